#include "server/cuda/cuda_backend.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/kernel_registry.h"
#include "server/backend/batch_checks.h"
#include "server/backend/cpu_rows.h"
#include "server/backend/kernel_choice.h"
#include "server/cuda/driver_api.h"

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
  absl::Status Check(CUresult r, absl::string_view call) const { return driver_->Check(r, call); }

  // Every thread that issues work calls this first.
  absl::Status MakeCurrent() const {
    return Check(api().cuCtxSetCurrent(context_), "cuCtxSetCurrent");
  }

  CUdevice device() const { return device_; }
  bool stream_ordered = false;  // set once during start-up
  uint32_t max_grid_x = 65535;  // set once during start-up

 private:
  std::shared_ptr<const CudaDriver> driver_;
  CUdevice device_;
  CUcontext context_;
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
  if (absl::Status s = ctx->MakeCurrent(); !s.ok()) return s;
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
    return absl::InternalError(message);
  }
  if (absl::Status s = ctx->Check(
          ctx->api().cuModuleGetFunction(&loaded->function, loaded->module, ptx.entry.c_str()),
          absl::StrCat("cuModuleGetFunction(", ptx.entry, ")"));
      !s.ok()) {
    return s;
  }
  return std::shared_ptr<const LoadedModule>(std::move(loaded));
}

enum class Plan {
  kRowResident,  // rms_norm_backward_row_resident + rms_norm_backward_dgamma_reduce: dx and a
                 // fixed-order grad_gamma on the GPU, with or without a given rms
  kBatched,      // batched_rms_norm_backward: dx and grad_gamma (atomics) on the GPU
  kWarp,         // rms_norm_backward: dx on the GPU with the given rms; grad_gamma on the host
  kHost,         // rms given, hidden_dim > 32: dx and grad_gamma on the host from the given rms
};

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
    if (absl::Status s = ctx.Check(ctx.api().cuMemHostAlloc(&p, bytes, 0), "cuMemHostAlloc");
        !s.ok()) {
      return s;
    }
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

class CudaBackwardSession : public BackwardSession {
 public:
  // gamma: hidden_dim elements of spec.dtype as given; gamma_f32: the same as f32 (host paths).
  CudaBackwardSession(std::shared_ptr<const DeviceContext> ctx, const BatchSpec& spec, Plan plan,
                      std::shared_ptr<const LoadedModule> module, const kernels::Kernel* kernel,
                      kernels::KernelConfig config, std::vector<uint8_t> gamma,
                      std::vector<float> gamma_f32)
      : ctx_(std::move(ctx)),
        spec_(spec),
        plan_(plan),
        module_(std::move(module)),
        kernel_(kernel),
        config_(config),
        element_bytes_(backend_internal::ElementBytes(spec.dtype)),
        gamma_(std::move(gamma)),
        gamma_f32_(std::move(gamma_f32)),
        dgamma_sum_(spec.hidden_dim, 0.0) {}

  ~CudaBackwardSession() override {
    if (!ctx_->MakeCurrent().ok()) return;  // the context is gone: nothing can be freed
    for (DeviceBuffer* b : {&d_gamma_, &d_x_, &d_dy_, &d_dx_, &d_rms_, &d_dgamma_, &d_partials_}) {
      b->Release(*ctx_, stream_);
    }
    if (stream_ != nullptr) {
      ctx_->api().cuStreamSynchronize(stream_);
      ctx_->api().cuStreamDestroy_v2(stream_);
    }
    in_.Release(*ctx_);
    out_.Release(*ctx_);
  }

  // The reduction for the row-resident plan; set before Init().
  void SetReduce(std::shared_ptr<const LoadedModule> module, const kernels::Kernel* kernel,
                 const kernels::KernelConfig& config) {
    reduce_module_ = std::move(module);
    reduce_kernel_ = kernel;
    reduce_config_ = config;
  }

