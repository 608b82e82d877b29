// normgrad::PtxLibrary: the PTX (and cubin) images that normgrad_add_ptx_library() embedded in a
// static library at build time, and the choice of the image to load on a given device.
//
//   # CMakeLists.txt (docs/build-systems.md)
//   find_package(normgrad CONFIG REQUIRED)
//   normgrad_add_ptx_library(my_kernels KERNEL rms_norm_backward_row_resident
//                            HIDDEN_DIMS 4096 DTYPES bf16 TARGETS sm_80 sm_90)
//   target_link_libraries(app PRIVATE my_kernels)
//
//   // app.cc
//   #include "my_kernels.h"   // declares normgrad::embedded::my_kernels()
//   const normgrad::PtxImage* image = normgrad::embedded::my_kernels().Find(
//       "rms_norm_backward_row_resident", 4096, "bf16", /*device_sm=*/major * 10 + minor);
//   if (image == nullptr) return;          // no image this device can load
//   cuModuleLoadData(&module, image->data);  // PTX text (NUL-terminated) or a cubin
//   cuModuleGetFunction(&fn, module, image->entry);
//
// Header-only, standard C++17, no other dependency; the images are constant data, so every
// function here is thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace normgrad {

enum class PtxImageKind {
  kPtx,    // PTX text: the driver JIT-compiles it for any device of target_sm or newer
  kCubin,  // an ELF image for exactly sm_<target_sm>
};

// A parameter of the kernel's entry, in declaration order (the order cuLaunchKernel expects).
struct PtxKernelParam {
  const char* name;
  const char* type;  // PTX type: "u64", "u32", "f32"
};

// One embedded image. Everything is read from the image itself (entry, parameters, PTX version)
// or is the configuration it was requested for (kernel, hidden_dim, dtype, target_sm: the
// inputs of the kernel's launch geometry, docs/kernels.md; and the RMSNorm variant baked into
// the PTX, the library's GAMMA_OFFSET, NO_GAMMA and CASTING_MODE).
struct PtxImage {
  const char* kernel;       // the kernel's name, as requested ("rms_norm_backward_row_resident")
  const char* entry;        // the .entry name in the PTX (what cuModuleGetFunction takes)
  uint32_t hidden_dim;      // as requested
  const char* dtype;        // "f32", "bf16" or "f16"
  int target_sm;            // 90 for sm_90: the PTX's .target, the cubin's architecture
  const char* ptx_version;  // the PTX's .version ("8.0"); for a cubin, that of its PTX
  PtxImageKind kind;
  const unsigned char* data;  // `size` bytes; PTX text is followed by a NUL (not in `size`)
  size_t size;
  const char* sha256;  // lowercase hex of data[0, size): the content address EmitPtx reports
  const PtxKernelParam* params;
  size_t num_params;
  float gamma_offset;        // scale = gamma_offset + gamma (0: the plain RMSNorm)
  bool has_gamma;            // false: the scale is 1 and there is no grad_gamma
  const char* casting_mode;  // "llama", "gemma" or "none"

  std::string_view bytes() const {
    return std::string_view(reinterpret_cast<const char*>(data), size);
  }
};

// The images of one normgrad_add_ptx_library() target, in the order of its arguments (kernel,
// hidden_dim, dtype, target; each configuration's PTX, then its cubin).
class PtxLibrary {
 public:
  constexpr PtxLibrary(const PtxImage* const* images, size_t num_images)
      : images_(images), num_images_(num_images) {}

  // for (const normgrad::PtxImage* image : library) ...
  const PtxImage* const* begin() const { return images_; }
  const PtxImage* const* end() const { return images_ + num_images_; }
  size_t size() const { return num_images_; }

  // The image to load on a device of compute capability `device_sm` (major * 10 + minor: 86 for
  // 8.6) for this configuration: the cubin built for exactly that architecture, else the PTX
  // of the highest target <= device_sm (the newest the driver can JIT for it), else nullptr
  // (every target is newer than the device, or the configuration was not embedded).
  const PtxImage* Find(std::string_view kernel, uint32_t hidden_dim, std::string_view dtype,
                       int device_sm) const {
    const PtxImage* best_ptx = nullptr;
    for (const PtxImage* image : *this) {
      if (kernel != image->kernel || hidden_dim != image->hidden_dim || dtype != image->dtype) {
        continue;
      }
      if (image->kind == PtxImageKind::kCubin) {
        if (image->target_sm == device_sm) return image;
      } else if (image->target_sm <= device_sm &&
                 (best_ptx == nullptr || image->target_sm > best_ptx->target_sm)) {
        best_ptx = image;
      }
    }
    return best_ptx;
  }

 private:
  const PtxImage* const* images_;
  size_t num_images_;
};

}  // namespace normgrad
