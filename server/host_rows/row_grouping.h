// How host_rows groups rows (two or four at a time) and when it streams dx, from this machine's
// L1 data cache: the measured tuning of docs/backends.md ("CPU backend"), in one place.
#pragma once

#include <cstddef>

namespace normgrad::server::host_rows {

// Rows go four at a time when they have at most FourRowsMaxElements() elements, else two at a
// time. Four rows keep the per-group costs (reductions, the grad_gamma load and store) small and
// prefetch further ahead, but four rows whose stride is near a multiple of 4 KiB put a dozen
// streams (x, dy and dx of each row) on the same L1 sets. On an earlier machine four wide rows
// measured slower in cache (4096 elements: 27 -> 20 GB/s); on a 12-way L1 they did not (34-37
// GB/s either way) and were faster in memory (4096 x 4096: 5.2 -> 4.3 ms). So: every width where
// the L1 data cache has at least kWaysForFourWideRows ways (a dozen streams fit a set), else up
// to kFourRowsMaxElementsFewWays, also where the ways are unknown (docs/backends.md).
inline constexpr int kWaysForFourWideRows = 12;
inline constexpr size_t kFourRowsMaxElementsFewWays = 2048;
size_t FourRowsMaxElementsWithL1Ways(int l1_ways);
size_t FourRowsMaxElements();  // for this machine's L1DataCacheWays(), computed once

// Rows that alias. When two rows of a group start within kAliasBytes of each other modulo 4 KiB
// (f32 rows of 1000, 1016, 1024, 1536, 2048, 3072, 4096 ... elements), pass 2 loads their x and dy
// and stores their dx at the same low 12 address bits, on the same L1 sets. On a CPU with an 8-way
// L1 (Zen 3, AVX2) streamed dx then ran at 1.8 - 5.7 GB/s (9.7 at 1000) against 9.4 - 16.4 GB/s
// with ordinary stores, and four such rows at a time were slower than two (of copy: 1024 0.55
// against 0.69, 2048 0.58 against 0.76); on one with a 12-way L1 (Zen 5) those widths streamed
// faster than they stored (4096 x 4096: 4.3 against 5.7 ms), four rows at a time included.
// Rows that do not alias streamed well on both.
// So where the L1 data cache has fewer than kWaysForFourWideRows ways, or unknown ways, a group
// whose rows alias writes dx with ordinary stores, and goes two rows at a time, not four
// (docs/backends.md; figures in docs/benchmarks.md).
inline constexpr size_t kAliasBytes = 128;
// Whether `group_rows` consecutive rows of `row_bytes` each put two rows' starts within
// kAliasBytes of each other modulo 4 KiB.
bool GroupRowsAlias(size_t row_bytes, size_t group_rows);
bool ToleratesAliasedRowsFor(int l1_ways);
bool ToleratesAliasedRows();  // for this machine's L1DataCacheWays(), computed once

// The L1 data cache's associativity: sysconf, else the kernel's cache description in sysfs; 0
// when neither says.
int L1DataCacheWays();

// How many rows both of host_rows' paths put in a group of rows of `hidden_dim` elements of
// `element_bytes` (without streaming stores): four, or two (the rules above).
size_t RowsPerGroup(size_t hidden_dim, size_t element_bytes);

}  // namespace normgrad::server::host_rows
