// The start-up self-test of a GPU backend: before the server reports SERVING, the backend's
// default kernels run on a small batch and their dx and grad_gamma are compared with the CPU
// reference (kernels/rmsnorm/reference.h). A GPU that computes wrong numbers (a bad device, a broken
// driver, a miscompiled kernel) must not take traffic.
//
//   absl::Status s = RunDeviceSelfTest(backend);
//   // OK; FAILED_PRECONDITION "self-test: dx[3] = ... differs from the CPU reference ..." on a
//   // mismatch; or the backend's own error (UNAVAILABLE for a lost device, ...).
#pragma once

#include "absl/status/status.h"
#include "server/backend/backend.h"

namespace normgrad::server {

// Shape of the batch: f32, no given rms, the backend's kernel choice (on CUDA the row-resident
// kernel and its grad_gamma reduction), one chunk. Tolerance: every value within 1e-3 of the
// reference, relative to the largest magnitude of its tensor (the kernels sum in f32, the
// reference in double).
inline constexpr uint64_t kSelfTestRows = 4;
inline constexpr uint32_t kSelfTestHiddenDim = 256;
inline constexpr double kSelfTestTolerance = 1e-3;

absl::Status RunDeviceSelfTest(Backend& backend);

}  // namespace normgrad::server
