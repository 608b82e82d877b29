#include "server/cuda/module_loader.h"

#include <cstdint>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace normgrad::server::cuda_internal {

LoadedModule::~LoadedModule() {
  if (module != nullptr && ctx->MakeCurrent().ok()) ctx->api().cuModuleUnload(module);
}

absl::StatusOr<std::shared_ptr<const LoadedModule>> LoadModule(
    const std::shared_ptr<const DeviceContext>& ctx, const kernels::EmittedPtx& ptx) {
  NORMGRAD_RETURN_IF_ERROR(ctx->MakeCurrent());
  auto loaded = std::make_shared<LoadedModule>();
  loaded->ctx = ctx;
  loaded->entry = ptx.entry;
  loaded->params = ptx.params;
  std::vector<char> log(16 << 10, '\0');
  CUjit_option options[] = {CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
  void* values[] = {log.data(), reinterpret_cast<void*>(static_cast<uintptr_t>(log.size()))};
  const CUresult r =
      ctx->api().cuModuleLoadDataEx(&loaded->module, ptx.text.c_str(), 2, options, values);
  if (r != CUDA_SUCCESS) {
    loaded->module = nullptr;
    const absl::Status s =
        ctx->Check(r, absl::StrCat("cuModuleLoadDataEx(", ptx.entry, ", sm_", ptx.target_sm,
                                   ", PTX ISA ", ptx.version.ToString(), ")"));
    std::string text(log.data(), strnlen(log.data(), log.size()));
    while (!text.empty() && (text.back() == '\n' || text.back() == '\0')) text.pop_back();
    const std::string message =
        absl::StrCat(s.message(), "; JIT log: ", text.empty() ? "(empty)" : text);
    // A PTX newer than the driver or no code for this GPU is the GPU's/driver's limit; every
    // other JIT failure is ours (the generator emitted something the JIT refused).
    if (s.code() == absl::StatusCode::kFailedPrecondition)
      return absl::FailedPreconditionError(message);
    if (s.code() == absl::StatusCode::kUnavailable) return absl::UnavailableError(message);
    return absl::InternalError(message);
  }
  NORMGRAD_RETURN_IF_ERROR(ctx->Check(
      ctx->api().cuModuleGetFunction(&loaded->function, loaded->module, ptx.entry.c_str()),
      absl::StrCat("cuModuleGetFunction(", ptx.entry, ")")));
  return std::shared_ptr<const LoadedModule>(std::move(loaded));
}

}  // namespace normgrad::server::cuda_internal
