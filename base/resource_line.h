// The one-line report of what a kernel configuration costs on the device, printed the same way by
// the offline emitter (normgrad-ptx --resource-usage) and by the CLI (normgrad emit-ptx
// --resource-usage), so that scripts can read either:
//   "ENTRY dtype=f32 target=sm_90 ptx_version=7.8 min_cuda_driver=11.8 registers=72
//    spill_store_bytes=0 spill_load_bytes=0 shared_memory_bytes=64 local_memory_bytes=0
//    barriers=1"
// or "... min_cuda_driver=11.8 resources=unknown (WHY)" when they could not be measured.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace normgrad::base {

// The counts' part: "registers=R spill_store_bytes=S ... barriers=B".
std::string ResourceCounts(uint64_t registers, uint64_t spill_store_bytes,
                           uint64_t spill_load_bytes, uint64_t shared_memory_bytes,
                           uint64_t local_memory_bytes, uint64_t barriers);

// `target` as "sm_90"; `counts` (ResourceCounts) not ok: "resources=unknown (<its message>)".
std::string ResourceLine(absl::string_view entry, absl::string_view dtype,
                         absl::string_view target, absl::string_view ptx_version,
                         absl::string_view min_cuda_driver, const absl::StatusOr<std::string>& counts);

}  // namespace normgrad::base
