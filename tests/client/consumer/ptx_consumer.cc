// Built with normgrad_add_ptx_library() from an install tree (tests/client/consumer_test.cmake).
// Checks every embedded image of both libraries (the plain RMSNorm, and a variant) against the
// files the installed normgrad-ptx (and normgrad-cubin) wrote into REF_DIR, byte for byte and by
// digest, the variant each image records, and which image PtxLibrary::Find chooses for a few
// devices. Exit 0 when everything holds, else 1 with one line per failure.
//
//   ptx_consumer REF_DIR CUBINS
//
// REF_DIR holds, per configuration, STEM.ptx and STEM.ptx.sha256 (and STEM.cubin,
// STEM.cubin.sha256 when CUBINS is 1), STEM = KERNEL_hHIDDEN_DTYPE_sm_NN (with _off1_llama for
// the variant's), and list.txt, what `normgrad-ptx --list` prints.
#include <cstdio>
#include <string>

#include "consumer_ptx.h"
#include "consumer_ptx_variant.h"

namespace {

// What consumer/CMakeLists.txt asks for: 2 kernels x 1 hidden_dim x 1 dtype x 2 targets.
constexpr const char* kKernels[] = {"rms_norm_backward_row_resident", "batched_rms_norm_backward"};
constexpr uint32_t kHiddenDim = 896;
constexpr const char* kDType = "bf16";
constexpr size_t kConfigurations = 4;
// consumer_ptx_variant: the row-resident kernel only (the batched one computes the plain RMSNorm
// only) x 2 targets, GAMMA_OFFSET 1 CASTING_MODE llama.
constexpr size_t kVariantConfigurations = 2;

int failures = 0;

void Expect(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "FAIL: %s\n", what.c_str());
    ++failures;
  }
}

std::string ReadFile(const std::string& path) {
  std::FILE* file = std::fopen(path.c_str(), "rb");
  if (file == nullptr) {
    Expect(false, "cannot read " + path);
    return "";
  }
  std::string bytes;
  char buffer[65536];
  for (size_t n; (n = std::fread(buffer, 1, sizeof(buffer), file)) > 0;) bytes.append(buffer, n);
  std::fclose(file);
  return bytes;
}

std::string Describe(const normgrad::PtxImage* image) {
  if (image == nullptr) return "none";
  return std::string(image->kind == normgrad::PtxImageKind::kCubin ? "cubin" : "PTX") + " sm_" +
         std::to_string(image->target_sm);
}

struct Variant {
  float gamma_offset;
  bool has_gamma;
  std::string casting_mode;
};

