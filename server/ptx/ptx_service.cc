#include "server/ptx/ptx_service.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/kernel.h"
#include "kernels/status_macros.h"
#include "server/proto_conversion/proto_conversion.h"
#include "server/ptx/sha256.h"

namespace normgrad::server {

PtxService::PtxService(const PtxServiceOptions& options)
    : cache_(options.cache), nvjitlink_(NvJitLink::Load(options.nvjitlink_path)) {}

absl::StatusOr<v1::EmitPtxResponse> PtxService::Emit(const v1::EmitPtxRequest& request) {
  NORMGRAD_ASSIGN_OR_RETURN(const kernels::Kernel* kernel, KernelNamed(request.kernel(), "kernel"));
  kernels::KernelConfig config;
  config.hidden_dim = request.hidden_dim();
  NORMGRAD_ASSIGN_OR_RETURN(config.dtype, DTypeFromProto(request.dtype(), "dtype"));
  if (!request.target().empty()) {
    // The parsers' errors name the field and quote the text (bounded: kernels/bounded_quote.h).
    NORMGRAD_ASSIGN_OR_RETURN(config.target_sm, kernels::ParseTarget(request.target()));
  }
  if (!request.ptx_version().empty()) {
    NORMGRAD_ASSIGN_OR_RETURN(config.ptx_version, kernels::ParsePtxVersion(request.ptx_version()));
  }
  NORMGRAD_RETURN_IF_ERROR(kernel->CanImplement(config));
  if (request.cubin() && !nvjitlink_.ok()) return nvjitlink_.status();

  const std::string ptx_key = kernel->ConfigKey(config);
  using Cache = ModuleCache<v1::EmitPtxResponse>;
  auto emit_ptx = [&]() -> absl::StatusOr<Cache::Compiled> {
    NORMGRAD_ASSIGN_OR_RETURN(const kernels::EmittedPtx emitted, kernel->Emit(config));
    auto response = std::make_shared<v1::EmitPtxResponse>();
    response->set_ptx(emitted.text);
    response->set_entry(emitted.entry);
    for (const kernels::KernelParam& p : emitted.params) {
      v1::KernelParameter* out = response->add_params();
      out->set_name(p.name);
      out->set_type(p.ptx_type);
    }
    response->mutable_digest()->set_sha256(Sha256Hex(emitted.text));
    response->mutable_digest()->set_size_bytes(emitted.text.size());
    response->set_ptx_version(emitted.version.ToString());
    response->set_target(absl::StrCat("sm_", emitted.target_sm));
    response->set_config_key(emitted.config_key);
    const uint64_t bytes = response->ByteSizeLong();
    return Cache::Compiled{std::move(response), bytes};
  };
  NORMGRAD_ASSIGN_OR_RETURN(const std::shared_ptr<const v1::EmitPtxResponse> ptx,
                            cache_.GetOrCompile(ptx_key, emit_ptx));
  if (!request.cubin()) return *ptx;

  // The cubin entry carries the PTX too, so a hit needs one lookup.
  const std::string cubin_key = absl::StrCat(ptx_key, "\ncubin");
  const NvJitLink& jit = **nvjitlink_;
  auto compile_cubin = [&]() -> absl::StatusOr<Cache::Compiled> {
    NORMGRAD_ASSIGN_OR_RETURN(std::string cubin, jit.Compile(ptx->ptx(), config.target_sm));
    auto response = std::make_shared<v1::EmitPtxResponse>(*ptx);
    response->mutable_cubin_digest()->set_sha256(Sha256Hex(cubin));
    response->mutable_cubin_digest()->set_size_bytes(cubin.size());
    response->set_cubin(std::move(cubin));
    const uint64_t bytes = response->ByteSizeLong();
    return Cache::Compiled{std::move(response), bytes};
  };
  NORMGRAD_ASSIGN_OR_RETURN(const std::shared_ptr<const v1::EmitPtxResponse> with_cubin,
                            cache_.GetOrCompile(cubin_key, compile_cubin));
  return *with_cubin;
}

}  // namespace normgrad::server
