// PTX -> cubin with NVIDIA's nvJitLink, loaded at run time with dlopen so that the server builds
// and runs without the CUDA toolkit. No GPU or driver is needed to compile.
//
//   absl::StatusOr<std::unique_ptr<NvJitLink>> jit = NvJitLink::Load("");  // default search
//   absl::StatusOr<std::string> cubin = (*jit)->Compile(ptx_text, 90);     // -arch=sm_90
//   absl::StatusOr<NvJitLink::Assembled> a = (*jit)->Assemble(ptx_text, 90);  // + ptxas -v
//
// Search order when `path` is empty: libnvJitLink.so.13, libnvJitLink.so (the loader's path),
// then /usr/local/cuda/lib64/libnvJitLink.so*. Thread-safe: every Compile uses its own handle.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace normgrad::server {

// What the assembler reports for one kernel entry: ptxas -v's lines, which nvJitLink writes to
// its info log with -verbose ("N bytes stack frame, N bytes spill stores, N bytes spill loads";
// "Used N registers, used N barriers, N bytes smem, N bytes cmem[0]"). Per thread where the
// hardware allocates per thread (registers, stack), per block for shared memory.
struct AssemblerReport {
  uint32_t registers = 0;            // per thread
  uint32_t barriers = 0;             // named barriers used
  uint64_t stack_frame_bytes = 0;    // local memory per thread (spills live there too)
  uint64_t spill_store_bytes = 0;
  uint64_t spill_load_bytes = 0;
  uint64_t shared_memory_bytes = 0;  // static .shared per block (ptxas omits it when 0)
  uint64_t constant_memory_bytes = 0;  // cmem[0]: parameters and the driver's constants
};

// The report for `entry` in an assembler log (ptxas -v's stdout, or nvJitLink's info log).
// INVALID_ARGUMENT naming the entry when the log has no "Compiling entry function" section for
// it, or no "Used N registers" line in it.
absl::StatusOr<AssemblerReport> ParseAssemblerReport(absl::string_view log,
                                                     absl::string_view entry);

class NvJitLink {
 public:
  // FAILED_PRECONDITION saying what was tried when no usable library is found.
  static absl::StatusOr<std::unique_ptr<NvJitLink>> Load(absl::string_view path);
  ~NvJitLink();

  // The cubin (an ELF image) for sm_<target_sm>. INVALID_ARGUMENT with nvJitLink's error log
  // when the PTX does not compile for that target.
  absl::StatusOr<std::string> Compile(absl::string_view ptx, int target_sm) const;

  // Compile with -verbose: the cubin and the assembler's info log. Compile() is Assemble()'s
  // cubin, so both give the same bytes.
  struct Assembled {
    std::string cubin;
    std::string info_log;  // ptxas -v's lines; parse with ParseAssemblerReport
  };
  absl::StatusOr<Assembled> Assemble(absl::string_view ptx, int target_sm) const;

  const std::string& library_path() const { return library_path_; }

 private:
  struct Api;
  NvJitLink() = default;
  void* handle_ = nullptr;
  std::unique_ptr<Api> api_;
  std::string library_path_;
};

}  // namespace normgrad::server
