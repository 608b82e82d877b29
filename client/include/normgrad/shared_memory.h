// A shared-memory region for the shared-memory transport (docs/api.md, "Shared memory"): a memfd
// sealed against shrinking and mapped here. Put x and dy (and rms) in it and leave room for
// grad_input; register it with a Client whose server runs with --shared-memory on a unix socket,
// and Backward calls whose tensors lie in it send no payload byte: the server reads and writes
// the region in place.
//
//   auto region = normgrad::SharedMemoryRegion::Create(3 * bytes);   // x, dy, dx
//   float* x = region->As<float>(0);  ... fill x and dy ...
//   (*client)->RegisterSharedMemory(**region);
//   (*client)->Backward(x_span, dy_span, gamma, eps, {.dx = dx_span});   // no copy
//
// The region must outlive every call that uses it and the Client it is registered with. Not
// thread-safe to create; its memory is the caller's to share between threads as usual.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"

namespace normgrad {

class SharedMemoryRegion {
 public:
  // memfd_create + ftruncate(bytes) + F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL + mmap.
  static absl::StatusOr<std::unique_ptr<SharedMemoryRegion>> Create(uint64_t bytes);
  ~SharedMemoryRegion();
  SharedMemoryRegion(const SharedMemoryRegion&) = delete;
  SharedMemoryRegion& operator=(const SharedMemoryRegion&) = delete;

  uint8_t* data() const { return base_; }
  uint64_t size() const { return size_; }
  int fd() const { return fd_; }
  template <typename T>
  T* As(uint64_t byte_offset) const {
    return reinterpret_cast<T*>(base_ + byte_offset);
  }
  // True when [p, p + bytes) lies inside the region.
  bool Contains(const void* p, uint64_t bytes) const;

 private:
  SharedMemoryRegion(int fd, uint8_t* base, uint64_t size) : fd_(fd), base_(base), size_(size) {}
  const int fd_;
  uint8_t* const base_;
  const uint64_t size_;
};

}  // namespace normgrad
