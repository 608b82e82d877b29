// Fuzzes EmitPtx as the server runs it on a client's request: the input is a serialized
// v1::EmitPtxRequest (kernel, hidden_dim, dtype, target, ptx_version, cubin, and the batch's
// targets and dtypes, resource_usage) handed to
// server::PtxService::Emit, which looks the kernel up, parses target and PTX version, asks the
// kernel's CanImplement, then builds the module (kernels' PTX builder), verifies it (the
// Verifier) and prints it, through the ModuleCache the server uses. nvJitLink is not loaded
// (an uninstrumented 99 MB library would dominate the run): cubin requests must get
// FAILED_PRECONDITION.
// Contract: an error is INVALID_ARGUMENT with a message (FAILED_PRECONDITION only for cubin,
// RESOURCE_EXHAUSTED only above kMaxEmitPtxConfigurations); an answer has one artifact per
// configuration (targets x dtypes), each carrying the requested entry, PTX whose sha256 and size
// are the digest's, a `.target` and `.version` matching its fields, a minimum CUDA driver, no
// resource usage but the reason (no nvJitLink) when asked, PTX the interpreter's parser
// accepts; a single-configuration answer repeats its artifact in the top-level fields; the same
// request again (a cache hit) gives the same bytes.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/stubs/logging.h"
#include "normgrad/v1/normgrad.pb.h"
#include "server/ptx/ptx_service.h"
#include "base/sha256.h"
#include "tests/ptxsim/sim/parser.h"

namespace {

normgrad::server::PtxService& Service() {
  static normgrad::server::PtxService* service = [] {
    normgrad::server::PtxServiceOptions options;
    options.cache.max_entries = 16;  // small, so eviction runs too
    options.cache.max_bytes = 8ull << 20;
    options.nvjitlink_path = "/nonexistent/libnvJitLink.so.13";
    return new normgrad::server::PtxService(options);
  }();
  return *service;
}

void Check(bool ok) {
  if (!ok) std::abort();
}

}  // namespace

// protobuf logs every string field with invalid UTF-8 it refuses (most random inputs); the
// refusal is the parse result, the log line only noise.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  normgrad::v1::EmitPtxRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  // Large dimensions are legal, but each costs a build; the server's own bound is
  // --max-hidden-dim (65536 by default).
  if (request.hidden_dim() > 65536) request.set_hidden_dim(request.hidden_dim() % 65537);

  absl::StatusOr<normgrad::v1::EmitPtxResponse> r = Service().Emit(request);
  if (!r.ok()) {
    Check(!r.status().message().empty());
    Check(r.status().code() == absl::StatusCode::kInvalidArgument ||
          (request.cubin() && r.status().code() == absl::StatusCode::kFailedPrecondition) ||
          (r.status().code() == absl::StatusCode::kResourceExhausted &&
           static_cast<uint64_t>(std::max(1, request.targets_size())) *
                   std::max(1, request.dtypes_size()) >
               normgrad::server::kMaxEmitPtxConfigurations));
    return 0;
  }
  Check(!request.cubin());  // no nvJitLink here
  const bool batch = request.targets_size() > 0 || request.dtypes_size() > 0;
  const int configurations =
      std::max(1, request.targets_size()) * std::max(1, request.dtypes_size());
  Check(r->artifacts_size() == configurations);
  for (const normgrad::v1::EmitPtxArtifact& a : r->artifacts()) {
    Check(a.entry() == request.kernel());
    Check(!a.ptx().empty() && a.cubin().empty());
    Check(a.digest().sha256() == normgrad::base::Sha256Hex(a.ptx()));
    Check(a.digest().size_bytes() == a.ptx().size());
    Check(absl::StrContains(a.ptx(), absl::StrCat(".target ", a.target())));
    Check(absl::StrContains(a.ptx(), absl::StrCat(".version ", a.ptx_version())));
    Check(absl::StrContains(a.ptx(), absl::StrCat(".entry ", a.entry())));
    Check(!a.config_key().empty() && !a.min_cuda_driver().empty());
    Check(!a.has_resource_usage());
    Check(a.resource_usage_unknown().empty() != request.resource_usage());
    Check(normgrad::ptxsim::ParsePtx(a.ptx()).ok());
  }
  if (batch) {
    Check(r->ptx().empty());
  } else {
    Check(r->ptx() == r->artifacts(0).ptx() && r->entry() == r->artifacts(0).entry() &&
          r->target() == r->artifacts(0).target());
  }

  absl::StatusOr<normgrad::v1::EmitPtxResponse> again = Service().Emit(request);
  Check(again.ok() && again->SerializeAsString() == r->SerializeAsString());
  return 0;
}
