#include "base/resource_line.h"

#include "absl/strings/str_cat.h"

namespace normgrad::base {

std::string ResourceCounts(uint64_t registers, uint64_t spill_store_bytes,
                           uint64_t spill_load_bytes, uint64_t shared_memory_bytes,
                           uint64_t local_memory_bytes, uint64_t barriers) {
  return absl::StrCat("registers=", registers, " spill_store_bytes=", spill_store_bytes,
                      " spill_load_bytes=", spill_load_bytes,
                      " shared_memory_bytes=", shared_memory_bytes,
                      " local_memory_bytes=", local_memory_bytes, " barriers=", barriers);
}

std::string ResourceLine(absl::string_view entry, absl::string_view dtype,
                         absl::string_view target, absl::string_view ptx_version,
                         absl::string_view min_cuda_driver,
                         const absl::StatusOr<std::string>& counts) {
  std::string line = absl::StrCat(entry, " dtype=", dtype, " target=", target,
                                  " ptx_version=", ptx_version,
                                  " min_cuda_driver=", min_cuda_driver);
  if (counts.ok()) {
    absl::StrAppend(&line, " ", *counts);
  } else {
    absl::StrAppend(&line, " resources=unknown (", counts.status().message(), ")");
  }
  return line;
}

}  // namespace normgrad::base