  // Stream, gamma upload. Called once before the session is handed out.
  absl::Status Init() {
    if (plan_ == Plan::kHost) return absl::OkStatus();
    if (absl::Status s = ctx_->MakeCurrent(); !s.ok()) return s;
    if (absl::Status s = ctx_->Check(ctx_->api().cuStreamCreate(&stream_, CU_STREAM_NON_BLOCKING),
                                     "cuStreamCreate");
        !s.ok()) {
      return s;
    }
    const size_t gamma_bytes = gamma_.size();
    if (absl::Status s = d_gamma_.Reserve(*ctx_, stream_, gamma_bytes); !s.ok()) return s;
    if (absl::Status s = in_.Reserve(*ctx_, gamma_bytes); !s.ok()) return s;
    std::memcpy(in_.get(), gamma_.data(), gamma_bytes);
    if (absl::Status s = ctx_->Check(
            ctx_->api().cuMemcpyHtoDAsync_v2(d_gamma_.get(), in_.get(), gamma_bytes, stream_),
            "cuMemcpyHtoDAsync(gamma)");
        !s.ok()) {
      return s;
    }
    if (plan_ == Plan::kBatched || plan_ == Plan::kRowResident) {  // f32 for every dtype
      if (absl::Status s = d_dgamma_.Reserve(*ctx_, stream_, spec_.hidden_dim * sizeof(float));
          !s.ok()) {
        return s;
      }
    }
    // The staging buffer is reused by the first chunk: the upload must be done by then.
    return ctx_->Check(ctx_->api().cuStreamSynchronize(stream_), "cuStreamSynchronize");
  }

  absl::Status ProcessChunk(absl::Span<const uint8_t> x, absl::Span<const uint8_t> dy,
                            absl::Span<const float> rms, uint64_t rows,
                            absl::Span<uint8_t> dx) override {
    if (!broken_.ok()) return broken_;
    if (absl::Status s = backend_internal::CheckChunk(spec_, rows_done_, rows, x.size(), dy.size(),
                                                      rms.size(), dx.size());
        !s.ok()) {
      return s;
    }
    const auto start = std::chrono::steady_clock::now();
    absl::Status s =
        plan_ == Plan::kHost ? HostChunk(x, dy, rms, rows, dx) : DeviceChunk(x, dy, rms, rows, dx);
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
    if (absl::Status s = backend_internal::CheckFinish(spec_, rows_done_, dgamma.size()); !s.ok()) {
      return s;
    }
    std::vector<float> rounded(dgamma_sum_.begin(), dgamma_sum_.end());
    cpu_internal::ConvertFromF32(spec_.dtype, rounded.data(), dgamma.data(), rounded.size());
    return absl::OkStatus();
  }

  absl::string_view KernelName() const override {
    return plan_ == Plan::kHost ? absl::string_view("cpu_highway") : module_->entry;
  }
  double ComputeSeconds() const override { return compute_seconds_; }

