// What every RPC of the service shares: its configuration and its collaborators, owned by
// NormGradServer (server/process/), which outlives every RPC. No gRPC types: the stream pipeline
// (backward_pipeline.h) reads it too.
#ifndef NORMGRAD_SERVER_SERVICE_SERVICE_ENV_H_
#define NORMGRAD_SERVER_SERVICE_SERVICE_ENV_H_

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/time/time.h"
#include "server/backend/backend.h"
#include "server/metrics/metrics.h"
#include "server/ptx/ptx_service.h"
#include "server/service/admission.h"
#include "server/service/backward_validator.h"
#include "server/thread_pool/thread_pool.h"

namespace normgrad::server {

class RegionRegistry;
class StreamRegistry;

struct ServiceConfig {
  std::string version;
  BackwardLimits batch_limits;
  uint64_t max_message_bytes = 0;
  absl::Duration stream_idle_timeout = absl::Seconds(30);
};

struct ServiceEnv {
  ServiceConfig config;
  Backend* backend = nullptr;
  PtxService* ptx = nullptr;
  AdmissionController* admission = nullptr;
  MetricsRegistry* metrics = nullptr;
  ThreadPool* pool = nullptr;  // blocking work: chunk compute, session start, EmitPtx
  StreamRegistry* streams = nullptr;
  RegionRegistry* regions = nullptr;  // shared-memory regions; null without --shared-memory
  std::atomic<bool> draining{false};
};

}  // namespace normgrad::server

#endif  // NORMGRAD_SERVER_SERVICE_SERVICE_ENV_H_
