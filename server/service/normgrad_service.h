// The gRPC face of normgrad: NormGrad::CallbackService with one reactor per RmsNormBackward
// stream (BackwardStream, in the .cc: a thin shell around BackwardPipeline, which holds the
// stream's logic without gRPC) and unary reactors for EmitPtx and GetServerInfo.
//
// Threading contract (gRPC's callback model): no reaction blocks. Chunk compute, session start
// (which may compile) and EmitPtx run on a ThreadPool; a stream has at most one task there at a
// time, one read and one write in flight, and holds at most kMaxChunksHeldPerStream row chunks
// (received but whose response is not yet written) before it stops reading: flow control reaches
// the client through HTTP/2 windows instead of server memory (backward_pipeline.h).
//
// The service does not own its collaborators; NormGradServer (server/process/) wires them.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "normgrad/v1/normgrad.grpc.pb.h"
#include "proto/normgrad/v1/metadata_keys.h"
#include "server/metrics/metrics.h"
#include "server/service/service_env.h"

namespace normgrad::server {

class BackwardStream;

using v1::kWritesDoneTrailer;  // proto/normgrad/v1/metadata_keys.h

// Every live BackwardStream, for the idle watchdog and for draining, and the number of
// RmsNormBackwardUnary calls running (draining waits for them too). Thread-safe.
class StreamRegistry {
 public:
  void Add(BackwardStream* stream);
  void Remove(BackwardStream* stream);
  void AddUnary();
  void RemoveUnary();
  size_t size() const;  // streams and unary calls
  // Ends streams that made no progress for `timeout` while waiting on their client.
  void CheckIdle(absl::Time now, absl::Duration timeout);
  // Blocks until no stream is alive or `deadline` passes; true when none is alive.
  bool WaitUntilEmpty(absl::Time deadline);

 private:
  mutable std::mutex mu_;
  std::condition_variable emptied_;
  absl::flat_hash_set<BackwardStream*> streams_;  // guarded by mu_
  size_t unary_calls_ = 0;  // guarded by mu_
};

// Every method takes its messages as bytes (gRPC's raw callback API) and parses them itself, so
// that a message that does not parse as the method's type is INVALID_ARGUMENT saying so (gRPC's
// own parsing answers a unary call UNIMPLEMENTED with no message, and ends a stream's reads as
// if the client had half-closed).
using RawNormGradService = v1::NormGrad::WithRawCallbackMethod_RmsNormBackward<
    v1::NormGrad::WithRawCallbackMethod_RmsNormBackwardUnary<
        v1::NormGrad::WithRawCallbackMethod_EmitPtx<
            v1::NormGrad::WithRawCallbackMethod_GetServerInfo<v1::NormGrad::Service>>>>;

class NormGradService final : public RawNormGradService {
 public:
  explicit NormGradService(ServiceEnv* env) : env_(env) {}

  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* RmsNormBackward(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* RmsNormBackwardUnary(grpc::CallbackServerContext* context,
                                                 const grpc::ByteBuffer* request,
                                                 grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* EmitPtx(grpc::CallbackServerContext* context,
                                    const grpc::ByteBuffer* request,
                                    grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* context,
                                          const grpc::ByteBuffer* request,
                                          grpc::ByteBuffer* response) override;

 private:
  ServiceEnv* env_;
};

}  // namespace normgrad::server
