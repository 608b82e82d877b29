#include "server/service/ptx_service.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/kernel.h"
#include "kernels/kernel_registry.h"
#include "server/service/sha256.h"

namespace normgrad::server {
namespace {

std::string KnownKernelNames() {
  std::vector<std::string> names;
  for (const kernels::Kernel* k : kernels::AllKernels()) names.emplace_back(k->EntryName());
  return names.empty() ? "none" : absl::StrJoin(names, ", ");
}

absl::StatusOr<kernels::DType> ToKernelDType(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_UNSPECIFIED:
    case v1::DTYPE_F32:
      return kernels::DType::kF32;
    case v1::DTYPE_BF16:
      return kernels::DType::kBF16;
    case v1::DTYPE_F16:
      return kernels::DType::kF16;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("dtype is ", static_cast<int>(dtype), ", not a known DType"));
  }
}

}  // namespace

PtxService::PtxService(const PtxServiceOptions& options)
    : cache_(options.cache), nvjitlink_(NvJitLink::Load(options.nvjitlink_path)) {}

absl::StatusOr<v1::EmitPtxResponse> PtxService::Emit(const v1::EmitPtxRequest& request) {
  if (request.kernel().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("kernel is empty; known: ", KnownKernelNames()));
  }
  const kernels::Kernel* kernel = kernels::FindKernel(request.kernel());
  if (kernel == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("kernel \"", request.kernel(),
                                                   "\" is unknown; known: ", KnownKernelNames()));
  }
  kernels::KernelConfig config;
  config.hidden_dim = request.hidden_dim();
  absl::StatusOr<kernels::DType> dtype = ToKernelDType(request.dtype());
  if (!dtype.ok()) return dtype.status();
  config.dtype = *dtype;
  if (!request.target().empty()) {
    absl::StatusOr<int> sm = kernels::ParseTarget(request.target());
    if (!sm.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("target \"", request.target(), "\": ", sm.status().message()));
    }
    config.target_sm = *sm;
  }
  if (!request.ptx_version().empty()) {
    absl::StatusOr<kernels::PtxVersion> v = kernels::ParsePtxVersion(request.ptx_version());
    if (!v.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ptx_version \"", request.ptx_version(), "\": ", v.status().message()));
    }
    config.ptx_version = *v;
  }
  if (absl::Status s = kernel->CanImplement(config); !s.ok()) return s;
  if (request.cubin() && !nvjitlink_.ok()) return nvjitlink_.status();

  const std::string ptx_key = kernel->ConfigKey(config);
  using Cache = ModuleCache<v1::EmitPtxResponse>;
  auto emit_ptx = [&]() -> absl::StatusOr<Cache::Compiled> {
    absl::StatusOr<kernels::EmittedPtx> emitted = kernel->Emit(config);
    if (!emitted.ok()) return emitted.status();
    auto response = std::make_shared<v1::EmitPtxResponse>();
    response->set_ptx(emitted->text);
    response->set_entry(emitted->entry);
    for (const kernels::KernelParam& p : emitted->params) {
      v1::KernelParameter* out = response->add_params();
      out->set_name(p.name);
      out->set_type(p.ptx_type);
    }
    response->mutable_digest()->set_sha256(Sha256Hex(emitted->text));
    response->mutable_digest()->set_size_bytes(emitted->text.size());
    response->set_ptx_version(emitted->version.ToString());
    response->set_target(absl::StrCat("sm_", emitted->target_sm));
    response->set_config_key(emitted->config_key);
    const uint64_t bytes = response->ByteSizeLong();
    return Cache::Compiled{std::move(response), bytes};
  };
  absl::StatusOr<std::shared_ptr<const v1::EmitPtxResponse>> ptx =
      cache_.GetOrCompile(ptx_key, emit_ptx);
  if (!ptx.ok()) return ptx.status();
  if (!request.cubin()) return **ptx;

  // The cubin entry carries the PTX too, so a hit needs one lookup.
  const std::string cubin_key = absl::StrCat(ptx_key, "\ncubin");
  const NvJitLink& jit = **nvjitlink_;
  auto compile_cubin = [&]() -> absl::StatusOr<Cache::Compiled> {
    absl::StatusOr<std::string> cubin = jit.Compile((*ptx)->ptx(), config.target_sm);
    if (!cubin.ok()) return cubin.status();
    auto response = std::make_shared<v1::EmitPtxResponse>(**ptx);
    response->mutable_cubin_digest()->set_sha256(Sha256Hex(*cubin));
    response->mutable_cubin_digest()->set_size_bytes(cubin->size());
    response->set_cubin(std::move(*cubin));
    const uint64_t bytes = response->ByteSizeLong();
    return Cache::Compiled{std::move(response), bytes};
  };
  absl::StatusOr<std::shared_ptr<const v1::EmitPtxResponse>> with_cubin =
      cache_.GetOrCompile(cubin_key, compile_cubin);
  if (!with_cubin.ok()) return with_cubin.status();
  return **with_cubin;
}

}  // namespace normgrad::server