// Every image of `library`: `configurations` of them (twice that with cubins), each the bytes
// and digest of REF_DIR/STEM`suffix`, entry and parameters as normgrad-ptx --list says, and the
// variant the library was asked for.
void CheckImages(const normgrad::PtxLibrary& library, size_t configurations,
                 const std::string& dir, bool cubins, const std::string& list,
                 const std::string& suffix, const Variant& variant) {
  Expect(library.size() == configurations * (cubins ? 2 : 1),
         "images: " + std::to_string(library.size()) + ", expected " +
             std::to_string(configurations * (cubins ? 2 : 1)));
  for (const normgrad::PtxImage* image : library) {
    const bool ptx = image->kind == normgrad::PtxImageKind::kPtx;
    const std::string file = dir + "/" + image->kernel + "_h" + std::to_string(image->hidden_dim) +
                             "_" + image->dtype + "_sm_" + std::to_string(image->target_sm) +
                             suffix + (ptx ? ".ptx" : ".cubin");
    std::string digest = ReadFile(file + ".sha256");
    while (!digest.empty() && (digest.back() == '\n' || digest.back() == ' ')) digest.pop_back();
    Expect(image->bytes() == ReadFile(file), file + ": the embedded image differs");
    Expect(digest == image->sha256,
           file + ": digest " + image->sha256 + " embedded, " + digest + " of the file");
    Expect(std::string(image->entry) == image->kernel, file + ": entry " + image->entry);
    if (ptx) Expect(image->data[image->size] == 0, file + ": PTX not NUL-terminated");
    if (!ptx) Expect(image->bytes().substr(0, 4) == "\177ELF", file + ": not an ELF cubin");
    // The entry's parameters, written as normgrad-ptx --list writes them.
    std::string signature = std::string(image->entry) + "(";
    for (size_t i = 0; i < image->num_params; ++i) {
      signature +=
          std::string(i == 0 ? "" : ", ") + image->params[i].name + ": " + image->params[i].type;
    }
    signature += ")\n";
    Expect(list.find(signature) != std::string::npos,
           file + ": parameters " + signature + "are not what normgrad-ptx --list says");
    Expect(image->gamma_offset == variant.gamma_offset && image->has_gamma == variant.has_gamma &&
               image->casting_mode == variant.casting_mode,
           file + ": variant gamma_offset " + std::to_string(image->gamma_offset) +
               (image->has_gamma ? " with" : " without") + " gamma, casting " +
               image->casting_mode + "; expected " + std::to_string(variant.gamma_offset) + " " +
               variant.casting_mode);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: ptx_consumer REF_DIR CUBINS(0|1)\n");
    return 2;
  }
  const std::string dir = argv[1];
  const bool cubins = std::string(argv[2]) == "1";
  const normgrad::PtxLibrary& library = normgrad::embedded::consumer_ptx();
  const std::string list = ReadFile(dir + "/list.txt");

  CheckImages(library, kConfigurations, dir, cubins, list, "", {0.0f, true, "gemma"});
  const normgrad::PtxLibrary& variant = normgrad::embedded::consumer_ptx_variant();
  CheckImages(variant, kVariantConfigurations, dir, cubins, list, "_off1_llama",
              {1.0f, true, "llama"});
  // The variant's flags reached the emitter: its PTX is not the plain one's.
  for (int sm : {80, 90}) {
    const normgrad::PtxImage* plain = library.Find(kKernels[0], kHiddenDim, kDType, sm);
    const normgrad::PtxImage* scaled = variant.Find(kKernels[0], kHiddenDim, kDType, sm);
    Expect(plain != nullptr && scaled != nullptr && plain->bytes() != scaled->bytes(),
           "sm_" + std::to_string(sm) + ": the variant's image is the plain RMSNorm's");
  }

  // Which image a device gets, for targets sm_80 and sm_90.
  struct Case {
    int device_sm;
    const char* expected;
  };
  const Case cases[] = {
      {75, "none"},                                // older than every target
      {80, cubins ? "cubin sm_80" : "PTX sm_80"},  // its own cubin
      {86, "PTX sm_80"},                           // no sm_86 cubin: newest PTX <= 86
      {89, "PTX sm_80"},
      {90, cubins ? "cubin sm_90" : "PTX sm_90"},
      {120, "PTX sm_90"},  // newer than every target: JIT sm_90
  };
  for (const char* kernel : kKernels) {
    for (const Case& c : cases) {
      const std::string chosen = Describe(library.Find(kernel, kHiddenDim, kDType, c.device_sm));
      Expect(chosen == c.expected, std::string(kernel) + " on sm_" + std::to_string(c.device_sm) +
                                       ": " + chosen + ", expected " + c.expected);
    }
    Expect(library.Find(kernel, 4096, kDType, 90) == nullptr, "hidden_dim 4096 was not embedded");
    Expect(library.Find(kernel, kHiddenDim, "f32", 90) == nullptr, "f32 was not embedded");
  }
  Expect(library.Find("rms_norm_backward", kHiddenDim, kDType, 90) == nullptr,
         "rms_norm_backward was not embedded");

  std::printf("%zu images checked, %s\n", library.size() + variant.size(),
              failures == 0 ? "all as expected" : "");
  return failures == 0 ? 0 : 1;
}
