// Loads libnormgrad_emulated_cuda.so with dlopen and drives it through the Driver API, as the
// server's CUDA backend does: device queries, context rules, memory, copies, module loading
// (and its JIT error log), launches, streams and events.
#include <cuda.h>
#include <dlfcn.h>

#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace {

using ::testing::HasSubstr;

// Every symbol server/cuda/driver_api.h resolves, by its exported name: the name cuda.h's macros
// map a call to, so that `cuMemAlloc(...)` below calls the cuMemAlloc_v2 member. (The
// unversioned cuEventElapsedTime, exported too, is checked by name only.)
#define NG_DRIVER_SYMBOLS(X)      \
  X(cuInit)                       \
  X(cuDriverGetVersion)           \
  X(cuDeviceGetCount)             \
  X(cuDeviceGet)                  \
  X(cuDeviceGetName)              \
  X(cuDeviceGetAttribute)         \
  X(cuDeviceTotalMem_v2)          \
  X(cuDevicePrimaryCtxRetain)     \
  X(cuDevicePrimaryCtxRelease_v2) \
  X(cuCtxSetCurrent)              \
  X(cuCtxGetCurrent)              \
  X(cuModuleLoadDataEx)           \
  X(cuModuleUnload)               \
  X(cuModuleGetFunction)          \
  X(cuLaunchKernel)               \
  X(cuMemAlloc_v2)                \
  X(cuMemFree_v2)                 \
  X(cuMemAllocAsync)              \
  X(cuMemFreeAsync)               \
  X(cuDeviceGetDefaultMemPool)    \
  X(cuMemPoolSetAttribute)        \
  X(cuMemHostAlloc)               \
  X(cuMemFreeHost)                \
  X(cuMemcpyHtoDAsync_v2)         \
  X(cuMemcpyDtoHAsync_v2)         \
  X(cuMemHostRegister_v2)         \
  X(cuMemHostUnregister)          \
  X(cuMemsetD8Async)              \
  X(cuMemsetD32Async)             \
  X(cuStreamCreate)               \
  X(cuStreamDestroy_v2)           \
  X(cuStreamSynchronize)          \
  X(cuEventCreate)                \
  X(cuEventRecord)                \
  X(cuEventSynchronize)           \
  X(cuEventElapsedTime_v2)        \
  X(cuEventDestroy_v2)            \
  X(cuGetErrorName)               \
  X(cuGetErrorString)             \
  X(cuMemGetInfo_v2)

constexpr char kScalePtx[] = R"(
.version 7.8
.target sm_90
.address_size 64
.visible .entry scale(.param .u64 data, .param .u32 n, .param .f32 factor)
{
  .reg .pred %p<2>;
  .reg .b32 %r<5>;
  .reg .f32 %f<4>;
  .reg .b64 %rd<4>;
  ld.param.u64 %rd1, [data];
  ld.param.u32 %r1, [n];
  ld.param.f32 %f1, [factor];
  mov.u32 %r2, %tid.x;
  mov.u32 %r3, %ctaid.x;
  mad.lo.u32 %r4, %r3, 64, %r2;
  setp.ge.u32 %p1, %r4, %r1;
  @%p1 bra DONE;
  mul.wide.u32 %rd2, %r4, 4;
  add.s64 %rd3, %rd1, %rd2;
  ld.global.f32 %f2, [%rd3];
  mul.rn.f32 %f3, %f2, %f1;
  st.global.f32 [%rd3], %f3;
DONE:
  ret;
}
)";

struct Api {
  void* lib = nullptr;
  template <typename F>
  F Get(const char* name) {
    return reinterpret_cast<F>(dlsym(lib, name));
  }
};

