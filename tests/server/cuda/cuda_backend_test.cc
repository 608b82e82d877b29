// The CUDA backend without a GPU: the driver loader, CUresult conversion, backend selection and
// fallbacks, and the whole session pipeline (staging, launches split by grid limit, module
// cache, JIT log, grad_gamma accumulation) against a scripted driver library.
#include "server/cuda/cuda_backend.h"

#include <dlfcn.h>
#include <stdlib.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/rmsnorm/kernel_registry.h"
#include "kernels/rmsnorm/reference.h"
#include "server/backend_factory/backend_factory.h"
#include "nvidia/driver_api.h"
#include "tests/server/backend/backend_test_util.h"

#ifndef NORMGRAD_SCRIPTED_CUDA_DRIVER
#error "NORMGRAD_SCRIPTED_CUDA_DRIVER must name the scripted driver library"
#endif
#ifndef NORMGRAD_PARTIAL_CUDA_DRIVER
#error "NORMGRAD_PARTIAL_CUDA_DRIVER must name the partial driver library"
#endif

// In the test utilities' namespace: Batch, MakeBatch, RunF32... without qualification.
namespace normgrad::server::testing {
namespace {

constexpr char kScripted[] = NORMGRAD_SCRIPTED_CUDA_DRIVER;
constexpr char kPartial[] = NORMGRAD_PARTIAL_CUDA_DRIVER;

// Sets an environment variable for the scope of a test.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = getenv(name)) old_ = old, had_ = true;
    if (value != nullptr) {
      setenv(name, value, 1);
    } else {
      unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (had_) {
      setenv(name_.c_str(), old_.c_str(), 1);
    } else {
      unsetenv(name_.c_str());
    }
  }

