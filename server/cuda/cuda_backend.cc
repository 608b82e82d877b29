#include "server/cuda/cuda_backend.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
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
#include "server/cuda/driver_api.h"
#include "server/host_rows/host_rows.h"

namespace normgrad::server {
namespace {

using backend_internal::kBatchedKernel;
using backend_internal::kDgammaReduceKernel;
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
      failure_ = absl::UnavailableError(
          absl::StrCat("the GPU failed and this server cannot use it any more: ", reason.message()));
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
      Fail(absl::DeadlineExceededError(absl::StrCat(
          "cuStreamSynchronize has not returned for ", absl::FormatDuration(longest),
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
  mutable absl::Status failure_;                              // guarded by health_mu_
  mutable Backend::DeviceFailureHandler failure_handler_;     // guarded by health_mu_
  mutable uint64_t next_wait_id_ = 0;                         // guarded by health_mu_
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

// Device memory from the stream-ordered pool when available, else cuMemAlloc.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // Grows to at least `bytes` (contents are not kept).
  absl::Status Reserve(const DeviceContext& ctx, CUstream stream, size_t bytes) {
    if (bytes <= capacity_) return absl::OkStatus();
    Release(ctx, stream);
    CUdeviceptr p = 0;
    const absl::Status s =
        ctx.stream_ordered
            ? ctx.Check(ctx.api().cuMemAllocAsync(&p, bytes, stream), "cuMemAllocAsync")
            : ctx.Check(ctx.api().cuMemAlloc_v2(&p, bytes), "cuMemAlloc");
    if (!s.ok()) return s;
    ptr_ = p;
    capacity_ = bytes;
    return absl::OkStatus();
  }

  void Release(const DeviceContext& ctx, CUstream stream) {
    if (ptr_ == 0) return;
    if (ctx.stream_ordered) {
      ctx.api().cuMemFreeAsync(ptr_, stream);
    } else {
      ctx.api().cuMemFree_v2(ptr_);
    }
    ptr_ = 0;
    capacity_ = 0;
  }

  CUdeviceptr get() const { return ptr_; }

 private:
  CUdeviceptr ptr_ = 0;
  size_t capacity_ = 0;
};

// Page-locked host memory for the copies to and from the device.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

  absl::Status Reserve(const DeviceContext& ctx, size_t bytes) {
    if (bytes <= capacity_) return absl::OkStatus();
    Release(ctx);
    void* p = nullptr;
    NORMGRAD_RETURN_IF_ERROR(ctx.Check(ctx.api().cuMemHostAlloc(&p, bytes, 0), "cuMemHostAlloc"));
    ptr_ = static_cast<uint8_t*>(p);
    capacity_ = bytes;
    return absl::OkStatus();
  }

  void Release(const DeviceContext& ctx) {
    if (ptr_ != nullptr) ctx.api().cuMemFreeHost(ptr_);
    ptr_ = nullptr;
    capacity_ = 0;
  }

  uint8_t* get() const { return ptr_; }

 private:
  uint8_t* ptr_ = nullptr;
  size_t capacity_ = 0;
};

// How a session computes: on the GPU through a kernels::BackwardPlan (which kernels, in which
// order, with which workspace), or on the host for a given rms with rows no GPU kernel takes it
// for (hidden_dim > 32 without the row-resident kernel): dx and grad_gamma from the CPU
// backend's rows, exactly from the given rms.
//
// Device memory of a chunk: x, dy, dx (and rms) in device buffers grown to the largest chunk,
// the plan's workspace, and the chunk's f32 grad_gamma, which the host adds (double) in chunk
// order. Where the plan leaves grad_gamma to the caller (DgammaOutput::kNone), the host computes
// it from the chunk and the given rms.
class CudaBackwardSession : public BackwardSession, private kernels::KernelLauncher {
 public:
  // plan: null for the host path; modules: one per plan step, loaded in the device's context.
  // gamma: hidden_dim elements of spec.dtype as given; gamma_f32: the same as f32 (host paths).
  CudaBackwardSession(std::shared_ptr<const DeviceContext> ctx, const BatchSpec& spec,
                      std::optional<kernels::BackwardPlan> plan,
                      std::vector<std::shared_ptr<const LoadedModule>> modules,
                      std::vector<uint8_t> gamma, std::vector<float> gamma_f32)
      : ctx_(std::move(ctx)),
        spec_(spec),
        plan_(std::move(plan)),
        modules_(std::move(modules)),
        element_bytes_(backend_internal::ElementBytes(spec.dtype)),
        gamma_(std::move(gamma)),
        gamma_f32_(std::move(gamma_f32)),
        dgamma_sum_(spec.hidden_dim, 0.0) {}

  ~CudaBackwardSession() override {
    // A failed device: nothing can be freed, and a synchronize might never return.
    if (!ctx_->failure().ok() || !ctx_->MakeCurrent().ok()) return;
    for (DeviceBuffer* b : {&d_gamma_, &d_x_, &d_dy_, &d_dx_, &d_rms_, &d_dgamma_, &d_workspace_}) {
      b->Release(*ctx_, stream_);
    }
    if (stream_ != nullptr) {
      ctx_->api().cuStreamSynchronize(stream_);
      ctx_->api().cuStreamDestroy_v2(stream_);
    }
    in_.Release(*ctx_);
    out_.Release(*ctx_);
  }

  // Stream, gamma upload. Called once before the session is handed out.
  absl::Status Init() {
    if (!plan_.has_value()) return absl::OkStatus();
    const cuda::DriverApi& api = ctx_->api();
    NORMGRAD_RETURN_IF_ERROR(ctx_->MakeCurrent());
    NORMGRAD_RETURN_IF_ERROR(
        ctx_->Check(api.cuStreamCreate(&stream_, CU_STREAM_NON_BLOCKING), "cuStreamCreate"));
    const size_t gamma_bytes = gamma_.size();
    NORMGRAD_RETURN_IF_ERROR(d_gamma_.Reserve(*ctx_, stream_, gamma_bytes));
    NORMGRAD_RETURN_IF_ERROR(in_.Reserve(*ctx_, gamma_bytes));
    std::memcpy(in_.get(), gamma_.data(), gamma_bytes);
    NORMGRAD_RETURN_IF_ERROR(
        ctx_->Check(api.cuMemcpyHtoDAsync_v2(d_gamma_.get(), in_.get(), gamma_bytes, stream_),
                    "cuMemcpyHtoDAsync(gamma)"));
    if (plan_->dgamma_output() != kernels::DgammaOutput::kNone) {  // f32 for every dtype
      NORMGRAD_RETURN_IF_ERROR(d_dgamma_.Reserve(*ctx_, stream_, spec_.hidden_dim * sizeof(float)));
    }
    // The staging buffer is reused by the first chunk: the upload must be done by then.
    return ctx_->Synchronize(stream_);
  }

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
      broken_ = s;  // device buffers may hold half a chunk: the session cannot go on
      return s;
    }
    rows_done_ += rows;
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

  absl::Status DeviceChunk(absl::Span<const uint8_t> x, absl::Span<const uint8_t> dy,
                           absl::Span<const float> rms, uint64_t rows, absl::Span<uint8_t> dx) {
    const cuda::DriverApi& api = ctx_->api();
    const kernels::BackwardPlan& plan = *plan_;
    const size_t h = spec_.hidden_dim;
    const size_t data_bytes = rows * h * element_bytes_;
    const bool rms_to_device = plan.requires_rms() || (plan.reads_rms() && spec_.rms_provided);
    const bool dgamma_on_device = plan.dgamma_output() != kernels::DgammaOutput::kNone;
    const size_t rms_bytes = rms_to_device ? rows * sizeof(float) : 0;
    const size_t dgamma_bytes = dgamma_on_device ? h * sizeof(float) : 0;
    const size_t workspace_bytes = plan.WorkspaceBytes(rows);
    // grad_gamma (f32) follows dx in the output staging buffer, 16-byte aligned (dx of a 16-bit
    // dtype may end mid-float).
    const size_t dgamma_offset = (data_bytes + 15) / 16 * 16;
    NORMGRAD_RETURN_IF_ERROR(ctx_->MakeCurrent());
    for (auto [buffer, bytes] : {std::pair{&d_x_, data_bytes}, std::pair{&d_dy_, data_bytes},
                                 std::pair{&d_dx_, data_bytes}, std::pair{&d_rms_, rms_bytes},
                                 std::pair{&d_workspace_, workspace_bytes}}) {
      if (bytes != 0) NORMGRAD_RETURN_IF_ERROR(buffer->Reserve(*ctx_, stream_, bytes));
    }
    // A chunk whose x, dy, rms and dx all lie in registered host memory (a shared-memory
    // region) is copied straight from and to it; any other goes through the pinned buffers.
    const bool in_place = ctx_->IsRegisteredHost(x.data(), data_bytes) &&
                          ctx_->IsRegisteredHost(dy.data(), data_bytes) &&
                          (rms_bytes == 0 || ctx_->IsRegisteredHost(rms.data(), rms_bytes)) &&
                          ctx_->IsRegisteredHost(dx.data(), data_bytes);
    if (!in_place) NORMGRAD_RETURN_IF_ERROR(in_.Reserve(*ctx_, 2 * data_bytes + rms_bytes));
    NORMGRAD_RETURN_IF_ERROR(out_.Reserve(*ctx_, dgamma_offset + dgamma_bytes));

    const uint8_t* x_host = x.data();
    const uint8_t* dy_host = dy.data();
    const uint8_t* rms_host = reinterpret_cast<const uint8_t*>(rms.data());
    if (!in_place) {
      uint8_t* in = in_.get();
      std::memcpy(in, x.data(), data_bytes);
      std::memcpy(in + data_bytes, dy.data(), data_bytes);
      if (rms_bytes != 0) std::memcpy(in + 2 * data_bytes, rms.data(), rms_bytes);
      x_host = in;
      dy_host = in + data_bytes;
      rms_host = in + 2 * data_bytes;
    }
    NORMGRAD_RETURN_IF_ERROR(ctx_->Check(
        api.cuMemcpyHtoDAsync_v2(d_x_.get(), x_host, data_bytes, stream_), "cuMemcpyHtoDAsync(x)"));
    NORMGRAD_RETURN_IF_ERROR(
        ctx_->Check(api.cuMemcpyHtoDAsync_v2(d_dy_.get(), dy_host, data_bytes, stream_),
                    "cuMemcpyHtoDAsync(dy)"));
    if (rms_bytes != 0) {
      NORMGRAD_RETURN_IF_ERROR(ctx_->Check(
          api.cuMemcpyHtoDAsync_v2(d_rms_.get(), rms_host, rms_bytes, stream_),
          "cuMemcpyHtoDAsync(rms)"));
    }
    if (plan.dgamma_output() == kernels::DgammaOutput::kAccumulated) {  // atomics add into it
      NORMGRAD_RETURN_IF_ERROR(ctx_->Check(api.cuMemsetD32Async(d_dgamma_.get(), 0, h, stream_),
                                           "cuMemsetD32Async(grad_gamma)"));
    }
    kernels::BackwardArgs args;
    args.x = d_x_.get();
    args.dy = d_dy_.get();
    args.dx = d_dx_.get();
    args.gamma = d_gamma_.get();
    args.rms = rms_bytes != 0 ? d_rms_.get() : 0;
    args.dgamma = d_dgamma_.get();
    args.workspace = d_workspace_.get();
    args.rows = rows;
    args.hidden_dim = spec_.hidden_dim;
    args.eps = spec_.eps;
    NORMGRAD_RETURN_IF_ERROR(plan.Run(args, *this));

    uint8_t* out = out_.get();
    NORMGRAD_RETURN_IF_ERROR(
        ctx_->Check(api.cuMemcpyDtoHAsync_v2(in_place ? dx.data() : out, d_dx_.get(), data_bytes,
                                             stream_),
                    "cuMemcpyDtoHAsync(dx)"));
    if (dgamma_bytes != 0) {
      NORMGRAD_RETURN_IF_ERROR(ctx_->Check(
          api.cuMemcpyDtoHAsync_v2(out + dgamma_offset, d_dgamma_.get(), dgamma_bytes, stream_),
          "cuMemcpyDtoHAsync(grad_gamma)"));
    }
    NORMGRAD_RETURN_IF_ERROR(ctx_->Synchronize(stream_));
    if (!in_place) std::memcpy(dx.data(), out, data_bytes);
    if (dgamma_on_device) {
      const float* chunk_dgamma = reinterpret_cast<const float*>(out + dgamma_offset);
      for (size_t i = 0; i < h; ++i) dgamma_sum_[i] += chunk_dgamma[i];
    } else {
      AddHostGradGamma(x, dy, rms, rows);
    }
    return absl::OkStatus();
  }

  // grad_gamma_i += dy_ri * x_ri / rms_r in row order (double), for the warp plan's narrow rows.
  void AddHostGradGamma(absl::Span<const uint8_t> x, absl::Span<const uint8_t> dy,
                        absl::Span<const float> rms, uint64_t rows) {
    const size_t h = spec_.hidden_dim;
    std::vector<float> xf(rows * h), yf(rows * h);
    host_rows::ConvertToF32(spec_.dtype, x.data(), xf.data(), xf.size());
    host_rows::ConvertToF32(spec_.dtype, dy.data(), yf.data(), yf.size());
    for (uint64_t r = 0; r < rows; ++r) {
      const double inv_rms = 1.0 / static_cast<double>(rms[r]);
      for (size_t i = 0; i < h; ++i) {
        dgamma_sum_[i] += static_cast<double>(yf[r * h + i]) * xf[r * h + i] * inv_rms;
      }
    }
  }

  // The host path: the CPU backend's rows with the given rms (exact), one thread.
  absl::Status HostChunk(absl::Span<const uint8_t> x, absl::Span<const uint8_t> dy,
                         absl::Span<const float> rms, uint64_t rows, absl::Span<uint8_t> dx) {
    const size_t n = rows * spec_.hidden_dim;
    std::vector<float> staged(3 * n);
    host_rows::ConvertToF32(spec_.dtype, x.data(), staged.data(), n);
    host_rows::ConvertToF32(spec_.dtype, dy.data(), staged.data() + n, n);
    std::vector<double> partial(spec_.hidden_dim, 0.0);
    host_rows::RowBlock block;
    block.x = staged.data();
    block.dy = staged.data() + n;
    block.dx = staged.data() + 2 * n;
    block.gamma = gamma_f32_.data();
    block.rms = rms.data();
    block.dgamma = partial.data();
    block.num_rows = rows;
    block.hidden_dim = spec_.hidden_dim;
    block.eps = spec_.eps;
    host_rows::BackwardRowsF32(block);
    host_rows::ConvertFromF32(spec_.dtype, block.dx, dx.data(), n);
    for (size_t i = 0; i < partial.size(); ++i) dgamma_sum_[i] += partial[i];
    return absl::OkStatus();
  }

  const std::shared_ptr<const DeviceContext> ctx_;
  const BatchSpec spec_;
  const std::optional<kernels::BackwardPlan> plan_;                 // empty: the host path
  const std::vector<std::shared_ptr<const LoadedModule>> modules_;  // one per plan step
  const size_t element_bytes_;
  const std::vector<uint8_t> gamma_;
  const std::vector<float> gamma_f32_;
  CUstream stream_ = nullptr;
  DeviceBuffer d_gamma_, d_x_, d_dy_, d_dx_, d_rms_, d_dgamma_, d_workspace_;
  PinnedBuffer in_, out_;
  std::vector<double> dgamma_sum_;
  uint64_t rows_done_ = 0;
  double compute_seconds_ = 0;
  absl::Status broken_;
};

class CudaBackend : public Backend {
 public:
  CudaBackend(std::shared_ptr<const DeviceContext> ctx, DeviceDescription device, int target_sm,
              ModuleCacheOptions cache)
      : ctx_(std::move(ctx)), device_(std::move(device)), target_sm_(target_sm), cache_(cache) {}

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
    auto session =
        std::make_unique<CudaBackwardSession>(ctx_, spec, std::move(plan), std::move(modules),
                                              std::move(gamma_bytes), std::move(gamma_f32));
    NORMGRAD_RETURN_IF_ERROR(session->Init());
    return std::unique_ptr<BackwardSession>(std::move(session));
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
  return std::unique_ptr<Backend>(
      new CudaBackend(std::move(ctx), std::move(d), major * 10 + minor, options.cache));
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
