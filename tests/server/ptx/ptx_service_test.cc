// PtxService without gRPC: batches of targets x dtypes (order, all-or-nothing, errors naming
// the item), the request bound, the single-configuration fields, the minimum CUDA driver, and
// resource usage with nvJitLink (when this machine has it) and without (said, not an error).
#include "server/ptx/ptx_service.h"

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "base/sha256.h"

namespace normgrad::server {
namespace {

using ::testing::HasSubstr;

PtxServiceOptions Options(const std::string& nvjitlink_path) {
  PtxServiceOptions options;
  options.cache.max_entries = 64;
  options.cache.max_bytes = 64ull << 20;
  options.nvjitlink_path = nvjitlink_path;
  return options;
}

v1::EmitPtxRequest Request(const std::string& kernel = "rms_norm_backward_row_resident") {
  v1::EmitPtxRequest r;
  r.set_kernel(kernel);
  r.set_hidden_dim(4096);
  return r;
}

// The resource usage of the row-resident kernel for sm_80 and sm_90.
v1::EmitPtxRequest ResourceUsageRequest() {
  v1::EmitPtxRequest r = Request();
  r.add_targets("sm_80");
  r.add_targets("sm_90");
  r.set_resource_usage(true);
  return r;
}

TEST(PtxServiceTest, BatchIsOneArtifactPerTargetAndDtypeTargetsOuter) {
  PtxService ptx(Options("/nonexistent/libnvJitLink.so.13"));
  v1::EmitPtxRequest request = Request();
  request.add_targets("sm_80");
  request.add_targets("sm_90");
  request.add_dtypes(v1::DTYPE_F32);
  request.add_dtypes(v1::DTYPE_BF16);
  absl::StatusOr<v1::EmitPtxResponse> r = ptx.Emit(request);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->artifacts_size(), 4);
  const std::pair<const char*, v1::DType> want[] = {{"sm_80", v1::DTYPE_F32},
                                                    {"sm_80", v1::DTYPE_BF16},
                                                    {"sm_90", v1::DTYPE_F32},
                                                    {"sm_90", v1::DTYPE_BF16}};
  for (int i = 0; i < 4; ++i) {
    const v1::EmitPtxArtifact& a = r->artifacts(i);
    EXPECT_EQ(a.target(), want[i].first) << i;
    EXPECT_EQ(a.dtype(), want[i].second) << i;
    EXPECT_THAT(a.ptx(), HasSubstr(std::string(".target ") + want[i].first));
    EXPECT_EQ(a.digest().sha256(), base::Sha256Hex(a.ptx()));
    EXPECT_EQ(a.entry(), "rms_norm_backward_row_resident");
    EXPECT_FALSE(a.has_resource_usage());
    EXPECT_TRUE(a.resource_usage_unknown().empty());  // not asked
  }
  EXPECT_NE(r->artifacts(0).digest().sha256(), r->artifacts(1).digest().sha256());
  // The single-configuration fields stay empty for a batch.
  EXPECT_TRUE(r->ptx().empty());
  EXPECT_TRUE(r->entry().empty());

