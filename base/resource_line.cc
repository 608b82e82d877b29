#include "base/resource_line.h"

#include "absl/strings/str_cat.h"

namespace normgrad::base {

std::string ResourceLine(absl::string_view entry, absl::string_view dtype,
                         absl::string_view target, absl::string_view ptx_version,
                         absl::string_view min_cuda_driver,
                         const absl::StatusOr<ResourceUsageCounts>& counts) {
  std::string line = absl::StrCat(entry, " dtype=", dtype, " target=", target,
                                  " ptx_version=", ptx_version, " min_cuda_driver=", min_cuda_driver);
  if (!counts.ok()) return absl::StrCat(line, " resources=unknown (", counts.status().message(), ")");
  const ResourceUsageCounts& c = *counts;
  return absl::StrCat(line, " registers=", c.registers, " spill_store_bytes=", c.spill_store_bytes,
                      " spill_load_bytes=", c.spill_load_bytes,
                      " shared_memory_bytes=", c.shared_memory_bytes,
                      " local_memory_bytes=", c.local_memory_bytes, " barriers=", c.barriers);
}

}  // namespace normgrad::base
