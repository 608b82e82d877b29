// The backward-kernel interface (kernels/backward_kernel.h): argument packing from a built
// kernel's own parameter list, what each kernel's Run launches and fills, and what it says it
// reads and writes, checked with a launcher that records instead of running (the interpreter runs
// the same plans in tests/ptxsim).
#include "kernels/backward_kernel.h"

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "gtest/gtest.h"
#include "kernels/kernel_config.h"
#include "kernels/kernel_params.h"
#include "kernels/rmsnorm/kernel_registry.h"
#include "kernels/rmsnorm/rms_norm_backward_row_resident.h"
#include "kernels/ptx/targets.h"

namespace normgrad::kernels {
namespace {

constexpr char kRowResident[] = "rms_norm_backward_row_resident";
constexpr char kBatched[] = "batched_rms_norm_backward";
constexpr char kWarp[] = "rms_norm_backward";

// What each kernel reads and writes (BackwardKernel::DataFlow), every field.
constexpr BackwardDataFlow kRowResidentFlow = {
    .reads_rms = true, .requires_rms = false, .writes_dgamma = true, .reproducible_dgamma = true};
constexpr BackwardDataFlow kBatchedFlow = {
    .reads_rms = false, .requires_rms = false, .writes_dgamma = true, .reproducible_dgamma = false};
constexpr BackwardDataFlow kWarpFlow = {
    .reads_rms = true, .requires_rms = true, .writes_dgamma = false, .reproducible_dgamma = false};

// Every field a different value, so that a value in the wrong slot shows.
KernelParamValues DistinctValues() {
  return KernelParamValues{/*input=*/0x1000,
                           /*gamma=*/0x2000,
                           /*rms=*/0x3000,
                           /*grad_output=*/0x4000,
                           /*grad_input=*/0x5000,
                           /*grad_gamma=*/0x6000,
                           /*dgamma_partials=*/0x7000,
                           /*dgamma=*/0x8000,
                           /*semaphores=*/0x9000,
                           /*num_rows=*/11,
                           /*hidden_dim=*/13,
                           /*eps=*/0.25f};
}

TEST(KernelParamTable, EveryIdHasOneEntryAndItsNameFindsIt) {
  for (int i = 0; i < kNumKernelParamIds; ++i) {
    const KernelParamId id = static_cast<KernelParamId>(i);
    ASSERT_EQ(SpecOf(id).id, id) << i;
    ASSERT_EQ(FindKernelParam(SpecOf(id).name), id) << SpecOf(id).name;
  }
  EXPECT_FALSE(FindKernelParam("no_such_param").has_value());
}

TEST(PackArgs, FillsEveryKernelsParametersInItsOwnOrder) {
  const KernelParamValues values = DistinctValues();
  for (const BackwardKernel* k : AllKernels()) {
    const std::vector<KernelParam> params = k->Params();
    ASSERT_FALSE(params.empty()) << k->EntryName();
    absl::StatusOr<PackedArgs> packed = PackArgs(params, values);
    ASSERT_TRUE(packed.ok()) << k->EntryName() << ": " << packed.status();
    ASSERT_EQ(packed->size(), params.size());
    // Reading the array back gives the values of exactly the declared parameters.
    absl::StatusOr<KernelParamValues> back = UnpackArgs(params, packed->pointers());
    ASSERT_TRUE(back.ok()) << back.status();
    for (size_t i = 0; i < params.size(); ++i) {
      uint64_t slot = 0;
      std::memcpy(&slot, packed->pointers()[i], sizeof(slot));
      const std::string& name = params[i].name;
      if (name == "input_ptr") {
        EXPECT_EQ(slot, values.input);
      } else if (name == "grad_output_ptr") {
        EXPECT_EQ(slot, values.grad_output);
      } else if (name == "num_rows") {
        EXPECT_EQ(slot, values.num_rows);  // u32 in the low bytes of a zeroed slot
      }
      if (name == "eps") {
        float eps;
        std::memcpy(&eps, packed->pointers()[i], sizeof(eps));
        EXPECT_EQ(eps, values.eps);
      }
    }
    EXPECT_EQ(back->hidden_dim, values.hidden_dim) << k->EntryName();
  }
}

TEST(PackArgs, TheRowResidentKernelsArrayIsInItsDeclarationOrder) {
  const std::vector<KernelParam> params = FindKernel(kRowResident)->Params();
  absl::StatusOr<PackedArgs> packed = PackArgs(params, DistinctValues());
  ASSERT_TRUE(packed.ok()) << packed.status();
  std::vector<uint64_t> slots;
  for (size_t i = 0; i < packed->size(); ++i) {
    uint64_t slot = 0;
    std::memcpy(&slot, packed->pointers()[i], 4 * (params[i].ptx_type == "u64" ? 2 : 1));
    slots.push_back(slot);
  }
  uint32_t eps_bits;
  const float eps = 0.25f;
  std::memcpy(&eps_bits, &eps, 4);
  // x, gamma, dy, dx, rms, dgamma, workspace, semaphores, rows, hidden, eps: the order Build
  // declares.
  EXPECT_EQ(slots, (std::vector<uint64_t>{0x1000, 0x2000, 0x4000, 0x5000, 0x3000, 0x8000, 0x7000,
                                          0x9000, 11, 13, eps_bits}));
}

TEST(PackArgs, AParameterTheContractDoesNotKnowIsAnInternalErrorNamingIt) {
  absl::StatusOr<PackedArgs> unknown =
      PackArgs({{"input_ptr", "u64"}, {"scale_ptr", "u64"}}, DistinctValues());
  ASSERT_EQ(unknown.status().code(), absl::StatusCode::kInternal);
  EXPECT_NE(unknown.status().message().find("scale_ptr"), absl::string_view::npos);

  absl::StatusOr<PackedArgs> mistyped = PackArgs({{"num_rows", "u64"}}, DistinctValues());
  ASSERT_EQ(mistyped.status().code(), absl::StatusCode::kInternal);
  EXPECT_NE(mistyped.status().message().find("num_rows is .u64"), absl::string_view::npos)
      << mistyped.status();
}

// Records launches (geometry and the argument values) and zero fills, in order.
class RecordingLauncher : public KernelLauncher {
 public:
  explicit RecordingLauncher(const BackwardPlan& plan, uint32_t max_grid_x = kMaxGridX)
      : max_grid_x_(max_grid_x), params_(plan.kernel().Params()) {}
  struct Launched {
    LaunchGeometry geometry;
    KernelParamValues values;
  };
  struct Filled {
    uint64_t address;
    uint64_t bytes;
    size_t before_launch;  // how many launches came before it
  };
  const std::vector<Launched>& launched() const { return launched_; }
  const std::vector<Filled>& filled() const { return filled_; }

