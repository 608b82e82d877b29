// Loads libnormgrad_emulated_cuda.so with dlopen and drives it through the Driver API, as the
// server's CUDA backend does: device queries, context rules, memory, copies, module loading
// (and its JIT error log), launches, streams and events; and CUDA IPC between this process and
// a child (this binary re-executed with NORMGRAD_EMULATED_IPC_TEST_ROLE set, which plays one
// side and exits before any test runs).
#include <cuda.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace {

using ::testing::HasSubstr;

// Every symbol nvidia/driver_api.h resolves, and the IPC ones its IPC data path uses, by
// its exported name: the name cuda.h's macros map a call to, so that `cuMemAlloc(...)` below
// calls the cuMemAlloc_v2 member. (The unversioned cuEventElapsedTime and cuDeviceGetUuid,
// exported too, are checked by name only.)
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
  X(cuMemGetInfo_v2)              \
  X(cuDeviceGetUuid_v2)           \
  X(cuMemGetAddressRange_v2)      \
  X(cuIpcGetMemHandle)            \
  X(cuIpcOpenMemHandle_v2)        \
  X(cuIpcCloseMemHandle)

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

// ---- The child's side of the IPC tests ----

// The environment that makes this binary a child: its role, and the parent's handle (hex).
constexpr char kRoleVariable[] = "NORMGRAD_EMULATED_IPC_TEST_ROLE";
constexpr char kHandleVariable[] = "NORMGRAD_EMULATED_IPC_TEST_HANDLE";
constexpr char kExpectVariable[] = "NORMGRAD_EMULATED_IPC_TEST_EXPECT";  // a CUresult
// The exported buffer: kIpcFloats floats, element i holding i * (the role's factor).
constexpr uint32_t kIpcFloats = 256;

std::string HandleToHex(const CUipcMemHandle& handle) {
  std::string hex;
  char byte[3];
  for (char c : handle.reserved) {
    std::snprintf(byte, sizeof(byte), "%02x", static_cast<unsigned char>(c));
    hex += byte;
  }
  return hex;
}

bool HexToHandle(const char* hex, CUipcMemHandle* handle) {
  if (hex == nullptr || std::strlen(hex) != 2 * sizeof(handle->reserved)) return false;
  for (size_t i = 0; i < sizeof(handle->reserved); ++i) {
    unsigned int byte = 0;
    if (std::sscanf(hex + 2 * i, "%2x", &byte) != 1) return false;
    handle->reserved[i] = static_cast<char>(byte);
  }
  return true;
}

// The driver's entry points for a child, which runs before gtest does.
struct ChildDriver {
#define NG_DECLARE(symbol) decltype(&::symbol) symbol = nullptr;
  NG_DRIVER_SYMBOLS(NG_DECLARE)
#undef NG_DECLARE

