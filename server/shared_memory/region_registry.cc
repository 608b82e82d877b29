#include "server/shared_memory/region_registry.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace normgrad::server {

OwnedFd& OwnedFd::operator=(OwnedFd&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) close(fd_);
    fd_ = other.release();
  }
  return *this;
}

OwnedFd::~OwnedFd() {
  if (fd_ >= 0) close(fd_);
}

MappedRegion::~MappedRegion() {
  if (on_unmap_) on_unmap_(base_);
  munmap(base_, size_);
}

namespace {

// Bytes of the region's pages that are allocated, of its first `size` bytes. st_blocks counts
// every allocated page of the file, also pages past its end (fallocate with
// FALLOC_FL_KEEP_SIZE, which F_SEAL_GROW does not stop), which would hide as many holes inside:
// those are given back first (they are no part of the region). (SEEK_HOLE cannot tell: on
// tmpfs, a page fallocated and not yet written reads as a hole.)
absl::StatusOr<uint64_t> AllocatedBytes(int fd, uint64_t size) {
  if (fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(size),
                std::numeric_limits<off_t>::max() - static_cast<off_t>(size)) != 0) {
    return absl::InternalError(
        absl::StrCat("fallocate(PUNCH_HOLE) past the region's end: ", std::strerror(errno)));
  }
  struct stat st;
  if (fstat(fd, &st) != 0) return absl::InternalError(absl::StrCat("fstat: ", std::strerror(errno)));
  return static_cast<uint64_t>(st.st_blocks) * 512;
}

absl::Status UnallocatedError(absl::string_view field, uint64_t allocated, uint64_t size) {
  return absl::FailedPreconditionError(absl::StrCat(
      field, ": ", allocated, " of the region's ", size, " bytes are allocated; the server "
      "does not fault in a client's pages (they would be charged to its memory): allocate "
      "every page first (posix_fallocate(fd, 0, size), as the client library does)"));
}

}  // namespace

absl::Status MappedRegion::CheckAllocated(absl::string_view field) const {
  if (fd_.get() < 0) return absl::OkStatus();
  absl::StatusOr<uint64_t> allocated = AllocatedBytes(fd_.get(), size_);
  if (!allocated.ok()) return allocated.status();
  if (*allocated < size_) return UnallocatedError(field, *allocated, size_);
  return absl::OkStatus();
}

absl::Status RegionRegistry::CheckRoomLocked(uint64_t size, uid_t uid) const {
  if (regions_.size() >= limits_.max_regions) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the server holds ", regions_.size(), " shared-memory regions, its limit "
        "(--shared-memory-max-regions=", limits_.max_regions, "); release one first"));
  }
  if (size > limits_.max_bytes - bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "a region of ", size, " bytes on top of the ", bytes_, " registered exceeds "
        "--shared-memory-max-bytes=", limits_.max_bytes));
  }
  UserUsage usage;
  if (auto it = by_user_.find(uid); it != by_user_.end()) usage = it->second;
  if (limits_.max_regions_per_user > 0 && usage.regions >= limits_.max_regions_per_user) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "uid:", uid, " holds ", usage.regions, " shared-memory regions, its share "
        "(--shared-memory-max-regions-per-user=", limits_.max_regions_per_user,
        "); release one first"));
  }
  if (limits_.max_bytes_per_user > 0 && size > limits_.max_bytes_per_user - usage.bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "a region of ", size, " bytes on top of the ", usage.bytes, " uid:", uid,
        " registered exceeds its share (--shared-memory-max-bytes-per-user=",
        limits_.max_bytes_per_user, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<RegionGrant> RegionRegistry::Register(OwnedFd fd, const RegionOwner& owner) {
  auto refuse = [this](absl::Status s) {
    std::lock_guard<std::mutex> lock(mu_);
    ++refused_;
    return s;
  };
  const int seals = fcntl(fd.get(), F_GET_SEALS);
  if (seals < 0) {
    return refuse(absl::InvalidArgumentError(
        "the region's file descriptor is not a memfd (F_GET_SEALS failed): create it with "
        "memfd_create(..., MFD_ALLOW_SEALING)"));
  }
  if ((seals & F_SEAL_SHRINK) == 0) {
    return refuse(absl::FailedPreconditionError(
        "the region's memfd is not sealed with F_SEAL_SHRINK: seal it after ftruncate, so that "
        "it cannot be shrunk under the server"));
  }
  if ((seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)) != 0) {
    return refuse(absl::InvalidArgumentError(
        "the region's memfd is sealed against writes; the server writes grad_input into it"));
  }
  struct stat st;
  if (fstat(fd.get(), &st) != 0) {
    return refuse(absl::InvalidArgumentError(absl::StrCat("fstat: ", std::strerror(errno))));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size == 0) {
    return refuse(absl::InvalidArgumentError("the region is 0 bytes; ftruncate it first"));
  }
  absl::StatusOr<uint64_t> allocated = AllocatedBytes(fd.get(), size);
  if (!allocated.ok()) return refuse(allocated.status());
  if (*allocated < size) return refuse(UnallocatedError("the region", *allocated, size));
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (absl::Status s = CheckRoomLocked(size, owner.uid); !s.ok()) {
      ++refused_;
      return s;
    }
  }
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (base == MAP_FAILED) {
    return refuse(absl::InvalidArgumentError(
        absl::StrCat("mmap of the region (", size, " bytes): ", std::strerror(errno))));
  }
  std::function<void(void*)> on_unmap;
  if (hooks_.on_map) {
    if (absl::Status s = hooks_.on_map(base, size); s.ok()) {
      on_unmap = hooks_.on_unmap;
    } else {
      std::fprintf(stderr, "normgrad-server: shared-memory region of %llu bytes not registered "
                   "with the backend (its chunks are staged): %s\n",
                   static_cast<unsigned long long>(size), std::string(s.message()).c_str());
    }
  }
  auto mapping = std::make_shared<const MappedRegion>(static_cast<uint8_t*>(base), size,
                                                      std::move(on_unmap), std::move(fd));
  RegionGrant grant;
  grant.size = size;
  if (getrandom(grant.key.data(), grant.key.size(), 0) != static_cast<ssize_t>(grant.key.size())) {
    return refuse(absl::InternalError("getrandom failed for the region key"));
  }
  std::lock_guard<std::mutex> lock(mu_);
  // Checked again: another registration may have taken the room meanwhile.
  if (absl::Status s = CheckRoomLocked(size, owner.uid); !s.ok()) {
    ++refused_;
    return s;
  }
  grant.id = next_id_++;
  regions_[grant.id] = Entry{std::move(mapping), grant.key, owner};
  bytes_ += size;
  UserUsage& usage = by_user_[owner.uid];
  ++usage.regions;
  usage.bytes += size;
  ++registered_;
  return grant;
}

