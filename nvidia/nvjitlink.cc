#include "nvidia/nvjitlink.h"

#include <dlfcn.h>
#include <glob.h>

#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

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
  int (*info_log_size)(Handle, size_t*) = nullptr;
  int (*info_log)(Handle, char*) = nullptr;
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
    resolve(api->info_log_size, "nvJitLinkGetInfoLogSize");
    resolve(api->info_log, "nvJitLinkGetInfoLog");
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
  absl::StatusOr<Assembled> assembled = Assemble(ptx, target_sm);
  if (!assembled.ok()) return assembled.status();
  return std::move(assembled->cubin);
}

absl::StatusOr<NvJitLink::Assembled> NvJitLink::Assemble(absl::string_view ptx,
                                                         int target_sm) const {
  const std::string arch = absl::StrCat("-arch=sm_", target_sm);
  // -verbose adds ptxas's resource lines to the info log. The code is the same as without it;
  // the cubin's tool note (.note.nv.tkinfo, which records ptxas's options) says "-v" too.
  const char* options[] = {arch.c_str(), "-verbose"};
  Handle h = nullptr;
  int r = api_->create(&h, 2, options);
  if (r != kSuccess) {
    if (h != nullptr) api_->destroy(&h);
    return absl::InvalidArgumentError(
        absl::StrCat("nvJitLinkCreate(", arch, ") failed with nvJitLinkResult ", r));
  }
  auto read_log = [&](int (*size_fn)(Handle, size_t*), int (*log_fn)(Handle, char*)) {
    size_t size = 0;
    if (size_fn(h, &size) != kSuccess || size == 0) return std::string();
    std::string log(size, '\0');
    if (log_fn(h, log.data()) != kSuccess) return std::string();
    while (!log.empty() && (log.back() == '\0' || log.back() == '\n')) log.pop_back();
    return log;
  };
  absl::StatusOr<Assembled> result;
  const std::string text(ptx);  // nvJitLink wants NUL-terminated PTX
  r = api_->add_data(h, kInputPtx, text.c_str(), text.size() + 1, "normgrad.ptx");
  if (r == kSuccess) r = api_->complete(h);
  if (r != kSuccess) {
    result = absl::InvalidArgumentError(absl::StrCat(
        "nvJitLink could not compile the PTX for sm_", target_sm, " (nvJitLinkResult ", r,
        "): ", read_log(api_->error_log_size, api_->error_log)));
  } else {
    size_t size = 0;
    Assembled out;
    if (api_->cubin_size(h, &size) == kSuccess) {
      out.cubin.resize(size);
      if (api_->cubin(h, out.cubin.data()) != kSuccess) out.cubin.clear();
    }
    if (out.cubin.empty()) {
      result = absl::InternalError("nvJitLink completed but returned no cubin");
    } else {
      out.info_log = read_log(api_->info_log_size, api_->info_log);
      result = std::move(out);
    }
  }
  api_->destroy(&h);
  return result;
}

namespace {

// The decimal number that ends right before `suffix` in `line` ("Used 72 registers" with
// " registers" -> 72), or nullopt when the suffix or the number is missing.
std::optional<uint64_t> NumberBefore(absl::string_view line, absl::string_view suffix) {
  const size_t at = line.find(suffix);
  if (at == absl::string_view::npos) return std::nullopt;
  size_t begin = at;
  while (begin > 0 && absl::ascii_isdigit(static_cast<unsigned char>(line[begin - 1]))) --begin;
  uint64_t value = 0;
  if (begin == at || !absl::SimpleAtoi(line.substr(begin, at - begin), &value)) {
    return std::nullopt;
  }
  return value;
}

}  // namespace

absl::StatusOr<AssemblerReport> ParseAssemblerReport(absl::string_view log,
                                                     absl::string_view entry) {
  constexpr absl::string_view kCompiling = "Compiling entry function '";
  AssemblerReport report;
  bool in_entry = false;
  bool found_entry = false;
  bool found_registers = false;
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    if (const size_t at = line.find(kCompiling); at != absl::string_view::npos) {
      absl::string_view name = line.substr(at + kCompiling.size());
      name = name.substr(0, name.find('\''));
      in_entry = name == entry;
      found_entry = found_entry || in_entry;
      continue;
    }
    // nvJitLink follows ptxas's lines with its own link summary ("info    : used N registers,
    // ... N bytes smem" with the driver's reserved shared memory added): not the assembler's.
    if (absl::StartsWith(line, "info")) in_entry = false;
    if (!in_entry) continue;
    if (std::optional<uint64_t> stack = NumberBefore(line, " bytes stack frame")) {
      report.stack_frame_bytes = *stack;
      report.spill_store_bytes = NumberBefore(line, " bytes spill stores").value_or(0);
      report.spill_load_bytes = NumberBefore(line, " bytes spill loads").value_or(0);
    }
    if (std::optional<uint64_t> registers = NumberBefore(line, " registers")) {
      found_registers = true;
      report.registers = static_cast<uint32_t>(*registers);
      report.barriers = static_cast<uint32_t>(NumberBefore(line, " barriers").value_or(0));
      report.shared_memory_bytes = NumberBefore(line, " bytes smem").value_or(0);
      report.constant_memory_bytes = NumberBefore(line, " bytes cmem[0]").value_or(0);
    }
  }
  if (!found_entry) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the assembler's log has no \"Compiling entry function '", entry, "'\" section"));
  }
  if (!found_registers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the assembler's log has no \"Used N registers\" line for entry ", entry));
  }
  return report;
}

}  // namespace normgrad::server