  // The same configuration alone: the same artifact, also in the old fields.
  v1::EmitPtxRequest single = Request();
  single.set_target("sm_90");
  single.set_dtype(v1::DTYPE_BF16);
  absl::StatusOr<v1::EmitPtxResponse> one = ptx.Emit(single);
  ASSERT_TRUE(one.ok()) << one.status();
  ASSERT_EQ(one->artifacts_size(), 1);
  EXPECT_EQ(one->artifacts(0).SerializeAsString(), r->artifacts(3).SerializeAsString());
  EXPECT_EQ(one->ptx(), r->artifacts(3).ptx());
  EXPECT_EQ(one->digest().sha256(), r->artifacts(3).digest().sha256());
  EXPECT_EQ(one->target(), "sm_90");
  EXPECT_EQ(one->config_key(), r->artifacts(3).config_key());
}

// The variant fields emit that variant: its own PTX and config_key, for every configuration of
// a batch; invalid fields and kernels that do not emit the variant are INVALID_ARGUMENT naming
// the field or the variant.
TEST(PtxServiceTest, VariantFieldsEmitThatVariant) {
  PtxService ptx(Options("/nonexistent/libnvJitLink.so.13"));
  v1::EmitPtxRequest plain = Request();
  plain.set_dtype(v1::DTYPE_BF16);
  plain.set_target("sm_90");
  absl::StatusOr<v1::EmitPtxResponse> base = ptx.Emit(plain);
  ASSERT_TRUE(base.ok()) << base.status();

  v1::EmitPtxRequest gemma = plain;
  gemma.set_gamma_offset(1.0f);
  v1::EmitPtxRequest llama = plain;
  llama.set_casting_mode(v1::CASTING_MODE_LLAMA);
  v1::EmitPtxRequest no_gamma = plain;
  no_gamma.set_no_gamma(true);
  std::vector<std::string> texts = {base->ptx()};
  for (const auto& [request, suffix] : {std::pair{gemma, "_off3f800000"}, std::pair{llama, "_llama"},
                                        std::pair{no_gamma, "_nogamma"}}) {
    SCOPED_TRACE(suffix);
    absl::StatusOr<v1::EmitPtxResponse> r = ptx.Emit(request);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_THAT(r->config_key(), HasSubstr(suffix));
    EXPECT_THAT(base->config_key(), ::testing::Not(HasSubstr(suffix)));
    for (const std::string& other : texts) EXPECT_NE(r->ptx(), other);
    texts.push_back(r->ptx());
  }

  v1::EmitPtxRequest batch = gemma;
  batch.clear_dtype();
  batch.clear_target();
  batch.add_targets("sm_90");
  batch.add_dtypes(v1::DTYPE_F32);
  batch.add_dtypes(v1::DTYPE_BF16);
  absl::StatusOr<v1::EmitPtxResponse> r = ptx.Emit(batch);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->artifacts_size(), 2);
  for (const v1::EmitPtxArtifact& a : r->artifacts()) EXPECT_THAT(a.config_key(), HasSubstr("_off3f800000"));
  EXPECT_EQ(r->artifacts(1).ptx(), texts[1]);  // the bf16 one, as emitted alone

  v1::EmitPtxRequest bad = no_gamma;
  bad.set_gamma_offset(1.0f);
  absl::StatusOr<v1::EmitPtxResponse> e = ptx.Emit(bad);
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(e.status().message(), HasSubstr("gamma_offset is 1 with no_gamma"));
  bad = plain;
  bad.set_gamma_offset(std::numeric_limits<float>::infinity());
  e = ptx.Emit(bad);
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(e.status().message(), HasSubstr("gamma_offset is inf; must be finite"));
  bad = plain;
  bad.set_casting_mode(static_cast<v1::CastingMode>(7));
  e = ptx.Emit(bad);
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(e.status().message(), HasSubstr("casting_mode is 7"));
  bad = Request("rms_norm_backward");
  bad.set_hidden_dim(32);
  bad.set_gamma_offset(1.0f);
  e = ptx.Emit(bad);
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument) << e.status();
}

TEST(PtxServiceTest, MinCudaDriverFollowsThePtxVersion) {
  PtxService ptx(Options("/nonexistent/libnvJitLink.so.13"));
  for (const auto& [target, version, driver] :
       {std::tuple{"sm_80", "", "11.0"}, std::tuple{"sm_90", "", "11.8"},
        std::tuple{"sm_90", "8.0", "12.0"}, std::tuple{"sm_90", "8.5", "12.5"},
        std::tuple{"sm_90", "8.6", "12.7"}, std::tuple{"sm_120", "", "12.8"},
        std::tuple{"sm_90", "9.0", "13.0"}}) {
    v1::EmitPtxRequest request = Request("batched_rms_norm_backward");
    request.set_target(target);
    request.set_ptx_version(version);
    absl::StatusOr<v1::EmitPtxResponse> r = ptx.Emit(request);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->artifacts(0).min_cuda_driver(), driver)
        << target << " PTX " << r->artifacts(0).ptx_version();
  }
}

