// The addresses the gRPC service listens on (--listen, repeatable): HOST:PORT for TCP, or
// unix:/PATH for a unix-domain socket, so that clients on the same machine (a sidecar in the
// same pod, a training process on the same node) skip the TCP stack and can use the shared-memory
// transport (docs/api.md).
//
//   absl::StatusOr<ListenAddress> a = ParseListenAddress("unix:/run/normgrad/grpc.sock");
//   NORMGRAD_RETURN_IF_ERROR(PrepareUnixSocketPath(a->path));   // before gRPC binds
//   ... builder.AddListeningPort(a->text, ...); BuildAndStart ...
//   NORMGRAD_RETURN_IF_ERROR(SetUnixSocketMode(a->path, 0660));  // after
#pragma once

#include <sys/socket.h>
#include <sys/types.h>

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace normgrad::server {

struct ListenAddress {
  enum Kind { kTcp, kUnix } kind = kTcp;
  std::string text;  // as given; what gRPC's AddListeningPort takes
  std::string host;  // kTcp
  int port = 0;      // kTcp; 0 picks a free one
  std::string path;  // kUnix: an absolute or relative file name
};

// "HOST:PORT", "[::1]:PORT" or "unix:PATH" (unix:/abs and unix:rel both). INVALID_ARGUMENT
// naming --listen and the value otherwise; a PATH too long for sockaddr_un (107 bytes) included.
absl::StatusOr<ListenAddress> ParseListenAddress(absl::string_view text);

// Makes `path` free to bind: nothing there is fine; a socket nobody listens on (left by a server
// that died) is removed; a socket a live server listens on is UNAVAILABLE ("in use"), and so is
// anything that is not a socket (never removed: it may be someone's file).
// `type`: SOCK_STREAM for gRPC's sockets, SOCK_SEQPACKET for the shared-memory region socket.
absl::Status PrepareUnixSocketPath(const std::string& path, int type = SOCK_STREAM);

// chmod of the socket file (who may connect). Bits outside 0777 are INVALID_ARGUMENT.
absl::Status SetUnixSocketMode(const std::string& path, mode_t mode);

// Removes the socket file at shutdown if it is still the one this process bound (same inode).
void RemoveUnixSocket(const std::string& path, ino_t inode);
// The inode of the socket file at `path`, or 0.
ino_t UnixSocketInode(const std::string& path);

}  // namespace normgrad::server