 private:
  absl::Status DeviceChunk(absl::Span<const uint8_t> x, absl::Span<const uint8_t> dy,
                           absl::Span<const float> rms, uint64_t rows, absl::Span<uint8_t> dx) {
    const cuda::DriverApi& api = ctx_->api();
    const size_t h = spec_.hidden_dim;
    const size_t data_bytes = rows * h * element_bytes_;
    const bool rms_to_device =
        plan_ == Plan::kWarp || (plan_ == Plan::kRowResident && spec_.rms_provided);
    const bool dgamma_on_device = plan_ == Plan::kBatched || plan_ == Plan::kRowResident;
    const size_t rms_bytes = rms_to_device ? rows * sizeof(float) : 0;
    const size_t dgamma_bytes = dgamma_on_device ? h * sizeof(float) : 0;
    // grad_gamma (f32) follows dx in the output staging buffer, 16-byte aligned (dx of a 16-bit
    // dtype may end mid-float).
    const size_t dgamma_offset = (data_bytes + 15) / 16 * 16;
    if (absl::Status s = ctx_->MakeCurrent(); !s.ok()) return s;
    for (auto [buffer, bytes] : {std::pair{&d_x_, data_bytes}, std::pair{&d_dy_, data_bytes},
                                 std::pair{&d_dx_, data_bytes}, std::pair{&d_rms_, rms_bytes}}) {
      if (bytes == 0) continue;
      if (absl::Status s = buffer->Reserve(*ctx_, stream_, bytes); !s.ok()) return s;
    }
    if (absl::Status s = in_.Reserve(*ctx_, 2 * data_bytes + rms_bytes); !s.ok()) return s;
    if (absl::Status s = out_.Reserve(*ctx_, dgamma_offset + dgamma_bytes); !s.ok()) return s;

    uint8_t* in = in_.get();
    std::memcpy(in, x.data(), data_bytes);
    std::memcpy(in + data_bytes, dy.data(), data_bytes);
    if (rms_bytes != 0) std::memcpy(in + 2 * data_bytes, rms.data(), rms_bytes);
    if (absl::Status s = ctx_->Check(api.cuMemcpyHtoDAsync_v2(d_x_.get(), in, data_bytes, stream_),
                                     "cuMemcpyHtoDAsync(x)");
        !s.ok()) {
      return s;
    }
    if (absl::Status s =
            ctx_->Check(api.cuMemcpyHtoDAsync_v2(d_dy_.get(), in + data_bytes, data_bytes, stream_),
                        "cuMemcpyHtoDAsync(dy)");
        !s.ok()) {
      return s;
    }
    if (rms_bytes != 0) {
      if (absl::Status s = ctx_->Check(
              api.cuMemcpyHtoDAsync_v2(d_rms_.get(), in + 2 * data_bytes, rms_bytes, stream_),
              "cuMemcpyHtoDAsync(rms)");
          !s.ok()) {
        return s;
      }
    }
    if (plan_ == Plan::kBatched) {  // the atomics add into it; the reduction overwrites it
      if (absl::Status s = ctx_->Check(api.cuMemsetD32Async(d_dgamma_.get(), 0, h, stream_),
                                       "cuMemsetD32Async(grad_gamma)");
          !s.ok()) {
        return s;
      }
    }
    if (absl::Status s =
            plan_ == Plan::kRowResident ? LaunchRowResident(rows) : LaunchSeedKernel(rows);
        !s.ok()) {
      return s;
    }
    uint8_t* out = out_.get();
    if (absl::Status s =
            ctx_->Check(api.cuMemcpyDtoHAsync_v2(out, d_dx_.get(), data_bytes, stream_),
                        "cuMemcpyDtoHAsync(dx)");
        !s.ok()) {
      return s;
    }
    if (dgamma_bytes != 0) {
      if (absl::Status s = ctx_->Check(
              api.cuMemcpyDtoHAsync_v2(out + dgamma_offset, d_dgamma_.get(), dgamma_bytes, stream_),
              "cuMemcpyDtoHAsync(grad_gamma)");
          !s.ok()) {
        return s;
      }
    }
    if (absl::Status s = ctx_->Check(api.cuStreamSynchronize(stream_), "cuStreamSynchronize");
        !s.ok()) {
      return s;
    }
    std::memcpy(dx.data(), out, data_bytes);
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
    cpu_internal::ConvertToF32(spec_.dtype, x.data(), xf.data(), xf.size());
    cpu_internal::ConvertToF32(spec_.dtype, dy.data(), yf.data(), yf.size());
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
    cpu_internal::ConvertToF32(spec_.dtype, x.data(), staged.data(), n);
    cpu_internal::ConvertToF32(spec_.dtype, dy.data(), staged.data() + n, n);
    std::vector<double> partial(spec_.hidden_dim, 0.0);
    cpu_internal::RowBlock block;
    block.x = staged.data();
    block.dy = staged.data() + n;
    block.dx = staged.data() + 2 * n;
    block.gamma = gamma_f32_.data();
    block.rms = rms.data();
    block.dgamma = partial.data();
    block.num_rows = rows;
    block.hidden_dim = spec_.hidden_dim;
    block.eps = spec_.eps;
    cpu_internal::BackwardRowsF32(block);
    cpu_internal::ConvertFromF32(spec_.dtype, block.dx, dx.data(), n);
    for (size_t i = 0; i < partial.size(); ++i) dgamma_sum_[i] += partial[i];
    return absl::OkStatus();
  }

  // A kernel argument, by the parameter's declared PTX type.
  struct Arg {
    std::string ptx_type;  // "u64", "u32", "f32"
    uint64_t u64 = 0;
    uint32_t u32 = 0;
    float f32 = 0;
  };
  static Arg U64(uint64_t v) { return Arg{"u64", v, 0, 0}; }
  static Arg U32(uint32_t v) { return Arg{"u32", 0, v, 0}; }
  static Arg F32(float v) { return Arg{"f32", 0, 0, v}; }

