// Judges whether a stream still deserves its slot: it ends one that waited on its client (a
// read or a write in flight, nothing of the server's own pending) for longer than the idle
// timeout, or whose x, dy and grad_input moved slower than a minimum rate over a window of such
// waiting. Time the server spends (a job queued or running, the byte budget) never counts: a
// busy server must not end its clients' streams.
//
//   StreamWatchdog w(start, {.bytes_per_second = 1 << 20, .window = absl::Seconds(30)});
//   w.NoteProgress(now);                              // a read, write or job completed
//   StreamWatchdog::Verdict v = w.Visit(now, idle_timeout, state);   // periodically
//   if (!v.end.ok()) ...                              // end the stream with v.end
//
// Not thread-safe: its owner (the stream pipeline) calls it under its own lock.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace normgrad::server {

// --min-stream-bytes-per-second over --min-stream-rate-window; 0 bytes: no minimum.
struct MinStreamRate {
  uint64_t bytes_per_second = 0;
  absl::Duration window = absl::Seconds(30);
};

class StreamWatchdog {
 public:
  StreamWatchdog(absl::Time start, MinStreamRate min_rate)
      : min_rate_(min_rate), last_progress_(start), last_visit_(start) {}

  // What the stream is doing at a visit.
  struct StreamState {
    bool waiting_on_client = false;  // a read or write in flight, no job queued or running
    bool writing = false;            // a write in flight (the client does not read)
    uint64_t rows_received = 0;      // for the idle message
    uint64_t bytes_moved = 0;        // x, dy and gamma in plus grad_input out, so far
  };
  struct Verdict {
    absl::Status end;             // OK: the stream goes on
    bool below_min_rate = false;  // `end` is the minimum rate's (counted as a rejection)
  };

  void NoteProgress(absl::Time now) { last_progress_ = now; }

  // DEADLINE_EXCEEDED when the stream waited on its client for `idle_timeout` (0: never) since
  // its last progress, or moved less than the minimum rate over a full window of waiting.
  Verdict Visit(absl::Time now, absl::Duration idle_timeout, const StreamState& state);

 private:
  absl::Status CheckRate(uint64_t bytes_moved);

  const MinStreamRate min_rate_;
  absl::Time last_progress_;
  // The time the stream waited on its client, as the visits saw it (each interval between two
  // visits counts when the second finds the stream waiting on its client); the current rate
  // window's start: the waiting and the bytes moved then.
  absl::Time last_visit_;
  absl::Duration client_wait_;
  absl::Duration rate_window_wait_;
  uint64_t rate_window_bytes_ = 0;
};

}  // namespace normgrad::server
