#include "server/cuda/cuda_backend.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/kernel_registry.h"
#include "kernels/launch.h"
#include "kernels/status_macros.h"
#include "server/backend/batch_checks.h"
#include "server/backend/kernel_choice.h"
#include "nvidia/driver_api.h"
#include "server/host_rows/host_rows.h"

namespace normgrad::server {
namespace {

using backend_internal::kBatchedKernel;
using backend_internal::kRowResidentKernel;
using backend_internal::kWarpKernel;
using cuda::CudaDriver;

// The retained primary context of one device, shared by the backend, its sessions and its
// cached modules; released when the last of them is gone.
class DeviceContext {
 public:
  DeviceContext(std::shared_ptr<const CudaDriver> driver, CUdevice device, CUcontext context)
      : driver_(std::move(driver)), device_(device), context_(context) {}
  DeviceContext(const DeviceContext&) = delete;
  DeviceContext& operator=(const DeviceContext&) = delete;
  ~DeviceContext() { api().cuDevicePrimaryCtxRelease_v2(device_); }

  const cuda::DriverApi& api() const { return driver_->api(); }
  const CudaDriver& driver() const { return *driver_; }
  // CudaDriver::Check; an error that means the device is lost (cuda::IsDeviceLost) marks the
  // device failed and returns the failure (UNAVAILABLE, "the GPU failed ...: <call> failed: ...").
  absl::Status Check(CUresult r, absl::string_view call) const {
    if (r == CUDA_SUCCESS) return absl::OkStatus();
    absl::Status s = driver_->Check(r, call);
    if (!cuda::IsDeviceLost(r)) return s;
    Fail(s);
    return failure();
  }

  // The device's failure (UNAVAILABLE) once one was seen, else OK. Thread-safe.
  absl::Status failure() const {
    std::lock_guard<std::mutex> lock(health_mu_);
    return failure_;
  }
  void set_failure_handler(Backend::DeviceFailureHandler handler) const {
    std::lock_guard<std::mutex> lock(health_mu_);
    failure_handler_ = std::move(handler);
  }
  // Marks the device failed for good (the first reason stays) and calls the handler, once.
  void Fail(const absl::Status& reason) const {
    Backend::DeviceFailureHandler handler;
    absl::Status status;
    {
      std::lock_guard<std::mutex> lock(health_mu_);
      if (!failure_.ok()) return;
      failure_ = absl::UnavailableError(absl::StrCat(
          "the GPU failed and this server cannot use it any more: ", reason.message()));
      status = failure_;
      handler = failure_handler_;
    }
    if (handler) handler(status);
  }

  // cuStreamSynchronize, counted as outstanding while it waits: a wait that exceeds the device
  // watchdog's bound is a hung device (CheckProgress). The driver's wait has no timeout and
  // cannot be interrupted; the thread stays blocked.
  absl::Status Synchronize(CUstream stream) const {
    uint64_t id;
    {
      std::lock_guard<std::mutex> lock(health_mu_);
      id = next_wait_id_++;
      waits_[id] = absl::Now();
    }
    const CUresult r = api().cuStreamSynchronize(stream);
    {
      std::lock_guard<std::mutex> lock(health_mu_);
      waits_.erase(id);
    }
    return Check(r, "cuStreamSynchronize");
  }

  // failure(), after turning a synchronize that has waited for longer than `bound` (zero: no
  // bound) into the device's failure.
  absl::Status CheckProgress(absl::Duration bound) const {
    absl::Duration longest = absl::ZeroDuration();
    {
      std::lock_guard<std::mutex> lock(health_mu_);
      if (!failure_.ok() || bound <= absl::ZeroDuration()) return failure_;
      const absl::Time now = absl::Now();
      for (const auto& [id, since] : waits_) longest = std::max(longest, now - since);
    }
    if (longest > bound) {
      Fail(absl::DeadlineExceededError(
          absl::StrCat("cuStreamSynchronize has not returned for ", absl::FormatDuration(longest),
                       ", more than the device timeout of ", absl::FormatDuration(bound),
                       " (the GPU is hung)")));
    }
    return failure();
  }

  // Every thread that issues work calls this first.
  absl::Status MakeCurrent() const {
    return Check(api().cuCtxSetCurrent(context_), "cuCtxSetCurrent");
  }

  CUdevice device() const { return device_; }
  bool stream_ordered = false;  // set once during start-up
  uint32_t max_grid_x = 65535;  // set once during start-up

  // Host ranges registered with the driver (page-locked in place): copies go straight between
  // them and the device, with no staging copy. Thread-safe.
  absl::Status RegisterHost(void* base, uint64_t bytes) const {
    if (api().cuMemHostRegister_v2 == nullptr || api().cuMemHostUnregister == nullptr) {
      return absl::UnimplementedError("the driver has no cuMemHostRegister");
    }
    NORMGRAD_RETURN_IF_ERROR(MakeCurrent());
    NORMGRAD_RETURN_IF_ERROR(Check(
        api().cuMemHostRegister_v2(base, bytes, CU_MEMHOSTREGISTER_PORTABLE), "cuMemHostRegister"));
    std::lock_guard<std::mutex> lock(host_mu_);
    host_ranges_[reinterpret_cast<uintptr_t>(base)] = bytes;
    return absl::OkStatus();
  }
  void UnregisterHost(void* base) const {
    {
      std::lock_guard<std::mutex> lock(host_mu_);
      if (host_ranges_.erase(reinterpret_cast<uintptr_t>(base)) == 0) return;
    }
    if (MakeCurrent().ok()) (void)api().cuMemHostUnregister(base);
  }
  bool IsRegisteredHost(const void* p, uint64_t bytes) const {
    const auto a = reinterpret_cast<uintptr_t>(p);
    std::lock_guard<std::mutex> lock(host_mu_);
    auto it = host_ranges_.upper_bound(a);
    if (it == host_ranges_.begin()) return false;
    --it;
    return a - it->first <= it->second && bytes <= it->second - (a - it->first);
  }

 private:
  std::shared_ptr<const CudaDriver> driver_;
  CUdevice device_;
  CUcontext context_;
  mutable std::mutex host_mu_;
  mutable std::map<uintptr_t, uint64_t> host_ranges_;  // base -> bytes; guarded by host_mu_
  mutable std::mutex health_mu_;
  mutable absl::Status failure_;                           // guarded by health_mu_
  mutable Backend::DeviceFailureHandler failure_handler_;  // guarded by health_mu_
  mutable uint64_t next_wait_id_ = 0;                      // guarded by health_mu_
  mutable std::map<uint64_t, absl::Time> waits_;  // synchronizes waiting: id -> start; health_mu_
};

// A module loaded into the device's context, with its kernel entry. Unloaded when the cache
// has evicted it and no session holds it any more.
struct LoadedModule {
  std::shared_ptr<const DeviceContext> ctx;
  CUmodule module = nullptr;
  CUfunction function = nullptr;
  std::string entry;
  std::vector<kernels::KernelParam> params;

