// Every bad Backward input gets its gRPC code and a message naming the field and the numbers: the
// catalogue of bad requests, a message over the size limit (counted as the client saw it), one
// that does not parse, and client strings too long to echo whole.
#include "tests/server/service/service_suite.h"

namespace normgrad::server::service_test {
namespace {

using ::testing::HasSubstr;
using testing::WaitFor;

struct BadInput {
  std::string name;
  std::vector<v1::BackwardRequest> messages;
  grpc::StatusCode code;
  std::string message;  // substring
};

std::vector<BadInput> BadInputs() {
  const Batch b = testing::RandomBatch(10, 8, 11);
  const v1::BackwardRequest header = testing::HeaderFor(b);
  const v1::BackwardRequest chunk4 = testing::ChunkFor(b, 0, 4);
  std::vector<BadInput> cases;
  auto with_header = [&](auto edit) {
    v1::BackwardRequest h = header;
    edit(*h.mutable_header());
    return h;
  };
  auto with_chunk = [&](auto edit) {
    v1::BackwardRequest c = chunk4;
    edit(c);
    return c;
  };
  cases.push_back({"no header", {chunk4}, grpc::INVALID_ARGUMENT,
                   "the first message must carry `header`"});
  cases.push_back({"repeated header", {header, chunk4, header}, grpc::INVALID_ARGUMENT,
                   "chunk 1: header repeated"});
  cases.push_back({"num_rows 0", {with_header([](auto& h) { h.set_num_rows(0); })},
                   grpc::INVALID_ARGUMENT, "header.num_rows is 0"});
  cases.push_back({"num_rows absurd",
                   {with_header([](auto& h) { h.set_num_rows(uint64_t{1} << 60); })},
                   grpc::RESOURCE_EXHAUSTED, "header.num_rows is 1152921504606846976, above"});
  cases.push_back({"hidden_dim 0", {with_header([](auto& h) { h.set_hidden_dim(0); })},
                   grpc::INVALID_ARGUMENT, "header.hidden_dim is 0"});
  cases.push_back({"hidden_dim absurd",
                   {with_header([](auto& h) { h.set_hidden_dim(1u << 30); })},
                   grpc::RESOURCE_EXHAUSTED, "header.hidden_dim is 1073741824, above"});
  cases.push_back({"eps 0", {with_header([](auto& h) { h.set_eps(0); })},
                   grpc::INVALID_ARGUMENT, "header.eps is 0"});
  cases.push_back({"eps negative", {with_header([](auto& h) { h.set_eps(-1); })},
                   grpc::INVALID_ARGUMENT, "header.eps is -1"});
  cases.push_back({"eps nan", {with_header([](auto& h) { h.set_eps(std::nanf("")); })},
                   grpc::INVALID_ARGUMENT, "header.eps is nan"});
  cases.push_back({"eps inf", {with_header([](auto& h) { h.set_eps(INFINITY); })},
                   grpc::INVALID_ARGUMENT, "header.eps is inf"});
  cases.push_back({"gamma length", {with_header([](auto& h) { h.set_gamma(std::string(12, 'g')); })},
                   grpc::INVALID_ARGUMENT, "header.gamma has 12 bytes, not hidden_dim*4 = 32"});
  cases.push_back({"unknown dtype",
                   {with_header([](auto& h) { h.set_dtype(static_cast<v1::DType>(9)); })},
                   grpc::INVALID_ARGUMENT, "header.dtype is 9"});
  cases.push_back({"unknown kernel",
                   {with_header([](auto& h) { h.mutable_options()->set_kernel("fast_one"); })},
                   grpc::INVALID_ARGUMENT, "header.options.kernel \"fast_one\" is unknown"});
  {
    const Batch wide = testing::RandomBatch(2, 33, 12, /*with_rms=*/true);
    v1::BackwardRequest h = testing::HeaderFor(wide);
    h.mutable_header()->mutable_options()->set_kernel("rms_norm_backward");
    cases.push_back({"warp kernel hidden_dim 33", {h}, grpc::INVALID_ARGUMENT, "33"});
  }
  cases.push_back({"x and dy differ",
                   {header, with_chunk([](auto& c) { c.mutable_dy()->resize(64); })},
                   grpc::INVALID_ARGUMENT, "chunk 0: x has 128 bytes but dy has 64"});
  cases.push_back({"not a multiple of 4",
                   {header, with_chunk([](auto& c) {
                      c.mutable_x()->resize(127);
                      c.mutable_dy()->resize(127);
                    })},
                   grpc::INVALID_ARGUMENT, "chunk 0: x has 127 bytes, not a multiple of 4"});
  cases.push_back({"not a multiple of hidden_dim",
                   {header, with_chunk([](auto& c) {
                      c.mutable_x()->resize(100);
                      c.mutable_dy()->resize(100);
                    })},
                   grpc::INVALID_ARGUMENT,
                   "chunk 0: x has 100 bytes, not a multiple of hidden_dim*4 = 32"});
  cases.push_back({"more rows than declared",
                   {header, chunk4, chunk4, chunk4}, grpc::INVALID_ARGUMENT,
                   "chunk 2: 4 rows after 8 would exceed header.num_rows = 10"});
  cases.push_back({"fewer rows than declared", {header, chunk4}, grpc::INVALID_ARGUMENT,
                   "the stream ended after 4 of header.num_rows = 10 rows"});
  cases.push_back({"empty stream", {}, grpc::INVALID_ARGUMENT,
                   "the stream ended before its header"});
  cases.push_back({"rms without rms_provided",
                   {header, with_chunk([](auto& c) { c.set_rms(std::string(16, 'r')); })},
                   grpc::INVALID_ARGUMENT, "chunk 0: rms has 16 bytes but header.rms_provided is false"});
  cases.push_back({"rms wrong length",
                   {with_header([](auto& h) { h.set_rms_provided(true); }),
                    with_chunk([](auto& c) { c.set_rms(std::string(12, 'r')); })},
                   grpc::INVALID_ARGUMENT, "chunk 0: rms has 12 bytes, not rows*4 = 16"});
  // The variant fields (gamma is 8 f32 values = 32 bytes).
  cases.push_back({"gamma_offset nan",
                   {with_header([](auto& h) { h.set_gamma_offset(std::nanf("")); })},
                   grpc::INVALID_ARGUMENT,
                   "header.gamma_offset is nan; must be finite"});
  cases.push_back({"gamma_offset with no_gamma",
                   {with_header([](auto& h) {
                     h.set_no_gamma(true);
                     h.clear_gamma();
                     h.set_gamma_offset(1.0f);
                   })},
                   grpc::INVALID_ARGUMENT,
                   "header.gamma_offset is 1 with header.no_gamma"});
  cases.push_back({"gamma bytes with no_gamma",
                   {with_header([](auto& h) { h.set_no_gamma(true); })},
                   grpc::INVALID_ARGUMENT,
                   "header.gamma has 32 bytes; must be empty with header.no_gamma"});
  cases.push_back(
      {"casting_mode 7",
       {with_header([](auto& h) { h.set_casting_mode(static_cast<v1::CastingMode>(7)); })},
       grpc::INVALID_ARGUMENT,
       "header.casting_mode is 7; must be one of"});
  {
    // One message above the server's receive limit (4 MiB by default).
    v1::BackwardRequest big;
    big.set_x(std::string(3 << 20, '\0'));
    big.set_dy(std::string(3 << 20, '\0'));
    cases.push_back({"message over the size limit", {header, big}, grpc::RESOURCE_EXHAUSTED,
                     "larger than max"});
  }
  return cases;
}

TEST_F(ServiceTest, EveryBadInputGetsItsCodeAndAMessageNamingFieldAndNumbers) {
  for (const BadInput& c : BadInputs()) {
    SCOPED_TRACE(c.name);
    grpc::Status s = testing::SendMessages(*stub_, c.messages);
    EXPECT_EQ(s.error_code(), c.code) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(c.message));
  }
  // ... and the server still serves everyone.
  ExpectMatchesReference(*stub_, testing::RandomBatch(20, 16, 9), 7);
}

// gRPC itself refuses a message above --max-message-bytes (RESOURCE_EXHAUSTED, "larger than
// max"); the server's own count of the call must say what the client saw.
TEST_F(ServiceTest, AMessageOverTheSizeLimitIsCountedAsTheClientSawIt) {
  const testing::Batch b = testing::RandomBatch(10, 8, 31);
  auto counts = [&] {
    int code = 0;
    return testing::ParsePrometheusText(
        testing::HttpGet(server_->metrics_port(), "/metrics", &code), nullptr);
  };
  const std::string exhausted =
      "normgrad_requests_total{code=\"RESOURCE_EXHAUSTED\",method=\"RmsNormBackward\"}";
  const std::string invalid =
      "normgrad_requests_total{code=\"INVALID_ARGUMENT\",method=\"RmsNormBackward\"}";
  auto before = counts();
  v1::BackwardRequest big;
  big.set_x(std::string(3 << 20, '\0'));
  big.set_dy(std::string(3 << 20, '\0'));
  grpc::Status s = testing::SendMessages(*stub_, {testing::HeaderFor(b), big});
  ASSERT_EQ(s.error_code(), grpc::RESOURCE_EXHAUSTED) << s.error_message();
  ASSERT_TRUE(WaitFor([&] { return server_->live_streams() == 0; }, absl::Seconds(30)));
  auto after = counts();
  // gRPC tells the server only that the call was cancelled, not why: when the cancellation
  // reaches the server before the failed read, the call is counted CANCELLED (about 1 in 8
  // runs here); never as the "stream ended early" it is not.
  const std::string cancelled =
      "normgrad_requests_total{code=\"CANCELLED\",method=\"RmsNormBackward\"}";
  EXPECT_EQ(after[exhausted] - before[exhausted] + after[cancelled] - before[cancelled], 1);
  EXPECT_EQ(after[invalid] - before[invalid], 0);
  EXPECT_EQ(after["normgrad_inflight_bytes"], 0);
}

// Reflection

// gRPC parses a callback method's messages itself unless the method is raw: then a unary call
// whose request does not parse got UNIMPLEMENTED with no message, and a stream's unparsable
// message ended its reads like a half-close. The service parses them and says so.
TEST_F(ServiceTest, AMessageThatDoesNotParseIsInvalidArgumentSayingWhich) {
  grpc::GenericStub stub(testing::ChannelFor(server_->port()));
  const std::string garbage("\xff\xff\xff", 3);  // a field tag whose varint never ends
  for (const auto& [method, type] :
       {std::pair{"EmitPtx", "EmitPtxRequest"}, std::pair{"GetServerInfo", "GetServerInfoRequest"}}) {
    grpc::Slice slice(garbage);
    grpc::ByteBuffer in(&slice, 1), out;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    std::promise<grpc::Status> done;
    stub.UnaryCall(&context, absl::StrCat("/normgrad.v1.NormGrad/", method), grpc::StubOptions(),
                   &in, &out, [&](grpc::Status s) { done.set_value(s); });
    const grpc::Status s = done.get_future().get();
    EXPECT_EQ(s.error_code(), grpc::INVALID_ARGUMENT) << method << ": " << s.error_message();
    EXPECT_EQ(s.error_message(), absl::StrCat("the request (3 bytes) does not parse as a "
                                              "normgrad.v1.", type));
  }

  // The stream: a good header, then a chunk that does not parse.
  GenericStreamingCall call(stub, "/normgrad.v1.NormGrad/RmsNormBackward");
  ASSERT_TRUE(call.Step(1));
  const std::string header = testing::HeaderFor(testing::RandomBatch(4, 8, 1)).SerializeAsString();
  for (const std::string& message : {header, garbage}) ASSERT_TRUE(call.Write(message, 2));
  grpc::ByteBuffer response;
  call->Read(&response, reinterpret_cast<void*>(3));
  bool ok;
  ASSERT_TRUE(call.Next(&ok));
  EXPECT_FALSE(ok) << "a response to an unparsable chunk";
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(4));
  ASSERT_TRUE(call.Next(&ok));
  EXPECT_EQ(status.error_code(), grpc::INVALID_ARGUMENT) << status.error_message();
  EXPECT_EQ(status.error_message(),
            "chunk 0 (3 bytes) does not parse as a normgrad.v1.BackwardRequest");
}

