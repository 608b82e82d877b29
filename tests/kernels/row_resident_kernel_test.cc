// rms_norm_backward_row_resident: configuration contract
// (limits, tiling in the key, sm_count only in the geometry), emitted forms (16-byte vectors,
// no atomics, two barriers per row), the divergence analysis, and ptxas for sm_75..sm_100 with
// a register count that lets the block launch (registers x threads <= 64K) and no spills.
// ptxas's registers are printed for the record (docs/kernels.md quotes them).
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <optional>
#include <regex>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "kernels/ptx/divergence_analysis.h"
#include "kernels/kernel_config.h"
#include "kernels/backward_kernel.h"
#include "kernels/built_kernel.h"
#include "kernels/rmsnorm/kernel_registry.h"
#include "kernels/rmsnorm/rms_norm_backward_row_resident.h"

namespace normgrad::kernels {
namespace {

const BackwardKernel& Main() { return *FindKernel("rms_norm_backward_row_resident"); }

int Count(const std::string& text, const std::string& needle) {
  int n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

TEST(RowResidentKernelTest, IsRegisteredWithItsParameters) {
  ASSERT_NE(FindKernel("rms_norm_backward_row_resident"), nullptr);
  std::vector<std::string> names;
  for (const KernelParam& p : Main().Params()) names.push_back(p.name + ":" + p.ptx_type);
  EXPECT_EQ(names,
            (std::vector<std::string>{"input_ptr:u64", "gamma_ptr:u64", "grad_output_ptr:u64",
                                      "grad_input_ptr:u64", "rms_ptr:u64", "dgamma_ptr:u64",
                                      "dgamma_partials_ptr:u64", "semaphores_ptr:u64",
                                      "num_rows:u32", "hidden_dim:u32", "eps:f32"}));
  absl::StatusOr<EmittedPtx> ptx = Main().Emit({.hidden_dim = 4096, .target_sm = 90});
  ASSERT_TRUE(ptx.ok()) << ptx.status();
  ASSERT_EQ(ptx->params.size(), Main().Params().size());
  for (size_t i = 0; i < ptx->params.size(); ++i) {
    EXPECT_EQ(ptx->params[i].name, Main().Params()[i].name);
  }
}

TEST(RowResidentKernelTest, RefusesRowsWiderThanItStreams) {
  EXPECT_TRUE(Main().CanImplement({.hidden_dim = 16384}).ok());
  EXPECT_TRUE(Main().CanImplement({.hidden_dim = 16385}).ok());  // streamed
  EXPECT_TRUE(Main().CanImplement({.hidden_dim = 65536}).ok());
  absl::Status s = Main().CanImplement({.hidden_dim = 65537});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "hidden_dim 65537 is outside 1..65536")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "batched_rms_norm_backward")) << s;
  EXPECT_EQ(Main().CanImplement({.hidden_dim = 0}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Main().CanImplement({.hidden_dim = 64, .dtype = DType::kBF16, .target_sm = 75}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Main().Emit({.hidden_dim = 70000}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(RowResidentKernelTest, TilingHoldsTheWholeRowWithinTheRegisterBudget) {
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (uint32_t h = 1; h <= RowResidentRmsNormBackwardKernel::kMaxHiddenDim;
         h = h < 64 ? h + 1 : h * 2 - 1) {
      const RowTiling t =
          RowResidentRmsNormBackwardKernel::TilingFor({.hidden_dim = h, .dtype = d});
      EXPECT_GE(t.capacity(), h) << h;
      // Above kMaxHeldHiddenDim the row is streamed: one vector per thread per segment of a
      // 1024-thread block, one block per SM, as many segments as the row needs.
      EXPECT_EQ(t.streamed, h > RowResidentRmsNormBackwardKernel::kMaxHeldHiddenDim) << h;
      if (t.streamed) {
        EXPECT_EQ(t.threads, 1024u);
        EXPECT_EQ(t.blocks_per_sm, 1u);
        EXPECT_LT((t.vectors_per_thread - 1) * t.threads * t.vector_elements, h);
        continue;
      }
      EXPECT_LE(t.elements_per_thread(), RowResidentRmsNormBackwardKernel::kMaxElementsPerThread);
      EXPECT_EQ(t.vector_elements * DTypeBytes(d), 16u);
      EXPECT_TRUE(t.threads == 256 || t.threads == 512 || t.threads == 1024) << t.threads;
      // Not wasteful: one slot less per thread would not hold the row (or T is the minimum).
      EXPECT_TRUE(t.vectors_per_thread == 1 ||
                  (t.vectors_per_thread - 1) * t.threads * t.vector_elements < h);
      // 1024 resident threads per SM (64 registers each) up to 8 elements per thread, else one
      // 512-thread block (128 registers each).
      if (t.elements_per_thread() <= 8) {
        EXPECT_EQ(t.threads * t.blocks_per_sm, 1024u) << h;
      } else {
        EXPECT_EQ(t.threads, 512u) << h;
        EXPECT_EQ(t.blocks_per_sm, 1u) << h;
      }
    }
  }
  // The shapes: f32 896 -> 256 x 1 (4 per SM), 4096 -> 512 x 2 (2 per SM), 8192 ->
  // 1024 x 2 (1 per SM), 16384 -> 512 x 8 (1 per SM); bf16 4096 -> 512 x 1.
  auto tile = [](uint32_t h, DType d) {
    const RowTiling t = RowResidentRmsNormBackwardKernel::TilingFor({.hidden_dim = h, .dtype = d});
    return std::vector<uint32_t>{t.threads, t.vectors_per_thread, t.blocks_per_sm};
  };
  EXPECT_EQ(tile(896, DType::kF32), (std::vector<uint32_t>{256, 1, 4}));
  EXPECT_EQ(tile(4096, DType::kF32), (std::vector<uint32_t>{512, 2, 2}));
  EXPECT_EQ(tile(8192, DType::kF32), (std::vector<uint32_t>{1024, 2, 1}));
  EXPECT_EQ(tile(16384, DType::kF32), (std::vector<uint32_t>{512, 8, 1}));
  EXPECT_EQ(tile(4096, DType::kBF16), (std::vector<uint32_t>{512, 1, 2}));
  EXPECT_EQ(tile(16384, DType::kBF16), (std::vector<uint32_t>{512, 4, 1}));
  EXPECT_EQ(tile(65536, DType::kF32), (std::vector<uint32_t>{1024, 16, 1}));
  EXPECT_EQ(tile(65536, DType::kBF16), (std::vector<uint32_t>{1024, 8, 1}));
}

TEST(RowResidentKernelTest, TheKeyNamesTheTilingButNotTheSmCount) {
  const std::string a = Main().ConfigKey({.hidden_dim = 4096, .target_sm = 90});
  EXPECT_EQ(a,
            "rms_norm_backward_row_resident|dtype=f32|sm_90|ptx=7.8|normgrad-ptx/3|tile=512x2x2");
  // Same tiling, same key, same bytes.
  EXPECT_EQ(Main().ConfigKey({.hidden_dim = 4000, .target_sm = 90}), a);
  EXPECT_EQ(Main().Emit({.hidden_dim = 4000, .target_sm = 90})->text,
            Main().Emit({.hidden_dim = 4096, .target_sm = 90})->text);
  EXPECT_NE(Main().ConfigKey({.hidden_dim = 4097, .target_sm = 90}), a);
  // sm_count changes the grid only.
  EXPECT_EQ(Main().ConfigKey({.hidden_dim = 4096, .target_sm = 90, .sm_count = 132}), a);
  EXPECT_EQ(Main().Emit({.hidden_dim = 4096, .target_sm = 90, .sm_count = 132})->text,
            Main().Emit({.hidden_dim = 4096, .target_sm = 90, .sm_count = 7})->text);
}

KernelConfig WithVariant(KernelConfig c, NormVariant v) {
  c.variant = v;
  return c;
}

TEST(RowResidentKernelTest, ImplementsEveryVariantAndKeysItAsEmitted) {
  const KernelConfig bf16{.hidden_dim = 896, .dtype = DType::kBF16, .target_sm = 90};
  const KernelConfig f32{.hidden_dim = 896, .target_sm = 90};
  const NormVariant llama{.gamma_offset = 1.0f, .casting = CastingMode::kLlama};
  const NormVariant none{.gamma_offset = 1.0f, .casting = CastingMode::kNone};
  const NormVariant gemma{.gamma_offset = 1.0f};
  EXPECT_TRUE(Main().CanImplement(WithVariant(bf16, llama)).ok());
  EXPECT_TRUE(Main().CanImplement(WithVariant(bf16, {.has_gamma = false})).ok());
  // bf16: every casting mode has its own module.
  const std::string key_llama = Main().ConfigKey(WithVariant(bf16, llama));
  EXPECT_TRUE(absl::StrContains(key_llama, "_llama|tile=")) << key_llama;
  EXPECT_NE(key_llama, Main().ConfigKey(WithVariant(bf16, none)));
  EXPECT_NE(Main().ConfigKey(WithVariant(bf16, gemma)), Main().ConfigKey(bf16));
  // f32: the casting mode changes nothing, so one key and one module.
  EXPECT_EQ(Main().ConfigKey(WithVariant(f32, llama)), Main().ConfigKey(WithVariant(f32, gemma)));
  EXPECT_EQ(Main().Emit(WithVariant(f32, llama))->text, Main().Emit(WithVariant(f32, gemma))->text);
  // Without gamma neither the offset nor the casting mode changes the math.
  EXPECT_EQ(Main().ConfigKey(WithVariant(bf16, {.has_gamma = false, .casting = CastingMode::kLlama})),
            Main().ConfigKey(WithVariant(bf16, {.has_gamma = false})));
  // The default variant's key is the key it always had.
  EXPECT_EQ(Main().ConfigKey(f32),
            "rms_norm_backward_row_resident|dtype=f32|sm_90|ptx=7.8|normgrad-ptx/3|tile=256x1x4");
}

TEST(RowResidentKernelTest, EmitsTheVariantsMath) {
  for (uint32_t h : {896u, 16392u}) {  // held, streamed
    const KernelConfig bf16{.hidden_dim = h, .dtype = DType::kBF16, .target_sm = 90};
    const std::string plain = Main().Emit(bf16)->text;
    const int stores = Count(plain, "cvt.rn.bf16.f32");  // dx (and nothing else) is rounded
    // The offset: one f32 add of the immediate per gamma element loaded (0f3F800000 = 1.0).
    const std::string offset = Main().Emit(WithVariant(bf16, {.gamma_offset = 1.0f}))->text;
    EXPECT_GT(Count(offset, "add.rn.f32 "), Count(plain, "add.rn.f32 ")) << h;
    EXPECT_GT(Count(offset, "0f3F800000"), Count(plain, "0f3F800000")) << h;
    EXPECT_EQ(Count(offset, "cvt.rn.bf16.f32"), stores) << h;
    // none rounds m = dy * scale; llama also x / rms: more roundings each.
    const std::string none = Main().Emit(WithVariant(bf16, {.casting = CastingMode::kNone}))->text;
    const std::string llama =
        Main().Emit(WithVariant(bf16, {.casting = CastingMode::kLlama}))->text;
    EXPECT_GT(Count(none, "cvt.rn.bf16.f32"), stores) << h;
    EXPECT_GT(Count(llama, "cvt.rn.bf16.f32"), Count(none, "cvt.rn.bf16.f32")) << h;
    // No gamma: no grad_gamma at all (no tree: no atomics, fences, workspace or dgamma), and
    // the gamma pointer never read.
    const std::string no_gamma = Main().Emit(WithVariant(bf16, {.has_gamma = false}))->text;
    EXPECT_EQ(Count(no_gamma, "atom."), 0) << h;
    EXPECT_EQ(Count(no_gamma, "fence."), 0) << h;
    EXPECT_FALSE(absl::StrContains(no_gamma, "[dgamma_ptr]")) << h;
    EXPECT_FALSE(absl::StrContains(no_gamma, "[dgamma_partials_ptr]")) << h;
    EXPECT_FALSE(absl::StrContains(no_gamma, "[semaphores_ptr]")) << h;
    // The same parameters for every config (the backend packs them once).
    const std::vector<KernelParam> params = Main().Emit(WithVariant(bf16, {.has_gamma = false}))->params;
    ASSERT_EQ(params.size(), Main().Params().size());
    for (size_t i = 0; i < params.size(); ++i) EXPECT_EQ(params[i].name, Main().Params()[i].name);
  }
}

TEST(RowResidentKernelTest, NoGammaNeedsNoWorkspaceAndWritesNoGradGamma) {
  const KernelConfig c{.hidden_dim = 4096, .target_sm = 90, .variant = {.has_gamma = false}};
  const auto& k = static_cast<const BackwardKernel&>(Main());
  EXPECT_EQ(k.WorkspaceBytes(c, 1000), 0u);
  EXPECT_EQ(k.SemaphoreBytes(c, 1000), 0u);
  absl::StatusOr<BackwardPlan> plan = BackwardPlan::Create(k, c);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_FALSE(plan->DataFlow().writes_dgamma);
  EXPECT_TRUE(plan->DataFlow().reads_rms);
  const KernelConfig with_gamma{.hidden_dim = 4096, .target_sm = 90};
  EXPECT_TRUE(BackwardPlan::Create(k, with_gamma)->DataFlow().writes_dgamma);
  EXPECT_GT(k.WorkspaceBytes(with_gamma, 1000), 0u);
}

TEST(RowResidentKernelTest, GeometryIsAPersistentGridSizedBySmCount) {
  const KernelConfig c{.hidden_dim = 4096, .target_sm = 90, .sm_count = 132};
  LaunchGeometry g = Main().Geometry(c, 1u << 20);
  EXPECT_EQ(g.block[0], 512u);
  EXPECT_EQ(g.grid[0], 132u * 2);                  // the entry's .minnctapersm 2
  EXPECT_EQ(Main().Geometry(c, 10).grid[0], 10u);  // never more blocks than rows
  EXPECT_EQ(Main().Geometry(c, 0).grid[0], 1u);
  EXPECT_EQ(Main().Geometry({.hidden_dim = 16384, .sm_count = 132}, 1u << 20).grid[0], 132u);
  EXPECT_EQ(Main().Geometry({.hidden_dim = 896, .sm_count = 132}, 1u << 20).grid[0], 132u * 4);
  // Unknown SM count: the documented default.
  EXPECT_EQ(Main().Geometry({.hidden_dim = 4096}, 1u << 20).grid[0],
            RowResidentRmsNormBackwardKernel::kDefaultSmCount * 2);
  for (uint32_t h : {1u, 33u, 896u, 4097u, 16384u, 16385u, 65536u}) {
    EXPECT_EQ(Main().Geometry({.hidden_dim = h}, 100).block[0] % 32, 0u);
  }
  // Streamed rows: one 1024-thread block per SM.
  const LaunchGeometry wide = Main().Geometry({.hidden_dim = 65536, .sm_count = 132}, 1u << 20);
  EXPECT_EQ(wide.grid[0], 132u);
  EXPECT_EQ(wide.block[0], 1024u);
}

TEST(RowResidentKernelTest, EmitsStreamedVectorAccessesAndTheTreesCountsAndFences) {
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16}) {
    absl::StatusOr<EmittedPtx> ptx = Main().Emit({.hidden_dim = 4096, .dtype = d, .target_sm = 80});
    ASSERT_TRUE(ptx.ok()) << ptx.status();
    const std::string& t = ptx->text;
    const std::string v4 = d == DType::kF32 ? ".v4.f32" : ".v4.u32";
    const RowTiling tiling =
        RowResidentRmsNormBackwardKernel::TilingFor({.hidden_dim = 4096, .dtype = d});
    const int slots = static_cast<int>(tiling.vectors_per_thread);
    const int quads = slots * static_cast<int>(tiling.vector_elements / 4);
    // Per slot: x and dy streamed (evict first); gamma before the reduction and again after it
    // (cache hits, default policy); dx streamed.
    EXPECT_EQ(Count(t, "ld.global.cs" + v4), 2 * slots);
    EXPECT_EQ(Count(t, "ld.global" + v4), 2 * slots);
    EXPECT_EQ(Count(t, "st.global.cs" + v4), slots);
    // The tree: each thread's quads stored once per level and loaded from kFanIn members, L2
    // only; dgamma stored once (default policy).
    EXPECT_EQ(Count(t, "st.global.cg.v4.f32"), quads);
    EXPECT_EQ(Count(t, "ld.global.cg.v4.f32"),
              quads * static_cast<int>(RowResidentRmsNormBackwardKernel::kFanIn));
    EXPECT_EQ(Count(t, "st.global.v4.f32"), quads);
    // One arrival count per level (the only atomic), a release and an acquire fence, two
    // barriers per row and two per level, the entry's launch bounds.
    EXPECT_EQ(Count(t, "atom.global.add.u32"), 1);
    EXPECT_EQ(Count(t, "atom."), 1);
    EXPECT_EQ(Count(t, "fence.acq_rel.gpu"), 2);
    EXPECT_EQ(Count(t, "bar.sync"), 4);
    EXPECT_EQ(Count(t, "shfl.sync.bfly"), 10);
    EXPECT_TRUE(
        absl::StrContains(t, absl::StrCat(".maxntid ", tiling.threads, ", 1, 1\n.minnctapersm ",
                                          tiling.blocks_per_sm, "\n")))
        << t.substr(0, 600);
  }
}

TEST(RowResidentKernelTest, StreamedRowsReadTwiceAndSumTheTreeFromRows) {
  for (DType d : {DType::kF32, DType::kBF16}) {
    const KernelConfig c{.hidden_dim = 65536, .dtype = d, .target_sm = 90};
    absl::StatusOr<EmittedPtx> ptx = Main().Emit(c);
    ASSERT_TRUE(ptx.ok()) << ptx.status();
    const std::string& t = ptx->text;
    const std::string v4 = d == DType::kF32 ? ".v4.f32" : ".v4.u32";
    // One segment of code per pass (a loop): pass 1 keeps x and dy in L2 (.cg), pass 2 reads
    // them a last time (.cs) and streams dx out; gamma in both (default policy).
    EXPECT_EQ(Count(t, "ld.global.cg" + v4), d == DType::kF32 ? 2 + 1 + 16 + 1 : 2);
    EXPECT_EQ(Count(t, "ld.global.cs" + v4), 2);
    EXPECT_EQ(Count(t, "st.global.cs" + v4), 1);
    EXPECT_EQ(Count(t, "atom."), 1);
    EXPECT_EQ(Count(t, "fence.acq_rel.gpu"), 2);
    EXPECT_TRUE(absl::StrContains(t, ".maxntid 1024, 1, 1\n.minnctapersm 1\n")) << t.substr(0, 600);
    EXPECT_TRUE(absl::StrContains(ptx->config_key, "|tile=1024x")) << ptx->config_key;
    EXPECT_EQ(ptx->config_key.back(), 's');
  }
}

TEST(RowResidentKernelTest, DivergenceAnalysisIsClean) {
  const NormVariant variants[] = {{},
                                  {1.0f, true, CastingMode::kLlama},
                                  {-0.5f, true, CastingMode::kNone},
                                  {0.0f, false, CastingMode::kGemma}};
  for (const NormVariant& v : variants) {
    for (DType d : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (uint32_t h : {1u, 3u, 33u, 896u, 4095u, 4097u, 8193u, 16384u, 16385u, 40000u, 65536u}) {
        const KernelConfig c{.hidden_dim = h, .dtype = d, .target_sm = 80, .variant = v};
        absl::StatusOr<Module> m = static_cast<const BuiltKernel&>(Main()).Build(c);
        ASSERT_TRUE(m.ok()) << m.status();
        EXPECT_TRUE(CheckDivergence(*m, LaunchAssumptions{}).ok())
            << Main().EntryName() << " " << h << v.KeySuffix();
      }
    }
  }
}

// ptxas, as in ptxas_test.cc: PATH, then /usr/local/cuda/bin.
std::optional<std::string> FindPtxas() {
  if (const char* path = std::getenv("PATH"); path != nullptr) {
    for (absl::string_view dir : absl::StrSplit(path, ':', absl::SkipEmpty())) {
      const std::string candidate = absl::StrCat(dir, "/ptxas");
      if (access(candidate.c_str(), X_OK) == 0) return candidate;
    }
  }
  if (access("/usr/local/cuda/bin/ptxas", X_OK) == 0) return "/usr/local/cuda/bin/ptxas";
  return std::nullopt;
}

std::string Assemble(const std::string& ptxas, const std::string& text, int sm, int* exit_code) {
  const std::string base = absl::StrCat(::testing::TempDir(), "/normgrad_rr_", getpid(), "_", sm);
  {
    std::ofstream f(base + ".ptx", std::ios::binary | std::ios::trunc);
    f << text;
  }
  const std::string cmd = absl::StrCat("'", ptxas, "' -arch=sm_", sm, " -v '", base, ".ptx' -o '",
                                       base, ".cubin' 2>&1");
  std::string out;
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) out.append(buf, n);
  const int status = pclose(pipe);
  *exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::remove((base + ".ptx").c_str());
  std::remove((base + ".cubin").c_str());
  return out;
}

// ptxas assembles `c` with a register count that lets .minnctapersm blocks of the tiling's
// threads fit in an SM's 65,536 registers, and no spills; returns the registers (0 on failure).
int ExpectAssemblesWithoutSpills(const std::string& ptxas, const KernelConfig& c) {
  const std::regex used("Used ([0-9]+) registers");
  absl::StatusOr<EmittedPtx> ptx = Main().Emit(c);
  EXPECT_TRUE(ptx.ok()) << ptx.status();
  if (!ptx.ok()) return 0;
  const std::string what = absl::StrCat(DTypeName(c.dtype), " h", c.hidden_dim, " sm_",
                                        c.target_sm, c.variant.KeySuffix());
  int code = -1;
  const std::string out = Assemble(ptxas, ptx->text, c.target_sm, &code);
  EXPECT_EQ(code, 0) << what << "\n" << out;
  std::smatch match;
  int regs = 0;
  if (!std::regex_search(out, match, used) || !absl::SimpleAtoi(match[1].str(), &regs)) {
    ADD_FAILURE() << what << ": no register count in\n" << out;
    return 0;
  }
  const RowTiling tiling = RowResidentRmsNormBackwardKernel::TilingFor(c);
  const uint32_t threads = Main().Geometry(c, 1).block[0];
  // .minnctapersm holds: that many blocks fit in an SM's 65,536 registers.
  EXPECT_LE(regs * threads * tiling.blocks_per_sm, 65536u) << what;
  EXPECT_TRUE(absl::StrContains(out, "0 bytes spill stores")) << what << "\n" << out;
  return regs;
}

TEST(RowResidentKernelTest, PtxasAssemblesEveryTargetWithRegistersThatFitTheBlock) {
  const std::optional<std::string> ptxas = FindPtxas();
  if (!ptxas.has_value()) GTEST_SKIP() << "ptxas not found on PATH or in /usr/local/cuda/bin";
  for (int sm : {75, 80, 90, 100}) {
    for (DType d : {DType::kF32, DType::kBF16, DType::kF16}) {
      if (d == DType::kBF16 && sm < 80) continue;
      for (uint32_t h : {1u, 896u, 4096u, 4097u, 8192u, 16384u, 16385u, 65536u}) {
        const KernelConfig c{.hidden_dim = h, .dtype = d, .target_sm = sm};
        const int regs = ExpectAssemblesWithoutSpills(*ptxas, c);
        if (sm == 90 && (h == 896 || h == 4096 || h == 16384 || h == 65536)) {
          std::cout << "rms_norm_backward_row_resident " << DTypeName(d) << " hidden_dim=" << h
                    << " sm_90 block=" << Main().Geometry(c, 1).block[0] << ": " << regs
                    << " registers\n";
        }
      }
    }
  }
}

TEST(RowResidentKernelTest, PtxasAssemblesTheVariantsWithoutSpills) {
  const std::optional<std::string> ptxas = FindPtxas();
  if (!ptxas.has_value()) GTEST_SKIP() << "ptxas not found on PATH or in /usr/local/cuda/bin";
  // The most instructions (offset add, both roundings), the product rounding alone, and the
  // fewest (no gamma), held (up to the most registers, 16384) and streamed.
  const NormVariant variants[] = {{1.0f, true, CastingMode::kLlama},
                                  {-0.5f, true, CastingMode::kNone},
                                  {0.0f, false, CastingMode::kGemma}};
  for (int sm : {75, 80, 90, 100}) {
    for (DType d : {DType::kBF16, DType::kF16, DType::kF32}) {
      if (d == DType::kBF16 && sm < 80) continue;
      for (const NormVariant& v : variants) {
        if (d == DType::kF32 && v.casting == CastingMode::kNone) continue;  // same PTX as gemma
        for (uint32_t h : {1u, 896u, 4097u, 16384u, 16385u, 65536u}) {
          KernelConfig c{.hidden_dim = h, .dtype = d, .target_sm = sm};
          c.variant = v;
          const int regs = ExpectAssemblesWithoutSpills(*ptxas, c);
          if (sm == 90 && (h == 16384 || h == 65536)) {
            std::cout << "rms_norm_backward_row_resident" << v.KeySuffix() << " " << DTypeName(d)
                      << " hidden_dim=" << h << " sm_90: " << regs << " registers\n";
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace normgrad::kernels
