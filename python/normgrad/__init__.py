"""normgrad: RMSNorm-backward gradients computed by a normgrad server.

    import normgrad
    client = normgrad.Client("localhost:50051")
    dx, dgamma = client.backward(x, dy, gamma, eps=1e-5)   # numpy arrays or torch tensors
    dx, dgamma = client.backward(x, dy, gamma, gamma_offset=1.0, casting_mode="gemma")
    dx, none = client.backward(x, dy, None, in_place=True)  # no weight; dx written over dy
    dgamma = client.backward_device(x_ptr, dy_ptr, dx_ptr, gamma, num_rows=r, hidden_dim=h)
    future = client.backward_async(x, dy, gamma)            # concurrent.futures.Future
    ptx = client.emit_ptx("rms_norm_backward_row_resident", 4096, target="sm_90")
    client.info()      # dict: backend, device, limits, ...
    client.health()    # "SERVING"

Every call goes through the C++ client (normgrad::client: chunking, retries, TLS, tokens);
this package checks shapes and dtypes and hands the arrays' memory to it without copying
(docs/python.md; the checks in _arrays.py, the errors in errors.py). Torch CUDA tensors (and raw device pointers, backward_device) go by CUDA IPC
to a server on the same GPU started with --cuda-ipc: it computes on them in place. A failed
call raises normgrad.Error (a subclass per gRPC code) whose .code is the gRPC code's name and
whose .message is the server's message, unchanged.

normgrad.torch has rms_norm and RMSNorm, whose backward runs on the server.
"""

import base64
import concurrent.futures
import dataclasses
import json
import math
import operator
import threading

from . import _native
from ._arrays import (  # noqa: F401 (what the Client uses; tests reach _device_route)
    _DEVICE_DTYPES, _check_in_place, _check_shapes, _check_torch_cuda, _device_route,
    _gamma_host, _is_torch, _pointer, _prepare_numpy, _prepare_torch, _rms_buffer,
    _torch_types, _use_out, _write_into)
from .errors import Error, _ERROR_CLASSES, _make_error

__all__ = [
    "CASTING_MODES", "Client", "Error", "PtxResult", "Tls", "TRANSPORTS",
    "CancelledError", "UnknownError", "InvalidArgumentError", "DeadlineExceededError",
    "NotFoundError", "AlreadyExistsError", "PermissionDeniedError", "ResourceExhaustedError",
    "FailedPreconditionError", "AbortedError", "OutOfRangeError", "UnimplementedError",
    "InternalError", "UnavailableError", "DataLossError", "UnauthenticatedError",
]

# How a Client moves tensors (the C++ client's transports, docs/client.md): "bytes" in the gRPC
# messages; "shm" through a shared-memory region (a unix: target whose server runs with
# --shared-memory; FAILED_PRECONDITION otherwise); "auto" shared memory when the target offers
# it, bytes otherwise, and CUDA tensors by CUDA IPC when the server offers it; "cuda_ipc" CUDA
# tensors by CUDA IPC only (FAILED_PRECONDITION when the server takes none; host arrays are a
# ValueError). With "bytes" and "shm", CUDA tensors are copied to the host and back.
TRANSPORTS = ("auto", "bytes", "shm", "cuda_ipc")


# One subclass per gRPC code, e.g. normgrad.InvalidArgumentError for INVALID_ARGUMENT.
globals().update({cls.__name__: cls for cls in _ERROR_CLASSES.values()})


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


# casting_mode names and their v1::CastingMode values (docs/python.md, "RMSNorm variants");
# None sends CASTING_MODE_UNSPECIFIED, which the server treats as "gemma".
CASTING_MODES = ("llama", "gemma", "none")
_CASTING_MODE_VALUES = {None: 0, "llama": 1, "gemma": 2, "none": 3}
_CASTING_MODE_NAMES = {value: name for name, value in _CASTING_MODE_VALUES.items()}


