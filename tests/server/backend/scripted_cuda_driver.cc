// A stand-in CUDA driver library for the CUDA backend's tests on machines without a GPU. It
// exports the symbols of nvidia/driver_api.h; "device" memory is host memory, and
// cuLaunchKernel runs a C++ model of the two backward kernels, chosen by the entry name found
// in the loaded PTX (its arguments read back with the kernels' own launch contract,
// kernels::UnpackArgs, from the parameter list the PTX declares). Behaviour is scripted by
// environment, read at every call:
//   NORMGRAD_SCRIPTED_CUDA=ok|init_fails|no_devices|jit_error|oom     (default ok)
//   NORMGRAD_SCRIPTED_CUDA_MAX_GRID_X=N                             (default 2147483647)
//   NORMGRAD_SCRIPTED_CUDA_STREAMS=deferred|immediate                (default immediate)
// "deferred": copies, memsets and launches issued on a stream are queued and run, in issue
// order, only when that stream is synchronized (or destroyed), as late as a GPU may run them: a
// host that reads a result before waiting for its stream reads stale bytes, and work that needs
// another stream's results without waiting for them runs without them. The most streams holding
// queued work at once is counted (normgrad_scripted_cuda_max_busy_streams).
// Work issued on a thread that has not made the context current fails with
// CUDA_ERROR_INVALID_CONTEXT, as a real driver does.
#include <cuda.h>
#undef cuEventElapsedTime  // export the unversioned name, as nvidia/driver_api.h looks up

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/backward_kernel.h"
#include "tests/common/cuda_error_text.h"

