// normgrad-pipeline-bench: the CUDA backend's chunk pipeline (pieces alternating between two
// streams, cuda_backend.h) against the same backend with one piece per chunk (serial: stage,
// copy in, compute, copy out, one after another), in the same run, on the same chunk.
//
//   normgrad-pipeline-bench [--smoke] [--iters N] [--hidden H] [--chunk-mib M] [--piece-bytes B]
//                           [--dtypes f32,bf16,f16]
//
// For each dtype, one chunk of M MiB of x (default 64, the client's shared-memory chunk; rows =
// M MiB / (H x element size), H default 4096) is computed through ProcessChunk by two CUDA
// backends on the driver the server would load ($NORMGRAD_CUDA_DRIVER, else libcuda.so.1): one
// with pieces of B bytes of x (default the backend's 8 MiB), one with a single piece. Twice:
// from plain host memory (staged through pinned memory) and from host memory registered with
// the driver (RegisterHostMemory, as a shared-memory region is: copied in place). The two
// backends' calls alternate, N timed calls each after one untimed; the figure is the median.
// GB/s counts x and dy in and dx out. Prints one line per case with
// `pipelined/serial = R`. dx must be the same bits both ways (it is per row), and grad_gamma
// within 1e-4 relative of the serial one. Exit status: 0; 1 when the backend cannot start;
// 2 for bad arguments; 3 when the results differ.
//
// --smoke: hidden 256, a 64 KiB chunk, pieces of 4 KiB, 2 iterations (for the emulated driver,
// where the figures mean nothing: it runs every copy and launch synchronously).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "kernels/kernel_config.h"
#include "server/backend/backend.h"
#include "server/backend_factory/backend_factory.h"
#include "server/host_rows/element_conversion.h"

