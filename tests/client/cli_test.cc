// The CLI's paths that need no server: usage errors, bad input files (exit 2, one line), and an
// unreachable server (exit 1, "error: UNAVAILABLE: ...").
#include "client/tools/cli.h"

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "client/tools/flag_parser.h"
#include "client/tools/npy.h"
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

TEST(FlagParserTest, ParsesEveryFlagForm) {
  const FlagSpec spec = {{"a", true}, {"b", false}, {"o", true}};
  absl::StatusOr<ParsedArgs> p = ParseArgs({"--a=1", "-o", "f", "--b", "pos", "--", "--a"}, spec);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->Get("a"), "1");
  EXPECT_EQ(p->Get("o"), "f");
  EXPECT_TRUE(p->Has("b"));
  EXPECT_EQ(p->positional, (std::vector<std::string>{"pos", "--a"}));
  EXPECT_FALSE(ParseArgs({"--a"}, spec).ok());
  EXPECT_FALSE(ParseArgs({"--b=yes"}, spec).ok());
  EXPECT_FALSE(ParseArgs({"--c"}, spec).ok());
  absl::StatusOr<ParsedArgs> off = ParseArgs({"--b", "--b=false"}, spec);
  ASSERT_TRUE(off.ok());
  EXPECT_FALSE(off->Has("b"));
}

}  // namespace
}  // namespace normgrad::tools
