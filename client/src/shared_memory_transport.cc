#include "client/src/shared_memory_transport.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "client/src/descriptor_passing.h"
#include "normgrad/v1/normgrad.pb.h"

namespace normgrad {

absl::StatusOr<std::unique_ptr<SharedMemoryRegion>> SharedMemoryRegion::Create(uint64_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("shared-memory region: 0 bytes");
  const int fd = memfd_create("normgrad-region", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat("memfd_create: ", std::strerror(errno)));
  }
  auto fail = [fd](const char* what) {
    const int err = errno;
    close(fd);
    return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(err)));
  };
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) return fail("ftruncate");
  // Every page allocated now, by this process (and charged to its memory cgroup): the server
  // refuses a region with pages it would fault in itself (docs/api.md, "Shared memory").
  if (const int err = posix_fallocate(fd, 0, static_cast<off_t>(bytes)); err != 0) {
    close(fd);
    return absl::ResourceExhaustedError(absl::StrCat(
        "shared-memory region of ", bytes, " bytes: allocating its pages: ", std::strerror(err)));
  }
  // Sealed against shrinking (the server checks it: a shrunk mapping would SIGBUS it), growing
  // and further sealing.
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return fail("fcntl(F_ADD_SEALS)");
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (base == MAP_FAILED) return fail("mmap");
  return std::unique_ptr<SharedMemoryRegion>(
      new SharedMemoryRegion(fd, static_cast<uint8_t*>(base), bytes));
}

SharedMemoryRegion::~SharedMemoryRegion() {
  munmap(base_, size_);
  close(fd_);
}

bool SharedMemoryRegion::Contains(const void* p, uint64_t bytes) const {
  const auto a = reinterpret_cast<uintptr_t>(p);
  const auto b = reinterpret_cast<uintptr_t>(base_);
  return a >= b && a - b <= size_ && bytes <= size_ - (a - b);
}

namespace client_internal {

std::string RegionSocketPathFor(const std::string& target) {
  absl::string_view t = target;
  if (!absl::ConsumePrefix(&t, "unix:")) return "";
  if (absl::StartsWith(t, "//")) t.remove_prefix(2);
  if (t.empty()) return "";
  return absl::StrCat(t, ".shm");
}

SharedMemoryTransport::SharedMemoryTransport(Transport mode, std::string socket_path,
                                             std::function<absl::StatusOr<bool>()> server_offers,
                                             absl::Duration reply_timeout)
    : mode_(mode),
      socket_path_(std::move(socket_path)),
      server_offers_(std::move(server_offers)),
      reply_timeout_(reply_timeout) {}

SharedMemoryTransport::~SharedMemoryTransport() {
  // Closing the connection releases every region registered on it, on the server.
  if (fd_ >= 0) close(fd_);
}

absl::Status SharedMemoryTransport::ConnectLocked() {
  if (fd_ >= 0) return absl::OkStatus();
  if (socket_path_.empty()) {
    return absl::FailedPreconditionError(
        "shared memory needs the server's unix socket as the target (unix:/PATH)");
  }
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("socket: ", std::strerror(errno)));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (socket_path_.size() >= sizeof(addr.sun_path)) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat("region socket path too long: ", socket_path_));
  }
  std::memcpy(addr.sun_path, socket_path_.data(), socket_path_.size());
  if (connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int err = errno;
    close(fd);
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot reach the server's region socket ", socket_path_, ": ", std::strerror(err),
        " (is the server started with --shared-memory?)"));
  }
  fd_ = fd;
  ++connection_;
  return absl::OkStatus();
}

void SharedMemoryTransport::DisconnectLocked() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
  abandoned_.clear();
  registered_.clear();  // later calls stage their tensors, or the caller registers again
  std::lock_guard<std::mutex> lock(pool_->mu);
  pool_->free.clear();
  pool_->to_release.clear();
}

absl::StatusOr<v1::RegionReply> SharedMemoryTransport::AwaitReplyLocked(uint64_t request_id) {
  const absl::Time deadline = absl::Now() + reply_timeout_;
  while (true) {
    const absl::Duration left = deadline - absl::Now();
    pollfd p{fd_, POLLIN, 0};
    const int ready =
        left <= absl::ZeroDuration()
            ? 0
            : poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(left + absl::Milliseconds(1))));
    if (ready < 0 && errno == EINTR) continue;
    if (ready == 0) {
      abandoned_.insert(request_id);
      return absl::UnavailableError(absl::StrCat(
          "no answer to the region request within ", absl::FormatDuration(reply_timeout_),
          " (ClientOptions::region_reply_timeout); abandoned (a late answer is ignored)"));
    }
    if (ready < 0) {
      return absl::UnavailableError(absl::StrCat("region socket: poll: ", std::strerror(errno)));
    }
    char bytes[4096];
    // MSG_TRUNC: the datagram's real length, so that a longer one is seen for what it is.
    const ssize_t n = recv(fd_, bytes, sizeof(bytes), MSG_TRUNC | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (n <= 0) {
      const std::string why = n == 0 ? "connection closed by the server" : std::strerror(errno);
      DisconnectLocked();
      return absl::UnavailableError(absl::StrCat("region socket: ", why,
                                                 " (the next registration connects again)"));
    }
    v1::RegionReply reply;
    if (static_cast<size_t>(n) > sizeof(bytes) || !reply.ParseFromArray(bytes, static_cast<int>(n))) {
      continue;  // not a reply of this protocol: no request of ours can be matched to it
    }
    if (reply.request_id() == request_id) return reply;
    if (abandoned_.erase(reply.request_id()) > 0 && reply.code() == 0 && reply.region_id() != 0) {
      // A registration given up on did go through after all: its memfd is closed here.
      SendReleaseLocked(reply.region_id());
    }
  }
}