class EmulatedDriverTest : public ::testing::Test {
 protected:
  void SetUp() override {
    api_.lib = dlopen(NORMGRAD_EMULATED_CUDA_PATH, RTLD_NOW | RTLD_LOCAL);
    ASSERT_NE(api_.lib, nullptr) << dlerror();
#define NG_LOAD(symbol)                            \
  symbol = api_.Get<decltype(&::symbol)>(#symbol); \
  ASSERT_NE(symbol, nullptr) << #symbol;
    NG_DRIVER_SYMBOLS(NG_LOAD)
#undef NG_LOAD
    ASSERT_EQ(cuInit(0), CUDA_SUCCESS);
  }

  void MakeCurrent() {
    CUcontext ctx = nullptr;
    ASSERT_EQ(cuDevicePrimaryCtxRetain(&ctx, 0), CUDA_SUCCESS);
    ASSERT_NE(ctx, nullptr);
    ASSERT_EQ(cuCtxSetCurrent(ctx), CUDA_SUCCESS);
  }

  // Loads scale() from kScalePtx.
  void LoadScaleKernel(CUmodule* module, CUfunction* fn) {
    ASSERT_EQ(cuModuleLoadDataEx(module, kScalePtx, 0, nullptr, nullptr), CUDA_SUCCESS);
    ASSERT_EQ(cuModuleGetFunction(fn, *module, "scale"), CUDA_SUCCESS);
  }

  Api api_;
#define NG_DECLARE(symbol) decltype(&::symbol) symbol = nullptr;
  NG_DRIVER_SYMBOLS(NG_DECLARE)
#undef NG_DECLARE
};

TEST_F(EmulatedDriverTest, ExportsEveryDriverApiSymbolTheBackendResolves) {
#define NG_NAME(symbol) #symbol,
  for (const char* name : {NG_DRIVER_SYMBOLS(NG_NAME) "cuEventElapsedTime"}) {
    EXPECT_NE(dlsym(api_.lib, name), nullptr) << name;
  }
#undef NG_NAME
}

TEST_F(EmulatedDriverTest, ReportsAPlausibleSm90Device) {
  int version = 0;
  ASSERT_EQ(cuDriverGetVersion(&version), CUDA_SUCCESS);
  EXPECT_EQ(version, 13000);
  int count = 0;
  ASSERT_EQ(cuDeviceGetCount(&count), CUDA_SUCCESS);
  EXPECT_EQ(count, 1);
  CUdevice dev = -1;
  ASSERT_EQ(cuDeviceGet(&dev, 0), CUDA_SUCCESS);
  EXPECT_EQ(cuDeviceGet(&dev, 1), CUDA_ERROR_INVALID_DEVICE);
  char name[128];
  ASSERT_EQ(cuDeviceGetName(name, sizeof(name), 0), CUDA_SUCCESS);
  EXPECT_THAT(std::string(name), HasSubstr("PTX interpreter"));
  int major = 0, minor = -1, sms = 0, warp = 0, threads = 0;
  ASSERT_EQ(cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 0),
            CUDA_SUCCESS);
  ASSERT_EQ(cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, 0),
            CUDA_SUCCESS);
  ASSERT_EQ(cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 0), CUDA_SUCCESS);
  ASSERT_EQ(cuDeviceGetAttribute(&warp, CU_DEVICE_ATTRIBUTE_WARP_SIZE, 0), CUDA_SUCCESS);
  ASSERT_EQ(cuDeviceGetAttribute(&threads, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK, 0),
            CUDA_SUCCESS);
  EXPECT_EQ(major, 9);
  EXPECT_EQ(minor, 0);
  EXPECT_EQ(sms, 132);
  EXPECT_EQ(warp, 32);
  EXPECT_EQ(threads, 1024);
  size_t total = 0;
  ASSERT_EQ(cuDeviceTotalMem(&total, 0), CUDA_SUCCESS);
  EXPECT_GT(total, size_t{1} << 30);
  const char* error_name = nullptr;
  ASSERT_EQ(cuGetErrorName(CUDA_ERROR_INVALID_PTX, &error_name), CUDA_SUCCESS);
  EXPECT_STREQ(error_name, "CUDA_ERROR_INVALID_PTX");
}

TEST_F(EmulatedDriverTest, WorkWithoutACurrentContextIsInvalidContext) {
  ASSERT_EQ(cuCtxSetCurrent(nullptr), CUDA_SUCCESS);
  CUdeviceptr p = 0;
  EXPECT_EQ(cuMemAlloc(&p, 64), CUDA_ERROR_INVALID_CONTEXT);
  CUcontext ctx = nullptr;
  ASSERT_EQ(cuCtxGetCurrent(&ctx), CUDA_SUCCESS);
  EXPECT_EQ(ctx, nullptr);
  MakeCurrent();
  ASSERT_EQ(cuMemAlloc(&p, 64), CUDA_SUCCESS);
  EXPECT_EQ(cuMemFree(p), CUDA_SUCCESS);
  EXPECT_EQ(cuMemFree(p), CUDA_ERROR_INVALID_VALUE);  // double free is refused
  EXPECT_EQ(cuDevicePrimaryCtxRelease(0), CUDA_SUCCESS);
}

