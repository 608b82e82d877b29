// The CLI's paths that need no server: usage errors, bad input files (exit 2, one line), and an
// unreachable server (exit 1, "error: UNAVAILABLE: ...").
#include "client/tools/cli.h"

#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "client/tools/npy.h"
#include "client/tools/tool_flags.h"
#include "gtest/gtest.h"

namespace normgrad::tools {
namespace {

struct Result {
  int code;
  std::string out, err;
};

Result RunTool(const std::vector<std::string>& args, const std::string& env_target = "") {
  std::ostringstream out, err;
  CliEnvironment env;
  env.normgrad_target = env_target;
  const int code = RunCli(args, env, out, err);
  return {code, out.str(), err.str()};
}

int Lines(const std::string& s) { return static_cast<int>(std::count(s.begin(), s.end(), '\n')); }

class CliFilesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir();
    Write("x.npy", {3, 4}, std::vector<float>(12, 1.0f));
    Write("g.npy", {4}, std::vector<float>(4, 1.0f));
    Write("g5.npy", {5}, std::vector<float>(5, 1.0f));
    Write("x1d.npy", {12}, std::vector<float>(12, 1.0f));
    Write("dy_other.npy", {4, 3}, std::vector<float>(12, 1.0f));
    const std::string good =
        npy::SerializeF32(std::vector<uint64_t>{3, 4}, std::vector<float>(12, 1));
    RawWrite("trunc.npy", good.substr(0, good.size() - 5));
    std::string f8 = good;
    f8.replace(f8.find("<f4"), 3, "<f8");
    RawWrite("f8.npy", f8);
    std::string fortran = good;
    fortran.replace(fortran.find("False"), 5, "True ");
    RawWrite("fortran.npy", fortran);
  }
  // Per-test names: ctest runs each test as its own process, in parallel.
  std::string P(const std::string& name) {
    return dir_ + "/cli_test_" + ::testing::UnitTest::GetInstance()->current_test_info()->name() +
           "_" + name;
  }
  void Write(const std::string& name, std::vector<uint64_t> shape, std::vector<float> data) {
    ASSERT_TRUE(npy::WriteF32(P(name), shape, data).ok());
  }
  void RawWrite(const std::string& name, const std::string& bytes) {
    std::ofstream(P(name), std::ios::binary) << bytes;
  }
  std::vector<std::string> Backward(const std::string& x, const std::string& dy,
                                    const std::string& g) {
    return {"--target=127.0.0.1:1", "backward", "--x", P(x), "--dy", P(dy), "--gamma", P(g)};
  }
  std::string dir_;
};

TEST(CliTest, NoCommandPrintsUsageAndExits2) {
  const Result r = RunTool({});
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_NE(r.err.find("usage: normgrad"), std::string::npos);
}

TEST(CliTest, HelpExits0OnStdout) {
  const Result r = RunTool({"help"});
  EXPECT_EQ(r.code, kExitOk);
  EXPECT_NE(r.out.find("emit-ptx"), std::string::npos);
}

TEST(CliTest, UnknownCommandAndFlagsExit2WithOneLine) {
  for (const std::vector<std::string>& args :
       std::vector<std::vector<std::string>>{{"frobnicate"},
                                             {"info", "--bogus"},
                                             {"--bogus", "info"},
                                             {"info", "extra"},
                                             {"backward", "--x"},
                                             {"info", "--deadline=soon"},
                                             {"info", "--max-attempts=0"},
                                             {"info", "--tls-cert=/nonexistent"},
                                             {"info", "--tls-ca=/nonexistent/ca.pem"},
                                             {"emit-ptx"},
                                             {"emit-ptx", "--kernel=k", "--dtype=f64"},
                                             {"emit-ptx", "--kernel=k", "--hidden-dim=-3"}}) {
    const Result r = RunTool(args);
    EXPECT_EQ(r.code, kExitUsage) << args[0] << " " << r.err;
    EXPECT_EQ(Lines(r.err), 1) << r.err;
    EXPECT_EQ(r.err.rfind("normgrad: ", 0), 0u) << r.err;
  }
}

