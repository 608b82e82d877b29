#include "server/process/server_metrics.h"

#include "absl/strings/str_cat.h"

namespace normgrad::server {

ServerMetrics::ServerMetrics(MetricsRegistry& r)
    : serving(r, "normgrad_serving", "1 when health is SERVING, 0 while starting or draining."),
      device_healthy(r, "normgrad_device_healthy",
                     "1 while the device may serve; 0 after a failed start-up self-test or once "
                     "the device failed (a sticky driver error, --device-timeout)."),
      shm_regions(r, "normgrad_shm_regions",
                  "Shared-memory regions registered now (--shared-memory)."),
      shm_region_bytes(r, "normgrad_shm_region_bytes",
                       "Bytes of the shared-memory regions registered now."),
      shm_registrations(r, "normgrad_shm_registrations",
                        "Region registrations since start, by result (ok, refused).", {"result"}),
      unix_refused_connections(
          r, "normgrad_unix_refused_connections_total",
          "Unix-socket connections closed at accept, by socket (grpc, region) and reason "
          "(uid: --unix-allowed-uids does not list the peer; bound: the socket's "
          "connection bound, in all or for the peer's user).",
          {"socket", "reason"}),
      inflight_bytes(r, "normgrad_inflight_bytes",
                     "Bytes held for chunks being computed or written (admission control)."),
      backend_info(r, "normgrad_backend_info", "Always 1; the labels describe backend and device.",
                   {"backend", "device", "compute_capability", "driver_version", "version"}),
      device_memory_bytes(r, "normgrad_device_memory_bytes", "Total memory of the device."),
      process_resident_bytes(r, "normgrad_process_resident_bytes",
                             "Resident memory of the server process."),
      process_heap_in_use_bytes(r, "normgrad_process_heap_in_use_bytes",
                                "Bytes malloc has handed out and not had back (0 where unknown)."),
      process_heap_free_bytes(
          r, "normgrad_process_heap_free_bytes",
          "Bytes malloc holds for reuse without handing them out (0 where unknown)."),
      cache_hits(r, "normgrad_cache_hits_total", "Cache lookups that found the entry.", {"cache"}),
      cache_misses(r, "normgrad_cache_misses_total", "Cache lookups that had to compile.",
                   {"cache"}),
      cache_evictions(r, "normgrad_cache_evictions_total", "Entries evicted by the LRU bounds.",
                      {"cache"}),
      cache_compiles(r, "normgrad_cache_compiles_total", "Compile functions run.", {"cache"}),
      cache_compile_failures(r, "normgrad_cache_compile_failures_total",
                             "Compile functions that failed.", {"cache"}),
      cache_compile_seconds(r, "normgrad_cache_compile_seconds_total", "Time spent compiling.",
                            {"cache"}),
      cache_entries(r, "normgrad_cache_entries", "Entries in the cache.", {"cache"}),
      cache_bytes(r, "normgrad_cache_bytes", "Bytes accounted to the cache's entries.",
                  {"cache"}) {}

void ServerMetrics::PublishBackend(const Backend& backend, const std::string& version) const {
  const DeviceDescription d = backend.Device();
  backend_info.Set({{"backend", std::string(backend.Name())},
                    {"device", d.name},
                    {"compute_capability",
                     absl::StrCat(d.compute_capability_major, ".", d.compute_capability_minor)},
                    {"driver_version", d.driver_version},
                    {"version", version}},
                   1);
  device_memory_bytes.Set(static_cast<double>(d.total_memory_bytes));
}

void ServerMetrics::CollectCache(const char* cache, const ModuleCacheStats& s) const {
  const MetricsRegistry::Labels l = {{"cache", cache}};
  cache_hits.Set(l, static_cast<double>(s.hits));
  cache_misses.Set(l, static_cast<double>(s.misses));
  cache_evictions.Set(l, static_cast<double>(s.evictions));
  cache_compiles.Set(l, static_cast<double>(s.compiles));
  cache_compile_failures.Set(l, static_cast<double>(s.compile_failures));
  cache_compile_seconds.Set(l, s.compile_seconds);
  cache_entries.Set(l, static_cast<double>(s.entries));
  cache_bytes.Set(l, static_cast<double>(s.bytes));
}

void ServerMetrics::CollectProcessMemory(const ProcessMemory& memory) const {
  process_resident_bytes.Set(static_cast<double>(memory.resident_bytes));
  process_heap_in_use_bytes.Set(static_cast<double>(memory.heap_in_use_bytes));
  process_heap_free_bytes.Set(static_cast<double>(memory.heap_free_bytes));
}

void ServerMetrics::CollectRegions(const RegionStats& stats) const {
  shm_regions.Set(static_cast<double>(stats.regions));
  shm_region_bytes.Set(static_cast<double>(stats.bytes));
  shm_registrations.Set({{"result", "ok"}}, static_cast<double>(stats.registered));
  shm_registrations.Set({{"result", "refused"}}, static_cast<double>(stats.refused));
}

}  // namespace normgrad::server
