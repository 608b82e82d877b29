// CUDA IPC end to end: normgrad-server as a subprocess on the CUDA backend over the emulated
// driver (whose device memory is shareable between processes: tests/ptxsim/sim/emulated_driver.cc),
// with --cuda-ipc; this process is the client, with its own device buffers on the "same GPU"
// (the same emulated driver library, loaded here too). The server opens the buffers from their
// IPC handles and runs the kernels on them in place: grad_input appears in this process's device
// memory, and no tensor byte crosses the socket. Skipped when the build has no emulated driver.
#include "normgrad/cuda_ipc.h"

#include <cuda.h>
#include <dlfcn.h>
#include <sys/wait.h>

#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "normgrad/client.h"
#include "tests/common/child_process.h"
#include "tests/server/process/emulated_server.h"
#include "tests/server/service/service_test_util.h"

namespace normgrad {
namespace {

using ::normgrad::testing::ChildProcess;
using ::normgrad::testing::ReadyLine;
using ::testing::HasSubstr;
namespace st = ::normgrad::server::testing;

// The Driver API calls this client makes itself (allocating and filling its buffers), with the
// ABI's types, so the test builds without cuda.h.
// The driver's entry points with cuda.h's own types: a call through a pointer of another
// function type (int for CUresult) is undefined behaviour, which clang's -fsanitize=function
// reports.
struct TestDriver {
  using Ptr = CUdeviceptr;
  decltype(&::cuInit) cuInit;
  decltype(&::cuDeviceGet) cuDeviceGet;
  decltype(&::cuDevicePrimaryCtxRetain) cuDevicePrimaryCtxRetain;
  decltype(&::cuCtxSetCurrent) cuCtxSetCurrent;
  decltype(&::cuMemAlloc_v2) cuMemAlloc_v2;
  decltype(&::cuMemFree_v2) cuMemFree_v2;
  decltype(&::cuMemcpyHtoDAsync_v2) cuMemcpyHtoDAsync_v2;
  decltype(&::cuMemcpyDtoHAsync_v2) cuMemcpyDtoHAsync_v2;
  decltype(&::cuStreamSynchronize) cuStreamSynchronize;
};

template <typename F>
void Resolve(void* lib, const char* name, F& out) {
  out = reinterpret_cast<F>(dlsym(lib, name));
  ASSERT_NE(out, nullptr) << name;
}

class CudaIpcTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::string(NORMGRAD_EMULATED_CUDA).empty()) {
      GTEST_SKIP() << "built without the emulated CUDA driver (no cuda.h)";
    }
    // The client library's ExportCudaBuffer loads the same library: one driver in this process.
    setenv("NORMGRAD_CUDA_DRIVER", NORMGRAD_EMULATED_CUDA, 1);
    void* lib = dlopen(NORMGRAD_EMULATED_CUDA, RTLD_NOW | RTLD_LOCAL);
    ASSERT_NE(lib, nullptr) << dlerror();
    Resolve(lib, "cuInit", d_.cuInit);
    Resolve(lib, "cuDeviceGet", d_.cuDeviceGet);
    Resolve(lib, "cuDevicePrimaryCtxRetain", d_.cuDevicePrimaryCtxRetain);
    Resolve(lib, "cuCtxSetCurrent", d_.cuCtxSetCurrent);
    Resolve(lib, "cuMemAlloc_v2", d_.cuMemAlloc_v2);
    Resolve(lib, "cuMemFree_v2", d_.cuMemFree_v2);
    Resolve(lib, "cuMemcpyHtoDAsync_v2", d_.cuMemcpyHtoDAsync_v2);
    Resolve(lib, "cuMemcpyDtoHAsync_v2", d_.cuMemcpyDtoHAsync_v2);
    Resolve(lib, "cuStreamSynchronize", d_.cuStreamSynchronize);
    ASSERT_EQ(d_.cuInit(0), CUDA_SUCCESS);
    CUdevice device = 0;
    ASSERT_EQ(d_.cuDeviceGet(&device, 0), CUDA_SUCCESS);
    CUcontext context = nullptr;
    ASSERT_EQ(d_.cuDevicePrimaryCtxRetain(&context, device), CUDA_SUCCESS);
    ASSERT_EQ(d_.cuCtxSetCurrent(context), CUDA_SUCCESS);
  }

  void TearDown() override {
    for (TestDriver::Ptr p : allocations_) d_.cuMemFree_v2(p);
  }

  // The server on the emulated driver, with `flags` after the common ones.
  ChildProcess StartServer(std::vector<std::string> flags) {
    absl::StatusOr<ChildProcess> child = testing::StartOnEmulatedDriver({}, std::move(flags));
    EXPECT_TRUE(child.ok()) << child.status();
    return *std::move(child);
  }

  std::unique_ptr<Client> ClientFor(int port, uint64_t chunk_bytes = uint64_t{64} << 20) {
    ClientOptions o;
    o.target = absl::StrCat("127.0.0.1:", port);
    o.max_attempts = 1;
    o.default_deadline = absl::Seconds(120);
    o.shm_chunk_bytes = chunk_bytes;  // rows per device chunk too
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Create(o);
    EXPECT_TRUE(c.ok()) << c.status();
    return *std::move(c);
  }

  TestDriver::Ptr Alloc(size_t bytes) {
    TestDriver::Ptr p = 0;
    EXPECT_EQ(d_.cuMemAlloc_v2(&p, bytes), CUDA_SUCCESS);
    allocations_.push_back(p);
    return p;
  }
  void Upload(TestDriver::Ptr to, const void* from, size_t bytes) {
    ASSERT_EQ(d_.cuMemcpyHtoDAsync_v2(to, from, bytes, nullptr), CUDA_SUCCESS);
    ASSERT_EQ(d_.cuStreamSynchronize(nullptr), CUDA_SUCCESS);
  }
  std::vector<float> Download(TestDriver::Ptr from, size_t count) {
    std::vector<float> out(count, std::nanf(""));
    EXPECT_EQ(d_.cuMemcpyDtoHAsync_v2(out.data(), from, count * 4, nullptr), CUDA_SUCCESS);
    EXPECT_EQ(d_.cuStreamSynchronize(nullptr), CUDA_SUCCESS);
    return out;
  }
  static CudaIpcBuffer Export(TestDriver::Ptr p) {
    absl::StatusOr<CudaIpcBuffer> b = ExportCudaBuffer(p);
    EXPECT_TRUE(b.ok()) << b.status();
    return b.ok() ? *b : CudaIpcBuffer{};
  }

  // A batch placed in one allocation, [x | dy | dx], and its host-side arguments.
  struct DeviceBatch {
    st::Batch batch;
    TestDriver::Ptr base = 0;
    std::vector<float> dgamma;
    RawBackwardArgs args;
  };
  DeviceBatch Place(uint64_t rows, uint32_t hidden, uint32_t seed, bool with_rms = false) {
    DeviceBatch b;
    b.batch = st::RandomBatch(rows, hidden, seed, with_rms);
    const size_t bytes = rows * hidden * 4;
    b.base = Alloc(3 * bytes);
    Upload(b.base, b.batch.x.data(), bytes);
    Upload(b.base + bytes, b.batch.dy.data(), bytes);
    b.dgamma.assign(hidden, std::nanf(""));
    absl::StatusOr<std::string> uuid = CudaDeviceUuid(0);
    EXPECT_TRUE(uuid.ok()) << uuid.status();
    CudaIpcTensors t;
    t.device_uuid = uuid.ok() ? *uuid : "";
    t.x = Export(b.base);
    t.dy = Export(b.base + bytes);
    t.dx = Export(b.base + 2 * bytes);
    b.args.num_rows = rows;
    b.args.hidden_dim = hidden;
    b.args.eps = b.batch.eps;
    b.args.gamma = absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(b.batch.gamma.data()),
                                       hidden * 4u);
    b.args.dgamma = absl::MakeSpan(reinterpret_cast<uint8_t*>(b.dgamma.data()), hidden * 4u);
    b.args.device = std::move(t);
    return b;
  }

  // dx in device memory and dgamma against the reference.
  void ExpectMatchesReference(const DeviceBatch& b) {
    std::vector<float> want_dx, want_dgamma;
    st::ReferenceFor(b.batch, want_dx, want_dgamma);
    const size_t bytes = b.batch.rows * b.batch.hidden * 4;
    const std::vector<float> dx = Download(b.base + 2 * bytes, want_dx.size());
    for (size_t i = 0; i < dx.size(); ++i) {
      ASSERT_NEAR(dx[i], want_dx[i], 1e-4f * (1 + std::fabs(want_dx[i]))) << "dx[" << i << "]";
    }
    for (size_t i = 0; i < want_dgamma.size(); ++i) {
      ASSERT_NEAR(b.dgamma[i], want_dgamma[i], 1e-3f * (1 + std::fabs(want_dgamma[i])))
          << "dgamma[" << i << "]";
    }
  }

  TestDriver d_{};
  std::vector<TestDriver::Ptr> allocations_;
};

