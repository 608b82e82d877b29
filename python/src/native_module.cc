// normgrad._native: the Python binding of normgrad::Client (client/include/normgrad/client.h).
//
// Only what Python cannot do well lives here: handing buffers to the C++ client without a copy,
// waiting with the GIL released, and cancelling a call on Ctrl-C. Argument shapes, dtypes and
// the result objects are the pure-Python layer's (normgrad/__init__.py), which calls:
//
//   client = _native.Client(target, token, use_tls, tls_roots, tls_cert, tls_key,
//                           tls_server_name, deadline_s, max_attempts, transport)
//   summary = client.backward_raw("f32", rows, hidden, eps, x, dy, gamma, rms, dx, dgamma, kernel,
//                                 gamma_offset, casting_mode)
//   summary = client.backward_device("f32", rows, hidden, eps, x_ptr, dy_ptr, dx_ptr, rms_ptr,
//                                    gamma, dgamma, kernel, device, gamma_offset,
//                                    casting_mode)   # CUDA IPC
//   uuid = cuda_device_uuid(device)                                   # 16 bytes
//
// gamma and dgamma None: the RMSNorm has no weight (no_gamma). casting_mode: the value of
// v1::CastingMode (0 unspecified, 1 llama, 2 gemma, 3 none).
//
// Errors: a failed call raises the exception that the factory registered with
// set_error_factory(code_name, message) returns (normgrad.Error and its subclasses).
//
// Threading: one Client may be used from many Python threads at once (normgrad::Client is
// thread-safe); every blocking wait releases the GIL.
#include <Python.h>
#include <google/protobuf/util/json_util.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "normgrad/client.h"
#include "normgrad/cuda_ipc.h"

namespace py = pybind11;

namespace normgrad::python_internal {
namespace {

// Set once by normgrad/__init__.py: (code_name, message) -> exception instance.
py::object& ErrorFactory() {
  static py::object* factory = new py::object();  // never destroyed: lives as long as the module
  return *factory;
}

[[noreturn]] void RaiseStatus(const absl::Status& status) {
  const std::string code = absl::StatusCodeToString(status.code());
  const std::string message(status.message());
  py::object& factory = ErrorFactory();
  if (!factory) throw std::runtime_error(absl::StrCat(code, ": ", message));
  py::object exception = factory(code, message);
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exception.ptr())), exception.ptr());
  throw py::error_already_set();
}

absl::Duration SecondsToDuration(std::optional<double> seconds) {
  if (!seconds.has_value()) return absl::ZeroDuration();  // the client's default
  if (std::isinf(*seconds)) return absl::InfiniteDuration();
  return absl::Seconds(*seconds);
}

// Waits for `future` with the GIL released. Every 50 ms it takes the GIL back to run Python's
// signal handlers (only the main thread runs them): when one raises (KeyboardInterrupt on
// Ctrl-C), the call is cancelled, awaited (the C++ call writes into the caller's buffers until
// it ends), and the exception propagates.
template <typename T>
T WaitInterruptibly(std::future<T>& future, CallCancellation* cancellation) {
  while (true) {
    {
      py::gil_scoped_release release;
      if (future.wait_for(std::chrono::milliseconds(50)) == std::future_status::ready) break;
    }
    if (PyErr_CheckSignals() != 0) {
      if (cancellation != nullptr) cancellation->Cancel();
      {
        py::gil_scoped_release release;
        future.wait();
      }
      throw py::error_already_set();
    }
  }
  return future.get();
}

ElementType ParseType(const std::string& name) {
  if (name == "f32") return ElementType::kF32;
  if (name == "bf16") return ElementType::kBF16;
  if (name == "f16") return ElementType::kF16;
  throw py::value_error(absl::StrCat("dtype \"", name, "\" is not f32, bf16 or f16"));
}

Transport ParseTransport(const std::string& name) {
  if (name == "auto") return Transport::kAuto;
  if (name == "bytes") return Transport::kBytes;
  if (name == "shm") return Transport::kSharedMemory;
  throw py::value_error(absl::StrCat("transport \"", name, "\" is not auto, bytes or shm"));
}

// A C-contiguous buffer's bytes (the buffer protocol; no copy). `info` keeps the exporter's
// view alive for as long as the span is used.
absl::Span<const uint8_t> BytesOf(const py::buffer_info& info, const char* name) {
  const bool contiguous = [&] {
    py::ssize_t expected = info.itemsize;
    for (py::ssize_t d = info.ndim - 1; d >= 0; --d) {
      if (info.shape[d] != 1 && info.strides[d] != expected) return false;
      expected *= info.shape[d];
    }
    return true;
  }();
  if (!contiguous) throw py::value_error(absl::StrCat(name, ": buffer is not C-contiguous"));
  return {static_cast<const uint8_t*>(info.ptr), static_cast<size_t>(info.size * info.itemsize)};
}