void SharedMemoryTransport::SendReleaseLocked(uint64_t region_id) {
  v1::RegionRequest request;
  request.set_release_region_id(region_id);
  request.set_request_id(next_request_id_++);  // its reply is dropped (AwaitReplyLocked)
  const std::string bytes = request.SerializeAsString();
  if (fd_ >= 0) (void)send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
}

void SharedMemoryTransport::SendReleasesLocked() {
  std::vector<std::pair<uint64_t, uint64_t>> ids;
  {
    std::lock_guard<std::mutex> lock(pool_->mu);
    ids.swap(pool_->to_release);
  }
  // A region of an earlier connection went with it.
  for (const auto& [id, connection] : ids) {
    if (fd_ >= 0 && connection == connection_) SendReleaseLocked(id);
  }
}

absl::StatusOr<SharedMemoryTransport::Registered> SharedMemoryTransport::RegisterLocked(
    const SharedMemoryRegion& region) {
  if (absl::Status s = ConnectLocked(); !s.ok()) return s;
  SendReleasesLocked();
  const uint64_t request_id = next_request_id_++;
  v1::RegionRequest request;
  request.set_register_region(true);
  request.set_request_id(request_id);
  if (SendWithDescriptor(fd_, request.SerializeAsString(), region.fd()) < 0) {
    const int err = errno;
    if (err == EPIPE || err == ECONNRESET || err == ENOTCONN) DisconnectLocked();
    return absl::UnavailableError(absl::StrCat("sending the region: ", std::strerror(err)));
  }
  absl::StatusOr<v1::RegionReply> answer = AwaitReplyLocked(request_id);
  if (!answer.ok()) {
    return absl::Status(answer.status().code(), absl::StrCat("registering a shared-memory region: ",
                                                             answer.status().message()));
  }
  const v1::RegionReply& reply = *answer;
  if (reply.code() != 0) {
    return absl::Status(static_cast<absl::StatusCode>(reply.code()), reply.message());
  }
  // A grant is taken only for this region as the server mapped it: its size and a whole key.
  if (reply.region_key().size() != 16 || reply.size_bytes() != region.size() ||
      reply.region_id() == 0) {
    SendReleaseLocked(reply.region_id());
    return absl::InternalError(absl::StrCat(
        "registering a shared-memory region: the server's grant does not fit the region (",
        reply.size_bytes(), " bytes for a region of ", region.size(), ", a key of ",
        reply.region_key().size(), " bytes, id ", reply.region_id(), "); not used"));
  }
  return Registered{&region, reply.region_id(), reply.region_key(), connection_};
}

absl::Status SharedMemoryTransport::Register(const SharedMemoryRegion& region) {
  std::lock_guard<std::mutex> lock(mu_);
  absl::StatusOr<Registered> r = RegisterLocked(region);
  if (!r.ok()) return r.status();
  registered_.push_back(*r);
  return absl::OkStatus();
}

