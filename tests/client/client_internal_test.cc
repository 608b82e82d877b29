// The client's gRPC-free parts: argument validation, chunk planning, target resolution and service config, the hand
// encoding of grpc.health.v1 messages, and the status conversion.
#include <cmath>
#include <set>

#include "client/src/channel_config.h"
#include "client/src/chunking.h"
#include "client/src/grpc_status.h"
#include "client/src/health_wire.h"
#include "client/src/raw_args.h"
#include "gtest/gtest.h"
#include "normgrad/client.h"

namespace normgrad::client_internal {
namespace {

TEST(RowChunkerTest, ChunksCoverEveryRowOnceInOrder) {
  for (uint64_t rows : {1, 2, 7, 64, 1000, 1001}) {
    for (uint64_t chunk_bytes : {1, 100, 4096, 1 << 20}) {
      RowChunker chunker(rows, /*row_bytes=*/400, chunk_bytes);
      uint64_t next = 0;
      for (uint64_t i = 0; i < chunker.num_chunks(); ++i) {
        const RowRange r = chunker.Chunk(i);
        EXPECT_EQ(r.first_row, next);
        EXPECT_GE(r.num_rows, 1u);
        EXPECT_LE(r.num_rows * 400, std::max<uint64_t>(chunk_bytes, 400));
        next += r.num_rows;
      }
      EXPECT_EQ(next, rows) << rows << " rows, " << chunk_bytes << " bytes per chunk";
    }
  }
}

TEST(RowChunkerTest, RowWiderThanChunkGoesOneRowPerChunk) {
  RowChunker chunker(5, /*row_bytes=*/1000, /*chunk_bytes=*/10);
  EXPECT_EQ(chunker.rows_per_chunk(), 1u);
  EXPECT_EQ(chunker.num_chunks(), 5u);
}

TEST(RowChunkerTest, ExactMultipleHasNoEmptyLastChunk) {
  RowChunker chunker(8, 4, 16);  // 4 rows per chunk
  EXPECT_EQ(chunker.num_chunks(), 2u);
  EXPECT_EQ(chunker.Chunk(1).num_rows, 4u);
}

TEST(ResolveTargetTest, SingleAddressIsKeptWithoutBalancing) {
  absl::StatusOr<ResolvedTarget> t = ResolveTarget("localhost:50051");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->uri, "localhost:50051");
  EXPECT_FALSE(t->round_robin);
}

TEST(ResolveTargetTest, ListBecomesIpv4UriWithRoundRobin) {
  absl::StatusOr<ResolvedTarget> t = ResolveTarget("127.0.0.1:1, localhost:2");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->uri, "ipv4:127.0.0.1:1,127.0.0.1:2");
  EXPECT_TRUE(t->round_robin);
  absl::StatusOr<ResolvedTarget> v6 = ResolveTarget("[::1]:1,[::1]:2");
  ASSERT_TRUE(v6.ok());
  EXPECT_EQ(v6->uri, "ipv6:[::1]:1,[::1]:2");
}

TEST(ResolveTargetTest, SchemesAreKeptAndDnsIsBalanced) {
  absl::StatusOr<ResolvedTarget> dns = ResolveTarget("dns:///normgrad.svc:50051");
  ASSERT_TRUE(dns.ok());
  EXPECT_EQ(dns->uri, "dns:///normgrad.svc:50051");
  EXPECT_TRUE(dns->round_robin);
  absl::StatusOr<ResolvedTarget> unix_socket = ResolveTarget("unix:/tmp/s");
  ASSERT_TRUE(unix_socket.ok());
  EXPECT_FALSE(unix_socket->round_robin);
}

TEST(ResolveTargetTest, RejectsEmptyTargetsElementsMissingPortsAndMixedFamilies) {
  for (const char* bad : {"", "  ", "a:1,,b:2", "127.0.0.1:1,127.0.0.2", "127.0.0.1:1,[::1]:2"}) {
    absl::StatusOr<ResolvedTarget> t = ResolveTarget(bad);
    ASSERT_FALSE(t.ok()) << bad;
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  }
}

TEST(ServiceConfigTest, RoundRobinForAListAndNoRetryPolicy) {
  // Retries are the client's own (ClientRetryTest); gRPC's retry layer is off.
  EXPECT_EQ(ServiceConfigJson({"ipv4:1.2.3.4:1,1.2.3.4:2", true}),
            R"({"loadBalancingConfig":[{"round_robin":{}}]})");
  EXPECT_EQ(ServiceConfigJson({"localhost:1", false}), "{}");
}

TEST(HealthWireTest, RequestEncodingMatchesProtobuf) {
  EXPECT_EQ(EncodeHealthCheckRequest(""), "");
  EXPECT_EQ(EncodeHealthCheckRequest("normgrad.v1.NormGrad"),
            std::string("\x0a\x14normgrad.v1.NormGrad", 22));
}