TEST_F(CudaIpcTest, TheServerComputesInPlaceInTheClientsDeviceBuffers) {
  ChildProcess server = StartServer({"--backend=cuda", "--cuda-ipc"});
  const ReadyLine ready = server.AwaitReady(absl::Seconds(120));
  ASSERT_GT(ready.grpc_port, 0) << server.Stderr();
  // 48 rows of 256 f32 in chunks of 16 rows: three chunks, each at its own offsets.
  std::unique_ptr<Client> client = ClientFor(ready.grpc_port, 16 * 256 * 4);
  DeviceBatch b = Place(48, 256, 11);
  absl::StatusOr<RawBackwardResult> r = client->BackwardRaw(b.args, {});
  ASSERT_TRUE(r.ok()) << r.status() << "\n" << server.Stderr();
  EXPECT_EQ(r->summary.backend, "cuda");
  EXPECT_EQ(r->summary.chunks, 3u);
  ExpectMatchesReference(b);

  // GetServerInfo says what the client must match.
  absl::StatusOr<v1::GetServerInfoResponse> info = client->ServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_TRUE(info->cuda_ipc().enabled());
  EXPECT_EQ(info->cuda_ipc().device_uuid(), b.args.device->device_uuid);
  EXPECT_EQ(info->cuda_ipc().max_open_handles(), 64u);
  // The payload never crossed the socket: the stream is counted under cuda_ipc.
  int code = 0;
  auto m = st::ParsePrometheusText(
      st::HttpGet(ready.metrics_port, "/metrics", &code), nullptr);
  EXPECT_EQ(m["normgrad_transport_streams_total{transport=\"cuda_ipc\"}"], 1);
  EXPECT_EQ(m["normgrad_transport_streams_total{transport=\"tcp\"}"], 0);
}