TEST_F(CliFilesTest, BadInputFilesExit2WithOneLineNamingTheProblem) {
  const struct {
    std::vector<std::string> args;
    std::string expected;
  } cases[] = {
      {Backward("missing.npy", "x.npy", "g.npy"), "cannot open"},
      {Backward("f8.npy", "x.npy", "g.npy"), "dtype '<f8'"},
      {Backward("fortran.npy", "x.npy", "g.npy"), "Fortran"},
      {Backward("trunc.npy", "x.npy", "g.npy"), "truncated data"},
      {Backward("x1d.npy", "x1d.npy", "g.npy"), "needs 2 or more dimensions"},
      {Backward("x.npy", "dy_other.npy", "g.npy"), "differs from x's (3, 4)"},
      {Backward("x.npy", "x.npy", "g5.npy"), "expected (4,)"},
      {{"backward", "--dy", "a", "--gamma", "b"}, "--x is required"},
  };
  for (const auto& c : cases) {
    const Result r = RunTool(c.args);
    EXPECT_EQ(r.code, kExitUsage) << c.expected;
    EXPECT_EQ(Lines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find(c.expected), std::string::npos) << r.err;
  }
  std::vector<std::string> eps = Backward("x.npy", "x.npy", "g.npy");
  eps.push_back("--eps=tiny");
  EXPECT_EQ(RunTool(eps).code, kExitUsage);
}

TEST_F(CliFilesTest, BadVariantFlagsExit2WithOneLineNamingTheFlag) {
  auto with = [this](std::vector<std::string> extra) {
    std::vector<std::string> args = Backward("x.npy", "x.npy", "g.npy");
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  };
  const std::vector<std::string> no_gamma = {
      "--target=127.0.0.1:1", "backward", "--x", P("x.npy"), "--dy", P("x.npy"), "--no-gamma"};
  std::vector<std::string> no_gamma_offset = no_gamma, no_gamma_dgamma = no_gamma;
  no_gamma_offset.push_back("--gamma-offset=1");
  no_gamma_dgamma.push_back("--dgamma=" + P("dg.npy"));
  const struct {
    std::vector<std::string> args;
    std::string expected;
  } cases[] = {
      {with({"--gamma-offset=nan"}), "--gamma-offset: not a finite number: \"nan\""},
      {with({"--gamma-offset=one"}), "--gamma-offset: not a finite number: \"one\""},
      {with({"--casting-mode=bf16"}), "--casting-mode: \"bf16\" is not llama, gemma or none"},
      {with({"--no-gamma"}), "--no-gamma takes no --gamma, --dgamma or --gamma-offset"},
      {no_gamma_offset, "--no-gamma takes no --gamma"},
      {no_gamma_dgamma, "--no-gamma takes no --gamma"},
      {{"backward", "--x", P("x.npy"), "--dy", P("x.npy")}, "--gamma is required"},
  };
  for (const auto& c : cases) {
    const Result r = RunTool(c.args);
    EXPECT_EQ(r.code, kExitUsage) << c.expected;
    EXPECT_EQ(Lines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find(c.expected), std::string::npos) << r.err;
  }
  // Well-formed variant flags reach the (unreachable) server.
  std::vector<std::string> good = no_gamma;
  good.insert(good.end(), {"--casting-mode=llama", "--max-attempts=1"});
  EXPECT_EQ(RunTool(good).code, kExitServerError) << RunTool(good).err;
}

TEST_F(CliFilesTest, UnreachableServerExits1WithTheGrpcCode) {
  std::vector<std::string> args = Backward("x.npy", "x.npy", "g.npy");
  args.push_back("--max-attempts=1");
  const Result r = RunTool(args);
  EXPECT_EQ(r.code, kExitServerError);
  EXPECT_EQ(r.err.rfind("error: UNAVAILABLE: ", 0), 0u) << r.err;
  EXPECT_EQ(Lines(r.err), 1);
}