TEST(HealthWireTest, DecodesStatusAndSkipsUnknownFields) {
  EXPECT_EQ(*DecodeHealthCheckResponse(""), 0);
  EXPECT_EQ(*DecodeHealthCheckResponse(std::string("\x08\x01", 2)), 1);
  // field 2 (string "ab"), field 3 fixed32, then status NOT_SERVING.
  EXPECT_EQ(*DecodeHealthCheckResponse(std::string("\x12\x02"
                                                   "ab"
                                                   "\x1d\x01\x02\x03\x04\x08\x02",
                                                   11)),
            2);
}

TEST(HealthWireTest, RejectsTruncatedMessages) {
  for (const std::string& bad : {std::string("\x08", 1),
                                 std::string("\x12\x05"
                                             "ab",
                                             4),
                                 std::string("\x80", 1), std::string("\x1d\x01", 2)}) {
    absl::StatusOr<int> s = DecodeHealthCheckResponse(bad);
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInternal);
  }
}

TEST(GrpcStatusTest, KeepsCodeAndMessageForEveryCode) {
  EXPECT_TRUE(FromGrpcStatus(grpc::Status::OK).ok());
  for (int code = 1; code <= 16; ++code) {
    const absl::Status s =
        FromGrpcStatus(grpc::Status(static_cast<grpc::StatusCode>(code), "server said: x=3"));
    EXPECT_EQ(static_cast<int>(s.code()), code);
    EXPECT_EQ(s.message(), "server said: x=3");
  }
}

TEST(ClientCreateTest, RejectsOptionsGrpcWouldMisuseNamingTheOption) {
  const struct {
    void (*adjust)(ClientOptions&);
    const char* field;
  } cases[] = {
      {[](ClientOptions& o) { o.max_attempts = 0; }, "max_attempts"},
      {[](ClientOptions& o) { o.chunk_bytes = 0; }, "chunk_bytes"},
      {[](ClientOptions& o) { o.initial_backoff = absl::ZeroDuration(); }, "initial_backoff"},
      {[](ClientOptions& o) { o.max_backoff = absl::Microseconds(1); }, "initial_backoff"},
      {[](ClientOptions& o) { o.target = "127.0.0.1:1,"; }, "target"},
  };
  for (const auto& c : cases) {
    ClientOptions options;
    c.adjust(options);
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(options);
    ASSERT_FALSE(client.ok()) << c.field;
    EXPECT_EQ(client.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(client.status().message().rfind(c.field, 0), 0u) << client.status();
  }
  ClientOptions no_retries;
  no_retries.max_attempts = 1;
  no_retries.initial_backoff = absl::ZeroDuration();  // unused without retries
  EXPECT_TRUE(Client::Create(no_retries).ok());
}

// A bearer token travels in clear text without TLS: only to this host (loopback or a unix
// socket), never across a network.
TEST(ClientCreateTest, RefusesBearerTokenOverPlaintextUnlessLoopbackOrUnix) {
  for (const char* target :
       {"10.0.0.1:50051", "normgrad.svc:50051", "dns:///normgrad.svc:50051",
        "127.0.0.1:1,10.0.0.2:2", "ipv4:127.0.0.1:1,192.168.1.1:2", "[2001:db8::1]:50051",
        "ipv6:[::1]:1,[2001:db8::1]:2", "0.0.0.0:50051", "localhost.example.com:1"}) {
    ClientOptions options;
    options.target = target;
    options.bearer_token = "t0ken";
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(options);
    ASSERT_FALSE(client.ok()) << target;
    EXPECT_EQ(client.status().code(), absl::StatusCode::kInvalidArgument) << target;
    EXPECT_EQ(client.status().message().rfind("bearer_token", 0), 0u) << client.status();
    EXPECT_NE(client.status().message().find("use_tls"), absl::string_view::npos)
        << client.status();
    EXPECT_EQ(client.status().message().find("t0ken"), absl::string_view::npos)
        << "the token is never echoed";
    options.use_tls = true;  // the same target over TLS is fine
    EXPECT_TRUE(Client::Create(options).ok()) << target;
  }
  for (const char* target : {"localhost:50051", "LOCALHOST:1", "127.0.0.1:50051", "127.1.2.3:50051",
                             "[::1]:50051", "127.0.0.1:1, localhost:2", "ipv4:127.0.0.1:1",
                             "ipv6:[::1]:1,[::1]:2", "dns:///localhost:50051", "dns:localhost:1",
                             "unix:/tmp/normgrad.sock", "unix-abstract:normgrad"}) {
    ClientOptions options;
    options.target = target;
    options.bearer_token = "t0ken";
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(options);
    EXPECT_TRUE(client.ok()) << target << ": " << client.status();
  }
}

// num_rows * hidden_dim * 4 wraps to 128 bytes for num_rows = 2^60 + 8, hidden_dim = 4: a check
// on the wrapped product would accept 128-byte buffers and the client would read far past them.
TEST(ValidateRawTest, SizeProductsThatOverflowAreInvalidArgumentNotAWrappedMatch) {
  std::vector<uint8_t> x(128), dy(128), dx(128), gamma(16), dgamma(16);
  RawBackwardArgs a;
  a.type = ElementType::kF32;
  a.num_rows = (uint64_t{1} << 60) + 8;
  a.hidden_dim = 4;
  a.x = x;
  a.dy = dy;
  a.dx = absl::MakeSpan(dx);
  a.gamma = gamma;
  a.dgamma = absl::MakeSpan(dgamma);
  absl::Status s = ValidateRaw(a);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("overflow"), std::string::npos) << s;
  EXPECT_NE(s.message().find("1152921504606846984"), std::string::npos) << s;

  // rms's own product: num_rows * 4 wraps at 2^62 even when the tensors would not (bf16, 1 wide).
  a.type = ElementType::kBF16;
  a.hidden_dim = 1;
  a.num_rows = (uint64_t{1} << 62) + 1;
  EXPECT_EQ(ValidateRaw(a).code(), absl::StatusCode::kInvalidArgument);

  // The same buffers with counts that fit are accepted: the check is the overflow, not the size.
  a.type = ElementType::kF32;
  a.num_rows = 8;
  a.hidden_dim = 4;
  EXPECT_TRUE(ValidateRaw(a).ok()) << ValidateRaw(a);
}