// A client string of 100 KB in an error would pass gRPC's default 8 KiB metadata limit on the
// way back (the client then sees a transport error instead of the server's answer).
TEST_F(ServiceTest, LongClientStringsAreNotEchoedWhole) {
  const std::string long_text(100000, 'z');
  auto expect_bounded = [](const grpc::Status& s, const std::string& field) {
    SCOPED_TRACE(field);
    const std::string head = s.error_message().substr(0, 512);
    EXPECT_EQ(s.error_code(), grpc::INVALID_ARGUMENT) << head;
    EXPECT_THAT(head, HasSubstr(field + " \"zzzz"));
    EXPECT_THAT(head, HasSubstr("\"... (100000 bytes)"));
    EXPECT_LT(s.error_message().size(), 512u) << head;
  };
  v1::BackwardRequest header = testing::HeaderFor(testing::RandomBatch(2, 8, 1));
  header.mutable_header()->mutable_options()->set_kernel(long_text);
  expect_bounded(testing::SendMessages(*stub_, {header}), "header.options.kernel");

  v1::EmitPtxResponse r;
  v1::EmitPtxRequest kernel = PtxRequest(896, "sm_90");
  kernel.set_kernel(long_text);
  expect_bounded(Emit(*stub_, kernel, &r), "kernel");
  expect_bounded(Emit(*stub_, PtxRequest(896, long_text), &r), "target");
  v1::EmitPtxRequest version = PtxRequest(896, "sm_90");
  version.set_ptx_version(long_text);
  expect_bounded(Emit(*stub_, version, &r), "ptx_version");
}

}  // namespace
}  // namespace normgrad::server::service_test
