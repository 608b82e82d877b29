#include "server/cpu/cpu_backend.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/rmsnorm/kernel_choice.h"
#include "server/backend/backward_session_base.h"
#include "server/backend/batch_checks.h"
#include "server/host_rows/element_conversion.h"
#include "server/host_rows/host_rows.h"
#include "server/host_rows/simd_target.h"
#include "server/thread_pool/thread_pool.h"

namespace normgrad::server {
namespace cpu_internal {

uint64_t RowsPerPartition(uint64_t rows, uint32_t hidden_dim) {
  const uint64_t by_count = (rows + kMaxPartitions - 1) / kMaxPartitions;
  const uint64_t by_size =
      (kMinPartitionElements + hidden_dim - 1) / std::max<uint32_t>(hidden_dim, 1);
  return std::max<uint64_t>({by_count, by_size, kMinPartitionRows});
}

uint64_t StagingRows(uint32_t hidden_dim) {
  return std::max<uint64_t>(1, kStagingElements / std::max<uint32_t>(hidden_dim, 1));
}

}  // namespace cpu_internal

namespace {

using backend_internal::ElementBytes;
using kernels::DType;

// Buffers of doubles that ended sessions leave for the next ones. A session's buffers (gamma in
// double, grad_gamma, the partitions' partials: up to 66 x hidden_dim doubles) would otherwise be
// fresh pages at every batch; a page fault costs about 10 us on the VMs we measured, and at
// hidden_dim 65536 the faults of 32 MiB of partials took 15x longer than the batch's compute.
// Thread-safe.
class DoubleBufferPool {
 public:
  std::vector<double> Take() {
    std::lock_guard<std::mutex> lock(mu_);
    if (free_.empty()) return {};
    std::vector<double> v = std::move(free_.back());
    free_.pop_back();
    return v;
  }

  // Kept if the pool holds fewer than kMaxKept buffers and this one is at most kMaxKeptBytes.
  void Give(std::vector<double> v) {
    if (v.capacity() * sizeof(double) > kMaxKeptBytes) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (free_.size() < kMaxKept) free_.push_back(std::move(v));
  }

 private:
  // One session's three: a batch after a batch starts without faults, and an idle server keeps
  // at most 96 MiB here (hidden_dim 65536: 64 partitions' partials are 32 MiB).
  static constexpr size_t kMaxKept = 3;
  static constexpr size_t kMaxKeptBytes = 32ull << 20;

  std::mutex mu_;
  std::vector<std::vector<double>> free_;  // guarded by mu_
};

// A thread's f32 copies of staged rows (x, dy, dx), kept between chunks: allocated for each
// partition (192 KiB, above malloc's mmap threshold) they page-faulted at every partition and
// made bf16/f16 several times slower than f32. Released when above
// kMaxKeptStagingBytes, so a thread keeps at most that much after the call.
constexpr size_t kMaxKeptStagingBytes = 4ull << 20;
thread_local std::vector<float> staging_per_thread;

class CpuBackwardSession : public backend_internal::BackwardSessionBase {
 public:
  // `gamma_f64` holds the batch's gamma as double; the three buffers come from and go back to
  // `buffers`.
  CpuBackwardSession(const kernels::BackwardRequest& spec, std::vector<double> gamma_f64, ThreadPool* pool,
                     DoubleBufferPool* buffers)
      : BackwardSessionBase(spec, buffers->Take()),
        gamma_f64_(std::move(gamma_f64)),
        pool_(pool),
        buffers_(buffers),
        reads_rms_(kernels::ReadsGivenRms(spec)),
        partials_(buffers->Take()) {
    // bf16/f16 rows are computed in f32 (host_rows' half_rows.h): the scale as f32 (exact: it
    // was formed in f32) and its largest magnitude, once per batch.
    if (spec.dtype != DType::kF32) {
      gamma_f32_.assign(gamma_f64_.begin(), gamma_f64_.end());
      gamma_max_abs_ = host_rows::MaxAbsScale(gamma_f32_.data(), gamma_f32_.size());
    }
  }

  ~CpuBackwardSession() override {
    buffers_->Give(std::move(gamma_f64_));
    buffers_->Give(std::move(dgamma_sum_));
    buffers_->Give(std::move(partials_));
  }

  absl::Status ProcessChunk(absl::Span<const uint8_t> x, absl::Span<const uint8_t> dy,
                            absl::Span<const float> rms, uint64_t rows,
                            absl::Span<uint8_t> dx) override {
    NORMGRAD_RETURN_IF_ERROR(
        backend_internal::CheckChunk(spec_, rows_done_, rows, x.size(), dy.size(), rms, dx.size()));
    return Compute(rows, [&] { return ComputeChunk(x, dy, rms, rows, dx); });
  }