absl::Span<uint8_t> WritableBytesOf(const py::buffer_info& info, const char* name) {
  if (info.readonly) throw py::value_error(absl::StrCat(name, ": buffer is read-only"));
  absl::Span<const uint8_t> bytes = BytesOf(info, name);
  return {const_cast<uint8_t*>(bytes.data()), bytes.size()};
}

// Arguments with the call's shape and RMSNorm variant set; the caller adds the tensors (and
// sets no_gamma when there is no gamma).
RawBackwardArgs ShapedArgs(const std::string& type, uint64_t num_rows, uint32_t hidden_dim,
                           double eps, double gamma_offset, int casting_mode) {
  if (!v1::CastingMode_IsValid(casting_mode)) {
    throw py::value_error(absl::StrCat("casting_mode: ", casting_mode, " is not a CastingMode"));
  }
  RawBackwardArgs args;
  args.type = ParseType(type);
  args.num_rows = num_rows;
  args.hidden_dim = hidden_dim;
  args.eps = static_cast<float>(eps);
  args.gamma_offset = static_cast<float>(gamma_offset);
  args.casting_mode = static_cast<v1::CastingMode>(casting_mode);
  return args;
}

// gamma and dgamma into `args`, or no_gamma when both are None (one without the other is a
// ValueError). The buffer_infos keep the exporters' views alive while the spans are used.
void SetGamma(const std::optional<py::buffer>& gamma, const std::optional<py::buffer>& dgamma,
              const char* dgamma_name, std::optional<py::buffer_info>& gamma_info,
              std::optional<py::buffer_info>& dgamma_info, RawBackwardArgs& args) {
  if (gamma.has_value() != dgamma.has_value()) {
    throw py::value_error(absl::StrCat("gamma and ", dgamma_name, ": give both or neither"));
  }
  if (!gamma.has_value()) {
    args.no_gamma = true;
    return;
  }
  gamma_info = gamma->request();
  dgamma_info = dgamma->request(true);
  args.gamma = BytesOf(*gamma_info, "gamma");
  args.dgamma = WritableBytesOf(*dgamma_info, dgamma_name);
}

py::dict SummaryDict(const RawBackwardResult& result) {
  py::dict d;
  d["backend"] = result.summary.backend;
  d["kernel"] = result.summary.kernel;
  d["rows"] = result.summary.rows;
  d["chunks"] = result.summary.chunks;
  d["compute_seconds"] = result.summary.compute_seconds;
  d["total_seconds"] = result.summary.total_seconds;
  d["attempts"] = result.attempts;
  return d;
}

// The same status with "<field>: " before its message.
absl::Status Prefixed(const absl::Status& status, const char* field) {
  return absl::Status(status.code(), absl::StrCat(field, ": ", status.message()));
}

// args.device for the pointers: GPU `device`'s UUID and each pointer's IPC handle and offset.
absl::Status ExportDeviceTensors(int device, uint64_t x_ptr, uint64_t dy_ptr, uint64_t dx_ptr,
                                 std::optional<uint64_t> rms_ptr, RawBackwardArgs& args) {
  absl::StatusOr<std::string> uuid = CudaDeviceUuid(device);
  if (!uuid.ok()) return Prefixed(uuid.status(), absl::StrCat("device ", device).c_str());
  CudaIpcTensors tensors;
  tensors.device_uuid = *std::move(uuid);
  const std::pair<const char*, uint64_t> buffers[] = {
      {"x_ptr", x_ptr}, {"dy_ptr", dy_ptr}, {"dx_ptr", dx_ptr}};
  CudaIpcBuffer* outs[] = {&tensors.x, &tensors.dy, &tensors.dx};
  for (size_t i = 0; i < 3; ++i) {
    absl::StatusOr<CudaIpcBuffer> b = ExportCudaBuffer(buffers[i].second);
    if (!b.ok()) return Prefixed(b.status(), buffers[i].first);
    *outs[i] = *std::move(b);
  }
  if (rms_ptr.has_value()) {
    absl::StatusOr<CudaIpcBuffer> b = ExportCudaBuffer(*rms_ptr);
    if (!b.ok()) return Prefixed(b.status(), "rms_ptr");
    tensors.rms = *std::move(b);
  }
  args.device = std::move(tensors);
  return absl::OkStatus();
}

