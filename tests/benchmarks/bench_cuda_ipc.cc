// CUDA IPC end to end against the same backend in-process, in the same run, on the same device
// buffers: normgrad-server (a child process, --backend=cuda --cuda-ipc, on a unix socket)
// computes a batch that lives in this process's device memory, named by CUDA IPC handles; the
// baseline is the CUDA backend created in this process running the same chunk on the same
// buffers (BackwardSession::ProcessDeviceChunk: the kernels, gamma in, grad_gamma out, no RPC).
//
//   bench_cuda_ipc [--rows=4096] [--hidden=4096] [--dtype=bf16] [--repeats=10]
//                  [--server=<dir of this program>/normgrad-server]
//
// Prints one line starting "cuda_ipc" with both best times, the bytes of x, dy and dx per
// second, and "cuda_ipc/in-process = R" (time ratio; target <= 2 on a GPU), then the largest
// difference between the two runs' dx (they run the same kernels on the same input: 0).
// Needs a CUDA driver: the GPU's, or the emulated one (NORMGRAD_CUDA_DRIVER) at small shapes,
// where the figures only prove the plumbing.
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/kernel_config.h"
#include "normgrad/client.h"
#include "normgrad/cuda_ipc.h"
#include "server/backend_factory/backend_factory.h"
#include "nvidia/driver_api.h"
#include "tests/common/child_process.h"

ABSL_FLAG(uint64_t, rows, 4096, "Rows of the batch.");
ABSL_FLAG(uint32_t, hidden, 4096, "hidden_dim of the batch.");
ABSL_FLAG(std::string, dtype, "bf16", "Element type: f32, bf16 or f16.");
ABSL_FLAG(int, repeats, 10, "Timed runs per side (after one warm-up each); the best is reported.");
ABSL_FLAG(std::string, server, "", "normgrad-server to start; empty: the one beside this program.");

namespace {

using normgrad::server::cuda::CudaDriver;

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

int Fail(const std::string& what) {
  std::fprintf(stderr, "bench_cuda_ipc: %s\n", what.c_str());
  return 1;
}

std::string BesideThisProgram(const std::string& name) {
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) return name;
  std::string path(self, static_cast<size_t>(n));
  return path.substr(0, path.rfind('/') + 1) + name;
}

