// CPU backend throughput for a 4096 x 4096 f32 batch, as a fraction of this machine's copy
// bandwidth measured in the same run with the same thread count.
//
//   bench_cpu_backend [--threads=N] [--rows=4096] [--hidden=4096] [--iterations=5]
//                     [--chunk_rows=C] [--dx_page_offset=B]
//
// Bytes moved by the backward: x and dy read, dx written (12 bytes per element). Bytes moved by
// the copy: the same-sized buffer read and written (8 bytes per element), split across the
// threads like the backend's work. The two alternate; best of --iterations for each, after one
// warm-up.
//
// --dx_page_offset=B places dx so that it starts B bytes (a multiple of 4, below 4096) after x
// within a 4 KiB page. By default dx is allocated like x and dy, which on glibc puts all three
// at the same page offset; other offsets show the cost of loads of x/dy that match an earlier
// dx store in their low 12 bits.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "server/backend/backend.h"
#include "server/cpu/cpu_backend.h"
#include "server/thread_pool/thread_pool.h"

namespace {

using normgrad::server::Backend;
using normgrad::server::BackwardSession;
using normgrad::server::BatchSpec;

double Seconds(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

template <typename T>
bool ParseFlag(const char* arg, const char* name, T* out) {
  const std::string prefix = std::string("--") + name + "=";
  if (!absl::StartsWith(arg, prefix)) return false;
  if (!absl::SimpleAtoi(arg + prefix.size(), out)) {
    std::fprintf(stderr, "bad value in %s\n", arg);
    std::exit(2);
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  uint64_t rows = 4096;
  uint32_t hidden = 4096;
  int iterations = 5;
  uint64_t chunk_rows = 0;  // 0: the whole batch in one chunk
  int dx_page_offset = -1;  // -1: dx as allocated
  for (int i = 1; i < argc; ++i) {
    if (ParseFlag(argv[i], "threads", &threads) || ParseFlag(argv[i], "rows", &rows) ||
        ParseFlag(argv[i], "hidden", &hidden) || ParseFlag(argv[i], "iterations", &iterations) ||
        ParseFlag(argv[i], "chunk_rows", &chunk_rows) ||
        ParseFlag(argv[i], "dx_page_offset", &dx_page_offset)) {
      continue;
    }
    std::fprintf(stderr,
                 "usage: %s [--threads=N] [--rows=R] [--hidden=H] [--iterations=I] "
                 "[--chunk_rows=C] [--dx_page_offset=B]\n",
                 argv[0]);
    return 2;
  }
  if (chunk_rows == 0) chunk_rows = rows;
  if (dx_page_offset >= 4096 || (dx_page_offset >= 0 && dx_page_offset % 4 != 0)) {
    std::fprintf(stderr, "--dx_page_offset must be a multiple of 4 below 4096\n");
    return 2;
  }
  const uint64_t n = rows * hidden;
  std::vector<float> x(n), dy(n), dx(n), gamma(hidden), dgamma(hidden), copy(n);
  for (uint64_t i = 0; i < n; ++i) {
    x[i] = static_cast<float>((i * 2654435761u) % 1000) / 500.0f - 1.0f;
    dy[i] = static_cast<float>((i * 40503u) % 1000) / 500.0f - 1.0f;
  }
  for (uint32_t i = 0; i < hidden; ++i) gamma[i] = 1.0f + static_cast<float>(i % 7) / 10.0f;
  // dx_at: where dx starts (dx itself, or inside dx_moved at the requested page offset from x).
  std::vector<float> dx_moved(dx_page_offset < 0 ? 0 : n + 1024);
  float* dx_at = dx.data();
  if (dx_page_offset >= 0) {
    const uintptr_t want =
        (reinterpret_cast<uintptr_t>(x.data()) + static_cast<uintptr_t>(dx_page_offset)) % 4096;
    const uintptr_t base = reinterpret_cast<uintptr_t>(dx_moved.data());
    dx_at = dx_moved.data() + ((want - base % 4096 + 4096) % 4096) / sizeof(float);
  }
  std::fill(dx.begin(), dx.end(), 0.0f);  // touch every page before timing
  std::fill(dx_moved.begin(), dx_moved.end(), 0.0f);
  std::fill(copy.begin(), copy.end(), 0.0f);

  // Copy bandwidth: each thread copies one contiguous slice.
  normgrad::server::ThreadPool pool(threads - 1);  // plus the thread that calls ParallelFor
  const uint64_t slice = (n + threads - 1) / threads;
  auto copy_once = [&] {
    const auto start = std::chrono::steady_clock::now();
    pool.ParallelFor(threads, [&](size_t t) {
      const uint64_t first = std::min<uint64_t>(n, t * slice);
      const uint64_t last = std::min<uint64_t>(n, first + slice);
      std::memcpy(copy.data() + first, x.data() + first, (last - first) * sizeof(float));
    });
    return Seconds(start);
  };

  normgrad::server::CpuBackendOptions options;
  options.threads = threads;
  std::unique_ptr<Backend> backend = normgrad::server::NewCpuBackend(options);
  BatchSpec spec;
  spec.num_rows = rows;
  spec.hidden_dim = hidden;
  auto bytes = [](auto& v) { return reinterpret_cast<uint8_t*>(v.data()); };
  // One whole batch (StartBackward .. Finish); negative on error (printed).
  auto backward_once = [&]() -> double {
    const auto start = std::chrono::steady_clock::now();
    auto session = backend->StartBackward(
        spec, absl::Span<const uint8_t>(bytes(gamma), hidden * sizeof(float)));
    if (!session.ok()) {
      std::fprintf(stderr, "StartBackward: %s\n", session.status().ToString().c_str());
      return -1;
    }
    for (uint64_t first = 0; first < rows; first += chunk_rows) {
      const uint64_t r = std::min(chunk_rows, rows - first);
      const uint64_t off = first * hidden * sizeof(float);
      const uint64_t len = r * hidden * sizeof(float);
      absl::Status s = (*session)->ProcessChunk(
          absl::Span<const uint8_t>(bytes(x) + off, len),
          absl::Span<const uint8_t>(bytes(dy) + off, len), {}, r,
          absl::Span<uint8_t>(reinterpret_cast<uint8_t*>(dx_at) + off, len));
      if (!s.ok()) {
        std::fprintf(stderr, "ProcessChunk: %s\n", s.ToString().c_str());
        return -1;
      }
    }
    absl::Status s = (*session)->Finish(absl::Span<uint8_t>(bytes(dgamma), hidden * sizeof(float)));
    if (!s.ok()) {
      std::fprintf(stderr, "Finish: %s\n", s.ToString().c_str());
      return -1;
    }
    return Seconds(start);
  };

  // Alternate the two so that both see the same machine state; iteration 0 warms up.
  double best_copy = 1e30;
  double best_backward = 1e30;
  for (int it = 0; it <= iterations; ++it) {
    const double c = copy_once();
    const double b = backward_once();
    if (b < 0) return 1;
    if (it > 0) {
      best_copy = std::min(best_copy, c);
      best_backward = std::min(best_backward, b);
    }
  }

  const double copy_gbps = 8.0 * n / best_copy / 1e9;
  const double backward_gbps = 12.0 * n / best_backward / 1e9;
  std::printf("device: %s\n", backend->Device().name.c_str());
  std::printf("shape: %llu x %u f32, chunk %llu rows, %d threads, best of %d\n",
              static_cast<unsigned long long>(rows), hidden,
              static_cast<unsigned long long>(chunk_rows), threads, iterations);
  if (dx_page_offset >= 0) std::printf("dx %d bytes after x within a 4 KiB page\n", dx_page_offset);
  std::printf("copy (memcpy, read+write):      %8.3f ms  %7.2f GB/s\n", best_copy * 1e3, copy_gbps);
  std::printf("backward (x,dy read; dx write): %8.3f ms  %7.2f GB/s\n", best_backward * 1e3,
              backward_gbps);
  std::printf("ratio backward/copy bandwidth: %.3f (target >= 0.80)\n", backward_gbps / copy_gbps);
  return 0;
}