namespace {

std::string Mode() {
  const char* m = std::getenv("NORMGRAD_SCRIPTED_CUDA");
  return m != nullptr ? m : "ok";
}

// Live pinned and device bytes and streams, with the peaks since the last reset (the CUDA
// backend's staging pool is checked against them).
struct Allocations {
  std::mutex mu;
  std::map<uintptr_t, size_t> host, device;  // base -> bytes
  size_t host_bytes = 0, device_bytes = 0, peak_host = 0, peak_device = 0;
  int streams = 0;
  int busy_streams = 0, max_busy_streams = 0;  // streams with queued work (deferred mode)
};
Allocations& Live() {
  static Allocations* a = new Allocations;
  return *a;
}
// One field of Live(), read under its lock.
template <typename T>
T LiveField(T Allocations::*field) {
  std::lock_guard<std::mutex> lock(Live().mu);
  return Live().*field;
}
void Track(std::map<uintptr_t, size_t>& map, size_t& bytes, size_t& peak, void* p, size_t n) {
  std::lock_guard<std::mutex> lock(Live().mu);
  map[reinterpret_cast<uintptr_t>(p)] = n;
  bytes += n;
  peak = std::max(peak, bytes);
}
void Untrack(std::map<uintptr_t, size_t>& map, size_t& bytes, void* p) {
  std::lock_guard<std::mutex> lock(Live().mu);
  auto it = map.find(reinterpret_cast<uintptr_t>(p));
  if (it == map.end()) return;
  bytes -= it->second;
  map.erase(it);
}

int DummyContextStorage;
CUcontext const kContext = reinterpret_cast<CUcontext>(&DummyContextStorage);
thread_local CUcontext current = nullptr;

std::atomic<int> module_loads{0};
std::atomic<int> launches{0};
std::atomic<int> live_modules{0};

enum class Elem { kF32, kBF16, kF16 };

struct Module {
  std::string entry;
  Elem elem = Elem::kF32;  // x, dy, gamma, dx; guessed from the PTX's conversions
  std::vector<normgrad::kernels::KernelParam> params;  // as declared, in order
};

// Parses ".entry NAME(" and the ".param .TYPE NAME" lines that follow it.
Module Parse(const char* ptx) {
  Module m;
  const std::string text(ptx);
  // Every 16-bit kernel rounds its output with cvt.rn.bf16.f32 or cvt.rn.f16.f32.
  if (text.find("cvt.rn.bf16.f32") != std::string::npos) {
    m.elem = Elem::kBF16;
  } else if (text.find("cvt.rn.f16.f32") != std::string::npos) {
    m.elem = Elem::kF16;
  }
  size_t at = text.find(".entry ");
  if (at == std::string::npos) return m;
  at += 7;
  size_t end = text.find_first_of("( \n", at);
  m.entry = text.substr(at, end - at);
  size_t close = text.find(')', end);
  size_t p = text.find(".param ", end);
  while (p != std::string::npos && p < close) {
    p += 7;
    size_t type_end = text.find(' ', p);
    std::string type = text.substr(p + 1, type_end - p - 1);  // skip the '.'
    size_t name_start = type_end + 1;
    size_t name_end = text.find_first_of(",) \n", name_start);
    m.params.push_back({text.substr(name_start, name_end - name_start), type});
    p = text.find(".param ", name_end);
  }
  return m;
}

struct Function {
  Module* module;
};

bool NoContext() { return current != kContext; }

// A stream: the work queued on it in deferred mode.
struct Stream {
  std::vector<std::function<void()>> queued;  // guarded by Live().mu
};

bool Deferred() {
  const char* m = std::getenv("NORMGRAD_SCRIPTED_CUDA_STREAMS");
  return m != nullptr && std::string(m) == "deferred";
}

// Runs `op` now, or queues it on `stream` in deferred mode (the null stream runs it now).
void Issue(CUstream stream, std::function<void()> op) {
  if (stream == nullptr || !Deferred()) {
    op();
    return;
  }
  auto* s = reinterpret_cast<Stream*>(stream);
  std::lock_guard<std::mutex> lock(Live().mu);
  if (s->queued.empty()) {
    ++Live().busy_streams;
    Live().max_busy_streams = std::max(Live().max_busy_streams, Live().busy_streams);
  }
  s->queued.push_back(std::move(op));
}

// Runs what is queued on `stream`, in issue order.
void Drain(CUstream stream) {
  if (stream == nullptr) return;
  auto* s = reinterpret_cast<Stream*>(stream);
  std::vector<std::function<void()>> ops;
  {
    std::lock_guard<std::mutex> lock(Live().mu);
    ops.swap(s->queued);
    if (!ops.empty()) --Live().busy_streams;
  }
  for (auto& op : ops) op();
}

float F32FromBits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
uint32_t BitsFromF32(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return bits;
}

// Element i of a buffer of `elem`, as f32 (f16: normal numbers and zero, what the tests use).
float LoadElem(Elem elem, const void* base, uint64_t i) {
  if (elem == Elem::kF32) return static_cast<const float*>(base)[i];
  const uint16_t h = static_cast<const uint16_t*>(base)[i];
  if (elem == Elem::kBF16) return F32FromBits(uint32_t{h} << 16);
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  if (exp == 0) return F32FromBits(sign);
  return F32FromBits(sign | ((exp - 15 + 127) << 23) | ((h & 0x3ffu) << 13));
}

// Rounds to nearest even.
void StoreElem(Elem elem, void* base, uint64_t i, float v) {
  if (elem == Elem::kF32) {
    static_cast<float*>(base)[i] = v;
    return;
  }
  const uint32_t bits = BitsFromF32(v);
  uint16_t out;
  if (elem == Elem::kBF16) {
    out = static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
  } else {
    const uint32_t sign = (bits >> 16) & 0x8000u;
    const int32_t exp = static_cast<int32_t>((bits >> 23) & 0xffu) - 127 + 15;
    if (exp <= 0) {
      out = static_cast<uint16_t>(sign);
    } else {
      uint32_t half = (static_cast<uint32_t>(exp) << 10) | ((bits & 0x7fffffu) >> 13);
      const uint32_t rest = bits & 0x1fffu;
      if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;
      out = static_cast<uint16_t>(sign | half);
    }
  }
  static_cast<uint16_t*>(base)[i] = out;
}

template <typename T>
T* Ptr(uint64_t address) {
  return reinterpret_cast<T*>(address);
}

// The model of kernel `m.entry` on the unpacked arguments `v`.
void RunKernel(const Module& m, const normgrad::kernels::KernelParamValues& v) {
  const bool row_resident = m.entry == "rms_norm_backward_row_resident";
  const bool batched = m.entry == "batched_rms_norm_backward";
  // rms: the given one (warp kernel; row-resident when rms_ptr != 0), else from x and eps.
  const float* given_rms = batched ? nullptr : Ptr<const float>(v.rms);
  // grad_gamma: atomics into one vector (batched), or written whole (row-resident: the sum over
  // the launch's rows, here in row order).
  const uint32_t h = v.hidden_dim;
  float* dgamma = row_resident ? Ptr<float>(v.dgamma) : nullptr;
  if (row_resident) std::memset(dgamma, 0, uint64_t{h} * sizeof(float));
  const void* x = Ptr<const void>(v.input);
  const void* gamma = Ptr<const void>(v.gamma);
  const void* dy = Ptr<const void>(v.grad_output);
  void* dx = Ptr<void>(v.grad_input);
  for (uint32_t r = 0; r < v.num_rows; ++r) {
    const uint64_t row = uint64_t{r} * h;
    float sum_sq = 0, sum_xdyg = 0;
    for (uint32_t i = 0; i < h; ++i) {
      const float xi = LoadElem(m.elem, x, row + i);
      sum_sq += xi * xi;
      sum_xdyg += xi * LoadElem(m.elem, dy, row + i) * LoadElem(m.elem, gamma, i);
    }
    const float rms =
        given_rms != nullptr ? given_rms[r] : std::sqrt(sum_sq / static_cast<float>(h) + v.eps);
    const float inv = 1.0f / rms;
    const float mean = sum_xdyg / static_cast<float>(h);
    for (uint32_t i = 0; i < h; ++i) {
      const float xi = LoadElem(m.elem, x, row + i);
      const float yi = LoadElem(m.elem, dy, row + i);
      StoreElem(m.elem, dx, row + i,
                inv * (LoadElem(m.elem, gamma, i) * yi - xi * inv * inv * mean));
      if (batched) {
        Ptr<float>(v.grad_gamma)[i] += yi * xi * inv;
      } else if (row_resident) {
        dgamma[i] += yi * xi * inv;
      }
    }
  }
}

}  // namespace