absl::StatusOr<std::shared_ptr<const MappedRegion>> RegionRegistry::Find(
    uint64_t id, absl::string_view key) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = regions_.find(id);
  bool match = it != regions_.end() && key.size() == it->second.key.size();
  if (match) {
    uint8_t diff = 0;  // constant time in the key's bytes
    for (size_t i = 0; i < key.size(); ++i) {
      diff |= static_cast<uint8_t>(key[i]) ^ it->second.key[i];
    }
    match = diff == 0;
  }
  if (!match) {
    return absl::NotFoundError(absl::StrCat(
        "shm.region_id=", id, ": no registered region with this id and shm.region_key (regions "
        "belong to the client that registered them, and go when its region connection closes)"));
  }
  return it->second.mapping;
}

absl::Status RegionRegistry::Release(uint64_t id, uint64_t connection) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = regions_.find(id);
  if (it == regions_.end() || it->second.owner.connection != connection) {
    return absl::NotFoundError(
        absl::StrCat("region ", id, " is not registered on this connection"));
  }
  ForgetLocked(it->second);
  regions_.erase(it);
  return absl::OkStatus();
}

void RegionRegistry::ForgetLocked(const Entry& entry) {
  const uint64_t size = entry.mapping->size();
  bytes_ -= size;
  auto it = by_user_.find(entry.owner.uid);
  if (it == by_user_.end()) return;
  --it->second.regions;
  it->second.bytes -= size;
  if (it->second.regions == 0) by_user_.erase(it);
}

int RegionRegistry::ReleaseOwner(uint64_t connection) {
  std::lock_guard<std::mutex> lock(mu_);
  int released = 0;
  for (auto it = regions_.begin(); it != regions_.end();) {
    if (it->second.owner.connection == connection) {
      ForgetLocked(it->second);
      regions_.erase(it++);
      ++released;
    } else {
      ++it;
    }
  }
  return released;
}

RegionStats RegionRegistry::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {regions_.size(), bytes_, registered_, refused_};
}

absl::Status CheckRegionRange(absl::string_view field, uint64_t offset, uint64_t bytes,
                              uint64_t region_size, uint64_t alignment) {
  if (offset % alignment != 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, " is ", offset,
                                                   ", not a multiple of ", alignment));
  }
  if (offset > region_size || bytes > region_size - offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " is ", offset, " with ", bytes, " bytes to access, past the end of the ",
        region_size, "-byte region"));
  }
  return absl::OkStatus();
}

}  // namespace normgrad::server
