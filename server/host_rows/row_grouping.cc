#include "server/host_rows/row_grouping.h"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <string>

namespace normgrad::server::host_rows {

int L1DataCacheWays() {
  long ways = sysconf(_SC_LEVEL1_DCACHE_ASSOC);
  if (ways > 0) return static_cast<int>(ways);
  // cpu0's caches as the kernel describes them; index0..3 are L1d, L1i, L2, L3 on x86, but the
  // order is not promised, so each entry's level and type are read.
  for (int index = 0; index < 8; ++index) {
    const std::string dir =
        "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/";
    std::ifstream level(dir + "level"), type(dir + "type"), assoc(dir + "ways_of_associativity");
    int l = 0;
    std::string t;
    if (!(level >> l) || !(type >> t)) break;
    if (l == 1 && t == "Data" && (assoc >> ways) && ways > 0) return static_cast<int>(ways);
  }
  return 0;
}

size_t FourRowsMaxElementsWithL1Ways(int l1_ways) {
  return l1_ways >= kWaysForFourWideRows ? SIZE_MAX : kFourRowsMaxElementsFewWays;
}

size_t FourRowsMaxElements() {
  static const size_t max_elements = FourRowsMaxElementsWithL1Ways(L1DataCacheWays());
  return max_elements;
}

bool GroupRowsAlias(size_t row_bytes, size_t group_rows) {
  constexpr size_t kPage = 4096;
  for (size_t k = 1; k < group_rows; ++k) {
    const size_t offset = (k * row_bytes) % kPage;  // row k's start against row 0's
    if (std::min(offset, kPage - offset) < kAliasBytes) return true;
  }
  return false;
}

bool ToleratesAliasedRowsFor(int l1_ways) { return l1_ways >= kWaysForFourWideRows; }

bool ToleratesAliasedRows() {
  static const bool tolerates = ToleratesAliasedRowsFor(L1DataCacheWays());
  return tolerates;
}

size_t RowsPerGroup(size_t hidden_dim, size_t element_bytes) {
  if (hidden_dim > FourRowsMaxElements()) return 2;
  if (!ToleratesAliasedRows() && GroupRowsAlias(hidden_dim * element_bytes, 4)) return 2;
  return 4;
}

}  // namespace normgrad::server::host_rows