class PyClient {
 public:
  PyClient(const std::string& target, const std::string& token, bool use_tls,
           const std::string& tls_roots, const std::string& tls_cert, const std::string& tls_key,
           const std::string& tls_server_name, std::optional<double> deadline_s, int max_attempts,
           const std::string& transport) {
    ClientOptions options;
    options.transport = ParseTransport(transport);
    options.target = target;
    options.bearer_token = token;
    options.use_tls = use_tls;
    options.tls.root_certs_pem = tls_roots;
    options.tls.client_cert_pem = tls_cert;
    options.tls.client_key_pem = tls_key;
    options.tls.server_name_override = tls_server_name;
    if (deadline_s.has_value()) options.default_deadline = SecondsToDuration(deadline_s);
    options.max_attempts = max_attempts;
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(options);
    if (!client.ok()) RaiseStatus(client.status());
    client_ = std::move(*client);
  }

  // One Backward of `type` elements from the caller's buffers into the caller's output buffers.
  py::dict BackwardRaw(const std::string& type, uint64_t num_rows, uint32_t hidden_dim, double eps,
                       const py::buffer& x, const py::buffer& dy,
                       const std::optional<py::buffer>& gamma, const std::optional<py::buffer>& rms,
                       const py::buffer& dx, const std::optional<py::buffer>& dgamma,
                       const std::string& kernel, double gamma_offset, int casting_mode) {
    const py::buffer_info x_info = x.request(), dy_info = dy.request(), dx_info = dx.request(true);
    std::optional<py::buffer_info> rms_info, gamma_info, dgamma_info;
    if (rms.has_value()) rms_info = rms->request();
    RawBackwardArgs args = ShapedArgs(type, num_rows, hidden_dim, eps, gamma_offset, casting_mode);
    args.x = BytesOf(x_info, "x");
    args.dy = BytesOf(dy_info, "dy");
    SetGamma(gamma, dgamma, "dgamma", gamma_info, dgamma_info, args);
    if (rms_info.has_value()) args.rms = BytesOf(*rms_info, "rms");
    args.dx = WritableBytesOf(dx_info, "dx");
    return RunRaw(args, kernel);
  }

  // One Backward on device buffers of this process by CUDA IPC (normgrad/cuda_ipc.h): x, dy, dx
  // (and rms) are device pointers of GPU `device`, exported as IPC handles; gamma and dgamma are
  // host buffers. The driver calls need the pointers' CUDA context current on this thread.
  py::dict BackwardDevice(const std::string& type, uint64_t num_rows, uint32_t hidden_dim,
                          double eps, uint64_t x_ptr, uint64_t dy_ptr, uint64_t dx_ptr,
                          std::optional<uint64_t> rms_ptr, const std::optional<py::buffer>& gamma,
                          const std::optional<py::buffer>& dgamma, const std::string& kernel,
                          int device, double gamma_offset, int casting_mode, bool in_place) {
    std::optional<py::buffer_info> gamma_info, dgamma_info;
    RawBackwardArgs args = ShapedArgs(type, num_rows, hidden_dim, eps, gamma_offset, casting_mode);
    args.in_place = in_place;  // dx_ptr is dy_ptr: the server writes dx over dy
    SetGamma(gamma, dgamma, "grad_gamma", gamma_info, dgamma_info, args);
    absl::Status exported;
    {
      py::gil_scoped_release release;
      exported = ExportDeviceTensors(device, x_ptr, dy_ptr, dx_ptr, rms_ptr, args);
    }
    if (!exported.ok()) RaiseStatus(exported);
    return RunRaw(args, kernel);
  }

  // Runs one BackwardRaw, interruptible by Ctrl-C (WaitInterruptibly); raises on failure.
  py::dict RunRaw(const RawBackwardArgs& args, const std::string& kernel) {
    BackwardOptions options;
    options.kernel = kernel;
    options.cancellation = std::make_shared<CallCancellation>();
    auto promise = std::make_shared<std::promise<absl::StatusOr<RawBackwardResult>>>();
    std::future<absl::StatusOr<RawBackwardResult>> future = promise->get_future();
    client_->BackwardRawAsync(args, options, [promise](absl::StatusOr<RawBackwardResult> r) {
      promise->set_value(std::move(r));
    });
    absl::StatusOr<RawBackwardResult> result =
        WaitInterruptibly(future, options.cancellation.get());
    if (!result.ok()) RaiseStatus(result.status());
    return SummaryDict(*result);
  }

