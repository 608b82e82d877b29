#include "server/process/grpc_listener.h"

#include <grpcpp/server_posix.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/listen_socket/acceptor.h"
#include "server/listen_socket/peer_uid.h"

namespace normgrad::server {
namespace {

// Hands an accepted connection to gRPC, which owns the descriptor from here.
void HandOver(grpc::Server* server, int fd) {
#ifdef GPR_SUPPORT_CHANNELS_FROM_FD
  grpc::AddInsecureChannelFromFd(server, fd);
#else
  (void)server;
  close(fd);
#endif
}

// The one thread of a listening socket: accept while descriptors last, pause while they do not.
void Serve(ListenSocket* s, Acceptor& acceptor,
           const std::function<void(const AcceptedPeer&)>& take) {
  std::vector<pollfd> none;
  while (s->Poll(acceptor, none)) {
    while (std::optional<AcceptedPeer> peer = acceptor.AcceptOne()) take(*peer);
  }
}

}  // namespace

bool GrpcListener::Supported() {
#ifdef GPR_SUPPORT_CHANNELS_FROM_FD
  return true;
#else
  return false;
#endif
}

absl::StatusOr<std::unique_ptr<GrpcListener>> GrpcListener::StartUnix(
    const std::string& path, mode_t mode, grpc::Server* server, AcceptedPeers* peers,
    std::vector<uint32_t> allowed_uids, std::atomic<uint64_t>* refused) {
  if (!Supported()) return absl::UnimplementedError("gRPC takes no connections from descriptors");
  absl::StatusOr<std::unique_ptr<ListenSocket>> socket = ListenSocket::Open(
      path, {.type = SOCK_STREAM, .mode = mode, .what = absl::StrCat("--listen=unix:", path)});
  if (!socket.ok()) return socket.status();
  std::unique_ptr<GrpcListener> l(new GrpcListener());
  ListenSocket* s = socket->get();
  l->sockets_.push_back(*std::move(socket));
  s->Start([s, server, peers, allowed_uids = std::move(allowed_uids), refused] {
    Acceptor acceptor(s->fd(), allowed_uids, "unix listener", refused);
    Serve(s, acceptor, [&](const AcceptedPeer& peer) {
      peers->Set(peer.fd, {peer.pid, peer.uid, peer.gid});
      HandOver(server, peer.fd);
    });
  });
  return l;
}

absl::StatusOr<std::unique_ptr<GrpcListener>> GrpcListener::StartTcp(const std::string& host,
                                                                      int port,
                                                                      grpc::Server* server,
                                                                      AcceptedPeers* peers,
                                                                      const std::string& what) {
  if (!Supported()) return absl::UnimplementedError("gRPC takes no connections from descriptors");
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV | AI_ADDRCONFIG;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (const int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &found); rc != 0) {
    return absl::UnavailableError(
        absl::StrCat(what, ": cannot resolve ", host, ": ", gai_strerror(rc)));
  }
  std::unique_ptr<GrpcListener> l(new GrpcListener());
  absl::Status status = absl::OkStatus();
  for (addrinfo* a = found; a != nullptr && status.ok(); a = a->ai_next) {
    sockaddr_storage address{};
    std::memcpy(&address, a->ai_addr, a->ai_addrlen);
    if (!l->sockets_.empty()) {  // the port the first address got, when 0 was asked for
      const uint16_t chosen = htons(static_cast<uint16_t>(l->sockets_.front()->port()));
      if (address.ss_family == AF_INET) reinterpret_cast<sockaddr_in*>(&address)->sin_port = chosen;
      if (address.ss_family == AF_INET6) {
        reinterpret_cast<sockaddr_in6*>(&address)->sin6_port = chosen;
      }
    }
    absl::StatusOr<std::unique_ptr<ListenSocket>> socket = ListenSocket::OpenTcp(
        reinterpret_cast<const sockaddr*>(&address), a->ai_addrlen, {.what = what});
    if (!socket.ok()) {
      status = socket.status();
      break;
    }
    l->sockets_.push_back(*std::move(socket));
  }
  freeaddrinfo(found);
  if (!status.ok()) return status;
  if (l->sockets_.empty()) return absl::UnavailableError(absl::StrCat(what, ": no address"));
  for (const std::unique_ptr<ListenSocket>& socket : l->sockets_) {
    ListenSocket* s = socket.get();
    s->Start([s, server, peers, what] {
      Acceptor acceptor(s->fd(), {}, what);
      Serve(s, acceptor, [&](const AcceptedPeer& peer) {
        // gRPC's own listener does the same: small messages are not held back.
        const int one = 1;
        setsockopt(peer.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        if (peers != nullptr) {
          peers->SetTcp(peer.fd,
                        TcpPeerAddress(reinterpret_cast<const sockaddr*>(&peer.address),
                                       peer.address_len),
                        LoopbackPeerUidOf(peer.fd));
        }
        HandOver(server, peer.fd);
      });
    });
  }
  return l;
}

GrpcListener::~GrpcListener() { Stop(); }

void GrpcListener::Stop() {
  for (const std::unique_ptr<ListenSocket>& s : sockets_) s->Stop();
}

int GrpcListener::port() const { return sockets_.empty() ? 0 : sockets_.front()->port(); }

}  // namespace normgrad::server
