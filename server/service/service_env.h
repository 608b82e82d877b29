// What every RPC of the service shares: its configuration and its collaborators, owned by
// NormGradServer (server/process/), which outlives every RPC. The service hands each part of a
// stream only what it uses (StreamDeps, backward_pipeline.h), never the whole of it.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "server/backend/backend.h"
#include "server/ptx/ptx_service.h"
#include "server/service/admission.h"
#include "server/service/backward_validator.h"
#include "server/service/service_metrics.h"
#include "server/thread_pool/thread_pool.h"

namespace normgrad::server {

class RegionRegistry;
class AcceptedPeers;
class StreamRegistry;

struct ServiceConfig {
  std::string version;
  BackwardLimits batch_limits;
  uint64_t max_message_bytes = 0;
  absl::Duration stream_idle_timeout = absl::Seconds(30);
  // A stream whose x and dy arrive slower than this, over `min_stream_rate_window` of waiting
  // on its client (server compute and queueing not counted), is ended; 0: no minimum.
  uint64_t min_stream_bytes_per_second = 0;
  absl::Duration min_stream_rate_window = absl::Seconds(30);
  // Users whose unix-socket connections may call the service (--unix-allowed-uids); empty: any
  // that the socket file's mode lets connect.
  std::vector<uint32_t> unix_allowed_uids;
};

// Whether the device can serve. NormGradServer marks it unhealthy (a failed device, a failed
// start-up self-test) and never back: new streams are then refused UNAVAILABLE and GetServerInfo
// says why. Thread-safe.
class DeviceHealth {
 public:
  void MarkUnhealthy(const absl::Status& reason) {
    std::lock_guard<std::mutex> lock(mu_);
    if (reason_.ok()) reason_ = reason;  // the first reason stays
    healthy_.store(false);
  }
  bool healthy() const { return healthy_.load(); }
  absl::Status reason() const {  // OK while healthy
    std::lock_guard<std::mutex> lock(mu_);
    return reason_;
  }

 private:
  std::atomic<bool> healthy_{true};
  mutable std::mutex mu_;
  absl::Status reason_;  // guarded by mu_
};

struct ServiceEnv {
  ServiceConfig config;
  Backend* backend = nullptr;
  PtxService* ptx = nullptr;
  AdmissionController* admission = nullptr;
  const ServiceMetrics* metrics = nullptr;
  ThreadPool* pool = nullptr;  // blocking work: chunk compute, session start
  // EmitPtx (emission, nvJitLink): its own workers, so chunks never wait behind compiles; null:
  // `pool`.
  ThreadPool* emit_ptx_pool = nullptr;
  StreamRegistry* streams = nullptr;
  RegionRegistry* regions = nullptr;  // shared-memory regions; null without --shared-memory
  // Credentials of the unix-socket connections the server accepted itself; null when gRPC
  // listens on the unix sockets (TLS) or there are none.
  const AcceptedPeers* accepted_peers = nullptr;
  bool cuda_ipc = false;  // --cuda-ipc: chunks may name device memory (backend->DeviceUuid())
  uint32_t max_cuda_ipc_handles = 0;  // --max-cuda-ipc-handles
  std::atomic<bool> draining{false};
  DeviceHealth device_health;
};

}  // namespace normgrad::server