  // One cuLaunchKernel of `module` with its parameters filled by name from `args`.
  absl::Status LaunchOnce(const LoadedModule& module, const kernels::LaunchGeometry& g,
                          const std::vector<std::pair<absl::string_view, Arg>>& args) {
    std::vector<Arg> slots(module.params.size());
    std::vector<void*> pointers(module.params.size());
    for (size_t k = 0; k < module.params.size(); ++k) {
      const kernels::KernelParam& p = module.params[k];
      auto it =
          std::find_if(args.begin(), args.end(), [&](const auto& a) { return a.first == p.name; });
      if (it == args.end()) {
        return absl::InternalError(absl::StrCat("kernel ", module.entry, " has parameter ", p.name,
                                                " that the CUDA backend cannot fill"));
      }
      slots[k] = it->second;
      if (p.ptx_type != slots[k].ptx_type) {
        return absl::InternalError(absl::StrCat("kernel ", module.entry, " parameter ", p.name,
                                                " is ", p.ptx_type, "; expected ",
                                                slots[k].ptx_type));
      }
      pointers[k] = slots[k].ptx_type == "u64"   ? static_cast<void*>(&slots[k].u64)
                    : slots[k].ptx_type == "u32" ? static_cast<void*>(&slots[k].u32)
                                                 : static_cast<void*>(&slots[k].f32);
    }
    return ctx_->Check(ctx_->api().cuLaunchKernel(
                           module.function, g.grid[0], g.grid[1], g.grid[2], g.block[0], g.block[1],
                           g.block[2], g.shared_bytes, stream_, pointers.data(), nullptr),
                       absl::StrCat("cuLaunchKernel(", module.entry, ")"));
  }

  // The seed kernels over `rows` rows, in pieces when the grid would exceed the device's limit.
  absl::Status LaunchSeedKernel(uint64_t rows) {
    uint64_t piece = std::min<uint64_t>(rows, std::numeric_limits<uint32_t>::max());
    while (piece > 1 && kernel_->Geometry(config_, piece).grid[0] > ctx_->max_grid_x) {
      piece = (piece + 1) / 2;
    }
    const size_t h = spec_.hidden_dim;
    for (uint64_t first = 0; first < rows; first += piece) {
      const uint64_t n = std::min(piece, rows - first);
      const uint64_t data_offset = first * h * element_bytes_;
      if (absl::Status s = LaunchOnce(*module_, kernel_->Geometry(config_, n),
                                      {{"input_ptr", U64(d_x_.get() + data_offset)},
                                       {"grad_output_ptr", U64(d_dy_.get() + data_offset)},
                                       {"grad_input_ptr", U64(d_dx_.get() + data_offset)},
                                       {"gamma_ptr", U64(d_gamma_.get())},
                                       {"rms_ptr", U64(d_rms_.get() + first * sizeof(float))},
                                       {"grad_gamma_ptr", U64(d_dgamma_.get())},
                                       {"num_rows", U32(static_cast<uint32_t>(n))},
                                       {"hidden_dim", U32(spec_.hidden_dim)},
                                       {"eps", F32(spec_.eps)}});
          !s.ok()) {
        return s;
      }
    }
    return absl::OkStatus();
  }

  // The row-resident kernel (persistent grid: G blocks, G partial rows of grad_gamma), then the
  // fixed-order reduction of the partials into the f32 chunk grad_gamma.
  absl::Status LaunchRowResident(uint64_t rows) {
    const kernels::LaunchGeometry g = kernel_->Geometry(config_, rows);
    const uint32_t partials = g.grid[0];
    if (absl::Status s = d_partials_.Reserve(*ctx_, stream_,
                                             size_t{partials} * spec_.hidden_dim * sizeof(float));
        !s.ok()) {
      return s;
    }
    if (absl::Status s = LaunchOnce(*module_, g,
                                    {{"input_ptr", U64(d_x_.get())},
                                     {"grad_output_ptr", U64(d_dy_.get())},
                                     {"grad_input_ptr", U64(d_dx_.get())},
                                     {"gamma_ptr", U64(d_gamma_.get())},
                                     {"rms_ptr", U64(spec_.rms_provided ? d_rms_.get() : 0)},
                                     {"dgamma_partials_ptr", U64(d_partials_.get())},
                                     {"num_rows", U32(static_cast<uint32_t>(rows))},
                                     {"hidden_dim", U32(spec_.hidden_dim)},
                                     {"eps", F32(spec_.eps)}});
        !s.ok()) {
      return s;
    }
    return LaunchOnce(*reduce_module_, reduce_kernel_->Geometry(reduce_config_, partials),
                      {{"dgamma_partials_ptr", U64(d_partials_.get())},
                       {"dgamma_ptr", U64(d_dgamma_.get())},
                       {"num_partials", U32(partials)},
                       {"hidden_dim", U32(spec_.hidden_dim)}});
  }

