#include "server/shared_memory/region_socket.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "normgrad/v1/normgrad.pb.h"
#include "server/listen_socket/acceptor.h"

namespace normgrad::server {
namespace {

constexpr size_t kMaxMessageBytes = 4096;
constexpr int kMaxFdsPerMessage = 4;

struct Connection {
  int fd = -1;
  uint64_t id = 0;
  RegionOwner owner;
};

// Closes descriptors on a thread of its own, which nothing waits for: closing what a client
// passed may block for as long as the client chooses (a socket with SO_LINGER whose peer does
// not read, a file of a FUSE mount the client serves), and the thread that serves every region
// connection, or a drain, must not wait for that. The thread is never joined.
void CloseInBackground(int fd) {
  struct Queue {
    std::mutex mu;
    std::condition_variable ready;
    std::deque<int> fds;
  };
  static Queue* const queue = [] {
    auto* q = new Queue;  // lives as long as the process: the thread may outlive any owner
    std::thread([q] {
      while (true) {
        int next;
        {
          std::unique_lock<std::mutex> lock(q->mu);
          q->ready.wait(lock, [q] { return !q->fds.empty(); });
          next = q->fds.front();
          q->fds.pop_front();
        }
        close(next);
      }
    }).detach();
    return q;
  }();
  {
    std::lock_guard<std::mutex> lock(queue->mu);
    queue->fds.push_back(fd);
  }
  queue->ready.notify_one();
}

// A descriptor a client passed: kept when it may be a region (a memfd: its close never
// blocks), else closed in the background at once.
OwnedFd TakePassed(int fd) {
  if (fcntl(fd, F_GET_SEALS) >= 0) return OwnedFd(fd);
  CloseInBackground(fd);
  return OwnedFd();
}

// One datagram and the descriptors that came with it (all but the first are closed: a
// registration takes one).
struct Received {
  ssize_t bytes = 0;  // 0: the peer closed; -1: error (errno in `error`); -2: too long
  int error = 0;
  std::string data;
  OwnedFd fd;
  int fds = 0;
};

Received ReceiveMessage(int fd) {
  Received r;
  std::vector<char> buffer(kMaxMessageBytes);
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage)];
  iovec iov{buffer.data(), buffer.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  r.bytes = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
  if (r.bytes < 0) {
    r.error = errno;
    return r;
  }
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < n; ++i) {
      int passed;
      std::memcpy(&passed, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      if (r.fds++ == 0) {
        r.fd = TakePassed(passed);  // not a memfd: closed, and Register says so
      } else {
        CloseInBackground(passed);
      }
    }
  }
  if ((msg.msg_flags & MSG_TRUNC) != 0) r.bytes = -2;  // longer than any request
  r.data.assign(buffer.data(), static_cast<size_t>(std::max<ssize_t>(r.bytes, 0)));
  return r;
}

void Reply(int fd, uint64_t request_id, const absl::Status& status, const RegionGrant* grant) {
  v1::RegionReply reply;
  reply.set_request_id(request_id);
  reply.set_code(static_cast<int32_t>(status.code()));
  reply.set_message(std::string(status.message()));
  if (grant != nullptr) {
    reply.set_region_id(grant->id);
    reply.set_region_key(grant->key.data(), grant->key.size());
    reply.set_size_bytes(grant->size);
  }
  const std::string bytes = reply.SerializeAsString();
  // A client that does not read its replies only loses them.
  (void)send(fd, bytes.data(), bytes.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
}

absl::Status Handle(RegionRegistry& registry, const Connection& c, Received& r,
                    RegionGrant* grant, uint64_t* request_id) {
  if (r.bytes == -2) {
    return absl::InvalidArgumentError(
        absl::StrCat("request longer than ", kMaxMessageBytes, " bytes"));
  }
  if (r.bytes == 0) {
    return absl::InvalidArgumentError("an empty message is not a normgrad.v1.RegionRequest");
  }
  v1::RegionRequest request;
  if (!request.ParseFromString(r.data)) {
    return absl::InvalidArgumentError("the message is not a normgrad.v1.RegionRequest");
  }
  *request_id = request.request_id();
  if (request.register_region()) {
    if (r.fds != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a registration carries exactly one file descriptor (SCM_RIGHTS); this one carried ",
          r.fds));
    }
    absl::StatusOr<RegionGrant> g = registry.Register(std::move(r.fd), c.owner);
    if (!g.ok()) return g.status();
    *grant = *g;
    std::fprintf(stderr, "normgrad-server: shared-memory region %llu registered (%llu bytes) by "
                 "pid %d uid %u\n", static_cast<unsigned long long>(g->id),
                 static_cast<unsigned long long>(g->size), static_cast<int>(c.owner.pid),
                 static_cast<unsigned>(c.owner.uid));
    return absl::OkStatus();
  }
  if (request.release_region_id() != 0) {
    return registry.Release(request.release_region_id(), c.id);
  }
  return absl::InvalidArgumentError("the request neither registers nor releases a region");
}

}  // namespace

