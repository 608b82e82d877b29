// Admission control for the service: caps on concurrent backward streams (in total and per
// client identity) and on the bytes the server holds for them (request chunks being computed,
// responses waiting to be written), and on the EmitPtx calls waiting for or running on the
// EmitPtx workers (calls and request bytes, in total and per connection). Past any cap the caller
// gets RESOURCE_EXHAUSTED at once, naming the limit, its flag and the numbers; nothing queues
// beyond them.
//
//   if (absl::Status s = admission.AdmitStream(client); !s.ok()) return Finish(s);
//   if (absl::Status s = admission.ReserveBytes(n); !s.ok()) return Finish(s);
//   ... admission.ReleaseBytes(n); admission.ReleaseStream(client);
//   if (absl::Status s = admission.AdmitEmitPtx(peer, request_bytes); !s.ok()) return Finish(s);
//   ... admission.ReleaseEmitPtx(peer, request_bytes);
//
// Every refusal is counted in normgrad_rejected_total{method, limit} when a registry is given.
// Thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <mutex>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "server/service/service_metrics.h"

namespace normgrad::server {

struct AdmissionLimits {
  uint32_t max_streams = 64;                   // --max-streams
  uint64_t max_inflight_bytes = 1ull << 30;    // --max-inflight-bytes
  // Streams one client identity may hold at once; 0: no share (a client may take all of
  // max_streams). The flag's 0 means half of --max-streams (server_flags.cc).
  uint32_t max_streams_per_client = 0;         // --max-streams-per-client
  // EmitPtx calls admitted and not finished (queued for or running on the EmitPtx workers), and
  // the request bytes they hold, in total and per connection (gRPC's peer: address and port).
  uint32_t max_emit_ptx_calls = 64;                          // --max-emit-ptx-queue
  uint32_t max_emit_ptx_calls_per_connection = 8;            // --max-emit-ptx-queue-per-connection
  uint64_t max_emit_ptx_bytes = 64ull << 20;                 // --max-emit-ptx-queue-bytes
  uint64_t max_emit_ptx_bytes_per_connection = 16ull << 20;  // ...-queue-bytes-per-connection
};

// INVALID_ARGUMENT naming the flag and its value: every limit must be > 0 (except
// max_streams_per_client, 0: no share), and a per-connection EmitPtx limit not above its total.
absl::Status CheckAdmissionLimits(const AdmissionLimits& limits);

// A client's identity from gRPC's peer string when the call carries no authenticated one: the
// address without the port ("ipv4:10.0.0.7:51234" -> "ipv4:10.0.0.7"); an IPv6 address by its
// /64, which one host or site holds whole ("ipv6:[2001:db8:1:2::9]:5000" ->
// "ipv6:[2001:db8:1:2::]/64"; an IPv4-mapped one as IPv4); every unix-socket peer is the one
// identity "unix". A loopback peer is better named by its user (LoopbackPeerUid): any local user
// can connect from 127.0.0.2, .3, ... and would otherwise be that many clients.
std::string ClientIdentityFromPeer(absl::string_view peer);

// The user owning the client end of a TCP connection from a loopback address (127.0.0.0/8,
// ::1, ::ffff:127.x.y.z), as the kernel lists it (/proc/net/tcp, tcp6) in this network
// namespace: `peer` is gRPC's peer string ("ipv4:127.0.0.2:40000"). Empty for any other peer,
// or when the connection is not found (it closed meanwhile).
std::optional<uint32_t> LoopbackPeerUid(absl::string_view peer);

class AdmissionController {
 public:
  // `metrics` (may be null) counts every refusal (ServiceMetrics::rejected).
  explicit AdmissionController(const AdmissionLimits& limits,
                               const ServiceMetrics* metrics = nullptr)
      : limits_(limits), metrics_(metrics) {}

  // `client`: the caller's identity (ClientIdentity in normgrad_service.cc); "" for none.
  absl::Status AdmitStream(absl::string_view client = "");
  void ReleaseStream(absl::string_view client = "");
  absl::Status ReserveBytes(uint64_t bytes);
  void ReleaseBytes(uint64_t bytes);
  // One EmitPtx call from `connection` holding `bytes` of request until ReleaseEmitPtx.
  absl::Status AdmitEmitPtx(absl::string_view connection, uint64_t bytes);
  void ReleaseEmitPtx(absl::string_view connection, uint64_t bytes);

  uint32_t active_streams() const;
  uint32_t streams_of(absl::string_view client) const;
  uint64_t inflight_bytes() const;
  uint32_t emit_ptx_calls() const;
  uint64_t emit_ptx_bytes() const;
  // The share of one client: max_streams_per_client, or max_streams when that is 0 or larger.
  uint32_t streams_per_client() const;
  const AdmissionLimits& limits() const { return limits_; }

 private:
  struct EmitPtxHeld {
    uint32_t calls = 0;
    uint64_t bytes = 0;
  };
  void CountRejection(const char* method, const char* limit);

  const AdmissionLimits limits_;
  const ServiceMetrics* const metrics_;
  mutable std::mutex mu_;
  uint32_t streams_ = 0;  // guarded by mu_
  uint64_t bytes_ = 0;  // guarded by mu_
  absl::flat_hash_map<std::string, uint32_t> streams_by_client_;  // guarded by mu_; no zeros
  EmitPtxHeld emit_total_;  // guarded by mu_
  absl::flat_hash_map<std::string, EmitPtxHeld> emit_by_connection_;  // guarded by mu_; no zeros
};

}  // namespace normgrad::server