  const std::shared_ptr<const DeviceContext> ctx_;
  const BatchSpec spec_;
  const Plan plan_;
  const std::shared_ptr<const LoadedModule> module_;  // null on the host plan
  const kernels::Kernel* const kernel_;               // null on the host plan
  const kernels::KernelConfig config_;
  // The row-resident plan's grad_gamma reduction (null otherwise).
  std::shared_ptr<const LoadedModule> reduce_module_;
  const kernels::Kernel* reduce_kernel_ = nullptr;
  kernels::KernelConfig reduce_config_;
  const size_t element_bytes_;
  const std::vector<uint8_t> gamma_;
  const std::vector<float> gamma_f32_;
  CUstream stream_ = nullptr;
  DeviceBuffer d_gamma_, d_x_, d_dy_, d_dx_, d_rms_, d_dgamma_, d_partials_;
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
    if (absl::Status s = backend_internal::CheckBatch(spec, gamma.size()); !s.ok()) return s;
    if (absl::Status s = backend_internal::CheckNamedKernel(spec); !s.ok()) return s;
    kernels::KernelConfig config = backend_internal::ConfigFor(spec, target_sm_);
    config.sm_count = device_.sm_count;  // sizes the row-resident kernel's persistent grid
    const kernels::Kernel* row_resident = kernels::FindKernel(kRowResidentKernel);
    Plan plan;
    if (spec.kernel.empty()) {
      // The row-resident kernel when it fits (any rms, reproducible grad_gamma); else the
      // seed kernels; else the host path for a given rms with wide rows.
      plan = row_resident != nullptr && row_resident->CanImplement(config).ok() ? Plan::kRowResident
             : !spec.rms_provided                                               ? Plan::kBatched
             : spec.hidden_dim <= 32                                            ? Plan::kWarp
                                                                                : Plan::kHost;
    } else {
      plan = spec.kernel == kWarpKernel          ? Plan::kWarp
             : spec.kernel == kRowResidentKernel ? Plan::kRowResident
                                                 : Plan::kBatched;
    }
    std::vector<uint8_t> gamma_bytes(gamma.begin(), gamma.end());
    std::vector<float> gamma_f32(spec.hidden_dim);
    cpu_internal::ConvertToF32(spec.dtype, gamma.data(), gamma_f32.data(), gamma_f32.size());

    std::shared_ptr<const LoadedModule> module;
    const kernels::Kernel* kernel = nullptr;
    if (plan != Plan::kHost) {
      kernel = kernels::FindKernel(plan == Plan::kWarp          ? kWarpKernel
                                   : plan == Plan::kRowResident ? kRowResidentKernel
                                                                : kBatchedKernel);
      if (kernel == nullptr) {
        return absl::InternalError("the kernels library lacks a backward kernel");
      }
      absl::StatusOr<std::shared_ptr<const LoadedModule>> m = GetModule(*kernel, config);
      if (!m.ok()) return m.status();
      module = *std::move(m);
    }
    std::shared_ptr<const LoadedModule> reduce_module;
    const kernels::Kernel* reduce_kernel = nullptr;
    kernels::KernelConfig reduce_config = config;
    if (plan == Plan::kRowResident) {
      reduce_kernel = kernels::FindKernel(kDgammaReduceKernel);
      if (reduce_kernel == nullptr) {
        return absl::InternalError("the kernels library lacks the grad_gamma reduction");
      }
      reduce_config.dtype = kernels::DType::kF32;  // the chunk's grad_gamma stays f32
      absl::StatusOr<std::shared_ptr<const LoadedModule>> m =
          GetModule(*reduce_kernel, reduce_config);
      if (!m.ok()) return m.status();
      reduce_module = *std::move(m);
    }
    auto session =
        std::make_unique<CudaBackwardSession>(ctx_, spec, plan, std::move(module), kernel, config,
                                              std::move(gamma_bytes), std::move(gamma_f32));
    if (plan == Plan::kRowResident) {
      session->SetReduce(std::move(reduce_module), reduce_kernel, reduce_config);
    }
    if (absl::Status s = session->Init(); !s.ok()) return s;
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

 private:
  absl::StatusOr<std::shared_ptr<const LoadedModule>> GetModule(
      const kernels::Kernel& kernel, const kernels::KernelConfig& config) {
    if (absl::Status s = kernel.CanImplement(config); !s.ok()) {
      kernels::KernelConfig elsewhere = config;
      elsewhere.target_sm = backend_internal::kProbeTargetSm;
      if (kernel.CanImplement(elsewhere).ok()) {  // the request is fine; this GPU is not
        return absl::FailedPreconditionError(absl::StrCat("GPU ", device_.name, " (sm_", target_sm_,
                                                          ") cannot run ", kernel.EntryName(), ": ",
                                                          s.message()));
      }
      return s;
    }
    return cache_.GetOrCompile(
        kernel.ConfigKey(config), [&]() -> absl::StatusOr<ModuleCache<LoadedModule>::Compiled> {
          absl::StatusOr<kernels::EmittedPtx> ptx = kernel.Emit(config);
          if (!ptx.ok()) return ptx.status();
          absl::StatusOr<std::shared_ptr<const LoadedModule>> loaded = LoadModule(ctx_, *ptx);
          if (!loaded.ok()) return loaded.status();
          return ModuleCache<LoadedModule>::Compiled{*std::move(loaded), ptx->text.size()};
        });
  }