  absl::Span<const KernelParam> Params() const override { return params_; }
  uint32_t MaxGridX() const override { return max_grid_x_; }
  absl::Status Launch(const LaunchGeometry& g, void** args) override {
    absl::StatusOr<KernelParamValues> v = UnpackArgs(params_, args);
    if (!v.ok()) return v.status();
    launched_.push_back({g, *v});
    return absl::OkStatus();
  }
  absl::Status ZeroFill(uint64_t address, uint64_t bytes) override {
    filled_.push_back({address, bytes, launched_.size()});
    return absl::OkStatus();
  }

 private:
  uint32_t max_grid_x_;
  std::vector<KernelParam> params_;
  std::vector<Launched> launched_;
  std::vector<Filled> filled_;
};

KernelConfig Config(uint32_t hidden, DType dtype = DType::kF32) {
  KernelConfig c;
  c.hidden_dim = hidden;
  c.dtype = dtype;
  c.target_sm = 90;
  c.sm_count = 4;
  return c;
}

BackwardArgs Args(uint64_t rows, uint32_t hidden) {
  BackwardArgs a;
  a.x = 0x10000;
  a.dy = 0x20000;
  a.dx = 0x30000;
  a.gamma = 0x40000;
  a.rms = 0x50000;
  a.dgamma = 0x60000;
  a.workspace = 0x70000;
  a.semaphores = 0x80000;
  a.rows = rows;
  a.hidden_dim = hidden;
  a.eps = 1e-3f;
  return a;
}

// Every field of a plan's DataFlow, so that none goes unchecked.
void ExpectDataFlow(const BackwardDataFlow& got, const BackwardDataFlow& want) {
  EXPECT_EQ(got.reads_rms, want.reads_rms);
  EXPECT_EQ(got.requires_rms, want.requires_rms);
  EXPECT_EQ(got.writes_dgamma, want.writes_dgamma);
  EXPECT_EQ(got.reproducible_dgamma, want.reproducible_dgamma);
}

TEST(BackwardPlan, RowResidentIsOneLaunchWritingDxAndDgammaThroughItsTree) {
  const KernelConfig config = Config(896, DType::kBF16);
  absl::StatusOr<BackwardPlan> plan = BackwardPlan::Create(*FindKernel(kRowResident), config);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ExpectDataFlow(plan->DataFlow(), kRowResidentFlow);

  // sm_count 4 x 4 blocks of 256 threads: G = 16 for 1000 rows, one group, two levels (16, 1):
  // 16 workspace rows of the tiling's capacity (256 threads x 8 bf16) and one semaphore.
  const uint64_t rows = 1000;
  const uint32_t blocks = FindKernel(kRowResident)->Geometry(config, rows).grid[0];
  EXPECT_EQ(blocks, 16u);
  EXPECT_EQ(plan->WorkspaceBytes(rows), uint64_t{16} * 256 * 8 * sizeof(float));
  EXPECT_EQ(plan->SemaphoreBytes(rows), 4u);
  // One row: G = 1, no tree at all.
  EXPECT_EQ(plan->WorkspaceBytes(1), 0u);
  EXPECT_EQ(plan->SemaphoreBytes(1), 0u);

  RecordingLauncher launcher(*plan);
  ASSERT_TRUE(plan->Run(Args(rows, 896), launcher).ok());
  ASSERT_EQ(launcher.launched().size(), 1u);
  EXPECT_TRUE(launcher.filled().empty());  // the tree writes dgamma: nothing to zero
  const auto& main = launcher.launched()[0];
  EXPECT_EQ(main.geometry.grid[0], blocks);
  EXPECT_EQ(main.values.input, 0x10000u);
  EXPECT_EQ(main.values.rms, 0x50000u);
  EXPECT_EQ(main.values.dgamma, 0x60000u);
  EXPECT_EQ(main.values.dgamma_partials, 0x70000u);
  EXPECT_EQ(main.values.semaphores, 0x80000u);
  EXPECT_EQ(main.values.num_rows, rows);
  EXPECT_EQ(main.values.eps, 1e-3f);
}

TEST(RowResidentTree, RowsAndSemaphoresPerLevel) {
  using K = RowResidentRmsNormBackwardKernel;
  EXPECT_EQ(K::TreeRows(1), 0u);
  EXPECT_EQ(K::TreeSemaphores(1), 0u);
  EXPECT_EQ(K::TreeRows(2), 2u);  // 2 -> 1
  EXPECT_EQ(K::TreeSemaphores(2), 1u);
  EXPECT_EQ(K::TreeRows(16), 16u);  // 16 -> 1
  EXPECT_EQ(K::TreeRows(17), 19u);  // 17 -> 2 -> 1
  EXPECT_EQ(K::TreeSemaphores(17), 3u);
  EXPECT_EQ(K::TreeRows(264), 264u + 17 + 2);  // 264 -> 17 -> 2 -> 1
  EXPECT_EQ(K::TreeSemaphores(264), 17u + 2 + 1);
}

TEST(BackwardPlan, TruenoCompatibleKernelsLaunchInPiecesBelowTheDevicesGridLimit) {
  // batched: one block per row. 10 rows under a limit of 3 blocks: pieces of 3, 3, 3, 1 rows
  // (halving from 10: 5, then 3), each with its rows' pointers.
  const KernelConfig config = Config(100, DType::kF16);
  absl::StatusOr<BackwardPlan> plan = BackwardPlan::Create(*FindKernel(kBatched), config);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ExpectDataFlow(plan->DataFlow(), kBatchedFlow);
  EXPECT_EQ(plan->WorkspaceBytes(10), 0u);
  RecordingLauncher launcher(*plan, /*max_grid_x=*/3);
  ASSERT_TRUE(plan->Run(Args(10, 100), launcher).ok());
  // The atomics add into dgamma: zeroed once, before the first piece, f32 per column.
  ASSERT_EQ(launcher.filled().size(), 1u);
  EXPECT_EQ(launcher.filled()[0].address, 0x60000u);
  EXPECT_EQ(launcher.filled()[0].bytes, 100u * sizeof(float));
  EXPECT_EQ(launcher.filled()[0].before_launch, 0u);
  const std::vector<uint32_t> want_rows = {3, 3, 3, 1};
  ASSERT_EQ(launcher.launched().size(), want_rows.size());
  uint64_t first = 0;
  for (size_t i = 0; i < want_rows.size(); ++i) {
    const auto& l = launcher.launched()[i];
    EXPECT_EQ(l.values.num_rows, want_rows[i]) << i;
    EXPECT_LE(l.geometry.grid[0], 3u) << i;
    const uint64_t offset = first * 100 * 2;  // f16 rows of 100
    EXPECT_EQ(l.values.input, 0x10000 + offset) << i;
    EXPECT_EQ(l.values.grad_output, 0x20000 + offset) << i;
    EXPECT_EQ(l.values.grad_input, 0x30000 + offset) << i;
    EXPECT_EQ(l.values.gamma, 0x40000u) << i;
    EXPECT_EQ(l.values.grad_gamma, 0x60000u) << i;
    first += want_rows[i];
  }
}

TEST(BackwardPlan, TheWarpKernelReadsTheGivenRmsOfEachPiecesRows) {
  absl::StatusOr<BackwardPlan> plan = BackwardPlan::Create(*FindKernel(kWarp), Config(32));
  ASSERT_TRUE(plan.ok()) << plan.status();
  ExpectDataFlow(plan->DataFlow(), kWarpFlow);
  // 8 rows per block under a limit of 1 block: halving 20 rows gives pieces of 5.
  RecordingLauncher launcher(*plan, /*max_grid_x=*/1);
  ASSERT_TRUE(plan->Run(Args(20, 32), launcher).ok());
  ASSERT_EQ(launcher.launched().size(), 4u);
  EXPECT_TRUE(launcher.filled().empty());
  uint64_t first = 0;
  for (const auto& l : launcher.launched()) {
    EXPECT_EQ(l.values.rms, 0x50000 + first * sizeof(float));
    first += l.values.num_rows;
  }
  EXPECT_EQ(first, 20u);
}

TEST(BackwardPlan, CanImplementNamesTheFieldAndTheNumbers) {
  absl::StatusOr<BackwardPlan> row = BackwardPlan::Create(*FindKernel(kRowResident), Config(64));
  absl::StatusOr<BackwardPlan> warp = BackwardPlan::Create(*FindKernel(kWarp), Config(16));
  ASSERT_TRUE(row.ok() && warp.ok());
  struct Case {
    const BackwardPlan& plan;
    BackwardArgs args;
    std::string want;
  };
  BackwardArgs other_hidden = Args(4, 65);
  BackwardArgs no_workspace = Args(4, 64);
  no_workspace.workspace = 0;
  BackwardArgs misaligned_workspace = Args(4, 64);
  misaligned_workspace.workspace = 0x70004;
  BackwardArgs no_semaphores = Args(4, 64);
  no_semaphores.semaphores = 0;
  BackwardArgs too_many_rows = Args(uint64_t{1} << 32, 64);
  BackwardArgs no_rms = Args(4, 16);
  no_rms.rms = 0;
  for (const Case& c : {Case{*row, other_hidden, "hidden_dim 65 differs from the plan's 64"},
                        Case{*row, no_workspace, "workspace of"},
                        Case{*row, misaligned_workspace, "workspace at 0x70004 is not 16-byte"},
                        Case{*row, no_semaphores, "semaphores of 4 bytes for 4 rows"},
                        Case{*row, too_many_rows, "rows 4294967296 exceed 4294967295"},
                        Case{*warp, no_rms, "needs the forward's rms"}}) {
    const absl::Status s = c.plan.CheckArgs(c.args);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.want;
    EXPECT_NE(s.message().find(c.want), absl::string_view::npos) << s;
    RecordingLauncher launcher(c.plan);
    EXPECT_EQ(c.plan.Run(c.args, launcher).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(launcher.launched().empty());
  }
}

TEST(BackwardPlan, CreateRefusesWhatTheKernelRefuses) {
  EXPECT_EQ(BackwardPlan::Create(*FindKernel(kWarp), Config(33)).status().code(),
            absl::StatusCode::kInvalidArgument);
  KernelConfig bf16_on_turing = Config(64, DType::kBF16);
  bf16_on_turing.target_sm = 75;
  EXPECT_EQ(BackwardPlan::Create(*FindKernel(kRowResident), bf16_on_turing).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The block size the entry of `ptx` declares: the line after its parameter list must be
// `.maxntid X, 1, 1` and the next one `{` (or `.minnctapersm N`, then `{`). 0 when the directive
// is missing or malformed.
uint32_t DeclaredMaxThreads(const std::string& ptx) {
  const std::vector<absl::string_view> lines = absl::StrSplit(ptx, '\n');
  for (size_t i = 0; i + 2 < lines.size(); ++i) {
    if (lines[i] != ")") continue;
    std::vector<absl::string_view> words = absl::StrSplit(lines[i + 1], ' ');
    uint32_t x = 0;
    const bool body_next =
        lines[i + 2] == "{" || (absl::StartsWith(lines[i + 2], ".minnctapersm ") &&
                                i + 3 < lines.size() && lines[i + 3] == "{");
    if (words.size() == 4 && words[0] == ".maxntid" && absl::ConsumeSuffix(&words[1], ",") &&
        absl::SimpleAtoi(words[1], &x) && words[2] == "1," && words[3] == "1" && body_next) {
      return x;
    }
    return 0;
  }
  return 0;
}

// Every registry kernel, dtype and supported target, at hidden dims that reach every
// row-resident tiling (256 to 1024 threads) and the other kernels' limits: the PTX declares the
// block size its launches use, so ptxas (and nvJitLink's relocatable ptxas) fits its registers
// to that block and the driver refuses a larger one.
TEST(LaunchBounds, EveryKernelDeclaresMaxntidEqualToItsLaunchBlock) {
  const std::vector<uint32_t> hidden_dims = {1,    32,   512,  896,  2048,  2049,
                                             4096, 4097, 8192, 8193, 12288, 16384};
  int checked = 0;
  for (const BackwardKernel* k : AllKernels()) {
    for (const DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (const uint32_t hidden : hidden_dims) {
        for (const int target : SupportedTargets()) {
          const KernelConfig config{.hidden_dim = hidden, .dtype = dtype, .target_sm = target};
          if (!k->CanImplement(config).ok()) continue;
          const std::string what = absl::StrCat(k->ConfigKey(config), " hidden_dim ", hidden);
          absl::StatusOr<EmittedPtx> ptx = k->Emit(config);
          ASSERT_TRUE(ptx.ok()) << what << ": " << ptx.status();
          const uint32_t declared = DeclaredMaxThreads(ptx->text);
          EXPECT_EQ(declared, k->BlockThreads(config)) << what;
          for (const uint64_t rows : {uint64_t{1}, uint64_t{1000}, uint64_t{1} << 33}) {
            const LaunchGeometry g = k->Geometry(config, rows);
            EXPECT_EQ(g.block[0], declared) << what << ", " << rows << " rows";
            EXPECT_EQ(g.block[1] * g.block[2], 1u) << what;
          }
          ++checked;
        }
      }
    }
  }
  // 3 kernels; bf16 on 10 of the 11 targets; rms_norm_backward at hidden_dim <= 32 only.
  EXPECT_GT(checked, 800);
}

TEST(LaunchBounds, RowResidentTilingsSpanEveryBlockSize) {
  const BackwardKernel* k = FindKernel(kRowResident);
  ASSERT_NE(k, nullptr);
  EXPECT_EQ(k->BlockThreads({.hidden_dim = 896}), 256u);
  EXPECT_EQ(k->BlockThreads({.hidden_dim = 4096}), 512u);
  EXPECT_EQ(k->BlockThreads({.hidden_dim = 8192}), 1024u);
  EXPECT_EQ(k->BlockThreads({.hidden_dim = 16384}), 512u);
  EXPECT_EQ(k->BlockThreads({.hidden_dim = 16384}),
            RowResidentRmsNormBackwardKernel::TilingFor({.hidden_dim = 16384}).threads);
}

TEST(LaunchBounds, TheParserOfThisTestNeedsTheDirective) {
  const BackwardKernel* k = FindKernel(kBatched);
  ASSERT_NE(k, nullptr);
  absl::StatusOr<EmittedPtx> ptx = k->Emit({.hidden_dim = 64, .target_sm = 90});
  ASSERT_TRUE(ptx.ok()) << ptx.status();
  EXPECT_EQ(DeclaredMaxThreads(ptx->text), 32u);
  std::string without = ptx->text;
  const size_t at = without.find(".maxntid 32, 1, 1\n");
  ASSERT_NE(at, std::string::npos);
  without.erase(at, std::strlen(".maxntid 32, 1, 1\n"));
  EXPECT_EQ(DeclaredMaxThreads(without), 0u);
}

TEST(BackwardPlan, NoRowsLaunchNothing) {
  absl::StatusOr<BackwardPlan> plan = BackwardPlan::Create(*FindKernel(kRowResident), Config(64));
  ASSERT_TRUE(plan.ok());
  RecordingLauncher launcher(*plan);
  EXPECT_TRUE(plan->Run(Args(0, 64), launcher).ok());
  EXPECT_TRUE(launcher.launched().empty());
}

}  // namespace
}  // namespace normgrad::kernels