  // dlopen, every symbol, cuInit, the primary context made current.
  bool Load() {
    void* lib = dlopen(NORMGRAD_EMULATED_CUDA_PATH, RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) return false;
    bool ok = true;
#define NG_LOAD(symbol)                                                \
  symbol = reinterpret_cast<decltype(&::symbol)>(dlsym(lib, #symbol)); \
  ok = ok && symbol != nullptr;
    NG_DRIVER_SYMBOLS(NG_LOAD)
#undef NG_LOAD
    CUcontext ctx = nullptr;
    return ok && cuInit(0) == CUDA_SUCCESS && cuDevicePrimaryCtxRetain(&ctx, 0) == CUDA_SUCCESS &&
           cuCtxSetCurrent(ctx) == CUDA_SUCCESS;
  }
};

// Role "import": open the parent's handle (twice: the same pointer), read i * 1.0, check the
// address range of an interior pointer, scale the buffer by 2 with a kernel launched here, write
// -1 into the last element, close twice. The exit code names the first step that failed.
int ImportAndWrite(ChildDriver& cu, const CUipcMemHandle& handle) {
  constexpr size_t kBytes = kIpcFloats * sizeof(float);
  CUdeviceptr p = 0, again = 0;
  if (cu.cuIpcOpenMemHandle(&p, handle, 0) != CUDA_ERROR_INVALID_VALUE) return 20;  // flags
  if (cu.cuIpcOpenMemHandle(&p, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) != CUDA_SUCCESS)
    return 21;
  CUdeviceptr base = 0;
  size_t size = 0;
  if (cu.cuMemGetAddressRange(&base, &size, p + 100) != CUDA_SUCCESS || base != p ||
      size != kBytes)
    return 22;
  std::vector<float> host(kIpcFloats);
  if (cu.cuMemcpyDtoHAsync(host.data(), p, kBytes, nullptr) != CUDA_SUCCESS) return 23;
  for (uint32_t i = 0; i < kIpcFloats; ++i) {
    if (host[i] != static_cast<float>(i)) return 24;
  }
  if (cu.cuIpcOpenMemHandle(&again, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) != CUDA_SUCCESS ||
      again != p)
    return 25;
  if (cu.cuIpcCloseMemHandle(p) != CUDA_SUCCESS) return 26;
  // One reference left: still mapped, still a device range.
  if (cu.cuMemGetAddressRange(&base, nullptr, p) != CUDA_SUCCESS) return 27;
  CUmodule module = nullptr;
  CUfunction fn = nullptr;
  if (cu.cuModuleLoadDataEx(&module, kScalePtx, 0, nullptr, nullptr) != CUDA_SUCCESS ||
      cu.cuModuleGetFunction(&fn, module, "scale") != CUDA_SUCCESS)
    return 28;
  uint32_t n = kIpcFloats;
  float factor = 2.0f;
  void* params[] = {&p, &n, &factor};
  if (cu.cuLaunchKernel(fn, kIpcFloats / 64, 1, 1, 64, 1, 1, 0, nullptr, params, nullptr) !=
      CUDA_SUCCESS)
    return 29;
  const float marker = -1.0f;
  if (cu.cuMemcpyHtoDAsync(p + kBytes - sizeof(float), &marker, sizeof(float), nullptr) !=
      CUDA_SUCCESS)
    return 30;
  if (cu.cuModuleUnload(module) != CUDA_SUCCESS) return 31;
  if (cu.cuIpcCloseMemHandle(p) != CUDA_SUCCESS) return 32;
  if (cu.cuIpcCloseMemHandle(p) != CUDA_ERROR_INVALID_VALUE) return 33;  // no reference left
  if (cu.cuMemGetAddressRange(&base, &size, p) != CUDA_ERROR_NOT_FOUND) return 34;
  return 0;
}

// Role "export": allocate kIpcFloats floats holding i * 3, print the handle's hex on a line of
// its own on stdout (after gtest's banner lines), wait for a byte (or EOF) on stdin, free the
// allocation and exit.
int ExportAndExit(ChildDriver& cu) {
  constexpr size_t kBytes = kIpcFloats * sizeof(float);
  std::vector<float> host(kIpcFloats);
  for (uint32_t i = 0; i < kIpcFloats; ++i) host[i] = 3.0f * static_cast<float>(i);
  CUdeviceptr p = 0;
  CUipcMemHandle handle;
  if (cu.cuMemAlloc(&p, kBytes) != CUDA_SUCCESS ||
      cu.cuMemcpyHtoDAsync(p, host.data(), kBytes, nullptr) != CUDA_SUCCESS ||
      cu.cuIpcGetMemHandle(&handle, p) != CUDA_SUCCESS)
    return 50;
  const std::string line = HandleToHex(handle) + "\n";
  if (write(STDOUT_FILENO, line.data(), line.size()) != static_cast<ssize_t>(line.size()))
    return 51;
  char go = 0;
  if (read(STDIN_FILENO, &go, 1) < 0) return 52;
  return cu.cuMemFree(p) == CUDA_SUCCESS ? 0 : 53;
}

// Runs the child's role when this binary was started as one; returns otherwise.
void RunChildRoleIfAsked() {
  const char* role = std::getenv(kRoleVariable);
  if (role == nullptr) return;
  ChildDriver cu;
  if (!cu.Load()) std::exit(10);
  const std::string r = role;
  CUipcMemHandle handle;
  const bool have_handle = HexToHandle(std::getenv(kHandleVariable), &handle);
  if (r == "import") std::exit(have_handle ? ImportAndWrite(cu, handle) : 11);
  if (r == "export") std::exit(ExportAndExit(cu));
  if (r == "expect") {  // one open, whose result must be $NORMGRAD_EMULATED_IPC_TEST_EXPECT
    const char* expect = std::getenv(kExpectVariable);
    if (!have_handle || expect == nullptr) std::exit(11);
    CUdeviceptr p = 0;
    const CUresult got = cu.cuIpcOpenMemHandle(&p, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
    if (got == std::atoi(expect)) std::exit(0);
    std::fprintf(stderr, "cuIpcOpenMemHandle returned %d, expected %s\n", static_cast<int>(got),
                 expect);
    std::exit(12);
  }
  std::exit(13);
}

// gtest sets global environments up before the first test, so a child plays its role and exits
// without running one. (From main, not from a static initializer: LeakSanitizer's check at exit
// crashes when exit is called during static initialization.)
class ChildRoleEnvironment : public ::testing::Environment {
 public:
  void SetUp() override { RunChildRoleIfAsked(); }
};
::testing::Environment* const kChildRoleEnvironment =
    ::testing::AddGlobalTestEnvironment(new ChildRoleEnvironment);  // gtest owns it

// ---- The parent's side ----

// This binary, re-executed as a child with `variables` ("NAME=value") added to the environment;
// with `pipes`, its stdin and stdout are pipes from and to the parent.
struct Child {
  pid_t pid = -1;
  int to_child = -1;    // the child's stdin, with pipes
  int from_child = -1;  // the child's stdout, with pipes
};

Child StartChild(const std::vector<std::string>& variables, bool pipes) {
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) env_strings.push_back(*e);
  env_strings.insert(env_strings.end(), variables.begin(), variables.end());
  std::vector<char*> envp;
  for (std::string& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  char exe[] = "/proc/self/exe";
  char* argv[] = {exe, nullptr};
  int in[2] = {-1, -1}, out[2] = {-1, -1};
  if (pipes && (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0)) return {};
  Child child;
  child.pid = fork();
  if (child.pid == 0) {  // only async-signal-safe calls from here to execve
    if (pipes && (dup2(in[0], STDIN_FILENO) < 0 || dup2(out[1], STDOUT_FILENO) < 0)) _exit(126);
    execve(exe, argv, envp.data());
    _exit(127);
  }
  if (pipes) {
    close(in[0]);
    close(out[1]);
    child.to_child = in[1];
    child.from_child = out[0];
  }
  return child;
}

// Waits for `child` and describes how it ended: "exit 0" is success.
std::string WaitForChild(Child& child) {
  if (child.to_child >= 0) close(child.to_child);
  if (child.from_child >= 0) close(child.from_child);
  child.to_child = child.from_child = -1;
  int status = 0;
  if (child.pid < 0 || waitpid(child.pid, &status, 0) != child.pid) return "not started";
  if (WIFEXITED(status)) return "exit " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return "signal " + std::to_string(WTERMSIG(status));
  return "status " + std::to_string(status);
}

std::string RunChild(const std::vector<std::string>& variables) {
  Child child = StartChild(variables, /*pipes=*/false);
  return WaitForChild(child);
}

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

  // A `bytes` allocation in `data` and its IPC handle in `handle`; the caller frees it.
  void AllocAndExport(size_t bytes, CUdeviceptr* data, CUipcMemHandle* handle) {
    ASSERT_EQ(cuMemAlloc(data, bytes), CUDA_SUCCESS);
    ASSERT_EQ(cuIpcGetMemHandle(handle, *data), CUDA_SUCCESS);
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
  for (const char* name : {NG_DRIVER_SYMBOLS(NG_NAME) "cuEventElapsedTime", "cuDeviceGetUuid"}) {
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

// ---- CUDA IPC ----

TEST_F(EmulatedDriverTest, DeviceUuidIsTheSameThroughBothNames) {
  CUuuid v2, plain;
  ASSERT_EQ(cuDeviceGetUuid(&v2, 0), CUDA_SUCCESS);  // cuDeviceGetUuid_v2
  auto unversioned = api_.Get<CUresult (*)(CUuuid*, CUdevice)>("cuDeviceGetUuid");
  ASSERT_NE(unversioned, nullptr);
  ASSERT_EQ(unversioned(&plain, 0), CUDA_SUCCESS);
  EXPECT_EQ(std::memcmp(v2.bytes, plain.bytes, sizeof(v2.bytes)), 0);
  EXPECT_EQ(cuDeviceGetUuid(&v2, 1), CUDA_ERROR_INVALID_DEVICE);
  EXPECT_EQ(cuDeviceGetUuid(nullptr, 0), CUDA_ERROR_INVALID_VALUE);
}

TEST_F(EmulatedDriverTest, AMalformedDeviceUuidVariableAbortsTheProcess) {
  EXPECT_EQ(RunChild({"NORMGRAD_EMULATED_IPC_TEST_ROLE=import",
                      "NORMGRAD_EMULATED_DEVICE_UUID=0123456789abcdef-not-hex-0123456789"}),
            "signal " + std::to_string(SIGABRT));
}

TEST_F(EmulatedDriverTest, MemGetAddressRangeGivesTheAllocationContainingAPointer) {
  MakeCurrent();
  CUdeviceptr data = 0;
  ASSERT_EQ(cuMemAlloc(&data, 1000), CUDA_SUCCESS);
  CUdeviceptr base = 0;
  size_t size = 0;
  ASSERT_EQ(cuMemGetAddressRange(&base, &size, data + 777), CUDA_SUCCESS);
  EXPECT_EQ(base, data);
  EXPECT_EQ(size, 1024u);  // 256-byte granularity
  EXPECT_EQ(cuMemGetAddressRange(nullptr, &size, data + 1023), CUDA_SUCCESS);
  EXPECT_EQ(cuMemGetAddressRange(&base, nullptr, data), CUDA_SUCCESS);
  EXPECT_EQ(cuMemGetAddressRange(&base, &size, data + 1024), CUDA_ERROR_NOT_FOUND);
  EXPECT_EQ(cuMemGetAddressRange(&base, &size, 0), CUDA_ERROR_NOT_FOUND);
  ASSERT_EQ(cuMemFree(data), CUDA_SUCCESS);
  EXPECT_EQ(cuMemGetAddressRange(&base, &size, data), CUDA_ERROR_NOT_FOUND);
}

TEST_F(EmulatedDriverTest, IpcGetMemHandleNeedsTheBaseOfALiveAllocation) {
  MakeCurrent();
  CUdeviceptr data = 0;
  ASSERT_EQ(cuMemAlloc(&data, 4096), CUDA_SUCCESS);
  EXPECT_EQ(data % 256, 0u);
  CUipcMemHandle handle;
  EXPECT_EQ(cuIpcGetMemHandle(&handle, data + 256), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuIpcGetMemHandle(&handle, 0), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuIpcGetMemHandle(nullptr, data), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuIpcGetMemHandle(&handle, data), CUDA_SUCCESS);
  ASSERT_EQ(cuMemFree(data), CUDA_SUCCESS);
  EXPECT_EQ(cuIpcGetMemHandle(&handle, data), CUDA_ERROR_INVALID_VALUE);
  ASSERT_EQ(cuCtxSetCurrent(nullptr), CUDA_SUCCESS);
  EXPECT_EQ(cuIpcGetMemHandle(&handle, data), CUDA_ERROR_INVALID_CONTEXT);
}

TEST_F(EmulatedDriverTest, IpcOpenInTheExportingProcessIsInvalidContext) {
  MakeCurrent();
  CUdeviceptr data = 0;
  CUipcMemHandle handle;
  ASSERT_NO_FATAL_FAILURE(AllocAndExport(4096, &data, &handle));
  CUdeviceptr opened = 0;
  EXPECT_EQ(cuIpcOpenMemHandle(&opened, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
            CUDA_ERROR_INVALID_CONTEXT);
  EXPECT_EQ(cuIpcOpenMemHandle(&opened, handle, 0), CUDA_ERROR_INVALID_VALUE);
  CUipcMemHandle garbage;
  std::memset(&garbage, 0x5a, sizeof(garbage));
  EXPECT_EQ(cuIpcOpenMemHandle(&opened, garbage, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
            CUDA_ERROR_INVALID_HANDLE);
  // Only a pointer cuIpcOpenMemHandle returned can be closed; an own allocation cannot.
  EXPECT_EQ(cuIpcCloseMemHandle(data), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuMemFree(data), CUDA_SUCCESS);
}

// The parent exports i * 1.0; the child reads it, opens twice (one pointer, two closes), scales
// it by 2 with a kernel launched in the child and writes -1 last; the parent sees all of that.
TEST_F(EmulatedDriverTest, AnotherProcessReadsAndWritesAnExportedAllocation) {
  MakeCurrent();
  constexpr size_t kBytes = kIpcFloats * sizeof(float);
  CUdeviceptr data = 0;
  ASSERT_EQ(cuMemAlloc(&data, kBytes), CUDA_SUCCESS);
  std::vector<float> host(kIpcFloats);
  for (uint32_t i = 0; i < kIpcFloats; ++i) host[i] = static_cast<float>(i);
  ASSERT_EQ(cuMemcpyHtoDAsync(data, host.data(), kBytes, nullptr), CUDA_SUCCESS);
  CUipcMemHandle handle;
  ASSERT_EQ(cuIpcGetMemHandle(&handle, data), CUDA_SUCCESS);

  // Exit codes: see ImportAndWrite.
  EXPECT_EQ(RunChild({"NORMGRAD_EMULATED_IPC_TEST_ROLE=import",
                      "NORMGRAD_EMULATED_IPC_TEST_HANDLE=" + HandleToHex(handle)}),
            "exit 0");
  ASSERT_EQ(cuMemcpyDtoHAsync(host.data(), data, kBytes, nullptr), CUDA_SUCCESS);
  for (uint32_t i = 0; i + 1 < kIpcFloats; ++i) EXPECT_EQ(host[i], 2.0f * i) << i;
  EXPECT_EQ(host[kIpcFloats - 1], -1.0f);
  EXPECT_EQ(cuMemFree(data), CUDA_SUCCESS);
}

// Freed, with the fd number most likely reused by the next allocation: the handle names a memfd
// that is gone (or another one), so opening it is CUDA_ERROR_INVALID_HANDLE.
TEST_F(EmulatedDriverTest, AFreedAllocationsHandleIsInvalidHandle) {
  MakeCurrent();
  CUdeviceptr data = 0;
  CUipcMemHandle handle;
  ASSERT_NO_FATAL_FAILURE(AllocAndExport(4096, &data, &handle));
  ASSERT_EQ(cuMemFree(data), CUDA_SUCCESS);
  CUdeviceptr successor = 0;
  ASSERT_EQ(cuMemAlloc(&successor, 4096), CUDA_SUCCESS);
  const std::string expect_invalid_handle =
      "NORMGRAD_EMULATED_IPC_TEST_EXPECT=" + std::to_string(CUDA_ERROR_INVALID_HANDLE);
  EXPECT_EQ(RunChild({"NORMGRAD_EMULATED_IPC_TEST_ROLE=expect", expect_invalid_handle,
                      "NORMGRAD_EMULATED_IPC_TEST_HANDLE=" + HandleToHex(handle)}),
            "exit 0");
  ASSERT_EQ(cuMemFree(successor), CUDA_SUCCESS);
  EXPECT_EQ(RunChild({"NORMGRAD_EMULATED_IPC_TEST_ROLE=expect", expect_invalid_handle,
                      "NORMGRAD_EMULATED_IPC_TEST_HANDLE=" + HandleToHex(handle)}),
            "exit 0");
}

TEST_F(EmulatedDriverTest, AHandleFromADeviceWithAnotherUuidIsInvalidDevice) {
  MakeCurrent();
  CUuuid uuid;
  ASSERT_EQ(cuDeviceGetUuid(&uuid, 0), CUDA_SUCCESS);
  uuid.bytes[15] = static_cast<char>(uuid.bytes[15] ^ 1);
  std::string other;  // as nvidia-smi writes one: 8-4-4-4-12
  char byte[3];
  for (int i = 0; i < 16; ++i) {
    std::snprintf(byte, sizeof(byte), "%02x", static_cast<unsigned char>(uuid.bytes[i]));
    other += byte;
    if (i == 3 || i == 5 || i == 7 || i == 9) other += '-';
  }
  CUdeviceptr data = 0;
  CUipcMemHandle handle;
  ASSERT_NO_FATAL_FAILURE(AllocAndExport(4096, &data, &handle));
  const std::string handle_variable = "NORMGRAD_EMULATED_IPC_TEST_HANDLE=" + HandleToHex(handle);
  EXPECT_EQ(RunChild({"NORMGRAD_EMULATED_IPC_TEST_ROLE=expect", handle_variable,
                      "NORMGRAD_EMULATED_IPC_TEST_EXPECT=" +
                          std::to_string(CUDA_ERROR_INVALID_DEVICE),
                      "NORMGRAD_EMULATED_DEVICE_UUID=" + other}),
            "exit 0");
  // The same handle on this device opens (then the child exits with it open: no crash).
  EXPECT_EQ(RunChild({"NORMGRAD_EMULATED_IPC_TEST_ROLE=expect", handle_variable,
                      "NORMGRAD_EMULATED_IPC_TEST_EXPECT=" + std::to_string(CUDA_SUCCESS)}),
            "exit 0");
  EXPECT_EQ(cuMemFree(data), CUDA_SUCCESS);
}

// This process imports the child's allocation; the child frees it and exits; the mapping here
// stays readable and writable (a kernel scales it) until closed, and the handle no longer opens.
TEST_F(EmulatedDriverTest, AnImportedMappingOutlivesItsExporter) {
  MakeCurrent();
  constexpr size_t kBytes = kIpcFloats * sizeof(float);
  Child child = StartChild({"NORMGRAD_EMULATED_IPC_TEST_ROLE=export"}, /*pipes=*/true);
  ASSERT_GT(child.pid, 0);
  std::string said, line;
  CUipcMemHandle handle;
  bool have_handle = false;
  char c = 0;
  while (!have_handle && read(child.from_child, &c, 1) == 1) {  // gtest's banner, then the handle
    if (c != '\n') {
      line += c;
      continue;
    }
    have_handle = HexToHandle(line.c_str(), &handle);
    said += line + "\n";
    line.clear();
  }
  ASSERT_TRUE(have_handle) << "child said:\n" << said;
  CUdeviceptr p = 0;
  ASSERT_EQ(cuIpcOpenMemHandle(&p, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), CUDA_SUCCESS);
  std::vector<float> host(kIpcFloats);
  ASSERT_EQ(cuMemcpyDtoHAsync(host.data(), p, kBytes, nullptr), CUDA_SUCCESS);
  EXPECT_EQ(host[5], 15.0f);

  ASSERT_EQ(write(child.to_child, "x", 1), 1);
  EXPECT_EQ(WaitForChild(child), "exit 0");  // freed and gone

  CUmodule module = nullptr;
  CUfunction fn = nullptr;
  ASSERT_NO_FATAL_FAILURE(LoadScaleKernel(&module, &fn));
  uint32_t n = kIpcFloats;
  float factor = 2.0f;
  void* params[] = {&p, &n, &factor};
  ASSERT_EQ(cuLaunchKernel(fn, kIpcFloats / 64, 1, 1, 64, 1, 1, 0, nullptr, params, nullptr),
            CUDA_SUCCESS);
  ASSERT_EQ(cuMemcpyDtoHAsync(host.data(), p, kBytes, nullptr), CUDA_SUCCESS);
  for (uint32_t i = 0; i < kIpcFloats; ++i) EXPECT_EQ(host[i], 6.0f * i) << i;
  EXPECT_EQ(cuModuleUnload(module), CUDA_SUCCESS);
  EXPECT_EQ(cuIpcCloseMemHandle(p), CUDA_SUCCESS);
  CUdeviceptr reopened = 0;
  EXPECT_EQ(cuIpcOpenMemHandle(&reopened, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
            CUDA_ERROR_INVALID_HANDLE);
}

}  // namespace