namespace normgrad::server {
namespace {

struct Options {
  int iters = 10;
  uint32_t hidden = 4096;
  uint64_t chunk_bytes = uint64_t{64} << 20;
  uint64_t piece_bytes = 0;  // 0: the backend's default
  std::vector<kernels::DType> dtypes = {kernels::DType::kF32, kernels::DType::kBF16};
};

bool ParseArgs(int argc, char** argv, Options* o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const char* v = i + 1 < argc ? argv[i + 1] : nullptr;
    uint64_t n = 0;
    if (a == "--smoke") {
      o->iters = 2;
      o->hidden = 256;
      o->chunk_bytes = 64 << 10;
      o->piece_bytes = 4096;
    } else if (a == "--iters" && v != nullptr && absl::SimpleAtoi(v, &n) && n > 0 && n < 10000) {
      o->iters = static_cast<int>(n), ++i;
    } else if (a == "--hidden" && v != nullptr && absl::SimpleAtoi(v, &n) && n > 0 && n <= 65536) {
      o->hidden = static_cast<uint32_t>(n), ++i;
    } else if (a == "--chunk-mib" && v != nullptr && absl::SimpleAtoi(v, &n) && n > 0 &&
               n <= 4096) {
      o->chunk_bytes = n << 20, ++i;
    } else if (a == "--piece-bytes" && v != nullptr && absl::SimpleAtoi(v, &n) && n > 0) {
      o->piece_bytes = n, ++i;
    } else if (a == "--dtypes" && v != nullptr) {
      o->dtypes.clear();
      for (absl::string_view d : absl::StrSplit(v, ',')) {
        absl::StatusOr<kernels::DType> parsed = kernels::ParseDType(d);
        if (!parsed.ok()) {
          std::fprintf(stderr, "--dtypes: %s\n", std::string(parsed.status().message()).c_str());
          return false;
        }
        o->dtypes.push_back(*parsed);
      }
      ++i;
    } else {
      std::fprintf(stderr, "bad argument '%s' (see the top of pipeline_bench_main.cc)\n",
                   a.c_str());
      return false;
    }
  }
  return true;
}

// One backend's buffers: x, dy in, dx out (registered with its backend when `registered`).
struct Buffers {
  std::vector<uint8_t> x, dy, dx;
  std::vector<uint8_t> dgamma;
};

struct Side {
  const char* name;
  std::unique_ptr<Backend> backend;
  Buffers buf;
  std::vector<double> seconds;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Runs one dtype; returns 0, 1 or 3 (see the top).
int RunDtype(const Options& o, kernels::DType dtype) {
  const size_t elem = kernels::DTypeBytes(dtype);
  const uint64_t rows = std::max<uint64_t>(1, o.chunk_bytes / (uint64_t{o.hidden} * elem));
  const size_t bytes = rows * o.hidden * elem;

  // Inputs in [-2, 2), gamma in [0.5, 1.5), as the dtype's bytes.
  std::mt19937 gen(42);
  auto fill = [&](std::vector<uint8_t>& out, size_t n, float lo, float hi) {
    std::uniform_real_distribution<float> uniform(lo, hi);
    std::vector<float> values(n);
    for (float& v : values) v = uniform(gen);
    out.resize(n * elem);
    host_rows::ConvertFromF32(dtype, values.data(), out.data(), n);
  };
  std::vector<uint8_t> x, dy, gamma;
  fill(x, rows * o.hidden, -2, 2);
  fill(dy, rows * o.hidden, -2, 2);
  fill(gamma, o.hidden, 0.5f, 1.5f);

  Side sides[2] = {{"serial", nullptr, {}, {}}, {"pipelined", nullptr, {}, {}}};
  for (int s = 0; s < 2; ++s) {
    BackendOptions bo;
    bo.kind = BackendKind::kCuda;
    bo.max_staging_bytes = 8 * bytes + (uint64_t{64} << 20);
    bo.cuda_pipeline_piece_bytes =
        s == 0 ? std::numeric_limits<uint64_t>::max() : o.piece_bytes;  // 0: the default
    absl::StatusOr<std::unique_ptr<Backend>> b = CreateBackend(bo);
    if (!b.ok()) {
      std::fprintf(stderr, "no CUDA backend: %s\n", std::string(b.status().message()).c_str());
      return 1;
    }
    sides[s].backend = *std::move(b);
    sides[s].buf.x = x;
    sides[s].buf.dy = dy;
    sides[s].buf.dx.assign(bytes, 0);
    sides[s].buf.dgamma.assign(o.hidden * elem, 0);
  }

  kernels::BackwardRequest spec;
  spec.num_rows = rows;
  spec.hidden_dim = o.hidden;
  spec.dtype = dtype;
  int status = 0;
  for (const bool registered : {false, true}) {
    for (Side& side : sides) {
      side.seconds.clear();
      if (!registered) continue;
      DeviceBackend* device = side.backend->device();
      if (device == nullptr) {
        std::fprintf(stderr, "%s: the backend has no device to register memory with\n",
                     side.name);
        return 1;
      }
      for (std::vector<uint8_t>* v : {&side.buf.x, &side.buf.dy, &side.buf.dx}) {
        const absl::Status r = device->RegisterHostMemory(v->data(), v->size());
        if (!r.ok()) {
          std::fprintf(stderr, "RegisterHostMemory: %s\n", std::string(r.message()).c_str());
          return 1;
        }
      }
    }
    for (int it = 0; it <= o.iters; ++it) {
      for (int k = 0; k < 2; ++k) {
        Side& side = sides[(it + k) % 2];  // alternate which goes first
        auto session = side.backend->StartBackward(spec, gamma);
        if (!session.ok()) {
          std::fprintf(stderr, "%s: %s\n", side.name,
                       std::string(session.status().message()).c_str());
          return 1;
        }
        const auto t0 = std::chrono::steady_clock::now();
        const absl::Status c = (*session)->ProcessChunk(side.buf.x, side.buf.dy, {}, rows,
                                                        absl::MakeSpan(side.buf.dx));
        const auto t1 = std::chrono::steady_clock::now();
        const absl::Status f = c.ok() ? (*session)->Finish(absl::MakeSpan(side.buf.dgamma)) : c;
        if (!f.ok()) {
          std::fprintf(stderr, "%s: %s\n", side.name, std::string(f.message()).c_str());
          return 1;
        }
        if (it > 0) side.seconds.push_back(std::chrono::duration<double>(t1 - t0).count());
      }
    }
    if (registered) {
      for (Side& side : sides) {
        for (std::vector<uint8_t>* v : {&side.buf.x, &side.buf.dy, &side.buf.dx}) {
          side.backend->device()->UnregisterHostMemory(v->data());
        }
      }
    }
    const double serial = Median(sides[0].seconds), piped = Median(sides[1].seconds);
    const double moved = 3.0 * static_cast<double>(bytes);
    const bool same_dx = sides[0].buf.dx == sides[1].buf.dx;
    std::vector<float> dgamma[2] = {std::vector<float>(o.hidden), std::vector<float>(o.hidden)};
    for (int k = 0; k < 2; ++k) {
      host_rows::ConvertToF32(dtype, sides[k].buf.dgamma.data(), dgamma[k].data(), o.hidden);
    }
    double worst = 0;
    for (uint32_t i = 0; i < o.hidden; ++i) {
      const double a = dgamma[0][i], b = dgamma[1][i];
      worst = std::max(worst, std::fabs(a - b) / std::max(1.0, std::fabs(a)));
    }
    // 16-bit: one rounding of the f32 sum apart.
    const double dgamma_tol = dtype == kernels::DType::kF32 ? 1e-4 : 8e-3;
    std::printf(
        "%-4s %llu x %u (%.1f MiB of x) %-10s serial %8.2f GB/s (%.3f ms)  pipelined %8.2f GB/s "
        "(%.3f ms)  pipelined/serial = %.2f  dx %s, grad_gamma max rel diff %.2e\n",
        std::string(kernels::DTypeName(dtype)).c_str(), static_cast<unsigned long long>(rows),
        o.hidden, static_cast<double>(bytes) / (1 << 20), registered ? "registered" : "staged",
        moved / serial / 1e9, serial * 1e3, moved / piped / 1e9, piped * 1e3, serial / piped,
        same_dx ? "identical" : "DIFFERS", worst);
    if (!same_dx || !(worst <= dgamma_tol)) status = 3;
  }
  return status;
}

}  // namespace
}  // namespace normgrad::server

int main(int argc, char** argv) {
  normgrad::server::Options o;
  if (!ParseArgs(argc, argv, &o)) return 2;
  int status = 0;
  for (const normgrad::kernels::DType dtype : o.dtypes) {
    const int s = normgrad::server::RunDtype(o, dtype);
    if (s == 1) return 1;
    status = std::max(status, s);
  }
  if (status != 0) std::fprintf(stderr, "the pipelined results differ from the serial ones\n");
  return status;
}
