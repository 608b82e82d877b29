// Admission control for the service: a cap on concurrent backward streams and on the bytes the
// server holds for them (request chunks being computed, responses waiting to be written). Past
// either cap the caller gets RESOURCE_EXHAUSTED at once, naming the limit and its flag; nothing
// queues.
//
//   if (absl::Status s = admission.AdmitStream(); !s.ok()) return Finish(s);
//   if (absl::Status s = admission.ReserveBytes(n); !s.ok()) return Finish(s);
//   ... admission.ReleaseBytes(n); admission.ReleaseStream();
//
// Thread-safe.
#ifndef NORMGRAD_SERVER_SERVICE_ADMISSION_H_
#define NORMGRAD_SERVER_SERVICE_ADMISSION_H_

#include <cstdint>
#include <mutex>

#include "absl/status/status.h"

namespace normgrad::server {

struct AdmissionLimits {
  uint32_t max_streams = 64;                   // --max-streams
  uint64_t max_inflight_bytes = 1ull << 30;    // --max-inflight-bytes
};

class AdmissionController {
 public:
  explicit AdmissionController(const AdmissionLimits& limits) : limits_(limits) {}

  absl::Status AdmitStream();
  void ReleaseStream();
  absl::Status ReserveBytes(uint64_t bytes);
  void ReleaseBytes(uint64_t bytes);

  uint32_t active_streams() const;
  uint64_t inflight_bytes() const;
  const AdmissionLimits& limits() const { return limits_; }

 private:
  const AdmissionLimits limits_;
  mutable std::mutex mu_;
  uint32_t streams_ = 0;  // guarded by mu_
  uint64_t bytes_ = 0;  // guarded by mu_
};

}  // namespace normgrad::server

#endif  // NORMGRAD_SERVER_SERVICE_ADMISSION_H_