absl::StatusOr<std::unique_ptr<RegionSocket>> RegionSocket::Start(
    const std::string& path, const RegionSocketOptions& options, RegionRegistry* registry) {
  absl::StatusOr<std::unique_ptr<ListenSocket>> socket = ListenSocket::Open(
      path, {.type = SOCK_SEQPACKET, .mode = options.mode, .backlog = 64,
             .what = absl::StrCat("region socket ", path), .remove_on_stop = true});
  if (!socket.ok()) return socket.status();
  std::unique_ptr<RegionSocket> s(new RegionSocket(*std::move(socket), registry, options));
  s->socket_->Start([raw = s.get()] { raw->Run(); });
  return s;
}

RegionSocket::RegionSocket(std::unique_ptr<ListenSocket> socket, RegionRegistry* registry,
                           RegionSocketOptions options)
    : options_(std::move(options)), registry_(registry), socket_(std::move(socket)) {}

RegionSocket::~RegionSocket() { Stop(); }

void RegionSocket::Stop() { socket_->Stop(); }

void RegionSocket::Run() {
  std::vector<Connection> connections;
  absl::flat_hash_map<uid_t, uint32_t> per_user;  // connections by the peer's uid
  uint64_t next_id = 1;
  Acceptor acceptor(socket_->fd(), options_.allowed_uids, "region socket " + path(),
                        options_.refused_peers);
  auto drop = [&](size_t i) {
    const int released = registry_->ReleaseOwner(connections[i].id);
    if (released > 0) {
      std::fprintf(stderr, "normgrad-server: %d shared-memory region(s) of pid %d released (its "
                   "region connection closed)\n", released, static_cast<int>(connections[i].owner.pid));
    }
    if (auto it = per_user.find(connections[i].owner.uid); it != per_user.end() && --it->second == 0) {
      per_user.erase(it);
    }
    close(connections[i].fd);
    connections.erase(connections.begin() + static_cast<std::ptrdiff_t>(i));
  };
  std::vector<pollfd> polled;
  while (true) {
    polled.clear();
    for (const Connection& c : connections) polled.push_back({c.fd, POLLIN | POLLRDHUP, 0});
    if (!socket_->Poll(acceptor, polled)) break;
    // Connections first (their indexes match `polled` only before any is dropped).
    for (size_t i = connections.size(); i-- > 0;) {
      const short revents = polled[i].revents;
      if (revents == 0) continue;
      Received r = ReceiveMessage(connections[i].fd);
      if (r.bytes == -1 && (r.error == EAGAIN || r.error == EINTR)) continue;
      // recvmsg gives 0 bytes both for the peer's close and for an empty datagram: only the
      // hang-up tells them apart.
      const bool closed = r.bytes == 0 && (revents & (POLLHUP | POLLRDHUP | POLLERR)) != 0;
      if (closed || r.bytes == -1) {  // closed (the client went away) or broken
        drop(i);
        continue;
      }
      RegionGrant grant;
      uint64_t request_id = 0;
      const absl::Status s = Handle(*registry_, connections[i], r, &grant, &request_id);
      Reply(connections[i].fd, request_id, s, s.ok() && grant.id != 0 ? &grant : nullptr);
    }
    while (std::optional<AcceptedPeer> peer = acceptor.AcceptOne()) {
      uint32_t& mine = per_user[peer->uid];
      if (connections.size() >= options_.max_connections ||
          mine >= options_.max_connections_per_user) {
        if (mine == 0) per_user.erase(peer->uid);
        close(peer->fd);
        if (options_.refused_over_bound != nullptr) options_.refused_over_bound->fetch_add(1);
        continue;
      }
      ++mine;
      Connection c;
      c.fd = peer->fd;
      c.id = next_id++;
      c.owner.connection = c.id;
      c.owner.pid = peer->pid;
      c.owner.uid = peer->uid;
      connections.push_back(c);
    }
  }
  while (!connections.empty()) drop(connections.size() - 1);
}

}  // namespace normgrad::server