absl::Status SharedMemoryTransport::Unregister(const SharedMemoryRegion& region) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = std::find_if(registered_.begin(), registered_.end(),
                         [&](const Registered& r) { return r.region == &region; });
  if (it == registered_.end()) {
    return absl::NotFoundError("UnregisterSharedMemory: the region is not registered here");
  }
  const uint64_t id = it->id;
  const bool on_this_connection = it->connection == connection_;
  registered_.erase(it);  // no later call plans with it, whatever the server answers
  if (fd_ < 0 || !on_this_connection) return absl::OkStatus();
  const uint64_t request_id = next_request_id_++;
  v1::RegionRequest request;
  request.set_release_region_id(id);
  request.set_request_id(request_id);
  const std::string bytes = request.SerializeAsString();
  if (send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL) < 0) {
    return absl::UnavailableError(absl::StrCat("releasing the region: ", std::strerror(errno)));
  }
  absl::StatusOr<v1::RegionReply> reply = AwaitReplyLocked(request_id);
  if (!reply.ok()) return reply.status();
  if (reply->code() != 0) {
    return absl::Status(static_cast<absl::StatusCode>(reply->code()), reply->message());
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> SharedMemoryTransport::AvailableLocked() {
  if (!available_.has_value()) {
    if (socket_path_.empty()) {
      available_ = false;
    } else {
      absl::StatusOr<bool> offers = server_offers_();
      // A failed GetServerInfo is not remembered: the next call asks again.
      if (!offers.ok()) return offers.status();
      available_ = *offers;
    }
  }
  return *available_;
}

absl::StatusOr<std::shared_ptr<SharedMemoryRegion>> SharedMemoryTransport::TakeStagingLocked(
    uint64_t bytes, Registered* registered, std::shared_ptr<std::atomic<bool>> discard) {
  std::unique_ptr<SharedMemoryRegion> region;
  {
    std::lock_guard<std::mutex> lock(pool_->mu);
    auto& free = pool_->free;
    auto it = std::find_if(free.begin(), free.end(), [&](const auto& e) {
      return e.first->size() >= bytes && e.second.connection == connection_;
    });
    if (it != free.end()) {
      region = std::move(it->first);
      *registered = it->second;
      free.erase(it);
    }
  }
  if (region == nullptr) {
    uint64_t size = uint64_t{1} << 20;
    while (size < bytes) size *= 2;
    absl::StatusOr<std::unique_ptr<SharedMemoryRegion>> created = SharedMemoryRegion::Create(size);
    if (!created.ok()) return created.status();
    absl::StatusOr<Registered> r = RegisterLocked(**created);
    if (!r.ok()) return r.status();
    *registered = *r;
    region = *std::move(created);
  }
  std::shared_ptr<StagingPool> pool = pool_;
  Registered entry = *registered;
  SharedMemoryRegion* raw = region.release();
  return std::shared_ptr<SharedMemoryRegion>(
      raw, [pool, entry, discard = discard](SharedMemoryRegion* r) {
        std::unique_ptr<SharedMemoryRegion> owned(r);
        std::lock_guard<std::mutex> lock(pool->mu);
        if (discard->load()) {
          // Unmapped and closed here as `owned` goes.
          pool->to_release.emplace_back(entry.id, entry.connection);
        } else {
          pool->free.emplace_back(std::move(owned), entry);
        }
      });
}

absl::StatusOr<std::optional<ShmPlan>> SharedMemoryTransport::Plan(const RawBackwardArgs& a) {
  if (mode_ == Transport::kBytes) return std::optional<ShmPlan>();
  std::unique_lock<std::mutex> lock(mu_);
  for (const Registered& r : registered_) {
    if (r.connection != connection_) continue;  // went with an earlier connection
    const SharedMemoryRegion& region = *r.region;
    if (region.Contains(a.x.data(), a.x.size()) && region.Contains(a.dy.data(), a.dy.size()) &&
        region.Contains(a.dx.data(), a.dx.size()) &&
        (a.rms.empty() || region.Contains(a.rms.data(), a.rms.size()))) {
      ShmPlan plan;
      plan.region_id = r.id;
      plan.region_key = r.key;
      plan.x = static_cast<uint64_t>(a.x.data() - region.data());
      plan.dy = static_cast<uint64_t>(a.dy.data() - region.data());
      plan.dx = static_cast<uint64_t>(a.dx.data() - region.data());
      plan.rms = a.rms.empty() ? 0 : static_cast<uint64_t>(a.rms.data() - region.data());
      return std::optional<ShmPlan>(std::move(plan));
    }
  }
  absl::StatusOr<bool> available = AvailableLocked();
  if (!available.ok() || !*available) {
    if (mode_ == Transport::kAuto) return std::optional<ShmPlan>();  // bytes, as before
    if (!available.ok()) return available.status();
    return absl::FailedPreconditionError(
        socket_path_.empty()
            ? "transport=shm needs the server's unix socket as the target (unix:/PATH)"
            : "transport=shm: the server takes no shared memory (start it with --shared-memory)");
  }
  // Staging: x, dy, rms, dx one after the other (every offset a multiple of 4).
  const uint64_t x_bytes = a.x.size(), rms_bytes = a.rms.size();
  ShmPlan plan;
  Registered registered{};
  absl::StatusOr<std::shared_ptr<SharedMemoryRegion>> staging =
      TakeStagingLocked(3 * x_bytes + rms_bytes, &registered, plan.discard_staging);
  if (!staging.ok()) {
    if (mode_ == Transport::kAuto) return std::optional<ShmPlan>();
    return staging.status();
  }
  plan.staging = *std::move(staging);
  plan.region_id = registered.id;
  plan.region_key = registered.key;
  plan.x = 0;
  plan.dy = x_bytes;
  plan.rms = 2 * x_bytes;
  plan.dx = 2 * x_bytes + rms_bytes;
  lock.unlock();  // the staging region is this call's alone: copy without holding others up
  uint8_t* base = plan.staging->data();
  std::memcpy(base + plan.x, a.x.data(), x_bytes);
  std::memcpy(base + plan.dy, a.dy.data(), x_bytes);
  if (rms_bytes > 0) std::memcpy(base + plan.rms, a.rms.data(), rms_bytes);
  return std::optional<ShmPlan>(std::move(plan));
}

}  // namespace client_internal
}  // namespace normgrad