// Random elements of `dtype` in [-1, 1) (bf16/f16: the top or IEEE-half bits of an f32).
std::vector<uint8_t> RandomElements(normgrad::kernels::DType dtype, size_t count, uint32_t seed,
                                    float offset) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const size_t element = normgrad::kernels::DTypeBytes(dtype);
  std::vector<uint8_t> out(count * element);
  for (size_t i = 0; i < count; ++i) {
    const float v = u(rng) + offset;
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    if (dtype == normgrad::kernels::DType::kF32) {
      std::memcpy(&out[i * 4], &bits, 4);
    } else if (dtype == normgrad::kernels::DType::kBF16) {
      const uint16_t h = static_cast<uint16_t>(bits >> 16);
      std::memcpy(&out[i * 2], &h, 2);
    } else {  // f16 of a value in (-2, 2): sign, rebiased exponent, top mantissa bits
      const uint32_t sign = (bits >> 16) & 0x8000u;
      const int exponent = static_cast<int>((bits >> 23) & 0xffu) - 127 + 15;
      const uint16_t h =
          exponent <= 0 ? static_cast<uint16_t>(sign)
                        : static_cast<uint16_t>(sign | (static_cast<uint32_t>(exponent) << 10) |
                                                ((bits >> 13) & 0x3ffu));
      std::memcpy(&out[i * 2], &h, 2);
    }
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const uint64_t rows = absl::GetFlag(FLAGS_rows);
  const uint32_t hidden = absl::GetFlag(FLAGS_hidden);
  const int repeats = std::max(1, absl::GetFlag(FLAGS_repeats));
  const absl::StatusOr<normgrad::kernels::DType> dtype =
      normgrad::kernels::ParseDType(absl::GetFlag(FLAGS_dtype));
  if (!dtype.ok()) return Fail(std::string(dtype.status().message()));
  const size_t element = normgrad::kernels::DTypeBytes(*dtype);
  const size_t bytes = rows * hidden * element;

  // This process's device buffers: x, dy, and a dx for each side.
  absl::StatusOr<std::shared_ptr<const CudaDriver>> driver =
      CudaDriver::Load(normgrad::server::cuda::ResolveDriverLibrary(""));
  if (!driver.ok()) return Fail(driver.status().ToString());
  const normgrad::server::cuda::DriverApi& api = (*driver)->api();
  std::string error;
  auto ok = [&](CUresult r, const char* call) {
    absl::Status s = (*driver)->Check(r, call);
    if (!s.ok() && error.empty()) error = s.ToString();
    return s.ok();
  };
  CUdevice device = 0;
  CUcontext context = nullptr;
  CUdeviceptr x = 0, dy = 0, dx_remote = 0, dx_local = 0;
  const std::vector<uint8_t> x_host = RandomElements(*dtype, rows * hidden, 1, 0.0f);
  const std::vector<uint8_t> dy_host = RandomElements(*dtype, rows * hidden, 2, 0.0f);
  const std::vector<uint8_t> gamma = RandomElements(*dtype, hidden, 3, 1.0f);
  if (!ok(api.cuInit(0), "cuInit") || !ok(api.cuDeviceGet(&device, 0), "cuDeviceGet") ||
      !ok(api.cuDevicePrimaryCtxRetain(&context, device), "cuDevicePrimaryCtxRetain") ||
      !ok(api.cuCtxSetCurrent(context), "cuCtxSetCurrent") ||
      !ok(api.cuMemAlloc_v2(&x, bytes), "cuMemAlloc(x)") ||
      !ok(api.cuMemAlloc_v2(&dy, bytes), "cuMemAlloc(dy)") ||
      !ok(api.cuMemAlloc_v2(&dx_remote, bytes), "cuMemAlloc(dx)") ||
      !ok(api.cuMemAlloc_v2(&dx_local, bytes), "cuMemAlloc(dx)") ||
      !ok(api.cuMemcpyHtoDAsync_v2(x, x_host.data(), bytes, nullptr), "cuMemcpyHtoDAsync(x)") ||
      !ok(api.cuMemcpyHtoDAsync_v2(dy, dy_host.data(), bytes, nullptr), "cuMemcpyHtoDAsync(dy)") ||
      !ok(api.cuStreamSynchronize(nullptr), "cuStreamSynchronize")) {
    return Fail(error);
  }

  // The baseline: the CUDA backend in this process on the same buffers.
  normgrad::server::BackendOptions backend_options;
  backend_options.kind = normgrad::server::BackendKind::kCuda;
  absl::StatusOr<std::unique_ptr<normgrad::server::Backend>> backend =
      normgrad::server::CreateBackend(backend_options);
  if (!backend.ok()) return Fail(backend.status().ToString());
  normgrad::kernels::BackwardRequest spec;
  spec.num_rows = rows;
  spec.hidden_dim = hidden;
  spec.dtype = *dtype;
  std::vector<uint8_t> dgamma_local(hidden * element), dgamma_remote(hidden * element);
  double in_process = 1e30;
  std::string kernel;
  for (int i = 0; i <= repeats; ++i) {  // run 0 warms up (module load)
    const auto start = std::chrono::steady_clock::now();
    auto session = (*backend)->StartBackward(spec, gamma);
    if (!session.ok()) return Fail(session.status().ToString());
    absl::Status s = (*session)->ProcessDeviceChunk({x, dy, 0, dx_local, rows});
    if (s.ok()) s = (*session)->Finish(absl::MakeSpan(dgamma_local));
    if (!s.ok()) return Fail(s.ToString());
    if (i > 0) in_process = std::min(in_process, Seconds(start));
    kernel = std::string((*session)->KernelName());
  }

  // The service: normgrad-server as a child on a unix socket, this process its client.
  const char* tmp = std::getenv("TMPDIR");
  std::string dir_template =
      absl::StrCat(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp", "/normgrad-bench-XXXXXX");
  const char* dir = mkdtemp(dir_template.data());
  if (dir == nullptr) return Fail("mkdtemp failed");
  const std::string socket = absl::StrCat(dir, "/grpc.sock");
  std::string server_path = absl::GetFlag(FLAGS_server);
  if (server_path.empty()) server_path = BesideThisProgram("normgrad-server");
  absl::StatusOr<normgrad::testing::ChildProcess> server = normgrad::testing::ChildProcess::Start(
      {server_path, "--backend=cuda", "--cuda-ipc", absl::StrCat("--listen=unix:", socket),
       "--metrics-listen=", "--worker-threads=2"});
  if (!server.ok()) return Fail(server.status().ToString());
  if (server->AwaitReady(absl::Seconds(120)).text.empty()) {
    return Fail(absl::StrCat(server_path, " did not get ready"));
  }
  normgrad::ClientOptions client_options;
  client_options.target = absl::StrCat("unix:", socket);
  client_options.max_attempts = 1;
  client_options.shm_chunk_bytes = bytes;  // one chunk, as the baseline
  absl::StatusOr<std::unique_ptr<normgrad::Client>> client =
      normgrad::Client::Create(client_options);
  if (!client.ok()) return Fail(client.status().ToString());
  absl::StatusOr<std::string> uuid = normgrad::CudaDeviceUuid(0);
  if (!uuid.ok()) return Fail(uuid.status().ToString());
  normgrad::CudaIpcTensors tensors;
  tensors.device_uuid = *uuid;
  for (auto [out, ptr] : {std::pair{&tensors.x, x}, std::pair{&tensors.dy, dy},
                          std::pair{&tensors.dx, dx_remote}}) {
    absl::StatusOr<normgrad::CudaIpcBuffer> b = normgrad::ExportCudaBuffer(ptr);
    if (!b.ok()) return Fail(b.status().ToString());
    *out = *std::move(b);
  }
  normgrad::RawBackwardArgs args;
  args.type = *dtype == normgrad::kernels::DType::kF32    ? normgrad::ElementType::kF32
              : *dtype == normgrad::kernels::DType::kBF16 ? normgrad::ElementType::kBF16
                                                          : normgrad::ElementType::kF16;
  args.num_rows = rows;
  args.hidden_dim = hidden;
  args.gamma = gamma;
  args.dgamma = absl::MakeSpan(dgamma_remote);
  args.device = tensors;
  double end_to_end = 1e30;
  std::string remote_kernel;
  for (int i = 0; i <= repeats; ++i) {
    const auto start = std::chrono::steady_clock::now();
    absl::StatusOr<normgrad::RawBackwardResult> r = (*client)->BackwardRaw(args, {});
    if (!r.ok()) return Fail(r.status().ToString());
    if (i > 0) end_to_end = std::min(end_to_end, Seconds(start));
    remote_kernel = r->summary.kernel;
  }

  // Both sides ran the same kernels on the same input.
  std::vector<uint8_t> a(bytes), b(bytes);
  if (!ok(api.cuMemcpyDtoHAsync_v2(a.data(), dx_local, bytes, nullptr), "cuMemcpyDtoHAsync") ||
      !ok(api.cuMemcpyDtoHAsync_v2(b.data(), dx_remote, bytes, nullptr), "cuMemcpyDtoHAsync") ||
      !ok(api.cuStreamSynchronize(nullptr), "cuStreamSynchronize")) {
    return Fail(error);
  }
  const size_t differing_bytes =
      static_cast<size_t>(std::mismatch(a.begin(), a.end(), b.begin()).first - a.begin());
  const bool same = differing_bytes == bytes && dgamma_local == dgamma_remote;

  const double moved = 3.0 * static_cast<double>(bytes);
  std::printf(
      "cuda_ipc %llux%u %s (%s, in-process %s): end-to-end %.3f ms (%.1f GB/s), in-process %.3f ms (%.1f "
      "GB/s); cuda_ipc/in-process = %.2f (time; target <= 2)\n",
      static_cast<unsigned long long>(rows), hidden, absl::GetFlag(FLAGS_dtype).c_str(),
      remote_kernel.c_str(), kernel.c_str(), end_to_end * 1e3, moved / end_to_end / 1e9, in_process * 1e3,
      moved / in_process / 1e9, end_to_end / in_process);
  std::printf("dx and grad_gamma of both sides: %s\n",
              same ? "identical" : "DIFFERENT (a bug: same kernels, same input)");
  server->Signal(SIGTERM);
  server->WaitExit(absl::Seconds(30));
  unlink(socket.c_str());
  rmdir(dir);
  for (CUdeviceptr p : {x, dy, dx_remote, dx_local}) api.cuMemFree_v2(p);
  return same ? 0 : 1;
}
