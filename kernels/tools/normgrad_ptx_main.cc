// normgrad-ptx: prints the PTX of one kernel configuration, with no server and no GPU.
//
//   normgrad-ptx --kernel batched_rms_norm_backward --hidden-dim 896 --target sm_90
//                [--ptx-version 8.0] [--dtype f32] [-o out.ptx]
//                [--resource-usage [--nvjitlink PATH]]
//   normgrad-ptx --list
//
// --resource-usage prints, instead of the PTX (which -o still writes), one line with what the
// device pays for it, in the fields `normgrad emit-ptx --resource-usage` prints: registers,
// spills, shared and local memory from nvJitLink's assembler report (loaded at run time, as the
// server does; "resources=unknown (why)" without it), and the lowest CUDA driver for its PTX ISA.
//
// Exit status: 0 on success, 2 on bad arguments or a configuration the kernel refuses (one line
// on stderr saying why), 1 when the output file cannot be written or nvJitLink refuses the PTX.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/resource_line.h"
#include "kernels/kernel_config.h"
#include "kernels/rmsnorm/kernel_registry.h"
#include "kernels/ptx/targets.h"
#include "nvidia/nvjitlink.h"

namespace {

using normgrad::kernels::AllKernels;
using normgrad::kernels::FindKernel;
using normgrad::kernels::BackwardKernel;
using normgrad::kernels::KernelConfig;
using normgrad::kernels::KernelParam;

constexpr char kUsage[] =
    "usage: normgrad-ptx --kernel NAME --hidden-dim N [--target sm_NN] [--ptx-version X.Y] "
    "[--dtype f32] [--gamma-offset X] [--no-gamma] [--casting-mode llama|gemma|none] [-o FILE] "
    "[--resource-usage [--nvjitlink PATH]] | --list";

[[noreturn]] void Fail(const std::string& reason) {
  std::cerr << "normgrad-ptx: " << reason << "\n";
  std::exit(2);
}

void List() {
  for (const BackwardKernel* k : AllKernels()) {
    std::vector<std::string> params;
    for (const KernelParam& p : k->Params())
      params.push_back(absl::StrCat(p.name, ": ", p.ptx_type));
    std::cout << k->EntryName() << "(" << absl::StrJoin(params, ", ") << ")\n";
  }
}

// The report line (base::ResourceLine; the CLI prints the same, then sha256).
std::string ResourceLine(const normgrad::kernels::EmittedPtx& ptx,
                         normgrad::kernels::DType dtype, const std::string& nvjitlink_path,
                         bool* assembly_failed) {
  absl::StatusOr<std::string> driver = normgrad::kernels::MinCudaDriverForPtx(ptx.version);
  auto line = [&](const absl::StatusOr<std::string>& counts) {
    return normgrad::base::ResourceLine(ptx.entry, normgrad::kernels::DTypeName(dtype),
                                        absl::StrCat("sm_", ptx.target_sm),
                                        ptx.version.ToString(),
                                        driver.ok() ? *driver : "unknown", counts);
  };
  absl::StatusOr<std::unique_ptr<normgrad::server::NvJitLink>> jit =
      normgrad::server::NvJitLink::Load(nvjitlink_path);
  if (!jit.ok()) return line(jit.status());
  absl::StatusOr<normgrad::server::NvJitLink::Assembled> assembled =
      (*jit)->Assemble(ptx.text, ptx.target_sm);
  if (!assembled.ok()) {
    *assembly_failed = true;
    return line(assembled.status());
  }
  absl::StatusOr<normgrad::server::AssemblerReport> r =
      normgrad::server::ParseAssemblerReport(assembled->info_log, ptx.entry);
  if (!r.ok()) return line(r.status());
  return line(normgrad::base::ResourceCounts(r->registers, r->spill_store_bytes,
                                             r->spill_load_bytes, r->shared_memory_bytes,
                                             r->stack_frame_bytes, r->barriers));
}

}  // namespace

