// CPU backend throughput as a fraction of this machine's copy bandwidth measured in the same run
// with the same thread count: one shape (default 4096 x 4096 f32), or a sweep over hidden sizes.
//
//   bench_cpu_backend [--threads=N] [--rows=4096] [--hidden=4096] [--dtype=f32|bf16|f16]
//                     [--iterations=5] [--chunk_rows=C] [--dx_page_offset=B] [--simd=AVX2]
//   bench_cpu_backend --sweep [--sweep_mib=64] [--threads=N] [--iterations=5] [--dx_page_offset=B]
//                     [--simd=AVX2]
//
// Bytes moved by the backward: x and dy read, dx written (3 x the dtype's size per element).
// Bytes moved by the copy: a buffer of x's size read and written (2 x the dtype's size per
// element), split across the threads like the backend's work. The two alternate; best of
// --iterations for each, after one warm-up.
//
// --sweep: hidden 64 .. 65536 (the sizes models use, and 992 / 1000 / 1016, around an L1 cliff),
// rows = --sweep_mib MiB of x / (hidden x dtype size), for f32, bf16 and f16; one line per shape:
// dtype, hidden, rows, copy GB/s, backward GB/s, ratio. The buffers are allocated once for the
// largest shape, so the sweep measures no page faults.
//
// --dx_page_offset=B places dx so that it starts B bytes (below 4096) after x within a 4 KiB
// page. By default dx is allocated like x and dy, which on glibc puts all three at the same page
// offset; other offsets show the cost of loads of x/dy that match an earlier dx store in their
// low 12 bits. An offset that is not a multiple of the element size (1, say) leaves dx
// misaligned, which the backend stages as f32 a few rows at a time, the path bf16/f16 took for
// every chunk before they were converted in registers.
//
// --simd=AVX2 (or SSE4, ...): Highway dispatches to no better target than this one, to measure
// the code path of machines without AVX-512 on one that has it.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "kernels/kernel_config.h"
#include "server/backend/backend.h"
#include "server/cpu/cpu_backend.h"
#include "server/host_rows/element_conversion.h"
#include "server/host_rows/row_grouping.h"
#include "server/host_rows/simd_target.h"
#include "server/thread_pool/thread_pool.h"

ABSL_FLAG(int, threads, static_cast<int>(std::max(1u, std::thread::hardware_concurrency())),
          "worker threads (the backend's pool and the copy baseline's)");
ABSL_FLAG(uint64_t, rows, 4096, "rows of the single shape");
ABSL_FLAG(uint32_t, hidden, 4096, "hidden size of the single shape");
ABSL_FLAG(std::string, dtype, "f32", "f32, bf16 or f16");
ABSL_FLAG(int, iterations, 5, "timed runs of each side; the best counts");
ABSL_FLAG(uint64_t, chunk_rows, 0, "rows per chunk (0: the whole batch as one chunk)");
ABSL_FLAG(int, dx_page_offset, -1,
          "dx's byte offset in its page (-1: as allocated; not a multiple of the element size: "
          "staged through f32)");
ABSL_FLAG(bool, sweep, false,
          "every hidden size of the table and every dtype instead of one shape");
ABSL_FLAG(uint64_t, sweep_mib, 64, "MiB of x per sweep shape");
ABSL_FLAG(std::string, simd, "", "a Highway target to stop at (e.g. AVX2) instead of the best");

