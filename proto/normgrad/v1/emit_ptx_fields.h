// The fields an EmitPtxArtifact shares with the single-configuration fields of EmitPtxResponse
// (the response's own ptx, entry, ... that a one-configuration request also gets, and that a
// server without `artifacts` sends alone). Copied in either direction by the same function, so
// the server's and the client's views of them cannot drift apart.
#pragma once

namespace normgrad::v1 {

template <typename From, typename To>
void CopySingleConfigurationFields(const From& from, To& to) {
  to.set_ptx(from.ptx());
  to.set_entry(from.entry());
  *to.mutable_params() = from.params();
  *to.mutable_digest() = from.digest();
  to.set_ptx_version(from.ptx_version());
  to.set_target(from.target());
  to.set_config_key(from.config_key());
  if (from.has_cubin_digest()) {
    to.set_cubin(from.cubin());
    *to.mutable_cubin_digest() = from.cubin_digest();
  }
}

}  // namespace normgrad::v1
