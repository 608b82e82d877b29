// emit-ptx's local cache (client/tools/ptx_cache.h). In-process: entries round-trip, a corrupt
// blob or entry is DATA_LOSS and fetched again. As a build farm uses it: many `normgrad`
// processes at once against one cache directory and a `normgrad-server` process; every output is
// byte-identical, the server is asked once per configuration, and a corrupted entry is detected
// and fetched again. And emit-ptx's batch without a cache, with --resource-usage.
#include "client/tools/ptx_cache.h"

#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "base/sha256.h"
#include "gtest/gtest.h"
#include "normgrad/client.h"
#include "tests/common/child_process.h"

namespace normgrad::tools {
namespace {

namespace fs = std::filesystem;

std::string TempDir(const std::string& name) {
  std::string pattern = absl::StrCat(::testing::TempDir(), "/", name, "XXXXXX");
  if (mkdtemp(pattern.data()) == nullptr) ADD_FAILURE() << "mkdtemp " << pattern;
  return pattern;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void WriteAll(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

v1::EmitPtxArtifact Artifact(const std::string& ptx) {
  v1::EmitPtxArtifact a;
  a.set_entry("k");
  a.set_ptx(ptx);
  a.mutable_digest()->set_sha256(base::Sha256Hex(ptx));
  a.mutable_digest()->set_size_bytes(ptx.size());
  a.set_target("sm_90");
  return a;
}

v1::EmitPtxRequest Request(const std::string& target) {
  v1::EmitPtxRequest r;
  r.set_kernel("k");
  r.set_hidden_dim(896);
  r.set_target(target);
  return r;
}

TEST(PtxCacheTest, EntriesRoundTripAndKeysSeparateServerVersionsAndConfigurations) {
  absl::StatusOr<PtxCache> cache = PtxCache::Open(TempDir("ptx_cache"));
  ASSERT_TRUE(cache.ok()) << cache.status();
  const std::string key = PtxCache::Key("1.0", Request("sm_90"));
  EXPECT_NE(key, PtxCache::Key("1.1", Request("sm_90")));
  EXPECT_NE(key, PtxCache::Key("1.0", Request("sm_80")));
  // The variant is part of the configuration (an offset down to its last bit).
  v1::EmitPtxRequest variant = Request("sm_90");
  variant.set_gamma_offset(1.0f);
  const std::string offset_key = PtxCache::Key("1.0", variant);
  EXPECT_NE(key, offset_key);
  variant.set_gamma_offset(std::nextafter(1.0f, 2.0f));
  EXPECT_NE(offset_key, PtxCache::Key("1.0", variant));
  variant = Request("sm_90");
  variant.set_no_gamma(true);
  EXPECT_NE(key, PtxCache::Key("1.0", variant));
  variant = Request("sm_90");
  variant.set_casting_mode(v1::CASTING_MODE_LLAMA);
  EXPECT_NE(key, PtxCache::Key("1.0", variant));
  EXPECT_EQ(cache->Read(key).status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(cache->Write(key, Artifact(".version 9.0\n")).ok());
  absl::StatusOr<v1::EmitPtxArtifact> back = cache->Read(key);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->SerializeAsString(), Artifact(".version 9.0\n").SerializeAsString());
}

TEST(PtxCacheTest, ACorruptBlobOrEntryIsDataLossAndFetchedAgain) {
  absl::StatusOr<PtxCache> cache = PtxCache::Open(TempDir("ptx_cache"));
  ASSERT_TRUE(cache.ok()) << cache.status();
  const std::string key = PtxCache::Key("1.0", Request("sm_90"));
  const v1::EmitPtxArtifact artifact = Artifact(".version 9.0\n.target sm_90\n");
  int fetches = 0;
  auto fetch = [&]() -> absl::StatusOr<v1::EmitPtxArtifact> {
    ++fetches;
    return artifact;
  };
  std::string notes;
  ASSERT_TRUE(cache->GetOrFetch(key, fetch, &notes).ok());
  ASSERT_TRUE(cache->GetOrFetch(key, fetch, &notes).ok());
  EXPECT_EQ(fetches, 1);
  EXPECT_EQ(notes, "");

  // One byte of the PTX changed on disk (same size): the blob's sha256 no longer matches.
  const std::string blob = cache->BlobPath(artifact.digest().sha256());
  std::string bytes = ReadAll(blob);
  bytes[3] ^= 1;
  WriteAll(blob, bytes);
  EXPECT_EQ(cache->Read(key).status().code(), absl::StatusCode::kDataLoss);
  absl::StatusOr<v1::EmitPtxArtifact> again = cache->GetOrFetch(key, fetch, &notes);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->ptx(), artifact.ptx());  // served from the fetch, not the corrupt blob
  EXPECT_EQ(fetches, 2);
  EXPECT_NE(notes.find("cache entry corrupt"), std::string::npos) << notes;
  EXPECT_TRUE(cache->Read(key).ok());  // rewritten

  // The entry itself: one byte of its body changed.
  const std::string entry = cache->EntryPath(key);
  bytes = ReadAll(entry);
  bytes.back() ^= 1;
  WriteAll(entry, bytes);
  EXPECT_EQ(cache->Read(key).status().code(), absl::StatusCode::kDataLoss);
  notes.clear();
  ASSERT_TRUE(cache->GetOrFetch(key, fetch, &notes).ok());
  EXPECT_EQ(fetches, 3);
  EXPECT_NE(notes.find("sha256 of the entry"), std::string::npos) << notes;
}

TEST(PtxCacheTest, UnknownResourceUsageIsNotStored) {
  absl::StatusOr<PtxCache> cache = PtxCache::Open(TempDir("ptx_cache"));
  ASSERT_TRUE(cache.ok()) << cache.status();
  v1::EmitPtxArtifact unknown = Artifact(".version 9.0\n");
  unknown.set_resource_usage_unknown("no nvJitLink");
  std::string notes;
  const std::string key = PtxCache::Key("1.0", Request("sm_90"));
  ASSERT_TRUE(cache->GetOrFetch(key, [&] { return unknown; }, &notes).ok());
  EXPECT_EQ(cache->Read(key).status().code(), absl::StatusCode::kNotFound);
}

#if defined(NORMGRAD_SERVER_PATH) && defined(NORMGRAD_CLI_PATH)

// The server's EmitPtx lookups so far: every EmitPtx of one configuration without cubin or
// resources is one lookup of its PTX cache (hit or miss), and nothing else looks there.
uint64_t PtxCacheLookups(int port) {
  ClientOptions options;
  options.target = absl::StrCat("127.0.0.1:", port);
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(options);
  EXPECT_TRUE(client.ok()) << client.status();
  if (!client.ok()) return 0;
  absl::StatusOr<v1::GetServerInfoResponse> info = (*client)->ServerInfo();
  EXPECT_TRUE(info.ok()) << info.status();
  return info.ok() ? info->ptx_cache().hits() + info->ptx_cache().misses() : 0;
}

struct CliRun {
  int status = -1;
  std::string err;
};

// Starts `count` emit-ptx processes at once, each writing into its own folder under `out_root`,
// and waits for all.
std::vector<CliRun> RunConcurrently(int count, int port, const std::string& cache_dir,
                                    const std::string& out_root) {
  std::vector<testing::ChildProcess> children;
  for (int i = 0; i < count; ++i) {
    const std::string out = absl::StrCat(out_root, "/", i);
    fs::create_directories(out);
    testing::ChildOptions options;
    options.capture_stderr = true;
    absl::StatusOr<testing::ChildProcess> child = testing::ChildProcess::Start(
        {NORMGRAD_CLI_PATH, absl::StrCat("--target=127.0.0.1:", port), "emit-ptx", "--kernel",
         "rms_norm_backward_row_resident", "--hidden-dim", "4096", "--target", "sm_80,sm_90",
         "--dtype", "f32,bf16", "--out-dir", out, "--cache-dir", cache_dir},
        options);
    EXPECT_TRUE(child.ok()) << child.status();
    if (child.ok()) children.push_back(*std::move(child));
  }
  std::vector<CliRun> runs;
  for (testing::ChildProcess& child : children) {
    CliRun run;
    const std::optional<int> status = child.WaitExit(absl::Seconds(120));
    run.status = status && WIFEXITED(*status) ? WEXITSTATUS(*status) : -1;
    run.err = child.Stderr();
    runs.push_back(run);
  }
  return runs;
}

// Every file of `dir`, by name.
std::vector<std::pair<std::string, std::string>> Files(const std::string& dir) {
  std::vector<std::pair<std::string, std::string>> files;
  for (const fs::directory_entry& e : fs::directory_iterator(dir)) {
    files.emplace_back(e.path().filename().string(), ReadAll(e.path().string()));
  }
  std::sort(files.begin(), files.end());
  return files;
}

// normgrad-server on 127.0.0.1:0 (CPU backend, no metrics), stopped by SIGTERM at the end.
absl::StatusOr<testing::ChildProcess> StartServer() {
  testing::ChildOptions options;
  options.stop_signal = SIGTERM;
  return testing::ChildProcess::Start(
      {NORMGRAD_SERVER_PATH, "--listen=127.0.0.1:0", "--metrics_listen=", "--backend=cpu"},
      options);
}

TEST(PtxCacheProcessTest, ConcurrentBuildsFetchEachConfigurationOnceAndRefetchCorruption) {
  absl::StatusOr<testing::ChildProcess> server = StartServer();
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = server->AwaitReady(absl::Seconds(60)).grpc_port;
  ASSERT_GT(port, 0);
  const std::string cache_dir = TempDir("ptx_cache_shared");
  const std::string out_root = TempDir("ptx_cache_out");

  // 8 builds of the same 4 configurations (2 targets x 2 dtypes), all at once.
  constexpr int kBuilds = 8;
  const std::vector<CliRun> runs = RunConcurrently(kBuilds, port, cache_dir, out_root);
  ASSERT_EQ(runs.size(), static_cast<size_t>(kBuilds));
  for (const CliRun& run : runs) EXPECT_EQ(run.status, 0) << run.err;
  const auto reference = Files(out_root + "/0");
  ASSERT_EQ(reference.size(), 4u);
  for (int i = 1; i < kBuilds; ++i) {
    EXPECT_TRUE(Files(absl::StrCat(out_root, "/", i)) == reference) << "build " << i;
  }
  EXPECT_EQ(PtxCacheLookups(port), 4u);  // one EmitPtx per configuration

  // Corrupt the stored PTX of one configuration: the next build notices, fetches it again (one
  // more EmitPtx), writes the right bytes, and repairs the entry for the build after it.
  const std::string& ptx = reference[0].second;
  const std::string blob = absl::StrCat(cache_dir, "/cas/", base::Sha256Hex(ptx));
  std::string bytes = ReadAll(blob);
  ASSERT_EQ(bytes, ptx);
  bytes[bytes.size() / 2] ^= 0x20;
  WriteAll(blob, bytes);
  std::vector<CliRun> again = RunConcurrently(1, port, cache_dir, out_root + "/after");
  ASSERT_EQ(again.size(), 1u);
  EXPECT_EQ(again[0].status, 0) << again[0].err;
  EXPECT_NE(again[0].err.find("cache entry corrupt"), std::string::npos) << again[0].err;
  EXPECT_TRUE(Files(out_root + "/after/0") == reference);
  EXPECT_EQ(PtxCacheLookups(port), 5u);
  again = RunConcurrently(1, port, cache_dir, out_root + "/repaired");
  EXPECT_EQ(again[0].status, 0) << again[0].err;
  EXPECT_EQ(again[0].err.find("corrupt"), std::string::npos) << again[0].err;
  EXPECT_TRUE(Files(out_root + "/repaired/0") == reference);
  EXPECT_EQ(PtxCacheLookups(port), 5u);
}

// Without a cache, several configurations go as one batch request; --resource-usage prints one
// line per configuration, in order, instead of the PTX.
TEST(PtxCacheProcessTest, WithoutACacheABatchGivesOneResourceLinePerConfiguration) {
  absl::StatusOr<testing::ChildProcess> server = StartServer();
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = server->AwaitReady(absl::Seconds(60)).grpc_port;
  ASSERT_GT(port, 0);
  testing::ChildOptions options;
  options.capture_stderr = true;
  absl::StatusOr<testing::ChildProcess> cli = testing::ChildProcess::Start(
      {NORMGRAD_CLI_PATH, absl::StrCat("--target=127.0.0.1:", port), "emit-ptx", "--kernel",
       "rms_norm_backward_row_resident", "--hidden-dim", "896", "--target", "sm_80",
       "--target", "sm_90", "--dtype", "bf16", "--resource-usage"},
      options);
  ASSERT_TRUE(cli.ok()) << cli.status();
  const std::string out = cli->ReadRest(absl::Seconds(120));
  const std::optional<int> status = cli->WaitExit(absl::Seconds(60));
  ASSERT_TRUE(status && WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << cli->Stderr();
  std::vector<std::string> lines;
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  ASSERT_EQ(lines.size(), 2u) << out;
  EXPECT_EQ(lines[0].rfind("rms_norm_backward_row_resident dtype=bf16 target=sm_80 ptx_version=7.0 "
                           "min_cuda_driver=11.0 ",
                           0),
            0u)
      << lines[0];
  EXPECT_EQ(lines[1].rfind("rms_norm_backward_row_resident dtype=bf16 target=sm_90 ptx_version=7.8 "
                           "min_cuda_driver=11.8 ",
                           0),
            0u)
      << lines[1];
  for (const std::string& line : lines) {
    EXPECT_TRUE(line.find(" registers=") != std::string::npos ||
                line.find(" resources=unknown (nvJitLink is not available") != std::string::npos)
        << line;
  }
}

#endif

}  // namespace
}  // namespace normgrad::tools
