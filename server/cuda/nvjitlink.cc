#include "server/cuda/nvjitlink.h"

#include <dlfcn.h>
#include <glob.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace normgrad::server {
namespace {

// The subset of nvJitLink.h we call; the enums' values are the library's ABI.
using Handle = struct nvJitLink*;
constexpr int kSuccess = 0;
constexpr int kInputPtx = 2;

std::vector<std::string> DefaultCandidates() {
  std::vector<std::string> out = {"libnvJitLink.so.13", "libnvJitLink.so"};
  glob_t g;
  if (glob("/usr/local/cuda/lib64/libnvJitLink.so*", 0, nullptr, &g) == 0) {
    for (size_t i = 0; i < g.gl_pathc; ++i) out.emplace_back(g.gl_pathv[i]);
  }
  globfree(&g);
  return out;
}

}  // namespace

struct NvJitLink::Api {
  int (*create)(Handle*, uint32_t, const char**) = nullptr;
  int (*destroy)(Handle*) = nullptr;
  int (*add_data)(Handle, int, const void*, size_t, const char*) = nullptr;
  int (*complete)(Handle) = nullptr;
  int (*cubin_size)(Handle, size_t*) = nullptr;
  int (*cubin)(Handle, void*) = nullptr;
  int (*error_log_size)(Handle, size_t*) = nullptr;
  int (*error_log)(Handle, char*) = nullptr;
};

absl::StatusOr<std::unique_ptr<NvJitLink>> NvJitLink::Load(absl::string_view path) {
  std::vector<std::string> candidates =
      path.empty() ? DefaultCandidates() : std::vector<std::string>{std::string(path)};
  std::vector<std::string> errors;
  for (const std::string& candidate : candidates) {
    void* handle = dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      const char* e = dlerror();
      errors.push_back(e != nullptr ? e : candidate);
      continue;
    }
    auto api = std::make_unique<Api>();
    bool ok = true;
    auto resolve = [&](auto& fn, const char* name) {
      void* sym = dlsym(handle, name);
      if (sym == nullptr) {
        // CUDA 12+ also exports versioned names; the unversioned ones are the stable ABI.
        sym = dlsym(handle, absl::StrCat("__", name, "_13_0").c_str());
      }
      if (sym == nullptr) ok = false;
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(sym);
    };
    resolve(api->create, "nvJitLinkCreate");
    resolve(api->destroy, "nvJitLinkDestroy");
    resolve(api->add_data, "nvJitLinkAddData");
    resolve(api->complete, "nvJitLinkComplete");
    resolve(api->cubin_size, "nvJitLinkGetLinkedCubinSize");
    resolve(api->cubin, "nvJitLinkGetLinkedCubin");
    resolve(api->error_log_size, "nvJitLinkGetErrorLogSize");
    resolve(api->error_log, "nvJitLinkGetErrorLog");
    if (!ok) {
      errors.push_back(absl::StrCat(candidate, ": missing nvJitLink symbols"));
      dlclose(handle);
      continue;
    }
    std::unique_ptr<NvJitLink> jit(new NvJitLink());
    jit->handle_ = handle;
    jit->api_ = std::move(api);
    jit->library_path_ = candidate;
    return jit;
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "nvJitLink is not available on this server, so it cannot produce cubins (tried: ",
      absl::StrJoin(errors, "; "), "); install the CUDA toolkit's libnvJitLink or set "
      "--nvjitlink=PATH"));
}

// The library stays loaded for the life of the process: CUDA libraries keep internal state and
// threads that do not survive dlclose, and a leak checker can only name a module still mapped.
NvJitLink::~NvJitLink() = default;

absl::StatusOr<std::string> NvJitLink::Compile(absl::string_view ptx, int target_sm) const {
  const std::string arch = absl::StrCat("-arch=sm_", target_sm);
  const char* options[] = {arch.c_str()};
  Handle h = nullptr;
  int r = api_->create(&h, 1, options);
  if (r != kSuccess) {
    if (h != nullptr) api_->destroy(&h);
    return absl::InvalidArgumentError(
        absl::StrCat("nvJitLinkCreate(", arch, ") failed with nvJitLinkResult ", r));
  }
  auto error_log = [&]() {
    size_t size = 0;
    if (api_->error_log_size(h, &size) != kSuccess || size == 0) return std::string();
    std::string log(size, '\0');
    if (api_->error_log(h, log.data()) != kSuccess) return std::string();
    while (!log.empty() && (log.back() == '\0' || log.back() == '\n')) log.pop_back();
    return log;
  };
  absl::StatusOr<std::string> result;
  const std::string text(ptx);  // nvJitLink wants NUL-terminated PTX
  r = api_->add_data(h, kInputPtx, text.c_str(), text.size() + 1, "normgrad.ptx");
  if (r == kSuccess) r = api_->complete(h);
  if (r != kSuccess) {
    result = absl::InvalidArgumentError(absl::StrCat("nvJitLink could not compile the PTX for sm_",
                                                     target_sm, " (nvJitLinkResult ", r,
                                                     "): ", error_log()));
  } else {
    size_t size = 0;
    std::string cubin;
    if (api_->cubin_size(h, &size) == kSuccess) {
      cubin.resize(size);
      if (api_->cubin(h, cubin.data()) != kSuccess) cubin.clear();
    }
    if (cubin.empty()) {
      result = absl::InternalError("nvJitLink completed but returned no cubin");
    } else {
      result = std::move(cubin);
    }
  }
  api_->destroy(&h);
  return result;
}

}  // namespace normgrad::server