int main(int argc, char** argv) {
  std::string kernel_name;
  std::optional<uint32_t> hidden_dim;
  std::string output;
  std::string nvjitlink_path;  // empty: nvJitLink's default search (nvidia/nvjitlink.h)
  KernelConfig config;
  bool list = false;
  bool resource_usage = false;

  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) Fail(absl::StrCat(arg, " needs a value; ", kUsage));
      return argv[++i];
    };
    if (arg == "--list") {
      list = true;
    } else if (arg == "--help" || arg == "-h") {
      std::cout << kUsage << "\n";
      return 0;
    } else if (arg == "--kernel") {
      kernel_name = value();
    } else if (arg == "--hidden-dim") {
      const std::string v = value();
      uint32_t n = 0;
      if (!absl::SimpleAtoi(v, &n) || v.empty() || v[0] == '-' || v[0] == '+') {
        Fail(absl::StrCat("--hidden-dim \"", v, "\" is not a non-negative integer below 2^32"));
      }
      hidden_dim = n;
    } else if (arg == "--target") {
      absl::StatusOr<int> sm = normgrad::kernels::ParseTarget(value());
      if (!sm.ok()) Fail(std::string(sm.status().message()));
      config.target_sm = *sm;
    } else if (arg == "--ptx-version") {
      absl::StatusOr<normgrad::kernels::PtxVersion> v = normgrad::kernels::ParsePtxVersion(value());
      if (!v.ok()) Fail(std::string(v.status().message()));
      config.ptx_version = *v;
    } else if (arg == "--dtype") {
      absl::StatusOr<normgrad::kernels::DType> d = normgrad::kernels::ParseDType(value());
      if (!d.ok()) Fail(std::string(d.status().message()));
      config.dtype = *d;
    } else if (arg == "--gamma-offset") {
      const std::string v = value();
      float offset = 0.0f;
      if (!absl::SimpleAtof(v, &offset) || !std::isfinite(offset)) {
        Fail(absl::StrCat("--gamma-offset \"", v, "\" is not a finite number"));
      }
      config.variant.gamma_offset = normgrad::kernels::NormVariant::CanonicalOffset(offset);
    } else if (arg == "--no-gamma") {
      config.variant.has_gamma = false;
    } else if (arg == "--casting-mode") {
      absl::StatusOr<normgrad::kernels::CastingMode> mode =
          normgrad::kernels::ParseCastingMode(value());
      if (!mode.ok()) Fail(std::string(mode.status().message()));
      config.variant.casting = *mode;
    } else if (arg == "-o" || arg == "--output") {
      output = value();
    } else if (arg == "--resource-usage") {
      resource_usage = true;
    } else if (arg == "--nvjitlink") {
      nvjitlink_path = value();
    } else {
      Fail(absl::StrCat("unknown argument \"", arg, "\"; ", kUsage));
    }
  }

  if (list) {
    List();
    return 0;
  }
  if (kernel_name.empty()) Fail(absl::StrCat("--kernel is required; ", kUsage));
  const BackwardKernel* kernel = FindKernel(kernel_name);
  if (kernel == nullptr) {
    std::vector<std::string> names;
    for (const BackwardKernel* k : AllKernels()) names.push_back(std::string(k->EntryName()));
    Fail(absl::StrCat("unknown kernel \"", kernel_name, "\"; known: ", absl::StrJoin(names, ", ")));
  }
  if (!hidden_dim.has_value()) Fail(absl::StrCat("--hidden-dim is required; ", kUsage));
  config.hidden_dim = *hidden_dim;
  if (!config.variant.has_gamma && config.variant.gamma_offset != 0.0f) {
    Fail("--no-gamma takes no --gamma-offset (an offset scales gamma)");
  }

  absl::StatusOr<normgrad::kernels::EmittedPtx> ptx = kernel->Emit(config);
  if (!ptx.ok()) Fail(std::string(ptx.status().message()));

  int status = 0;
  if (resource_usage) {
    bool assembly_failed = false;
    std::cout << ResourceLine(*ptx, config.dtype, nvjitlink_path, &assembly_failed) << "\n";
    if (assembly_failed) status = 1;
  } else if (output.empty()) {
    std::cout << ptx->text;
    return std::cout.good() ? 0 : 1;
  }
  if (output.empty()) return std::cout.good() ? status : 1;
  std::ofstream file(output, std::ios::binary | std::ios::trunc);
  file << ptx->text;
  file.close();
  if (!file) {
    std::cerr << "normgrad-ptx: cannot write " << output << "\n";
    return 1;
  }
  return status;
}
