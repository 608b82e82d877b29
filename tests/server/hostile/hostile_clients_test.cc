// Hostile and broken clients against a real server on 127.0.0.1:0: streams that stop sending or
// stop reading, bytes that are not gRPC on the gRPC port, garbage on the metrics port, clients
// that cancel after every possible message or vanish in the middle of a chunk. Each test checks
// that the bad client is ended with a clear status or a dropped connection, that a stream holds
// at most 3 chunks (normgrad_inflight_bytes) however hostile its client, that the bytes return to 0,
// and that a well-behaved client afterwards still gets the reference result.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/process/normgrad_server.h"
#include "tests/server/service/service_test_util.h"

namespace normgrad::server {
namespace {

using ::testing::HasSubstr;

double Tolerance() { return testing::TestBackendIsCuda() ? 1e-3 : 1e-5; }

constexpr uint64_t kMaxInflightBytes = 8ull << 20;
// What one stream may hold (docs/operations.md, "Memory and overload"): 3 row chunks, each
// reserving its request message and its response; the message's protobuf framing is the slack.
constexpr int kMaxChunksHeldPerStream = 3;
constexpr double kMessageOverheadBytes = 1024;

class HostileClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerOptions options = testing::TestServerOptions();
    options.stream_idle_timeout = absl::Seconds(1);
    options.admission.max_inflight_bytes = kMaxInflightBytes;
    absl::StatusOr<std::unique_ptr<NormGradServer>> server = NormGradServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    stub_ = testing::StubFor(server_->port());
  }

  // The server's gauges, scraped from its own metrics endpoint.
  double Gauge(const std::string& name) {
    int code = 0;
    const std::string text = testing::HttpGet(server_->metrics_port(), "/metrics", &code);
    EXPECT_EQ(code, 200);
    std::string error;
    std::map<std::string, double> m = testing::ParsePrometheusText(text, &error);
    EXPECT_TRUE(error.empty()) << error;
    return m[name];
  }

  // Waits (bounded) until no stream is live and no chunk bytes are held, at five looks in a row
  // 50 ms apart: a vanished client's last frames may still be on their way to the server (its
  // cancelled call returns at once), and a stream they open lives for a moment after a first
  // look found none.
  void ExpectServerDrains() {
    const absl::Time end = absl::Now() + absl::Seconds(30);
    int quiet_looks = 0;
    while (absl::Now() < end && quiet_looks < 5) {
      const bool quiet =
          server_->live_streams() == 0 && Gauge("normgrad_inflight_bytes") == 0;
      quiet_looks = quiet ? quiet_looks + 1 : 0;
      absl::SleepFor(absl::Milliseconds(50));
    }
    EXPECT_EQ(server_->live_streams(), 0u);
    EXPECT_EQ(Gauge("normgrad_inflight_bytes"), 0);
  }

  // A well-behaved client gets the reference result.
  void ExpectNormalCallWorks(uint32_t seed) {
    const testing::Batch batch = testing::RandomBatch(24, 64, seed);
    std::vector<float> dx, dgamma;
    testing::ReferenceFor(batch, dx, dgamma);
    const testing::BackwardResult r = testing::RunBackward(*stub_, batch, 7, absl::Seconds(60));
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    EXPECT_LE(testing::MaxDxError(batch, r.dx, dx), Tolerance());
    EXPECT_LE(testing::MaxScaledError(r.dgamma, dgamma), Tolerance());
  }

  std::unique_ptr<NormGradServer> server_;
  std::unique_ptr<v1::NormGrad::Stub> stub_;
};

// Connects to 127.0.0.1:port, sends `bytes`, then reads until the server closes the connection
// (true) or 20 s pass (false). `reply` gets what the server sent.
bool SendAndExpectClose(int port, const std::string& bytes, std::string* reply) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return false;
  }
  size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t n = send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;  // the server may drop us before it has read everything
    sent += n;
  }
  bool closed = false;
  const absl::Time end = absl::Now() + absl::Seconds(20);
  while (absl::Now() < end) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 100) <= 0) continue;
    char buf[4096];
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) {
      closed = true;
      break;
    }
    reply->append(buf, n);
  }
  close(fd);
  return closed;
}

