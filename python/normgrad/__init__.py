"""normgrad: RMSNorm-backward gradients computed by a normgrad server.

    import normgrad
    client = normgrad.Client("localhost:50051")
    dx, dgamma = client.backward(x, dy, gamma, eps=1e-5)   # numpy arrays or torch CPU tensors
    future = client.backward_async(x, dy, gamma)            # concurrent.futures.Future
    ptx = client.emit_ptx("rms_norm_backward_row_resident", 4096, target="sm_90")
    client.info()      # dict: backend, device, limits, ...
    client.health()    # "SERVING"

Every call goes through the C++ client (normgrad::client: chunking, retries, TLS, tokens);
this module checks shapes and dtypes and hands the arrays' memory to it without copying
(docs/python.md). A failed call raises normgrad.Error (a subclass per gRPC code) whose .code
is the gRPC code's name and whose .message is the server's message, unchanged.

normgrad.torch has rms_norm and RMSNorm, whose backward runs on the server.
"""

import concurrent.futures
import dataclasses
import json
import threading

from . import _native

__all__ = [
    "Client", "Error", "PtxResult", "Tls", "TRANSPORTS",
    "CancelledError", "UnknownError", "InvalidArgumentError", "DeadlineExceededError",
    "NotFoundError", "AlreadyExistsError", "PermissionDeniedError", "ResourceExhaustedError",
    "FailedPreconditionError", "AbortedError", "OutOfRangeError", "UnimplementedError",
    "InternalError", "UnavailableError", "DataLossError", "UnauthenticatedError",
]

# How a Client moves tensors (the C++ client's transports, docs/client.md): "bytes" in the gRPC
# messages; "shm" through a shared-memory region (a unix: target whose server runs with
# --shared-memory; FAILED_PRECONDITION otherwise); "auto" shared memory when the target offers
# it, bytes otherwise.
TRANSPORTS = ("auto", "bytes", "shm")


class Error(Exception):
    """A failed call: .code is the gRPC status code's name ("INVALID_ARGUMENT", ...), .message
    the server's (or the C++ client's) message, unchanged."""

    code = "UNKNOWN"

    def __init__(self, code, message):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def _error_class(code):
    name = "".join(part.capitalize() for part in code.split("_")) + "Error"
    return type(name, (Error,), {"code": code, "__module__": __name__,
                                 "__doc__": f"normgrad.Error with code {code}."})


# One subclass per gRPC code, e.g. normgrad.InvalidArgumentError for INVALID_ARGUMENT.
_ERROR_CLASSES = {code: _error_class(code) for code in (
    "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
    "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
    "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
    "UNAUTHENTICATED")}
globals().update({cls.__name__: cls for cls in _ERROR_CLASSES.values()})


def _make_error(code, message):
    return _ERROR_CLASSES.get(code, Error)(code, message)


_native.set_error_factory(_make_error)


@dataclasses.dataclass(frozen=True)
class Tls:
    """TLS settings: PEM contents (str or bytes). root_certs None: the system's roots;
    cert and key together: mutual TLS; server_name: checked instead of the target's host."""

    root_certs: object = None
    cert: object = None
    key: object = None
    server_name: str = None


@dataclasses.dataclass(frozen=True)
class PtxResult:
    """What emit_ptx returns: the PTX text, its sha256 (hex), the entry's name, the cubin
    (bytes; empty unless cubin=True), and the .version and .target the text declares."""

    ptx: str
    sha256: str
    entry: str
    cubin: bytes
    ptx_version: str
    target: str


def _text(pem):
    if pem is None:
        return ""
    return pem.decode() if isinstance(pem, (bytes, bytearray)) else str(pem)


# Element types the server computes in, by numpy dtype name / torch dtype.
_NUMPY_TYPES = {"float32": "f32", "float16": "f16"}