TEST(CliTest, TargetComesFromFlagThenEnvironment) {
  // Both unreachable; the message names the address that was used.
  const Result from_env = RunTool({"health", "--max-attempts=1"}, "127.0.0.1:1");
  EXPECT_EQ(from_env.code, kExitServerError);
  EXPECT_NE(from_env.err.find("127.0.0.1:1"), std::string::npos) << from_env.err;
  const Result from_flag =
      RunTool({"--target=127.0.0.1:2", "info", "--max-attempts=1"}, "127.0.0.1:1");
  EXPECT_EQ(from_flag.code, kExitServerError);
  EXPECT_NE(from_flag.err.find("127.0.0.1:2"), std::string::npos) << from_flag.err;
}

TEST(CliTest, CommandFlagsOverrideGlobalOnesAndEmitPtxTargetIsTheGpu) {
  // A bad global --max-attempts, overridden after the command: the call is made (and fails to
  // connect) instead of a usage error.
  const Result overridden =
      RunTool({"--target=127.0.0.1:1", "--max-attempts=0", "info", "--max-attempts=1"});
  EXPECT_EQ(overridden.code, kExitServerError) << overridden.err;
  // After emit-ptx, --target is the GPU architecture; the server stays the global one.
  const Result emit = RunTool(
      {"--target=127.0.0.1:2", "emit-ptx", "--kernel=k", "--target=sm_80", "--max-attempts=1"});
  EXPECT_EQ(emit.code, kExitServerError);
  EXPECT_NE(emit.err.find("127.0.0.1:2"), std::string::npos) << emit.err;
}

// The flag forms both tools take, parsed by CLI11 on an app set up as theirs: --name=value,
// --name value, -o value, a boolean --name (and --name=false), "--" ending the flags; a flag given
// twice keeps its last value; leftovers are reported by name, not dropped.
struct SampleTool {
  SampleTool() {
    ConfigureToolApp(app);
    app.add_option("--a", a);
    app.add_option("-o", o);
    app.add_flag("--b", b);
    AddIntegerOption(app, "--n", &n);
  }
  absl::Status Parse(const std::vector<std::string>& args) {
    absl::Status parsed = ParseToolArgs(app, args);
    return parsed.ok() ? CheckAllPlaced(app) : parsed;
  }
  CLI::App app;
  std::optional<std::string> a, o;
  bool b = false;
  int n = 0;
};

TEST(ToolFlagsTest, ParsesEveryFlagForm) {
  SampleTool tool;
  EXPECT_EQ(tool.Parse({"--a=1", "-o", "f", "--b", "--n", "4", "--n=5", "--", "--a"}).message(),
            "unexpected argument \"--a\"");
  EXPECT_EQ(tool.a, "1");
  EXPECT_EQ(tool.o, "f");
  EXPECT_TRUE(tool.b);
  EXPECT_EQ(tool.n, 5);

  SampleTool off;
  ASSERT_TRUE(off.Parse({"--b", "--b=false"}).ok());
  EXPECT_FALSE(off.b);
}

TEST(ToolFlagsTest, BadArgumentsAreInvalidArgumentNamingThem) {
  const std::pair<std::vector<std::string>, std::string> cases[] = {
      {{"--a"}, "--a"},        // needs a value
      {{"--b=maybe"}, "--b"},  // not a boolean
      {{"--c=1"}, "unknown flag --c"},
      {{"pos"}, "unexpected argument \"pos\""},
      {{"--n=x"}, "--n: \"x\" is not an integer"},  // read by absl, with our message
  };
  for (const auto& [args, message] : cases) {
    SampleTool tool;
    const absl::Status s = tool.Parse(args);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << args[0];
    EXPECT_NE(s.message().find(message), absl::string_view::npos) << s;
  }
}

}  // namespace
}  // namespace normgrad::tools
