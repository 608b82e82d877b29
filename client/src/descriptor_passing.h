// A descriptor passed over a unix socket (SCM_RIGHTS), as the client sends a shared-memory
// region to the server's region socket. Header-only, POSIX only.
//
//   if (SendWithDescriptor(socket, request.SerializeAsString(), memfd) < 0) { ...errno... }
#pragma once

#include <sys/socket.h>
#include <sys/types.h>

#include <cstring>
#include <string_view>

namespace normgrad::client_internal {

// sendmsg of `bytes` on `socket` with `fd` attached, without SIGPIPE; what sendmsg returned
// (-1 with errno set on failure).
inline ssize_t SendWithDescriptor(int socket, std::string_view bytes, int fd) {
  iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  return sendmsg(socket, &msg, MSG_NOSIGNAL);
}

}  // namespace normgrad::client_internal