// The warp kernel (hidden_dim <= 32, rms given) leaves grad_gamma to the host: x, dy and the
// client's rms come back from its device buffers for it.
TEST_F(CudaIpcTest, AGivenRmsInItsOwnAllocationIsReadFromTheDevice) {
  ChildProcess server = StartServer({"--backend=cuda", "--cuda-ipc"});
  const ReadyLine ready = server.AwaitReady(absl::Seconds(120));
  ASSERT_GT(ready.grpc_port, 0) << server.Stderr();
  std::unique_ptr<Client> client = ClientFor(ready.grpc_port, 8 * 32 * 4);
  DeviceBatch b = Place(24, 32, 12, /*with_rms=*/true);
  const TestDriver::Ptr rms = Alloc(64 + 24 * 4);  // at offset 64 of its allocation
  Upload(rms + 64, b.batch.rms.data(), 24 * 4);
  CudaIpcBuffer rms_buffer = Export(rms);
  rms_buffer.offset = 64;
  b.args.device->rms = rms_buffer;
  BackwardOptions options;
  options.kernel = "rms_norm_backward";
  absl::StatusOr<RawBackwardResult> r = client->BackwardRaw(b.args, options);
  ASSERT_TRUE(r.ok()) << r.status() << "\n" << server.Stderr();
  EXPECT_EQ(r->summary.kernel, "rms_norm_backward");
  ExpectMatchesReference(b);
}

