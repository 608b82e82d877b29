// A CUDA driver library that forwards every entry point of nvidia/driver_api.h to another
// driver library ($NORMGRAD_TRACE_INNER_DRIVER, e.g. the emulated one) and writes the stream
// work a program issues, one line per call, to $NORMGRAD_TRACE_FILE:
//   memset <bytes> <stream>      cuMemsetD8Async / cuMemsetD32Async (bytes, not elements)
//   record <event> <stream>      cuEventRecord
//   launch <stream>              cuLaunchKernel
//   elapsed <start> <stop>       cuEventElapsedTime
// so a test can check what normgrad-gpu-bench does between its timed runs (check_l2_flush.py:
// an L2 flush before every one). Every other entry point is a jump to the inner library's, so
// argument lists need not be spelled here; the tracing ones are written out. x86-64 ELF only.
#include <cuda.h>
#undef cuEventElapsedTime  // the unversioned name, as nvidia/driver_api.h looks up

#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>

#include "nvidia/driver_api.h"

namespace {

FILE* trace_file = nullptr;
std::mutex trace_mu;

template <typename... A>
void Trace(const char* format, A... a) {
  std::lock_guard<std::mutex> lock(trace_mu);
  std::fprintf(trace_file, format, a...);
  std::fflush(trace_file);
}

}  // namespace

// One pointer per entry point, filled from the inner library (or with a tracer below) before
// any call, and one exported symbol per entry point that jumps through it.
// (Hidden, so the jump reaches them %rip-relative from a shared object.)
#define NORMGRAD_TRACE_DEFINE(name, required)                                  \
  extern "C" {                                                                 \
  __attribute__((visibility("hidden"))) void* normgrad_trace_##name = nullptr; \
  }
NORMGRAD_CUDA_DRIVER_FUNCTIONS(NORMGRAD_TRACE_DEFINE)
#define NORMGRAD_TRACE_TRAMPOLINE(name, required) \
  asm(".pushsection .text\n"                      \
      ".globl " #name                             \
      "\n"                                        \
      ".type " #name ", @function\n" #name        \
      ":\n"                                       \
      "  jmp *normgrad_trace_" #name              \
      "(%rip)\n"                                  \
      ".size " #name ", .-" #name                 \
      "\n"                                        \
      ".popsection\n");
NORMGRAD_CUDA_DRIVER_FUNCTIONS(NORMGRAD_TRACE_TRAMPOLINE)

namespace {

template <typename F>
F Inner(void* handle, const char* name) {
  return reinterpret_cast<F>(dlsym(handle, name));
}

decltype(&::cuMemsetD8Async) inner_memset8 = nullptr;
decltype(&::cuMemsetD32Async) inner_memset32 = nullptr;
decltype(&::cuEventRecord) inner_record = nullptr;
decltype(&::cuLaunchKernel) inner_launch = nullptr;
decltype(&::cuEventElapsedTime) inner_elapsed = nullptr;

CUresult TraceMemset8(CUdeviceptr p, unsigned char value, size_t n, CUstream stream) {
  Trace("memset %zu %p\n", n, static_cast<void*>(stream));
  return inner_memset8(p, value, n, stream);
}
CUresult TraceMemset32(CUdeviceptr p, unsigned int value, size_t n, CUstream stream) {
  Trace("memset %zu %p\n", n * 4, static_cast<void*>(stream));
  return inner_memset32(p, value, n, stream);
}
CUresult TraceRecord(CUevent event, CUstream stream) {
  Trace("record %p %p\n", static_cast<void*>(event), static_cast<void*>(stream));
  return inner_record(event, stream);
}
CUresult TraceLaunch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                     unsigned bz, unsigned shared, CUstream stream, void** params, void** extra) {
  Trace("launch %p\n", static_cast<void*>(stream));
  return inner_launch(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra);
}
CUresult TraceElapsed(float* ms, CUevent start, CUevent stop) {
  Trace("elapsed %p %p\n", static_cast<void*>(start), static_cast<void*>(stop));
  return inner_elapsed(ms, start, stop);
}

// Runs when the library is loaded: a missing inner driver or trace file stops the program with
// one line, since nothing could be forwarded or traced.
__attribute__((constructor)) void LoadInnerDriver() {
  const char* inner = std::getenv("NORMGRAD_TRACE_INNER_DRIVER");
  const char* path = std::getenv("NORMGRAD_TRACE_FILE");
  void* handle = inner != nullptr ? dlopen(inner, RTLD_NOW | RTLD_LOCAL) : nullptr;
  if (handle == nullptr || path == nullptr) {
    std::fprintf(stderr,
                 "stream_trace_driver: needs NORMGRAD_TRACE_INNER_DRIVER (a loadable driver"
                 " library; got %s) and NORMGRAD_TRACE_FILE (got %s)\n",
                 inner != nullptr ? inner : "nothing", path != nullptr ? path : "nothing");
    std::abort();
  }
  trace_file = std::fopen(path, "w");
  if (trace_file == nullptr) {
    std::fprintf(stderr, "stream_trace_driver: cannot write %s\n", path);
    std::abort();
  }
#define NORMGRAD_TRACE_RESOLVE(name, required) normgrad_trace_##name = dlsym(handle, #name);
  NORMGRAD_CUDA_DRIVER_FUNCTIONS(NORMGRAD_TRACE_RESOLVE)
  inner_memset8 = Inner<decltype(inner_memset8)>(handle, "cuMemsetD8Async");
  inner_memset32 = Inner<decltype(inner_memset32)>(handle, "cuMemsetD32Async");
  inner_record = Inner<decltype(inner_record)>(handle, "cuEventRecord");
  inner_launch = Inner<decltype(inner_launch)>(handle, "cuLaunchKernel");
  inner_elapsed = Inner<decltype(inner_elapsed)>(handle, "cuEventElapsedTime");
  normgrad_trace_cuMemsetD8Async = reinterpret_cast<void*>(&TraceMemset8);
  normgrad_trace_cuMemsetD32Async = reinterpret_cast<void*>(&TraceMemset32);
  normgrad_trace_cuEventRecord = reinterpret_cast<void*>(&TraceRecord);
  normgrad_trace_cuLaunchKernel = reinterpret_cast<void*>(&TraceLaunch);
  normgrad_trace_cuEventElapsedTime = reinterpret_cast<void*>(&TraceElapsed);
}

}  // namespace