std::string RandomBytes(size_t size, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string out(size, '\0');
  for (char& c : out) c = static_cast<char>(rng());
  return out;
}

TEST_F(HostileClientTest, StreamsThatStopSendingEndWithIdleTimeoutWhileOthersComplete) {
  const testing::Batch batch = testing::RandomBatch(8, 32, 3);
  struct Idle {
    grpc::ClientContext context;
    std::unique_ptr<grpc::ClientReaderWriter<v1::BackwardRequest, v1::BackwardResponse>> stream;
  };
  // Two send nothing at all, two stop after the header, two after one chunk of four rows.
  std::vector<std::unique_ptr<Idle>> idle;
  for (int i = 0; i < 6; ++i) {
    auto s = std::make_unique<Idle>();
    s->context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
    s->stream = stub_->RmsNormBackward(&s->context);
    if (i >= 2) {
      ASSERT_TRUE(s->stream->Write(testing::HeaderFor(batch)));
    }
    if (i >= 4) {
      ASSERT_TRUE(s->stream->Write(testing::ChunkFor(batch, 0, 4)));
    }
    idle.push_back(std::move(s));
  }
  ExpectNormalCallWorks(4);  // served while six idle streams are open
  for (size_t i = 0; i < idle.size(); ++i) {
    v1::BackwardResponse response;
    int responses = 0;
    while (idle[i]->stream->Read(&response)) ++responses;
    const grpc::Status s = idle[i]->stream->Finish();
    EXPECT_EQ(s.error_code(), grpc::DEADLINE_EXCEEDED) << "stream " << i << ": " << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("stream idle timeout")) << "stream " << i;
    EXPECT_EQ(responses, i >= 4 ? 1 : 0) << "stream " << i;  // the chunk sent was answered
  }
  ExpectServerDrains();
}

TEST_F(HostileClientTest, ClientThatStopsReadingIsHeldUnderInflightLimitThenTimedOut) {
  // 255 chunks of 64 KiB each way (the last chunk never comes, so the stream cannot finish) and a
  // client that never reads: 16 MiB of responses the server may not hold. Its bytes held for
  // chunks must stay at 3 chunks (far under --max-inflight-bytes) while gRPC's flow control
  // stops the writes, and the watchdog ends the stream.
  const testing::Batch batch = testing::RandomBatch(4096, 1024, 5);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(90)));
  auto stream = stub_->RmsNormBackward(&context);
  std::atomic<int> written{0};
  std::thread writer([&] {
    if (!stream->Write(testing::HeaderFor(batch))) return;
    for (uint64_t first = 0; first + 16 < batch.rows; first += 16) {
      if (!stream->Write(testing::ChunkFor(batch, first, 16))) return;
      ++written;
    }
  });
  double peak_held = 0;
  const absl::Time end = absl::Now() + absl::Seconds(60);
  absl::SleepFor(absl::Milliseconds(100));  // let the stream register; the loop below is bounded
  while (absl::Now() < end && server_->live_streams() != 0) {
    peak_held = std::max(peak_held, Gauge("normgrad_inflight_bytes"));
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(server_->live_streams(), 0u) << "the stream was not ended";
  writer.join();
  v1::BackwardResponse response;
  int responses = 0;
  while (stream->Read(&response)) ++responses;
  const grpc::Status s = stream->Finish();
  // A client that reads nothing cannot receive trailers either (they would queue behind the
  // stuck response), so the watchdog cancels the call: the client sees CANCELLED, the server
  // records DEADLINE_EXCEEDED. A client that stopped reading only after the server finished
  // writing gets the watchdog's DEADLINE_EXCEEDED itself.
  EXPECT_TRUE(s.error_code() == grpc::CANCELLED || s.error_code() == grpc::DEADLINE_EXCEEDED)
      << s.error_code() << " " << s.error_message();
  EXPECT_EQ(Gauge("normgrad_requests_total{code=\"DEADLINE_EXCEEDED\",method=\"RmsNormBackward\"}"),
            1);
  // The gauge cannot pass --max-inflight-bytes by construction (admission refuses), so that is
  // no bound to test. The real one: a stream holds at most 3 chunks (docs/operations.md, "Memory
  // and overload"), each reserving its request message (x and dy) plus its response (dx), so a
  // client that stops reading pins ~3 x 192 KiB here however many chunks it sends, not 8 MiB.
  const double chunk_x_bytes = 16.0 * 1024 * sizeof(float);
  const double per_chunk = 3 * chunk_x_bytes + kMessageOverheadBytes;
  EXPECT_GE(peak_held, per_chunk - kMessageOverheadBytes) << "no chunk was ever held";
  EXPECT_LE(peak_held, kMaxChunksHeldPerStream * per_chunk)
      << "the stopped reader's stream held more than " << kMaxChunksHeldPerStream << " chunks";
  std::printf("stopped reader: %d chunks written, %d responses delivered, peak held %.0f bytes "
              "(bound %d chunks = %.0f bytes; limit %llu); ended with %d: %s\n",
              written.load(), responses, peak_held, kMaxChunksHeldPerStream,
              kMaxChunksHeldPerStream * per_chunk,
              static_cast<unsigned long long>(kMaxInflightBytes), s.error_code(),
              s.error_message().c_str());
  ExpectServerDrains();
  ExpectNormalCallWorks(6);
}