namespace {

using normgrad::kernels::DType;
using normgrad::server::Backend;
using normgrad::kernels::BackwardRequest;

double Seconds(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

struct Shape {
  uint64_t rows = 0;
  uint32_t hidden = 0;
  DType dtype = DType::kF32;
  uint64_t chunk_rows = 0;  // 0: the whole batch in one chunk
};

struct Timing {
  double copy_seconds = 1e30;      // best
  double backward_seconds = 1e30;  // best; negative on error (printed)
  double CopyGbps(uint64_t bytes) const { return 2.0 * bytes / copy_seconds / 1e9; }
  double BackwardGbps(uint64_t bytes) const { return 3.0 * bytes / backward_seconds / 1e9; }
};

// x, dy, dx and the copy's destination, each `capacity` bytes, allocated and touched once.
class Buffers {
 public:
  Buffers(uint64_t capacity, int dx_page_offset)
      : x_(capacity), dy_(capacity), dx_(capacity + 4096), copy_(capacity) {
    // Touch every page before timing (std::vector zero-fills).
    dx_at_ = dx_.data();
    if (dx_page_offset >= 0) {
      const uintptr_t want =
          (reinterpret_cast<uintptr_t>(x_.data()) + static_cast<uintptr_t>(dx_page_offset)) % 4096;
      const uintptr_t base = reinterpret_cast<uintptr_t>(dx_.data());
      dx_at_ = dx_.data() + (want - base % 4096 + 4096) % 4096;
    }
  }

  // Fills the whole of x and dy with `dtype` values (a fixed f32 pattern, rounded).
  void Prepare(DType dtype) {
    if (prepared_ && dtype == dtype_) return;
    const uint64_t n = x_.size() / static_cast<uint64_t>(normgrad::kernels::DTypeBytes(dtype));
    std::vector<float> f32(n);
    for (uint8_t* buffer : {x_.data(), dy_.data()}) {
      const uint64_t mul = buffer == x_.data() ? 2654435761u : 40503u;
      for (uint64_t i = 0; i < n; ++i) {
        f32[i] = static_cast<float>((i * mul) % 1000) / 500.0f - 1.0f;
      }
      normgrad::server::host_rows::ConvertFromF32(dtype, f32.data(), buffer, n);
    }
    prepared_ = true;
    dtype_ = dtype;
  }

  uint8_t* x() { return x_.data(); }
  uint8_t* dy() { return dy_.data(); }
  uint8_t* dx() { return dx_at_; }
  uint8_t* copy() { return copy_.data(); }

 private:
  std::vector<uint8_t> x_, dy_, dx_, copy_;
  uint8_t* dx_at_ = nullptr;
  bool prepared_ = false;
  DType dtype_ = DType::kF32;
};

// Copy and backward of `shape`, alternating; iteration 0 warms up.
Timing Measure(Backend& backend, normgrad::server::ThreadPool& pool, int threads, Buffers& buffers,
               const Shape& shape, int iterations) {
  const uint64_t elem = static_cast<uint64_t>(normgrad::kernels::DTypeBytes(shape.dtype));
  const uint64_t bytes = shape.rows * shape.hidden * elem;
  const uint64_t chunk_rows = shape.chunk_rows == 0 ? shape.rows : shape.chunk_rows;
  buffers.Prepare(shape.dtype);
  std::vector<float> gamma(shape.hidden);
  for (uint32_t i = 0; i < shape.hidden; ++i) gamma[i] = 1.0f + static_cast<float>(i % 7) / 10.0f;
  std::vector<uint8_t> gamma_bytes(shape.hidden * elem), dgamma(shape.hidden * elem);
  normgrad::server::host_rows::ConvertFromF32(shape.dtype, gamma.data(), gamma_bytes.data(),
                                              shape.hidden);

  // Copy bandwidth: each thread copies one contiguous slice.
  const uint64_t slice = (bytes + threads - 1) / threads;
  auto copy_once = [&] {
    const auto start = std::chrono::steady_clock::now();
    pool.ParallelFor(threads, [&](size_t t) {
      const uint64_t first = std::min<uint64_t>(bytes, t * slice);
      const uint64_t last = std::min<uint64_t>(bytes, first + slice);
      std::memcpy(buffers.copy() + first, buffers.x() + first, last - first);
    });
    return Seconds(start);
  };

  BackwardRequest spec;
  spec.num_rows = shape.rows;
  spec.hidden_dim = shape.hidden;
  spec.dtype = shape.dtype;
  // One whole batch (StartBackward .. Finish); negative on error (printed).
  auto backward_once = [&]() -> double {
    const auto start = std::chrono::steady_clock::now();
    auto session = backend.StartBackward(spec, gamma_bytes);
    if (!session.ok()) {
      std::fprintf(stderr, "StartBackward: %s\n", session.status().ToString().c_str());
      return -1;
    }
    for (uint64_t first = 0; first < shape.rows; first += chunk_rows) {
      const uint64_t r = std::min(chunk_rows, shape.rows - first);
      const uint64_t off = first * shape.hidden * elem;
      const uint64_t len = r * shape.hidden * elem;
      absl::Status s =
          (*session)->ProcessChunk(absl::Span<const uint8_t>(buffers.x() + off, len),
                                   absl::Span<const uint8_t>(buffers.dy() + off, len), {}, r,
                                   absl::Span<uint8_t>(buffers.dx() + off, len));
      if (!s.ok()) {
        std::fprintf(stderr, "ProcessChunk: %s\n", s.ToString().c_str());
        return -1;
      }
    }
    absl::Status s = (*session)->Finish(absl::MakeSpan(dgamma));
    if (!s.ok()) {
      std::fprintf(stderr, "Finish: %s\n", s.ToString().c_str());
      return -1;
    }
    return Seconds(start);
  };

  // Alternate the two so that both see the same machine state.
  Timing t;
  for (int it = 0; it <= iterations; ++it) {
    const double c = copy_once();
    const double b = backward_once();
    if (b < 0) {
      t.backward_seconds = -1;
      return t;
    }
    if (it > 0) {
      t.copy_seconds = std::min(t.copy_seconds, c);
      t.backward_seconds = std::min(t.backward_seconds, b);
    }
  }
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "bench_cpu_backend [--threads=N] [--rows=R] [--hidden=H] [--dtype=f32|bf16|f16] "
      "[--iterations=I] [--chunk_rows=C] [--dx_page_offset=B] [--simd=TARGET] | --sweep "
      "[--sweep_mib=64]");
  absl::ParseCommandLine(argc, argv);
  const int threads = absl::GetFlag(FLAGS_threads);
  Shape shape;
  shape.rows = absl::GetFlag(FLAGS_rows);
  shape.hidden = absl::GetFlag(FLAGS_hidden);
  shape.chunk_rows = absl::GetFlag(FLAGS_chunk_rows);
  const int iterations = absl::GetFlag(FLAGS_iterations);
  const int dx_page_offset = absl::GetFlag(FLAGS_dx_page_offset);
  const bool sweep = absl::GetFlag(FLAGS_sweep);
  const uint64_t sweep_mib = absl::GetFlag(FLAGS_sweep_mib);
  const std::string dtype_name = absl::GetFlag(FLAGS_dtype);
  const std::string simd = absl::GetFlag(FLAGS_simd);
  if (dx_page_offset >= 4096) {
    std::fprintf(stderr, "--dx_page_offset must be below 4096\n");
    return 2;
  }
  absl::StatusOr<DType> dtype = normgrad::kernels::ParseDType(dtype_name);
  if (!dtype.ok()) {
    std::fprintf(stderr, "--dtype: %s\n", dtype.status().ToString().c_str());
    return 2;
  }
  shape.dtype = *dtype;
  if (!simd.empty() && !normgrad::server::host_rows::LimitSimdTarget(simd)) {
    std::fprintf(stderr, "--simd=%s: not a Highway target this build dispatches to\n",
                 simd.c_str());
    return 2;
  }

  normgrad::server::ThreadPool pool(threads - 1);  // plus the thread that calls ParallelFor
  normgrad::server::CpuBackendOptions options;
  options.threads = threads;
  std::unique_ptr<Backend> backend = normgrad::server::NewCpuBackend(options);
  const size_t four_rows_max = normgrad::server::host_rows::FourRowsMaxElements();
  const std::string grouping = four_rows_max == SIZE_MAX
                                   ? std::string("at every width")
                                   : "up to " + std::to_string(four_rows_max) + " elements";
  std::printf("device: %s; L1d %d-way: rows four at a time %s; dx streamed%s\n",
              backend->Device().name.c_str(), normgrad::server::host_rows::L1DataCacheWays(),
              grouping.c_str(),
              normgrad::server::host_rows::ToleratesAliasedRows()
                  ? ""
                  : " (and rows four at a time) except where a group's rows alias modulo 4 KiB");

  if (sweep) {
    const uint64_t bytes = sweep_mib << 20;
    Buffers buffers(bytes, dx_page_offset);
    std::printf("sweep: %llu MiB of x per batch, one chunk, %d threads, best of %d%s\n",
                static_cast<unsigned long long>(sweep_mib), threads, iterations,
                dx_page_offset >= 0 ? ", dx moved (--dx_page_offset)" : "");
    std::printf("%-5s %7s %8s %10s %14s %6s\n", "dtype", "hidden", "rows", "copy GB/s",
                "backward GB/s", "ratio");
    double worst = 1e30;
    for (DType d : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (uint32_t hidden : {64u, 128u, 896u, 992u, 1000u, 1016u, 1024u, 2048u, 4096u, 5120u,
                              8192u, 16384u, 65536u}) {
        Shape s;
        s.hidden = hidden;
        s.dtype = d;
        s.rows = bytes / (hidden * static_cast<uint64_t>(normgrad::kernels::DTypeBytes(d)));
        const Timing t = Measure(*backend, pool, threads, buffers, s, iterations);
        if (t.backward_seconds < 0) return 1;
        const uint64_t x_bytes = s.rows * hidden * normgrad::kernels::DTypeBytes(d);
        const double ratio = t.BackwardGbps(x_bytes) / t.CopyGbps(x_bytes);
        worst = std::min(worst, ratio);
        std::printf("%-5s %7u %8llu %10.2f %14.2f %6.3f\n",
                    std::string(normgrad::kernels::DTypeName(d)).c_str(), hidden,
                    static_cast<unsigned long long>(s.rows), t.CopyGbps(x_bytes),
                    t.BackwardGbps(x_bytes), ratio);
        std::fflush(stdout);
      }
    }
    std::printf("lowest ratio backward/copy bandwidth: %.3f (target >= 0.80)\n", worst);
    return 0;
  }

  const uint64_t x_bytes =
      shape.rows * shape.hidden * static_cast<uint64_t>(normgrad::kernels::DTypeBytes(shape.dtype));
  Buffers buffers(x_bytes, dx_page_offset);
  const Timing t = Measure(*backend, pool, threads, buffers, shape, iterations);
  if (t.backward_seconds < 0) return 1;
  std::printf(
      "shape: %llu x %u %s, chunk %llu rows, %d threads, best of %d\n",
      static_cast<unsigned long long>(shape.rows), shape.hidden, dtype_name.c_str(),
      static_cast<unsigned long long>(shape.chunk_rows == 0 ? shape.rows : shape.chunk_rows),
      threads, iterations);
  if (dx_page_offset >= 0) std::printf("dx %d bytes after x within a 4 KiB page\n", dx_page_offset);
  std::printf("copy (memcpy, read+write):      %8.3f ms  %7.2f GB/s\n", t.copy_seconds * 1e3,
              t.CopyGbps(x_bytes));
  std::printf("backward (x,dy read; dx write): %8.3f ms  %7.2f GB/s\n", t.backward_seconds * 1e3,
              t.BackwardGbps(x_bytes));
  std::printf("ratio backward/copy bandwidth: %.3f (target >= 0.80)\n",
              t.BackwardGbps(x_bytes) / t.CopyGbps(x_bytes));
  return 0;
}