TEST_F(EmulatedDriverTest, AllocCopyLoadLaunchCopyBack) {
  MakeCurrent();
  constexpr uint32_t kN = 200;
  CUstream stream = nullptr;
  ASSERT_EQ(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
  size_t free_before = 0, total = 0;
  ASSERT_EQ(cuMemGetInfo(&free_before, &total), CUDA_SUCCESS);
  CUdeviceptr data = 0;
  ASSERT_EQ(cuMemAllocAsync(&data, kN * sizeof(float), stream), CUDA_SUCCESS);
  size_t free_after = 0;
  ASSERT_EQ(cuMemGetInfo(&free_after, &total), CUDA_SUCCESS);
  EXPECT_LT(free_after, free_before);
  float* host = nullptr;
  ASSERT_EQ(cuMemHostAlloc(reinterpret_cast<void**>(&host), kN * sizeof(float), 0), CUDA_SUCCESS);
  for (uint32_t i = 0; i < kN; ++i) host[i] = static_cast<float>(i);
  ASSERT_EQ(cuMemcpyHtoDAsync(data, host, kN * sizeof(float), stream), CUDA_SUCCESS);
  // A copy that runs past the allocation is refused.
  EXPECT_EQ(cuMemcpyHtoDAsync(data + 4, host, kN * sizeof(float) + 256, stream),
            CUDA_ERROR_INVALID_VALUE);

  CUmodule module = nullptr;
  CUfunction fn = nullptr;
  ASSERT_NO_FATAL_FAILURE(LoadScaleKernel(&module, &fn));
  CUfunction missing = nullptr;
  EXPECT_EQ(cuModuleGetFunction(&missing, module, "missing"), CUDA_ERROR_NOT_FOUND);
  CUevent start = nullptr, stop = nullptr;
  ASSERT_EQ(cuEventCreate(&start, 0), CUDA_SUCCESS);
  ASSERT_EQ(cuEventCreate(&stop, 0), CUDA_SUCCESS);
  ASSERT_EQ(cuEventRecord(start, stream), CUDA_SUCCESS);
  uint32_t n = kN;
  float factor = 2.5f;
  void* params[] = {&data, &n, &factor};
  ASSERT_EQ(cuLaunchKernel(fn, (kN + 63) / 64, 1, 1, 64, 1, 1, 0, stream, params, nullptr),
            CUDA_SUCCESS);
  ASSERT_EQ(cuEventRecord(stop, stream), CUDA_SUCCESS);
  std::vector<float> back(kN);
  ASSERT_EQ(cuMemcpyDtoHAsync(back.data(), data, kN * sizeof(float), stream), CUDA_SUCCESS);
  ASSERT_EQ(cuStreamSynchronize(stream), CUDA_SUCCESS);
  for (uint32_t i = 0; i < kN; ++i) EXPECT_EQ(back[i], 2.5f * static_cast<float>(i)) << i;
  float ms = -1.0f;
  ASSERT_EQ(cuEventElapsedTime(&ms, start, stop), CUDA_SUCCESS);
  EXPECT_GE(ms, 0.0f);

  ASSERT_EQ(cuMemsetD32Async(data, 0x3f800000u, kN, stream), CUDA_SUCCESS);  // 1.0f
  ASSERT_EQ(cuMemcpyDtoHAsync(back.data(), data, kN * sizeof(float), stream), CUDA_SUCCESS);
  EXPECT_EQ(back[kN - 1], 1.0f);

  EXPECT_EQ(cuEventDestroy(start), CUDA_SUCCESS);
  EXPECT_EQ(cuEventDestroy(stop), CUDA_SUCCESS);
  EXPECT_EQ(cuModuleUnload(module), CUDA_SUCCESS);
  EXPECT_EQ(cuModuleUnload(module), CUDA_ERROR_INVALID_HANDLE);
  EXPECT_EQ(cuMemFreeAsync(data, stream), CUDA_SUCCESS);
  EXPECT_EQ(cuMemFreeHost(host), CUDA_SUCCESS);
  EXPECT_EQ(cuStreamDestroy(stream), CUDA_SUCCESS);
}

TEST_F(EmulatedDriverTest, BadPtxFailsWithTheParseErrorInTheJitLog) {
  MakeCurrent();
  std::string bad = kScalePtx;
  bad.replace(bad.find("mul.rn.f32"), 10, "mul.rn.f16");
  char log[256];
  std::memset(log, 'x', sizeof(log));
  CUjit_option options[] = {CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
  void* values[] = {log, reinterpret_cast<void*>(static_cast<uintptr_t>(sizeof(log)))};
  CUmodule module = nullptr;
  EXPECT_EQ(cuModuleLoadDataEx(&module, bad.c_str(), 2, options, values), CUDA_ERROR_INVALID_PTX);
  EXPECT_THAT(std::string(log), HasSubstr("line 22: unsupported instruction 'mul.rn.f16'"));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(values[1]), std::strlen(log) + 1);  // size written back

  std::string too_new = kScalePtx;
  too_new.replace(too_new.find("sm_90"), 5, "sm_100");
  EXPECT_EQ(cuModuleLoadDataEx(&module, too_new.c_str(), 2, options, values),
            CUDA_ERROR_INVALID_PTX);
  EXPECT_THAT(std::string(log), HasSubstr("sm_100"));

  std::string newer_isa = kScalePtx;
  newer_isa.replace(newer_isa.find("7.8"), 3, "9.9");
  EXPECT_EQ(cuModuleLoadDataEx(&module, newer_isa.c_str(), 0, nullptr, nullptr),
            CUDA_ERROR_UNSUPPORTED_PTX_VERSION);

  const char elf[] =
      "\x7f"
      "ELF\x02\x01\x01";
  EXPECT_EQ(cuModuleLoadDataEx(&module, elf, 0, nullptr, nullptr), CUDA_ERROR_NO_BINARY_FOR_GPU);
}

TEST_F(EmulatedDriverTest, ConcurrentThreadsEachWithTheirOwnStreamDoNotInterfere) {
  CUcontext ctx = nullptr;
  ASSERT_EQ(cuDevicePrimaryCtxRetain(&ctx, 0), CUDA_SUCCESS);
  ASSERT_EQ(cuCtxSetCurrent(ctx), CUDA_SUCCESS);
  CUmodule module = nullptr;
  CUfunction fn = nullptr;
  ASSERT_NO_FATAL_FAILURE(LoadScaleKernel(&module, &fn));
  constexpr int kThreads = 6;
  constexpr int kRounds = 10;
  std::vector<int> failures(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      if (cuCtxSetCurrent(ctx) != CUDA_SUCCESS) {
        ++failures[t];
        return;
      }
      CUstream stream = nullptr;
      if (cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) ++failures[t];
      for (int round = 0; round < kRounds; ++round) {
        const uint32_t n = 64 + 37 * static_cast<uint32_t>(t + round);
        std::vector<float> host(n);
        for (uint32_t i = 0; i < n; ++i) host[i] = static_cast<float>(i + t);
        CUdeviceptr data = 0;
        float factor = static_cast<float>(t + 1);
        void* params[] = {&data, const_cast<uint32_t*>(&n), &factor};
        bool ok = cuMemAlloc(&data, n * sizeof(float)) == CUDA_SUCCESS &&
                  cuMemcpyHtoDAsync(data, host.data(), n * sizeof(float), stream) == CUDA_SUCCESS &&
                  cuLaunchKernel(fn, (n + 63) / 64, 1, 1, 64, 1, 1, 0, stream, params, nullptr) ==
                      CUDA_SUCCESS &&
                  cuMemcpyDtoHAsync(host.data(), data, n * sizeof(float), stream) == CUDA_SUCCESS &&
                  cuStreamSynchronize(stream) == CUDA_SUCCESS && cuMemFree(data) == CUDA_SUCCESS;
        for (uint32_t i = 0; ok && i < n; ++i) ok = host[i] == static_cast<float>(i + t) * factor;
        if (!ok) ++failures[t];
      }
      if (cuStreamDestroy(stream) != CUDA_SUCCESS) ++failures[t];
    });
  }
  for (std::thread& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(failures[t], 0) << "thread " << t;
  EXPECT_EQ(cuModuleUnload(module), CUDA_SUCCESS);
}