def _torch_types():
    import torch
    return {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


def _is_torch(value):
    module = type(value).__module__
    return module == "torch" or module.startswith("torch.")


class _Prepared:
    """One Backward's contiguous inputs, outputs allocated for the server to write into, and
    the buffers (numpy views sharing memory) handed to the C++ client."""

    __slots__ = ("dtype", "rows", "hidden", "buffers", "dx", "dgamma")


def _prepare_numpy(x, dy, gamma, rms):
    import numpy as np
    arrays = []
    for name, value in (("x", x), ("dy", dy), ("gamma", gamma)):
        if not isinstance(value, np.ndarray):
            raise TypeError(f"{name}: expected a numpy array like x, got {type(value).__name__}")
        arrays.append(value)
    x, dy, gamma = arrays
    dtype = _NUMPY_TYPES.get(x.dtype.name)
    if dtype is None:
        raise TypeError(f"x: dtype {x.dtype} is not supported; numpy arrays must be float32 or "
                        "float16 (bfloat16: pass torch tensors)")
    _check_shapes(x.shape, dy.shape, gamma.shape, x.dtype, dy.dtype, gamma.dtype)
    p = _Prepared()
    p.dtype = dtype
    p.hidden = x.shape[-1]
    p.rows = x.size // p.hidden if p.hidden else 0
    # No copy for C-contiguous arrays (the common case); one for any other layout.
    x, dy, gamma = np.ascontiguousarray(x), np.ascontiguousarray(dy), np.ascontiguousarray(gamma)
    p.dx = np.empty_like(x)
    p.dgamma = np.empty_like(gamma)
    rms_buffer = None if rms is None else _rms_buffer(rms, p.rows)
    p.buffers = (x, dy, gamma, rms_buffer, p.dx, p.dgamma)
    return p


def _torch_buffer(tensor, dtype):
    # A numpy view of the tensor's memory (no copy); numpy has no bfloat16, so its bits travel
    # as int16.
    return tensor.view(_torch_int16()).numpy() if dtype == "bf16" else tensor.numpy()


def _torch_int16():
    import torch
    return torch.int16


def _prepare_torch(x, dy, gamma, rms):
    import torch
    for name, value in (("x", x), ("dy", dy), ("gamma", gamma)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name}: expected a torch tensor like x, got {type(value).__name__}")
        if value.device.type != "cpu":
            raise ValueError(f"{name}: tensor is on {value.device}; normgrad takes CPU tensors "
                             "(move it with .cpu())")
    dtype = _torch_types().get(x.dtype)
    if dtype is None:
        raise TypeError(f"x: dtype {x.dtype} is not supported; torch tensors must be float32, "
                        "bfloat16 or float16")
    _check_shapes(tuple(x.shape), tuple(dy.shape), tuple(gamma.shape), x.dtype, dy.dtype,
                  gamma.dtype)
    p = _Prepared()
    p.dtype = dtype
    p.hidden = x.shape[-1]
    p.rows = x.numel() // p.hidden if p.hidden else 0
    # detach: the server's gradients are not part of any autograd graph; contiguous: no copy
    # when already contiguous.
    x, dy, gamma = x.detach().contiguous(), dy.detach().contiguous(), gamma.detach().contiguous()
    p.dx = torch.empty_like(x)
    p.dgamma = torch.empty_like(gamma)
    rms_buffer = None if rms is None else _rms_buffer(rms, p.rows)
    p.buffers = tuple(_torch_buffer(t, dtype) for t in (x, dy, gamma)) + (
        rms_buffer, _torch_buffer(p.dx, dtype), _torch_buffer(p.dgamma, dtype))
    return p


def _rms_buffer(rms, rows):
    """The forward pass's per-row rms as a contiguous float32 buffer of `rows` values."""
    import numpy as np
    if _is_torch(rms):
        import torch
        rms = rms.detach().to(torch.float32).contiguous().numpy()
    rms = np.ascontiguousarray(rms, dtype=np.float32).reshape(-1)
    if rms.size != rows:
        raise ValueError(f"rms: {rms.size} values, expected one per row ({rows})")
    return rms


def _check_shapes(x_shape, dy_shape, gamma_shape, x_dtype, dy_dtype, gamma_dtype):
    if len(x_shape) < 1:
        raise ValueError("x: needs at least one dimension (..., hidden)")
    if dy_shape != x_shape:
        raise ValueError(f"dy: shape {dy_shape} differs from x's {x_shape}")
    if gamma_shape != (x_shape[-1],):
        raise ValueError(f"gamma: shape {gamma_shape}, expected ({x_shape[-1]},) "
                         "(x's last dimension)")
    if dy_dtype != x_dtype or gamma_dtype != x_dtype:
        raise TypeError(f"x, dy and gamma must share one dtype; got {x_dtype}, {dy_dtype}, "
                        f"{gamma_dtype}")


class Client:
    """A connection to a normgrad server (one gRPC channel). Thread-safe: share one Client
    between threads. Calls release the GIL while they wait; Ctrl-C cancels a call in progress
    on the main thread (KeyboardInterrupt).

    target: "host:port", a comma-separated list of addresses (balanced round-robin), or a gRPC
      target URI ("dns:///svc:50051", "unix:/path").
    token: bearer token sent on every call (refused in clear text except to loopback/unix).
    tls: None (plaintext), True (TLS with the system's roots) or a normgrad.Tls.
    transport: "auto", "bytes" or "shm" (see TRANSPORTS).
    deadline: seconds per call; None: the C++ client's default (60 s); math.inf: none.
    max_attempts: attempts for a call that fails UNAVAILABLE (the C++ client's retries).
    async_workers: threads that carry backward_async calls (each waits without the GIL).
    """

    def __init__(self, target="localhost:50051", *, token=None, tls=None, transport="auto",
                 deadline=None, max_attempts=3, async_workers=8):
        if transport not in TRANSPORTS:
            raise ValueError(f"transport {transport!r} is not available; choose one of "
                             f"{', '.join(TRANSPORTS)} (\"auto\" picks the best available)")
        if deadline is not None and not deadline > 0:
            raise ValueError(f"deadline: must be > 0 seconds or None, got {deadline!r}")
        if tls is True:
            tls = Tls()
        elif tls is False:
            tls = None
        elif tls is not None and not isinstance(tls, Tls):
            raise TypeError(f"tls: expected None, True or normgrad.Tls, got {type(tls).__name__}")
        self.target = target
        self.transport = transport
        self._native = _native.Client(
            target, _text(token), tls is not None, _text(tls and tls.root_certs),
            _text(tls and tls.cert), _text(tls and tls.key), _text(tls and tls.server_name),
            None if deadline is None else float(deadline), int(max_attempts), transport)
        self._async_workers = async_workers
        self._executor = None
        self._executor_lock = threading.Lock()

    def backward(self, x, dy, gamma, *, eps=1e-5, rms=None, kernel=None):
        """dx and dgamma of y = x / rms(x) * gamma for upstream gradient dy.

        x, dy: (..., hidden) arrays of one kind and dtype: numpy float32/float16 or torch CPU
        float32/bfloat16/float16; leading dimensions are rows. gamma: (hidden,), same dtype.
        rms: the forward pass's per-row sqrt(mean(x^2) + eps) (float32, one per row); given,
        the server uses it and ignores eps. kernel: the server's kernel name (None: its choice).
        Returns (dx, dgamma) of x's and gamma's kind, dtype and shape.
        """
        p = _prepare_torch(x, dy, gamma, rms) if _is_torch(x) else _prepare_numpy(x, dy, gamma,
                                                                                  rms)
        if p.rows == 0 or p.hidden == 0:
            raise ValueError(f"x: shape {tuple(x.shape)} has no elements")
        self._native.backward_raw(p.dtype, p.rows, p.hidden, float(eps), *p.buffers,
                                  kernel or "")
        return p.dx, p.dgamma

    def backward_async(self, x, dy, gamma, *, eps=1e-5, rms=None, kernel=None):
        """backward on one of the Client's worker threads: a concurrent.futures.Future of
        (dx, dgamma). Inputs must not change until it is done."""
        return self._workers().submit(self.backward, x, dy, gamma, eps=eps, rms=rms,
                                      kernel=kernel)

    def emit_ptx(self, kernel, hidden_dim, *, target="sm_75", dtype="f32", ptx_version=None,
                 cubin=False):
        """The server's PTX for `kernel` (normgrad.PtxResult). dtype: "f32", "bf16" or "f16";
        cubin=True also asks for the cubin (needs nvJitLink on the server)."""
        ptx, sha256, entry, cubin_bytes, version, declared_target = self._native.emit_ptx(
            kernel, int(hidden_dim), target, dtype, ptx_version or "", bool(cubin))
        return PtxResult(ptx, sha256, entry, cubin_bytes, version, declared_target)

    def info(self):
        """GetServerInfo as a dict (proto field names: backend, device, limits, ...)."""
        return json.loads(self._native.server_info_json())

    def health(self, service=""):
        """grpc.health.v1 status: "SERVING", "NOT_SERVING", "UNKNOWN" or "SERVICE_UNKNOWN"."""
        return self._native.health(service)

    def close(self):
        """Waits for backward_async calls in flight and stops the worker threads."""
        with self._executor_lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"normgrad.Client({self.target!r}, transport={self.transport!r})"

    def _workers(self):
        with self._executor_lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self._async_workers, thread_name_prefix="normgrad")
            return self._executor