  const std::shared_ptr<const DeviceContext> ctx_;
  const DeviceDescription device_;
  const int target_sm_;
  ModuleCache<LoadedModule> cache_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> NewCudaBackend(const CudaBackendOptions& options) {
  const std::string path = cuda::ResolveDriverLibrary(options.driver_library);
  absl::StatusOr<std::shared_ptr<const CudaDriver>> loaded = CudaDriver::Load(path);
  if (!loaded.ok()) return loaded.status();
  std::shared_ptr<const CudaDriver> driver = *std::move(loaded);
  const cuda::DriverApi& api = driver->api();
  // Start-up failures all mean "no usable GPU here".
  auto unusable = [&](const absl::Status& s) {
    return absl::FailedPreconditionError(absl::StrCat(path, ": ", s.message()));
  };
  if (absl::Status s = driver->Check(api.cuInit(0), "cuInit"); !s.ok()) return unusable(s);
  int driver_version = 0;
  if (absl::Status s = driver->Check(api.cuDriverGetVersion(&driver_version), "cuDriverGetVersion");
      !s.ok()) {
    return unusable(s);
  }
  int count = 0;
  if (absl::Status s = driver->Check(api.cuDeviceGetCount(&count), "cuDeviceGetCount"); !s.ok()) {
    return unusable(s);
  }
  if (count < 1) return absl::FailedPreconditionError(absl::StrCat(path, ": no CUDA device"));
  if (options.device_ordinal < 0 || options.device_ordinal >= count) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, ": device ordinal ", options.device_ordinal, " out of range (", count, " devices)"));
  }
  CUdevice device = 0;
  if (absl::Status s =
          driver->Check(api.cuDeviceGet(&device, options.device_ordinal), "cuDeviceGet");
      !s.ok()) {
    return unusable(s);
  }
  DeviceDescription d;
  char name[256] = {};
  if (absl::Status s =
          driver->Check(api.cuDeviceGetName(name, sizeof(name) - 1, device), "cuDeviceGetName");
      !s.ok()) {
    return unusable(s);
  }
  d.name = name;
  int major = 0, minor = 0, sms = 0, max_grid_x = 0, pools = 0;
  for (auto [attribute, out, label] :
       {std::tuple{CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, &major,
                   "compute capability major"},
        std::tuple{CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, &minor,
                   "compute capability minor"},
        std::tuple{CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, &sms, "multiprocessor count"},
        std::tuple{CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X, &max_grid_x, "max grid dim x"}}) {
    if (absl::Status s = driver->Check(api.cuDeviceGetAttribute(out, attribute, device),
                                       absl::StrCat("cuDeviceGetAttribute(", label, ")"));
        !s.ok()) {
      return unusable(s);
    }
  }
  size_t total = 0;
  if (absl::Status s = driver->Check(api.cuDeviceTotalMem_v2(&total, device), "cuDeviceTotalMem");
      !s.ok()) {
    return unusable(s);
  }
  d.compute_capability_major = major;
  d.compute_capability_minor = minor;
  d.total_memory_bytes = total;
  d.driver_version = cuda::DriverVersionString(driver_version);
  d.max_ptx_version = cuda::MaxPtxVersionForDriver(driver_version);
  d.sm_count = static_cast<uint32_t>(sms);

  CUcontext context = nullptr;
  if (absl::Status s =
          driver->Check(api.cuDevicePrimaryCtxRetain(&context, device), "cuDevicePrimaryCtxRetain");
      !s.ok()) {
    return unusable(s);
  }
  auto ctx = std::make_shared<DeviceContext>(driver, device, context);
  ctx->max_grid_x = max_grid_x > 0 ? static_cast<uint32_t>(max_grid_x) : 65535u;
  if (absl::Status s = ctx->MakeCurrent(); !s.ok()) return unusable(s);

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

}  // namespace normgrad::server
