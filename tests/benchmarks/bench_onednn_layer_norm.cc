// normgrad's CPU backend against oneDNN's layer-normalization backward (the library a user would
// pick instead), same shapes, same thread count, in the same run: prints normgrad's speed over
// oneDNN's per shape.
//
//   bench_onednn_layer_norm [--threads=N] [--iterations=5] [--sweep_mib=64] [--dtype=f32|bf16]
//
// oneDNN: layer_normalization_backward, prop_kind::backward, use_scale, plain row-major
// (rows x hidden) of --dtype (bf16: src, diff_dst and diff_src bf16, scale and diff_scale f32,
// where this CPU's oneDNN has a bf16 layer norm; it says when it has none); it computes diff_src
// and diff_scale from src, diff_dst, the forward's mean and
// variance (computed once, untimed) and scale. A layer-norm backward does strictly more work than
// an RMSNorm backward (it also reduces diff_dst and subtracts the mean) and moves the same bytes:
// x and dy read, dx written. Debian's libdnnl is threaded with OpenMP: its thread count is set
// with omp_set_num_threads(--threads) before the first primitive runs. Its idle threads wait
// passively (OMP_WAIT_POLICY=passive, unless the caller set a policy): libgomp's default lets
// them spin after each parallel region, and on 2 cores they then took the CPU from normgrad's
// pool, which runs right after oneDNN (normgrad measured up to 1.8x slower; oneDNN's own times
// moved by a few percent).
//
// normgrad: the CPU backend with --threads threads, one whole batch per timing (StartBackward, one
// ProcessChunk, Finish), rms recomputed from x. The two alternate; best of --iterations each,
// after one warm-up. Shapes: four of models' sizes (4096 x 4096, 4096 x 896, 16384 x 1024,
// 2048 x 8192) and the sweep's hidden sizes at --sweep_mib MiB of x.
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "dnnl.hpp"
#include "server/backend/backend.h"
#include "server/cpu/cpu_backend.h"

ABSL_FLAG(int, threads, static_cast<int>(std::max(1u, std::thread::hardware_concurrency())),
          "threads of both sides (oneDNN's OpenMP threads, the backend's pool)");
ABSL_FLAG(int, iterations, 5, "timed runs of each side; the best counts");
ABSL_FLAG(uint64_t, sweep_mib, 64, "MiB of x per sweep shape");
ABSL_FLAG(std::string, dtype, "f32", "f32 or bf16: x, dy and dx on both sides");

