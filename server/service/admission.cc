#include "server/service/admission.h"

#include <mutex>

#include "absl/strings/str_cat.h"

namespace normgrad::server {

absl::Status AdmissionController::AdmitStream() {
  std::lock_guard<std::mutex> lock(mu_);
  if (streams_ >= limits_.max_streams) {
    return absl::ResourceExhaustedError(
        absl::StrCat("too many concurrent streams: ", streams_, " of ", limits_.max_streams,
                     " in use (--max-streams); retry later"));
  }
  ++streams_;
  return absl::OkStatus();
}

void AdmissionController::ReleaseStream() {
  std::lock_guard<std::mutex> lock(mu_);
  if (streams_ > 0) --streams_;
}

absl::Status AdmissionController::ReserveBytes(uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (bytes > limits_.max_inflight_bytes - bytes_ || bytes_ > limits_.max_inflight_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "in-flight bytes limit: this chunk needs ", bytes, " bytes, ", bytes_, " of ",
        limits_.max_inflight_bytes, " are in use (--max-inflight-bytes); retry later or send "
        "smaller chunks"));
  }
  bytes_ += bytes;
  return absl::OkStatus();
}

void AdmissionController::ReleaseBytes(uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  bytes_ = bytes > bytes_ ? 0 : bytes_ - bytes;
}

uint32_t AdmissionController::active_streams() const {
  std::lock_guard<std::mutex> lock(mu_);
  return streams_;
}

uint64_t AdmissionController::inflight_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_;
}

}  // namespace normgrad::server