TEST_F(HostileClientTest, NonGrpcBytesOnGrpcPortDropTheConnectionAndServerKeepsServing) {
  std::string reply;
  EXPECT_TRUE(SendAndExpectClose(server_->port(), RandomBytes(64 << 10, 7), &reply));
  reply.clear();
  EXPECT_TRUE(SendAndExpectClose(
      server_->port(), "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: keep-alive\r\n\r\n",
      &reply));
  // A valid HTTP/2 preface followed by garbage frames.
  reply.clear();
  EXPECT_TRUE(SendAndExpectClose(
      server_->port(), "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + RandomBytes(4096, 8), &reply));
  ExpectNormalCallWorks(9);
  ExpectServerDrains();
}

// HTTP/2 frames by hand (RFC 9113 section 4.1): 9-byte header, then the payload.
std::string Http2Frame(uint8_t type, uint8_t flags, const std::string& payload) {
  std::string f;
  const uint32_t n = static_cast<uint32_t>(payload.size());
  f += static_cast<char>(n >> 16);
  f += static_cast<char>(n >> 8);
  f += static_cast<char>(n);
  f += static_cast<char>(type);
  f += static_cast<char>(flags);
  f += std::string(4, '\0');  // stream 0
  return f + payload;
}

// The GOAWAY frames (type 7) in what a server sent: error code and debug text of each.
std::vector<std::pair<uint32_t, std::string>> GoAways(const std::string& bytes) {
  std::vector<std::pair<uint32_t, std::string>> out;
  size_t at = 0;
  while (at + 9 <= bytes.size()) {
    const auto b = [&](size_t i) { return static_cast<uint32_t>(static_cast<uint8_t>(bytes[i])); };
    const uint32_t length = b(at) << 16 | b(at + 1) << 8 | b(at + 2);
    if (at + 9 + length > bytes.size()) break;
    if (b(at + 3) == 7 && length >= 8) {
      const size_t p = at + 9;
      const uint32_t code = b(p + 4) << 24 | b(p + 5) << 16 | b(p + 6) << 8 | b(p + 7);
      out.push_back({code, bytes.substr(p + 8, length - 8)});
    }
    at += 9 + length;
  }
  return out;
}

TEST_F(HostileClientTest, PingFloodGetsGoAwayEnhanceYourCalmAndServerKeepsServing) {
  // Pings with no call open, far more often than --min-client-ping-interval allows: after two
  // strikes the server answers GOAWAY ENHANCE_YOUR_CALM (0xb) "too_many_pings" and closes.
  std::string flood = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + Http2Frame(4, 0, "");
  for (int i = 0; i < 20; ++i) flood += Http2Frame(6, 0, std::string(8, static_cast<char>(i)));
  std::string reply;
  EXPECT_TRUE(SendAndExpectClose(server_->port(), flood, &reply));
  const auto goaways = GoAways(reply);
  ASSERT_FALSE(goaways.empty()) << reply.size() << " bytes back, no GOAWAY";
  EXPECT_EQ(goaways.back().first, 0xbu);
  EXPECT_THAT(goaways.back().second, HasSubstr("too_many_pings"));
  ExpectNormalCallWorks(13);
  ExpectServerDrains();
}

TEST_F(HostileClientTest, RequestMetadataPastSixteenKibIsRefusedAndServerKeepsServing) {
  // The offender gets a connection of its own (gRPC would otherwise share one between channels
  // to the same address): the server may close it after the refusal, which is its business.
  auto offender = v1::NormGrad::NewStub(testing::OwnConnectionFor(server_->port()));
  const auto info_with_metadata = [&](size_t bytes) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
    context.AddMetadata("x-padding", std::string(bytes, 'a'));
    v1::GetServerInfoResponse response;
    return offender->GetServerInfo(&context, v1::GetServerInfoRequest(), &response);
  };
  EXPECT_TRUE(info_with_metadata(8 << 10).ok());  // under the cap: served
  const grpc::Status refused = info_with_metadata(64 << 10);
  EXPECT_EQ(refused.error_code(), grpc::RESOURCE_EXHAUSTED) << refused.error_message();
  EXPECT_THAT(refused.error_message(), HasSubstr("metadata size exceeds limit"));
  ExpectNormalCallWorks(14);
  ExpectServerDrains();
}

TEST_F(HostileClientTest, GarbageOnMetricsPortIsRefusedAndMetricsKeepServing) {
  std::string reply;
  EXPECT_TRUE(SendAndExpectClose(server_->metrics_port(),
                                 RandomBytes(16 << 10, 10) + "\r\n\r\n", &reply));
  reply.clear();
  EXPECT_TRUE(SendAndExpectClose(server_->metrics_port(),
                                 "GET /metrics HTTP/1.1\r\nContent-Length: -5\r\n\r\n" +
                                     RandomBytes(1024, 11),
                                 &reply));
  int code = 0;
  testing::HttpGet(server_->metrics_port(), "/metrics", &code);
  EXPECT_EQ(code, 200);
  ExpectNormalCallWorks(12);
}

TEST_F(HostileClientTest, CancelAfterEveryPossibleMessageLeavesNothingHeld) {
  const testing::Batch batch = testing::RandomBatch(12, 64, 13);
  // k messages sent (header, then chunks of 3 rows), optionally one response read, then cancel.
  for (int k = 0; k <= 5; ++k) {
    for (bool read_one : {false, true}) {
      grpc::ClientContext context;
      context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
      auto stream = stub_->RmsNormBackward(&context);
      bool ok = true;
      for (int m = 0; m < k && ok; ++m) {
        ok = stream->Write(m == 0 ? testing::HeaderFor(batch)
                                  : testing::ChunkFor(batch, (m - 1) * 3, 3));
      }
      if (k == 5) stream->WritesDone();
      v1::BackwardResponse response;
      if (read_one && k >= 2) stream->Read(&response);
      context.TryCancel();
      while (stream->Read(&response)) {
      }
      const grpc::Status s = stream->Finish();
      // Whole batches (k == 5) may have finished before the cancel arrived.
      if (!s.ok()) {
        EXPECT_EQ(s.error_code(), grpc::CANCELLED) << "k=" << k << " " << s.error_message();
      }
    }
  }
  ExpectServerDrains();
  ExpectNormalCallWorks(14);
}

TEST_F(HostileClientTest, ClientVanishingMidChunkLeavesNothingHeld) {
  // 3 MiB chunks, cancelled (RST_STREAM) or the channel dropped while the chunk is on the wire.
  const testing::Batch batch = testing::RandomBatch(384, 1024, 15);
  for (int i = 0; i < 8; ++i) {
    auto channel = testing::ChannelFor(server_->port());
    auto stub = v1::NormGrad::NewStub(channel);
    auto context = std::make_unique<grpc::ClientContext>();
    auto stream = stub->RmsNormBackward(context.get());
    ASSERT_TRUE(stream->Write(testing::HeaderFor(batch)));
    std::thread writer([&] {
      for (uint64_t first = 0; first < batch.rows; first += 384) {
        if (!stream->Write(testing::ChunkFor(batch, first, 384))) return;
      }
    });
    absl::SleepFor(absl::Microseconds(200 * i));
    context->TryCancel();
    writer.join();
    stream->Finish();
    stream.reset();
  }
  ExpectServerDrains();
  ExpectNormalCallWorks(16);
}

}  // namespace
}  // namespace normgrad::server