namespace {

using normgrad::server::Backend;
using normgrad::kernels::BackwardRequest;

double Seconds(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// One layer-norm backward of rows x hidden elements of `type` through oneDNN, its buffers set up
// once.
class OneDnnLayerNormBackward {
 public:
  OneDnnLayerNormBackward(dnnl::engine& engine, dnnl::memory::data_type type, const void* x,
                          const void* dy, void* dx, const float* gamma, int64_t rows,
                          int64_t hidden, float eps)
      : engine_(engine), stream_(engine) {
    using dnnl::memory;
    const memory::desc data_md({rows, hidden}, type, memory::format_tag::ab);
    const memory::desc scale_md({hidden}, memory::data_type::f32, memory::format_tag::a);
    const auto flags = dnnl::normalization_flags::use_scale;
    const dnnl::layer_normalization_forward::desc fwd_desc(dnnl::prop_kind::forward_training,
                                                           data_md, eps, flags);
    const dnnl::layer_normalization_forward::primitive_desc fwd_pd(fwd_desc, engine_);
    const dnnl::layer_normalization_backward::desc bwd_desc(dnnl::prop_kind::backward, data_md,
                                                            data_md, eps, flags);
    const dnnl::layer_normalization_backward::primitive_desc bwd_pd(bwd_desc, engine_, fwd_pd);
    // oneDNN's memory objects over our buffers (it does not own them); its API takes non-const.
    src_ = memory(data_md, engine_, const_cast<void*>(x));
    diff_dst_ = memory(data_md, engine_, const_cast<void*>(dy));
    diff_src_ = memory(data_md, engine_, dx);
    scale_ = memory(scale_md, engine_, const_cast<float*>(gamma));
    diff_scale_ = memory(scale_md, engine_);
    mean_ = memory(fwd_pd.mean_desc(), engine_);
    variance_ = memory(fwd_pd.variance_desc(), engine_);
    // The forward, once, for the statistics the backward reads (its dst goes to dx, overwritten).
    dnnl::layer_normalization_forward(fwd_pd).execute(
        stream_, {{DNNL_ARG_SRC, src_}, {DNNL_ARG_DST, diff_src_}, {DNNL_ARG_SCALE, scale_},
                  {DNNL_ARG_MEAN, mean_}, {DNNL_ARG_VARIANCE, variance_}});
    stream_.wait();
    backward_ = dnnl::layer_normalization_backward(bwd_pd);
  }

  double RunOnce() {
    const auto start = std::chrono::steady_clock::now();
    backward_.execute(stream_, {{DNNL_ARG_SRC, src_},
                                {DNNL_ARG_DIFF_DST, diff_dst_},
                                {DNNL_ARG_MEAN, mean_},
                                {DNNL_ARG_VARIANCE, variance_},
                                {DNNL_ARG_SCALE, scale_},
                                {DNNL_ARG_DIFF_SRC, diff_src_},
                                {DNNL_ARG_DIFF_SCALE, diff_scale_}});
    stream_.wait();
    return Seconds(start);
  }

 private:
  dnnl::engine& engine_;
  dnnl::stream stream_;
  dnnl::memory src_, diff_dst_, diff_src_, scale_, diff_scale_, mean_, variance_;
  dnnl::layer_normalization_backward backward_;
};

}  // namespace

int main(int argc, char** argv) {
  // libgomp reads its wait policy when it loads, so the policy is set by running this program
  // again with it in the environment (once: the second run finds it set).
  if (std::getenv("OMP_WAIT_POLICY") == nullptr) {
    setenv("OMP_WAIT_POLICY", "passive", 1);
    execv("/proc/self/exe", argv);
    std::perror("re-running with OMP_WAIT_POLICY=passive");  // goes on with the default policy
    unsetenv("OMP_WAIT_POLICY");
  }
  absl::SetProgramUsageMessage(
      "bench_onednn_layer_norm [--threads=N] [--iterations=I] [--sweep_mib=64] [--dtype=f32|bf16]");
  absl::ParseCommandLine(argc, argv);
  const int threads = absl::GetFlag(FLAGS_threads);
  const int iterations = absl::GetFlag(FLAGS_iterations);
  const uint64_t sweep_mib = absl::GetFlag(FLAGS_sweep_mib);
  const std::string dtype_name = absl::GetFlag(FLAGS_dtype);
  if (dtype_name != "f32" && dtype_name != "bf16") {
    std::fprintf(stderr, "--dtype is %s; must be f32 or bf16\n", dtype_name.c_str());
    return 2;
  }
  const bool bf16 = dtype_name == "bf16";
  const size_t elem_bytes = bf16 ? 2 : 4;
  const auto onednn_type = bf16 ? dnnl::memory::data_type::bf16 : dnnl::memory::data_type::f32;
  omp_set_num_threads(threads);

  std::vector<std::pair<uint64_t, uint32_t>> shapes = {
      {4096, 4096}, {4096, 896}, {16384, 1024}, {2048, 8192}};
  for (uint32_t hidden :
       {64u, 128u, 896u, 1000u, 1024u, 2048u, 4096u, 5120u, 8192u, 16384u, 65536u}) {
    shapes.emplace_back((sweep_mib << 20) / (elem_bytes * hidden), hidden);
  }
  uint64_t max_elements = 0;
  for (const auto& [rows, hidden] : shapes) max_elements = std::max(max_elements, rows * hidden);
  // Allocated and touched once, reused by every shape.
  // Allocated and touched once, reused by every shape: elem_bytes per element (bf16: the upper
  // half of the f32 value, rounded to nearest even).
  std::vector<uint8_t> x(max_elements * elem_bytes), dy(max_elements * elem_bytes),
      dx(max_elements * elem_bytes);
  auto put = [&](std::vector<uint8_t>& buffer, uint64_t i, float v) {
    if (!bf16) {
      std::memcpy(buffer.data() + 4 * i, &v, 4);
      return;
    }
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    const uint16_t half = static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
    std::memcpy(buffer.data() + 2 * i, &half, 2);
  };
  for (uint64_t i = 0; i < max_elements; ++i) {
    put(x, i, static_cast<float>((i * 2654435761u) % 1000) / 500.0f - 1.0f);
    put(dy, i, static_cast<float>((i * 40503u) % 1000) / 500.0f - 1.0f);
  }

  normgrad::server::CpuBackendOptions options;
  options.threads = threads;
  std::unique_ptr<Backend> backend = normgrad::server::NewCpuBackend(options);
  dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  const char* wait_policy = std::getenv("OMP_WAIT_POLICY");
  std::printf(
      "normgrad: %s; oneDNN %d.%d.%d, OpenMP, %d threads, OMP_WAIT_POLICY=%s; %s, best of %d\n",
      backend->Device().name.c_str(), dnnl_version()->major, dnnl_version()->minor,
      dnnl_version()->patch, threads, wait_policy != nullptr ? wait_policy : "(default)",
      dtype_name.c_str(), iterations);
  std::printf("%8s %7s %14s %13s %14s %13s %17s\n", "rows", "hidden", "normgrad ms",
              "normgrad GB/s", "oneDNN ms", "oneDNN GB/s", "normgrad/oneDNN");
  double lowest = 1e30;
  for (const auto& shape : shapes) {
    // Plain variables: lambdas below capture them (C++17 cannot capture structured bindings).
    const uint64_t rows = shape.first;
    const uint32_t hidden = shape.second;
    const float eps = 1e-5f;
    // gamma: f32 for oneDNN (its scale is f32 for every data type), the dtype for normgrad.
    std::vector<float> gamma(hidden);
    std::vector<uint8_t> gamma_bytes(hidden * elem_bytes), dgamma(hidden * elem_bytes);
    for (uint32_t i = 0; i < hidden; ++i) {
      gamma[i] = 1.0f + static_cast<float>(i % 7) / 10.0f;
      put(gamma_bytes, i, gamma[i]);
      if (bf16) {  // oneDNN gets the bf16 value normgrad gets
        uint16_t half;
        std::memcpy(&half, gamma_bytes.data() + 2 * i, 2);
        const uint32_t bits = uint32_t{half} << 16;
        std::memcpy(&gamma[i], &bits, 4);
      }
    }
    const uint64_t bytes = rows * hidden * elem_bytes;

    BackwardRequest spec;
    spec.num_rows = rows;
    spec.hidden_dim = hidden;
    spec.eps = eps;
    spec.dtype = bf16 ? normgrad::kernels::DType::kBF16 : normgrad::kernels::DType::kF32;
    auto normgrad_once = [&]() -> double {
      const auto start = std::chrono::steady_clock::now();
      auto session = backend->StartBackward(spec, absl::MakeConstSpan(gamma_bytes));
      if (!session.ok()) {
        std::fprintf(stderr, "StartBackward: %s\n", session.status().ToString().c_str());
        std::exit(1);
      }
      absl::Status s = (*session)->ProcessChunk(absl::MakeConstSpan(x.data(), bytes),
                                                absl::MakeConstSpan(dy.data(), bytes), {}, rows,
                                                absl::MakeSpan(dx.data(), bytes));
      if (s.ok()) s = (*session)->Finish(absl::MakeSpan(dgamma));
      if (!s.ok()) {
        std::fprintf(stderr, "normgrad: %s\n", s.ToString().c_str());
        std::exit(1);
      }
      return Seconds(start);
    };

    double best_normgrad = 1e30;
    double best_onednn = 1e30;
    try {
      OneDnnLayerNormBackward onednn(engine, onednn_type, x.data(), dy.data(), dx.data(),
                                     gamma.data(), static_cast<int64_t>(rows), hidden, eps);
      for (int it = 0; it <= iterations; ++it) {
        const double n = normgrad_once();
        const double o = onednn.RunOnce();
        if (it > 0) {
          best_normgrad = std::min(best_normgrad, n);
          best_onednn = std::min(best_onednn, o);
        }
      }
    } catch (const dnnl::error& e) {
      std::fprintf(stderr, "oneDNN at %llu x %u (%s): %s%s\n",
                   static_cast<unsigned long long>(rows), hidden, dtype_name.c_str(), e.what(),
                   bf16 ? " (this CPU's oneDNN has no bf16 layer normalization)" : "");
      return 1;
    }
    const double speed = best_onednn / best_normgrad;
    lowest = std::min(lowest, speed);
    std::printf("%8llu %7u %14.3f %13.2f %14.3f %13.2f %17.2f\n",
                static_cast<unsigned long long>(rows), hidden, best_normgrad * 1e3,
                3.0 * bytes / best_normgrad / 1e9, best_onednn * 1e3,
                3.0 * bytes / best_onednn / 1e9, speed);
    std::fflush(stdout);
  }
  std::printf("lowest normgrad/oneDNN speed: %.2f (target >= 1.25)\n", lowest);
  return 0;
}
