// libnormgrad_emulated_cuda.so: a stand-in for libcuda.so.1 that exports the Driver API
// functions nvidia/driver_api.h looks up, backed by the PTX interpreter.
//
//   NORMGRAD_CUDA_DRIVER=build/lib/libnormgrad_emulated_cuda.so build/bin/normgrad-server ...
//
// Model (docs/ptxsim.md):
//  - One device ("normgrad emulated device (PTX interpreter)", sm_90 unless
//    $NORMGRAD_EMULATED_SM says otherwise), one primary context, a per-thread current context
//    (calls that need one fail with CUDA_ERROR_INVALID_CONTEXT without it, like the driver).
//  - Device memory is host memory (256-byte aligned); a device pointer is the host address.
//    Every allocation is a memfd ("normgrad-emu-<id>", the id unique across processes) mapped
//    MAP_SHARED, so another process can map the same pages, and is registered so the
//    interpreter bounds-checks each global access. Capacity: $NORMGRAD_EMULATED_MEMORY_MB
//    (default 16384) MiB of this process's own allocations, each rounded up to 256 bytes. Each
//    allocation holds a file descriptor, so the driver raises RLIMIT_NOFILE to its hard limit.
//  - The device's UUID is $NORMGRAD_EMULATED_DEVICE_UUID (32 hex digits, dashes ignored; anything
//    else aborts with a message) or a fixed default, so a test can put two processes on
//    "different GPUs".
//  - CUDA IPC: cuIpcGetMemHandle's handle names the exporter's pid, the memfd's fd number, the
//    allocation's id and size and the device UUID; cuIpcOpenMemHandle opens
//    /proc/<pid>/fd/<fd>, checks it is still that memfd and maps it (reference-counted per
//    handle) until cuIpcCloseMemHandle. A freed or exited exporter's handle is
//    CUDA_ERROR_INVALID_HANDLE, another UUID CUDA_ERROR_INVALID_DEVICE, the exporting process
//    itself CUDA_ERROR_INVALID_CONTEXT; an open mapping outlives its exporter.
//  - Streams execute synchronously at enqueue time, so every *Async call is complete when it
//    returns; events record the host clock.
//  - cuModuleLoadDataEx parses the PTX (never cubin); a parse error is CUDA_ERROR_INVALID_PTX
//    with "line N: reason" in CU_JIT_ERROR_LOG_BUFFER.
//  - cuLaunchKernel runs the interpreter on the calling thread. A sanitizer finding is printed
//    to stderr and returned: CUDA_ERROR_ILLEGAL_ADDRESS (out of bounds),
//    CUDA_ERROR_MISALIGNED_ADDRESS, CUDA_ERROR_LAUNCH_TIMEOUT (instruction limit,
//    $NORMGRAD_EMULATED_MAX_WARP_INSTRUCTIONS), CUDA_ERROR_LAUNCH_FAILED (the rest).
//    Errors are not sticky: the context stays usable.
//  - $NORMGRAD_EMULATED_CUDA_FAULT injects a device failure, counted in kernel launches (so N
//    does not depend on how many other calls start-up makes): "sticky:N" makes the Nth launch
//    fail with CUDA_ERROR_ILLEGAL_ADDRESS and every later call that needs a context fail the
//    same way (a lost device); "hang:N" lets the Nth launch return but the next
//    cuStreamSynchronize of its stream never returns (a hung device); "corrupt:N" flips the sign
//    bit of the first f32 of every device-to-host copy from the Nth launch on (wrong results).
//    Anything else there aborts with a message.
//  - $NORMGRAD_EMULATED_CUDA_VERBOSE=1 prints one line per launch (instructions, seconds).
#include <cuda.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "tests/common/cuda_error_text.h"
#include "tests/ptxsim/sim/interpreter.h"
#include "tests/ptxsim/sim/memory_map.h"
#include "tests/ptxsim/sim/parser.h"

// cuda.h maps cuEventElapsedTime to cuEventElapsedTime_v2; the unversioned symbol is exported
// too, for loaders that ask for it by that name.
#undef cuEventElapsedTime
extern "C" CUresult CUDAAPI cuEventElapsedTime(float* pMilliseconds, CUevent hStart, CUevent hEnd);
// The same for cuDeviceGetUuid (cuDeviceGetUuid_v2).
#undef cuDeviceGetUuid
extern "C" CUresult CUDAAPI cuDeviceGetUuid(CUuuid* uuid, CUdevice dev);

#define NG_EXPORT extern "C" __attribute__((visibility("default")))