// 2 rows of 4 f32 values, buffers apart, the default variant: valid.
struct VariantArgs {
  std::vector<uint8_t> x = std::vector<uint8_t>(32), dy = x, dx = x,
                       gamma = std::vector<uint8_t>(16), dgamma = gamma;
  RawBackwardArgs Args() {
    return {ElementType::kF32, 2, 4, 1e-5f, x, dy, gamma, {}, absl::MakeSpan(dx),
            absl::MakeSpan(dgamma), std::nullopt, 0.0f, false, v1::CASTING_MODE_UNSPECIFIED,
            false};
  }
};

void ExpectInvalid(const RawBackwardArgs& a, absl::string_view message) {
  absl::Status s = ValidateRaw(a);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find(message), std::string::npos) << s;
}

TEST(ValidateRawTest, VariantFieldsAreCheckedNamingTheField) {
  VariantArgs v;
  RawBackwardArgs a = v.Args();
  ASSERT_TRUE(ValidateRaw(a).ok());
  a.gamma_offset = std::nanf("");
  ExpectInvalid(a, "gamma_offset: must be finite, got nan");
  a.gamma_offset = 1.0f;
  EXPECT_TRUE(ValidateRaw(a).ok());
  a.casting_mode = static_cast<v1::CastingMode>(7);
  ExpectInvalid(a, "casting_mode: 7 is not one of");
  a.casting_mode = v1::CASTING_MODE_LLAMA;
  EXPECT_TRUE(ValidateRaw(a).ok());
  a.no_gamma = true;
  ExpectInvalid(a, "gamma_offset: 1 with no_gamma; must be 0");
  a.gamma_offset = 0.0f;
  ExpectInvalid(a, "gamma (no_gamma): 16 bytes, expected 0");
  a.gamma = {};
  ExpectInvalid(a, "dgamma (no_gamma): 16 bytes, expected 0");
  a.dgamma = {};
  EXPECT_TRUE(ValidateRaw(a).ok()) << ValidateRaw(a);
  a.no_gamma = false;
  ExpectInvalid(a, "gamma: 0 bytes, expected 16");
}

TEST(ValidateRawTest, DxIsApartFromXAndDyOrWithInPlaceExactlyDy) {
  VariantArgs v;
  RawBackwardArgs a = v.Args();
  a.dx = absl::MakeSpan(v.dy);
  ExpectInvalid(a, "dx: overlaps dy (dx starts 0 bytes from dy); set in_place");
  a.in_place = true;
  EXPECT_TRUE(ValidateRaw(a).ok()) << ValidateRaw(a);
  std::vector<uint8_t> both(48);  // dy, and dx one row (16 bytes) into it
  a.dy = absl::MakeConstSpan(both).subspan(0, 32);
  a.dx = absl::MakeSpan(both).subspan(16, 32);
  ExpectInvalid(a, "in_place: dx must be exactly dy's span; dx starts 16 bytes from dy");
  a.in_place = false;
  ExpectInvalid(a, "dx: overlaps dy (dx starts 16 bytes from dy)");
  a = v.Args();
  a.dx = absl::MakeSpan(v.x);
  a.dy = v.x;
  a.in_place = true;
  ExpectInvalid(a, "dx: overlaps x");
}

TEST(ValidateRawTest, DeviceInPlaceNeedsDxToBeDy) {
  VariantArgs v;
  RawBackwardArgs a = v.Args();
  a.x = {};
  a.dy = {};
  a.dx = {};
  CudaIpcTensors d;
  d.device_uuid = std::string(16, 'u');
  d.x.handle = std::string(64, 'x');
  d.dy.handle = std::string(64, 'y');
  d.dx = d.dy;
  a.device = d;
  ExpectInvalid(a, "device.dx is device.dy: set in_place");
  a.in_place = true;
  EXPECT_TRUE(ValidateRaw(a).ok()) << ValidateRaw(a);
  a.device->dx.offset = 16;
  ExpectInvalid(a,
                "in_place: device.dx must be device.dy (the same handle and offset); dx is at "
                "offset 16, dy at 0 of the same handle");
}

}  // namespace
}  // namespace normgrad::client_internal
