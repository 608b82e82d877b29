// Random RmsNormBackward batches, their reference gradients, the request messages that carry
// them and error measures: what the service's tests share that needs no gRPC and no server.
//
//   const Batch b = RandomBatch(/*rows=*/64, /*hidden=*/256, /*seed=*/1);
//   std::vector<float> dx, dgamma;
//   ReferenceFor(b, dx, dgamma);
//   v1::BackwardRequest header = HeaderFor(b), rows = ChunkFor(b, 0, 64);
#pragma once

#include <cstdint>
#include <vector>

#include "normgrad/v1/normgrad.pb.h"

namespace normgrad::server::testing {

struct Batch {
  uint64_t rows = 0;
  uint32_t hidden = 0;
  float eps = 1e-5f;
  std::vector<float> x, dy, gamma, rms;  // rms empty unless with_rms
};
Batch RandomBatch(uint64_t rows, uint32_t hidden, uint32_t seed, bool with_rms = false);

// The reference result for `batch` (kernels::ReferenceBackward).
void ReferenceFor(const Batch& batch, std::vector<float>& dx, std::vector<float>& dgamma);

v1::BackwardRequest HeaderFor(const Batch& batch);
v1::BackwardRequest ChunkFor(const Batch& batch, uint64_t first_row, uint64_t rows);

// Largest |a - b| / (|b| + scale) over the elements; scale = max(largest |b|, min_scale).
double MaxScaledError(const std::vector<float>& got, const std::vector<float>& want,
                      double min_scale = 0);

// dx's error relative to the size of the terms it is computed from: the largest
// |gamma_i * dy_ri| / rms_r of the batch. (For small hidden_dim dx is a difference of nearly
// equal terms, far smaller than either: an f32 kernel's error is relative to the terms.)
double MaxDxError(const Batch& batch, const std::vector<float>& got, const std::vector<float>& want);

}  // namespace normgrad::server::testing
