#include "server/process/unix_grpc_listener.h"

#include <grpcpp/server_posix.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/unix_socket/unix_acceptor.h"

namespace normgrad::server {

bool UnixGrpcListener::Supported() {
#ifdef GPR_SUPPORT_CHANNELS_FROM_FD
  return true;
#else
  return false;
#endif
}

absl::StatusOr<std::unique_ptr<UnixGrpcListener>> UnixGrpcListener::Start(
    const std::string& path, mode_t mode, grpc::Server* server, UnixPeers* peers,
    std::vector<uint32_t> allowed_uids, std::atomic<uint64_t>* refused) {
  if (!Supported()) return absl::UnimplementedError("gRPC takes no connections from descriptors");
  absl::StatusOr<std::unique_ptr<UnixListenSocket>> socket = UnixListenSocket::Open(
      path, {.type = SOCK_STREAM, .mode = mode, .what = absl::StrCat("--listen=unix:", path)});
  if (!socket.ok()) return socket.status();
  std::unique_ptr<UnixGrpcListener> l(new UnixGrpcListener(*std::move(socket)));
  UnixListenSocket* s = l->socket_.get();
  s->Start([s, server, peers, allowed_uids = std::move(allowed_uids), refused] {
    UnixAcceptor acceptor(s->fd(), allowed_uids, "unix listener", refused);
    std::vector<pollfd> none;
    while (s->Poll(acceptor, none)) {
      while (std::optional<UnixPeer> peer = acceptor.AcceptOne()) {
        peers->Set(peer->fd, {peer->pid, peer->uid, peer->gid});
#ifdef GPR_SUPPORT_CHANNELS_FROM_FD
        grpc::AddInsecureChannelFromFd(server, peer->fd);  // gRPC owns the descriptor from here
#else
        close(peer->fd);
#endif
      }
    }
  });
  return l;
}

UnixGrpcListener::~UnixGrpcListener() { Stop(); }

void UnixGrpcListener::Stop() { socket_->Stop(); }

}  // namespace normgrad::server