namespace normgrad::ptxsim {
namespace {

constexpr int kDriverVersion = 13000;
constexpr int kMaxPtxMajor = 9;
constexpr int kMaxPtxMinor = 0;
constexpr const char* kDeviceName = "normgrad emulated device (PTX interpreter)";

uint64_t EnvU64(const char* name, uint64_t fallback) {
  const char* v = std::getenv(name);
  uint64_t out = 0;
  if (v == nullptr || !absl::SimpleAtoi(v, &out) || out == 0) return fallback;
  return out;
}

struct EmuContext {
  int device = 0;
};

struct EmuModule;
struct EmuFunction {
  EmuModule* module = nullptr;
  const Entry* entry = nullptr;
};

struct EmuModule {
  Module module;
  std::unordered_map<std::string, std::unique_ptr<EmuFunction>> functions;
};

struct EmuStream {
  unsigned int flags = 0;
};

struct EmuEvent {
  unsigned int flags = 0;
  bool recorded = false;
  std::chrono::steady_clock::time_point time;
};

struct EmuPool {
  uint64_t release_threshold = 0;
};

// $NORMGRAD_EMULATED_CUDA_FAULT (see the top of this file).
struct FaultPlan {
  enum class Kind { kNone, kSticky, kHang, kCorrupt };
  Kind kind = Kind::kNone;
  uint64_t at_launch = 0;  // N, from 1
};

FaultPlan ParseFaultPlan() {
  FaultPlan plan;
  const char* v = std::getenv("NORMGRAD_EMULATED_CUDA_FAULT");
  if (v == nullptr || *v == '\0') return plan;
  const std::string text = v;
  const size_t colon = text.find(':');
  const std::string kind = text.substr(0, colon);
  uint64_t n = 0;
  const bool number_ok = colon != std::string::npos &&
                         absl::SimpleAtoi(text.substr(colon + 1), &n) && n > 0;
  if (kind == "sticky") plan.kind = FaultPlan::Kind::kSticky;
  if (kind == "hang") plan.kind = FaultPlan::Kind::kHang;
  if (kind == "corrupt") plan.kind = FaultPlan::Kind::kCorrupt;
  if (plan.kind == FaultPlan::Kind::kNone || !number_ok) {
    std::fprintf(stderr,
                 "[emulated cuda] NORMGRAD_EMULATED_CUDA_FAULT=%s is not sticky:N, hang:N or "
                 "corrupt:N with N >= 1\n",
                 v);
    std::abort();
  }
  plan.at_launch = n;
  return plan;
}

// $NORMGRAD_EMULATED_DEVICE_UUID (see the top of this file).
CUuuid ParseDeviceUuid() {
  CUuuid uuid;
  // "ngemu-device-000" in ASCII: recognizably the emulator's in a dump.
  std::memcpy(uuid.bytes, "ngemu-device-000", sizeof(uuid.bytes));
  const char* v = std::getenv("NORMGRAD_EMULATED_DEVICE_UUID");
  if (v == nullptr || *v == '\0') return uuid;
  std::string hex;
  for (const char* c = v; *c != '\0'; ++c) {
    if (*c != '-') hex.push_back(*c);
  }
  bool ok = hex.size() == 2 * sizeof(uuid.bytes);
  for (size_t i = 0; ok && i < sizeof(uuid.bytes); ++i) {
    unsigned int byte = 0;
    ok = std::isxdigit(static_cast<unsigned char>(hex[2 * i])) &&
         std::isxdigit(static_cast<unsigned char>(hex[2 * i + 1])) &&
         std::sscanf(hex.c_str() + 2 * i, "%2x", &byte) == 1;
    uuid.bytes[i] = static_cast<char>(byte);
  }
  if (!ok) {
    std::fprintf(stderr,
                 "[emulated cuda] NORMGRAD_EMULATED_DEVICE_UUID=%s is not 32 hex digits (dashes "
                 "allowed)\n",
                 v);
    std::abort();
  }
  return uuid;
}

// A device allocation of this process: the memfd that backs it stays open while it lives, so an
// importer can open it through /proc/<pid>/fd/<fd>.
struct DeviceAllocation {
  uint64_t id = 0;  // in the memfd's name, "normgrad-emu-<id>"
  int fd = -1;
  uint64_t size = 0;    // rounded up to 256 bytes: what the MemoryMap and capacity count
  uint64_t mapped = 0;  // rounded up to pages: the memfd's size and the mapping's
};

// Another process's allocation mapped here by cuIpcOpenMemHandle.
struct ImportedMapping {
  int32_t pid = 0;
  uint64_t id = 0;
  uint64_t size = 0;
  uint64_t mapped = 0;
  int refs = 0;  // cuIpcOpenMemHandle calls not yet closed
};

class EmulatedDriver {
 public:
  EmulatedDriver()
      : sm_(static_cast<int>(EnvU64("NORMGRAD_EMULATED_SM", 90))),
        total_bytes_(EnvU64("NORMGRAD_EMULATED_MEMORY_MB", 16384) << 20),
        max_warp_instructions_(
            EnvU64("NORMGRAD_EMULATED_MAX_WARP_INSTRUCTIONS", uint64_t{1} << 36)),
        verbose_(EnvU64("NORMGRAD_EMULATED_CUDA_VERBOSE", 0) != 0),
        fault_(ParseFaultPlan()),
        uuid_(ParseDeviceUuid()),
        first_allocation_id_(std::random_device()() * uint64_t{0x100000000} ^
                             (static_cast<uint64_t>(getpid()) << 20)) {
    // Every live allocation holds its memfd open: allow as many descriptors as the hard limit,
    // so a process with many buffers does not run out at a soft limit of 1024.
    rlimit files;
    if (getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < files.rlim_max) {
      files.rlim_cur = files.rlim_max;
      setrlimit(RLIMIT_NOFILE, &files);
    }
  }

  std::mutex mu;
  bool initialized = false;  // guarded by mu
  int primary_refs = 0;      // guarded by mu
  EmuContext primary;
  EmuPool pool;
  MemoryMap memory;  // own and imported device memory (thread-safe on its own)
  std::map<uint64_t, DeviceAllocation> allocations;  // own, by base; guarded by mu
  uint64_t allocated_bytes = 0;  // sum of allocations' size (the capacity); guarded by mu
  uint64_t next_allocation = 0;  // guarded by mu
  std::map<uint64_t, ImportedMapping> imports;  // by base in this process; guarded by mu
  std::unordered_set<void*> host_allocations;  // guarded by mu
  std::map<uintptr_t, size_t> host_registrations;  // cuMemHostRegister: base -> bytes; mu
  uint64_t registered_copies = 0;  // async copies whose host side was registered memory; mu
  std::unordered_set<EmuModule*> modules;      // guarded by mu
  std::unordered_set<EmuFunction*> functions;  // guarded by mu
  std::unordered_set<EmuStream*> streams;      // guarded by mu
  std::unordered_set<EmuEvent*> events;        // guarded by mu

  const int sm_;
  const uint64_t total_bytes_;
  const uint64_t max_warp_instructions_;
  const bool verbose_;
  const FaultPlan fault_;
  const CUuuid uuid_;
  // Allocation ids count up from here: random and mixed with the pid, so that a handle's
  // (pid, fd, id) cannot name a memfd of a later process that reuses the pid and fd number.
  const uint64_t first_allocation_id_;
  std::atomic<uint64_t> launches{0};
  std::atomic<bool> fault_tripped{false};  // the fault's launch happened
  std::unordered_set<CUstream> hung_streams;   // hang:N: never synchronize again; guarded by mu

