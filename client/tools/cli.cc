#include "client/tools/cli.h"

#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/resource_line.h"
#include "client/tools/npy.h"
#include "client/tools/ptx_cache.h"
#include "client/tools/tool_flags.h"
#include "normgrad/client.h"
#include "normgrad/shared_memory.h"
#include "proto/normgrad/v1/emit_ptx_fields.h"

namespace normgrad::tools {
namespace {

constexpr char kUsage[] =
    "usage: normgrad [--target=HOST:PORT] <command> [flags]\n"
    "commands:\n"
    "  backward --x X.npy --dy DY.npy --gamma G.npy [--rms RMS.npy] [--eps 1e-5]\n"
    "           [--kernel NAME] [--dx DX.npy] [--dgamma DG.npy]\n"
    "           [--gamma-offset X] [--no-gamma (no --gamma, no --dgamma)]\n"
    "           [--casting-mode llama|gemma|none] [--in-place (dx over dy in shared memory)]\n"
    "  emit-ptx --kernel NAME --hidden-dim N [--target sm_90 ...] [--ptx-version 8.0]\n"
    "           [--dtype f32|bf16|f16 ...] [-o FILE] [--cubin FILE] [--out-dir DIR [--cubins]]\n"
    "           [--resource-usage] [--cache-dir DIR (else $NORMGRAD_PTX_CACHE)]\n"
    "           [--gamma-offset X] [--no-gamma] [--casting-mode llama|gemma|none]\n"
    "           (server: --server or global --target; --target/--dtype repeat or take a,b,c)\n"
    "  info     server version, backend, device, limits, cache (JSON)\n"
    "  health   [--service NAME]   grpc.health.v1 check; exit 0 when SERVING, 3 otherwise\n"
    "client flags (any command): --token-file FILE (else $NORMGRAD_TOKEN; --token T is visible\n"
    "  to other users in the process list) --deadline 30s --max-attempts N --chunk-bytes N\n"
    "  --transport auto|bytes|shm (shm: shared memory with a server on this machine's unix socket)\n"
    "  --tls --tls-ca FILE --tls-cert FILE --tls-key FILE --tls-server-name NAME\n"
    "the server is --target, else $NORMGRAD_TARGET, else localhost:50051\n";

int UsageError(std::ostream& err, absl::string_view message) {
  err << "normgrad: " << message << "\n";
  return kExitUsage;
}

int ServerError(std::ostream& err, const absl::Status& status) {
  err << "error: " << absl::StatusCodeToString(status.code()) << ": " << status.message() << "\n";
  return kExitServerError;
}

// Each command's own flags, as given (unset when not given).
struct BackwardFlags {
  std::optional<std::string> x, dy, gamma, rms, eps, kernel, dx, dgamma, gamma_offset, casting_mode;
  bool no_gamma = false;
  bool in_place = false;
};
struct EmitPtxFlags {
  std::optional<std::string> kernel, hidden_dim, ptx_version, output, cubin, out_dir, cache_dir;
  std::optional<std::string> gamma_offset, casting_mode;  // the variant, as backward's
  bool no_gamma = false;
  std::vector<std::string> gpu_targets, dtypes;
  bool cubins = false;
  bool resource_usage = false;
};
struct HealthFlags {
  std::string service;
};

// Progress bar on stderr (a terminal): "[#######.........]  43%  4300/10000 rows".
class ProgressBar {
 public:
  explicit ProgressBar(std::ostream& err) : err_(err) {}
  void Update(uint64_t done, uint64_t total) {
    std::lock_guard<std::mutex> lock(mu_);
    constexpr int kWidth = 30;
    const int filled = total == 0 ? kWidth : static_cast<int>(kWidth * done / total);
    err_ << "\r[" << std::string(filled, '#') << std::string(kWidth - filled, '.') << "] "
         << absl::StrFormat("%3d%%  %d/%d rows", total == 0 ? 100 : 100 * done / total, done, total)
         << std::flush;
    drawn_ = true;
  }
  void Clear() {
    std::lock_guard<std::mutex> lock(mu_);
    if (drawn_) err_ << "\r\033[K" << std::flush;
  }

