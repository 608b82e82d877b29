#include "client/src/channel_config.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace normgrad::client_internal {
namespace {

bool HasScheme(absl::string_view target) {
  for (absl::string_view scheme : {"dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:"}) {
    if (absl::StartsWith(target, scheme)) return true;
  }
  return false;
}

// "localhost", an IPv4 address in 127.0.0.0/8, or ::1 (also IPv4-mapped ::ffff:127.x.y.z).
bool IsLoopbackHost(absl::string_view host) {
  if (absl::EqualsIgnoreCase(host, "localhost")) return true;
  const std::string h(host);
  in_addr v4;
  if (inet_pton(AF_INET, h.c_str(), &v4) == 1) {
    return (ntohl(v4.s_addr) >> 24) == 127;
  }
  in6_addr v6;
  if (inet_pton(AF_INET6, h.c_str(), &v6) == 1) {
    if (IN6_IS_ADDR_LOOPBACK(&v6)) return true;
    return IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127;
  }
  return false;
}

// The host of "host", "host:port", "[v6]", "[v6]:port" or a bare IPv6 address.
absl::string_view HostOf(absl::string_view address) {
  if (absl::StartsWith(address, "[")) {
    const size_t close = address.find(']');
    return close == absl::string_view::npos ? address : address.substr(1, close - 1);
  }
  const size_t colon = address.find(':');
  if (colon == absl::string_view::npos) return address;
  if (address.find(':', colon + 1) != absl::string_view::npos) return address;  // bare IPv6
  return address.substr(0, colon);
}

}  // namespace

bool IsLoopbackOrUnixTarget(absl::string_view target) {
  target = absl::StripAsciiWhitespace(target);
  if (absl::StartsWith(target, "unix:") || absl::StartsWith(target, "unix-abstract:")) return true;
  if (absl::ConsumePrefix(&target, "dns:")) {
    // dns:[//authority/]host[:port]: the authority names the DNS server, not the target.
    if (absl::ConsumePrefix(&target, "//")) {
      const size_t slash = target.find('/');
      if (slash == absl::string_view::npos) return false;
      target.remove_prefix(slash + 1);
    }
  } else if (!absl::ConsumePrefix(&target, "ipv4:")) {
    absl::ConsumePrefix(&target, "ipv6:");
  }
  if (target.empty()) return false;
  for (absl::string_view part : absl::StrSplit(target, ',')) {
    if (!IsLoopbackHost(HostOf(absl::StripAsciiWhitespace(part)))) return false;
  }
  return true;
}

absl::StatusOr<ResolvedTarget> ResolveTarget(absl::string_view target) {
  target = absl::StripAsciiWhitespace(target);
  if (target.empty()) return absl::InvalidArgumentError("target: empty");
  if (HasScheme(target)) {
    const bool balanced = absl::StartsWith(target, "dns:") || absl::StartsWith(target, "ipv4:") ||
                          absl::StartsWith(target, "ipv6:");
    return ResolvedTarget{std::string(target), balanced};
  }
  if (!absl::StrContains(target, ',')) return ResolvedTarget{std::string(target), false};

  std::vector<std::string> addresses;
  bool any_v4 = false, any_v6 = false;
  for (absl::string_view part : absl::StrSplit(target, ',')) {
    part = absl::StripAsciiWhitespace(part);
    if (part.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("target: empty element in list \"", target, "\""));
    }
    const size_t colon = part.rfind(':');
    if (colon == absl::string_view::npos || colon + 1 == part.size()) {
      return absl::InvalidArgumentError(absl::StrCat("target: \"", part, "\" has no port"));
    }
    absl::string_view host = part.substr(0, colon);
    const absl::string_view port = part.substr(colon + 1);
    if (host == "localhost") host = "127.0.0.1";
    if (absl::StartsWith(host, "[")) {
      any_v6 = true;
    } else {
      any_v4 = true;
    }
    addresses.push_back(absl::StrCat(host, ":", port));
  }
  if (any_v4 && any_v6) {
    return absl::InvalidArgumentError(
        absl::StrCat("target: list \"", target, "\" mixes IPv4 and IPv6 addresses"));
  }
  return ResolvedTarget{absl::StrCat(any_v6 ? "ipv6:" : "ipv4:", absl::StrJoin(addresses, ",")),
                        true};
}

std::string ServiceConfigJson(const ResolvedTarget& target) {
  return target.round_robin ? R"({"loadBalancingConfig":[{"round_robin":{}}]})" : "{}";
}

}  // namespace normgrad::client_internal
