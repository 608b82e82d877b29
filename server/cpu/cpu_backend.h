// The CPU backend: multi-threaded over row partitions (a ThreadPool), each partition's rows
// through host_rows (Google Highway, the best SIMD target of the machine, picked at run time).
// The default when no usable GPU is found.
//
//   std::unique_ptr<Backend> cpu = NewCpuBackend({.threads = 4});
//
// Accuracy: dx and grad_gamma are computed in double from the inputs and rounded once, so
// they agree with kernels::ReferenceBackward to within an ulp or two of the output type.
//
// Determinism: the rows of a chunk are cut into partitions by a rule that depends only on the
// chunk's shape (rows, hidden_dim), never on the thread count or on timing; each partition
// sums its rows' grad_gamma in row order into its own double buffer, and the buffers are added
// into the batch's accumulator in partition order, chunk after chunk. Same input and chunking
// therefore give the same bits whatever the thread count. (On another machine Highway may pick
// a different vector width, which changes the order of each row's two sums: bits may then
// differ in the last place.)
//
// dtypes: f32, bf16 and f16 read and written where they lie, bf16/f16 converted in registers
// (exactly, and rounded back as staging through f32 would). Staged as f32 a few rows at a time
// (kStagingElements): buffers not aligned to their element, and the casting modes llama and none
// on bf16/f16.
//
// Variants (kernels::NormVariant, every one): the scale gamma_offset + gamma is formed once per
// batch in f32; without gamma it is 1 and no grad_gamma is accumulated; the casting modes llama
// and none round where host_rows::RowBlock says. dx may be written over dy (in place).
#pragma once

#include <cstdint>
#include <memory>

#include "server/backend/backend.h"

namespace normgrad::server {

struct CpuBackendOptions {
  int threads = 0;  // 0: std::thread::hardware_concurrency()
};

std::unique_ptr<Backend> NewCpuBackend(const CpuBackendOptions& options);

namespace cpu_internal {

// Rows per partition for a chunk of `rows` x `hidden_dim`: at most kMaxPartitions
// partitions, each of at least kMinPartitionElements elements and kMinPartitionRows rows (or the
// whole chunk). Shape only. The row bound keeps the partitions' grad_gamma partials (hidden_dim
// doubles each, zeroed, then read once more to sum them) at most 1/48 of the bytes the
// partition moves, and makes a partition at least 16 groups of four rows: a partition's first
// group is the one that nothing prefetched, and with 16-row partitions (4 groups) that cost
// 1024 x 16384 f32 a fifth of its speed (6.2 - 6.8 ms against 5.2 - 5.7 ms with 64 rows).
inline constexpr uint64_t kMaxPartitions = 64;
inline constexpr uint64_t kMinPartitionElements = 131072;
inline constexpr uint64_t kMinPartitionRows = 64;
uint64_t RowsPerPartition(uint64_t rows, uint32_t hidden_dim);

// dx of a chunk at least this large is written with non-temporal stores.
inline constexpr uint64_t kStreamDxBytes = 8ull << 20;

// Staged rows (misaligned buffers; llama/none on bf16/f16) are converted to f32 at most
// StagingRows(hidden_dim) rows at a time per thread: kStagingElements elements, or one row when
// rows are wider. A thread then holds at most 12 x max(kStagingElements, hidden_dim) bytes of f32
// copies (x, dy and dx), whatever the chunk's size (docs/operations.md, "Memory and overload");
// it keeps them for the next chunk when they are at most 4 MiB.
inline constexpr uint64_t kStagingElements = 16384;
uint64_t StagingRows(uint32_t hidden_dim);

}  // namespace cpu_internal
}  // namespace normgrad::server
