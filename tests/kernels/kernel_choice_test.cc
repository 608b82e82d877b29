// Which kernel a request gets (kernels/rmsnorm/kernel_choice.h): the choice for a request and a device,
// a named kernel obeyed, and the named-kernel checks in the words the backends answer with.
#include "kernels/rmsnorm/kernel_choice.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "kernels/rmsnorm/kernel_registry.h"

namespace normgrad::kernels {
namespace {

constexpr BackwardDevice kH100{.target_sm = 90, .sm_count = 132};
constexpr BackwardDevice kTuring{.target_sm = 75, .sm_count = 40};

std::string Chosen(const BackwardRequest& request, const BackwardDevice& device) {
  absl::StatusOr<const BackwardKernel*> k = ChooseBackwardKernel(request, device);
  if (!k.ok()) return "error: " + std::string(k.status().message());
  return *k == nullptr ? "host" : std::string((*k)->EntryName());
}

TEST(ChooseBackwardKernel, PrefersTheRowResidentKernelThenByRmsAndWidth) {
  EXPECT_EQ(Chosen({.hidden_dim = 4096}, kH100), "rms_norm_backward_row_resident");
  EXPECT_EQ(Chosen({.hidden_dim = 4096, .rms_provided = true}, kH100),
            "rms_norm_backward_row_resident");
  EXPECT_EQ(Chosen({.hidden_dim = 65536}, kH100), "rms_norm_backward_row_resident");
  // Wider than the row-resident kernel streams: rms recomputed, or the host with a given rms.
  EXPECT_EQ(Chosen({.hidden_dim = 65537}, kH100), "batched_rms_norm_backward");
  EXPECT_EQ(Chosen({.hidden_dim = 65537, .rms_provided = true}, kH100), "host");
  // bf16 below sm_80: the row-resident kernel cannot run there; narrow rows with a given rms go
  // to the warp kernel (which then fails on the device's target), wider ones to the host.
  EXPECT_EQ(Chosen({.hidden_dim = 32, .dtype = DType::kBF16, .rms_provided = true}, kTuring),
            "rms_norm_backward");
  EXPECT_EQ(Chosen({.hidden_dim = 33, .dtype = DType::kBF16, .rms_provided = true}, kTuring), "host");
  EXPECT_EQ(Chosen({.hidden_dim = 4096, .dtype = DType::kBF16}, kTuring),
            "batched_rms_norm_backward");
}

TEST(ChooseBackwardKernel, GivesEveryVariantToTheRowResidentKernelOnly) {
  const NormVariant offset{.gamma_offset = 1.0f};
  const NormVariant no_gamma{.has_gamma = false};
  const NormVariant llama{.casting = CastingMode::kLlama};
  for (const NormVariant& v : {offset, no_gamma, llama}) {
    for (bool rms : {false, true}) {
      // Where the default would go to the warp kernel, the batched kernel or the host.
      for (uint32_t h : {16u, 4096u, 65536u}) {
        EXPECT_EQ(Chosen({.hidden_dim = h, .rms_provided = rms, .variant = v}, kH100),
                  "rms_norm_backward_row_resident")
            << v.Describe() << " h" << h;
      }
      // bf16 on sm_75: still the row-resident kernel, whose CanImplement then fails on the
      // device's target (the backend says so), never a kernel that would ignore the variant.
      EXPECT_EQ(Chosen({.hidden_dim = 32, .dtype = DType::kBF16, .rms_provided = rms, .variant = v},
                       kTuring),
                "rms_norm_backward_row_resident");
      // Wider than the row-resident kernel takes: its refusal, naming the variant.
      const std::string wide = Chosen({.hidden_dim = 65537, .rms_provided = rms, .variant = v}, kH100);
      EXPECT_TRUE(absl::StartsWith(wide, "error: no kernel computes this RMSNorm variant (" +
                                             v.Describe() + ")"))
          << wide;
      EXPECT_TRUE(absl::StrContains(wide, "hidden_dim 65537 is outside 1..65536")) << wide;
    }
  }
}

TEST(ChooseBackwardKernel, ANamedKernelThatCannotComputeTheVariantIsRefused) {
  const NormVariant offset{.gamma_offset = 0.5f, .casting = CastingMode::kNone};
  for (absl::string_view name : {"batched_rms_norm_backward", "rms_norm_backward"}) {
    const std::string got =
        Chosen({.hidden_dim = 16, .rms_provided = true, .kernel = std::string(name), .variant = offset},
               kH100);
    EXPECT_EQ(got, "error: " + std::string(name) +
                       " implements the plain RMSNorm only (gamma_offset 0, a gamma, casting mode "
                       "gemma); this batch has gamma_offset 0.5, a gamma, casting mode none; "
                       "rms_norm_backward_row_resident computes the variants");
  }
  EXPECT_EQ(Chosen({.hidden_dim = 16,
                    .kernel = "rms_norm_backward_row_resident",
                    .variant = offset},
                   kH100),
            "rms_norm_backward_row_resident");
}

TEST(ChooseBackwardKernel, ObeysANamedKernelAfterCheckingIt) {
  EXPECT_EQ(Chosen({.hidden_dim = 64, .kernel = "batched_rms_norm_backward"}, kH100),
            "batched_rms_norm_backward");
  EXPECT_EQ(Chosen({.hidden_dim = 16, .rms_provided = true, .kernel = "rms_norm_backward"}, kH100),
            "rms_norm_backward");
  EXPECT_EQ(Chosen({.hidden_dim = 64, .kernel = "rms_norm_backward"}, kH100),
            "error: hidden_dim 64 is outside 1..32, the limit of rms_norm_backward (one warp per "
            "row); use batched_rms_norm_backward");
}

TEST(CheckNamedKernel, SaysWhatIsWrongInTheBackendsWords) {
  EXPECT_TRUE(CheckNamedKernel({.hidden_dim = 64}).ok());
  // A request naming `kernel` (a function: GCC 12 warns falsely on a std::string member of a
  // designated initializer inside an initializer list).
  auto named = [](uint32_t hidden_dim, std::string kernel, bool rms_provided = false,
                  float eps = 1e-5f) {
    BackwardRequest r;
    r.hidden_dim = hidden_dim;
    r.kernel = std::move(kernel);
    r.rms_provided = rms_provided;
    r.eps = eps;
    return r;
  };
  struct Case {
    BackwardRequest request;
    std::string want;
  };
  const std::vector<Case> cases = {
      {named(64, "fast_one"), "kernel \"fast_one\" is unknown"},
      {named(16, "rms_norm_backward"),
       "kernel \"rms_norm_backward\" needs the forward pass's rms (one value per row); none given"},
      {named(64, "batched_rms_norm_backward", /*rms_provided=*/true, /*eps=*/0),
       "kernel \"batched_rms_norm_backward\" recomputes rms from x and eps (a given rms is not "
       "read): eps is 0; must be finite and > 0; leave kernel empty to use the given rms"},
      {named(70000, "rms_norm_backward_row_resident"), "hidden_dim 70000 is outside 1..65536"},
  };
  for (const Case& c : cases) {
    const absl::Status s = CheckNamedKernel(c.request);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.want;
    EXPECT_TRUE(absl::StrContains(s.message(), c.want)) << s;
  }
  // A kernel that reads the given rms needs no eps.
  EXPECT_TRUE(CheckNamedKernel(named(64, "rms_norm_backward_row_resident", true, 0)).ok());
}

TEST(ReadsGivenRms, OnlyWhenGivenAndTheKernelReadsIt) {
  EXPECT_FALSE(ReadsGivenRms({.hidden_dim = 64}));
  EXPECT_TRUE(ReadsGivenRms({.hidden_dim = 64, .rms_provided = true}));
  EXPECT_TRUE(ReadsGivenRms(
      {.hidden_dim = 64, .rms_provided = true, .kernel = "rms_norm_backward_row_resident"}));
  EXPECT_FALSE(
      ReadsGivenRms({.hidden_dim = 64, .rms_provided = true, .kernel = "batched_rms_norm_backward"}));
}

TEST(ConfigFor, TakesTheRequestsShapeAndTheDevicesTarget) {
  const KernelConfig c = ConfigFor({.hidden_dim = 896, .dtype = DType::kF16}, kH100);
  EXPECT_EQ(c.hidden_dim, 896u);
  EXPECT_EQ(c.dtype, DType::kF16);
  EXPECT_EQ(c.target_sm, 90);
  EXPECT_EQ(c.sm_count, 132u);
  EXPECT_FALSE(c.ptx_version.has_value());
}

}  // namespace
}  // namespace normgrad::kernels
