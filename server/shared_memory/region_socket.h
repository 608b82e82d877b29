// The region socket: where co-located clients register shared-memory regions. A unix
// SOCK_SEQPACKET socket (message boundaries kept, file descriptors passed with SCM_RIGHTS), one
// thread polling it and its connections. Each message is a normgrad.v1.RegionRequest, each answer a
// RegionReply; a region registered on a connection is released when that connection closes,
// so a client that dies leaves nothing behind.
//
//   absl::StatusOr<std::unique_ptr<RegionSocket>> s =
//       RegionSocket::Start("/run/normgrad/grpc.sock.shm", &registry);
//   ...
//   (*s)->Stop();   // closes every connection (their regions are released) and the socket
#ifndef NORMGRAD_SERVER_SHARED_MEMORY_REGION_SOCKET_H_
#define NORMGRAD_SERVER_SHARED_MEMORY_REGION_SOCKET_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "server/shared_memory/region_registry.h"

namespace normgrad::server {

class RegionSocket {
 public:
  // Most connections at once; more are accepted and closed at once (a client retries).
  static constexpr int kMaxConnections = 1024;

  // Binds and listens on `path` (which must be free: the caller removes a stale socket) with
  // file mode `mode`.
  static absl::StatusOr<std::unique_ptr<RegionSocket>> Start(const std::string& path, mode_t mode,
                                                             RegionRegistry* registry);
  ~RegionSocket();  // Stop()
  void Stop();

  const std::string& path() const { return path_; }

 private:
  RegionSocket(std::string path, int listen_fd, int wake_fd, RegionRegistry* registry);
  void Run();

  const std::string path_;
  const int listen_fd_;
  const int wake_fd_;  // an eventfd: Stop writes it to end Run
  RegionRegistry* const registry_;
  ino_t inode_ = 0;
  std::atomic<bool> stopped_{false};
  std::thread thread_;
};

}  // namespace normgrad::server

#endif  // NORMGRAD_SERVER_SHARED_MEMORY_REGION_SOCKET_H_
