// One attempt of a Backward call, without gRPC: what the client writes next and what it makes of
// each answer. The reactors in client.cc (the stream's BackwardCall, the one-message
// UnaryBackwardCall) carry out what it decides and hold no state of the call's own; tests drive
// it step by step (tests/client/backward_exchange_test.cc).
//
// Writes: the header, then each row chunk (the rows as the caller's bytes, or where they are in a
// shared-memory region or in CUDA IPC device buffers), then the half-close. A memory call (region
// or device buffers) keeps at most kMemoryChunksAhead chunks unanswered. A cancel is in order
// once a chunk naming the caller's memory went out (the server may be computing it): a
// BackwardRequest.cancel follows the chunks already sent, then the half-close; before that the
// call may simply be cut off.
//
// Answers: rows in batch order, each exactly once, grad_input into the caller's dx (from gRPC's
// pieces, or from the staging region), then grad_gamma and the summary. Each answer is checked
// whole before a byte of it lands in the caller's arrays.
//
//   BackwardExchange x(args, options, shm, chunk_bytes);
//   x.StartHeader();                       // message(): the header
//   ... written ...  x.WriteDone();
//   while ((next = x.NextWrite()) == BackwardExchange::kMessage) write(x.message(), x.bulk());
//   x.TakeAnswer(response, grad_input);    // for each answer read
//   x.Complete();                          // every row and grad_gamma came
//
// Not thread-safe: the reactor's lock guards it.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "client/src/chunking.h"
#include "client/src/shared_memory_transport.h"
#include "normgrad/client.h"
#include "normgrad/v1/normgrad.pb.h"
#include "proto/normgrad/v1/bulk_wire.h"

namespace normgrad::client_internal {

// A call's BackwardHeader, for the stream's first message and the unary request alike.
void FillHeader(const RawBackwardArgs& a, const BackwardOptions& options,
                v1::BackwardHeader* header);

class BackwardExchange {
 public:
  // A memory call's chunks sent but not answered, at most.
  static constexpr uint64_t kMemoryChunksAhead = 3;

  // `args`, `options` and `shm` (null: the rows travel as bytes) outlive the exchange.
  BackwardExchange(const RawBackwardArgs& args, const BackwardOptions& options,
                   const ShmPlan* shm, uint64_t chunk_bytes);

  // The server reads and writes the caller's memory (a shared-memory region, CUDA IPC buffers).
  bool memory_call() const { return shm_ != nullptr || args_.device.has_value(); }

  // The message to write now: the header (StartHeader) or what NextWrite returned kMessage for.
  // bulk(): its row bytes, pointing into the caller's arrays (BulkField: sent without a copy).
  const v1::BackwardRequest& message() const { return message_; }
  absl::Span<const v1::BulkField> bulk() const { return bulk_; }

  // The first message: the header. A write is in flight from here.
  void StartHeader();
  // The whole batch in one message (RmsNormBackwardUnary): the header and every row.
  void StartWhole();
  // The write in flight went out.
  void WriteDone() { write_in_flight_ = false; }

  // What the write chain does next: nothing (a write is in flight, the half-close was sent, or a
  // memory call waits for an answer before it sends more), a message (message(), bulk()), or
  // the half-close.
  enum Next { kNothing, kMessage, kWritesDone };
  Next NextWrite();

  // The caller cancelled, or its deadline passed (`why`). kCutOff: no chunk naming the caller's
  // memory went out, so the call may simply be cancelled (TryCancel). kInOrder: one did; the
  // cancel message follows the chunks sent (NextWrite), and the call is cut off only after the
  // grace. kAlready: a cancel came before.
  enum Cancelled { kAlready, kCutOff, kInOrder };
  Cancelled Cancel(absl::Status why);
  const absl::Status& cancel_status() const { return cancel_status_; }  // OK: not cancelled

  // One answer. An error for anything the server should not have sent (rows out of order or
  // out of the batch, a wrong number of grad_input or grad_gamma bytes, grad_input for a memory
  // chunk, a message after the final one), before any byte of it is written to the caller's
  // arrays.
  absl::Status TakeAnswer(const v1::BackwardResponse& response,
                          const v1::ReceivedBytes& grad_input);
  // OK when every row and the final message came; else why not, for a stream that ended OK.
  absl::Status Complete() const;

  uint64_t rows_received() const { return rows_received_; }
  bool any_answer() const { return any_answer_; }
  // A chunk naming the caller's memory was handed over: the server may touch that memory until
  // its status says it stopped.
  bool exposed() const { return exposed_; }
  const BackwardSummary& summary() const { return summary_; }

 private:
  void FillChunk(uint64_t index);

  const RawBackwardArgs& args_;
  const BackwardOptions& options_;
  const ShmPlan* const shm_;
  const uint64_t row_bytes_;
  const RowChunker chunker_;
  v1::BackwardRequest message_;
  std::vector<v1::BulkField> bulk_;
  uint64_t next_chunk_ = 0;
  uint64_t chunks_answered_ = 0;
  uint64_t rows_received_ = 0;
  bool any_answer_ = false;
  bool final_received_ = false;
  bool write_in_flight_ = false;
  bool writes_done_ = false;
  bool cancel_sent_ = false;
  bool exposed_ = false;
  absl::Status cancel_status_;
  BackwardSummary summary_;
};

}  // namespace normgrad::client_internal