 private:
  std::string name_, old_;
  bool had_ = false;
};

template <typename Fn>
Fn ScriptedSymbol(const char* name) {
  void* handle = dlopen(kScripted, RTLD_NOW | RTLD_LOCAL);  // the one CudaDriver::Load shares
  return handle != nullptr ? reinterpret_cast<Fn>(dlsym(handle, name)) : nullptr;
}
int ModuleLoads() { return ScriptedSymbol<int (*)()>("normgrad_scripted_cuda_module_loads")(); }
int Launches() { return ScriptedSymbol<int (*)()>("normgrad_scripted_cuda_launches")(); }
int LiveModules() { return ScriptedSymbol<int (*)()>("normgrad_scripted_cuda_live_modules")(); }
void ResetCounters() { ScriptedSymbol<void (*)()>("normgrad_scripted_cuda_reset")(); }
size_t PinnedBytes() { return ScriptedSymbol<size_t (*)()>("normgrad_scripted_cuda_host_bytes")(); }
size_t DeviceBytes() {
  return ScriptedSymbol<size_t (*)()>("normgrad_scripted_cuda_device_bytes")();
}
size_t PeakPinnedBytes() {
  return ScriptedSymbol<size_t (*)()>("normgrad_scripted_cuda_peak_host_bytes")();
}
size_t PeakDeviceBytes() {
  return ScriptedSymbol<size_t (*)()>("normgrad_scripted_cuda_peak_device_bytes")();
}
int LiveStreams() { return ScriptedSymbol<int (*)()>("normgrad_scripted_cuda_live_streams")(); }
int MaxBusyStreams() {
  return ScriptedSymbol<int (*)()>("normgrad_scripted_cuda_max_busy_streams")();
}

absl::StatusOr<std::unique_ptr<Backend>> Create(BackendKind kind, const std::string& library) {
  BackendOptions options;
  options.kind = kind;
  options.cuda_driver_library = library;
  options.cpu_threads = 2;
  return CreateBackend(options);
}

std::unique_ptr<Backend> ScriptedCuda(uint64_t max_staging_bytes = 1ull << 30,
                                      uint64_t pipeline_piece_bytes = 0) {
  BackendOptions options;
  options.kind = BackendKind::kCuda;
  options.cuda_driver_library = kScripted;
  options.max_staging_bytes = max_staging_bytes;
  options.cuda_pipeline_piece_bytes = pipeline_piece_bytes;
  absl::StatusOr<std::unique_ptr<Backend>> b = CreateBackend(options);
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? *std::move(b) : nullptr;
}

// A 4 x 64 f32 batch in one chunk, with the scripted driver in `mode` (NORMGRAD_SCRIPTED_CUDA).
absl::StatusOr<Gradients> RunSmallBatchInMode(Backend& cuda, const char* mode) {
  ScopedEnv env("NORMGRAD_SCRIPTED_CUDA", mode);
  return RunF32(cuda, MakeBatch(4, 64, false), 4);
}

// dx within 1e-5 relative plus 1e-5 of the row's largest |dx| (f32 sums on the "device").
void ExpectNearReference(const Batch& b, const Gradients& got) {
  std::vector<float> dx(b.x.size()), dgamma(b.hidden);
  kernels::ReferenceBackward({b.x, b.dy, b.gamma, b.rms, b.rows, b.hidden, b.eps},
                             absl::MakeSpan(dx), absl::MakeSpan(dgamma));
  int bad = 0;
  for (uint64_t r = 0; r < b.rows; ++r) {
    float scale = 0;
    for (uint32_t i = 0; i < b.hidden; ++i)
      scale = std::max(scale, std::fabs(dx[r * b.hidden + i]));
    for (uint32_t i = 0; i < b.hidden; ++i) {
      const size_t k = r * b.hidden + i;
      if (!(std::fabs(got.dx[k] - dx[k]) <= 1e-5 * (std::fabs(dx[k]) + scale))) ++bad;
    }
  }
  EXPECT_EQ(bad, 0) << "dx elements off";
  float scale = 0;
  for (float v : dgamma) scale = std::max(scale, std::fabs(v));
  for (uint32_t i = 0; i < b.hidden; ++i) {
    EXPECT_LE(std::fabs(got.dgamma[i] - dgamma[i]), 1e-5 * (std::fabs(dgamma[i]) + scale)) << i;
  }
}

// Runs `b` through `cuda` in chunks of `chunk_rows` (with `kernel` named, if any) and checks the
// result as ExpectNearReference does.
void ExpectRunNearReference(Backend& cuda, const Batch& b, uint64_t chunk_rows,
                            const std::string& kernel = "") {
  absl::StatusOr<Gradients> got = RunF32(cuda, b, chunk_rows, kernel);
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectNearReference(b, *got);
}

TEST(CudaDriverTest, ResolveLibraryPrefersOptionThenEnvironment) {
  ScopedEnv env("NORMGRAD_CUDA_DRIVER", "/opt/emulated/libcuda.so");
  EXPECT_EQ(cuda::ResolveDriverLibrary("/x/libcuda.so.1"), "/x/libcuda.so.1");
  EXPECT_EQ(cuda::ResolveDriverLibrary(""), "/opt/emulated/libcuda.so");
  ScopedEnv unset("NORMGRAD_CUDA_DRIVER", nullptr);
  EXPECT_EQ(cuda::ResolveDriverLibrary(""), "libcuda.so.1");
}

TEST(CudaDriverTest, ResultsConvertToStatusCodesNamingTheCall) {
  EXPECT_TRUE(cuda::CudaResultToStatus(nullptr, CUDA_SUCCESS, "cuInit").ok());
  absl::Status oom = cuda::CudaResultToStatus(nullptr, CUDA_ERROR_OUT_OF_MEMORY, "cuMemAlloc");
  EXPECT_EQ(oom.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(oom.message(), "cuMemAlloc failed: CUresult 2");
  EXPECT_EQ(cuda::CudaResultToStatus(nullptr, CUDA_ERROR_NO_DEVICE, "cuInit").code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(cuda::CudaResultToStatus(nullptr, CUDA_ERROR_UNSUPPORTED_PTX_VERSION, "load").code(),
            absl::StatusCode::kFailedPrecondition);
  // A lost device (sticky errors) is UNAVAILABLE: the work may succeed on another replica.
  for (CUresult lost :
       {CUDA_ERROR_ILLEGAL_ADDRESS, CUDA_ERROR_LAUNCH_FAILED, CUDA_ERROR_ECC_UNCORRECTABLE,
        CUDA_ERROR_HARDWARE_STACK_ERROR, CUDA_ERROR_ILLEGAL_INSTRUCTION,
        CUDA_ERROR_MISALIGNED_ADDRESS, CUDA_ERROR_INVALID_PC, CUDA_ERROR_DEVICE_UNAVAILABLE}) {
    EXPECT_TRUE(cuda::IsDeviceLost(lost)) << lost;
    EXPECT_EQ(cuda::CudaResultToStatus(nullptr, lost, "sync").code(),
              absl::StatusCode::kUnavailable)
        << lost;
  }
  EXPECT_FALSE(cuda::IsDeviceLost(CUDA_ERROR_NOT_READY));
  EXPECT_FALSE(cuda::IsDeviceLost(CUDA_ERROR_OUT_OF_MEMORY));
  EXPECT_EQ(cuda::CudaResultToStatus(nullptr, CUDA_ERROR_INVALID_HANDLE, "sync").code(),
            absl::StatusCode::kInternal);
}

TEST(CudaDriverTest, ConversionUsesTheDriversErrorNames) {
  absl::StatusOr<std::shared_ptr<const cuda::CudaDriver>> driver =
      cuda::CudaDriver::Load(kScripted);
  ASSERT_TRUE(driver.ok()) << driver.status();
  absl::Status s = (*driver)->Check(CUDA_ERROR_OUT_OF_MEMORY, "cuMemAllocAsync");
  EXPECT_EQ(s.message(), "cuMemAllocAsync failed: CUDA_ERROR_OUT_OF_MEMORY (out of memory)");
  EXPECT_TRUE((*driver)->HasStreamOrderedAllocation());
}

TEST(CudaDriverTest, VersionsFormatAndMapToPtxIsa) {
  EXPECT_EQ(cuda::DriverVersionString(13000), "13.0");
  EXPECT_EQ(cuda::DriverVersionString(12080), "12.8");
  EXPECT_EQ(cuda::MaxPtxVersionForDriver(12000), "8.0");
  EXPECT_EQ(cuda::MaxPtxVersionForDriver(12040), "8.4");
  EXPECT_EQ(cuda::MaxPtxVersionForDriver(12060), "8.5");
  EXPECT_EQ(cuda::MaxPtxVersionForDriver(12080), "8.7");
  EXPECT_EQ(cuda::MaxPtxVersionForDriver(12090), "8.8");
  EXPECT_EQ(cuda::MaxPtxVersionForDriver(13000), "9.0");
  EXPECT_EQ(cuda::MaxPtxVersionForDriver(13020), "9.0");  // newer: the newest known
}

TEST(CudaDriverTest, MissingLibraryIsFailedPreconditionWithDlerror) {
  absl::StatusOr<std::shared_ptr<const cuda::CudaDriver>> d =
      cuda::CudaDriver::Load("/nonexistent/libcuda.so.1");
  ASSERT_EQ(d.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(d.status().message().find("/nonexistent/libcuda.so.1 not loadable: "),
            std::string::npos)
      << d.status();
}

TEST(CudaDriverTest, LibraryWithoutTheSymbolsIsRefusedNamingThem) {
  absl::StatusOr<std::shared_ptr<const cuda::CudaDriver>> d = cuda::CudaDriver::Load(kPartial);
  ASSERT_EQ(d.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(d.status().message().find("is not a usable CUDA driver: it lacks cuDriverGetVersion"),
            std::string::npos)
      << d.status();
  EXPECT_EQ(d.status().message().find("cuMemAllocAsync"), std::string::npos)  // optional
      << d.status();
}

TEST(CreateBackendTest, ParsesBackendKinds) {
  EXPECT_EQ(*ParseBackendKind("auto"), BackendKind::kAuto);
  EXPECT_EQ(*ParseBackendKind("CUDA"), BackendKind::kCuda);
  EXPECT_EQ(*ParseBackendKind("cpu"), BackendKind::kCpu);
  absl::StatusOr<BackendKind> bad = ParseBackendKind("tpu");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("\"tpu\""), std::string::npos);
}

TEST(CreateBackendTest, AutoFallsBackToCpuAndSaysWhyInOneLine) {
  ::testing::internal::CaptureStderr();
  absl::StatusOr<std::unique_ptr<Backend>> b =
      Create(BackendKind::kAuto, "/nonexistent/libcuda.so.1");
  const std::string err = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ((*b)->Name(), "cpu");
  EXPECT_EQ(err.rfind("normgrad: backend=cpu (auto: /nonexistent/libcuda.so.1 not loadable: ", 0),
            0u)
      << err;
  EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;
}

TEST(CreateBackendTest, AutoUsesEnvironmentDriverWhenNoOptionGiven) {
  ScopedEnv env("NORMGRAD_CUDA_DRIVER", kPartial);
  ::testing::internal::CaptureStderr();
  absl::StatusOr<std::unique_ptr<Backend>> b = Create(BackendKind::kAuto, "");
  const std::string err = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(b.ok());
  EXPECT_EQ((*b)->Name(), "cpu");
  EXPECT_NE(err.find("it lacks cuDriverGetVersion"), std::string::npos) << err;
}

TEST(CreateBackendTest, CudaWithoutUsableGpuIsFailedPrecondition) {
  for (const char* library : {"/nonexistent/libcuda.so.1", kPartial}) {
    absl::StatusOr<std::unique_ptr<Backend>> b = Create(BackendKind::kCuda, library);
    ASSERT_EQ(b.status().code(), absl::StatusCode::kFailedPrecondition) << library;
    EXPECT_EQ(b.status().message().rfind("backend=cuda: no usable GPU: ", 0), 0u) << b.status();
  }
}

TEST(CreateBackendTest, CuInitFailureAndNoDevicesAreReported) {
  {
    ScopedEnv mode("NORMGRAD_SCRIPTED_CUDA", "init_fails");
    absl::StatusOr<std::unique_ptr<Backend>> b = Create(BackendKind::kCuda, kScripted);
    ASSERT_EQ(b.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(b.status().message().find(
                  "cuInit failed: CUDA_ERROR_NO_DEVICE (no CUDA-capable device is detected)"),
              std::string::npos)
        << b.status();
    ::testing::internal::CaptureStderr();
    absl::StatusOr<std::unique_ptr<Backend>> a = Create(BackendKind::kAuto, kScripted);
    ::testing::internal::GetCapturedStderr();
    ASSERT_TRUE(a.ok());
    EXPECT_EQ((*a)->Name(), "cpu");
  }
  ScopedEnv mode("NORMGRAD_SCRIPTED_CUDA", "no_devices");
  absl::StatusOr<std::unique_ptr<Backend>> b = Create(BackendKind::kCuda, kScripted);
  ASSERT_EQ(b.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(b.status().message().find("no CUDA device"), std::string::npos) << b.status();
}

TEST(CreateBackendTest, AutoPicksAUsableGpuAndSaysSo) {
  ::testing::internal::CaptureStderr();
  absl::StatusOr<std::unique_ptr<Backend>> b = Create(BackendKind::kAuto, kScripted);
  const std::string err = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ((*b)->Name(), "cuda");
  EXPECT_EQ(err, "normgrad: backend=cuda (auto: Scripted GPU, sm_90, driver 13.0)\n");
}

TEST(CudaBackendTest, DescribesTheDevice) {
  std::unique_ptr<Backend> cuda = ScriptedCuda();
  ASSERT_NE(cuda, nullptr);
  const DeviceDescription d = cuda->Device();
  EXPECT_EQ(d.name, "Scripted GPU");
  EXPECT_EQ(d.compute_capability_major, 9);
  EXPECT_EQ(d.compute_capability_minor, 0);
  EXPECT_EQ(d.total_memory_bytes, uint64_t{80} << 30);
  EXPECT_EQ(d.driver_version, "13.0");
  EXPECT_EQ(d.max_ptx_version, "9.0");
  EXPECT_EQ(d.sm_count, 132u);
}

TEST(CudaBackendTest, RowResidentKernelIsTheDefaultAndMatchesReference) {
  std::unique_ptr<Backend> cuda = ScriptedCuda();
  ASSERT_NE(cuda, nullptr);
  const Batch b = MakeBatch(301, 96, /*with_rms=*/false);
  kernels::BackwardRequest spec;
  spec.num_rows = b.rows;
  spec.hidden_dim = b.hidden;
  auto session = cuda->StartBackward(spec, Bytes(b.gamma));
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_EQ((*session)->KernelName(), "rms_norm_backward_row_resident");
  ResetCounters();
  ExpectRunNearReference(*cuda, b, 100);
  EXPECT_EQ(Launches(), 4);  // 4 chunks, one launch each (dx and grad_gamma)
}

TEST(CudaBackendTest, RowResidentGradGammaSameBitsRunAfterRun) {
  std::unique_ptr<Backend> cuda = ScriptedCuda();
  ASSERT_NE(cuda, nullptr);
  const Batch b = MakeBatch(700, 64, false);
  absl::StatusOr<Gradients> first = RunF32(*cuda, b, 256);
  absl::StatusOr<Gradients> second = RunF32(*cuda, b, 256);
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_EQ(0, std::memcmp(first->dgamma.data(), second->dgamma.data(), b.hidden * 4));
}

TEST(CudaBackendTest, GivenRmsIsUsedByTheRowResidentKernel) {
  std::unique_ptr<Backend> cuda = ScriptedCuda();
  ASSERT_NE(cuda, nullptr);
  Batch b = MakeBatch(50, 200, /*with_rms=*/true);
  for (float& r : b.rms) r *= 1.25f;  // not what x implies: proves the given rms is used
  ExpectRunNearReference(*cuda, b, 16);
}

TEST(CudaBackendTest, NamedBatchedKernelMatchesReferenceAcrossChunks) {
  std::unique_ptr<Backend> cuda = ScriptedCuda();
  ASSERT_NE(cuda, nullptr);
  const Batch b = MakeBatch(301, 96, /*with_rms=*/false);
  ExpectRunNearReference(*cuda, b, 100, "batched_rms_norm_backward");
}

TEST(CudaBackendTest, NamedWarpKernelUsesTheGivenRms) {
  std::unique_ptr<Backend> cuda = ScriptedCuda();
  ASSERT_NE(cuda, nullptr);
  Batch b = MakeBatch(50, 31, /*with_rms=*/true);
  for (float& r : b.rms) r *= 1.25f;  // not what x implies: proves the given rms is used
  kernels::BackwardRequest spec;
  spec.num_rows = b.rows;
  spec.hidden_dim = b.hidden;
  spec.rms_provided = true;
  spec.kernel = "rms_norm_backward";
  auto session = cuda->StartBackward(spec, Bytes(b.gamma));
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_EQ((*session)->KernelName(), "rms_norm_backward");
  ExpectRunNearReference(*cuda, b, 16, "rms_norm_backward");
}

// Rows wider than registers hold (16384) are streamed by the row-resident kernel, which takes
// the given rms as it is (scaled here, so recomputing it would be caught): one launch a chunk.
TEST(CudaBackendTest, GivenRmsWithStreamedRowsRunsTheRowResidentKernel) {
  std::unique_ptr<Backend> cuda = ScriptedCuda();
  ASSERT_NE(cuda, nullptr);
  Batch b = MakeBatch(5, 16400, /*with_rms=*/true);
  for (float& r : b.rms) r *= 0.8f;
  ResetCounters();
  ExpectRunNearReference(*cuda, b, 2);
  EXPECT_EQ(Launches(), 3);  // chunks of 2, 2 and 1 rows
}

TEST(CudaBackendTest, GivenRmsWithRowsWiderThanAnyGpuKernelTakesIsExactOnTheHostPath) {
  std::unique_ptr<Backend> cuda = ScriptedCuda();
  ASSERT_NE(cuda, nullptr);
  Batch b = MakeBatch(3, 65544, /*with_rms=*/true);  // above the row-resident kernel's 65536
  for (float& r : b.rms) r *= 0.8f;
  ResetCounters();
  ExpectRunNearReference(*cuda, b, 2);
  EXPECT_EQ(Launches(), 0);
}

TEST(CudaBackendTest, LaunchesAreSplitAtTheGridLimit) {
  ScopedEnv grid("NORMGRAD_SCRIPTED_CUDA_MAX_GRID_X", "7");
  std::unique_ptr<Backend> cuda = ScriptedCuda();
  ASSERT_NE(cuda, nullptr);
  const Batch b = MakeBatch(50, 64, false);
  ResetCounters();
  ExpectRunNearReference(*cuda, b, 50, "batched_rms_norm_backward");
  EXPECT_GE(Launches(), 8);  // 50 rows, at most 7 blocks of one row each per launch
}

TEST(CudaBackendTest, ModulesAreCachedAndUnloadedWithTheBackend) {
  ResetCounters();
  const int live_before = LiveModules();
  {
    std::unique_ptr<Backend> cuda = ScriptedCuda();
    ASSERT_NE(cuda, nullptr);
    const Batch b = MakeBatch(10, 128, false);
    ASSERT_TRUE(RunF32(*cuda, b, 10).ok());
    ASSERT_TRUE(RunF32(*cuda, b, 3).ok());
    EXPECT_EQ(ModuleLoads(), 1);  // the row-resident kernel
    const ModuleCacheStats s = cuda->CacheStats();
    EXPECT_EQ(s.compiles, 1u);
    EXPECT_EQ(s.hits, 1u);
    EXPECT_EQ(s.entries, 1u);
    EXPECT_EQ(LiveModules(), live_before + 1);
  }
  EXPECT_EQ(LiveModules(), live_before);
}

TEST(CudaBackendTest, PreloadCompilesOnceAndSessionsHitTheCache) {
  std::unique_ptr<Backend> cuda = ScriptedCuda();
  ASSERT_NE(cuda, nullptr);
  const kernels::BackwardKernel* batched = kernels::FindKernel("batched_rms_norm_backward");
  ASSERT_NE(batched, nullptr);
  kernels::KernelConfig config;
  config.hidden_dim = 64;
  config.target_sm = 75;  // the backend compiles for its own GPU (sm_90) whatever is asked
  ResetCounters();
  ASSERT_TRUE(cuda->Preload(*batched, config).ok());
  EXPECT_EQ(ModuleLoads(), 1);
  ASSERT_TRUE(RunF32(*cuda, MakeBatch(3, 64, false), 3, "batched_rms_norm_backward").ok());
  EXPECT_EQ(ModuleLoads(), 1);
  EXPECT_EQ(cuda->CacheStats().hits, 1u);
}

TEST(CudaBackendTest, ConcurrentFirstSessionsLoadTheModuleOnce) {
  std::unique_ptr<Backend> cuda = ScriptedCuda();
  ASSERT_NE(cuda, nullptr);
  ResetCounters();
  const Batch b = MakeBatch(9, 48, false);
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&] {
      if (RunF32(*cuda, b, 4).ok()) ok.fetch_add(1);
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(ok.load(), 8);
  EXPECT_EQ(ModuleLoads(), 1);  // the row-resident kernel, once
  EXPECT_EQ(cuda->CacheStats().compiles, 1u);
}

TEST(CudaBackendTest, JitFailureIsInternalWithTheJitLog) {
  std::unique_ptr<Backend> cuda = ScriptedCuda();
  ASSERT_NE(cuda, nullptr);
  absl::StatusOr<Gradients> got = RunSmallBatchInMode(*cuda, "jit_error");
  ASSERT_EQ(got.status().code(), absl::StatusCode::kInternal);
  EXPECT_NE(got.status().message().find("cuModuleLoadDataEx(rms_norm_backward_row_resident, sm_90"),
            std::string::npos)
      << got.status();
  EXPECT_NE(got.status().message().find(
                "CUDA_ERROR_INVALID_PTX (a PTX JIT compilation failed); JIT log: ptxas application "
                "ptx input, line 7; error   : scripted failure"),
            std::string::npos)
      << got.status();
  EXPECT_EQ(cuda->CacheStats().compile_failures, 1u);
  EXPECT_EQ(cuda->CacheStats().entries, 0u);
}

TEST(CudaBackendTest, OutOfDeviceMemoryIsResourceExhausted) {
  std::unique_ptr<Backend> cuda = ScriptedCuda();
  ASSERT_NE(cuda, nullptr);
  absl::StatusOr<Gradients> got = RunSmallBatchInMode(*cuda, "oom");
  EXPECT_EQ(got.status().code(), absl::StatusCode::kResourceExhausted) << got.status();
}

TEST(CudaBackendTest, ChunksFromOtherThreadsMakeTheContextCurrent) {
  std::unique_ptr<Backend> cuda = ScriptedCuda();
  ASSERT_NE(cuda, nullptr);
  const Batch b = MakeBatch(20, 64, false);
  absl::StatusOr<Gradients> got = absl::UnknownError("not run");
  std::thread worker([&] { got = RunF32(*cuda, b, 7); });
  worker.join();
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectNearReference(b, *got);
}

// Staging is the backend's, not the sessions': sessions that computed a chunk and wait for
// their next one hold no stream, pinned or device memory; the chunks, one after another, reused
// one slot.
TEST(CudaBackendTest, IdleSessionsHoldNoStagingAndChunksReuseOneSlot) {
  const size_t pinned_before = PinnedBytes(), device_before = DeviceBytes();
  const int streams_before = LiveStreams();
  {
    std::unique_ptr<Backend> cuda = ScriptedCuda();
    ASSERT_NE(cuda, nullptr);
    const Batch b = MakeBatch(64, 256, false);
    kernels::BackwardRequest spec;
    spec.num_rows = b.rows;
    spec.hidden_dim = b.hidden;
    std::vector<std::unique_ptr<BackwardSession>> sessions;
    std::vector<float> dx(32 * b.hidden);
    for (int i = 0; i < 8; ++i) {
      auto session = cuda->StartBackward(spec, Bytes(b.gamma));
      ASSERT_TRUE(session.ok()) << session.status();
      const size_t bytes = 32 * b.hidden * 4;
      ASSERT_TRUE((*session)
                      ->ProcessChunk(Bytes(b.x).subspan(0, bytes), Bytes(b.dy).subspan(0, bytes),
                                     {}, 32, MutableBytes(dx))
                      .ok());
      sessions.push_back(*std::move(session));
    }
    // One slot with its two streams: 32 rows of x, dy and dx pinned and on the device, plus
    // gamma and grad_gamma (one piece: one stream's); on the device also the grad_gamma tree
    // (32 blocks: 32 + 2 rows of the 256 x 4 tiling's 1024 f32) and the two streams' 4 KiB of
    // semaphores each.
    const size_t chunk = 32 * b.hidden * 4;
    EXPECT_EQ(LiveStreams(), streams_before + 2);
    EXPECT_GE(PinnedBytes() - pinned_before, 3 * chunk);
    EXPECT_LT(PinnedBytes() - pinned_before, 3 * chunk + 8192);
    EXPECT_GE(DeviceBytes() - device_before, 3 * chunk);
    EXPECT_LT(DeviceBytes() - device_before, 3 * chunk + 8192 + 34 * 4 * 1024 + 2 * 4096);
  }
  EXPECT_EQ(LiveStreams(), streams_before);
  EXPECT_EQ(PinnedBytes(), pinned_before);
  EXPECT_EQ(DeviceBytes(), device_before);
}

// Chunks computing at once on 8 threads never hold more pinned (or device) staging than the
// pool's bound, here room for two slots: the others wait for a slot, and every result is right.
TEST(CudaBackendTest, ConcurrentChunksStayWithinTheStagingBound) {
  const Batch b = MakeBatch(96, 512, false);
  const uint64_t slot = 3 * 16 * 512 * 4 + 16 * 1024;  // 16-row chunks, and gamma, grad_gamma
  std::unique_ptr<Backend> cuda = ScriptedCuda(2 * slot);
  ASSERT_NE(cuda, nullptr);
  const size_t pinned_before = PinnedBytes(), device_before = DeviceBytes();
  ResetCounters();
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&] {
      absl::StatusOr<Gradients> got = RunF32(*cuda, b, 16);
      if (got.ok()) ok.fetch_add(1);
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(ok.load(), 8);
  EXPECT_LE(PeakPinnedBytes() - pinned_before, 2 * slot);
  EXPECT_LE(PeakDeviceBytes() - device_before, 2 * slot);
  EXPECT_GT(PeakPinnedBytes(), pinned_before);
  ExpectRunNearReference(*cuda, b, 16);
}

// A chunk larger than the staging bound gets a slot of its own (lent alone above the bound); once
// it is done the pool is back within its bound: the backend does not keep that memory.
TEST(CudaBackendTest, ASlotAboveTheBoundIsFreedWhenItsChunkIsDone) {
  const Batch b = MakeBatch(64, 512, false);
  const uint64_t bound = 64 * 1024;  // a 64-row chunk stages 3 x 128 KiB
  std::unique_ptr<Backend> cuda = ScriptedCuda(bound);
  ASSERT_NE(cuda, nullptr);
  const size_t pinned_before = PinnedBytes(), device_before = DeviceBytes();
  ResetCounters();
  ExpectRunNearReference(*cuda, b, 64);
  EXPECT_GT(PeakDeviceBytes() - device_before, bound);  // the chunk did get its slot
  EXPECT_LE(PinnedBytes() - pinned_before, bound);
  EXPECT_LE(DeviceBytes() - device_before, bound);
  // And a chunk under the bound still reuses an idle slot afterwards.
  ExpectRunNearReference(*cuda, b, 8);
  ExpectRunNearReference(*cuda, b, 8);
  EXPECT_LE(DeviceBytes() - device_before, bound);
}

// The chunk pipeline, on a driver that runs a stream's work only when the host waits for that
// stream (deferred): a chunk cut into pieces of 4 rows (4 KiB of x at hidden 256) keeps both of
// its slot's streams busy at once, and every dx and grad_gamma is still right, so no piece's
// result was read before its stream was waited for and no stream used the other's data. Chunks
// of 30 rows: seven full pieces and one of 2 rows, 8 pieces alternating between two streams.
class CudaPipelineTest : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaPipelineTest, PiecesOverlapOnTwoStreamsAndEveryResultIsRight) {
  ScopedEnv deferred("NORMGRAD_SCRIPTED_CUDA_STREAMS", "deferred");
  std::unique_ptr<Backend> cuda = ScriptedCuda(1ull << 30, 4 * 256 * 4);
  ASSERT_NE(cuda, nullptr);
  for (const bool with_rms : {false, true}) {
    SCOPED_TRACE(with_rms ? "rms given" : "rms recomputed");
    const Batch b = MakeBatch(90, 256, with_rms, 7);
    ResetCounters();
    absl::StatusOr<Gradients> got = RunF32(*cuda, b, 30, GetParam());
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(MaxBusyStreams(), 2);
    ExpectNearReference(b, *got);
  }
}

INSTANTIATE_TEST_SUITE_P(Kernels, CudaPipelineTest,
                         ::testing::Values("", "rms_norm_backward_row_resident",
                                           "batched_rms_norm_backward"),
                         [](const auto& info) {
                           return info.param.empty() ? std::string("Default") : info.param;
                         });

// A chunk that fits one piece uses one stream (once its slot exists: making a slot zeroes both
// streams' semaphores); the cut depends on the shape only, so the same batch gives the same bits
// every time, and dx (per row) the same bits pipelined or not.
TEST(CudaPipelineCutTest, OnePieceUsesOneStreamAndTheCutIsReproducible) {
  ScopedEnv deferred("NORMGRAD_SCRIPTED_CUDA_STREAMS", "deferred");
  const Batch b = MakeBatch(60, 256, false, 3);
  std::unique_ptr<Backend> whole = ScriptedCuda();
  ASSERT_NE(whole, nullptr);
  ASSERT_TRUE(RunF32(*whole, b, 30).ok());
  ResetCounters();
  absl::StatusOr<Gradients> one = RunF32(*whole, b, 30);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(MaxBusyStreams(), 1);
  std::unique_ptr<Backend> cut = ScriptedCuda(1ull << 30, 4 * 256 * 4);
  ASSERT_NE(cut, nullptr);
  absl::StatusOr<Gradients> first = RunF32(*cut, b, 30);
  absl::StatusOr<Gradients> second = RunF32(*cut, b, 30);
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_EQ(first->dx, second->dx);
  EXPECT_EQ(first->dgamma, second->dgamma);
  EXPECT_EQ(first->dx, one->dx);
  ExpectNearReference(b, *first);
}

}  // namespace
}  // namespace normgrad::server::testing