 private:
  std::mutex mu_;
  std::ostream& err_;
  bool drawn_ = false;
};

// --gamma-offset and --casting-mode (backward's and emit-ptx's) into `offset` and `mode`; a usage
// error's message otherwise.
absl::Status ParseOffsetAndCasting(const std::optional<std::string>& gamma_offset,
                                   const std::optional<std::string>& casting_mode, float& offset,
                                   v1::CastingMode& mode) {
  if (gamma_offset && (!absl::SimpleAtof(*gamma_offset, &offset) || !std::isfinite(offset))) {
    return absl::InvalidArgumentError(
        absl::StrCat("--gamma-offset: not a finite number: \"", *gamma_offset, "\""));
  }
  if (casting_mode) {
    const std::pair<const char*, v1::CastingMode> modes[] = {{"llama", v1::CASTING_MODE_LLAMA},
                                                             {"gemma", v1::CASTING_MODE_GEMMA},
                                                             {"none", v1::CASTING_MODE_NONE}};
    bool known = false;
    for (const auto& [name, value] : modes) {
      if (*casting_mode == name) {
        mode = value;
        known = true;
      }
    }
    if (!known) {
      return absl::InvalidArgumentError(
          absl::StrCat("--casting-mode: \"", *casting_mode, "\" is not llama, gemma or none"));
    }
  }
  return absl::OkStatus();
}

// The variant flags of `backward` into `a`; a usage error's message otherwise.
absl::Status ParseVariantFlags(const BackwardFlags& args, RawBackwardArgs& a) {
  a.no_gamma = args.no_gamma;
  if (a.no_gamma && (args.gamma || args.dgamma || args.gamma_offset)) {
    return absl::InvalidArgumentError(
        "backward: --no-gamma takes no --gamma, --dgamma or --gamma-offset");
  }
  if (!a.no_gamma && !args.gamma) {
    return absl::InvalidArgumentError("backward: --gamma is required");
  }
  if (absl::Status s =
          ParseOffsetAndCasting(args.gamma_offset, args.casting_mode, a.gamma_offset, a.casting_mode);
      !s.ok()) {
    return s;
  }
  a.in_place = args.in_place;
  return absl::OkStatus();
}

absl::Span<uint8_t> BytesOf(std::vector<float>& v) {
  return {reinterpret_cast<uint8_t*>(v.data()), v.size() * sizeof(float)};
}

int Backward(const BackwardFlags& args, const ClientOptions& options, const CliEnvironment& env,
             std::ostream& out, std::ostream& err) {
  for (const auto& [flag, given] : {std::pair{"x", &args.x}, std::pair{"dy", &args.dy}}) {
    if (!*given) return UsageError(err, absl::StrCat("backward: --", flag, " is required"));
  }
  RawBackwardArgs raw;
  if (absl::Status s = ParseVariantFlags(args, raw); !s.ok()) return UsageError(err, s.message());
  float eps = 1e-5f;
  if (args.eps && !absl::SimpleAtof(*args.eps, &eps)) {
    return UsageError(err, absl::StrCat("--eps: not a number: \"", *args.eps, "\""));
  }
  absl::StatusOr<npy::Array> x = npy::ReadF32(*args.x);
  if (!x.ok()) return UsageError(err, x.status().message());
  absl::StatusOr<npy::Array> dy = npy::ReadF32(*args.dy);
  if (!dy.ok()) return UsageError(err, dy.status().message());
  absl::StatusOr<npy::Array> gamma = npy::Array{};
  if (!raw.no_gamma) gamma = npy::ReadF32(*args.gamma);
  if (!gamma.ok()) return UsageError(err, gamma.status().message());

  if (x->shape.size() < 2) {
    return UsageError(err, absl::StrCat(*args.x, ": shape ", npy::ShapeString(x->shape),
                                        "; x needs 2 or more dimensions (rows..., hidden)"));
  }
  const uint64_t hidden = x->shape.back();
  const uint64_t rows = hidden == 0 ? 0 : x->data.size() / hidden;
  if (dy->shape != x->shape) {
    return UsageError(err, absl::StrCat(*args.dy, ": shape ", npy::ShapeString(dy->shape),
                                        " differs from x's ", npy::ShapeString(x->shape)));
  }
  if (!raw.no_gamma && (gamma->shape.size() != 1 || gamma->shape[0] != hidden)) {
    return UsageError(err, absl::StrCat(*args.gamma, ": shape ", npy::ShapeString(gamma->shape),
                                        "; expected (", hidden, ",) to match x's last dimension"));
  }
  if (rows == 0 || hidden == 0) {
    return UsageError(err,
                      absl::StrCat(*args.x, ": shape ", npy::ShapeString(x->shape), " is empty"));
  }
  std::vector<float> rms;
  if (args.rms) {
    absl::StatusOr<npy::Array> r = npy::ReadF32(*args.rms);
    if (!r.ok()) return UsageError(err, r.status().message());
    const std::vector<uint64_t> row_shape(x->shape.begin(), x->shape.end() - 1);
    if (r->data.size() != rows || (r->shape != row_shape && r->shape.size() != 1)) {
      return UsageError(
          err, absl::StrCat(*args.rms, ": shape ", npy::ShapeString(r->shape), "; expected ",
                            npy::ShapeString(row_shape), " (one value per row)"));
    }
    rms = std::move(r->data);
  }

  std::unique_ptr<SharedMemoryRegion> region;  // --in-place; outlives the client
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(options);
  if (!client.ok()) return UsageError(err, client.status().message());
  BackwardOptions call;
  call.kernel = args.kernel.value_or("");
  ProgressBar bar(err);
  // A bar only for batches that take several messages, and only on a terminal.
  if (env.stderr_is_terminal && x->data.size() * sizeof(float) > options.chunk_bytes) {
    call.on_progress = [&bar](uint64_t done, uint64_t total) { bar.Update(done, total); };
  }
  std::vector<float> dx, dgamma(raw.no_gamma ? 0 : hidden);
  raw.num_rows = rows;
  raw.hidden_dim = static_cast<uint32_t>(hidden);
  raw.eps = eps;
  raw.x = BytesOf(x->data);
  raw.dy = BytesOf(dy->data);
  raw.gamma = BytesOf(gamma->data);
  raw.rms = BytesOf(rms);
  raw.dgamma = BytesOf(dgamma);
  // In place: x and dy in a region registered with the server, which writes dx over dy there.
  if (raw.in_place) {
    const uint64_t bytes = raw.x.size();
    absl::StatusOr<std::unique_ptr<SharedMemoryRegion>> made =
        SharedMemoryRegion::Create(2 * bytes);
    if (!made.ok()) return ServerError(err, made.status());
    region = *std::move(made);
    std::copy(raw.x.begin(), raw.x.end(), region->data());
    std::copy(raw.dy.begin(), raw.dy.end(), region->data() + bytes);
    if (absl::Status s = (*client)->RegisterSharedMemory(*region); !s.ok()) {
      return ServerError(err, absl::Status(s.code(), absl::StrCat("--in-place: ", s.message())));
    }
    raw.x = {region->data(), bytes};
    raw.dy = {region->data() + bytes, bytes};
    raw.dx = {region->data() + bytes, bytes};
  } else {
    dx.resize(x->data.size());
    raw.dx = BytesOf(dx);
  }
  absl::StatusOr<RawBackwardResult> g = (*client)->BackwardRaw(raw, call);
  bar.Clear();
  if (!g.ok()) return ServerError(err, g.status());

  if (args.dx) {
    if (raw.in_place) {
      dx.resize(x->data.size());
      std::memcpy(dx.data(), raw.dx.data(), raw.dx.size());
    }
    if (absl::Status s = npy::WriteF32(*args.dx, x->shape, dx); !s.ok()) {
      return UsageError(err, s.message());
    }
  }
  if (args.dgamma) {
    const uint64_t shape[] = {hidden};
    if (absl::Status s = npy::WriteF32(*args.dgamma, shape, dgamma); !s.ok()) {
      return UsageError(err, s.message());
    }
  }
  out << absl::StrFormat(
      "rows=%d hidden_dim=%d backend=%s kernel=%s chunks=%d compute_seconds=%.6f "
      "server_seconds=%.6f\n",
      rows, hidden, g->summary.backend, g->summary.kernel, g->summary.chunks,
      g->summary.compute_seconds, g->summary.total_seconds);
  return kExitOk;
}

absl::string_view DTypeLabel(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_BF16:
      return "bf16";
    case v1::DTYPE_F16:
      return "f16";
    default:
      return "f32";
  }
}

// The artifact of a single-configuration response (a server older than `artifacts` fills only
// the top-level fields).
v1::EmitPtxArtifact ArtifactOf(const v1::EmitPtxResponse& r, v1::DType dtype) {
  if (r.artifacts_size() > 0) return r.artifacts(0);
  v1::EmitPtxArtifact a;
  v1::CopySingleConfigurationFields(r, a);
  a.set_dtype(dtype);
  return a;
}

// One line per artifact: base::ResourceLine, then " sha256=...".
std::string ResourceLine(const v1::EmitPtxArtifact& a) {
  absl::StatusOr<std::string> counts = absl::UnknownError(
      a.resource_usage_unknown().empty() ? "not reported" : a.resource_usage_unknown());
  if (a.has_resource_usage()) {
    const v1::ResourceUsage& u = a.resource_usage();
    counts = base::ResourceCounts(u.registers(), u.spill_store_bytes(), u.spill_load_bytes(),
                                  u.shared_memory_bytes(), u.local_memory_bytes(), u.barriers());
  }
  std::string line = base::ResourceLine(a.entry(), DTypeLabel(a.dtype()), a.target(),
                                        a.ptx_version(), a.min_cuda_driver(), counts);
  absl::StrAppend(&line, " sha256=", a.digest().sha256());
  return line;
}

// For file names: "" for the default variant, else e.g. "_off1_llama", "_nogamma" (the offset
// with 9 significant digits, which tell every float apart).
std::string VariantLabel(const v1::EmitPtxRequest& request) {
  std::string label;
  if (request.gamma_offset() != 0.0f) {
    absl::StrAppend(&label, "_off", absl::StrFormat("%.9g", request.gamma_offset()));
  }
  if (request.no_gamma()) absl::StrAppend(&label, "_nogamma");
  if (request.casting_mode() == v1::CASTING_MODE_LLAMA) absl::StrAppend(&label, "_llama");
  if (request.casting_mode() == v1::CASTING_MODE_NONE) absl::StrAppend(&label, "_none");
  return label;
}

// What an emit-ptx command asks for: the request every configuration shares, and the targets and
// dtypes it is made for (one configuration each).
struct EmitPtxPlan {
  v1::EmitPtxRequest base;
  std::vector<std::string> targets;  // "" alone: the server's default
  std::vector<v1::DType> dtypes;
  size_t Configurations() const { return targets.size() * dtypes.size(); }
};

// The plan of the flags, or a usage error (kExitUsage, said on `err`).
int PlanEmitPtx(const EmitPtxFlags& args, std::ostream& err, EmitPtxPlan& plan) {
  if (!args.kernel) return UsageError(err, "emit-ptx: --kernel is required");
  v1::EmitPtxRequest& base = plan.base;
  base.set_kernel(*args.kernel);
  if (args.hidden_dim) {
    uint32_t hidden = 0;
    if (!absl::SimpleAtoi(*args.hidden_dim, &hidden)) {
      return UsageError(err, absl::StrCat("--hidden-dim: not a non-negative integer: \"",
                                          *args.hidden_dim, "\""));
    }
    base.set_hidden_dim(hidden);
  }
  std::vector<v1::DType>& dtypes = plan.dtypes;
  for (const std::string& name : args.dtypes.empty() ? std::vector<std::string>{"f32"}
                                                     : args.dtypes) {
    if (name == "f32") {
      dtypes.push_back(v1::DTYPE_F32);
    } else if (name == "bf16") {
      dtypes.push_back(v1::DTYPE_BF16);
    } else if (name == "f16") {
      dtypes.push_back(v1::DTYPE_F16);
    } else {
      return UsageError(err, absl::StrCat("--dtype: \"", name, "\" is not f32, bf16 or f16"));
    }
  }
  // An empty target is the server's default (sm_75).
  plan.targets = args.gpu_targets.empty() ? std::vector<std::string>{""} : args.gpu_targets;
  const size_t configurations = plan.Configurations();
  {
    float offset = 0.0f;
    v1::CastingMode mode = v1::CASTING_MODE_UNSPECIFIED;
    if (absl::Status s = ParseOffsetAndCasting(args.gamma_offset, args.casting_mode, offset, mode);
        !s.ok()) {
      return UsageError(err, s.message());
    }
    if (args.no_gamma && args.gamma_offset) {
      return UsageError(err, "emit-ptx: --no-gamma takes no --gamma-offset");
    }
    base.set_gamma_offset(offset);
    base.set_no_gamma(args.no_gamma);
    base.set_casting_mode(mode);
  }
  base.set_ptx_version(args.ptx_version.value_or(""));
  base.set_cubin(args.cubin.has_value() || args.cubins);
  base.set_resource_usage(args.resource_usage);
  if (configurations > 1 && (args.output || args.cubin)) {
    return UsageError(err, absl::StrCat("-o and --cubin name one file; for ", configurations,
                                        " configurations use --out-dir DIR (and --cubins)"));
  }
  if (args.cubins && !args.out_dir) return UsageError(err, "--cubins needs --out-dir DIR");
  if (configurations > 1 && !args.out_dir && !args.resource_usage) {
    return UsageError(err, absl::StrCat(configurations,
                                        " configurations: use --out-dir DIR, or --resource-usage "
                                        "for the report alone"));
  }
  return kExitOk;
}

// Every configuration's artifact, in targets-then-dtypes order: from the cache under `cache_dir`
// (one request per configuration it lacks), else in one request.
int FetchArtifacts(Client& client, const EmitPtxPlan& plan, const std::string& cache_dir,
                   std::ostream& err, std::vector<v1::EmitPtxArtifact>& artifacts) {
  if (!cache_dir.empty()) {
    // One single-configuration request per configuration not in the cache.
    absl::StatusOr<PtxCache> cache = PtxCache::Open(cache_dir);
    if (!cache.ok()) return UsageError(err, cache.status().message());
    absl::StatusOr<v1::GetServerInfoResponse> info = client.ServerInfo();
    if (!info.ok()) return ServerError(err, info.status());
    for (const std::string& target : plan.targets) {
      for (v1::DType dtype : plan.dtypes) {
        v1::EmitPtxRequest request = plan.base;
        request.set_target(target);
        request.set_dtype(dtype);
        std::string notes;
        absl::StatusOr<v1::EmitPtxArtifact> a = cache->GetOrFetch(
            PtxCache::Key(info->version(), request),
            [&]() -> absl::StatusOr<v1::EmitPtxArtifact> {
              absl::StatusOr<v1::EmitPtxResponse> r = client.EmitPtx(request);
              if (!r.ok()) return r.status();
              return ArtifactOf(*r, dtype);
            },
            &notes);
        err << notes;
        if (!a.ok()) return ServerError(err, a.status());
        artifacts.push_back(*std::move(a));
      }
    }
  } else if (plan.Configurations() == 1) {
    v1::EmitPtxRequest request = plan.base;
    request.set_target(plan.targets[0]);
    request.set_dtype(plan.dtypes[0]);
    absl::StatusOr<v1::EmitPtxResponse> r = client.EmitPtx(request);
    if (!r.ok()) return ServerError(err, r.status());
    artifacts.push_back(ArtifactOf(*r, plan.dtypes[0]));
  } else {
    v1::EmitPtxRequest request = plan.base;
    for (const std::string& target : plan.targets) {
      if (!target.empty()) request.add_targets(target);  // none: the server's default
    }
    for (v1::DType dtype : plan.dtypes) request.add_dtypes(dtype);
    absl::StatusOr<v1::EmitPtxResponse> r = client.EmitPtx(request);
    if (!r.ok()) return ServerError(err, r.status());
    if (r->artifacts_size() != static_cast<int>(plan.Configurations())) {
      return ServerError(err, absl::InternalError(absl::StrCat(
                                  "the server answered ", r->artifacts_size(), " artifacts for ",
                                  plan.Configurations(), " configurations")));
    }
    artifacts.assign(r->artifacts().begin(), r->artifacts().end());
  }

  return kExitOk;
}

// The artifacts where the flags say: -o / --out-dir files, stdout, --cubin, the resource report.
int WriteArtifacts(const EmitPtxFlags& args, const EmitPtxPlan& plan,
                   const std::vector<v1::EmitPtxArtifact>& artifacts, std::ostream& out,
                   std::ostream& err) {
  auto write = [&](const std::string& path, const std::string& bytes) -> bool {
    std::ofstream file(path, std::ios::binary | std::ios::trunc);
    file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    file.close();
    if (!file) {
      err << "normgrad: " << path << ": cannot write\n";
      return false;
    }
    return true;
  };
  auto wrote = [&](const std::string& path, const v1::EmitPtxArtifact& a) {
    err << absl::StrFormat("wrote %s: entry %s, %s, %s, PTX %s, sha256 %s (%d bytes)\n", path,
                           a.entry(), DTypeLabel(a.dtype()), a.target(), a.ptx_version(),
                           a.digest().sha256(), a.digest().size_bytes());
  };
  if (args.out_dir) {
    for (const v1::EmitPtxArtifact& a : artifacts) {
      const std::string stem = absl::StrCat(*args.out_dir, "/", a.entry(), VariantLabel(plan.base), ".",
                                            DTypeLabel(a.dtype()), ".", a.target());
      if (!write(stem + ".ptx", a.ptx())) return kExitUsage;
      wrote(stem + ".ptx", a);
      if (args.cubins) {
        if (!write(stem + ".cubin", a.cubin())) return kExitUsage;
        err << absl::StrFormat("wrote %s.cubin: cubin sha256 %s (%d bytes)\n", stem,
                               a.cubin_digest().sha256(), a.cubin().size());
      }
    }
  }
  const v1::EmitPtxArtifact& first = artifacts.front();
  if (args.output) {
    if (!write(*args.output, first.ptx())) return kExitUsage;
    wrote(*args.output, first);
  } else if (!args.out_dir && !args.resource_usage) {
    out << first.ptx();
  }
  if (args.cubin) {
    if (!write(*args.cubin, first.cubin())) return kExitUsage;
    err << absl::StrFormat("wrote %s: cubin sha256 %s (%d bytes)\n", *args.cubin,
                           first.cubin_digest().sha256(), first.cubin().size());
  }
  if (args.resource_usage) {
    for (const v1::EmitPtxArtifact& a : artifacts) out << ResourceLine(a) << "\n";
  }
  return kExitOk;
}

int EmitPtx(const EmitPtxFlags& args, const ClientOptions& options, const CliEnvironment& env,
            std::ostream& out, std::ostream& err) {
  EmitPtxPlan plan;
  if (const int code = PlanEmitPtx(args, err, plan); code != kExitOk) return code;
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(options);
  if (!client.ok()) return UsageError(err, client.status().message());
  std::vector<v1::EmitPtxArtifact> artifacts;
  if (const int code = FetchArtifacts(**client, plan,
                                      args.cache_dir.value_or(env.ptx_cache_dir), err, artifacts);
      code != kExitOk) {
    return code;
  }
  return WriteArtifacts(args, plan, artifacts, out, err);
}

int Info(const ClientOptions& options, std::ostream& out, std::ostream& err) {
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(options);
  if (!client.ok()) return UsageError(err, client.status().message());
  absl::StatusOr<v1::GetServerInfoResponse> info = (*client)->ServerInfo();
  if (!info.ok()) return ServerError(err, info.status());
  std::string json;
  google::protobuf::util::JsonPrintOptions print;
  print.add_whitespace = true;
  print.always_print_primitive_fields = true;
  print.preserve_proto_field_names = true;
  if (!google::protobuf::util::MessageToJsonString(*info, &json, print).ok()) {
    err << "normgrad: cannot print the server's reply as JSON\n";
    return kExitServerError;
  }
  out << json;
  return kExitOk;
}

int Health(const HealthFlags& args, const ClientOptions& options, std::ostream& out,
           std::ostream& err) {
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(options);
  if (!client.ok()) return UsageError(err, client.status().message());
  absl::StatusOr<HealthStatus> health = (*client)->Health(args.service);
  if (!health.ok()) return ServerError(err, health.status());
  out << HealthStatusName(*health) << "\n";
  return *health == HealthStatus::kServing ? kExitOk : kExitNotServing;
}

// The server address flags, global and per command: --target (where the command gives it no
// other meaning; `target` null) and --server.
void AddServerFlags(CLI::App& app, std::optional<std::string>* target,
                    std::optional<std::string>& server) {
  if (target != nullptr) app.add_option("--target", *target)->type_name("HOST:PORT");
  app.add_option("--server", server)->type_name("HOST:PORT");
}

}  // namespace