TEST_F(CudaIpcTest, BadBuffersAreRefusedNamingTheFieldAndTheServerKeepsServing) {
  ChildProcess server = StartServer({"--backend=cuda", "--cuda-ipc"});
  const ReadyLine ready = server.AwaitReady(absl::Seconds(120));
  ASSERT_GT(ready.grpc_port, 0) << server.Stderr();
  std::unique_ptr<Client> client = ClientFor(ready.grpc_port);
  const uint64_t bytes = 8 * 64 * 4;
  auto call = [&](auto mutate) {
    DeviceBatch b = Place(8, 64, 13);
    mutate(*b.args.device);
    return client->BackwardRaw(b.args, {}).status();
  };

  absl::Status s = call([](CudaIpcTensors& t) { t.device_uuid[0] ^= 1; });
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("cuda_ipc.device_uuid = "));
  EXPECT_THAT(s.message(), HasSubstr("is not this server's GPU"));

  s = call([&](CudaIpcTensors& t) { t.x.offset = 3 * bytes + 4; });  // past [x | dy | dx]
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr(absl::StrCat("cuda_ipc.x.offset is ", 3 * bytes + 4)));
  EXPECT_THAT(s.message(), HasSubstr("past the end"));

  s = call([&](CudaIpcTensors& t) { t.x.offset = 2; });  // not on an f32 boundary
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("cuda_ipc.x.offset is 2, not a multiple of 4"));

  s = call([&](CudaIpcTensors& t) { t.dx.offset = bytes / 2; });  // over x and dy
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("overlaps cuda_ipc.x.offset = 0"));

  // The same allocation through a second handle (a byte the driver does not read differs): the
  // handles' bytes differ, the device memory is the same, and grad_input over x is refused.
  s = call([&](CudaIpcTensors& t) {
    t.dx.handle = t.x.handle;
    t.dx.handle[63] ^= 0x5a;
    t.dx.offset = bytes / 2;
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("cuda_ipc.grad_input ("));
  EXPECT_THAT(s.message(), HasSubstr("overlaps cuda_ipc.x"));

  // A buffer freed before the server opened it: the driver refuses its handle.
  const TestDriver::Ptr gone = Alloc(3 * bytes);
  const CudaIpcBuffer gone_buffer = Export(gone);
  ASSERT_EQ(d_.cuMemFree_v2(gone), CUDA_SUCCESS);
  allocations_.pop_back();
  s = call([&](CudaIpcTensors& t) { t.dy = gone_buffer; });
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("cuda_ipc.dy.handle: cuIpcOpenMemHandle failed"));

  s = call([](CudaIpcTensors& t) { t.x.handle.resize(12); });  // the client refuses it
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("device.x.handle: 12 bytes, expected 64"));

  // Nothing of that hurt the server.
  DeviceBatch good = Place(8, 64, 14);
  absl::StatusOr<RawBackwardResult> r = client->BackwardRaw(good.args, {});
  ASSERT_TRUE(r.ok()) << r.status();
  ExpectMatchesReference(good);
}

TEST_F(CudaIpcTest, WithoutTheFlagOrWithoutAGpuCudaIpcIsRefused) {
  {
    ChildProcess server = StartServer({"--backend=cuda"});
    const ReadyLine ready = server.AwaitReady(absl::Seconds(120));
    ASSERT_GT(ready.grpc_port, 0) << server.Stderr();
    std::unique_ptr<Client> client = ClientFor(ready.grpc_port);
    DeviceBatch b = Place(8, 64, 15);
    const absl::Status s = client->BackwardRaw(b.args, {}).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_THAT(s.message(), HasSubstr("start it with --cuda-ipc"));
  }
  ChildProcess cpu = StartServer({"--backend=cpu", "--cuda-ipc"});
  const std::optional<int> status = cpu.WaitExit(absl::Seconds(60));
  ASSERT_TRUE(status.has_value());
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) != 0);
  EXPECT_THAT(cpu.Stderr(), HasSubstr("--cuda-ipc: the cpu backend cannot open"));
}

