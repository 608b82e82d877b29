#include "server/service/admission.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>
#include <mutex>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/status_macros.h"

namespace normgrad::server {
namespace {

constexpr char kBackwardMethod[] = "RmsNormBackward";
constexpr char kEmitPtxMethod[] = "EmitPtx";

// A queue's total (flag `total_flag`) must be > 0, and its per-connection share (the flag with
// "-per-connection" added to the name) in 1..total.
absl::Status CheckQueueLimits(absl::string_view total_flag, uint64_t total, uint64_t share) {
  if (total == 0) return absl::InvalidArgumentError(absl::StrCat(total_flag, "=0: must be > 0"));
  if (share == 0 || share > total) {
    return absl::InvalidArgumentError(absl::StrCat(total_flag, "-per-connection=", share,
                                                   ": must be in 1..", total_flag, "=", total));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckAdmissionLimits(const AdmissionLimits& l) {
  NORMGRAD_RETURN_IF_ERROR(CheckQueueLimits("--max-emit-ptx-queue", l.max_emit_ptx_calls,
                                            l.max_emit_ptx_calls_per_connection));
  return CheckQueueLimits("--max-emit-ptx-queue-bytes", l.max_emit_ptx_bytes,
                          l.max_emit_ptx_bytes_per_connection);
}

namespace {

// A TCP peer's address and port from gRPC's peer string: "ipv4:A.B.C.D:PORT",
// "ipv6:[ADDR]:PORT" (brackets also as %5B and %5D). False for anything else.
struct TcpPeer {
  bool v6 = false;
  in_addr v4{};
  in6_addr v6_addr{};
  uint16_t port = 0;
};
bool ParseTcpPeer(absl::string_view peer, TcpPeer* out) {
  const size_t colon = peer.rfind(':');
  if (colon == absl::string_view::npos || colon + 1 == peer.size()) return false;
  const absl::string_view port = peer.substr(colon + 1);
  if (port.size() > 5 ||
      !std::all_of(port.begin(), port.end(), [](char c) { return absl::ascii_isdigit(c); })) {
    return false;
  }
  const int port_value = std::stoi(std::string(port));
  if (port_value > 65535) return false;
  out->port = static_cast<uint16_t>(port_value);
  absl::string_view host = peer.substr(0, colon);
  if (absl::ConsumePrefix(&host, "ipv4:")) {
    out->v6 = false;
    return inet_pton(AF_INET, std::string(host).c_str(), &out->v4) == 1;
  }
  if (!absl::ConsumePrefix(&host, "ipv6:")) return false;
  if (!(absl::ConsumePrefix(&host, "[") && absl::ConsumeSuffix(&host, "]")) &&
      !(absl::ConsumePrefix(&host, "%5B") && absl::ConsumeSuffix(&host, "%5D"))) {
    return false;
  }
  out->v6 = true;
  return inet_pton(AF_INET6, std::string(host).c_str(), &out->v6_addr) == 1;
}

}  // namespace

std::string ClientIdentityFromPeer(absl::string_view peer) {
  // unix: and unix-abstract:, and "fd:N" (a unix-socket connection whose credentials were not
  // found; the service names a known one by its uid).
  if (absl::StartsWith(peer, "unix") || absl::StartsWith(peer, "fd:")) return "unix";
  TcpPeer p;
  if (ParseTcpPeer(peer, &p) && p.v6) {
    char text[INET6_ADDRSTRLEN];
    if (IN6_IS_ADDR_V4MAPPED(&p.v6_addr)) {
      in_addr v4;
      std::memcpy(&v4, &p.v6_addr.s6_addr[12], 4);
      return absl::StrCat("ipv4:", inet_ntop(AF_INET, &v4, text, sizeof(text)));
    }
    if (!IN6_IS_ADDR_LOOPBACK(&p.v6_addr)) {
      in6_addr prefix = p.v6_addr;
      std::memset(&prefix.s6_addr[8], 0, 8);
      return absl::StrCat("ipv6:[", inet_ntop(AF_INET6, &prefix, text, sizeof(text)), "]/64");
    }
  }
  const size_t colon = peer.rfind(':');
  // "ipv4:" or "ipv6:" and at least one character before the port's colon.
  if (colon == absl::string_view::npos || colon <= 5 || colon + 1 == peer.size()) {
    return std::string(peer);
  }
  const absl::string_view port = peer.substr(colon + 1);
  if (!std::all_of(port.begin(), port.end(), [](char c) { return absl::ascii_isdigit(c); })) {
    return std::string(peer);
  }
  return std::string(peer.substr(0, colon));
}

std::optional<uint32_t> LoopbackPeerUid(absl::string_view peer) {
  TcpPeer p;
  if (!ParseTcpPeer(peer, &p)) return std::nullopt;
  // The kernel prints each address as the 32-bit words of its bytes in memory, in hex (%08X),
  // and the port as a number: the client end's line has the peer as its local address.
  std::string local;
  const char* table;
  auto word = [](const uint8_t* bytes) {
    uint32_t w;
    std::memcpy(&w, bytes, 4);
    char hex[9];
    std::snprintf(hex, sizeof(hex), "%08X", w);
    return std::string(hex);
  };
  if (!p.v6) {
    if ((ntohl(p.v4.s_addr) >> 24) != 127) return std::nullopt;
    local = word(reinterpret_cast<const uint8_t*>(&p.v4.s_addr));
    table = "/proc/net/tcp";
  } else {
    const bool mapped_loopback =
        IN6_IS_ADDR_V4MAPPED(&p.v6_addr) && p.v6_addr.s6_addr[12] == 127;
    if (!IN6_IS_ADDR_LOOPBACK(&p.v6_addr) && !mapped_loopback) return std::nullopt;
    for (int i = 0; i < 16; i += 4) local += word(&p.v6_addr.s6_addr[i]);
    table = "/proc/net/tcp6";
  }
  char port[8];
  std::snprintf(port, sizeof(port), ":%04X", p.port);
  local += port;
  std::ifstream in(table);
  std::string line;
  std::getline(in, line);  // the header
  while (std::getline(in, line)) {
    // sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid ...
    std::vector<absl::string_view> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (f.size() < 8 || f[1] != local) continue;
    uint32_t uid;
    if (absl::SimpleAtoi(f[7], &uid)) return uid;
  }
  return std::nullopt;
}

void AdmissionController::CountRejection(const char* method, const char* limit) {
  if (metrics_ != nullptr) {
    metrics_->rejected.Increment({{"method", method}, {"limit", limit}});
  }
}

uint32_t AdmissionController::streams_per_client() const {
  const uint32_t share = limits_.max_streams_per_client;
  return share == 0 ? limits_.max_streams : std::min(share, limits_.max_streams);
}

absl::Status AdmissionController::AdmitStream(absl::string_view client) {
  std::unique_lock<std::mutex> lock(mu_);
  if (streams_ >= limits_.max_streams) {
    const uint32_t in_use = streams_;  // read under the lock: the message is built after it
    lock.unlock();
    CountRejection(kBackwardMethod, "max-streams");
    return absl::ResourceExhaustedError(
        absl::StrCat("too many concurrent streams: ", in_use, " of ", limits_.max_streams,
                     " in use (--max-streams); retry later"));
  }
  const uint32_t share = streams_per_client();
  auto it = streams_by_client_.find(client);
  const uint32_t held = it == streams_by_client_.end() ? 0 : it->second;
  if (held >= share) {
    lock.unlock();
    CountRejection(kBackwardMethod, "max-streams-per-client");
    // The identity is not echoed: an address or a certificate name is the operator's to see.
    return absl::ResourceExhaustedError(absl::StrCat(
        "this client holds ", held, " streams, its share of ", share, " (of ",
        limits_.max_streams, " in all) (--max-streams-per-client); finish one, or retry later"));
  }
  ++streams_;
  ++streams_by_client_[client];
  return absl::OkStatus();
}

void AdmissionController::ReleaseStream(absl::string_view client) {
  std::lock_guard<std::mutex> lock(mu_);
  if (streams_ > 0) --streams_;
  auto it = streams_by_client_.find(client);
  if (it != streams_by_client_.end() && --it->second == 0) streams_by_client_.erase(it);
}

absl::Status AdmissionController::ReserveBytes(uint64_t bytes) {
  std::unique_lock<std::mutex> lock(mu_);
  if (bytes > limits_.max_inflight_bytes - bytes_ || bytes_ > limits_.max_inflight_bytes) {
    const uint64_t in_use = bytes_;
    lock.unlock();
    CountRejection(kBackwardMethod, "max-inflight-bytes");
    return absl::ResourceExhaustedError(absl::StrCat(
        "in-flight bytes limit: this chunk needs ", bytes, " bytes, ", in_use, " of ",
        limits_.max_inflight_bytes, " are in use (--max-inflight-bytes); retry later or send "
        "smaller chunks"));
  }
  bytes_ += bytes;
  return absl::OkStatus();
}

void AdmissionController::ReleaseBytes(uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  bytes_ = bytes > bytes_ ? 0 : bytes_ - bytes;
}

absl::Status AdmissionController::AdmitEmitPtx(absl::string_view connection, uint64_t bytes) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = emit_by_connection_.find(connection);
  const EmitPtxHeld mine = it == emit_by_connection_.end() ? EmitPtxHeld{} : it->second;
  const char* limit = nullptr;
  std::string message;
  if (emit_total_.calls >= limits_.max_emit_ptx_calls) {
    limit = "max-emit-ptx-queue";
    message = absl::StrCat("EmitPtx queue full: ", emit_total_.calls, " of ",
                           limits_.max_emit_ptx_calls, " calls queued or compiling "
                           "(--max-emit-ptx-queue); retry later");
  } else if (mine.calls >= limits_.max_emit_ptx_calls_per_connection) {
    limit = "max-emit-ptx-queue-per-connection";
    message = absl::StrCat("EmitPtx queue: this connection has ", mine.calls, " of ",
                           limits_.max_emit_ptx_calls_per_connection,
                           " calls queued or compiling (--max-emit-ptx-queue-per-connection); "
                           "wait for their answers");
  } else if (bytes > limits_.max_emit_ptx_bytes - emit_total_.bytes) {
    limit = "max-emit-ptx-queue-bytes";
    message = absl::StrCat("EmitPtx queue bytes: this request needs ", bytes, " bytes, ",
                           emit_total_.bytes, " of ", limits_.max_emit_ptx_bytes,
                           " are in use (--max-emit-ptx-queue-bytes); retry later");
  } else if (bytes > limits_.max_emit_ptx_bytes_per_connection - mine.bytes) {
    limit = "max-emit-ptx-queue-bytes-per-connection";
    message = absl::StrCat("EmitPtx queue bytes: this request needs ", bytes, " bytes, ",
                           mine.bytes, " of ", limits_.max_emit_ptx_bytes_per_connection,
                           " are in use by this connection "
                           "(--max-emit-ptx-queue-bytes-per-connection); wait for its answers");
  }
  if (limit != nullptr) {
    lock.unlock();
    CountRejection(kEmitPtxMethod, limit);
    return absl::ResourceExhaustedError(message);
  }
  ++emit_total_.calls;
  emit_total_.bytes += bytes;
  EmitPtxHeld& held = emit_by_connection_[connection];
  ++held.calls;
  held.bytes += bytes;
  return absl::OkStatus();
}

void AdmissionController::ReleaseEmitPtx(absl::string_view connection, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (emit_total_.calls > 0) --emit_total_.calls;
  emit_total_.bytes = bytes > emit_total_.bytes ? 0 : emit_total_.bytes - bytes;
  auto it = emit_by_connection_.find(connection);
  if (it == emit_by_connection_.end()) return;
  if (it->second.calls > 0) --it->second.calls;
  it->second.bytes = bytes > it->second.bytes ? 0 : it->second.bytes - bytes;
  if (it->second.calls == 0) emit_by_connection_.erase(it);
}

uint32_t AdmissionController::active_streams() const {
  std::lock_guard<std::mutex> lock(mu_);
  return streams_;
}

uint32_t AdmissionController::streams_of(absl::string_view client) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = streams_by_client_.find(client);
  return it == streams_by_client_.end() ? 0 : it->second;
}

uint64_t AdmissionController::inflight_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_;
}

uint32_t AdmissionController::emit_ptx_calls() const {
  std::lock_guard<std::mutex> lock(mu_);
  return emit_total_.calls;
}

uint64_t AdmissionController::emit_ptx_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return emit_total_.bytes;
}

}  // namespace normgrad::server
