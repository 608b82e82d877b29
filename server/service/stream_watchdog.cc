#include "server/service/stream_watchdog.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace normgrad::server {

StreamWatchdog::Verdict StreamWatchdog::Visit(absl::Time now, absl::Duration idle_timeout,
                                              const StreamState& state) {
  if (state.waiting_on_client && now > last_visit_) client_wait_ += now - last_visit_;
  last_visit_ = std::max(last_visit_, now);
  Verdict verdict;
  if (!state.waiting_on_client) return verdict;
  if (idle_timeout > absl::ZeroDuration() && now - last_progress_ >= idle_timeout) {
    verdict.end = absl::DeadlineExceededError(
        state.writing
            ? absl::StrCat("stream idle timeout: the client read no response for ",
                           absl::FormatDuration(idle_timeout), " (--stream-idle-timeout)")
            : absl::StrCat("stream idle timeout: no request message for ",
                           absl::FormatDuration(idle_timeout), " after ", state.rows_received,
                           " rows (--stream-idle-timeout)"));
    return verdict;
  }
  verdict.end = CheckRate(state.bytes_moved);
  verdict.below_min_rate = !verdict.end.ok();
  return verdict;
}

// The rate is judged per window of waiting on the client: below the minimum the stream ends; at
// or above it a new window starts.
absl::Status StreamWatchdog::CheckRate(uint64_t bytes_moved) {
  const uint64_t min_rate = min_rate_.bytes_per_second;
  const absl::Duration window = min_rate_.window;
  if (min_rate == 0 || window <= absl::ZeroDuration()) return absl::OkStatus();
  const absl::Duration waited = client_wait_ - rate_window_wait_;
  if (waited < window) return absl::OkStatus();
  const uint64_t moved = bytes_moved - rate_window_bytes_;
  const double rate = static_cast<double>(moved) / absl::ToDoubleSeconds(waited);
  if (rate >= static_cast<double>(min_rate)) {
    rate_window_wait_ = client_wait_;
    rate_window_bytes_ = bytes_moved;
    return absl::OkStatus();
  }
  return absl::DeadlineExceededError(absl::StrCat(
      "stream too slow: ", moved, " bytes of x, dy and grad_input moved in ",
      absl::FormatDuration(absl::Trunc(waited, absl::Milliseconds(1))),
      " of waiting on the client (", static_cast<uint64_t>(rate),
      " B/s), below --min-stream-bytes-per-second=", min_rate, " (window ",
      absl::FormatDuration(window), ", --min-stream-rate-window)"));
}

}  // namespace normgrad::server