// The randomized schedule of tests/client/schedule_test.cc over CUDA IPC: calls on buffers in
// the client's device memory, at a new random layout in one allocation for every call (so an
// earlier call's grad_input range overlaps a later call's x and dy), several chunks a call,
// ending at random: cancels at a random time and at random progress, deadlines of a few
// milliseconds, slow readers, and the server drained (SIGTERM) with a call in flight and
// replaced. Every OK result is checked against the reference; an allocation the library says
// the server may still write is not used again. The count of wrong results must be zero.
//   NORMGRAD_CUDA_IPC_SCHEDULE_CALLS (default 300), NORMGRAD_SCHEDULE_SEED (default 1).
TEST_F(CudaIpcTest, RandomEndingsAtRandomPointsNeverGiveAWrongOk) {
  auto env_or = [](const char* name, uint64_t fallback) {
    const char* v = std::getenv(name);
    return v != nullptr && *v != '\0' ? std::strtoull(v, nullptr, 10) : fallback;
  };
  const uint64_t total = env_or("NORMGRAD_CUDA_IPC_SCHEDULE_CALLS", 300);
  std::mt19937_64 rng(env_or("NORMGRAD_SCHEDULE_SEED", 1));
  auto uniform = [&](uint64_t lo, uint64_t hi) {
    return std::uniform_int_distribution<uint64_t>(lo, hi)(rng);
  };
  enum Ending { kNone, kCancelAtTime, kCancelAtProgress, kDeadline, kSlowReader, kDrain, kEndings };
  const char* const names[] = {"none", "cancel-at-time", "cancel-at-progress", "deadline",
                               "slow-reader", "drain"};
  auto start = [&](std::optional<ChildProcess>& server, std::unique_ptr<Client>& client) {
    server.emplace(StartServer({"--backend=cuda", "--cuda-ipc", "--shutdown-grace=0.2s"}));
    const ReadyLine ready = server->AwaitReady(absl::Seconds(120));
    ASSERT_GT(ready.grpc_port, 0) << server->Stderr();
    client = ClientFor(ready.grpc_port, /*chunk_bytes=*/2048);  // 1 to 8 chunks a call
  };
  std::optional<ChildProcess> server;
  std::unique_ptr<Client> client;
  start(server, client);
  absl::StatusOr<std::string> uuid = CudaDeviceUuid(0);
  ASSERT_TRUE(uuid.ok()) << uuid.status();

  constexpr size_t kAllocation = 256 << 10;
  TestDriver::Ptr base = Alloc(kAllocation);
  uint64_t ended[kEndings] = {}, ok = 0, wrong = 0, in_doubt = 0;
  std::map<std::string, uint64_t> outcomes;
  for (uint64_t call = 0; call < total; ++call) {
    Ending ending = uniform(0, 1) == 0 ? kNone : static_cast<Ending>(uniform(1, kEndings - 2));
    if (call % 75 == 74) ending = kDrain;
    const uint32_t hiddens[] = {8, 64, 256};
    const uint32_t hidden = hiddens[uniform(0, 2)];
    const uint64_t rows = uniform(1, 4096 / hidden);
    const uint64_t n = rows * hidden;
    const st::Batch b = st::RandomBatch(rows, hidden, static_cast<uint32_t>(call) + 100);
    // x, dy and dx in three distinct slots of the allocation, new for every call.
    const uint64_t slots = kAllocation / (n * 4);  // >= 16
    uint64_t at[3];
    do {
      for (uint64_t& a : at) a = uniform(0, slots - 1);
    } while (at[0] == at[1] || at[1] == at[2] || at[0] == at[2]);
    Upload(base + at[0] * n * 4, b.x.data(), n * 4);
    Upload(base + at[1] * n * 4, b.dy.data(), n * 4);
    CudaIpcTensors t;
    t.device_uuid = *uuid;
    t.x = Export(base + at[0] * n * 4);
    t.dy = Export(base + at[1] * n * 4);
    t.dx = Export(base + at[2] * n * 4);
    std::vector<float> dgamma(hidden, std::nanf(""));
    RawBackwardArgs a;
    a.num_rows = rows;
    a.hidden_dim = hidden;
    a.eps = b.eps;
    a.gamma = absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(b.gamma.data()), hidden * 4u);
    a.dgamma = absl::MakeSpan(reinterpret_cast<uint8_t*>(dgamma.data()), hidden * 4u);
    a.device = std::move(t);

    BackwardOptions options;
    options.cancellation = std::make_shared<CallCancellation>();
    const uint64_t cut = uniform(1, rows);
    if (ending == kDeadline) options.deadline = absl::Microseconds(uniform(300, 8000));
    if (ending == kCancelAtProgress) {
      options.on_progress = [c = options.cancellation, cut](uint64_t done, uint64_t) {
        if (done >= cut) c->Cancel();
      };
    }
    if (ending == kSlowReader) {
      options.on_progress = [](uint64_t, uint64_t) { absl::SleepFor(absl::Milliseconds(2)); };
    }
    std::promise<absl::Status> promise;
    std::future<absl::Status> done = promise.get_future();
    client->BackwardRawAsync(a, options, [&promise](absl::StatusOr<RawBackwardResult> r) {
      promise.set_value(r.status());
    });
    if (ending == kCancelAtTime) {
      absl::SleepFor(absl::Microseconds(uniform(0, 5000)));
      options.cancellation->Cancel();
    }
    if (ending == kDrain) {
      absl::SleepFor(absl::Microseconds(uniform(0, 5000)));
      server->Signal(SIGTERM);
    }
    const absl::Status s = done.get();
    ++ended[ending];
    ++outcomes[absl::StrCat(names[ending], " ", absl::StatusCodeToString(s.code()))];
    if (s.ok()) {
      ++ok;
      std::vector<float> want_dx, want_dgamma;
      st::ReferenceFor(b, want_dx, want_dgamma);
      const std::vector<float> dx = Download(base + at[2] * n * 4, n);
      double worst = 0;
      for (size_t i = 0; i < n; ++i) {
        const double e = std::fabs(double{dx[i]} - want_dx[i]) / (1 + std::fabs(want_dx[i]));
        if (!(e <= worst)) worst = std::isnan(e) ? 1e30 : e;
      }
      for (uint32_t i = 0; i < hidden; ++i) {
        const double e =
            std::fabs(double{dgamma[i]} - want_dgamma[i]) / (1 + std::fabs(want_dgamma[i]));
        if (!(e <= worst)) worst = std::isnan(e) ? 1e30 : e;
      }
      if (worst > 1e-3) {
        ++wrong;
        ADD_FAILURE() << "call " << call << " (" << names[ending] << ", " << rows << "x" << hidden
                      << ") returned OK with an error of " << worst;
      }
    } else if (absl::StrContains(s.message(), "did not confirm that it stopped")) {
      // As the library tells its caller: this memory may still be written; use new memory.
      ++in_doubt;
      base = Alloc(kAllocation);
    }
    if (ending == kDrain) {
      ASSERT_TRUE(server->WaitExit(absl::Seconds(30)).has_value()) << "the drained server";
      start(server, client);
    }
  }
  std::printf("cuda ipc schedule: %llu calls, %llu OK, %llu wrong, %llu in doubt\n",
              static_cast<unsigned long long>(total), static_cast<unsigned long long>(ok),
              static_cast<unsigned long long>(wrong), static_cast<unsigned long long>(in_doubt));
  for (const auto& [key, count] : outcomes) {
    std::printf("cuda ipc schedule:   %-40s %llu\n", key.c_str(),
                static_cast<unsigned long long>(count));
  }
  EXPECT_EQ(wrong, 0u);
  for (int e = 0; e < kEndings; ++e) EXPECT_GT(ended[e], 0u) << names[e] << " never happened";
  EXPECT_GT(ok, total / 4);
}

}  // namespace
}  // namespace normgrad