  absl::string_view KernelName() const override { return "cpu_highway"; }

 private:
  static bool IsAligned(const void* p, size_t bytes) {
    return reinterpret_cast<uintptr_t>(p) % bytes == 0;
  }

  absl::Status ComputeChunk(absl::Span<const uint8_t> x, absl::Span<const uint8_t> dy,
                            absl::Span<const float> rms, uint64_t rows, absl::Span<uint8_t> dx) {
    const size_t h = spec_.hidden_dim;
    const uint64_t rows_per_part = cpu_internal::RowsPerPartition(rows, spec_.hidden_dim);
    const size_t parts = (rows + rows_per_part - 1) / rows_per_part;
    partials_.resize(parts * h);
    // Buffers aligned to their element are used as they are (bf16/f16 converted in registers),
    // except for the casting modes that round (llama, none on bf16/f16), which run on rows
    // staged as f32; anything misaligned is staged too (copied aligned, in its dtype). dx may be
    // dy (in place): host_rows reads a dy element before it writes that dx element, and a staged
    // tile's dy is read before its dx is written back.
    const size_t elem_bytes = ElementBytes(spec_.dtype);
    const bool rounds =
        spec_.dtype != DType::kF32 && spec_.variant.casting != kernels::CastingMode::kGemma;
    const bool direct = !rounds && IsAligned(x.data(), elem_bytes) &&
                        IsAligned(dy.data(), elem_bytes) && IsAligned(dx.data(), elem_bytes);
    // Chunks far larger than the caches: dx goes straight to memory (see RowBlock).
    const bool stream_dx = direct && dx.size() >= cpu_internal::kStreamDxBytes;
    const bool has_gamma = spec_.variant.has_gamma;

    pool_->ParallelFor(parts, [&](size_t p) {
      const uint64_t first = p * rows_per_part;
      const size_t n = std::min<uint64_t>(rows_per_part, rows - first);
      const size_t offset = first * h;  // elements
      double* partial = partials_.data() + p * h;
      if (has_gamma) std::fill(partial, partial + h, 0.0);
      host_rows::RowBlock block;
      block.gamma_f64 = gamma_f64_.data();
      block.gamma = gamma_f32_.empty() ? nullptr : gamma_f32_.data();
      block.gamma_max_abs = gamma_max_abs_;
      block.rms = reads_rms_ ? rms.data() + first : nullptr;
      block.dgamma = has_gamma ? partial : nullptr;
      block.num_rows = n;
      block.hidden_dim = h;
      block.eps = spec_.eps;
      block.stream_dx = stream_dx;
      block.casting = spec_.variant.casting;
      block.element = spec_.dtype;
      if (direct) {
        block.x = x.data() + offset * elem_bytes;
        block.dy = dy.data() + offset * elem_bytes;
        block.dx = dx.data() + offset * elem_bytes;
        block.storage = spec_.dtype;
        host_rows::BackwardRows(block);
        return;
      }
      // Staged a few rows at a time (cpu_internal::StagingRows): the copies a thread holds do
      // not grow with the chunk. Rows are independent and grad_gamma is added row by row, so the
      // bits are those of staging the partition whole. Misaligned rows are copied as they are
      // (aligned, in their dtype: the same arithmetic as aligned ones, so the same bits); the
      // rounding casting modes' rows as f32.
      const size_t tile = std::min<size_t>(n, cpu_internal::StagingRows(spec_.hidden_dim));
      std::vector<float>& staged = staging_per_thread;
      if (staged.size() < 3 * tile * h) staged.resize(3 * tile * h);
      float* sx = staged.data();
      float* sdy = sx + tile * h;
      float* sdx = sdy + tile * h;
      if (!rounds) block.storage = spec_.dtype;
      for (size_t done = 0; done < n; done += tile) {
        const size_t m = std::min(tile, n - done);
        const size_t at = (offset + done * h) * elem_bytes;
        if (rounds) {
          host_rows::ConvertToF32(spec_.dtype, x.data() + at, sx, m * h);
          host_rows::ConvertToF32(spec_.dtype, dy.data() + at, sdy, m * h);
        } else {
          std::memcpy(sx, x.data() + at, m * h * elem_bytes);
          std::memcpy(sdy, dy.data() + at, m * h * elem_bytes);
        }
        block.x = sx;
        block.dy = sdy;
        block.dx = sdx;
        block.rms = reads_rms_ ? rms.data() + first + done : nullptr;
        block.num_rows = m;
        host_rows::BackwardRows(block);
        if (rounds) {
          host_rows::ConvertFromF32(spec_.dtype, sdx, dx.data() + at, m * h);
        } else {
          std::memcpy(dx.data() + at, sdx, m * h * elem_bytes);
        }
      }
      if (staged.capacity() * sizeof(float) > kMaxKeptStagingBytes) {
        std::vector<float>().swap(staged);
      }
    });

    // Fixed order: partition 0, 1, ... into the batch's accumulator.
    for (size_t p = 0; has_gamma && p < parts; ++p) {
      const double* partial = partials_.data() + p * h;
      for (size_t i = 0; i < h; ++i) dgamma_sum_[i] += partial[i];
    }
    return absl::OkStatus();
  }