  bool Initialized() {
    std::lock_guard<std::mutex> lock(mu);
    return initialized;
  }
};

EmulatedDriver& Driver() {
  static EmulatedDriver* driver =
      new EmulatedDriver();  // never destroyed: threads may outlive exit
  return *driver;
}

thread_local CUcontext current_context = nullptr;

// Every call past cuInit needs an initialized driver; most need a current context.
CUresult NeedInit() { return Driver().Initialized() ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED; }
// A query of device `dev` that writes through `out`: initialized, device 0 (the only one), `out`
// not null, checked in that order as the driver does.
CUresult NeedDevice(CUdevice dev, const void* out) {
  if (CUresult r = NeedInit(); r != CUDA_SUCCESS) return r;
  if (dev != 0) return CUDA_ERROR_INVALID_DEVICE;
  return out == nullptr ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}
CUresult NeedContext() {
  if (CUresult r = NeedInit(); r != CUDA_SUCCESS) return r;
  EmulatedDriver& d = Driver();
  if (d.fault_.kind == FaultPlan::Kind::kSticky && d.fault_tripped.load()) {
    return CUDA_ERROR_ILLEGAL_ADDRESS;  // sticky: the context is lost for good
  }
  return current_context == nullptr ? CUDA_ERROR_INVALID_CONTEXT : CUDA_SUCCESS;
}

bool ValidStream(CUstream stream) {
  if (stream == nullptr || stream == CU_STREAM_LEGACY || stream == CU_STREAM_PER_THREAD)
    return true;
  EmulatedDriver& d = Driver();
  std::lock_guard<std::mutex> lock(d.mu);
  return d.streams.count(reinterpret_cast<EmuStream*>(stream)) != 0;
}

// The device's attributes other than the compute capability (which follows sm_); 0 for the rest.
constexpr std::pair<CUdevice_attribute, int> kDeviceAttributes[] = {
    {CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 132},
    {CU_DEVICE_ATTRIBUTE_WARP_SIZE, 32},
    {CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK, 1024},
    {CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X, 1024},
    {CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y, 1024},
    {CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z, 64},
    {CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X, 2147483647},
    {CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y, 65535},
    {CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z, 65535},
    {CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK, 49152},
    {CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, 232448},
    {CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR, 233472},
    {CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY, 65536},
    {CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK, 65536},
    {CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR, 65536},
    {CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, 2048},
    {CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR, 32},
    {CU_DEVICE_ATTRIBUTE_CLOCK_RATE, 1980000},
    {CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE, 2619000},
    {CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH, 6144},
    {CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, 50 << 20},
    {CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, 1},
    {CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS, 1},
    {CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT, 2},
    {CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY, 1},
    {CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, 1},
    {CU_DEVICE_ATTRIBUTE_COMPUTE_MODE, CU_COMPUTEMODE_DEFAULT},
};

// One of cuModuleLoadDataEx's logs: the caller's buffer and its size (in: capacity, out: bytes
// written with the NUL); either null when the caller did not pass it.
struct JitLog {
  char* buffer = nullptr;
  size_t* size_inout = nullptr;
};

// The log whose buffer and size the caller passed as `buffer_option` and `size_option` among
// the `n` options; the size is passed in the value slot itself, as the driver takes it.
JitLog FindJitLog(unsigned int n, const CUjit_option* options, void** values,
                  CUjit_option buffer_option, CUjit_option size_option) {
  JitLog log;
  for (unsigned int i = 0; i < n; ++i) {
    if (options[i] == buffer_option) log.buffer = static_cast<char*>(values[i]);
    if (options[i] == size_option) log.size_inout = reinterpret_cast<size_t*>(&values[i]);
  }
  return log;
}

void WriteLog(const std::string& text, const JitLog& log) {
  if (log.buffer == nullptr || log.size_inout == nullptr || *log.size_inout == 0) return;
  const size_t n = std::min(text.size(), *log.size_inout - 1);
  std::memcpy(log.buffer, text.data(), n);
  log.buffer[n] = '\0';
  *log.size_inout = n + 1;
}

CUresult CheckDeviceRange(CUdeviceptr ptr, size_t bytes) {
  if (bytes == 0) return CUDA_SUCCESS;
  return Driver().memory.Contains(ptr, bytes) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult Allocate(CUdeviceptr* dptr, size_t bytes) {
  if (CUresult r = NeedContext(); r != CUDA_SUCCESS) return r;
  if (dptr == nullptr || bytes == 0) return CUDA_ERROR_INVALID_VALUE;
  EmulatedDriver& d = Driver();
  DeviceAllocation a;
  a.size = (bytes + 255) / 256 * 256;
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  a.mapped = (a.size + page - 1) / page * page;
  {
    std::lock_guard<std::mutex> lock(d.mu);
    if (d.allocated_bytes + a.size > d.total_bytes_) return CUDA_ERROR_OUT_OF_MEMORY;
    d.allocated_bytes += a.size;  // reserved now, so concurrent allocations respect the capacity
    a.id = d.first_allocation_id_ + d.next_allocation++;
  }
  const std::string name = absl::StrCat("normgrad-emu-", a.id);
  a.fd = memfd_create(name.c_str(), MFD_CLOEXEC);
  void* p = MAP_FAILED;
  if (a.fd >= 0 && ftruncate(a.fd, static_cast<off_t>(a.mapped)) == 0) {
    p = mmap(nullptr, a.mapped, PROT_READ | PROT_WRITE, MAP_SHARED, a.fd, 0);
  }
  if (p == MAP_FAILED) {
    if (a.fd >= 0) close(a.fd);
    std::lock_guard<std::mutex> lock(d.mu);
    d.allocated_bytes -= a.size;
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  const uint64_t base = reinterpret_cast<uint64_t>(p);  // page-aligned, so 256-byte aligned
  {
    std::lock_guard<std::mutex> lock(d.mu);
    d.allocations.emplace(base, a);
  }
  d.memory.Add(base, a.size);
  *dptr = static_cast<CUdeviceptr>(base);
  return CUDA_SUCCESS;
}

CUresult Release(CUdeviceptr dptr) {
  if (CUresult r = NeedContext(); r != CUDA_SUCCESS) return r;
  if (dptr == 0) return CUDA_SUCCESS;
  EmulatedDriver& d = Driver();
  DeviceAllocation a;
  {
    std::lock_guard<std::mutex> lock(d.mu);
    auto it = d.allocations.find(dptr);
    if (it == d.allocations.end()) return CUDA_ERROR_INVALID_VALUE;  // imported ones included
    a = it->second;
    d.allocations.erase(it);
    d.allocated_bytes -= a.size;
    d.memory.Remove(dptr);
  }
  munmap(reinterpret_cast<void*>(dptr), a.mapped);
  close(a.fd);  // an importer's mapping keeps the pages; new opens of the handle now fail
  return CUDA_SUCCESS;
}

// cuIpcGetMemHandle's 64 bytes (CU_IPC_HANDLE_SIZE); only this file reads them.
struct IpcHandle {
  uint32_t magic = 0;
  int32_t pid = 0;
  int32_t fd = -1;
  uint32_t reserved = 0;
  uint64_t id = 0;
  uint64_t size = 0;
  char uuid[16] = {};
  char padding[16] = {};
};
static_assert(sizeof(IpcHandle) == CU_IPC_HANDLE_SIZE);
constexpr uint32_t kIpcMagic = 0x4e474950;  // "NGIP"

// Hands `object` out as a handle: it is registered in `live` (one of the driver's sets, under its
// mutex) until Unregister.
template <typename T, typename Handle>
CUresult Register(std::unordered_set<T*>& live, T* object, Handle* handle) {
  EmulatedDriver& d = Driver();
  std::lock_guard<std::mutex> lock(d.mu);
  live.insert(object);
  *handle = reinterpret_cast<Handle>(object);
  return CUDA_SUCCESS;
}

// Takes `handle` out of `live` and deletes it, after `before_delete` (which runs under the
// driver's mutex); CUDA_ERROR_INVALID_HANDLE when it is not a live handle. Needs a context.
template <typename T, typename Handle, typename BeforeDelete>
CUresult Unregister(std::unordered_set<T*>& live, Handle handle, BeforeDelete before_delete) {
  if (CUresult r = NeedContext(); r != CUDA_SUCCESS) return r;
  EmulatedDriver& d = Driver();
  T* object = reinterpret_cast<T*>(handle);
  std::lock_guard<std::mutex> lock(d.mu);
  if (live.erase(object) == 0) return CUDA_ERROR_INVALID_HANDLE;
  before_delete(*object);
  delete object;
  return CUDA_SUCCESS;
}
template <typename T, typename Handle>
CUresult Unregister(std::unordered_set<T*>& live, Handle handle) {
  return Unregister(live, handle, [](T&) {});
}

// A copy or fill on `stream` of `count` elements of `element_bytes` at device address `device`:
// the context, the stream, nothing to do for 0 elements, `arguments_ok` (the host pointer or
// the alignment), the device range, in that order; then `work` runs (streams are synchronous).
template <typename Work>
CUresult StreamTransfer(CUstream stream, CUdeviceptr device, size_t count, size_t element_bytes,
                        bool arguments_ok, Work work) {
  if (CUresult r = NeedContext(); r != CUDA_SUCCESS) return r;
  if (!ValidStream(stream)) return CUDA_ERROR_INVALID_HANDLE;
  if (count == 0) return CUDA_SUCCESS;
  if (!arguments_ok) return CUDA_ERROR_INVALID_VALUE;
  if (CUresult r = CheckDeviceRange(device, count * element_bytes); r != CUDA_SUCCESS) return r;
  work();
  return CUDA_SUCCESS;
}

CUresult LaunchFailure(Finding finding) {
  switch (finding) {
    case Finding::kOutOfBounds:
      return CUDA_ERROR_ILLEGAL_ADDRESS;
    case Finding::kMisaligned:
      return CUDA_ERROR_MISALIGNED_ADDRESS;
    case Finding::kInstructionLimit:
      return CUDA_ERROR_LAUNCH_TIMEOUT;
    case Finding::kInvalidLaunch:
      return CUDA_ERROR_INVALID_VALUE;
    default:
      return CUDA_ERROR_LAUNCH_FAILED;
  }
}

}  // namespace
}  // namespace normgrad::ptxsim

using normgrad::ptxsim::current_context;
using normgrad::ptxsim::Driver;
using normgrad::ptxsim::EmuEvent;
using normgrad::ptxsim::EmuFunction;
using normgrad::ptxsim::EmulatedDriver;
using normgrad::ptxsim::EmuModule;
using normgrad::ptxsim::EmuStream;
using normgrad::ptxsim::FindJitLog;
using normgrad::ptxsim::JitLog;
using normgrad::ptxsim::NeedContext;
using normgrad::ptxsim::NeedDevice;
using normgrad::ptxsim::NeedInit;
using normgrad::ptxsim::WriteLog;

NG_EXPORT CUresult CUDAAPI cuGetErrorName(CUresult error, const char** pStr) {
  return normgrad::testing::DescribeCudaResult(error, false, pStr);
}

NG_EXPORT CUresult CUDAAPI cuGetErrorString(CUresult error, const char** pStr) {
  return normgrad::testing::DescribeCudaResult(error, true, pStr);
}

NG_EXPORT CUresult CUDAAPI cuInit(unsigned int Flags) {
  if (Flags != 0) return CUDA_ERROR_INVALID_VALUE;
  EmulatedDriver& d = Driver();
  std::lock_guard<std::mutex> lock(d.mu);
  d.initialized = true;
  return CUDA_SUCCESS;
}

NG_EXPORT CUresult CUDAAPI cuDriverGetVersion(int* driverVersion) {
  if (driverVersion == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *driverVersion = normgrad::ptxsim::kDriverVersion;
  return CUDA_SUCCESS;
}

NG_EXPORT CUresult CUDAAPI cuDeviceGetCount(int* count) {
  if (CUresult r = NeedInit(); r != CUDA_SUCCESS) return r;
  if (count == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *count = 1;
  return CUDA_SUCCESS;
}

NG_EXPORT CUresult CUDAAPI cuDeviceGet(CUdevice* device, int ordinal) {
  if (CUresult r = NeedInit(); r != CUDA_SUCCESS) return r;
  if (device == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
  *device = 0;
  return CUDA_SUCCESS;
}

NG_EXPORT CUresult CUDAAPI cuDeviceGetName(char* name, int len, CUdevice dev) {
  if (CUresult r = NeedDevice(dev, name); r != CUDA_SUCCESS) return r;
  if (len <= 0) return CUDA_ERROR_INVALID_VALUE;
  std::snprintf(name, static_cast<size_t>(len), "%s", normgrad::ptxsim::kDeviceName);
  return CUDA_SUCCESS;
}

NG_EXPORT CUresult CUDAAPI cuDeviceTotalMem(size_t* bytes, CUdevice dev) {
  if (CUresult r = NeedDevice(dev, bytes); r != CUDA_SUCCESS) return r;
  *bytes = Driver().total_bytes_;
  return CUDA_SUCCESS;
}

NG_EXPORT CUresult CUDAAPI cuDeviceGetAttribute(int* pi, CUdevice_attribute attrib, CUdevice dev) {
  if (CUresult r = NeedDevice(dev, pi); r != CUDA_SUCCESS) return r;
  if (attrib <= 0 || attrib >= CU_DEVICE_ATTRIBUTE_MAX) return CUDA_ERROR_INVALID_VALUE;
  const int sm = Driver().sm_;
  if (attrib == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR) {
    *pi = sm / 10;
  } else if (attrib == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR) {
    *pi = sm % 10;
  } else {
    *pi = 0;
    for (const auto& [a, value] : normgrad::ptxsim::kDeviceAttributes) {
      if (a == attrib) *pi = value;
    }
  }
  return CUDA_SUCCESS;
}

NG_EXPORT CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext* pctx, CUdevice dev) {
  if (CUresult r = NeedDevice(dev, pctx); r != CUDA_SUCCESS) return r;
  EmulatedDriver& d = Driver();
  std::lock_guard<std::mutex> lock(d.mu);
  ++d.primary_refs;
  *pctx = reinterpret_cast<CUcontext>(&d.primary);
  return CUDA_SUCCESS;
}

NG_EXPORT CUresult CUDAAPI cuDevicePrimaryCtxRelease(CUdevice dev) {
  if (CUresult r = NeedInit(); r != CUDA_SUCCESS) return r;
  if (dev != 0) return CUDA_ERROR_INVALID_DEVICE;
  EmulatedDriver& d = Driver();
  std::lock_guard<std::mutex> lock(d.mu);
  if (d.primary_refs == 0) return CUDA_ERROR_INVALID_CONTEXT;
  --d.primary_refs;
  return CUDA_SUCCESS;
}

NG_EXPORT CUresult CUDAAPI cuCtxSetCurrent(CUcontext ctx) {
  if (CUresult r = NeedInit(); r != CUDA_SUCCESS) return r;
  if (ctx != nullptr && ctx != reinterpret_cast<CUcontext>(&Driver().primary)) {
    return CUDA_ERROR_INVALID_CONTEXT;
  }
  current_context = ctx;
  return CUDA_SUCCESS;
}

NG_EXPORT CUresult CUDAAPI cuCtxGetCurrent(CUcontext* pctx) {
  if (CUresult r = NeedInit(); r != CUDA_SUCCESS) return r;
  if (pctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *pctx = current_context;
  return CUDA_SUCCESS;
}

NG_EXPORT CUresult CUDAAPI cuModuleLoadDataEx(CUmodule* module, const void* image,
                                              unsigned int numOptions, CUjit_option* options,
                                              void** optionValues) {
  if (CUresult r = NeedContext(); r != CUDA_SUCCESS) return r;
  if (module == nullptr || image == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (numOptions > 0 && (options == nullptr || optionValues == nullptr))
    return CUDA_ERROR_INVALID_VALUE;
  // The other options (optimization level, targets, ...): nothing to tune in an interpreter.
  const JitLog error_log = FindJitLog(numOptions, options, optionValues, CU_JIT_ERROR_LOG_BUFFER,
                                      CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES);
  const JitLog info_log = FindJitLog(numOptions, options, optionValues, CU_JIT_INFO_LOG_BUFFER,
                                     CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES);
  const unsigned char* bytes = static_cast<const unsigned char*>(image);
  const uint32_t magic = static_cast<uint32_t>(bytes[0]) | (static_cast<uint32_t>(bytes[1]) << 8) |
                         (static_cast<uint32_t>(bytes[2]) << 16) |
                         (static_cast<uint32_t>(bytes[3]) << 24);
  if (std::memcmp(bytes,
                  "\x7f"
                  "ELF",
                  4) == 0 ||
      magic == 0xba55ed50u || magic == 0x466243b1u) {
    WriteLog("the emulated device executes PTX text only (no cubin/fatbin)", error_log);
    return CUDA_ERROR_NO_BINARY_FOR_GPU;
  }
  const char* text = static_cast<const char*>(image);
  absl::StatusOr<normgrad::ptxsim::Module> parsed = normgrad::ptxsim::ParsePtx(text);
  if (!parsed.ok()) {
    WriteLog(absl::StrCat("ptxsim: ", parsed.status().message()), error_log);
    return CUDA_ERROR_INVALID_PTX;
  }
  EmulatedDriver& d = Driver();
  if (parsed->version_major > normgrad::ptxsim::kMaxPtxMajor ||
      (parsed->version_major == normgrad::ptxsim::kMaxPtxMajor &&
       parsed->version_minor > normgrad::ptxsim::kMaxPtxMinor)) {
    WriteLog(absl::StrCat("ptxsim: PTX ISA ", parsed->version_major, ".", parsed->version_minor,
                          " is newer than this driver supports (", normgrad::ptxsim::kMaxPtxMajor,
                          ".", normgrad::ptxsim::kMaxPtxMinor, ")"),
             error_log);
    return CUDA_ERROR_UNSUPPORTED_PTX_VERSION;
  }
  if (parsed->target_sm > d.sm_) {
    WriteLog(absl::StrCat("ptxsim: SM version specified by .target (sm_", parsed->target_sm,
                          ") is higher than the device's (sm_", d.sm_, ")"),
             error_log);
    return CUDA_ERROR_INVALID_PTX;
  }
  WriteLog("", info_log);
  WriteLog("", error_log);
  EmuModule* m = new EmuModule();
  m->module = *std::move(parsed);
  return normgrad::ptxsim::Register(d.modules, m, module);
}

NG_EXPORT CUresult CUDAAPI cuModuleUnload(CUmodule hmod) {
  EmulatedDriver& d = Driver();
  return normgrad::ptxsim::Unregister(d.modules, hmod, [&d](EmuModule& m) {
    for (auto& [name, f] : m.functions) d.functions.erase(f.get());
  });
}

NG_EXPORT CUresult CUDAAPI cuModuleGetFunction(CUfunction* hfunc, CUmodule hmod, const char* name) {
  if (CUresult r = NeedContext(); r != CUDA_SUCCESS) return r;
  if (hfunc == nullptr || name == nullptr) return CUDA_ERROR_INVALID_VALUE;
  EmulatedDriver& d = Driver();
  EmuModule* m = reinterpret_cast<EmuModule*>(hmod);
  std::lock_guard<std::mutex> lock(d.mu);
  if (d.modules.count(m) == 0) return CUDA_ERROR_INVALID_HANDLE;
  auto it = m->functions.find(name);
  if (it == m->functions.end()) {
    const normgrad::ptxsim::Entry* entry = m->module.FindEntry(name);
    if (entry == nullptr) return CUDA_ERROR_NOT_FOUND;
    auto f = std::make_unique<EmuFunction>();
    f->module = m;
    f->entry = entry;
    d.functions.insert(f.get());
    it = m->functions.emplace(name, std::move(f)).first;
  }
  *hfunc = reinterpret_cast<CUfunction>(it->second.get());
  return CUDA_SUCCESS;
}

NG_EXPORT CUresult CUDAAPI cuLaunchKernel(CUfunction f, unsigned int gridDimX,
                                          unsigned int gridDimY, unsigned int gridDimZ,
                                          unsigned int blockDimX, unsigned int blockDimY,
                                          unsigned int blockDimZ, unsigned int sharedMemBytes,
                                          CUstream hStream, void** kernelParams, void** extra) {
  if (CUresult r = NeedContext(); r != CUDA_SUCCESS) return r;
  if (!normgrad::ptxsim::ValidStream(hStream)) return CUDA_ERROR_INVALID_HANDLE;
  EmulatedDriver& d = Driver();
  const normgrad::ptxsim::Entry* entry = nullptr;
  {
    std::lock_guard<std::mutex> lock(d.mu);
    EmuFunction* fn = reinterpret_cast<EmuFunction*>(f);
    if (d.functions.count(fn) == 0) return CUDA_ERROR_INVALID_HANDLE;
    entry = fn->entry;
  }
  if (extra != nullptr) return CUDA_ERROR_NOT_SUPPORTED;  // kernelParams only
  if (!entry->params.empty() && kernelParams == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (sharedMemBytes > 49152) return CUDA_ERROR_INVALID_VALUE;  // no opt-in attribute here
  const normgrad::ptxsim::FaultPlan& fault = d.fault_;
  if (fault.kind != normgrad::ptxsim::FaultPlan::Kind::kNone && ++d.launches == fault.at_launch) {
    d.fault_tripped.store(true);
    std::fprintf(stderr, "[emulated cuda] injected fault at launch %llu of %s (%s)\n",
                 static_cast<unsigned long long>(fault.at_launch), entry->name.c_str(),
                 std::getenv("NORMGRAD_EMULATED_CUDA_FAULT"));
    if (fault.kind == normgrad::ptxsim::FaultPlan::Kind::kSticky) {
      return CUDA_ERROR_ILLEGAL_ADDRESS;
    }
    if (fault.kind == normgrad::ptxsim::FaultPlan::Kind::kHang) {
      std::lock_guard<std::mutex> lock(d.mu);
      d.hung_streams.insert(hStream);
    }
  }
  normgrad::ptxsim::LaunchConfig config;
  config.grid = {gridDimX, gridDimY, gridDimZ};
  config.block = {blockDimX, blockDimY, blockDimZ};
  config.dynamic_shared_bytes = sharedMemBytes;
  config.max_warp_instructions = d.max_warp_instructions_;
  normgrad::ptxsim::LaunchReport report;
  const auto start = std::chrono::steady_clock::now();
  absl::Status status = normgrad::ptxsim::Launch(*entry, config, kernelParams, d.memory, &report);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (d.verbose_) {
    std::fprintf(stderr,
                 "[emulated cuda] %s grid (%u,%u,%u) block (%u,%u,%u): %llu warp-instr, %llu "
                 "thread-instr, %.3f ms, %.1f M thread-instr/s\n",
                 entry->name.c_str(), gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ,
                 static_cast<unsigned long long>(report.warp_instructions),
                 static_cast<unsigned long long>(report.thread_instructions), seconds * 1e3,
                 seconds > 0 ? report.thread_instructions / seconds / 1e6 : 0.0);
  }
  if (!status.ok()) {
    std::fprintf(stderr, "[emulated cuda] launch of %s failed: %s\n", entry->name.c_str(),
                 std::string(status.message()).c_str());
    return normgrad::ptxsim::LaunchFailure(report.finding);
  }
  return CUDA_SUCCESS;
}

NG_EXPORT CUresult CUDAAPI cuMemAlloc(CUdeviceptr* dptr, size_t bytesize) {
  return normgrad::ptxsim::Allocate(dptr, bytesize);
}

NG_EXPORT CUresult CUDAAPI cuMemFree(CUdeviceptr dptr) { return normgrad::ptxsim::Release(dptr); }

NG_EXPORT CUresult CUDAAPI cuMemAllocAsync(CUdeviceptr* dptr, size_t bytesize, CUstream hStream) {
  if (!normgrad::ptxsim::ValidStream(hStream)) return CUDA_ERROR_INVALID_HANDLE;
  return normgrad::ptxsim::Allocate(dptr, bytesize);
}

NG_EXPORT CUresult CUDAAPI cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) {
  if (!normgrad::ptxsim::ValidStream(hStream)) return CUDA_ERROR_INVALID_HANDLE;
  return normgrad::ptxsim::Release(dptr);
}

NG_EXPORT CUresult CUDAAPI cuDeviceGetDefaultMemPool(CUmemoryPool* pool_out, CUdevice dev) {
  if (CUresult r = NeedDevice(dev, pool_out); r != CUDA_SUCCESS) return r;
  *pool_out = reinterpret_cast<CUmemoryPool>(&Driver().pool);
  return CUDA_SUCCESS;
}

NG_EXPORT CUresult CUDAAPI cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr,
                                                 void* value) {
  if (CUresult r = NeedInit(); r != CUDA_SUCCESS) return r;
  if (pool != reinterpret_cast<CUmemoryPool>(&Driver().pool)) return CUDA_ERROR_INVALID_HANDLE;
  if (value == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (attr == CU_MEMPOOL_ATTR_RELEASE_THRESHOLD) {
    std::memcpy(&Driver().pool.release_threshold, value, sizeof(uint64_t));
  }
  return CUDA_SUCCESS;
}

NG_EXPORT CUresult CUDAAPI cuMemHostAlloc(void** pp, size_t bytesize, unsigned int Flags) {
  if (CUresult r = NeedContext(); r != CUDA_SUCCESS) return r;
  if (pp == nullptr || bytesize == 0) return CUDA_ERROR_INVALID_VALUE;
  void* p = std::aligned_alloc(4096, (bytesize + 4095) / 4096 * 4096);
  if (p == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
  EmulatedDriver& d = Driver();
  std::lock_guard<std::mutex> lock(d.mu);
  d.host_allocations.insert(p);
  *pp = p;
  return CUDA_SUCCESS;
}

NG_EXPORT CUresult CUDAAPI cuMemFreeHost(void* p) {
  if (CUresult r = NeedContext(); r != CUDA_SUCCESS) return r;
  EmulatedDriver& d = Driver();
  {
    std::lock_guard<std::mutex> lock(d.mu);
    if (d.host_allocations.erase(p) == 0) return CUDA_ERROR_INVALID_VALUE;
  }
  std::free(p);
  return CUDA_SUCCESS;
}

namespace {

// Counts an async copy whose host range lies in memory registered with cuMemHostRegister (what a
// test asks through normgrad_emulated_registered_copies).
void CountRegisteredCopy(const void* host, size_t bytes) {
  EmulatedDriver& d = Driver();
  const auto a = reinterpret_cast<uintptr_t>(host);
  std::lock_guard<std::mutex> lock(d.mu);
  auto it = d.host_registrations.upper_bound(a);
  if (it == d.host_registrations.begin()) return;
  --it;
  if (a - it->first <= it->second && bytes <= it->second - (a - it->first)) ++d.registered_copies;
}

}  // namespace

NG_EXPORT CUresult CUDAAPI cuMemHostRegister(void* p, size_t bytesize, unsigned int Flags) {
  if (CUresult r = NeedContext(); r != CUDA_SUCCESS) return r;
  if (p == nullptr || bytesize == 0 || (Flags & ~0x0Fu) != 0) return CUDA_ERROR_INVALID_VALUE;
  EmulatedDriver& d = Driver();
  std::lock_guard<std::mutex> lock(d.mu);
  const auto a = reinterpret_cast<uintptr_t>(p);
  auto next = d.host_registrations.lower_bound(a);
  if (next != d.host_registrations.end() && next->first < a + bytesize) {
    return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
  }
  if (next != d.host_registrations.begin() && std::prev(next)->first + std::prev(next)->second > a) {
    return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
  }
  d.host_registrations[a] = bytesize;
  return CUDA_SUCCESS;
}

NG_EXPORT CUresult CUDAAPI cuMemHostUnregister(void* p) {
  if (CUresult r = NeedContext(); r != CUDA_SUCCESS) return r;
  EmulatedDriver& d = Driver();
  std::lock_guard<std::mutex> lock(d.mu);
  if (d.host_registrations.erase(reinterpret_cast<uintptr_t>(p)) == 0) {
    return CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
  }
  return CUDA_SUCCESS;
}

// Not a driver function: for tests that check copies went straight from registered memory.
NG_EXPORT uint64_t normgrad_emulated_registered_copies() {
  EmulatedDriver& d = Driver();
  std::lock_guard<std::mutex> lock(d.mu);
  return d.registered_copies;
}

NG_EXPORT CUresult CUDAAPI cuMemcpyHtoDAsync(CUdeviceptr dstDevice, const void* srcHost,
                                             size_t ByteCount, CUstream hStream) {
  CountRegisteredCopy(srcHost, ByteCount);
  return normgrad::ptxsim::StreamTransfer(
      hStream, dstDevice, ByteCount, 1, srcHost != nullptr,
      [&] { std::memcpy(reinterpret_cast<void*>(dstDevice), srcHost, ByteCount); });
}

NG_EXPORT CUresult CUDAAPI cuMemcpyDtoHAsync(void* dstHost, CUdeviceptr srcDevice, size_t ByteCount,
                                             CUstream hStream) {
  CountRegisteredCopy(dstHost, ByteCount);
  const EmulatedDriver& d = Driver();
  const bool corrupt = d.fault_.kind == normgrad::ptxsim::FaultPlan::Kind::kCorrupt &&
                       d.fault_tripped.load();
  return normgrad::ptxsim::StreamTransfer(
      hStream, srcDevice, ByteCount, 1, dstHost != nullptr, [&] {
        std::memcpy(dstHost, reinterpret_cast<const void*>(srcDevice), ByteCount);
        // corrupt:N: the sign bit of the first f32 (little-endian: its fourth byte).
        if (corrupt) static_cast<unsigned char*>(dstHost)[std::min<size_t>(3, ByteCount - 1)] ^= 0x80;
      });
}

NG_EXPORT CUresult CUDAAPI cuMemsetD8Async(CUdeviceptr dstDevice, unsigned char uc, size_t N,
                                           CUstream hStream) {
  return normgrad::ptxsim::StreamTransfer(hStream, dstDevice, N, 1, true, [&] {
    std::memset(reinterpret_cast<void*>(dstDevice), uc, N);
  });
}

NG_EXPORT CUresult CUDAAPI cuMemsetD32Async(CUdeviceptr dstDevice, unsigned int ui, size_t N,
                                            CUstream hStream) {
  return normgrad::ptxsim::StreamTransfer(hStream, dstDevice, N, 4, dstDevice % 4 == 0, [&] {
    uint32_t* p = reinterpret_cast<uint32_t*>(dstDevice);
    for (size_t i = 0; i < N; ++i) p[i] = ui;
  });
}

NG_EXPORT CUresult CUDAAPI cuStreamCreate(CUstream* phStream, unsigned int Flags) {
  if (CUresult r = NeedContext(); r != CUDA_SUCCESS) return r;
  if (phStream == nullptr || (Flags & ~CU_STREAM_NON_BLOCKING) != 0)
    return CUDA_ERROR_INVALID_VALUE;
  return normgrad::ptxsim::Register(Driver().streams, new EmuStream{Flags}, phStream);
}

NG_EXPORT CUresult CUDAAPI cuStreamDestroy(CUstream hStream) {
  return normgrad::ptxsim::Unregister(Driver().streams, hStream);
}

NG_EXPORT CUresult CUDAAPI cuStreamSynchronize(CUstream hStream) {
  if (CUresult r = NeedContext(); r != CUDA_SUCCESS) return r;
  if (!normgrad::ptxsim::ValidStream(hStream)) return CUDA_ERROR_INVALID_HANDLE;
  EmulatedDriver& d = Driver();
  bool hung = false;
  {
    std::lock_guard<std::mutex> lock(d.mu);
    hung = d.hung_streams.count(hStream) != 0;
  }
  if (hung) {
    // hang:N: the work never completes, and nothing can interrupt the wait (as on a hung GPU).
    std::fprintf(stderr, "[emulated cuda] cuStreamSynchronize on a hung stream: never returns\n");
    for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
  }
  return CUDA_SUCCESS;
}

NG_EXPORT CUresult CUDAAPI cuEventCreate(CUevent* phEvent, unsigned int Flags) {
  if (CUresult r = NeedContext(); r != CUDA_SUCCESS) return r;
  if (phEvent == nullptr) return CUDA_ERROR_INVALID_VALUE;
  EmuEvent* e = new EmuEvent();
  e->flags = Flags;
  return normgrad::ptxsim::Register(Driver().events, e, phEvent);
}

NG_EXPORT CUresult CUDAAPI cuEventRecord(CUevent hEvent, CUstream hStream) {
  if (CUresult r = NeedContext(); r != CUDA_SUCCESS) return r;
  if (!normgrad::ptxsim::ValidStream(hStream)) return CUDA_ERROR_INVALID_HANDLE;
  EmulatedDriver& d = Driver();
  std::lock_guard<std::mutex> lock(d.mu);
  EmuEvent* e = reinterpret_cast<EmuEvent*>(hEvent);
  if (d.events.count(e) == 0) return CUDA_ERROR_INVALID_HANDLE;
  e->recorded = true;
  e->time = std::chrono::steady_clock::now();
  return CUDA_SUCCESS;
}

NG_EXPORT CUresult CUDAAPI cuEventSynchronize(CUevent hEvent) {
  if (CUresult r = NeedContext(); r != CUDA_SUCCESS) return r;
  EmulatedDriver& d = Driver();
  std::lock_guard<std::mutex> lock(d.mu);
  return d.events.count(reinterpret_cast<EmuEvent*>(hEvent)) ? CUDA_SUCCESS
                                                             : CUDA_ERROR_INVALID_HANDLE;
}

NG_EXPORT CUresult CUDAAPI cuEventElapsedTime_v2(float* pMilliseconds, CUevent hStart,
                                                 CUevent hEnd) {
  if (CUresult r = NeedContext(); r != CUDA_SUCCESS) return r;
  if (pMilliseconds == nullptr) return CUDA_ERROR_INVALID_VALUE;
  EmulatedDriver& d = Driver();
  std::lock_guard<std::mutex> lock(d.mu);
  EmuEvent* a = reinterpret_cast<EmuEvent*>(hStart);
  EmuEvent* b = reinterpret_cast<EmuEvent*>(hEnd);
  if (d.events.count(a) == 0 || d.events.count(b) == 0) return CUDA_ERROR_INVALID_HANDLE;
  if ((a->flags | b->flags) & CU_EVENT_DISABLE_TIMING) return CUDA_ERROR_INVALID_HANDLE;
  if (!a->recorded || !b->recorded) return CUDA_ERROR_INVALID_HANDLE;
  *pMilliseconds = std::chrono::duration<float, std::milli>(b->time - a->time).count();
  return CUDA_SUCCESS;
}

NG_EXPORT CUresult CUDAAPI cuEventElapsedTime(float* pMilliseconds, CUevent hStart, CUevent hEnd) {
  return cuEventElapsedTime_v2(pMilliseconds, hStart, hEnd);
}

NG_EXPORT CUresult CUDAAPI cuEventDestroy(CUevent hEvent) {
  return normgrad::ptxsim::Unregister(Driver().events, hEvent);
}

NG_EXPORT CUresult CUDAAPI cuMemGetInfo(size_t* free, size_t* total) {
  if (CUresult r = NeedContext(); r != CUDA_SUCCESS) return r;
  if (free == nullptr || total == nullptr) return CUDA_ERROR_INVALID_VALUE;
  EmulatedDriver& d = Driver();
  *total = d.total_bytes_;
  std::lock_guard<std::mutex> lock(d.mu);
  *free = d.total_bytes_ - std::min<uint64_t>(d.total_bytes_, d.allocated_bytes);
  return CUDA_SUCCESS;
}

NG_EXPORT CUresult CUDAAPI cuDeviceGetUuid_v2(CUuuid* uuid, CUdevice dev) {
  if (CUresult r = NeedDevice(dev, uuid); r != CUDA_SUCCESS) return r;
  *uuid = Driver().uuid_;
  return CUDA_SUCCESS;
}

NG_EXPORT CUresult CUDAAPI cuDeviceGetUuid(CUuuid* uuid, CUdevice dev) {
  return cuDeviceGetUuid_v2(uuid, dev);
}

NG_EXPORT CUresult CUDAAPI cuMemGetAddressRange_v2(CUdeviceptr* pbase, size_t* psize,
                                                   CUdeviceptr dptr) {
  if (CUresult r = NeedContext(); r != CUDA_SUCCESS) return r;
  const normgrad::ptxsim::MemoryRange range = Driver().memory.Find(dptr);
  if (range.size == 0) return CUDA_ERROR_NOT_FOUND;
  if (pbase != nullptr) *pbase = static_cast<CUdeviceptr>(range.base);
  if (psize != nullptr) *psize = static_cast<size_t>(range.size);
  return CUDA_SUCCESS;
}

NG_EXPORT CUresult CUDAAPI cuIpcGetMemHandle(CUipcMemHandle* pHandle, CUdeviceptr dptr) {
  if (CUresult r = NeedContext(); r != CUDA_SUCCESS) return r;
  if (pHandle == nullptr) return CUDA_ERROR_INVALID_VALUE;
  EmulatedDriver& d = Driver();
  normgrad::ptxsim::IpcHandle h;
  {
    std::lock_guard<std::mutex> lock(d.mu);
    auto it = d.allocations.find(dptr);  // the base of an own allocation, as the driver wants
    if (it == d.allocations.end()) return CUDA_ERROR_INVALID_VALUE;
    h.fd = it->second.fd;
    h.id = it->second.id;
    h.size = it->second.size;
  }
  h.magic = normgrad::ptxsim::kIpcMagic;
  h.pid = static_cast<int32_t>(getpid());
  std::memcpy(h.uuid, d.uuid_.bytes, sizeof(h.uuid));
  std::memset(pHandle, 0, sizeof(*pHandle));
  std::memcpy(pHandle->reserved, &h, sizeof(h));
  return CUDA_SUCCESS;
}

namespace {

// Opens the memfd `h` names in its exporter and checks it is still that allocation's (not freed,
// not a later file under the same fd number); -1 when it is not.
int OpenExportedMemfd(const normgrad::ptxsim::IpcHandle& h, uint64_t mapped) {
  const std::string path = absl::StrCat("/proc/", h.pid, "/fd/", h.fd);
  const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return -1;
  // What we hold, not what the path names now: no race with the exporter closing the fd.
  char link[256];
  const std::string self = absl::StrCat("/proc/self/fd/", fd);
  const ssize_t n = readlink(self.c_str(), link, sizeof(link) - 1);
  const std::string expected = absl::StrCat("/memfd:normgrad-emu-", h.id);
  bool ok = n > 0;
  if (ok) {
    const std::string target(link, static_cast<size_t>(n));
    ok = target == expected || target == expected + " (deleted)";
  }
  struct stat st;
  ok = ok && fstat(fd, &st) == 0 && static_cast<uint64_t>(st.st_size) == mapped;
  if (!ok) {
    close(fd);
    return -1;
  }
  return fd;
}

}  // namespace

NG_EXPORT CUresult CUDAAPI cuIpcOpenMemHandle_v2(CUdeviceptr* pdptr, CUipcMemHandle handle,
                                                 unsigned int Flags) {
  if (CUresult r = NeedContext(); r != CUDA_SUCCESS) return r;
  if (pdptr == nullptr || Flags != CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  EmulatedDriver& d = Driver();
  normgrad::ptxsim::IpcHandle h;
  std::memcpy(&h, handle.reserved, sizeof(h));
  if (h.magic != normgrad::ptxsim::kIpcMagic || h.size == 0 || h.size % 256 != 0 || h.pid <= 0 ||
      h.fd < 0) {
    return CUDA_ERROR_INVALID_HANDLE;
  }
  if (std::memcmp(h.uuid, d.uuid_.bytes, sizeof(h.uuid)) != 0) return CUDA_ERROR_INVALID_DEVICE;
  if (h.pid == static_cast<int32_t>(getpid())) return CUDA_ERROR_INVALID_CONTEXT;
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t mapped = (h.size + page - 1) / page * page;
  // Held across the open and map, so two threads opening one handle map it once.
  std::lock_guard<std::mutex> lock(d.mu);
  for (auto& [base, m] : d.imports) {
    if (m.pid == h.pid && m.id == h.id) {
      ++m.refs;
      *pdptr = static_cast<CUdeviceptr>(base);
      return CUDA_SUCCESS;
    }
  }
  const int fd = OpenExportedMemfd(h, mapped);
  if (fd < 0) return CUDA_ERROR_INVALID_HANDLE;
  void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);  // the mapping keeps the pages
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  const uint64_t base = reinterpret_cast<uint64_t>(p);
  normgrad::ptxsim::ImportedMapping& m = d.imports[base];
  m.pid = h.pid;
  m.id = h.id;
  m.size = h.size;
  m.mapped = mapped;
  m.refs = 1;
  d.memory.Add(base, h.size);
  *pdptr = static_cast<CUdeviceptr>(base);
  return CUDA_SUCCESS;
}

NG_EXPORT CUresult CUDAAPI cuIpcCloseMemHandle(CUdeviceptr dptr) {
  if (CUresult r = NeedContext(); r != CUDA_SUCCESS) return r;
  EmulatedDriver& d = Driver();
  std::lock_guard<std::mutex> lock(d.mu);
  auto it = d.imports.find(dptr);
  if (it == d.imports.end()) return CUDA_ERROR_INVALID_VALUE;
  if (--it->second.refs > 0) return CUDA_SUCCESS;
  d.memory.Remove(dptr);
  munmap(reinterpret_cast<void*>(dptr), it->second.mapped);
  d.imports.erase(it);
  return CUDA_SUCCESS;
}
