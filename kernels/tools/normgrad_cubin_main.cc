// normgrad-cubin: compiles a PTX file to a cubin with nvJitLink, exactly as EmitPtx does on the
// server (NvJitLink::Compile), so that builds without a server embed the same bytes. Used by
// normgrad_add_ptx_library() (docs/build-systems.md); needs no GPU.
//
//   normgrad-cubin --target sm_90 -o k.cubin k.ptx
//   normgrad-cubin --check        # exit 0 when nvJitLink loads, else 3 and why on stderr
//
// Exit status: 0 on success, 2 on bad arguments or PTX nvJitLink refuses, 3 when nvJitLink is
// not available, 1 when a file cannot be read or written.
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/kernel_config.h"
#include "nvidia/nvjitlink.h"

namespace {

constexpr char kUsage[] =
    "usage: normgrad-cubin --target sm_NN -o FILE.cubin FILE.ptx | --check  "
    "(nvJitLink from $NORMGRAD_NVJITLINK, else the default search)";

int Fail(int code, const std::string& reason) {
  std::cerr << "normgrad-cubin: " << reason << "\n";
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  std::string input, output, target;
  bool check = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::cout << kUsage << "\n";
      return 0;
    }
    if (arg == "--check") {
      check = true;
    } else if (arg == "--target" || arg == "-o") {
      if (i + 1 >= argc) return Fail(2, absl::StrCat(arg, " needs a value; ", kUsage));
      (arg == "-o" ? output : target) = argv[++i];
    } else if (!arg.empty() && arg[0] != '-' && input.empty()) {
      input = arg;
    } else {
      return Fail(2, absl::StrCat("unexpected argument \"", arg, "\"; ", kUsage));
    }
  }
  const char* library = std::getenv("NORMGRAD_NVJITLINK");
  absl::StatusOr<std::unique_ptr<normgrad::server::NvJitLink>> jit =
      normgrad::server::NvJitLink::Load(library != nullptr ? library : "");
  if (check) {
    if (!jit.ok()) return Fail(3, std::string(jit.status().message()));
    std::cout << (*jit)->library_path() << "\n";
    return 0;
  }
  if (input.empty() || output.empty() || target.empty()) {
    return Fail(2, absl::StrCat("--target, -o and a PTX file are required; ", kUsage));
  }
  absl::StatusOr<int> sm = normgrad::kernels::ParseTarget(target);
  if (!sm.ok()) return Fail(2, std::string(sm.status().message()));
  if (!jit.ok()) return Fail(3, std::string(jit.status().message()));

  std::ifstream in(input, std::ios::binary);
  const std::string ptx((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (!in.good() && !in.eof()) return Fail(1, absl::StrCat("cannot read ", input));
  absl::StatusOr<std::string> cubin = (*jit)->Compile(ptx, *sm);
  if (!cubin.ok()) return Fail(2, absl::StrCat(input, ": ", cubin.status().message()));

  std::ofstream out(output, std::ios::binary | std::ios::trunc);
  out.write(cubin->data(), static_cast<std::streamsize>(cubin->size()));
  out.close();
  if (!out) return Fail(1, absl::StrCat("cannot write ", output));
  return 0;
}
