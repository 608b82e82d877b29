// Shared-memory regions that co-located clients registered (docs/api.md, "Shared memory"): each
// is a memfd sealed against shrinking, mapped read-write here, so the server reads x and dy and
// writes grad_input in place and no payload byte crosses a socket.
//
//   RegionRegistry registry({.max_regions = 64, .max_bytes = 8ull << 30});
//   absl::StatusOr<RegionGrant> g = registry.Register(std::move(fd), owner);  // fd: the memfd
//   absl::StatusOr<std::shared_ptr<const MappedRegion>> r = registry.Find(g->id, g->key);
//   ... r->data() ... (the mapping lives while anyone holds the shared_ptr)
//   registry.ReleaseOwner(owner.connection);   // the client's connection closed
//
// Why a sealed memfd: a mapped file that its owner truncates raises SIGBUS in every reader. The
// kernel refuses to shrink a memfd with F_SEAL_SHRINK, and seals cannot be removed, so once the
// seal is checked here no client can pull the pages from under the server.
//
// Ownership: a region is found only with its 16-byte random key, which only the registering
// client receives; a wrong key and an unknown id give the same NOT_FOUND, so ids cannot be probed.
// Thread-safe.
#pragma once

#include <sys/types.h>

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace normgrad::server {

struct RegionLimits {
  uint32_t max_regions = 64;           // --shared-memory-max-regions
  uint64_t max_bytes = 16ull << 30;    // --shared-memory-max-bytes, all regions together
  // One user's share (the registering peer's uid): no user can take every region or byte.
  // 0: no share of its own (the totals).
  uint32_t max_regions_per_user = 0;   // --shared-memory-max-regions-per-user
  uint64_t max_bytes_per_user = 0;     // --shared-memory-max-bytes-per-user
};

using RegionKey = std::array<uint8_t, 16>;

// Who registered a region: the connection on the region socket (regions go when it closes) and
// the peer's credentials from SO_PEERCRED, for the log.
struct RegionOwner {
  uint64_t connection = 0;
  pid_t pid = 0;
  uid_t uid = 0;
};

struct RegionGrant {
  uint64_t id = 0;
  RegionKey key{};
  uint64_t size = 0;
};

// What the compute backend does with each mapping: register it for copies in place (the CUDA
// backend page-locks it with cuMemHostRegister) and let go of it before it is unmapped. A failed
// on_map only costs speed (chunks are staged); it is not an error of the registration.
struct HostMemoryHooks {
  std::function<absl::Status(void* base, uint64_t bytes)> on_map;
  std::function<void(void* base)> on_unmap;
};

// A file descriptor closed on destruction.
class OwnedFd {
 public:
  OwnedFd() = default;
  explicit OwnedFd(int fd) : fd_(fd) {}
  OwnedFd(OwnedFd&& other) noexcept : fd_(other.release()) {}
  OwnedFd& operator=(OwnedFd&& other) noexcept;
  ~OwnedFd();
  int get() const { return fd_; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_ = -1;
};

// One mapping of a registered memfd; unmapped when the last holder lets go.
class MappedRegion {
 public:
  MappedRegion(uint8_t* base, uint64_t size, std::function<void(void*)> on_unmap = nullptr,
               OwnedFd fd = OwnedFd())
      : base_(base), size_(size), on_unmap_(std::move(on_unmap)), fd_(std::move(fd)) {}
  ~MappedRegion();
  MappedRegion(const MappedRegion&) = delete;
  MappedRegion& operator=(const MappedRegion&) = delete;

  uint8_t* data() const { return base_; }
  uint64_t size() const { return size_; }
  // OK when every page of the memfd is allocated now (by its client: the server faults none
  // in); FAILED_PRECONDITION naming `field` and the numbers otherwise. A mapping made without
  // its descriptor (tests) is taken as allocated.
  absl::Status CheckAllocated(absl::string_view field) const;

 private:
  uint8_t* const base_;
  const uint64_t size_;
  const std::function<void(void*)> on_unmap_;
  const OwnedFd fd_;
};

struct RegionStats {
  uint64_t regions = 0;
  uint64_t bytes = 0;
  uint64_t registered = 0;  // since start
  uint64_t refused = 0;     // registrations refused (bad fd, seals, limits)
};

class RegionRegistry {
 public:
  explicit RegionRegistry(const RegionLimits& limits, HostMemoryHooks hooks = {})
      : limits_(limits), hooks_(std::move(hooks)) {}

  // Checks and maps `fd`: a memfd (F_GET_SEALS works) sealed with F_SEAL_SHRINK, not sealed
  // against writes, of 1 byte or more, every page allocated, within the limits and the owner's
  // share of them. INVALID_ARGUMENT naming what is wrong (FAILED_PRECONDITION for a missing
  // seal or unallocated pages, RESOURCE_EXHAUSTED past a limit).
  absl::StatusOr<RegionGrant> Register(OwnedFd fd, const RegionOwner& owner);
  // The region `id` if `key` is its key; NOT_FOUND otherwise (same message either way).
  absl::StatusOr<std::shared_ptr<const MappedRegion>> Find(uint64_t id,
                                                           absl::string_view key) const;
  // Releases region `id` if `connection` registered it; NOT_FOUND otherwise.
  absl::Status Release(uint64_t id, uint64_t connection);
  // Releases every region `connection` registered (it closed); returns how many.
  int ReleaseOwner(uint64_t connection);

  RegionStats Stats() const;
  const RegionLimits& limits() const { return limits_; }

 private:
  struct Entry {
    std::shared_ptr<const MappedRegion> mapping;
    RegionKey key;
    RegionOwner owner;
  };

  // Takes a region being released off the byte and per-user counts.
  void ForgetLocked(const Entry& entry);
  // The owner's share is full (RESOURCE_EXHAUSTED saying which), or OK.
  absl::Status CheckRoomLocked(uint64_t size, uid_t uid) const;

  struct UserUsage {
    uint32_t regions = 0;
    uint64_t bytes = 0;
  };

  const RegionLimits limits_;
  const HostMemoryHooks hooks_;
  mutable std::mutex mu_;
  absl::flat_hash_map<uid_t, UserUsage> by_user_;  // guarded by mu_
  uint64_t next_id_ = 1;  // guarded by mu_
  absl::flat_hash_map<uint64_t, Entry> regions_;  // guarded by mu_
  uint64_t bytes_ = 0;  // guarded by mu_
  uint64_t registered_ = 0;  // guarded by mu_
  uint64_t refused_ = 0;  // guarded by mu_
};

// Checks a chunk's byte range [offset, offset + bytes) against a region of `region_size` bytes
// and an alignment, without overflow: INVALID_ARGUMENT naming `field` and the numbers.
absl::Status CheckRegionRange(absl::string_view field, uint64_t offset, uint64_t bytes,
                              uint64_t region_size, uint64_t alignment);

}  // namespace normgrad::server