TEST(PtxServiceTest, ABadItemFailsTheBatchNamingIndexFieldAndValue) {
  PtxService ptx(Options("/nonexistent/libnvJitLink.so.13"));
  struct BadRequest {
    std::vector<std::string> targets;
    std::vector<v1::DType> dtypes;
    std::string target;     // the single-target field
    uint32_t hidden_dim;    // 0: Request()'s
    std::vector<std::string> messages;  // each part of the error
  };
  const BadRequest cases[] = {
      {{"sm_90", "sm_ninety"}, {}, "", 0, {"targets[1]: target \"sm_ninety\" is not sm_NN"}},
      {{"sm_90", "sm_70"}, {}, "", 0, {"targets[1]: target sm_70 is not supported"}},
      // Each item is fine alone; one combination is not (bf16 needs sm_80).
      {{"sm_90", "sm_75"}, {v1::DTYPE_F32, v1::DTYPE_BF16}, "", 0,
       {"configuration 3 (targets[1] sm_75, dtypes[1] bf16): dtype bf16 needs target sm_80 or "
        "newer"}},
      {{"sm_90", "sm_80", "sm_90"}, {}, "", 0, {"targets[2] \"sm_90\" repeats targets[0]"}},
      {{}, {v1::DTYPE_F16, static_cast<v1::DType>(7)}, "", 0,
       {"dtypes[1] is 7, not a known DType"}},
      {{"sm_80"}, {}, "sm_90", 0, {"target \"sm_90\" and targets (1 items) are both set"}},
      // hidden_dim 70000 is above the row-resident kernel's bound for every configuration: the
      // first one is named.
      {{"sm_80"}, {v1::DTYPE_BF16}, "", 70000,
       {"configuration 0 (targets[0] sm_80, dtypes[0] bf16): ", "70000"}},
  };
  for (const BadRequest& c : cases) {
    v1::EmitPtxRequest request = Request();
    if (!c.target.empty()) request.set_target(c.target);
    for (const std::string& t : c.targets) request.add_targets(t);
    for (v1::DType d : c.dtypes) request.add_dtypes(d);
    if (c.hidden_dim != 0) request.set_hidden_dim(c.hidden_dim);
    absl::StatusOr<v1::EmitPtxResponse> r = ptx.Emit(request);
    ASSERT_FALSE(r.ok()) << c.messages.front();
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    for (const std::string& m : c.messages) EXPECT_THAT(r.status().message(), HasSubstr(m));
  }
}

TEST(PtxServiceTest, ConfigurationsPerRequestAreBounded) {
  PtxService ptx(Options("/nonexistent/libnvJitLink.so.13"));
  v1::EmitPtxRequest request = Request("batched_rms_norm_backward");
  for (int sm : {80, 86, 87, 89, 90, 100, 103, 110, 120, 121}) {
    request.add_targets("sm_" + std::to_string(sm));
  }
  for (v1::DType d : {v1::DTYPE_F32, v1::DTYPE_BF16, v1::DTYPE_F16}) request.add_dtypes(d);
  absl::StatusOr<v1::EmitPtxResponse> all = ptx.Emit(request);  // every target with bf16
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->artifacts_size(), 30);

  // 32 is allowed (16 targets x 2 dtypes pass the bound; the repeats are what fails), 33 not.
  v1::EmitPtxRequest at_bound = Request("batched_rms_norm_backward");
  for (int i = 0; i < 16; ++i) at_bound.add_targets("sm_90");
  for (v1::DType d : {v1::DTYPE_F32, v1::DTYPE_BF16}) at_bound.add_dtypes(d);
  EXPECT_EQ(ptx.Emit(at_bound).status().code(), absl::StatusCode::kInvalidArgument);
  v1::EmitPtxRequest above = Request("batched_rms_norm_backward");
  for (int i = 0; i < 11; ++i) above.add_targets("sm_90");
  for (v1::DType d : {v1::DTYPE_F32, v1::DTYPE_BF16, v1::DTYPE_F16}) above.add_dtypes(d);
  EXPECT_EQ(ptx.Emit(above).status().code(), absl::StatusCode::kResourceExhausted);

  v1::EmitPtxRequest too_many = Request("batched_rms_norm_backward");
  for (int i = 0; i < 17; ++i) too_many.add_targets("sm_90");  // checked before the items
  for (v1::DType d : {v1::DTYPE_F32, v1::DTYPE_BF16, v1::DTYPE_F16}) too_many.add_dtypes(d);
  absl::StatusOr<v1::EmitPtxResponse> r = ptx.Emit(too_many);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(r.status().message(),
              HasSubstr("targets (17) x dtypes (3) = 51 configurations; at most 32"));
}