extern "C" {

int normgrad_scripted_cuda_module_loads() { return module_loads.load(); }
int normgrad_scripted_cuda_launches() { return launches.load(); }
int normgrad_scripted_cuda_live_modules() { return live_modules.load(); }
void normgrad_scripted_cuda_reset() {
  module_loads = 0;
  launches = 0;
  std::lock_guard<std::mutex> lock(Live().mu);
  Live().peak_host = Live().host_bytes;
  Live().peak_device = Live().device_bytes;
  Live().max_busy_streams = Live().busy_streams;
}
// Pinned (cuMemHostAlloc) and device bytes live now, and their peaks since the last reset.
size_t normgrad_scripted_cuda_host_bytes() { return LiveField(&Allocations::host_bytes); }
size_t normgrad_scripted_cuda_device_bytes() { return LiveField(&Allocations::device_bytes); }
size_t normgrad_scripted_cuda_peak_host_bytes() { return LiveField(&Allocations::peak_host); }
size_t normgrad_scripted_cuda_peak_device_bytes() { return LiveField(&Allocations::peak_device); }
int normgrad_scripted_cuda_live_streams() { return LiveField(&Allocations::streams); }
// Deferred mode: the most streams that held queued work at once since the last reset.
int normgrad_scripted_cuda_max_busy_streams() { return LiveField(&Allocations::max_busy_streams); }

CUresult cuInit(unsigned int) {
  return Mode() == "init_fails" ? CUDA_ERROR_NO_DEVICE : CUDA_SUCCESS;
}
CUresult cuDriverGetVersion(int* v) {
  *v = 13000;
  return CUDA_SUCCESS;
}
CUresult cuDeviceGetCount(int* n) {
  *n = Mode() == "no_devices" ? 0 : 1;
  return CUDA_SUCCESS;
}
CUresult cuDeviceGet(CUdevice* d, int ordinal) {
  if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
  *d = 0;
  return CUDA_SUCCESS;
}
CUresult cuDeviceGetName(char* name, int len, CUdevice) {
  std::strncpy(name, "Scripted GPU", static_cast<size_t>(len));
  return CUDA_SUCCESS;
}
CUresult cuDeviceGetAttribute(int* v, CUdevice_attribute a, CUdevice) {
  switch (a) {
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR:
      *v = 9;
      break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR:
      *v = 0;
      break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT:
      *v = 132;
      break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED:
      *v = 1;
      break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X: {
      const char* g = std::getenv("NORMGRAD_SCRIPTED_CUDA_MAX_GRID_X");
      *v = g != nullptr ? std::atoi(g) : 2147483647;
      break;
    }
    default:
      *v = 0;
  }
  return CUDA_SUCCESS;
}
CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice) {
  *bytes = size_t{80} << 30;
  return CUDA_SUCCESS;
}
CUresult cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice) {
  *c = kContext;
  return CUDA_SUCCESS;
}
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice) { return CUDA_SUCCESS; }
CUresult cuCtxSetCurrent(CUcontext c) {
  current = c;
  return CUDA_SUCCESS;
}
CUresult cuCtxGetCurrent(CUcontext* c) {
  *c = current;
  return CUDA_SUCCESS;
}