  py::tuple EmitPtx(const std::string& kernel, uint32_t hidden_dim, const std::string& target,
                    const std::string& dtype, const std::string& ptx_version, bool cubin,
                    double gamma_offset, bool no_gamma, int casting_mode) {
    if (!v1::CastingMode_IsValid(casting_mode)) {
      throw py::value_error(absl::StrCat("casting_mode: ", casting_mode, " is not a CastingMode"));
    }
    v1::EmitPtxRequest request;
    request.set_gamma_offset(static_cast<float>(gamma_offset));
    request.set_no_gamma(no_gamma);
    request.set_casting_mode(static_cast<v1::CastingMode>(casting_mode));
    request.set_kernel(kernel);
    request.set_hidden_dim(hidden_dim);
    request.set_target(target);
    request.set_dtype(ToProtoDType(ParseType(dtype)));
    request.set_ptx_version(ptx_version);
    request.set_cubin(cubin);
    auto promise = std::make_shared<std::promise<absl::StatusOr<v1::EmitPtxResponse>>>();
    std::future<absl::StatusOr<v1::EmitPtxResponse>> future = promise->get_future();
    client_->EmitPtxAsync(request, {}, [promise](absl::StatusOr<v1::EmitPtxResponse> r) {
      promise->set_value(std::move(r));
    });
    absl::StatusOr<v1::EmitPtxResponse> r = WaitInterruptibly(future, nullptr);
    if (!r.ok()) RaiseStatus(r.status());
    return py::make_tuple(py::str(r->ptx()), r->digest().sha256(), r->entry(),
                          py::bytes(r->cubin()), r->ptx_version(), r->target());
  }

  // GetServerInfo as JSON text (proto field names, every field), for json.loads.
  std::string ServerInfoJson() {
    absl::StatusOr<v1::GetServerInfoResponse> info;
    {
      py::gil_scoped_release release;
      info = client_->ServerInfo();
    }
    if (!info.ok()) RaiseStatus(info.status());
    google::protobuf::util::JsonPrintOptions json;
    json.preserve_proto_field_names = true;
    json.always_print_primitive_fields = true;
    std::string text;
    if (!google::protobuf::util::MessageToJsonString(*info, &text, json).ok()) {
      RaiseStatus(absl::InternalError("GetServerInfo reply could not be printed as JSON"));
    }
    return text;
  }

  std::string Health(const std::string& service) {
    absl::StatusOr<HealthStatus> status;
    {
      py::gil_scoped_release release;
      status = client_->Health(service);
    }
    if (!status.ok()) RaiseStatus(status.status());
    return HealthStatusName(*status);
  }

 private:
  std::unique_ptr<Client> client_;
};

}  // namespace
}  // namespace normgrad::python_internal

PYBIND11_MODULE(_native, m) {
  using normgrad::python_internal::PyClient;
  m.doc() = "Binding of the normgrad C++ client; use the normgrad package, not this module.";
  m.def(
      "set_error_factory",
      [](py::object factory) { normgrad::python_internal::ErrorFactory() = std::move(factory); },
      "Registers (code_name, message) -> exception, raised for every failed call.");
  m.def(
      "cuda_device_uuid",
      [](int device) {
        absl::StatusOr<std::string> uuid;
        {
          py::gil_scoped_release release;
          uuid = normgrad::CudaDeviceUuid(device);
        }
        if (!uuid.ok()) normgrad::python_internal::RaiseStatus(uuid.status());
        return py::bytes(*uuid);
      },
      py::arg("device"), "cuDeviceGetUuid of CUDA device `device` (16 bytes).");
  py::class_<PyClient>(m, "Client")
      .def(py::init<const std::string&, const std::string&, bool, const std::string&,
                    const std::string&, const std::string&, const std::string&,
                    std::optional<double>, int, const std::string&>(),
           py::arg("target"), py::arg("token"), py::arg("use_tls"), py::arg("tls_roots"),
           py::arg("tls_cert"), py::arg("tls_key"), py::arg("tls_server_name"),
           py::arg("deadline_s"), py::arg("max_attempts"), py::arg("transport"))
      .def("backward_raw", &PyClient::BackwardRaw, py::arg("dtype"), py::arg("num_rows"),
           py::arg("hidden_dim"), py::arg("eps"), py::arg("x"), py::arg("dy"), py::arg("gamma"),
           py::arg("rms"), py::arg("dx"), py::arg("dgamma"), py::arg("kernel"),
           py::arg("gamma_offset"), py::arg("casting_mode"))
      .def("backward_device", &PyClient::BackwardDevice, py::arg("dtype"), py::arg("num_rows"),
           py::arg("hidden_dim"), py::arg("eps"), py::arg("x_ptr"), py::arg("dy_ptr"),
           py::arg("dx_ptr"), py::arg("rms_ptr"), py::arg("gamma"), py::arg("dgamma"),
           py::arg("kernel"), py::arg("device"), py::arg("gamma_offset"), py::arg("casting_mode"),
           py::arg("in_place") = false)
      .def("emit_ptx", &PyClient::EmitPtx, py::arg("kernel"), py::arg("hidden_dim"),
           py::arg("target"), py::arg("dtype"), py::arg("ptx_version"), py::arg("cubin"),
           py::arg("gamma_offset") = 0.0, py::arg("no_gamma") = false,
           py::arg("casting_mode") = 0)
      .def("server_info_json", &PyClient::ServerInfoJson)
      .def("health", &PyClient::Health, py::arg("service") = "");
}