  ~LoadedModule() {
    if (module != nullptr && ctx->MakeCurrent().ok()) ctx->api().cuModuleUnload(module);
  }
};

// cuModuleLoadDataEx with the JIT error log captured; a failure carries the log.
absl::StatusOr<std::shared_ptr<const LoadedModule>> LoadModule(
    const std::shared_ptr<const DeviceContext>& ctx, const kernels::EmittedPtx& ptx) {
  NORMGRAD_RETURN_IF_ERROR(ctx->MakeCurrent());
  auto loaded = std::make_shared<LoadedModule>();
  loaded->ctx = ctx;
  loaded->entry = ptx.entry;
  loaded->params = ptx.params;
  std::vector<char> log(16 << 10, '\0');
  CUjit_option options[] = {CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
  void* values[] = {log.data(), reinterpret_cast<void*>(static_cast<uintptr_t>(log.size()))};
  const CUresult r =
      ctx->api().cuModuleLoadDataEx(&loaded->module, ptx.text.c_str(), 2, options, values);
  if (r != CUDA_SUCCESS) {
    loaded->module = nullptr;
    const absl::Status s =
        ctx->Check(r, absl::StrCat("cuModuleLoadDataEx(", ptx.entry, ", sm_", ptx.target_sm,
                                   ", PTX ISA ", ptx.version.ToString(), ")"));
    std::string text(log.data(), strnlen(log.data(), log.size()));
    while (!text.empty() && (text.back() == '\n' || text.back() == '\0')) text.pop_back();
    const std::string message =
        absl::StrCat(s.message(), "; JIT log: ", text.empty() ? "(empty)" : text);
    // A PTX newer than the driver or no code for this GPU is the GPU's/driver's limit; every
    // other JIT failure is ours (the generator emitted something the JIT refused).
    if (s.code() == absl::StatusCode::kFailedPrecondition)
      return absl::FailedPreconditionError(message);
    if (s.code() == absl::StatusCode::kUnavailable) return absl::UnavailableError(message);
    return absl::InternalError(message);
  }
  NORMGRAD_RETURN_IF_ERROR(ctx->Check(
      ctx->api().cuModuleGetFunction(&loaded->function, loaded->module, ptx.entry.c_str()),
      absl::StrCat("cuModuleGetFunction(", ptx.entry, ")")));
  return std::shared_ptr<const LoadedModule>(std::move(loaded));
}

// One chunk's work area on the device: two streams, pinned host memory and device memory, lent
// by the backend's StagingPool for one ProcessChunk call. A chunk's pieces alternate between the
// two streams (CudaBackwardSession::DeviceChunk), so one piece's copies overlap the other's kernel.
struct StagingSlot {
  static constexpr int kStreams = 2;
  // The plan's semaphores (kernels::BackwardArgs::semaphores) for every launch on stream i:
  // semaphores[i], zeroed once when the slot is made; every completed run leaves them zero, and
  // a slot whose chunk failed is dropped, not reused. 1024 counters each: a grid of up to
  // ~15,000 blocks.
  static constexpr size_t kSemaphoreBytes = 4096;

  CUstream streams[kStreams] = {};
  uint8_t* host = nullptr;  // cuMemHostAlloc
  size_t host_bytes = 0;
  CUdeviceptr device = 0;  // stream-ordered on streams[0] when the device has pools
  size_t device_bytes = 0;
  CUdeviceptr semaphores[kStreams] = {};  // kSemaphoreBytes each, likewise
};

// The backend's staging slots (cuda_backend.h): the pinned bytes of every slot, lent or idle,
// stay within max_bytes, and so do the device bytes, except for one slot lent alone, which is
// freed when it comes back. Thread-safe.
class StagingPool {
 public:
  StagingPool(std::shared_ptr<const DeviceContext> ctx, uint64_t max_bytes)
      : ctx_(std::move(ctx)), max_bytes_(max_bytes) {}
  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;
  ~StagingPool() {
    for (std::unique_ptr<StagingSlot>& slot : idle_) Free(*slot);
  }

  // A slot with at least `host_bytes` pinned and `device_bytes` of device memory: an idle one
  // that is large enough, else a new one (idle slots freed first to make room under the bound,
  // else waiting for a lent one to come back). The device's failure ends the wait.
  absl::StatusOr<std::unique_ptr<StagingSlot>> Acquire(size_t host_bytes, size_t device_bytes) {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      auto best = idle_.end();
      for (auto it = idle_.begin(); it != idle_.end(); ++it) {
        const StagingSlot& s = **it;
        if (s.host_bytes < host_bytes || s.device_bytes < device_bytes) continue;
        if (best == idle_.end() ||
            s.host_bytes + s.device_bytes < (*best)->host_bytes + (*best)->device_bytes) {
          best = it;
        }
      }
      if (best != idle_.end()) {
        std::unique_ptr<StagingSlot> slot = std::move(*best);
        idle_.erase(best);
        ++lent_;
        return slot;
      }
      // No idle slot fits: free idle ones (smallest first: they fit fewer chunks) until the
      // new slot fits under the bound.
      std::sort(idle_.begin(), idle_.end(), [](const auto& a, const auto& b) {
        return a->host_bytes + a->device_bytes > b->host_bytes + b->device_bytes;
      });
      while (!idle_.empty() && !FitsLocked(host_bytes, device_bytes)) {
        std::unique_ptr<StagingSlot> slot = std::move(idle_.back());
        idle_.pop_back();
        host_held_ -= slot->host_bytes;
        device_held_ -= slot->device_bytes;
        Free(*slot);
      }
      if (FitsLocked(host_bytes, device_bytes) || lent_ == 0) break;
      NORMGRAD_RETURN_IF_ERROR(ctx_->failure());
      returned_.wait_for(lock, std::chrono::milliseconds(100));
    }
    host_held_ += host_bytes;
    device_held_ += device_bytes;
    ++lent_;
    lock.unlock();
    auto slot = std::make_unique<StagingSlot>();
    absl::Status s = Allocate(*slot, host_bytes, device_bytes);
    if (!s.ok()) {
      Free(*slot);
      std::lock_guard<std::mutex> relock(mu_);
      host_held_ -= host_bytes;
      device_held_ -= device_bytes;
      --lent_;
      returned_.notify_all();
      return s;
    }
    return slot;
  }

  // A slot whose stream has no work left (synchronized), kept for reuse; but while the pool
  // holds more than its bound (a slot lent alone above it), idle slots are freed, largest
  // first, until it is back under the bound: a chunk larger than the bound does not leave its
  // memory held after it is done.
  void Return(std::unique_ptr<StagingSlot> slot) {
    std::lock_guard<std::mutex> lock(mu_);
    idle_.push_back(std::move(slot));
    --lent_;
    std::sort(idle_.begin(), idle_.end(), [](const auto& a, const auto& b) {
      return a->host_bytes + a->device_bytes < b->host_bytes + b->device_bytes;
    });
    while (!idle_.empty() && !FitsLocked(0, 0)) {
      std::unique_ptr<StagingSlot> largest = std::move(idle_.back());
      idle_.pop_back();
      host_held_ -= largest->host_bytes;
      device_held_ -= largest->device_bytes;
      Free(*largest);
    }
    returned_.notify_all();
  }

  // A slot after a failed chunk: freed once its streams are idle. On a failed device nothing is
  // freed (a synchronize might never return; the process is going away) and its bytes stay
  // counted.
  void Drop(std::unique_ptr<StagingSlot> slot) {
    bool freed = ctx_->failure().ok() && ctx_->MakeCurrent().ok();
    for (CUstream stream : slot->streams) {
      freed =
          freed && (stream == nullptr || ctx_->api().cuStreamSynchronize(stream) == CUDA_SUCCESS);
    }
    if (freed) Free(*slot);
    std::lock_guard<std::mutex> lock(mu_);
    if (freed) {
      host_held_ -= slot->host_bytes;
      device_held_ -= slot->device_bytes;
    }
    --lent_;
    returned_.notify_all();
  }

 private:
  bool FitsLocked(size_t host_bytes, size_t device_bytes) const {
    return host_held_ + host_bytes <= max_bytes_ && device_held_ + device_bytes <= max_bytes_;
  }

  // Both streams are synchronized once at the end, so memory allocated in stream order on one
  // of them is usable on either from then on.
  absl::Status Allocate(StagingSlot& slot, size_t host_bytes, size_t device_bytes) const {
    const cuda::DriverApi& api = ctx_->api();
    NORMGRAD_RETURN_IF_ERROR(ctx_->MakeCurrent());
    for (CUstream& stream : slot.streams) {
      NORMGRAD_RETURN_IF_ERROR(
          ctx_->Check(api.cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate"));
    }
    if (host_bytes != 0) {
      void* p = nullptr;
      NORMGRAD_RETURN_IF_ERROR(
          ctx_->Check(api.cuMemHostAlloc(&p, host_bytes, 0), "cuMemHostAlloc"));
      slot.host = static_cast<uint8_t*>(p);
      slot.host_bytes = host_bytes;
    }
    if (device_bytes != 0) {
      NORMGRAD_ASSIGN_OR_RETURN(slot.device, AllocateDevice(slot.streams[0], device_bytes));
      slot.device_bytes = device_bytes;
    }
    for (int i = 0; i < StagingSlot::kStreams; ++i) {
      NORMGRAD_ASSIGN_OR_RETURN(slot.semaphores[i],
                                AllocateDevice(slot.streams[i], StagingSlot::kSemaphoreBytes));
      NORMGRAD_RETURN_IF_ERROR(ctx_->Check(
          api.cuMemsetD32Async(slot.semaphores[i], 0,
                               StagingSlot::kSemaphoreBytes / sizeof(uint32_t), slot.streams[i]),
          "cuMemsetD32Async(semaphores)"));
    }
    for (CUstream stream : slot.streams) {
      NORMGRAD_RETURN_IF_ERROR(ctx_->Check(api.cuStreamSynchronize(stream), "cuStreamSynchronize"));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<CUdeviceptr> AllocateDevice(CUstream stream, size_t bytes) const {
    const cuda::DriverApi& api = ctx_->api();
    CUdeviceptr p = 0;
    NORMGRAD_RETURN_IF_ERROR(
        ctx_->stream_ordered
            ? ctx_->Check(api.cuMemAllocAsync(&p, bytes, stream), "cuMemAllocAsync")
            : ctx_->Check(api.cuMemAlloc_v2(&p, bytes), "cuMemAlloc"));
    return p;
  }

  // Frees what `slot` holds (its streams have no work left). Nothing on a failed device.
  void Free(StagingSlot& slot) const {
    if (!ctx_->failure().ok() || !ctx_->MakeCurrent().ok()) return;
    const cuda::DriverApi& api = ctx_->api();
    for (const CUdeviceptr p : {slot.device, slot.semaphores[0], slot.semaphores[1]}) {
      if (p == 0) continue;
      if (ctx_->stream_ordered && slot.streams[0] != nullptr) {
        api.cuMemFreeAsync(p, slot.streams[0]);
      } else {
        api.cuMemFree_v2(p);
      }
    }
    for (CUstream stream : slot.streams) {
      if (stream == nullptr) continue;
      api.cuStreamSynchronize(stream);
      api.cuStreamDestroy_v2(stream);
    }
    if (slot.host != nullptr) api.cuMemFreeHost(slot.host);
    slot = StagingSlot{};
  }

  const std::shared_ptr<const DeviceContext> ctx_;
  const uint64_t max_bytes_;
  std::mutex mu_;
  std::condition_variable returned_;
  std::vector<std::unique_ptr<StagingSlot>> idle_;  // guarded by mu_
  uint64_t host_held_ = 0;                          // lent and idle; guarded by mu_
  uint64_t device_held_ = 0;                        // lent and idle; guarded by mu_
  uint32_t lent_ = 0;                               // guarded by mu_
};

// Device memory of other processes (CUDA IPC), opened with cuIpcOpenMemHandle and kept open in
// a bounded cache keyed by the handle's bytes, least recently used closed first (a buffer still
// computing is closed when its last holder lets go). The driver counts opens of one handle per
// context, so every entry is one open and one close.
class IpcBufferCache {
 public:
  IpcBufferCache(std::shared_ptr<const DeviceContext> ctx, uint32_t max_open)
      : ctx_(std::move(ctx)), max_open_(std::max<uint32_t>(1, max_open)) {}

  absl::StatusOr<std::shared_ptr<const DeviceBuffer>> Open(absl::string_view handle) {
    if (handle.size() != sizeof(CUipcMemHandle)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a CUDA IPC handle has ", sizeof(CUipcMemHandle), " bytes, not ", handle.size()));
    }
    std::lock_guard<std::mutex> lock(mu_);  // one open at a time: the driver's count stays 1
    for (auto it = lru_.begin(); it != lru_.end(); ++it) {
      if (it->first == handle) {
        lru_.splice(lru_.begin(), lru_, it);
        return lru_.front().second;
      }
    }
    NORMGRAD_RETURN_IF_ERROR(ctx_->MakeCurrent());
    CUipcMemHandle h;
    std::memcpy(h.reserved, handle.data(), sizeof(h.reserved));
    CUdeviceptr base = 0;
    const CUresult r =
        ctx_->api().cuIpcOpenMemHandle_v2(&base, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
    if (r == CUDA_ERROR_INVALID_HANDLE || r == CUDA_ERROR_INVALID_VALUE ||
        r == CUDA_ERROR_INVALID_DEVICE || r == CUDA_ERROR_INVALID_CONTEXT ||
        r == CUDA_ERROR_MAP_FAILED) {
      // The client's mistake, not the server's: name the driver's reason.
      return absl::InvalidArgumentError(absl::StrCat(
          ctx_->driver().Check(r, "cuIpcOpenMemHandle").message(),
          " (the buffer was freed or its process exited, it is on another GPU, or the handle "
          "was exported by the server's own process)"));
    }
    NORMGRAD_RETURN_IF_ERROR(ctx_->Check(r, "cuIpcOpenMemHandle"));
    size_t bytes = 0;
    CUdeviceptr range_base = 0;
    if (absl::Status s = ctx_->Check(ctx_->api().cuMemGetAddressRange_v2(&range_base, &bytes, base),
                                     "cuMemGetAddressRange");
        !s.ok()) {
      ctx_->api().cuIpcCloseMemHandle(base);
      return s;
    }
    auto opened =
        std::shared_ptr<DeviceBuffer>(new DeviceBuffer{base, bytes}, [ctx = ctx_](DeviceBuffer* b) {
          if (ctx->MakeCurrent().ok()) {
            ctx->api().cuIpcCloseMemHandle(b->address);
          }
          delete b;
        });
    lru_.emplace_front(std::string(handle), opened);
    while (lru_.size() > max_open_) lru_.pop_back();
    return std::shared_ptr<const DeviceBuffer>(std::move(opened));
  }

 private:
  const std::shared_ptr<const DeviceContext> ctx_;
  const uint32_t max_open_;
  mutable std::mutex mu_;
  // Most recently used first; a handle's bytes -> its opened buffer. Guarded by mu_.
  std::list<std::pair<std::string, std::shared_ptr<const DeviceBuffer>>> lru_;
};

// How a session computes: on the GPU through a kernels::BackwardPlan (which kernels, in which
// order, with which workspace), or on the host for a given rms with rows no GPU kernel takes it
// for (hidden_dim > 32 without the row-resident kernel): dx and grad_gamma from the CPU
// backend's rows, exactly from the given rms.
//
// Device memory of a chunk, in a slot borrowed from the backend's StagingPool for the chunk
// only: gamma, x, dy, dx (and rms), the plan's workspace, and the chunk's f32 grad_gamma, which
// the host adds (double) in chunk order. Where the plan leaves grad_gamma to the caller
// (DgammaOutput::kNone), the host computes it from the chunk and the given rms.
class CudaBackwardSession : public BackwardSession, private kernels::KernelLauncher {
 public:
  // plan: null for the host path; modules: one per plan step, loaded in the device's context.
  // gamma: hidden_dim elements of spec.dtype as given; gamma_f32: the same as f32 (host paths).
  CudaBackwardSession(std::shared_ptr<const DeviceContext> ctx, const BatchSpec& spec,
                      std::optional<kernels::BackwardPlan> plan,
                      std::vector<std::shared_ptr<const LoadedModule>> modules,
                      std::vector<uint8_t> gamma, std::vector<float> gamma_f32,
                      std::shared_ptr<StagingPool> staging, uint64_t piece_bytes)
      : ctx_(std::move(ctx)),
        staging_(std::move(staging)),
        piece_bytes_(std::max<uint64_t>(piece_bytes, 1)),
        spec_(spec),
        plan_(std::move(plan)),
        modules_(std::move(modules)),
        element_bytes_(backend_internal::ElementBytes(spec.dtype)),
        gamma_(std::move(gamma)),
        gamma_f32_(std::move(gamma_f32)),
        dgamma_sum_(spec.hidden_dim, 0.0) {}

  absl::Status ProcessChunk(absl::Span<const uint8_t> x, absl::Span<const uint8_t> dy,
                            absl::Span<const float> rms, uint64_t rows,
                            absl::Span<uint8_t> dx) override {
    if (!broken_.ok()) return broken_;
    NORMGRAD_RETURN_IF_ERROR(ctx_->failure());
    NORMGRAD_RETURN_IF_ERROR(
        backend_internal::CheckChunk(spec_, rows_done_, rows, x.size(), dy.size(), rms, dx.size()));
    const auto start = std::chrono::steady_clock::now();
    absl::Status s =
        plan_.has_value() ? DeviceChunk(x, dy, rms, rows, dx) : HostChunk(x, dy, rms, rows, dx);
    compute_seconds_ +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (!s.ok()) {
      broken_ = s;  // the device may hold half a chunk: the session cannot go on
      return s;
    }
    rows_done_ += rows;
    return absl::OkStatus();
  }

  absl::Status ProcessDeviceChunk(const DeviceRows& rows) override {
    if (!broken_.ok()) return broken_;
    NORMGRAD_RETURN_IF_ERROR(ctx_->failure());
    if (!plan_.has_value()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "no GPU kernel takes a given rms for rows of hidden_dim = ", spec_.hidden_dim,
          " (> 32): this server computes such chunks on the host, so send them as bytes or in "
          "shared memory, not in device memory"));
    }
    if (rows.rows == 0 || rows.rows > spec_.num_rows - rows_done_) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a device chunk of ", rows.rows, " rows after ", rows_done_, " of ", spec_.num_rows));
    }
    const auto start = std::chrono::steady_clock::now();
    absl::Status s = DeviceChunkInPlace(rows);
    compute_seconds_ +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (!s.ok()) {
      broken_ = s;
      return s;
    }
    rows_done_ += rows.rows;
    return absl::OkStatus();
  }

  absl::Status Finish(absl::Span<uint8_t> dgamma) override {
    if (!broken_.ok()) return broken_;
    NORMGRAD_RETURN_IF_ERROR(backend_internal::CheckFinish(spec_, rows_done_, dgamma.size()));
    std::vector<float> rounded(dgamma_sum_.begin(), dgamma_sum_.end());
    host_rows::ConvertFromF32(spec_.dtype, rounded.data(), dgamma.data(), rounded.size());
    return absl::OkStatus();
  }

  absl::string_view KernelName() const override {
    return plan_.has_value() ? plan_->kernel().EntryName() : absl::string_view("cpu_highway");
  }
  double ComputeSeconds() const override { return compute_seconds_; }

 private:
  // kernels::KernelLauncher: the plan's launches, on this session's stream.
  absl::Span<const kernels::KernelParam> Params(size_t step) const override {
    return modules_[step]->params;
  }
  uint32_t MaxGridX() const override { return ctx_->max_grid_x; }
  absl::Status Launch(size_t step, const kernels::LaunchGeometry& g, void** args) override {
    const LoadedModule& m = *modules_[step];
    return ctx_->Check(
        ctx_->api().cuLaunchKernel(m.function, g.grid[0], g.grid[1], g.grid[2], g.block[0],
                                   g.block[1], g.block[2], g.shared_bytes, stream_, args, nullptr),
        absl::StrCat("cuLaunchKernel(", m.entry, ")"));
  }

  // One chunk on the device, in a slot of the staging pool held for this call only, as a
  // pipeline of pieces of PieceRows() rows that alternate between the slot's two streams. Each
  // piece is: its rows staged into pinned memory (host), copied to the device, the plan's
  // launches, dx and its grad_gamma copied back. Piece p+1 is staged and issued before the host
  // waits for piece p, so the host's staging copies, the copies in each direction (PCIe is full
  // duplex) and the kernels of neighbouring pieces overlap; the host then copies piece p's dx
  // out while the device works on p+1. Each stream has its own gamma, workspace, semaphores and
  // grad_gamma, so the two streams share nothing but the rows' disjoint ranges. The pieces'
  // grad_gamma are added (double) in piece order: the same chunk always gives the same bits.
  //
  // Slot layout: pinned [gamma | x | dy | rms | dx | grad_gamma x2] (x, dy, rms and dx only when
  // the chunk is not in registered host memory), device [gamma x2 | x | dy | dx | rms |
  // workspace x2 | grad_gamma x2], each part 256-byte aligned.
  absl::Status DeviceChunk(absl::Span<const uint8_t> x, absl::Span<const uint8_t> dy,
                           absl::Span<const float> rms, uint64_t rows, absl::Span<uint8_t> dx) {
    const kernels::BackwardPlan& plan = *plan_;
    const size_t h = spec_.hidden_dim;
    const size_t data_bytes = rows * h * element_bytes_;
    const bool rms_to_device = plan.requires_rms() || (plan.reads_rms() && spec_.rms_provided);
    const bool dgamma_on_device = plan.dgamma_output() != kernels::DgammaOutput::kNone;
    const size_t rms_bytes = rms_to_device ? rows * sizeof(float) : 0;
    const size_t dgamma_bytes = dgamma_on_device ? h * sizeof(float) : 0;
    const uint64_t piece_rows = PieceRows(rows);
    const int streams = rows > piece_rows ? StagingSlot::kStreams : 1;
    // A chunk whose x, dy, rms and dx all lie in registered host memory (a shared-memory
    // region) is copied straight from and to it; any other goes through pinned staging.
    const bool in_place = ctx_->IsRegisteredHost(x.data(), data_bytes) &&
                          ctx_->IsRegisteredHost(dy.data(), data_bytes) &&
                          (rms_bytes == 0 || ctx_->IsRegisteredHost(rms.data(), rms_bytes)) &&
                          ctx_->IsRegisteredHost(dx.data(), data_bytes);
    const size_t staged = in_place ? 0 : data_bytes;
    const size_t staged_rms = in_place ? 0 : rms_bytes;
    ChunkLayout at;
    SlotLayout host;
    at.host_gamma = host.Add(gamma_.size());
    at.host_x = host.Add(staged);
    at.host_dy = host.Add(staged);
    at.host_rms = host.Add(staged_rms);
    at.host_dx = host.Add(staged);
    SlotLayout device;
    for (int i = 0; i < streams; ++i) at.gamma[i] = device.Add(gamma_.size());
    at.x = device.Add(data_bytes);
    at.dy = device.Add(data_bytes);
    at.dx = device.Add(data_bytes);
    at.rms = device.Add(rms_bytes);
    for (int i = 0; i < streams; ++i) {
      at.workspace[i] = device.Add(plan.WorkspaceBytes(piece_rows));
      at.dgamma[i] = device.Add(dgamma_bytes);
      at.host_dgamma[i] = host.Add(dgamma_bytes);
    }
    return WithSlot(host.bytes(), device.bytes(), [&](const StagingSlot& slot) -> absl::Status {
      NORMGRAD_RETURN_IF_ERROR(ctx_->MakeCurrent());
      std::memcpy(slot.host + at.host_gamma, gamma_.data(), gamma_.size());
      const ChunkRows chunk{x, dy, rms, dx, in_place, rms_bytes != 0, dgamma_bytes};
      const uint64_t pieces = (rows + piece_rows - 1) / piece_rows;
      Piece next = PieceOf(0, piece_rows, rows);
      NORMGRAD_RETURN_IF_ERROR(IssuePiece(slot, at, chunk, next));
      for (uint64_t p = 0; p < pieces; ++p) {
        const Piece piece = next;
        if (p + 1 < pieces) {
          next = PieceOf(p + 1, piece_rows, rows);
          NORMGRAD_RETURN_IF_ERROR(IssuePiece(slot, at, chunk, next));
        }
        NORMGRAD_RETURN_IF_ERROR(CompletePiece(slot, at, chunk, piece));
      }
      return absl::OkStatus();
    });
  }

  // Rows per piece of a chunk of `rows` (DeviceChunk): about pipeline_piece_bytes of x each,
  // at least one row; a function of the shape only, so the same chunk is cut the same way.
  uint64_t PieceRows(uint64_t rows) const {
    const uint64_t row_bytes = uint64_t{spec_.hidden_dim} * element_bytes_;
    return std::clamp<uint64_t>(piece_bytes_ / row_bytes, 1, rows);
  }

  // Runs `work(slot)` with a slot of the staging pool (stream_ is its first stream meanwhile),
  // then gives the slot back, or drops it when the work failed (its streams may hold half a
  // chunk).
  template <typename Work>
  absl::Status WithSlot(size_t host_bytes, size_t device_bytes, Work work) {
    NORMGRAD_ASSIGN_OR_RETURN(std::unique_ptr<StagingSlot> slot,
                              staging_->Acquire(host_bytes, device_bytes));
    stream_ = slot->streams[0];
    absl::Status s = work(*slot);
    stream_ = nullptr;
    if (s.ok()) {
      staging_->Return(std::move(slot));
    } else {
      staging_->Drop(std::move(slot));
    }
    return s;
  }

  // The plan's semaphores for `rows` fit in a slot's (a grid far beyond any device's would not).
  static absl::Status CheckSemaphores(const kernels::BackwardPlan& plan, uint64_t rows) {
    if (plan.SemaphoreBytes(rows) <= StagingSlot::kSemaphoreBytes) return absl::OkStatus();
    return absl::InternalError(absl::StrCat(plan.kernel().EntryName(), " needs ",
                                            plan.SemaphoreBytes(rows), " bytes of semaphores for ",
                                            rows, " rows; a staging slot has ",
                                            StagingSlot::kSemaphoreBytes));
  }

  // Offsets of the parts of a staging slot, 256-byte aligned.
  class SlotLayout {
   public:
    size_t Add(size_t bytes) {
      const size_t at = bytes_;
      bytes_ += (bytes + 255) / 256 * 256;
      return at;
    }
    size_t bytes() const { return bytes_; }

   private:
    size_t bytes_ = 0;
  };
  // Where DeviceChunk's parts lie in the slot: host_* in pinned memory, the rest on the device;
  // [i]: stream i's own.
  struct ChunkLayout {
    size_t host_gamma = 0, host_x = 0, host_dy = 0, host_rms = 0, host_dx = 0;
    size_t host_dgamma[StagingSlot::kStreams] = {};
    size_t gamma[StagingSlot::kStreams] = {};
    size_t x = 0, dy = 0, dx = 0, rms = 0;
    size_t workspace[StagingSlot::kStreams] = {};
    size_t dgamma[StagingSlot::kStreams] = {};
  };
  // The chunk DeviceChunk pipelines: its rows as the caller passed them.
  struct ChunkRows {
    absl::Span<const uint8_t> x, dy;
    absl::Span<const float> rms;
    absl::Span<uint8_t> dx;
    bool in_place;        // x, dy, rms and dx in registered host memory: no staging copies
    bool rms_to_device;   // the plan reads the given rms
    size_t dgamma_bytes;  // the plan's f32 grad_gamma on the device; 0: the host adds it
  };

  // Piece p of a chunk of `chunk_rows` cut into pieces of `piece_rows`: its stream, rows and
  // byte range in the chunk's rows.
  struct Piece {
    uint64_t index = 0;
    int stream = 0;  // p % 2
    uint64_t first = 0, rows = 0;
    size_t off = 0, bytes = 0;  // of x, dy and dx
  };
  Piece PieceOf(uint64_t p, uint64_t piece_rows, uint64_t chunk_rows) const {
    Piece piece;
    piece.index = p;
    piece.stream = static_cast<int>(p % StagingSlot::kStreams);
    piece.first = p * piece_rows;
    piece.rows = std::min(piece_rows, chunk_rows - piece.first);
    piece.off = piece.first * spec_.hidden_dim * element_bytes_;
    piece.bytes = piece.rows * spec_.hidden_dim * element_bytes_;
    return piece;
  }

  // Stages a piece's rows (unless in place) and issues its copies and launches on its stream. A
  // stream's first piece of the chunk also copies gamma to that stream's own copy.
  absl::Status IssuePiece(const StagingSlot& slot, const ChunkLayout& at, const ChunkRows& c,
                          const Piece& piece) {
    const cuda::DriverApi& api = ctx_->api();
    const kernels::BackwardPlan& plan = *plan_;
    const int s = piece.stream;
    const CUstream stream = slot.streams[s];
    const uint64_t rows = piece.rows;
    const size_t off = piece.off, bytes = piece.bytes;
    const size_t rms_off = piece.first * sizeof(float);
    const size_t rms_bytes = c.rms_to_device ? rows * sizeof(float) : 0;
    uint8_t* const pinned = slot.host;
    const CUdeviceptr dev = slot.device;
    if (piece.index < StagingSlot::kStreams) {
      NORMGRAD_RETURN_IF_ERROR(
          ctx_->Check(api.cuMemcpyHtoDAsync_v2(dev + at.gamma[s], pinned + at.host_gamma,
                                               gamma_.size(), stream),
                      "cuMemcpyHtoDAsync(gamma)"));
    }
    const uint8_t* x_host = c.x.data() + off;
    const uint8_t* dy_host = c.dy.data() + off;
    const uint8_t* rms_host = reinterpret_cast<const uint8_t*>(c.rms.data()) + rms_off;
    if (!c.in_place) {
      std::memcpy(pinned + at.host_x + off, x_host, bytes);
      std::memcpy(pinned + at.host_dy + off, dy_host, bytes);
      if (rms_bytes != 0) std::memcpy(pinned + at.host_rms + rms_off, rms_host, rms_bytes);
      x_host = pinned + at.host_x + off;
      dy_host = pinned + at.host_dy + off;
      rms_host = pinned + at.host_rms + rms_off;
    }
    NORMGRAD_RETURN_IF_ERROR(ctx_->Check(
        api.cuMemcpyHtoDAsync_v2(dev + at.x + off, x_host, bytes, stream), "cuMemcpyHtoDAsync(x)"));
    NORMGRAD_RETURN_IF_ERROR(
        ctx_->Check(api.cuMemcpyHtoDAsync_v2(dev + at.dy + off, dy_host, bytes, stream),
                    "cuMemcpyHtoDAsync(dy)"));
    if (rms_bytes != 0) {
      NORMGRAD_RETURN_IF_ERROR(
          ctx_->Check(api.cuMemcpyHtoDAsync_v2(dev + at.rms + rms_off, rms_host, rms_bytes, stream),
                      "cuMemcpyHtoDAsync(rms)"));
    }
    if (plan.dgamma_output() == kernels::DgammaOutput::kAccumulated) {  // atomics add into it
      NORMGRAD_RETURN_IF_ERROR(
          ctx_->Check(api.cuMemsetD32Async(dev + at.dgamma[s], 0, spec_.hidden_dim, stream),
                      "cuMemsetD32Async(grad_gamma)"));
    }
    kernels::BackwardArgs args;
    args.x = dev + at.x + off;
    args.dy = dev + at.dy + off;
    args.dx = dev + at.dx + off;
    args.gamma = dev + at.gamma[s];
    args.rms = rms_bytes != 0 ? dev + at.rms + rms_off : 0;
    args.dgamma = c.dgamma_bytes != 0 ? dev + at.dgamma[s] : 0;
    args.workspace = dev + at.workspace[s];
    args.semaphores = slot.semaphores[s];
    args.rows = rows;
    NORMGRAD_RETURN_IF_ERROR(CheckSemaphores(plan, rows));
    args.hidden_dim = spec_.hidden_dim;
    args.eps = spec_.eps;
    stream_ = stream;
    const absl::Status ran = plan.Run(args, *this);
    stream_ = slot.streams[0];
    NORMGRAD_RETURN_IF_ERROR(ran);
    NORMGRAD_RETURN_IF_ERROR(ctx_->Check(
        api.cuMemcpyDtoHAsync_v2(c.in_place ? c.dx.data() + off : pinned + at.host_dx + off,
                                 dev + at.dx + off, bytes, stream),
        "cuMemcpyDtoHAsync(dx)"));
    if (c.dgamma_bytes != 0) {
      NORMGRAD_RETURN_IF_ERROR(
          ctx_->Check(api.cuMemcpyDtoHAsync_v2(pinned + at.host_dgamma[s], dev + at.dgamma[s],
                                               c.dgamma_bytes, stream),
                      "cuMemcpyDtoHAsync(grad_gamma)"));
    }
    return absl::OkStatus();
  }

  // Waits for a piece (its stream holds nothing issued after it: the next piece on that stream
  // is issued only after this), then copies its dx out of pinned memory and adds its grad_gamma.
  absl::Status CompletePiece(const StagingSlot& slot, const ChunkLayout& at, const ChunkRows& c,
                             const Piece& piece) {
    const size_t off = piece.off, bytes = piece.bytes;
    NORMGRAD_RETURN_IF_ERROR(ctx_->Synchronize(slot.streams[piece.stream]));
    if (!c.in_place) std::memcpy(c.dx.data() + off, slot.host + at.host_dx + off, bytes);
    if (c.dgamma_bytes != 0) {
      const float* piece_dgamma =
          reinterpret_cast<const float*>(slot.host + at.host_dgamma[piece.stream]);
      for (size_t i = 0; i < spec_.hidden_dim; ++i) dgamma_sum_[i] += piece_dgamma[i];
    } else {
      AddHostGradGamma(c.x.subspan(off, bytes), c.dy.subspan(off, bytes),
                       c.rms.subspan(piece.first, piece.rows), piece.rows);
    }
    return absl::OkStatus();
  }

  // One chunk whose rows are in device memory (CUDA IPC): the plan runs on them in place. The
  // slot holds only gamma, the workspace and grad_gamma on the device; where the plan leaves
  // grad_gamma to the host (the warp plan), x, dy and rms come to pinned memory for it.
  absl::Status DeviceChunkInPlace(const DeviceRows& in) {
    const kernels::BackwardPlan& plan = *plan_;
    const cuda::DriverApi& api = ctx_->api();
    const size_t h = spec_.hidden_dim;
    const uint64_t rows = in.rows;
    const size_t data_bytes = rows * h * element_bytes_;
    const bool rms_to_device = plan.requires_rms() || (plan.reads_rms() && spec_.rms_provided);
    const bool dgamma_on_device = plan.dgamma_output() != kernels::DgammaOutput::kNone;
    if ((rms_to_device || !dgamma_on_device) && in.rms == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(plan.kernel().EntryName(), " needs the forward pass's rms for each row"));
    }
    const size_t dgamma_bytes = dgamma_on_device ? h * sizeof(float) : 0;
    const size_t to_host = dgamma_on_device ? 0 : data_bytes;
    const size_t rms_to_host = dgamma_on_device ? 0 : rows * sizeof(float);
    SlotLayout host;
    const size_t h_gamma = host.Add(gamma_.size()), h_dgamma = host.Add(dgamma_bytes),
                 h_x = host.Add(to_host), h_dy = host.Add(to_host), h_rms = host.Add(rms_to_host);
    SlotLayout device;
    const size_t d_gamma = device.Add(gamma_.size()),
                 d_workspace = device.Add(plan.WorkspaceBytes(rows)),
                 d_dgamma = device.Add(dgamma_bytes);
    return WithSlot(host.bytes(), device.bytes(), [&](const StagingSlot& slot) -> absl::Status {
      uint8_t* const pinned = slot.host;
      const CUdeviceptr dev = slot.device;
      NORMGRAD_RETURN_IF_ERROR(ctx_->MakeCurrent());
      std::memcpy(pinned + h_gamma, gamma_.data(), gamma_.size());
      NORMGRAD_RETURN_IF_ERROR(ctx_->Check(
          api.cuMemcpyHtoDAsync_v2(dev + d_gamma, pinned + h_gamma, gamma_.size(), stream_),
          "cuMemcpyHtoDAsync(gamma)"));
      if (plan.dgamma_output() == kernels::DgammaOutput::kAccumulated) {
        NORMGRAD_RETURN_IF_ERROR(ctx_->Check(api.cuMemsetD32Async(dev + d_dgamma, 0, h, stream_),
                                             "cuMemsetD32Async(grad_gamma)"));
      }
      kernels::BackwardArgs args;
      args.x = in.x;
      args.dy = in.dy;
      args.dx = in.dx;
      args.gamma = dev + d_gamma;
      args.rms = rms_to_device ? in.rms : 0;
      args.dgamma = dgamma_on_device ? dev + d_dgamma : 0;
      args.workspace = dev + d_workspace;
      args.semaphores = slot.semaphores[0];
      args.rows = rows;
      NORMGRAD_RETURN_IF_ERROR(CheckSemaphores(plan, rows));
      args.hidden_dim = spec_.hidden_dim;
      args.eps = spec_.eps;
      NORMGRAD_RETURN_IF_ERROR(plan.Run(args, *this));
      if (dgamma_on_device) {
        NORMGRAD_RETURN_IF_ERROR(ctx_->Check(
            api.cuMemcpyDtoHAsync_v2(pinned + h_dgamma, dev + d_dgamma, dgamma_bytes, stream_),
            "cuMemcpyDtoHAsync(grad_gamma)"));
      } else {
        for (auto [to, from, bytes, what] :
             {std::tuple{h_x, in.x, data_bytes, "x"}, std::tuple{h_dy, in.dy, data_bytes, "dy"},
              std::tuple{h_rms, in.rms, rms_to_host, "rms"}}) {
          NORMGRAD_RETURN_IF_ERROR(
              ctx_->Check(api.cuMemcpyDtoHAsync_v2(pinned + to, from, bytes, stream_),
                          absl::StrCat("cuMemcpyDtoHAsync(", what, ")")));
        }
      }
      NORMGRAD_RETURN_IF_ERROR(ctx_->Synchronize(stream_));
      if (dgamma_on_device) {
        const float* chunk_dgamma = reinterpret_cast<const float*>(pinned + h_dgamma);
        for (size_t i = 0; i < h; ++i) dgamma_sum_[i] += chunk_dgamma[i];
      } else {
        AddHostGradGamma(absl::MakeConstSpan(pinned + h_x, data_bytes),
                         absl::MakeConstSpan(pinned + h_dy, data_bytes),
                         absl::MakeConstSpan(reinterpret_cast<const float*>(pinned + h_rms), rows),
                         rows);
      }
      return absl::OkStatus();
    });
  }

  // grad_gamma_i += dy_ri * x_ri / rms_r in row order (double), for the warp plan's narrow rows.
  // Converted to f32 a few rows at a time (StagingRows).
  void AddHostGradGamma(absl::Span<const uint8_t> x, absl::Span<const uint8_t> dy,
                        absl::Span<const float> rms, uint64_t rows) {
    const size_t h = spec_.hidden_dim;
    const size_t tile = std::min<uint64_t>(rows, StagingRows());
    std::vector<float> xf(tile * h), yf(tile * h);
    for (uint64_t first = 0; first < rows; first += tile) {
      const size_t m = std::min<uint64_t>(tile, rows - first);
      host_rows::ConvertToF32(spec_.dtype, x.data() + first * h * element_bytes_, xf.data(), m * h);
      host_rows::ConvertToF32(spec_.dtype, dy.data() + first * h * element_bytes_, yf.data(),
                              m * h);
      for (uint64_t r = 0; r < m; ++r) {
        const double inv_rms = 1.0 / static_cast<double>(rms[first + r]);
        for (size_t i = 0; i < h; ++i) {
          dgamma_sum_[i] += static_cast<double>(yf[r * h + i]) * xf[r * h + i] * inv_rms;
        }
      }
    }
  }

  // Rows converted to f32 at once on the host paths: kHostStagingElements elements, or one row
  // when rows are wider, so the f32 copies held do not grow with the chunk (at most
  // 12 x max(kHostStagingElements, hidden_dim) bytes per session computing).
  static constexpr uint64_t kHostStagingElements = 16384;
  uint64_t StagingRows() const {
    return std::max<uint64_t>(1, kHostStagingElements / spec_.hidden_dim);
  }

  // The host path: the CPU backend's rows with the given rms (exact), one thread.
  absl::Status HostChunk(absl::Span<const uint8_t> x, absl::Span<const uint8_t> dy,
                         absl::Span<const float> rms, uint64_t rows, absl::Span<uint8_t> dx) {
    const size_t h = spec_.hidden_dim;
    const size_t tile = std::min<uint64_t>(rows, StagingRows());
    std::vector<float> staged(3 * tile * h);
    std::vector<double> partial(spec_.hidden_dim, 0.0);
    host_rows::RowBlock block;
    block.x = staged.data();
    block.dy = staged.data() + tile * h;
    block.dx = staged.data() + 2 * tile * h;
    block.gamma = gamma_f32_.data();
    block.dgamma = partial.data();
    block.hidden_dim = spec_.hidden_dim;
    block.eps = spec_.eps;
    for (uint64_t first = 0; first < rows; first += tile) {
      const size_t m = std::min<uint64_t>(tile, rows - first);
      const size_t at = first * h * element_bytes_;
      host_rows::ConvertToF32(spec_.dtype, x.data() + at, staged.data(), m * h);
      host_rows::ConvertToF32(spec_.dtype, dy.data() + at, staged.data() + tile * h, m * h);
      block.rms = rms.data() + first;
      block.num_rows = m;
      host_rows::BackwardRowsF32(block);
      host_rows::ConvertFromF32(spec_.dtype, block.dx, dx.data() + at, m * h);
    }
    for (size_t i = 0; i < partial.size(); ++i) dgamma_sum_[i] += partial[i];
    return absl::OkStatus();
  }

  const std::shared_ptr<const DeviceContext> ctx_;
  const std::shared_ptr<StagingPool> staging_;
  const uint64_t piece_bytes_;  // CudaBackendOptions::pipeline_piece_bytes
  const BatchSpec spec_;
  const std::optional<kernels::BackwardPlan> plan_;                 // empty: the host path
  const std::vector<std::shared_ptr<const LoadedModule>> modules_;  // one per plan step
  const size_t element_bytes_;
  const std::vector<uint8_t> gamma_;
  const std::vector<float> gamma_f32_;
  CUstream stream_ = nullptr;  // the borrowed slot's, during DeviceChunk
  std::vector<double> dgamma_sum_;
  uint64_t rows_done_ = 0;
  double compute_seconds_ = 0;
  absl::Status broken_;
};

class CudaBackend : public Backend {
 public:
  // uuid: the device's 16 bytes, empty when the driver has no CUDA IPC.
  CudaBackend(std::shared_ptr<const DeviceContext> ctx, DeviceDescription device, int target_sm,
              ModuleCacheOptions cache, uint64_t max_staging_bytes, std::string uuid,
              uint32_t max_ipc_handles, uint64_t pipeline_piece_bytes)
      : ctx_(std::move(ctx)),
        device_(std::move(device)),
        target_sm_(target_sm),
        cache_(cache),
        staging_(std::make_shared<StagingPool>(ctx_, max_staging_bytes)),
        uuid_(std::move(uuid)),
        ipc_(ctx_, max_ipc_handles),
        pipeline_piece_bytes_(pipeline_piece_bytes) {}

  ~CudaBackend() override { cache_.Clear(); }

  absl::string_view Name() const override { return "cuda"; }
  DeviceDescription Device() const override { return device_; }

  absl::StatusOr<std::unique_ptr<BackwardSession>> StartBackward(
      const BatchSpec& spec, absl::Span<const uint8_t> gamma) override {
    NORMGRAD_RETURN_IF_ERROR(ctx_->failure());
    NORMGRAD_RETURN_IF_ERROR(backend_internal::CheckBatch(spec, gamma.size()));
    NORMGRAD_RETURN_IF_ERROR(backend_internal::CheckNamedKernel(spec));
    kernels::KernelConfig config = backend_internal::ConfigFor(spec, target_sm_);
    config.sm_count = device_.sm_count;  // sizes the row-resident kernel's persistent grid
    std::vector<uint8_t> gamma_bytes(gamma.begin(), gamma.end());
    std::vector<float> gamma_f32(spec.hidden_dim);
    host_rows::ConvertToF32(spec.dtype, gamma.data(), gamma_f32.data(), gamma_f32.size());

    NORMGRAD_ASSIGN_OR_RETURN(const kernels::Kernel* kernel, ChooseKernel(spec, config));
    std::optional<kernels::BackwardPlan> plan;
    std::vector<std::shared_ptr<const LoadedModule>> modules;
    if (kernel != nullptr) {
      NORMGRAD_RETURN_IF_ERROR(CheckRunsOnThisGpu(*kernel, config));
      NORMGRAD_ASSIGN_OR_RETURN(plan, kernels::BackwardPlan::Create(*kernel, config));
      for (const kernels::BackwardPlan::Step& step : plan->steps()) {
        NORMGRAD_ASSIGN_OR_RETURN(std::shared_ptr<const LoadedModule> m,
                                  GetModule(*step.kernel, step.config));
        modules.push_back(std::move(m));
      }
    }
    return std::unique_ptr<BackwardSession>(std::make_unique<CudaBackwardSession>(
        ctx_, spec, std::move(plan), std::move(modules), std::move(gamma_bytes),
        std::move(gamma_f32), staging_, pipeline_piece_bytes_));
  }

  absl::Status Preload(const kernels::Kernel& kernel,
                       const kernels::KernelConfig& config) override {
    kernels::KernelConfig for_device = config;
    for_device.target_sm = target_sm_;  // modules are compiled for this backend's GPU
    for_device.sm_count = device_.sm_count;
    return GetModule(kernel, for_device).status();
  }

  ModuleCacheStats CacheStats() const override { return cache_.Stats(); }

  absl::Status RegisterHostMemory(void* base, uint64_t bytes) override {
    return ctx_->RegisterHost(base, bytes);
  }
  void UnregisterHostMemory(void* base) override { ctx_->UnregisterHost(base); }

  std::string DeviceUuid() const override { return uuid_; }
  absl::StatusOr<std::shared_ptr<const DeviceBuffer>> OpenIpcBuffer(
      absl::string_view handle) override {
    NORMGRAD_RETURN_IF_ERROR(ctx_->failure());
    if (uuid_.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat(ctx_->driver().path(), " has no CUDA IPC (cuIpcOpenMemHandle)"));
    }
    return ipc_.Open(handle);
  }

  void SetDeviceFailureHandler(DeviceFailureHandler handler) override {
    ctx_->set_failure_handler(std::move(handler));
  }
  absl::Status CheckDevice(absl::Duration bound) override { return ctx_->CheckProgress(bound); }

 private:
  // The request's kernel (BatchSpec::kernel, or the backend's choice: the row-resident kernel
  // when it fits, any rms, reproducible grad_gamma; else the seed kernels); nullptr for the host
  // path (a given rms with rows too wide for every GPU kernel that takes one).
  absl::StatusOr<const kernels::Kernel*> ChooseKernel(const BatchSpec& spec,
                                                      const kernels::KernelConfig& config) const {
    absl::string_view name = spec.kernel;
    if (name.empty()) {
      const kernels::Kernel* row_resident = kernels::FindKernel(kRowResidentKernel);
      name = row_resident != nullptr && row_resident->CanImplement(config).ok() ? kRowResidentKernel
             : !spec.rms_provided                                               ? kBatchedKernel
             : spec.hidden_dim <= 32                                            ? kWarpKernel
                                                                                : "";
      if (name.empty()) return nullptr;
    }
    const kernels::Kernel* kernel = kernels::FindKernel(name);
    if (kernel == nullptr) {
      return absl::InternalError(absl::StrCat("the kernels library lacks ", name));
    }
    return kernel;
  }

  // CanImplement's status, except FAILED_PRECONDITION when the request is fine but this GPU
  // cannot run the kernel (bf16 below sm_80, say).
  absl::Status CheckRunsOnThisGpu(const kernels::Kernel& kernel,
                                  const kernels::KernelConfig& config) const {
    absl::Status s = kernel.CanImplement(config);
    if (s.ok()) return s;
    kernels::KernelConfig elsewhere = config;
    elsewhere.target_sm = backend_internal::kProbeTargetSm;
    if (kernel.CanImplement(elsewhere).ok()) {
      return absl::FailedPreconditionError(absl::StrCat("GPU ", device_.name, " (sm_", target_sm_,
                                                        ") cannot run ", kernel.EntryName(), ": ",
                                                        s.message()));
    }
    return s;
  }

  absl::StatusOr<std::shared_ptr<const LoadedModule>> GetModule(
      const kernels::Kernel& kernel, const kernels::KernelConfig& config) {
    NORMGRAD_RETURN_IF_ERROR(CheckRunsOnThisGpu(kernel, config));
    return cache_.GetOrCompile(
        kernel.ConfigKey(config), [&]() -> absl::StatusOr<ModuleCache<LoadedModule>::Compiled> {
          NORMGRAD_ASSIGN_OR_RETURN(const kernels::EmittedPtx ptx, kernel.Emit(config));
          NORMGRAD_ASSIGN_OR_RETURN(std::shared_ptr<const LoadedModule> loaded,
                                    LoadModule(ctx_, ptx));
          return ModuleCache<LoadedModule>::Compiled{std::move(loaded), ptx.text.size()};
        });
  }

  const std::shared_ptr<const DeviceContext> ctx_;
  const DeviceDescription device_;
  const int target_sm_;
  ModuleCache<LoadedModule> cache_;
  const std::shared_ptr<StagingPool> staging_;  // shared with the sessions
  const std::string uuid_;
  IpcBufferCache ipc_;
  const uint64_t pipeline_piece_bytes_;
};

// Device set-up on a loaded driver (see cuda_backend.h); any failure means no usable GPU.
absl::StatusOr<std::unique_ptr<Backend>> OpenDevice(std::shared_ptr<const CudaDriver> driver,
                                                    const CudaBackendOptions& options) {
  const cuda::DriverApi& api = driver->api();
  NORMGRAD_RETURN_IF_ERROR(driver->Check(api.cuInit(0), "cuInit"));
  int driver_version = 0;
  NORMGRAD_RETURN_IF_ERROR(
      driver->Check(api.cuDriverGetVersion(&driver_version), "cuDriverGetVersion"));
  int count = 0;
  NORMGRAD_RETURN_IF_ERROR(driver->Check(api.cuDeviceGetCount(&count), "cuDeviceGetCount"));
  if (count < 1) return absl::FailedPreconditionError("no CUDA device");
  if (options.device_ordinal < 0 || options.device_ordinal >= count) {
    return absl::FailedPreconditionError(absl::StrCat("device ordinal ", options.device_ordinal,
                                                      " out of range (", count, " devices)"));
  }
  CUdevice device = 0;
  NORMGRAD_RETURN_IF_ERROR(
      driver->Check(api.cuDeviceGet(&device, options.device_ordinal), "cuDeviceGet"));
  DeviceDescription d;
  char name[256] = {};
  NORMGRAD_RETURN_IF_ERROR(
      driver->Check(api.cuDeviceGetName(name, sizeof(name) - 1, device), "cuDeviceGetName"));
  d.name = name;
  int major = 0, minor = 0, sms = 0, max_grid_x = 0, pools = 0;
  for (auto [attribute, out, label] :
       {std::tuple{CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, &major,
                   "compute capability major"},
        std::tuple{CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, &minor,
                   "compute capability minor"},
        std::tuple{CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, &sms, "multiprocessor count"},
        std::tuple{CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X, &max_grid_x, "max grid dim x"}}) {
    NORMGRAD_RETURN_IF_ERROR(driver->Check(api.cuDeviceGetAttribute(out, attribute, device),
                                           absl::StrCat("cuDeviceGetAttribute(", label, ")")));
  }
  size_t total = 0;
  NORMGRAD_RETURN_IF_ERROR(
      driver->Check(api.cuDeviceTotalMem_v2(&total, device), "cuDeviceTotalMem"));
  d.compute_capability_major = major;
  d.compute_capability_minor = minor;
  d.total_memory_bytes = total;
  d.driver_version = cuda::DriverVersionString(driver_version);
  d.max_ptx_version = cuda::MaxPtxVersionForDriver(driver_version);
  d.sm_count = static_cast<uint32_t>(sms);

  CUcontext context = nullptr;
  NORMGRAD_RETURN_IF_ERROR(
      driver->Check(api.cuDevicePrimaryCtxRetain(&context, device), "cuDevicePrimaryCtxRetain"));
  auto ctx = std::make_shared<DeviceContext>(driver, device, context);
  ctx->max_grid_x = max_grid_x > 0 ? static_cast<uint32_t>(max_grid_x) : 65535u;
  NORMGRAD_RETURN_IF_ERROR(ctx->MakeCurrent());

  // Stream-ordered allocation with a raised release threshold, when the driver and device
  // have memory pools; otherwise plain cuMemAlloc.
  if (driver->HasStreamOrderedAllocation() &&
      api.cuDeviceGetAttribute(&pools, CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, device) ==
          CUDA_SUCCESS &&
      pools != 0) {
    CUmemoryPool pool = nullptr;
    cuuint64_t threshold = std::numeric_limits<cuuint64_t>::max();
    ctx->stream_ordered = api.cuDeviceGetDefaultMemPool(&pool, device) == CUDA_SUCCESS &&
                          api.cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                                                    &threshold) == CUDA_SUCCESS;
  }
  std::string uuid;
  CUuuid id;
  if (driver->HasIpc() && api.cuDeviceGetUuid_v2(&id, device) == CUDA_SUCCESS) {
    uuid.assign(id.bytes, sizeof(id.bytes));
  }
  return std::unique_ptr<Backend>(new CudaBackend(
      std::move(ctx), std::move(d), major * 10 + minor, options.cache, options.max_staging_bytes,
      std::move(uuid), options.max_ipc_handles, options.pipeline_piece_bytes));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> NewCudaBackend(const CudaBackendOptions& options) {
  const std::string path = cuda::ResolveDriverLibrary(options.driver_library);
  NORMGRAD_ASSIGN_OR_RETURN(std::shared_ptr<const CudaDriver> driver, CudaDriver::Load(path));
  absl::StatusOr<std::unique_ptr<Backend>> backend = OpenDevice(std::move(driver), options);
  if (!backend.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(path, ": ", backend.status().message()));
  }
  return backend;
}

}  // namespace normgrad::server