TEST(PtxServiceTest, ResourceUsageWithoutNvJitLinkSaysWhyAndStillAnswers) {
  PtxService ptx(Options("/nonexistent/libnvJitLink.so.13"));
  v1::EmitPtxRequest request = ResourceUsageRequest();
  absl::StatusOr<v1::EmitPtxResponse> r = ptx.Emit(request);
  ASSERT_TRUE(r.ok()) << r.status();
  for (const v1::EmitPtxArtifact& a : r->artifacts()) {
    EXPECT_FALSE(a.has_resource_usage());
    EXPECT_THAT(a.resource_usage_unknown(), HasSubstr("nvJitLink is not available"));
    EXPECT_FALSE(a.ptx().empty());
  }
  request.set_cubin(true);  // a cubin cannot be had without it
  EXPECT_EQ(ptx.Emit(request).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(PtxServiceTest, ResourceUsageFromNvJitLinksReport) {
  PtxService ptx(Options(""));
  if (!ptx.has_nvjitlink()) GTEST_SKIP() << "no nvJitLink on this machine";
  v1::EmitPtxRequest request = ResourceUsageRequest();
  absl::StatusOr<v1::EmitPtxResponse> r = ptx.Emit(request);
  ASSERT_TRUE(r.ok()) << r.status();
  for (const v1::EmitPtxArtifact& a : r->artifacts()) {
    SCOPED_TRACE(a.target());
    ASSERT_TRUE(a.has_resource_usage()) << a.resource_usage_unknown();
    // The row stays in registers; grad_gamma's partials go through shared memory and a barrier.
    EXPECT_GT(a.resource_usage().registers(), 32u);
    EXPECT_LE(a.resource_usage().registers(), 255u);
    EXPECT_GT(a.resource_usage().shared_memory_bytes(), 0u);
    EXPECT_GE(a.resource_usage().barriers(), 1u);
    // At the 64 registers its .minnctapersm 2 allows, nvJitLink's relocatable assembly for
    // sm_80 keeps one word on the stack (docs/kernels.md, "Resource usage"); sm_90 none.
    EXPECT_LE(a.resource_usage().spill_store_bytes(), a.target() == "sm_90" ? 0u : 8u);
    EXPECT_TRUE(a.cubin().empty());  // resources only: no cubin bytes
    EXPECT_FALSE(a.has_cubin_digest());
  }
  // A cubin request for the same configuration uses the same assembly (one compile, cached).
  const uint64_t compiles = ptx.CacheStats().compiles;
  request.set_cubin(true);
  absl::StatusOr<v1::EmitPtxResponse> with_cubin = ptx.Emit(request);
  ASSERT_TRUE(with_cubin.ok()) << with_cubin.status();
  EXPECT_EQ(ptx.CacheStats().compiles, compiles);
  EXPECT_EQ(with_cubin->artifacts(1).resource_usage().registers(),
            r->artifacts(1).resource_usage().registers());
  EXPECT_EQ(with_cubin->artifacts(1).cubin().substr(0, 4),
            "\x7f"
            "ELF");
}

}  // namespace
}  // namespace normgrad::server
