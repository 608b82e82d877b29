// Shared pieces of the backend tests: deterministic inputs, running a whole batch through a
// backend in chunks, and the backend under test chosen by environment:
//
//   NORMGRAD_TEST_BACKEND=cpu   (default) the CPU backend
//   NORMGRAD_TEST_BACKEND=cuda  CreateBackend(kCuda); the driver library comes from
//                               NORMGRAD_CUDA_DRIVER (e.g. an emulated driver), else libcuda.so.1
//   NORMGRAD_TEST_BACKEND=cuda:/path/to/driver.so   the same with that driver library
//   NORMGRAD_TEST_CUDA_PIECE_BYTES=N  the CUDA backend's chunk pipeline cuts chunks into pieces
//                               of N bytes of x (BackendOptions::cuda_pipeline_piece_bytes), so
//                               small test chunks run as several pieces on two streams
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "server/backend_factory/backend_factory.h"

namespace normgrad::server::testing {

// NORMGRAD_TEST_BACKEND up to its first ':' ("cpu" when unset), and what follows the ':'.
inline std::string BackendUnderTestSetting(bool library_part) {
  const char* env = std::getenv("NORMGRAD_TEST_BACKEND");
  const std::string value = env != nullptr && *env != '\0' ? env : "cpu";
  const size_t colon = value.find(':');
  if (library_part) return colon == std::string::npos ? "" : value.substr(colon + 1);
  return value.substr(0, colon);
}

inline std::string BackendUnderTestName() { return BackendUnderTestSetting(false); }

inline absl::StatusOr<std::unique_ptr<Backend>> MakeBackendUnderTest(int cpu_threads = 0) {
  BackendOptions options;
  absl::StatusOr<BackendKind> kind = ParseBackendKind(BackendUnderTestName());
  if (!kind.ok()) return kind.status();
  options.kind = *kind;
  options.cuda_driver_library = BackendUnderTestSetting(true);
  options.cpu_threads = cpu_threads;
  if (const char* piece = std::getenv("NORMGRAD_TEST_CUDA_PIECE_BYTES")) {
    options.cuda_pipeline_piece_bytes = std::strtoull(piece, nullptr, 10);
  }
  return CreateBackend(options);
}

struct Batch {
  uint64_t rows = 0;
  uint32_t hidden = 0;
  float eps = 1e-5f;
  std::vector<float> x, dy, gamma, rms;  // rms empty unless provided
};

// Values in [-2, 2) (gamma in [0.5, 1.5)), the same for the same seed on every machine.
inline Batch MakeBatch(uint64_t rows, uint32_t hidden, bool with_rms, uint32_t seed = 1) {
  Batch b;
  b.rows = rows;
  b.hidden = hidden;
  std::mt19937 gen(seed * 7919u + hidden * 31u + static_cast<uint32_t>(rows));
  auto uniform = [&gen](float lo, float hi) {
    return lo + (hi - lo) * static_cast<float>(gen() >> 8) * (1.0f / 16777216.0f);
  };
  b.x.resize(rows * hidden);
  b.dy.resize(rows * hidden);
  b.gamma.resize(hidden);
  for (float& v : b.x) v = uniform(-2, 2);
  for (float& v : b.dy) v = uniform(-2, 2);
  for (float& v : b.gamma) v = uniform(0.5f, 1.5f);
  if (with_rms) {
    b.rms.resize(rows);
    for (uint64_t r = 0; r < rows; ++r) {
      double sum = 0;
      for (uint32_t i = 0; i < hidden; ++i)
        sum += double{b.x[r * hidden + i]} * b.x[r * hidden + i];
      b.rms[r] = static_cast<float>(std::sqrt(sum / hidden + b.eps));
    }
  }
  return b;
}

template <typename T>
absl::Span<const uint8_t> Bytes(const std::vector<T>& v) {
  return absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(v.data()),
                                   v.size() * sizeof(T));
}
template <typename T>
absl::Span<uint8_t> MutableBytes(std::vector<T>& v) {
  return absl::Span<uint8_t>(reinterpret_cast<uint8_t*>(v.data()), v.size() * sizeof(T));
}

struct Gradients {
  std::vector<float> dx, dgamma;
};

// Runs `b` (f32) through `backend` in chunks of `chunk_rows` rows (the last may be shorter), as
// `variant` (without gamma: no gamma sent, no grad_gamma back), dx written over a copy of dy
// when `in_place`.
inline absl::StatusOr<Gradients> RunF32(Backend& backend, const Batch& b, uint64_t chunk_rows,
                                        const std::string& kernel = "",
                                        const kernels::NormVariant& variant = {},
                                        bool in_place = false) {
  kernels::BackwardRequest spec;
  spec.num_rows = b.rows;
  spec.hidden_dim = b.hidden;
  spec.eps = b.eps;
  spec.rms_provided = !b.rms.empty();
  spec.kernel = kernel;
  spec.variant = variant;
  absl::StatusOr<std::unique_ptr<BackwardSession>> session = backend.StartBackward(
      spec, variant.has_gamma ? Bytes(b.gamma) : absl::Span<const uint8_t>());
  if (!session.ok()) return session.status();
  Gradients g;
  if (in_place) {
    g.dx = b.dy;
  } else {
    g.dx.assign(b.rows * b.hidden, 0.0f);
  }
  g.dgamma.assign(variant.has_gamma ? b.hidden : 0, 0.0f);
  const uint64_t h = b.hidden;
  for (uint64_t first = 0; first < b.rows; first += chunk_rows) {
    const uint64_t n = std::min(chunk_rows, b.rows - first);
    absl::Span<const uint8_t> x = Bytes(b.x).subspan(first * h * 4, n * h * 4);
    absl::Span<const uint8_t> dy = Bytes(in_place ? g.dx : b.dy).subspan(first * h * 4, n * h * 4);
    absl::Span<const float> rms =
        b.rms.empty() ? absl::Span<const float>() : absl::MakeConstSpan(b.rms).subspan(first, n);
    absl::Span<uint8_t> dx = MutableBytes(g.dx).subspan(first * h * 4, n * h * 4);
    if (absl::Status s = (*session)->ProcessChunk(x, dy, rms, n, dx); !s.ok()) return s;
  }
  if (absl::Status s = (*session)->Finish(MutableBytes(g.dgamma)); !s.ok()) return s;
  return g;
}

}  // namespace normgrad::server::testing
