// ptxsim-traffic: the global-memory traffic of every launch the CUDA backend makes for one chunk
// of a shape, counted by the PTX interpreter in 32-byte sectors (docs/ptxsim.md), with dx checked
// against the CPU reference first.
//
//   build/bin/ptxsim-traffic --rows 16384 --hidden 4096 --dtype bf16 [--target sm_90]
//                            [--sm-count 132]
//
// One line per launch, then, as the last line:
//   launches=N bytes_per_element=B partial_bytes_per_element=P l2_bytes_per_element=L
//   sector_efficiency=E
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "tests/ptxsim/sim/traffic.h"

namespace {

using normgrad::kernels::DType;
using normgrad::ptxsim::LaunchLine;
using normgrad::ptxsim::PlanTraffic;
using normgrad::ptxsim::PlanTrafficOptions;

int Usage(const std::string& why) {
  std::fprintf(stderr,
               "ptxsim-traffic: %s\nusage: ptxsim-traffic --rows R --hidden H --dtype f32|bf16|f16 "
               "[--target sm_90] [--sm-count 132]\n",
               why.c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  PlanTrafficOptions options;
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) return Usage(flag + " needs a value");
    const std::string value = argv[i + 1];
    uint32_t number = 0;
    if (flag == "--rows" || flag == "--hidden" || flag == "--sm-count") {
      if (!absl::SimpleAtoi(value, &number) || number == 0) {
        return Usage(flag + " needs a positive integer, not '" + value + "'");
      }
      (flag == "--rows"     ? options.rows
       : flag == "--hidden" ? options.hidden
                            : options.sm_count) = number;
    } else if (flag == "--dtype") {
      if (value == "f32") {
        options.dtype = DType::kF32;
      } else if (value == "bf16") {
        options.dtype = DType::kBF16;
      } else if (value == "f16") {
        options.dtype = DType::kF16;
      } else {
        return Usage("--dtype is f32, bf16 or f16, not '" + value + "'");
      }
    } else if (flag == "--target") {
      if (!absl::StartsWith(value, "sm_") || !absl::SimpleAtoi(value.substr(3), &number)) {
        return Usage("--target is sm_NN, not '" + value + "'");
      }
      options.target_sm = static_cast<int>(number);
    } else {
      return Usage("unknown flag " + flag);
    }
  }
  if (options.rows == 0 || options.hidden == 0) return Usage("--rows and --hidden are required");

  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<PlanTraffic> t = normgrad::ptxsim::RunPlanTraffic(options);
  if (!t.ok()) {
    std::fprintf(stderr, "ptxsim-traffic: %s\n", t.status().ToString().c_str());
    return 1;
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("%s, %u x %u, dx within tolerance (max relative error %.3g), %.1f s\n",
              t->kernel.c_str(), t->rows, t->hidden, t->max_dx_error, seconds);
  for (size_t i = 0; i < t->launches.size(); ++i) {
    std::printf("launch %zu: %s\n", i, LaunchLine(t->launches[i], t->Elements()).c_str());
  }
  std::printf("%s\n", normgrad::ptxsim::SummaryLine(*t).c_str());
  return 0;
}
