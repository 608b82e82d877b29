// The client's side of the shared-memory transport: registered regions, the connection to the
// server's region socket ("<unix socket path>.shm"), staging regions for tensors that are not in
// a registered region, and the choice, per call, between shared memory and bytes
// (ClientOptions::transport). Thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "normgrad/client.h"
#include "normgrad/v1/normgrad.pb.h"
#include "normgrad/shared_memory.h"

namespace normgrad::client_internal {

// Where one call's tensors are in a registered region (byte offsets), and the staging region
// when the client copied them there (nullptr for zero copy).
struct ShmPlan {
  uint64_t region_id = 0;
  std::string region_key;
  uint64_t x = 0, dy = 0, rms = 0, dx = 0;
  std::shared_ptr<SharedMemoryRegion> staging;  // returned to the pool when the plan goes
  // Set when the server may still write the staging region (the call ended without its word
  // that it stopped): the region is then unmapped and released instead of pooled, so no later
  // call ever gets its pages.
  std::shared_ptr<std::atomic<bool>> discard_staging = std::make_shared<std::atomic<bool>>(false);
};

class SharedMemoryTransport {
 public:
  // `socket_path`: the region socket, or empty when the target is not a unix socket.
  // `server_offers`: asks the server (GetServerInfo) whether it takes shared memory; called
  // at most once, on the first call that could use it.
  SharedMemoryTransport(Transport mode, std::string socket_path,
                        std::function<absl::StatusOr<bool>()> server_offers,
                        absl::Duration reply_timeout = absl::Seconds(10));
  ~SharedMemoryTransport();

  absl::Status Register(const SharedMemoryRegion& region);
  absl::Status Unregister(const SharedMemoryRegion& region);

  // The plan for a call: nullopt for bytes. Zero copy when x, dy, dx (and rms) lie in one
  // registered region; otherwise, with kSharedMemory or kAuto against a server that offers it,
  // a staging region holding copies of x, dy and rms (dx is copied out by the caller). Errors:
  // kSharedMemory against a server that cannot take it (FAILED_PRECONDITION saying why).
  absl::StatusOr<std::optional<ShmPlan>> Plan(const RawBackwardArgs& args);

 private:
  struct Registered {
    const SharedMemoryRegion* region;
    uint64_t id;
    std::string key;
    uint64_t connection = 0;  // the connection it was registered on (connection_)
  };
  absl::Status ConnectLocked();
  // The connection is gone (closed by the server, or broken): its regions went with it on the
  // server. Forgets them; the next registration connects again.
  void DisconnectLocked();
  absl::StatusOr<Registered> RegisterLocked(const SharedMemoryRegion& region);
  // Waits for the reply to request `request_id`, up to reply_timeout_. Replies to other requests
  // are dropped: a late one to an abandoned registration gets its region released.
  absl::StatusOr<v1::RegionReply> AwaitReplyLocked(uint64_t request_id);
  // Sends the releases of discarded staging regions (no reply is awaited).
  void SendReleasesLocked();
  void SendReleaseLocked(uint64_t region_id);
  absl::StatusOr<bool> AvailableLocked();
  absl::StatusOr<std::shared_ptr<SharedMemoryRegion>> TakeStagingLocked(
      uint64_t bytes, Registered* registered, std::shared_ptr<std::atomic<bool>> discard);

  const Transport mode_;
  const std::string socket_path_;
  std::function<absl::StatusOr<bool>()> server_offers_;
  const absl::Duration reply_timeout_;
  std::mutex mu_;
  int fd_ = -1;                       // the region socket connection (guarded by mu_)
  uint64_t connection_ = 0;           // counts connections made; guarded by mu_
  uint64_t next_request_id_ = 1;      // guarded by mu_
  // Registrations given up on (no reply in time), by request id (guarded by mu_).
  absl::flat_hash_set<uint64_t> abandoned_;
  std::optional<absl::StatusOr<bool>> available_;  // guarded by mu_
  std::vector<Registered> registered_;  // guarded by mu_
  // Staging regions not in use (registered), shared with the plans that hold one: a plan
  // gives its region back when it goes, also after this transport went.
  struct StagingPool {
    std::mutex mu;
    std::vector<std::pair<std::unique_ptr<SharedMemoryRegion>, Registered>> free;
    // Discarded staging regions, still registered: (region id, connection).
    std::vector<std::pair<uint64_t, uint64_t>> to_release;
  };
  std::shared_ptr<StagingPool> pool_ = std::make_shared<StagingPool>();
};

// The region socket for a target: "unix:/p" and "unix:///p" -> "/p.shm"; other targets: "".
std::string RegionSocketPathFor(const std::string& target);

}  // namespace normgrad::client_internal
