// normgrad-gpu-bench: memory bandwidth of the RMSNorm-backward kernels on a real GPU, against the
// device's own copy bandwidth measured in the same run.
//
//   normgrad-gpu-bench [--smoke] [--iters N] [--json out.json] [--dtypes f32,bf16]
//
// The driver is loaded the way the server loads it (nvidia/driver_api.h:
// $NORMGRAD_CUDA_DRIVER, else libcuda.so.1), so the emulated driver runs the same program at
// --smoke shapes. For each dtype and shape (rows x hidden: 1x896, 64x4096, 4096x896, 4096x4096,
// 16384x4096, 8192x8192, 32768x896, and streamed rows 256x65536 and 1024x65536, where the
// row-resident kernel reads x and dy twice and the batched kernel is what ran before; --smoke:
// 1x896, 64x896, 8x4096, 2x16384, 2x20000):
//   - copy: a 16-byte-vector copy kernel over (2 + 1) * rows * hidden elements' worth of bytes
//     (what the backward kernels move), bandwidth = bytes read + bytes written / time;
//   - rms_norm_backward_row_resident (one launch: dx and grad_gamma), and trueno-gpu's
//     batched_rms_norm_backward (with its grad_gamma memset);
// bandwidth = (x + dy read + dx written) bytes / median time of N launches (CUDA events), and the
// fraction of the copy bandwidth. Before every run (warm-up included) of every kernel, the copy
// too, L2 is flushed: a memset of a buffer twice CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, outside the
// timed region, so no run reads its inputs from what the previous run left in L2 (4096x896 f32
// moves 44 MB, less than an H100's 50 MB L2). Each kernel's runs stop early once their timed sum
// passes kTimedBudgetMs (at least kMinTimedRuns runs), so a slow kernel cannot stretch the run. The
// row-resident kernel's dx and dgamma are checked against ReferenceBackward on the first rows (max
// relative error in the output). Prints a table; writes JSON with --json. Exit status: 0; 1 with
// one line on stderr when the device cannot run it; 2 for bad arguments; 3 when the row-resident
// kernel's output is outside the tolerance.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "kernels/kernel_config.h"
#include "kernels/rmsnorm/kernel_registry.h"
#include "kernels/backward_kernel.h"
#include "kernels/ptx/ptx_builder.h"
#include "kernels/ptx/ptx_printer.h"
#include "kernels/ptx/targets.h"
#include "nvidia/driver_api.h"
#include "tests/ptxsim/backward_problem.h"

namespace normgrad::gpu_bench {
namespace {

using kernels::DType;
using server::cuda::CudaDriver;
using server::cuda::DriverApi;

// The row-resident plan's semaphores (as a staging slot of the CUDA backend has).
constexpr size_t kSemaphoreBytes = 4096;

struct Shape {
  uint32_t rows;
  uint32_t hidden;
};

// Exits through main with a message when a driver call fails.
#define BENCH_CHECK(expr, what)                                            \
  do {                                                                     \
    if (absl::Status _s = driver.Check((expr), what); !_s.ok()) return _s; \
  } while (0)

// A grid-stride copy of n16 16-byte vectors: the device's achievable read+write bandwidth.
std::string CopyKernelPtx(int target_sm) {
  using namespace kernels;  // NOLINT: builder vocabulary
  const PtxVersion version = *ResolvePtxVersion(target_sm, std::nullopt, PtxVersion{6, 0});
  Module m(version, target_sm);
  Function& f = m.AddEntry("copy_v4");
  const Param src_p = f.AddParam(PtxType::kU64, "src");
  const Param dst_p = f.AddParam(PtxType::kU64, "dst");
  const Param n_p = f.AddParam(PtxType::kU32, "n16");
  Builder b(&f);
  const Label loop = b.CreateLabel("loop");
  const Label done = b.CreateLabel("done");
  const Value tid = b.Mov(SpecialReg::kTidX);
  const Value ctaid = b.Mov(SpecialReg::kCtaidX);
  const Value ntid = b.Mov(SpecialReg::kNtidX);
  const Value nctaid = b.Mov(SpecialReg::kNctaidX);
  const Value stride = b.Mul(ntid, nctaid);
  const Value i = b.Mad(ctaid, ntid, tid);
  const Value n = b.LdParam(n_p);
  const Value src = b.LdParam(src_p);
  const Value dst = b.LdParam(dst_p);
  b.Bind(loop);
  b.BraIf(b.Setp(CmpOp::kGe, i, n), done);
  const Value off = b.MulWide(i, Value::U32(16));
  const Value from = b.Add(src, off);
  const std::vector<Value> v = b.LdV4(StateSpace::kGlobal, PtxType::kF32, Address{from, 0});
  const Value to = b.Add(dst, off);
  b.StV4(StateSpace::kGlobal, Address{to, 0}, v);
  b.AddTo(i, stride);
  b.Bra(loop);
  b.Bind(done);
  b.Ret();
  return EmitPtx(m);
}

class Bench {
 public:
  Bench(std::shared_ptr<const CudaDriver> driver, int iters)
      : driver_(std::move(driver)), api_(driver_->api()), iters_(iters) {}
  ~Bench() {
    if (flush_ != 0) api_.cuMemFree_v2(flush_);
  }
  Bench(const Bench&) = delete;
  Bench& operator=(const Bench&) = delete;