TEST_F(EmulatedDriverTest, OutOfBoundsLaunchIsIllegalAddressAndTheContextStaysUsable) {
  MakeCurrent();
  CUdeviceptr data = 0;
  ASSERT_EQ(cuMemAlloc(&data, 64 * sizeof(float)), CUDA_SUCCESS);
  ASSERT_EQ(cuMemsetD32Async(data, 0, 64, nullptr), CUDA_SUCCESS);
  CUmodule module = nullptr;
  CUfunction fn = nullptr;
  ASSERT_NO_FATAL_FAILURE(LoadScaleKernel(&module, &fn));
  uint32_t n = 200;  // the kernel believes the buffer holds 200 floats; it holds 64
  float factor = 1.0f;
  void* params[] = {&data, &n, &factor};
  EXPECT_EQ(cuLaunchKernel(fn, 4, 1, 1, 64, 1, 1, 0, nullptr, params, nullptr),
            CUDA_ERROR_ILLEGAL_ADDRESS);
  n = 64;
  EXPECT_EQ(cuLaunchKernel(fn, 1, 1, 1, 64, 1, 1, 0, nullptr, params, nullptr), CUDA_SUCCESS);
  EXPECT_EQ(cuLaunchKernel(fn, 1, 1, 1, 2048, 1, 1, 0, nullptr, params, nullptr),
            CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuModuleUnload(module), CUDA_SUCCESS);
  EXPECT_EQ(cuMemFree(data), CUDA_SUCCESS);
}

