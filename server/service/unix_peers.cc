#include "server/service/unix_peers.h"

#include "absl/strings/strip.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace normgrad::server {

void UnixPeers::Set(int fd, const PeerCredentials& credentials) {
  std::lock_guard<std::mutex> lock(mu_);
  by_fd_[fd] = credentials;
}

std::optional<PeerCredentials> UnixPeers::Find(absl::string_view peer) const {
  int fd = -1;
  if (!absl::ConsumePrefix(&peer, "fd:") || !absl::SimpleAtoi(peer, &fd)) return std::nullopt;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_fd_.find(fd);
  if (it == by_fd_.end()) return std::nullopt;
  return it->second;
}

std::string DescribePeer(const PeerCredentials& c) {
  return absl::StrCat("uid:", c.uid, " (pid ", c.pid, ")");
}

}  // namespace normgrad::server
