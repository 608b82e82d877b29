// EmitPtx without gRPC: FindKernel + CanImplement + Emit, a sha256 digest and size for the PTX
// (and the cubin when asked, compiled with nvJitLink, with the assembler's resource report),
// results cached by the kernel's ConfigKey in a ModuleCache (bounded LRU, single-flight: N
// concurrent identical requests compile once). A request names one configuration or a batch
// (targets x dtypes); a batch is checked whole before anything is emitted, and fails whole.
//
//   PtxService ptx({.cache = {...}, .nvjitlink_path = ""});
//   absl::StatusOr<v1::EmitPtxResponse> r = ptx.Emit(request);  // r->artifacts(): one per config
//
// Thread-safe. Emit blocks while compiling: call it from a worker thread, never a reaction.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "normgrad/v1/normgrad.pb.h"
#include "server/cache/module_cache.h"
#include "nvidia/nvjitlink.h"

namespace normgrad::server {

// Configurations (targets x dtypes) one EmitPtx request may name. Every supported target for one
// dtype (11), or the 10 targets that have bf16 for all three dtypes (30), fit. The largest
// artifact (row-resident, hidden_dim 16384, PTX + cubin) is about 114 KB, so 32 of them stay
// under gRPC's default 4 MiB receive limit of clients; each may also take an nvJitLink compile
// (0.2-0.7 s of one core), so this bounds one request's work too.
inline constexpr uint64_t kMaxEmitPtxConfigurations = 32;

struct PtxServiceOptions {
  ModuleCacheOptions cache;
  std::string nvjitlink_path;  // empty: NvJitLink's default search
};

class PtxService {
 public:
  explicit PtxService(const PtxServiceOptions& options);

  // INVALID_ARGUMENT for an unknown kernel, dtype, target or PTX version, a repeated target or
  // dtype, both `target` and `targets` (or `dtype` and `dtypes`) set, or what the kernel's
  // CanImplement/Emit say; in a batch the message names the item (`targets[2] "sm_13": ...`,
  // `configuration 3 (sm_90, bf16): ...`). RESOURCE_EXHAUSTED for more than
  // kMaxEmitPtxConfigurations configurations. FAILED_PRECONDITION for cubin=true without
  // nvJitLink. resource_usage=true without nvJitLink is not an error: each artifact says why its
  // resources are unknown.
  absl::StatusOr<v1::EmitPtxResponse> Emit(const v1::EmitPtxRequest& request);

  ModuleCacheStats CacheStats() const { return cache_.Stats(); }
  bool has_nvjitlink() const { return nvjitlink_.ok(); }

 private:
  struct Configuration;
  absl::StatusOr<v1::EmitPtxArtifact> EmitOne(const Configuration& c, bool cubin,
                                              bool resource_usage);

  ModuleCache<v1::EmitPtxArtifact> cache_;
  absl::StatusOr<std::unique_ptr<NvJitLink>> nvjitlink_;
};

}  // namespace normgrad::server