// The driver refuses a block with more threads than the entry's .maxntid (the product of its
// extents) with CUDA_ERROR_INVALID_VALUE, as it refuses one above the device's 1024; every
// kernel normgrad emits declares its block size this way (docs/kernels.md).
TEST_F(EmulatedDriverTest, ALaunchAboveTheEntrysMaxntidIsInvalidValue) {
  MakeCurrent();
  std::string bounded = kScalePtx;
  const size_t body = bounded.find(")\n{");
  ASSERT_NE(body, std::string::npos);
  bounded.insert(body + 1, "\n.maxntid 64, 1, 1");
  CUmodule module = nullptr;
  ASSERT_EQ(cuModuleLoadDataEx(&module, bounded.c_str(), 0, nullptr, nullptr), CUDA_SUCCESS);
  CUfunction fn = nullptr;
  ASSERT_EQ(cuModuleGetFunction(&fn, module, "scale"), CUDA_SUCCESS);
  constexpr uint32_t kN = 64;
  CUdeviceptr data = 0;
  ASSERT_EQ(cuMemAlloc(&data, kN * sizeof(float)), CUDA_SUCCESS);
  ASSERT_EQ(cuMemsetD32Async(data, 0x3f800000u, kN, nullptr), CUDA_SUCCESS);  // 1.0f
  uint32_t n = kN;
  float factor = 3.0f;
  void* params[] = {&data, &n, &factor};

  EXPECT_EQ(cuLaunchKernel(fn, 1, 1, 1, 128, 1, 1, 0, nullptr, params, nullptr),
            CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuLaunchKernel(fn, 1, 1, 1, 8, 16, 1, 0, nullptr, params, nullptr),
            CUDA_ERROR_INVALID_VALUE);  // 128 threads in two dimensions
  EXPECT_EQ(cuLaunchKernel(fn, 1, 1, 1, 65, 1, 1, 0, nullptr, params, nullptr),
            CUDA_ERROR_INVALID_VALUE);
  std::vector<float> back(kN);
  ASSERT_EQ(cuMemcpyDtoHAsync(back.data(), data, kN * sizeof(float), nullptr), CUDA_SUCCESS);
  EXPECT_EQ(back[0], 1.0f);  // the refused launches ran nothing

  // 64 threads in any shape are within the bound.
  EXPECT_EQ(cuLaunchKernel(fn, 1, 1, 1, 8, 8, 1, 0, nullptr, params, nullptr), CUDA_SUCCESS);
  ASSERT_EQ(cuMemsetD32Async(data, 0x3f800000u, kN, nullptr), CUDA_SUCCESS);
  EXPECT_EQ(cuLaunchKernel(fn, 1, 1, 1, 64, 1, 1, 0, nullptr, params, nullptr), CUDA_SUCCESS);
  ASSERT_EQ(cuMemcpyDtoHAsync(back.data(), data, kN * sizeof(float), nullptr), CUDA_SUCCESS);
  for (uint32_t i = 0; i < kN; ++i) EXPECT_EQ(back[i], 3.0f) << i;

  // Without the directive the same 128-thread block launches.
  CUmodule unbounded = nullptr;
  CUfunction plain = nullptr;
  ASSERT_NO_FATAL_FAILURE(LoadScaleKernel(&unbounded, &plain));
  EXPECT_EQ(cuLaunchKernel(plain, 1, 1, 1, 128, 1, 1, 0, nullptr, params, nullptr), CUDA_SUCCESS);

  EXPECT_EQ(cuModuleUnload(unbounded), CUDA_SUCCESS);
  EXPECT_EQ(cuModuleUnload(module), CUDA_SUCCESS);
  EXPECT_EQ(cuMemFree(data), CUDA_SUCCESS);
}

}  // namespace
