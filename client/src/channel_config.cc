#include "client/src/channel_config.h"

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

}  // namespace

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