CUresult cuModuleLoadDataEx(CUmodule* module, const void* image, unsigned int n,
                            CUjit_option* options, void** values) {
  if (NoContext()) return CUDA_ERROR_INVALID_CONTEXT;
  ++module_loads;
  if (Mode() == "jit_error") {
    char* log = nullptr;
    size_t size = 0;
    for (unsigned i = 0; i < n; ++i) {
      if (options[i] == CU_JIT_ERROR_LOG_BUFFER) log = static_cast<char*>(values[i]);
      if (options[i] == CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES)
        size = reinterpret_cast<uintptr_t>(values[i]);
    }
    if (log != nullptr && size > 0) {
      std::snprintf(log, size, "ptxas application ptx input, line 7; error   : scripted failure\n");
    }
    return CUDA_ERROR_INVALID_PTX;
  }
  *module = reinterpret_cast<CUmodule>(new Module(Parse(static_cast<const char*>(image))));
  ++live_modules;
  return CUDA_SUCCESS;
}
CUresult cuModuleUnload(CUmodule module) {
  if (NoContext()) return CUDA_ERROR_INVALID_CONTEXT;
  delete reinterpret_cast<Module*>(module);
  --live_modules;
  return CUDA_SUCCESS;
}
CUresult cuModuleGetFunction(CUfunction* f, CUmodule module, const char* name) {
  Module* m = reinterpret_cast<Module*>(module);
  if (m->entry != name) return CUDA_ERROR_NOT_FOUND;
  *f = reinterpret_cast<CUfunction>(m);
  return CUDA_SUCCESS;
}

CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned, unsigned, unsigned, unsigned, unsigned,
                        unsigned, CUstream stream, void** args, void**) {
  if (NoContext()) return CUDA_ERROR_INVALID_CONTEXT;
  const char* g = std::getenv("NORMGRAD_SCRIPTED_CUDA_MAX_GRID_X");
  if (g != nullptr && gx > static_cast<unsigned>(std::atoi(g))) return CUDA_ERROR_INVALID_VALUE;
  ++launches;
  const Module& m = *reinterpret_cast<Module*>(f);
  // A parameter the launch contract does not know, or of another type: the backend's packing
  // and the kernel disagree.
  const absl::StatusOr<normgrad::kernels::KernelParamValues> unpacked =
      normgrad::kernels::UnpackArgs(m.params, args);
  if (!unpacked.ok()) return CUDA_ERROR_INVALID_VALUE;
  const normgrad::kernels::KernelParamValues v = *unpacked;
  if (m.entry != "rms_norm_backward_row_resident" && m.entry != "batched_rms_norm_backward" &&
      m.entry != "rms_norm_backward") {
    return CUDA_ERROR_NOT_FOUND;
  }
  Issue(stream, [m, v] { RunKernel(m, v); });
  return CUDA_SUCCESS;
}

CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t bytes) {
  if (NoContext()) return CUDA_ERROR_INVALID_CONTEXT;
  if (Mode() == "oom") return CUDA_ERROR_OUT_OF_MEMORY;
  *p = reinterpret_cast<CUdeviceptr>(std::malloc(bytes));
  Track(Live().device, Live().device_bytes, Live().peak_device, reinterpret_cast<void*>(*p), bytes);
  return CUDA_SUCCESS;
}
CUresult cuMemFree_v2(CUdeviceptr p) {
  Untrack(Live().device, Live().device_bytes, reinterpret_cast<void*>(p));
  std::free(reinterpret_cast<void*>(p));
  return CUDA_SUCCESS;
}
CUresult cuMemAllocAsync(CUdeviceptr* p, size_t bytes, CUstream) { return cuMemAlloc_v2(p, bytes); }
CUresult cuMemFreeAsync(CUdeviceptr p, CUstream) { return cuMemFree_v2(p); }
CUresult cuDeviceGetDefaultMemPool(CUmemoryPool* pool, CUdevice) {
  *pool = reinterpret_cast<CUmemoryPool>(&DummyContextStorage);
  return CUDA_SUCCESS;
}
CUresult cuMemPoolSetAttribute(CUmemoryPool, CUmemPool_attribute a, void* v) {
  if (a != CU_MEMPOOL_ATTR_RELEASE_THRESHOLD) return CUDA_ERROR_INVALID_VALUE;
  return *static_cast<cuuint64_t*>(v) == ~cuuint64_t{0} ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
CUresult cuMemHostAlloc(void** p, size_t bytes, unsigned int) {
  if (NoContext()) return CUDA_ERROR_INVALID_CONTEXT;
  *p = std::malloc(bytes);
  Track(Live().host, Live().host_bytes, Live().peak_host, *p, bytes);
  return CUDA_SUCCESS;
}
CUresult cuMemFreeHost(void* p) {
  Untrack(Live().host, Live().host_bytes, p);
  std::free(p);
  return CUDA_SUCCESS;
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, CUstream stream) {
  if (NoContext()) return CUDA_ERROR_INVALID_CONTEXT;
  Issue(stream, [=] { std::memcpy(reinterpret_cast<void*>(dst), src, n); });
  return CUDA_SUCCESS;
}
CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, CUstream stream) {
  if (NoContext()) return CUDA_ERROR_INVALID_CONTEXT;
  Issue(stream, [=] { std::memcpy(dst, reinterpret_cast<const void*>(src), n); });
  return CUDA_SUCCESS;
}
CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, CUstream stream) {
  if (NoContext()) return CUDA_ERROR_INVALID_CONTEXT;
  Issue(stream, [=] { std::memset(reinterpret_cast<void*>(dst), v, n); });
  return CUDA_SUCCESS;
}
CUresult cuMemsetD32Async(CUdeviceptr dst, unsigned int v, size_t n, CUstream stream) {
  if (NoContext()) return CUDA_ERROR_INVALID_CONTEXT;
  Issue(stream, [=] {
    auto* p = reinterpret_cast<uint32_t*>(dst);
    for (size_t i = 0; i < n; ++i) p[i] = v;
  });
  return CUDA_SUCCESS;
}
CUresult cuStreamCreate(CUstream* s, unsigned int flags) {
  if (NoContext()) return CUDA_ERROR_INVALID_CONTEXT;
  if (flags != CU_STREAM_NON_BLOCKING) return CUDA_ERROR_INVALID_VALUE;  // the backend's contract
  *s = reinterpret_cast<CUstream>(new Stream);
  std::lock_guard<std::mutex> lock(Live().mu);
  ++Live().streams;
  return CUDA_SUCCESS;
}
CUresult cuStreamDestroy_v2(CUstream s) {
  Drain(s);  // a destroyed stream's work still completes
  {
    std::lock_guard<std::mutex> lock(Live().mu);
    --Live().streams;
  }
  delete reinterpret_cast<Stream*>(s);
  return CUDA_SUCCESS;
}
CUresult cuStreamSynchronize(CUstream s) {
  if (NoContext()) return CUDA_ERROR_INVALID_CONTEXT;
  Drain(s);
  return CUDA_SUCCESS;
}
CUresult cuEventCreate(CUevent* e, unsigned int) {
  *e = reinterpret_cast<CUevent>(new int(0));
  return CUDA_SUCCESS;
}
CUresult cuEventRecord(CUevent, CUstream) { return CUDA_SUCCESS; }
CUresult cuEventSynchronize(CUevent) { return CUDA_SUCCESS; }
CUresult cuEventElapsedTime(float* ms, CUevent, CUevent) {
  *ms = 0;
  return CUDA_SUCCESS;
}
CUresult cuEventDestroy_v2(CUevent e) {
  delete reinterpret_cast<int*>(e);
  return CUDA_SUCCESS;
}
CUresult cuGetErrorName(CUresult r, const char** s) {
  return normgrad::testing::DescribeCudaResult(r, false, s);
}
CUresult cuGetErrorString(CUresult r, const char** s) {
  return normgrad::testing::DescribeCudaResult(r, true, s);
}
CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
  *free_bytes = size_t{79} << 30;
  *total = size_t{80} << 30;
  return CUDA_SUCCESS;
}

}  // extern "C"
