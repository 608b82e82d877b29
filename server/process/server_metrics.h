// The process's own metrics (health, the device, the caches, shared memory, the process's
// memory, connections refused at accept), one typed handle each: name, help and label names are
// in server_metrics.cc and nowhere else. The service's are in server/service/service_metrics.h.
//
//   MetricsRegistry registry;
//   ServerMetrics metrics(registry);  // describes every one
//   metrics.serving.Set(1);
//   metrics.CollectCache("module", backend.CacheStats());  // in a collector, at each scrape
#pragma once

#include <string>

#include "server/backend/backend.h"
#include "server/metrics/metrics.h"
#include "server/process/process_memory.h"
#include "server/shared_memory/region_registry.h"

namespace normgrad::server {

struct ServerMetrics {
  explicit ServerMetrics(MetricsRegistry& registry);

  // normgrad_backend_info (always 1, the labels say what serves) and the device's memory.
  void PublishBackend(const Backend& backend, const std::string& version) const;
  // A module cache's statistics ({cache}: "module" for the backend's, "ptx" for EmitPtx's).
  void CollectCache(const char* cache, const ModuleCacheStats& stats) const;
  void CollectProcessMemory(const ProcessMemory& memory) const;
  void CollectRegions(const RegionStats& stats) const;

  Gauge serving;
  Gauge device_healthy;
  Gauge shm_regions;
  Gauge shm_region_bytes;
  Gauge shm_registrations;            // {result}
  Counter unix_refused_connections;   // {socket, reason}
  Gauge inflight_bytes;
  Gauge backend_info;  // {backend, device, compute_capability, driver_version, version}
  Gauge device_memory_bytes;
  Gauge process_resident_bytes;
  Gauge process_heap_in_use_bytes;
  Gauge process_heap_free_bytes;
  Counter cache_hits;                 // {cache}, as every cache_* metric
  Counter cache_misses;
  Counter cache_evictions;
  Counter cache_compiles;
  Counter cache_compile_failures;
  Counter cache_compile_seconds;
  Gauge cache_entries;
  Gauge cache_bytes;
};

}  // namespace normgrad::server
