// The `normgrad` CLI and `normgrad-load` against a real server on loopback: .npy round trips
// checked against the reference, every server-error path, and the load generator's counts
// (exact request counts, and errors counted by code against an overloaded server).
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "client/tools/cli.h"
#include "client/tools/load_flags.h"
#include "client/tools/npy.h"
#include "gtest/gtest.h"
#include "tests/client/test_server.h"

namespace normgrad::tools {
namespace {

using ::normgrad::testing::Address;
using ::normgrad::testing::Batch;

struct Result {
  int code;
  std::string out, err;
};

Result Cli(const std::vector<std::string>& args, const std::string& env_target = "",
           bool terminal = false) {
  std::ostringstream out, err;
  CliEnvironment env;
  env.normgrad_target = env_target;
  env.stderr_is_terminal = terminal;
  const int code = RunCli(args, env, out, err);
  return {code, out.str(), err.str()};
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

class CliServerTest : public testing::TestServerFixture {
 protected:
  void SetUp() override {
    TestServerFixture::SetUp();
    if (server_ != nullptr) target_ = "--target=" + Address(*server_);
  }
  std::string P(const std::string& name) {
    return ::testing::TempDir() + "/cli_server_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name() + "_" + name;
  }
  void Save(const std::string& name, std::vector<uint64_t> shape, const std::vector<float>& v) {
    ASSERT_TRUE(npy::WriteF32(P(name), shape, v).ok());
  }
  std::string target_;
};

TEST_F(CliServerTest, BackwardNpyRoundTripMatchesReference) {
  // (2, 150, 64): leading dimensions are rows; 300 rows over several 16 KiB chunks.
  const Batch b(300, 64, /*seed=*/21);
  Save("x.npy", {2, 150, 64}, b.x);
  Save("dy.npy", {2, 150, 64}, b.dy);
  Save("g.npy", {64}, b.gamma);
  const Result r =
      Cli({target_, "backward", "--x", P("x.npy"), "--dy", P("dy.npy"), "--gamma", P("g.npy"),
           "--eps=1e-5", "--chunk-bytes=16384", "--dx", P("dx.npy"), "--dgamma", P("dg.npy")});
  ASSERT_EQ(r.code, kExitOk) << r.err;
  EXPECT_NE(r.out.find("rows=300 hidden_dim=64 backend=cpu"), std::string::npos) << r.out;
  absl::StatusOr<npy::Array> dx = npy::ReadF32(P("dx.npy"));
  absl::StatusOr<npy::Array> dg = npy::ReadF32(P("dg.npy"));
  ASSERT_TRUE(dx.ok() && dg.ok());
  EXPECT_EQ(dx->shape, (std::vector<uint64_t>{2, 150, 64}));
  EXPECT_EQ(dg->shape, (std::vector<uint64_t>{64}));
  testing::ExpectGradientsClose(dx->data, dg->data, b);
}

TEST_F(CliServerTest, ProgressBarOnlyOnATerminal) {
  const Batch b(64, 32, /*seed=*/24);
  Save("px.npy", {64, 32}, b.x);
  Save("pg.npy", {32}, b.gamma);
  const std::vector<std::string> args = {
      target_,     "backward", "--x",       P("px.npy"),         "--dy",
      P("px.npy"), "--gamma",  P("pg.npy"), "--chunk-bytes=1024"};  // 8 rows per message
  const Result tty = Cli(args, "", /*terminal=*/true);
  ASSERT_EQ(tty.code, kExitOk) << tty.err;
  EXPECT_NE(tty.err.find("100%  64/64 rows"), std::string::npos) << tty.err;
  EXPECT_NE(tty.err.find("\r["), std::string::npos);
  const Result pipe = Cli(args, "", /*terminal=*/false);
  ASSERT_EQ(pipe.code, kExitOk) << pipe.err;
  EXPECT_EQ(pipe.err, "");
}

TEST_F(CliServerTest, BackwardWithRmsUsesIt) {
  const Batch b(7, 32, /*seed=*/22, 1e-5f, /*with_rms=*/true);
  Save("rx.npy", {7, 32}, b.x);
  Save("rdy.npy", {7, 32}, b.dy);
  Save("rg.npy", {32}, b.gamma);
  Save("rms.npy", {7}, b.rms);
  const Result r = Cli({"backward", "--x", P("rx.npy"), "--dy", P("rdy.npy"), "--gamma",
                        P("rg.npy"), "--rms", P("rms.npy"), "--dx", P("rdx.npy")},
                       Address(*server_));  // target from $NORMGRAD_TARGET
  ASSERT_EQ(r.code, kExitOk) << r.err;
  absl::StatusOr<npy::Array> dx = npy::ReadF32(P("rdx.npy"));
  ASSERT_TRUE(dx.ok());
  testing::ExpectClose(dx->data, b.dx, "dx");
}

TEST_F(CliServerTest, ServerRejectionExits1WithCodeAndMessage) {
  const Batch b(2, 8, /*seed=*/23);
  Save("ex.npy", {2, 8}, b.x);
  Save("eg.npy", {8}, b.gamma);
  const Result r = Cli({target_, "backward", "--x", P("ex.npy"), "--dy", P("ex.npy"), "--gamma",
                        P("eg.npy"), "--eps=0"});
  EXPECT_EQ(r.code, kExitServerError);
  EXPECT_EQ(r.err.rfind("error: INVALID_ARGUMENT: header.eps is 0", 0), 0u) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1);

  const Result k = Cli({target_, "emit-ptx", "--kernel=nope", "--hidden-dim=64"});
  EXPECT_EQ(k.code, kExitServerError);
  EXPECT_EQ(k.err.rfind("error: INVALID_ARGUMENT: ", 0), 0u) << k.err;
}

TEST_F(CliServerTest, EmitPtxWritesTheFileWithTheGpuTargetFlag) {
  const Result r = Cli({target_, "emit-ptx", "--kernel=batched_rms_norm_backward",
                        "--hidden-dim=896", "--target=sm_80", "-o", P("k.ptx")});
  ASSERT_EQ(r.code, kExitOk) << r.err;
  const std::string ptx = ReadAll(P("k.ptx"));
  EXPECT_NE(ptx.find(".target sm_80"), std::string::npos);
  EXPECT_NE(ptx.find(".entry batched_rms_norm_backward"), std::string::npos);
  EXPECT_NE(r.err.find("sha256"), std::string::npos);
  // Without -o the PTX goes to stdout.
  const Result s =
      Cli({target_, "emit-ptx", "--kernel=batched_rms_norm_backward", "--hidden-dim=896"});
  ASSERT_EQ(s.code, kExitOk) << s.err;
  EXPECT_NE(s.out.find(".entry batched_rms_norm_backward"), std::string::npos);
}

// --gamma-offset, --no-gamma and --casting-mode ask for that variant: other PTX than the default,
// its label in --out-dir's file names; a bad value is a usage error naming the flag.
TEST_F(CliServerTest, EmitPtxVariantFlagsEmitTheVariant) {
  const std::vector<std::string> base = {target_, "emit-ptx",
                                         "--kernel=rms_norm_backward_row_resident",
                                         "--hidden-dim=4096", "--target=sm_90", "--dtype=bf16"};
  auto with = [&](std::vector<std::string> more) {
    std::vector<std::string> args = base;
    args.insert(args.end(), more.begin(), more.end());
    return Cli(args);
  };
  const Result plain = with({});
  ASSERT_EQ(plain.code, kExitOk) << plain.err;
  const Result gemma = with({"--gamma-offset=1"});
  ASSERT_EQ(gemma.code, kExitOk) << gemma.err;
  const Result llama = with({"--casting-mode=llama"});
  ASSERT_EQ(llama.code, kExitOk) << llama.err;
  const Result no_gamma = with({"--no-gamma"});
  ASSERT_EQ(no_gamma.code, kExitOk) << no_gamma.err;
  EXPECT_NE(plain.out, gemma.out);
  EXPECT_NE(plain.out, llama.out);
  EXPECT_NE(plain.out, no_gamma.out);
  EXPECT_NE(gemma.out, llama.out);

  const std::string dir = P("variants");
  std::filesystem::remove_all(dir);  // a file from an earlier run must not pass for this one's
  ASSERT_TRUE(std::filesystem::create_directory(dir));
  const Result files = with({"--gamma-offset=1", "--casting-mode=llama", "--out-dir", dir});
  ASSERT_EQ(files.code, kExitOk) << files.err;
  const std::string ptx =
      ReadAll(dir + "/rms_norm_backward_row_resident_off1_llama.bf16.sm_90.ptx");
  EXPECT_NE(ptx.find(".entry rms_norm_backward_row_resident"), std::string::npos) << files.err;
  EXPECT_NE(ptx, plain.out);

  const Result bad = with({"--casting-mode=mistral"});
  EXPECT_EQ(bad.code, kExitUsage);
  EXPECT_NE(bad.err.find("--casting-mode: \"mistral\" is not llama, gemma or none"),
            std::string::npos)
      << bad.err;
  const Result both = with({"--no-gamma", "--gamma-offset=1"});
  EXPECT_EQ(both.code, kExitUsage);
  EXPECT_NE(both.err.find("--no-gamma takes no --gamma-offset"), std::string::npos) << both.err;
}

TEST_F(CliServerTest, EmitPtxCubinIsAnElfFileOrAFailedPrecondition) {
  // The server compiles cubins with nvJitLink when it finds one; without it the call fails with
  // FAILED_PRECONDITION, which the CLI reports as a server error.
  const Result r =
      Cli({target_, "emit-ptx", "--kernel=batched_rms_norm_backward", "--hidden-dim=896",
           "--target=sm_90", "-o", P("c.ptx"), "--cubin", P("c.cubin")});
  if (r.code == kExitOk) {
    EXPECT_EQ(ReadAll(P("c.cubin")).substr(0, 4),
              "\x7f"
              "ELF");
    EXPECT_NE(r.err.find("cubin sha256"), std::string::npos) << r.err;
  } else {
    EXPECT_EQ(r.code, kExitServerError);
    EXPECT_EQ(r.err.rfind("error: FAILED_PRECONDITION: ", 0), 0u) << r.err;
  }
}

TEST_F(CliServerTest, InfoPrintsJsonAndHealthPrintsServing) {
  const Result info = Cli({target_, "info"});
  ASSERT_EQ(info.code, kExitOk) << info.err;
  EXPECT_NE(info.out.find("\"backend\": \"cpu\""), std::string::npos) << info.out;
  const Result health = Cli({"health", target_});
  EXPECT_EQ(health.code, kExitOk) << health.err;
  EXPECT_EQ(health.out, "SERVING\n");
  const Result unknown = Cli({"health", target_, "--service=no.such.Service"});
  EXPECT_EQ(unknown.code, kExitServerError);
  EXPECT_EQ(unknown.err.rfind("error: NOT_FOUND: ", 0), 0u) << unknown.err;
}

class LoadServerTest : public testing::TestServerFixture {
 protected:
  // normgrad-load against this test's server: --target, then `flags`.
  Result Load(std::vector<std::string> flags, bool terminal = false) {
    flags.insert(flags.begin(), "--target=" + Address(*server_));
    std::ostringstream out, err;
    const int code = RunLoad(flags, "", terminal, out, err);
    return {code, out.str(), err.str()};
  }
  int CountOf(const std::string& json, const std::string& key) {
    const size_t at = json.find("\"" + key + "\":");
    if (at == std::string::npos) return -1;
    return std::stoi(json.substr(at + key.size() + 3));
  }
};

TEST_F(LoadServerTest, KnownNumberOfRequestsIsCountedExactly) {
  const Result r = Load({"--total=60", "--concurrency=6", "--shapes=8x256,3x128,17x64",
                         "--warmup=5", "--format=json"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(CountOf(r.out, "requests"), 60) << r.out;
  EXPECT_EQ(CountOf(r.out, "successes"), 60);
  EXPECT_EQ(CountOf(r.out, "errors"), 0);
  EXPECT_NE(r.out.find("\"errors_by_code\":{}"), std::string::npos);
}

TEST_F(LoadServerTest, LiveProgressLineOnlyOnATerminal) {
  // Paced so the run outlasts a few 250 ms redraws: 20 requests at 25/s.
  const std::vector<std::string> args = {"--total=20", "--rate=25", "--shapes=2x32",
                                         "--format=csv"};
  const Result tty = Load(args, /*terminal=*/true);
  ASSERT_EQ(tty.code, 0) << tty.err;
  EXPECT_NE(tty.err.find("concurrency 8: "), std::string::npos) << tty.err;
  EXPECT_NE(tty.err.find(" done, 0 errors"), std::string::npos) << tty.err;
  const Result pipe = Load(args, /*terminal=*/false);
  ASSERT_EQ(pipe.code, 0) << pipe.err;
  EXPECT_EQ(pipe.err, "");
}

TEST_F(LoadServerTest, ConnectionsRateAndEmitPtxAllComplete) {
  const Result conn =
      Load({"--total=30", "--concurrency=4", "--connections=3", "--shapes=4x64", "--format=csv"});
  ASSERT_EQ(conn.code, 0) << conn.err;
  EXPECT_NE(conn.out.find("\n4,30,30,0,"), std::string::npos) << conn.out;
  const Result paced =
      Load({"--total=20", "--rate=400", "--rate-dist=poisson", "--shapes=2x32", "--format=csv"});
  ASSERT_EQ(paced.code, 0) << paced.err;
  EXPECT_NE(paced.out.find(",20,20,0,"), std::string::npos) << paced.out;
  const Result ptx =
      Load({"--call=emit-ptx", "--total=12", "--concurrency=3", "--shapes=1x896", "--format=json"});
  ASSERT_EQ(ptx.code, 0) << ptx.err;
  EXPECT_EQ(CountOf(ptx.out, "successes"), 12) << ptx.out;
}

TEST_F(LoadServerTest, OverloadedServerErrorsAreCountedByCode) {
  // This test's server admits one stream at a time.
  server_ = testing::StartTestServer([](server::ServerOptions& o) { o.admission.max_streams = 1; });
  ASSERT_NE(server_, nullptr);
  // 512 x 1024 (2 MiB of x) is a stream, holding its slot through its upload (a one-message
  // batch holds it only while computed).
  const Result r = Load({"--total=48", "--concurrency=8", "--shapes=512x1024", "--format=json"});
  ASSERT_EQ(r.code, 0) << r.err;
  const int requests = CountOf(r.out, "requests");
  const int successes = CountOf(r.out, "successes");
  const int exhausted = CountOf(r.out, "RESOURCE_EXHAUSTED");
  EXPECT_EQ(requests, 48) << r.out;
  EXPECT_GT(exhausted, 0) << r.out;
  EXPECT_GT(successes, 0) << r.out;
  EXPECT_EQ(successes + exhausted, 48) << r.out;
  EXPECT_EQ(CountOf(r.out, "errors"), exhausted);
}

TEST_F(LoadServerTest, DurationRunStopsByItselfAndSweepWritesHtml) {
  const Result timed =
      Load({"--duration=300ms", "--concurrency=2", "--shapes=4x64", "--format=json"});
  ASSERT_EQ(timed.code, 0) << timed.err;
  EXPECT_GT(CountOf(timed.out, "requests"), 0);
  EXPECT_EQ(CountOf(timed.out, "requests"), CountOf(timed.out, "successes"));

  const std::string html = ::testing::TempDir() + "/load_sweep.html";
  const Result sweep = Load({"--concurrency-sweep=1:3:2", "--window=150ms", "--max-windows=4",
                             "--shapes=4x64", "--format=csv", "--html=" + html});
  ASSERT_EQ(sweep.code, 0) << sweep.err;
  EXPECT_NE(sweep.out.find("\n1,"), std::string::npos) << sweep.out;
  EXPECT_NE(sweep.out.find("\n3,"), std::string::npos) << sweep.out;
  const std::string page = ReadAll(html);
  EXPECT_NE(page.find("<polyline"), std::string::npos);
  EXPECT_NE(page.find("Latency histogram, concurrency 3"), std::string::npos);
}

}  // namespace
}  // namespace normgrad::tools