  absl::Status Init() {
    const CudaDriver& driver = *driver_;
    BENCH_CHECK(api_.cuInit(0), "cuInit");
    int count = 0;
    BENCH_CHECK(api_.cuDeviceGetCount(&count), "cuDeviceGetCount");
    if (count < 1) return absl::FailedPreconditionError("no CUDA device");
    BENCH_CHECK(api_.cuDeviceGet(&device_, 0), "cuDeviceGet");
    char name[256] = {};
    BENCH_CHECK(api_.cuDeviceGetName(name, sizeof(name), device_), "cuDeviceGetName");
    name_ = name;
    int major = 0, minor = 0, sms = 0;
    BENCH_CHECK(
        api_.cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device_),
        "cuDeviceGetAttribute");
    BENCH_CHECK(
        api_.cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device_),
        "cuDeviceGetAttribute");
    BENCH_CHECK(api_.cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device_),
                "cuDeviceGetAttribute");
    sm_count_ = static_cast<uint32_t>(std::max(sms, 1));
    // The newest supported target not above the device's compute capability.
    const int cc = major * 10 + minor;
    for (int t : kernels::SupportedTargets()) {
      if (t <= cc) target_sm_ = t;
    }
    if (target_sm_ == 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("compute capability ", major, ".", minor, " is below sm_75"));
    }
    BENCH_CHECK(api_.cuDevicePrimaryCtxRetain(&ctx_, device_), "cuDevicePrimaryCtxRetain");
    BENCH_CHECK(api_.cuCtxSetCurrent(ctx_), "cuCtxSetCurrent");
    BENCH_CHECK(api_.cuStreamCreate(&stream_, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    BENCH_CHECK(api_.cuEventCreate(&start_, CU_EVENT_DEFAULT), "cuEventCreate");
    BENCH_CHECK(api_.cuEventCreate(&stop_, CU_EVENT_DEFAULT), "cuEventCreate");
    return absl::OkStatus();
  }

  // The flush buffer: twice the L2 size (at least 1 MiB when the driver reports none), allocated
  // once for the whole run and written before every timed run.
  absl::Status AllocateFlushBuffer() {
    const CudaDriver& driver = *driver_;
    int l2 = 0;
    BENCH_CHECK(api_.cuDeviceGetAttribute(&l2, CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, device_),
                "cuDeviceGetAttribute(L2_CACHE_SIZE)");
    l2_bytes_ = static_cast<size_t>(std::max(l2, 0));
    flush_bytes_ = std::max<size_t>(2 * l2_bytes_, size_t{1} << 20);
    BENCH_CHECK(api_.cuMemAlloc_v2(&flush_, flush_bytes_), "cuMemAlloc(L2 flush buffer)");
    return absl::OkStatus();
  }
  // Evicts whatever the previous run left in L2 by writing the flush buffer (stream-ordered
  // before the next start event, so it is not timed).
  absl::Status FlushL2() {
    const CudaDriver& driver = *driver_;
    flush_value_ ^= 1;  // a different value each time: no driver can skip it as a repeat
    BENCH_CHECK(api_.cuMemsetD8Async(flush_, flush_value_, flush_bytes_, stream_),
                "cuMemsetD8Async(L2 flush)");
    return absl::OkStatus();
  }

  const std::string& name() const { return name_; }
  size_t l2_bytes() const { return l2_bytes_; }
  size_t flush_bytes() const { return flush_bytes_; }
  int target_sm() const { return target_sm_; }
  uint32_t sm_count() const { return sm_count_; }

  absl::StatusOr<CUfunction> Load(const std::string& ptx, const std::string& entry) {
    const CudaDriver& driver = *driver_;
    CUmodule module = nullptr;
    BENCH_CHECK(api_.cuModuleLoadDataEx(&module, ptx.c_str(), 0, nullptr, nullptr),
                absl::StrCat("cuModuleLoadDataEx(", entry, ")"));
    CUfunction f = nullptr;
    BENCH_CHECK(api_.cuModuleGetFunction(&f, module, entry.c_str()), "cuModuleGetFunction");
    return f;
  }

  absl::StatusOr<CUdeviceptr> Alloc(size_t bytes) {
    const CudaDriver& driver = *driver_;
    CUdeviceptr p = 0;
    BENCH_CHECK(api_.cuMemAlloc_v2(&p, std::max<size_t>(bytes, 16)), "cuMemAlloc");
    allocations_.push_back(p);
    return p;
  }
  void FreeAll() {
    for (CUdeviceptr p : allocations_) api_.cuMemFree_v2(p);
    allocations_.clear();
  }

  absl::Status Upload(CUdeviceptr dst, const void* src, size_t bytes) {
    const CudaDriver& driver = *driver_;
    void* staging = nullptr;
    BENCH_CHECK(api_.cuMemHostAlloc(&staging, std::max<size_t>(bytes, 16), 0), "cuMemHostAlloc");
    std::memcpy(staging, src, bytes);
    absl::Status s =
        driver.Check(api_.cuMemcpyHtoDAsync_v2(dst, staging, bytes, stream_), "cuMemcpyHtoDAsync");
    if (s.ok()) s = driver.Check(api_.cuStreamSynchronize(stream_), "cuStreamSynchronize");
    api_.cuMemFreeHost(staging);
    return s;
  }
  absl::Status Download(void* dst, CUdeviceptr src, size_t bytes) {
    const CudaDriver& driver = *driver_;
    void* staging = nullptr;
    BENCH_CHECK(api_.cuMemHostAlloc(&staging, std::max<size_t>(bytes, 16), 0), "cuMemHostAlloc");
    absl::Status s =
        driver.Check(api_.cuMemcpyDtoHAsync_v2(staging, src, bytes, stream_), "cuMemcpyDtoHAsync");
    if (s.ok()) s = driver.Check(api_.cuStreamSynchronize(stream_), "cuStreamSynchronize");
    if (s.ok()) std::memcpy(dst, staging, bytes);
    api_.cuMemFreeHost(staging);
    return s;
  }

  // One launch to replay: its function, geometry and a copy of its argument values.
  struct Launch {
    CUfunction f;
    kernels::LaunchGeometry g;
    std::vector<uint64_t> slots;  // one 8-byte slot per parameter (kernels::PackedArgs' layout)
  };

  // Median milliseconds of up to `iters_` timed runs of `launches` (one warm-up run first), each
  // after an L2 flush and `before`; stops after kMinTimedRuns runs once their sum passes
  // kTimedBudgetMs.
  absl::StatusOr<double> Time(const std::vector<Launch>& launches,
                              std::function<absl::Status()> before = nullptr) {
    const CudaDriver& driver = *driver_;
    std::vector<double> ms;
    double timed_sum = 0;
    for (int it = -1; it < iters_; ++it) {
      if (it >= kMinTimedRuns && timed_sum > kTimedBudgetMs) break;
      if (absl::Status s = FlushL2(); !s.ok()) return s;
      if (before) {
        if (absl::Status s = before(); !s.ok()) return s;
      }
      BENCH_CHECK(api_.cuEventRecord(start_, stream_), "cuEventRecord");
      for (const Launch& l : launches) {
        std::vector<uint64_t> slots = l.slots;
        std::vector<void*> args;
        for (uint64_t& slot : slots) args.push_back(&slot);
        BENCH_CHECK(api_.cuLaunchKernel(l.f, l.g.grid[0], l.g.grid[1], l.g.grid[2], l.g.block[0],
                                        l.g.block[1], l.g.block[2], l.g.shared_bytes, stream_,
                                        args.data(), nullptr),
                    "cuLaunchKernel");
      }
      BENCH_CHECK(api_.cuEventRecord(stop_, stream_), "cuEventRecord");
      BENCH_CHECK(api_.cuEventSynchronize(stop_), "cuEventSynchronize");
      float t = 0;
      BENCH_CHECK(api_.cuEventElapsedTime(&t, start_, stop_), "cuEventElapsedTime");
      if (it >= 0) {
        ms.push_back(t);
        timed_sum += t;
      }
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  }

  absl::Status Memset(CUdeviceptr p, size_t words) {
    const CudaDriver& driver = *driver_;
    BENCH_CHECK(api_.cuMemsetD32Async(p, 0, words, stream_), "cuMemsetD32Async");
    return absl::OkStatus();
  }

 private:
  std::shared_ptr<const CudaDriver> driver_;
  // Each kernel's timed runs: at least this many, then only while their sum is within the budget.
  static constexpr int kMinTimedRuns = 5;
  static constexpr double kTimedBudgetMs = 500;

  const DriverApi& api_;
  int iters_;
  CUdevice device_ = 0;
  CUcontext ctx_ = nullptr;
  CUstream stream_ = nullptr;
  CUevent start_ = nullptr, stop_ = nullptr;
  std::string name_;
  int target_sm_ = 0;
  uint32_t sm_count_ = 1;
  std::vector<CUdeviceptr> allocations_;
  CUdeviceptr flush_ = 0;  // allocated once (AllocateFlushBuffer), freed with the Bench
  size_t l2_bytes_ = 0, flush_bytes_ = 0;
  unsigned char flush_value_ = 0;
};

// A plan with its kernel's module loaded; Record() turns one request into the launches Time()
// replays (the same launches, geometry and arguments the CUDA backend makes). Zero fills are not
// recorded: Time's `before` zeroes what the kernel accumulates into.
struct LoadedPlan : public kernels::KernelLauncher {
  std::optional<kernels::BackwardPlan> plan;
  CUfunction function = nullptr;
  std::vector<kernels::KernelParam> params;
  std::vector<Bench::Launch> recorded;

  absl::StatusOr<std::vector<Bench::Launch>> Record(const kernels::BackwardArgs& args) {
    recorded.clear();
    if (absl::Status s = plan->Run(args, *this); !s.ok()) return s;
    return recorded;
  }
  absl::Span<const kernels::KernelParam> Params() const override { return params; }
  absl::Status ZeroFill(uint64_t address, uint64_t bytes) override { return absl::OkStatus(); }
  absl::Status Launch(const kernels::LaunchGeometry& g, void** args) override {
    Bench::Launch l{function, g, {}};
    for (size_t k = 0; k < params.size(); ++k) {
      l.slots.push_back(*static_cast<const uint64_t*>(args[k]));
    }
    recorded.push_back(std::move(l));
    return absl::OkStatus();
  }
};

// The plan of backward kernel `entry` at `c`, with its module loaded.
absl::StatusOr<LoadedPlan> LoadPlan(Bench& bench, absl::string_view entry,
                                    const kernels::KernelConfig& c) {
  const kernels::BackwardKernel* k = kernels::FindKernel(entry);
  if (k == nullptr) return absl::InternalError(absl::StrCat("no kernel ", entry));
  LoadedPlan loaded;
  absl::StatusOr<kernels::BackwardPlan> plan = kernels::BackwardPlan::Create(*k, c);
  if (!plan.ok()) return plan.status();
  loaded.plan = *std::move(plan);
  absl::StatusOr<kernels::EmittedPtx> ptx = loaded.plan->kernel().Emit(loaded.plan->config());
  if (!ptx.ok()) return ptx.status();
  absl::StatusOr<CUfunction> f = bench.Load(ptx->text, ptx->entry);
  if (!f.ok()) return f.status();
  loaded.function = *f;
  loaded.params = ptx->params;
  return loaded;
}

struct Row {
  std::string dtype;
  Shape shape;
  double bytes = 0;
  double copy_ms = 0, row_resident_ms = 0, batched_ms = 0;
  double max_rel_err_dx = 0, max_rel_err_dgamma = 0;
  uint32_t grid = 0, block = 0;
  double GBps(double ms) const { return ms > 0 ? bytes / (ms * 1e-3) / 1e9 : 0; }
};

absl::StatusOr<Row> RunShape(Bench& bench, DType dtype, Shape shape, CUfunction copy) {
  Row row;
  row.dtype = std::string(kernels::DTypeName(dtype));
  row.shape = shape;
  const size_t n = size_t{shape.rows} * shape.hidden;
  const size_t eb = kernels::DTypeBytes(dtype);
  row.bytes = 3.0 * n * eb;

  const kernel_testing::BackwardProblem p =
      kernel_testing::MakeBackwardProblem(dtype, shape.rows, shape.hidden);
  const std::vector<uint8_t> x = kernel_testing::EncodeElements(p.x, dtype);
  const std::vector<uint8_t> dy = kernel_testing::EncodeElements(p.dy, dtype);
  const std::vector<uint8_t> gamma = kernel_testing::EncodeElements(p.gamma, dtype);

  kernels::KernelConfig config;
  config.hidden_dim = shape.hidden;
  config.dtype = dtype;
  config.target_sm = bench.target_sm();
  config.sm_count = bench.sm_count();
  absl::StatusOr<LoadedPlan> row_resident =
      LoadPlan(bench, "rms_norm_backward_row_resident", config);
  if (!row_resident.ok()) return row_resident.status();
  absl::StatusOr<LoadedPlan> batched = LoadPlan(bench, "batched_rms_norm_backward", config);
  if (!batched.ok()) return batched.status();

  const uint64_t workspace_bytes = row_resident->plan->WorkspaceBytes(shape.rows);
  absl::StatusOr<CUdeviceptr> d_x = bench.Alloc(n * eb), d_dy = bench.Alloc(n * eb),
                              d_dx = bench.Alloc(n * eb), d_gamma = bench.Alloc(shape.hidden * eb),
                              d_workspace = bench.Alloc(workspace_bytes),
                              d_dgamma = bench.Alloc(size_t{shape.hidden} * 4),
                              d_semaphores = bench.Alloc(kSemaphoreBytes);
  for (const auto* d : {&d_x, &d_dy, &d_dx, &d_gamma, &d_workspace, &d_dgamma, &d_semaphores}) {
    if (!d->ok()) return d->status();
  }
  // Zeroed once, as the backend does: every run leaves them zero.
  if (row_resident->plan->SemaphoreBytes(shape.rows) > kSemaphoreBytes) {
    return absl::InternalError("the row-resident plan needs more semaphores than allocated");
  }
  if (absl::Status s = bench.Memset(*d_semaphores, kSemaphoreBytes / 4); !s.ok()) return s;
  // Copy: the same bytes moved as the backward (2n read + n written, as 1.5n read + 1.5n written).
  const size_t copy_bytes = (n * eb * 3 / 2 + 15) / 16 * 16;
  absl::StatusOr<CUdeviceptr> c_src = bench.Alloc(copy_bytes), c_dst = bench.Alloc(copy_bytes);
  if (!c_src.ok()) return c_src.status();
  if (!c_dst.ok()) return c_dst.status();
  for (auto [dst, src, bytes] :
       {std::tuple{*d_x, x.data(), x.size()}, std::tuple{*d_dy, dy.data(), dy.size()},
        std::tuple{*d_gamma, gamma.data(), gamma.size()}}) {
    if (absl::Status s = bench.Upload(dst, src, bytes); !s.ok()) return s;
  }

  kernels::BackwardArgs args;
  args.x = *d_x;
  args.dy = *d_dy;
  args.dx = *d_dx;
  args.gamma = *d_gamma;
  args.dgamma = *d_dgamma;
  args.workspace = *d_workspace;
  args.semaphores = *d_semaphores;
  args.rows = shape.rows;
  args.hidden_dim = shape.hidden;
  args.eps = p.eps;
  const kernels::LaunchGeometry g =
      row_resident->plan->kernel().Geometry(row_resident->plan->config(), shape.rows);
  row.grid = g.grid[0];
  row.block = g.block[0];

  const uint32_t copy_grid = bench.sm_count() * 8;
  const uint32_t n16 = static_cast<uint32_t>(copy_bytes / 16);
  kernels::LaunchGeometry copy_g;
  copy_g.grid[0] = copy_grid;
  copy_g.block[0] = 256;
  absl::StatusOr<double> copy_ms = bench.Time({{copy, copy_g, {*c_src, *c_dst, n16}}});
  if (!copy_ms.ok()) return copy_ms.status();
  row.copy_ms = *copy_ms;

  absl::StatusOr<std::vector<Bench::Launch>> rr_launches = row_resident->Record(args);
  if (!rr_launches.ok()) return rr_launches.status();
  absl::StatusOr<double> rr_ms = bench.Time(*rr_launches);
  if (!rr_ms.ok()) return rr_ms.status();
  row.row_resident_ms = *rr_ms;

  // Check the row-resident outputs (the last timed run) on the first rows against the reference.
  {
    const size_t check = std::min<size_t>(n, size_t{4} * shape.hidden);
    std::vector<uint8_t> dx(check * eb);  // the rows checked only: large shapes decode fast
    std::vector<float> dgamma(shape.hidden);
    if (absl::Status s = bench.Download(dx.data(), *d_dx, dx.size()); !s.ok()) return s;
    if (absl::Status s = bench.Download(dgamma.data(), *d_dgamma, dgamma.size() * 4); !s.ok()) {
      return s;
    }
    const kernel_testing::BackwardReference want = kernel_testing::ReferenceFor(p, false);
    const std::vector<float> got_dx = kernel_testing::DecodeElements(dx, dtype);
    row.max_rel_err_dx =
        kernel_testing::MaxRelativeError(got_dx, absl::MakeConstSpan(want.dx).first(check));
    row.max_rel_err_dgamma = kernel_testing::MaxRelativeError(dgamma, want.dgamma);
  }

  absl::StatusOr<std::vector<Bench::Launch>> b_launches = batched->Record(args);
  if (!b_launches.ok()) return b_launches.status();
  absl::StatusOr<double> b_ms =
      bench.Time(*b_launches, [&]() { return bench.Memset(*d_dgamma, shape.hidden); });
  if (!b_ms.ok()) return b_ms.status();
  row.batched_ms = *b_ms;
  bench.FreeAll();
  return row;
}

std::string Json(const Bench& bench, const std::vector<Row>& rows, int iters) {
  std::vector<std::string> items;
  for (const Row& r : rows) {
    const double copy = r.GBps(r.copy_ms);
    items.push_back(absl::StrFormat(
        "    {\"dtype\": \"%s\", \"rows\": %u, \"hidden\": %u, \"bytes\": %.0f, "
        "\"copy_ms\": %.6f, \"copy_gbps\": %.6g, "
        "\"row_resident_ms\": %.6f, \"row_resident_gbps\": %.6g, \"row_resident_of_copy\": %.4f, "
        "\"batched_ms\": %.6f, \"batched_gbps\": %.6g, \"batched_of_copy\": %.4f, "
        "\"row_resident_grid\": %u, \"row_resident_block\": %u, "
        "\"max_rel_err_dx\": %.3g, \"max_rel_err_dgamma\": %.3g}",
        r.dtype, r.shape.rows, r.shape.hidden, r.bytes, r.copy_ms, copy, r.row_resident_ms,
        r.GBps(r.row_resident_ms), copy > 0 ? r.GBps(r.row_resident_ms) / copy : 0, r.batched_ms,
        r.GBps(r.batched_ms), copy > 0 ? r.GBps(r.batched_ms) / copy : 0, r.grid, r.block,
        r.max_rel_err_dx, r.max_rel_err_dgamma));
  }
  return absl::StrCat("{\n  \"device\": \"", bench.name(), "\",\n  \"target\": \"sm_",
                      bench.target_sm(), "\",\n  \"sm_count\": ", bench.sm_count(),
                      ",\n  \"l2_cache_bytes\": ", bench.l2_bytes(),
                      ",\n  \"l2_policy\": \"flush\",\n  \"l2_flush_bytes\": ", bench.flush_bytes(),
                      ",\n  \"iters\": ", iters, ",\n  \"results\": [\n",
                      absl::StrJoin(items, ",\n"), "\n  ]\n}\n");
}

int Main(int argc, char** argv) {
  bool smoke = false;
  int iters = 20;
  std::string json_path;
  std::vector<DType> dtypes = {DType::kF32, DType::kBF16};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--smoke") {
      smoke = true;
    } else if (a == "--iters" && i + 1 < argc && absl::SimpleAtoi(argv[i + 1], &iters) &&
               iters >= 1) {
      ++i;
    } else if (a == "--json" && i + 1 < argc) {
      json_path = argv[++i];
    } else if (a == "--dtypes" && i + 1 < argc) {
      dtypes.clear();
      for (absl::string_view d : absl::StrSplit(argv[++i], ',')) {
        absl::StatusOr<DType> parsed = kernels::ParseDType(d);
        if (!parsed.ok()) {
          std::fprintf(stderr, "normgrad-gpu-bench: %s\n",
                       std::string(parsed.status().message()).c_str());
          return 2;
        }
        dtypes.push_back(*parsed);
      }
    } else {
      std::fprintf(stderr,
                   "normgrad-gpu-bench: bad argument \"%s\" (usage: [--smoke] [--iters N >= 1] "
                   "[--json PATH] [--dtypes f32,bf16,f16])\n",
                   a.c_str());
      return 2;
    }
  }
  const std::vector<Shape> shapes =
      smoke ? std::vector<Shape>{{1, 896}, {64, 896}, {8, 4096}, {2, 16384}, {2, 20000}}
            : std::vector<Shape>{{1, 896},      {64, 4096},   {4096, 896},  {4096, 4096},
                                 {16384, 4096}, {8192, 8192}, {32768, 896}, {256, 65536},
                                 {1024, 65536}};
  if (smoke) iters = std::min(iters, 2);

  const std::string path = server::cuda::ResolveDriverLibrary("");
  absl::StatusOr<std::shared_ptr<const CudaDriver>> driver = CudaDriver::Load(path);
  if (!driver.ok()) {
    std::fprintf(stderr, "normgrad-gpu-bench: %s\n",
                 std::string(driver.status().message()).c_str());
    return 1;
  }
  Bench bench(*driver, iters);
  if (absl::Status s = bench.Init(); !s.ok()) {
    std::fprintf(stderr, "normgrad-gpu-bench: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  if (absl::Status s = bench.AllocateFlushBuffer(); !s.ok()) {
    std::fprintf(stderr, "normgrad-gpu-bench: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  absl::StatusOr<CUfunction> copy = bench.Load(CopyKernelPtx(bench.target_sm()), "copy_v4");
  if (!copy.ok()) {
    std::fprintf(stderr, "normgrad-gpu-bench: %s\n", std::string(copy.status().message()).c_str());
    return 1;
  }
  std::printf("device: %s (sm_%d, %u SMs), median of up to %d runs\n", bench.name().c_str(),
              bench.target_sm(), bench.sm_count(), iters);
  std::printf(
      "L2: flush (a %zu-byte memset, twice the %zu-byte L2, before every run of every "
      "kernel, copy included; not timed)\n",
      bench.flush_bytes(), bench.l2_bytes());
  std::printf("%-5s %14s %10s %18s %7s %18s %7s %10s %10s\n", "dtype", "rows x hidden", "copy GB/s",
              "row_resident GB/s", "/copy", "batched(seed) GB/s", "/copy", "dx err", "dgamma err");
  std::vector<Row> rows;
  std::string wrong;  // shapes whose outputs disagree with the reference
  for (DType d : dtypes) {
    if (d == DType::kBF16 && bench.target_sm() < 80) {
      std::printf("%-5s skipped: bf16 needs sm_80 or newer (device is sm_%d)\n", "bf16",
                  bench.target_sm());
      continue;
    }
    for (const Shape& s : shapes) {
      absl::StatusOr<Row> r = RunShape(bench, d, s, *copy);
      if (!r.ok()) {
        std::fprintf(stderr, "normgrad-gpu-bench: %s %ux%u: %s\n",
                     std::string(kernels::DTypeName(d)).c_str(), s.rows, s.hidden,
                     std::string(r.status().message()).c_str());
        return 1;
      }
      const double copy_gbps = r->GBps(r->copy_ms);
      std::printf("%-5s %14s %10.1f %18.1f %7.3f %18.1f %7.3f %10.2g %10.2g\n", r->dtype.c_str(),
                  absl::StrCat(s.rows, "x", s.hidden).c_str(), copy_gbps,
                  r->GBps(r->row_resident_ms), r->GBps(r->row_resident_ms) / copy_gbps,
                  r->GBps(r->batched_ms), r->GBps(r->batched_ms) / copy_gbps, r->max_rel_err_dx,
                  r->max_rel_err_dgamma);
      std::fflush(stdout);
      // dx: half an ulp of the element type plus the f32 error; dgamma: f32 sums over many rows.
      const double dx_bound = d == DType::kF32 ? 1e-5 : d == DType::kF16 ? 5e-4 : 4e-3;
      if (!(r->max_rel_err_dx <= dx_bound) || !(r->max_rel_err_dgamma <= 1e-3)) {
        wrong = absl::StrCat(wrong, " ", r->dtype, " ", s.rows, "x", s.hidden);
      }
      rows.push_back(*r);
    }
  }
  const std::string json = Json(bench, rows, iters);
  if (!json_path.empty()) {
    std::ofstream f(json_path, std::ios::trunc);
    f << json;
    if (!f) {
      std::fprintf(stderr, "normgrad-gpu-bench: cannot write %s\n", json_path.c_str());
      return 1;
    }
  }
  if (!wrong.empty()) {
    std::fprintf(stderr,
                 "normgrad-gpu-bench: rms_norm_backward_row_resident disagrees with the "
                 "reference beyond tolerance at:%s\n",
                 wrong.c_str());
    return 3;
  }
  return 0;
}

}  // namespace
}  // namespace normgrad::gpu_bench

int main(int argc, char** argv) { return normgrad::gpu_bench::Main(argc, argv); }