def _variant(gamma, gamma_offset, casting_mode):
    """The checked (gamma_offset, casting_mode value) of a Backward; errors name the argument."""
    if casting_mode not in _CASTING_MODE_VALUES:
        raise ValueError(f"casting_mode: {casting_mode!r} is not one of "
                         f"{', '.join(map(repr, CASTING_MODES))} or None")
    try:
        offset = float(gamma_offset)
    except (TypeError, ValueError):
        raise TypeError(f"gamma_offset: expected a number, got "
                        f"{type(gamma_offset).__name__}") from None
    if not math.isfinite(offset):
        raise ValueError(f"gamma_offset: {offset} is not finite")
    if gamma is None and offset != 0:
        raise ValueError(f"gamma_offset: {offset} without gamma (gamma=None scales by 1); an "
                         "offset needs a weight")
    return offset, _CASTING_MODE_VALUES[casting_mode]


class Client:
    """A connection to a normgrad server (one gRPC channel). Thread-safe: share one Client
    between threads. Calls release the GIL while they wait; Ctrl-C cancels a call in progress
    on the main thread (KeyboardInterrupt).

    target: "host:port", a comma-separated list of addresses (balanced round-robin), or a gRPC
      target URI ("dns:///svc:50051", "unix:/path").
    token: bearer token sent on every call (refused in clear text except to loopback/unix).
    tls: None (plaintext), True (TLS with the system's roots) or a normgrad.Tls.
    transport: "auto", "bytes", "shm" or "cuda_ipc" (see TRANSPORTS).
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
            None if deadline is None else float(deadline), int(max_attempts),
            # The C++ client sends device buffers by CUDA IPC whatever its transport.
            "auto" if transport == "cuda_ipc" else transport)
        self._async_workers = async_workers
        self._executor = None
        self._executor_lock = threading.Lock()
        # GetServerInfo's cuda_ipc (enabled, device_uuid), asked at the first CUDA tensor, and
        # the UUIDs of this process's CUDA devices compared with it.
        self._cuda_ipc_lock = threading.Lock()
        self._server_cuda_ipc = None
        self._device_uuids = {}

    def backward(self, x, dy, gamma, *, eps=1e-5, rms=None, kernel=None, gamma_offset=0.0,
                 casting_mode=None, in_place=False, out=None):
        """dx and dgamma of y = x / rms(x) * (gamma_offset + gamma) for upstream gradient dy.

        x, dy: (..., hidden) arrays of one kind and dtype: numpy float32/float16 or torch
        float32/bfloat16/float16; leading dimensions are rows. gamma: (hidden,), same dtype, or
        None for an RMSNorm without weight (y = x / rms(x); dgamma is then None).
        rms: the forward pass's per-row sqrt(mean(x^2) + eps) (float32, one per row); given,
        the server uses it and ignores eps. kernel: the server's kernel name (None: its choice).
        gamma_offset: added to gamma in float32 (Gemma's 1.0; 0 without gamma). casting_mode:
        the forward's rounding, "llama", "gemma" or "none" (None: the server's default,
        "gemma"); docs/python.md, "RMSNorm variants". in_place: dx is written over dy's memory
        (dy contiguous) and dy itself is returned as dx. out: (dx, dgamma) arrays to write the
        results into instead of new ones (host arrays of x's and gamma's kind, dtype and
        shape, C-contiguous, sharing no memory with the inputs; dgamma None without gamma): a
        caller that reuses them saves allocating and faulting in fresh pages on every call.
        Returns (dx, dgamma) of x's and gamma's kind, dtype and shape (out's arrays when given).

        Torch CUDA tensors (x, dy and rms on one device; gamma anywhere) go by CUDA IPC when the
        server takes it for their GPU (takes_cuda_ipc): the server writes dx into a tensor
        allocated here on x's device, and dgamma is returned on x's device too. Otherwise
        (transport "auto", "bytes" or "shm") they are copied to the host and the results back.
        """
        variant = _variant(gamma, gamma_offset, casting_mode)
        if in_place:
            _check_in_place(dy)
        if out is not None and in_place:
            raise ValueError("out: not with in_place (dx is then dy)")
        if _is_torch(x) and getattr(x, "is_cuda", False):
            if out is not None:
                raise ValueError("out: takes host arrays; CUDA tensors get dx on x's device")
            dx, dgamma = self._backward_cuda(x, dy, gamma, eps, rms, kernel, variant, in_place)
        else:
            dx, dgamma = self._backward_host(x, dy, gamma, eps, rms, kernel, variant, out)
        # Over host memory the server's dx lands in memory of its own and is copied over dy
        # after the call succeeded (dy stays intact while the C++ client may resend it); by CUDA
        # IPC the server wrote it over dy already.
        return (_write_into(dy, dx) if in_place else dx), dgamma

    def _backward_host(self, x, dy, gamma, eps, rms, kernel, variant, out=None):
        """backward for numpy arrays and torch CPU tensors."""
        if self.transport == "cuda_ipc":
            raise ValueError(f"x: transport \"cuda_ipc\" takes torch CUDA tensors (or device "
                             f"pointers: backward_device), got a host {type(x).__name__}; use "
                             "transport \"auto\" for host arrays")
        p = _prepare_torch(x, dy, gamma, rms) if _is_torch(x) else _prepare_numpy(x, dy, gamma,
                                                                                  rms)
        if p.rows == 0 or p.hidden == 0:
            raise ValueError(f"x: shape {tuple(x.shape)} has no elements")
        if out is not None:
            _use_out(p, out)
        self._native.backward_raw(p.dtype, p.rows, p.hidden, float(eps), *p.buffers,
                                  kernel or "", *variant)
        return p.dx, p.dgamma

    def backward_device(self, x_ptr, dy_ptr, dx_ptr, gamma, *, num_rows, hidden_dim, dtype="f32",
                        eps=1e-5, rms_ptr=None, device=0, kernel=None, gamma_offset=0.0,
                        casting_mode=None, in_place=False):
        """Backward on tensors in CUDA device memory of this process, by CUDA IPC: the server
        (same GPU, started with --cuda-ipc) reads x and dy and writes dx in place.

        x_ptr, dy_ptr, dx_ptr: device addresses (ints, e.g. tensor.data_ptr()) of num_rows *
        hidden_dim contiguous elements of dtype ("f32", "bf16" or "f16") on CUDA device
        `device`; dx must not overlap x or dy, except in_place=True with dx_ptr == dy_ptr (the
        server writes dx over dy; such a call is not retried once a chunk may have been
        computed, since dy is gone). rms_ptr: num_rows float32 values of the forward's
        rms, or None (the server recomputes it from eps). gamma: (hidden_dim,) host array of
        dtype (numpy float32/float16, bf16 as its bits in uint16; or a torch CPU tensor), or
        None for an RMSNorm without weight. gamma_offset, casting_mode: as in backward.
        Returns grad_gamma, a host array of gamma's kind (None without gamma). The caller's
        work on the buffers must be finished (synchronize its stream) before the call, the CUDA
        context that owns them must be current on this thread, and they must stay allocated
        while the server may use them (docs/python.md). dx holds grad_input when this returns.
        """
        if self.transport in ("bytes", "shm"):
            raise ValueError(f"transport {self.transport!r} moves host memory; backward_device "
                             "needs \"auto\" or \"cuda_ipc\"")
        if dtype not in _DEVICE_DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {', '.join(_DEVICE_DTYPES)}")
        num_rows, hidden_dim = operator.index(num_rows), operator.index(hidden_dim)
        if num_rows <= 0 or hidden_dim <= 0:
            raise ValueError(f"num_rows = {num_rows} and hidden_dim = {hidden_dim}: both must be "
                             ">= 1")
        pointers = [_pointer(name, value) for name, value in
                    (("x_ptr", x_ptr), ("dy_ptr", dy_ptr), ("dx_ptr", dx_ptr))]
        rms_pointer = None if rms_ptr is None else _pointer("rms_ptr", rms_ptr)
        variant = _variant(gamma, gamma_offset, casting_mode)
        grad_gamma, (gamma_buffer, grad_buffer) = (
            (None, (None, None)) if gamma is None else _gamma_host(gamma, dtype, hidden_dim))
        self._native.backward_device(dtype, num_rows, hidden_dim, float(eps), *pointers,
                                     rms_pointer, gamma_buffer, grad_buffer, kernel or "",
                                     operator.index(device), *variant, bool(in_place))
        return grad_gamma

    def takes_cuda_ipc(self, device=0):
        """Whether the server takes CUDA IPC for CUDA device `device` of this process: started
        with --cuda-ipc, on that GPU (GetServerInfo asked once and remembered)."""
        with self._cuda_ipc_lock:
            if self._server_cuda_ipc is None:
                ipc = self.info().get("cuda_ipc") or {}
                uuid = base64.b64decode(ipc.get("device_uuid") or "")
                self._server_cuda_ipc = (bool(ipc.get("enabled")), uuid)
            enabled, server_uuid = self._server_cuda_ipc
            if not enabled:
                return False
            if device not in self._device_uuids:
                self._device_uuids[device] = _native.cuda_device_uuid(device)
            return self._device_uuids[device] == server_uuid

    def _backward_cuda(self, x, dy, gamma, eps, rms, kernel, variant, in_place):
        """backward for a torch CUDA x: by CUDA IPC (_device_route), or through the host. By
        CUDA IPC with in_place, the server writes dx over dy itself (dy is returned as dx)."""
        import torch
        _check_torch_cuda(x, dy, gamma, rms)
        device = x.device.index if x.device.index is not None else torch.cuda.current_device()
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if rows == 0:
            raise ValueError(f"x: shape {tuple(x.shape)} has no elements")
        if rms is not None and rms.numel() != rows:
            raise ValueError(f"rms: {rms.numel()} values, expected one per row ({rows})")
        with torch.cuda.device(device):  # the device's context current on this thread
            takes = self.transport not in ("bytes", "shm") and self.takes_cuda_ipc(device)
            if _device_route(self.transport, takes, self.target) == "host":
                dx, dgamma = self._backward_host(
                    x.cpu(), dy.cpu(), None if gamma is None else gamma.cpu(), eps,
                    None if rms is None else rms.cpu(), kernel, variant)
                return dx.to(x.device), None if dgamma is None else dgamma.to(x.device)
            # The locals hold every tensor until the call returns (the server reads them).
            x, dy = x.detach().contiguous(), dy.detach().contiguous()
            rms = None if rms is None else rms.detach().to(torch.float32).contiguous()
            dx = dy if in_place else torch.empty_like(x)
            gamma_host = None if gamma is None else gamma.detach().cpu().contiguous()
            # PyTorch's kernels are asynchronous: x, dy and rms must be written before another
            # process reads them. (This first runtime call on the thread also makes the device's
            # primary context current, which the driver calls of the export need.)
            torch.cuda.current_stream(device).synchronize()
            dgamma = self.backward_device(
                x.data_ptr(), dy.data_ptr(), dx.data_ptr(), gamma_host, num_rows=rows,
                hidden_dim=x.shape[-1], dtype=_torch_types()[x.dtype], eps=eps,
                rms_ptr=None if rms is None else rms.data_ptr(), device=device, kernel=kernel,
                gamma_offset=variant[0], casting_mode=_CASTING_MODE_NAMES[variant[1]],
                in_place=in_place)
            return dx, None if dgamma is None else dgamma.to(x.device)

    def backward_async(self, x, dy, gamma, **options):
        """backward on one of the Client's worker threads: a concurrent.futures.Future of
        (dx, dgamma); options as backward's. Inputs must not change until it is done."""
        return self._workers().submit(self.backward, x, dy, gamma, **options)

    def emit_ptx(self, kernel, hidden_dim, *, target="sm_75", dtype="f32", ptx_version=None,
                 cubin=False, gamma_offset=0.0, no_gamma=False, casting_mode=None):
        """The server's PTX for `kernel` (normgrad.PtxResult). dtype: "f32", "bf16" or "f16";
        cubin=True also asks for the cubin (needs nvJitLink on the server). gamma_offset,
        no_gamma and casting_mode pick the RMSNorm variant, as backward's gamma_offset,
        gamma=None and casting_mode do."""
        offset, mode = _variant(None if no_gamma else True, gamma_offset, casting_mode)
        ptx, sha256, entry, cubin_bytes, version, declared_target = self._native.emit_ptx(
            kernel, int(hidden_dim), target, dtype, ptx_version or "", bool(cubin), offset,
            bool(no_gamma), mode)
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
