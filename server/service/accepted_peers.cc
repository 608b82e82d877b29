#include "server/service/accepted_peers.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <cstring>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace normgrad::server {

void AcceptedPeers::Set(int fd, const PeerCredentials& credentials) {
  std::lock_guard<std::mutex> lock(mu_);
  by_fd_[fd] = Entry{credentials, "", std::nullopt};
}

void AcceptedPeers::SetTcp(int fd, std::string address, std::optional<uint32_t> loopback_uid) {
  std::lock_guard<std::mutex> lock(mu_);
  by_fd_[fd] = Entry{std::nullopt, std::move(address), loopback_uid};
}

std::optional<AcceptedPeers::Entry> AcceptedPeers::EntryOf(absl::string_view peer) const {
  int fd = -1;
  if (!absl::ConsumePrefix(&peer, "fd:") || !absl::SimpleAtoi(peer, &fd)) return std::nullopt;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_fd_.find(fd);
  if (it == by_fd_.end()) return std::nullopt;
  return it->second;
}

std::optional<PeerCredentials> AcceptedPeers::Find(absl::string_view peer) const {
  std::optional<Entry> e = EntryOf(peer);
  if (!e.has_value()) return std::nullopt;
  return e->credentials;
}

std::string AcceptedPeers::Address(absl::string_view peer) const {
  std::optional<Entry> e = EntryOf(peer);
  if (!e.has_value() || e->address.empty()) return std::string(peer);
  return e->address;
}

std::optional<uint32_t> AcceptedPeers::LoopbackUid(absl::string_view peer) const {
  std::optional<Entry> e = EntryOf(peer);
  if (!e.has_value()) return std::nullopt;
  return e->loopback_uid;
}

std::string DescribePeer(const PeerCredentials& c) {
  return absl::StrCat("uid:", c.uid, " (pid ", c.pid, ")");
}

std::string TcpPeerAddress(const sockaddr* address, socklen_t address_len) {
  char text[INET6_ADDRSTRLEN];
  if (address->sa_family == AF_INET && address_len >= sizeof(sockaddr_in)) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(address);
    return absl::StrCat("ipv4:", inet_ntop(AF_INET, &a->sin_addr, text, sizeof(text)), ":",
                        ntohs(a->sin_port));
  }
  if (address->sa_family == AF_INET6 && address_len >= sizeof(sockaddr_in6)) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(address);
    if (IN6_IS_ADDR_V4MAPPED(&a->sin6_addr)) {
      in_addr v4;
      std::memcpy(&v4, &a->sin6_addr.s6_addr[12], 4);
      return absl::StrCat("ipv4:", inet_ntop(AF_INET, &v4, text, sizeof(text)), ":",
                          ntohs(a->sin6_port));
    }
    return absl::StrCat("ipv6:[", inet_ntop(AF_INET6, &a->sin6_addr, text, sizeof(text)), "]:",
                        ntohs(a->sin6_port));
  }
  return "";
}

}  // namespace normgrad::server
