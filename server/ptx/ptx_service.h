// EmitPtx without gRPC: FindKernel + CanImplement + Emit, a sha256 digest and size for the PTX
// (and the cubin when asked, compiled with nvJitLink), results cached by the kernel's ConfigKey
// in a ModuleCache (bounded LRU, single-flight: N concurrent identical requests compile once).
//
//   PtxService ptx({.cache = {...}, .nvjitlink_path = ""});
//   absl::StatusOr<v1::EmitPtxResponse> r = ptx.Emit(request);
//
// Thread-safe. Emit blocks while compiling: call it from a worker thread, never a reaction.
#ifndef NORMGRAD_SERVER_PTX_PTX_SERVICE_H_
#define NORMGRAD_SERVER_PTX_PTX_SERVICE_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "normgrad/v1/normgrad.pb.h"
#include "server/cache/module_cache.h"
#include "server/cuda/nvjitlink.h"

namespace normgrad::server {

struct PtxServiceOptions {
  ModuleCacheOptions cache;
  std::string nvjitlink_path;  // empty: NvJitLink's default search
};

class PtxService {
 public:
  explicit PtxService(const PtxServiceOptions& options);

  // INVALID_ARGUMENT for an unknown kernel, dtype, target or PTX version, or what the kernel's
  // CanImplement/Emit say; FAILED_PRECONDITION for cubin=true without nvJitLink.
  absl::StatusOr<v1::EmitPtxResponse> Emit(const v1::EmitPtxRequest& request);

  ModuleCacheStats CacheStats() const { return cache_.Stats(); }
  bool has_nvjitlink() const { return nvjitlink_.ok(); }

 private:
  ModuleCache<v1::EmitPtxResponse> cache_;
  absl::StatusOr<std::unique_ptr<NvJitLink>> nvjitlink_;
};

}  // namespace normgrad::server

#endif  // NORMGRAD_SERVER_PTX_PTX_SERVICE_H_
