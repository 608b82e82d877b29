// PTX -> cubin with NVIDIA's nvJitLink, loaded at run time with dlopen so that the server builds
// and runs without the CUDA toolkit. No GPU or driver is needed to compile.
//
//   absl::StatusOr<std::unique_ptr<NvJitLink>> jit = NvJitLink::Load("");  // default search
//   absl::StatusOr<std::string> cubin = (*jit)->Compile(ptx_text, 90);     // -arch=sm_90
//
// Search order when `path` is empty: libnvJitLink.so.13, libnvJitLink.so (the loader's path),
// then /usr/local/cuda/lib64/libnvJitLink.so*. Thread-safe: every Compile uses its own handle.
#ifndef NORMGRAD_SERVER_CUDA_NVJITLINK_H_
#define NORMGRAD_SERVER_CUDA_NVJITLINK_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace normgrad::server {

class NvJitLink {
 public:
  // FAILED_PRECONDITION saying what was tried when no usable library is found.
  static absl::StatusOr<std::unique_ptr<NvJitLink>> Load(absl::string_view path);
  ~NvJitLink();

  // The cubin (an ELF image) for sm_<target_sm>. INVALID_ARGUMENT with nvJitLink's error log
  // when the PTX does not compile for that target.
  absl::StatusOr<std::string> Compile(absl::string_view ptx, int target_sm) const;

  const std::string& library_path() const { return library_path_; }

 private:
  struct Api;
  NvJitLink() = default;
  void* handle_ = nullptr;
  std::unique_ptr<Api> api_;
  std::string library_path_;
};

}  // namespace normgrad::server

#endif  // NORMGRAD_SERVER_CUDA_NVJITLINK_H_