int RunCli(const std::vector<std::string>& args, const CliEnvironment& env, std::ostream& out,
           std::ostream& err) {
  // Global flags come before the command, the command's own after it, where the server and
  // client flags may be given again: each is bound to one variable for both places, and CLI11
  // runs the app's options before the command's, so the command's value wins. For emit-ptx,
  // "--target" after the command is the GPU architecture (as in normgrad-ptx).
  CLI::App app("normgrad", "normgrad");
  ConfigureToolApp(app);
  app.require_subcommand(0, 1);  // a second command name is an unexpected argument
  std::optional<std::string> target, server;
  ClientFlags client;
  bool help = false;
  AddServerFlags(app, &target, server);
  AddClientFlags(app, client);
  app.add_flag("--help", help);

  CLI::App* help_command = app.add_subcommand("help");

  BackwardFlags backward;
  CLI::App* backward_command = app.add_subcommand("backward");
  for (const auto& [name, value] :
       {std::pair{"--x", &backward.x}, std::pair{"--dy", &backward.dy},
        std::pair{"--gamma", &backward.gamma}, std::pair{"--rms", &backward.rms},
        std::pair{"--dx", &backward.dx}, std::pair{"--dgamma", &backward.dgamma}}) {
    backward_command->add_option(name, *value)->type_name("FILE");
  }
  backward_command->add_option("--eps", backward.eps)->type_name("X");
  backward_command->add_option("--kernel", backward.kernel)->type_name("NAME");
  backward_command->add_option("--gamma-offset", backward.gamma_offset)->type_name("X");
  backward_command->add_flag("--no-gamma", backward.no_gamma);
  backward_command->add_option("--casting-mode", backward.casting_mode)
      ->type_name("llama|gemma|none");
  backward_command->add_flag("--in-place", backward.in_place);

  EmitPtxFlags emit;
  CLI::App* emit_command = app.add_subcommand("emit-ptx");
  emit_command->add_option("--kernel", emit.kernel)->type_name("NAME");
  emit_command->add_option("--hidden-dim", emit.hidden_dim)->type_name("N");
  emit_command->add_option("--target", emit.gpu_targets)->type_name("sm_XX")->delimiter(',');
  emit_command->add_option("--ptx-version", emit.ptx_version)->type_name("X.Y");
  emit_command->add_option("--dtype", emit.dtypes)->type_name("f32|bf16|f16")->delimiter(',');
  emit_command->add_option("-o", emit.output)->type_name("FILE");
  emit_command->add_option("--cubin", emit.cubin)->type_name("FILE");
  emit_command->add_option("--out-dir", emit.out_dir)->type_name("DIR");
  emit_command->add_flag("--cubins", emit.cubins);
  emit_command->add_flag("--resource-usage", emit.resource_usage);
  emit_command->add_option("--cache-dir", emit.cache_dir)->type_name("DIR");
  emit_command->add_option("--gamma-offset", emit.gamma_offset)->type_name("X");
  emit_command->add_flag("--no-gamma", emit.no_gamma);
  emit_command->add_option("--casting-mode", emit.casting_mode)->type_name("llama|gemma|none");

  CLI::App* info_command = app.add_subcommand("info");

  HealthFlags health;
  CLI::App* health_command = app.add_subcommand("health");
  health_command->add_option("--service", health.service)->type_name("NAME");

  for (CLI::App* command : {backward_command, emit_command, info_command, health_command}) {
    AddServerFlags(*command, command == emit_command ? nullptr : &target, server);
    AddClientFlags(*command, client);
  }

  if (absl::Status s = ParseToolArgs(app, args); !s.ok()) return UsageError(err, s.message());
  // What the global part could not place: a flag is an error even with --help; a word is a
  // command we do not have.
  const std::optional<Unplaced> unplaced = FirstUnplaced(app);
  if (unplaced && unplaced->is_flag) return UsageError(err, CheckAllPlaced(app).message());
  if (help) {
    out << kUsage;
    return kExitOk;
  }
  if (unplaced) {
    return UsageError(err, absl::StrCat("unknown command \"", unplaced->arg,
                                        "\" (backward, emit-ptx, info, health)"));
  }
  if (app.get_subcommands().empty()) {
    err << kUsage;
    return kExitUsage;
  }
  const CLI::App* command = app.get_subcommands().front();
  if (command == help_command) {  // whatever follows it
    out << kUsage;
    return kExitOk;
  }
  if (absl::Status s = CheckAllPlaced(*command); !s.ok()) {
    return UsageError(err, absl::StrCat(command->get_name(), ": ", s.message()));
  }
  std::string address = env.normgrad_target.empty() ? "localhost:50051" : env.normgrad_target;
  if (target) address = *target;
  if (server) address = *server;
  absl::StatusOr<ClientOptions> options = ClientOptionsFromFlags(client, address);
  if (!options.ok()) return UsageError(err, options.status().message());

  if (command == backward_command) return Backward(backward, *options, env, out, err);
  if (command == emit_command) return EmitPtx(emit, *options, env, out, err);
  if (command == info_command) return Info(*options, out, err);
  return Health(health, *options, out, err);
}

}  // namespace normgrad::tools
