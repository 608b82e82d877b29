// A Backward call's gRPC reactors: the stream's BackwardCall (one attempt each) and the
// one-message UnaryBackwardCall, over the gRPC-free BackwardExchange (backward_exchange.h), with
// the client's retries and the loan of the caller's memory (MemoryLoan). The client
// (client.cc's ClientImpl) starts a call with StartBackwardCall and hears of it once, through
// BackwardShared::done, after gRPC gave back the caller's memory.
#pragma once

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/client_context.h>

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include "client/src/shared_memory_transport.h"
#include "normgrad/client.h"

namespace normgrad::client_internal {

// What a call's reactors need of their client.
class CallHost {
 public:
  virtual ~CallHost() = default;
  virtual const ClientOptions& options() const = 0;
  virtual grpc::GenericStub& generic() = 0;
  virtual void AddMetadata(grpc::ClientContext& context) const = 0;
  // Schedules `then` (attempt `attempt`, >= 2) on a gRPC thread after a backoff: initial_backoff
  // doubling per attempt up to max_backoff, jittered by +-20%. False, scheduling nothing, when
  // the backoff would end at or past the call's deadline.
  virtual bool ScheduleRetry(int attempt, bool has_deadline,
                             std::chrono::system_clock::time_point deadline,
                             std::function<void()> then) = 0;
  // The server said it has no RmsNormBackwardUnary: from here on the client uses the stream.
  virtual void NoUnaryBackward() = 0;
  virtual bool unary_backward() const = 0;
};

// After attempt `attempt` of a call failed in a way worth retrying: schedules attempt
// `attempt + 1` (a new Attempt on the call's `state`) when attempts and time are left, and says
// whether it did.
template <typename Attempt, typename State>
bool RetryLater(CallHost* host, const std::shared_ptr<State>& state, int attempt) {
  if (attempt >= host->options().max_attempts) return false;
  const int next = attempt + 1;
  return host->ScheduleRetry(next, state->has_deadline, state->deadline,
                             [host, state, next] { (new Attempt(host, state, next))->Start(); });
}

// The caller's x, dy and rms, lent to gRPC: every slice of a request that points into them holds
// the loan's pin (proto/normgrad/v1/bulk_wire.h), and the call's result is handed to its caller
// only once gRPC has released them all, so the caller may reuse or free its arrays as soon as
// the call returns. gRPC releases a message's slices once it wrote them out, so a call that ended
// normally has them all back; a cancelled one may still be writing one when OnDone runs.
class MemoryLoan {
 public:
  // The pin the request slices hold; the loan is returned when the last copy goes.
  static std::shared_ptr<const void> Lend(const std::shared_ptr<MemoryLoan>& loan) {
    return std::shared_ptr<const void>(loan.get(), [loan](const void*) { loan->Returned(); });
  }

  // Runs `deliver` now when the memory is back, else when it comes back (on a thread of its own:
  // gRPC releases a slice deep inside its transport, where no caller's code may run).
  void DeliverWhenReturned(std::function<void()> deliver) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!returned_) {
        deliver_ = std::move(deliver);
        return;
      }
    }
    deliver();
  }

 private:
  void Returned() {
    std::function<void()> deliver;
    {
      std::lock_guard<std::mutex> lock(mu_);
      returned_ = true;
      deliver = std::move(deliver_);
    }
    if (deliver) std::thread(std::move(deliver)).detach();
  }

  std::mutex mu_;
  bool returned_ = false;          // guarded by mu_
  std::function<void()> deliver_;  // guarded by mu_
};

// What every attempt of one Backward call shares: its arguments, the loan of the caller's
// memory, its options, where its rows travel, its callback and deadline.
struct BackwardShared {
  RawBackwardArgs args;
  // The request slices' pin on args.x, dy and rms (every attempt's), until the result is
  // handed on.
  std::shared_ptr<MemoryLoan> loan = std::make_shared<MemoryLoan>();
  std::shared_ptr<const void> pin = MemoryLoan::Lend(loan);
  BackwardOptions options;
  std::optional<ShmPlan> shm;  // set: the rows travel in a shared-memory region
  Client::RawBackwardCallback done;
  std::chrono::system_clock::time_point deadline;
  bool has_deadline = false;
};

// Starts the call: in one RmsNormBackwardUnary message when it is a small batch of bytes and the
// client may (ClientOptions::unary_small_batches, x within chunk_bytes), else as a stream.
void StartBackwardCall(CallHost* host, std::shared_ptr<BackwardShared> shared);

}  // namespace normgrad::client_internal
