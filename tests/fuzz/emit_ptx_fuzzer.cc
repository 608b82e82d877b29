// Fuzzes EmitPtx as the server runs it on a client's request: the input is a serialized
// v1::EmitPtxRequest (kernel, hidden_dim, dtype, target, ptx_version, cubin) handed to
// server::PtxService::Emit, which looks the kernel up, parses target and PTX version, asks the
// kernel's CanImplement, then builds the module (kernels' PTX builder), verifies it (the
// Verifier) and prints it, through the ModuleCache the server uses. nvJitLink is not loaded
// (an uninstrumented 99 MB library would dominate the run): cubin requests must get
// FAILED_PRECONDITION.
// Contract: an error is INVALID_ARGUMENT with a message (FAILED_PRECONDITION only for cubin);
// an answer carries the requested entry, PTX whose sha256 and size are the digest's, a
// `.target` and `.version` matching the response's fields, that the PTX interpreter's parser
// accepts; the same request again (a cache hit) gives the same bytes.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/stubs/logging.h"
#include "normgrad/v1/normgrad.pb.h"
#include "server/ptx/ptx_service.h"
#include "server/ptx/sha256.h"
#include "tests/ptxsim/parser.h"

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
          (request.cubin() && r.status().code() == absl::StatusCode::kFailedPrecondition));
    return 0;
  }
  Check(!request.cubin());  // no nvJitLink here
  Check(r->entry() == request.kernel());
  Check(!r->ptx().empty() && r->cubin().empty());
  Check(r->digest().sha256() == normgrad::server::Sha256Hex(r->ptx()));
  Check(r->digest().size_bytes() == r->ptx().size());
  Check(absl::StrContains(r->ptx(), absl::StrCat(".target ", r->target())));
  Check(absl::StrContains(r->ptx(), absl::StrCat(".version ", r->ptx_version())));
  Check(absl::StrContains(r->ptx(), absl::StrCat(".entry ", r->entry())));
  Check(!r->config_key().empty());
  Check(normgrad::ptxsim::ParsePtx(r->ptx()).ok());

  absl::StatusOr<normgrad::v1::EmitPtxResponse> again = Service().Emit(request);
  Check(again.ok() && again->SerializeAsString() == r->SerializeAsString());
  return 0;
}