  std::vector<double> gamma_f64_;  // the scale, formed once per batch instead of per partition
  std::vector<float> gamma_f32_;   // the scale as f32, for bf16/f16 (else empty)
  double gamma_max_abs_ = -1;      // max |scale| for bf16/f16 (RowBlock::gamma_max_abs)
  ThreadPool* const pool_;
  DoubleBufferPool* const buffers_;
  const bool reads_rms_;  // the forward's rms is read (kernels::ReadsGivenRms), else recomputed
  std::vector<double> partials_;  // per partition of the current chunk
};

class CpuBackend : public Backend {
 public:
  // The thread that calls ProcessChunk is one of `threads`: the pool has threads - 1 workers.
  explicit CpuBackend(int threads) : threads_(threads), pool_(threads - 1) {}

  absl::string_view Name() const override { return "cpu"; }

  DeviceDescription Device() const override {
    DeviceDescription d;
    d.name = absl::StrCat("cpu: ", threads_, " threads, ", host_rows::SimdTargetName());
    const long pages = sysconf(_SC_PHYS_PAGES);
    const long page_size = sysconf(_SC_PAGESIZE);
    if (pages > 0 && page_size > 0) {
      d.total_memory_bytes = static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_size);
    }
    d.sm_count = static_cast<uint32_t>(threads_);
    return d;
  }

  absl::StatusOr<std::unique_ptr<BackwardSession>> StartBackward(
      const kernels::BackwardRequest& spec, absl::Span<const uint8_t> gamma) override {
    NORMGRAD_RETURN_IF_ERROR(backend_internal::CheckBatch(spec, gamma.size()));
    // A named kernel is honoured for its validity rules (the CPU computes the same math).
    NORMGRAD_RETURN_IF_ERROR(kernels::CheckNamedKernel(spec));
    // The scale (kernels::NormVariant): gamma as f32 a piece at a time (no buffer of hidden_dim
    // floats), plus the offset in one f32 add, then as double; 1 without gamma.
    std::vector<double> gamma_f64 = buffers_.Take();
    if (!spec.variant.has_gamma) {
      gamma_f64.assign(spec.hidden_dim, 1.0);
      return std::unique_ptr<BackwardSession>(
          new CpuBackwardSession(spec, std::move(gamma_f64), &pool_, &buffers_));
    }
    gamma_f64.resize(spec.hidden_dim);
    const size_t elem_bytes = ElementBytes(spec.dtype);
    const float offset = spec.variant.gamma_offset;
    float piece[1024];
    for (size_t i = 0; i < spec.hidden_dim; i += 1024) {
      const size_t n = std::min<size_t>(1024, spec.hidden_dim - i);
      host_rows::ConvertToF32(spec.dtype, gamma.data() + i * elem_bytes, piece, n);
      if (offset != 0.0f) {
        for (size_t k = 0; k < n; ++k) piece[k] = offset + piece[k];
      }
      std::copy(piece, piece + n, gamma_f64.begin() + i);
    }
    return std::unique_ptr<BackwardSession>(
        new CpuBackwardSession(spec, std::move(gamma_f64), &pool_, &buffers_));
  }

  absl::Status Preload(const kernels::BackwardKernel&, const kernels::KernelConfig&) override {
    return absl::OkStatus();
  }

  ModuleCacheStats CacheStats() const override { return ModuleCacheStats{}; }

 private:
  const int threads_;
  mutable ThreadPool pool_;
  DoubleBufferPool buffers_;  // outlives the sessions, like pool_
};

}  // namespace

std::unique_ptr<Backend> NewCpuBackend(const CpuBackendOptions& options) {
  int threads = options.threads;
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::make_unique<CpuBackend>(threads);
}

}  // namespace normgrad::server
