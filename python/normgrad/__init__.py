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
this module checks shapes and dtypes and hands the arrays' memory to it without copying
(docs/python.md). Torch CUDA tensors (and raw device pointers, backward_device) go by CUDA IPC
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


def _check_in_place(dy):
    """in_place=True writes dx over dy: dy must be one dense, writable block of memory."""
    if _is_torch(dy):
        if not dy.is_contiguous():
            raise ValueError("dy: in_place=True writes dx into dy's memory, which must be "
                             "contiguous (dy.contiguous() first)")
    elif not (dy.flags.c_contiguous and dy.flags.writeable):
        raise ValueError("dy: in_place=True writes dx into dy's memory, which must be a "
                         "C-contiguous, writable array")


def _write_into(dy, dx):
    """dx copied over dy (same shape and dtype), unless it is dy's memory already; returns dy."""
    if _is_torch(dy):
        if dx.data_ptr() != dy.data_ptr():
            dy.detach().copy_(dx)
    else:
        import numpy as np
        np.copyto(dy, dx)
    return dy


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
        if not isinstance(value, np.ndarray) and not (name == "gamma" and value is None):
            raise TypeError(f"{name}: expected a numpy array like x, got {type(value).__name__}")
        arrays.append(value)
    x, dy, gamma = arrays
    dtype = _NUMPY_TYPES.get(x.dtype.name)
    if dtype is None:
        raise TypeError(f"x: dtype {x.dtype} is not supported; numpy arrays must be float32 or "
                        "float16 (bfloat16: pass torch tensors)")
    _check_shapes(x, dy, gamma)
    p = _Prepared()
    p.dtype = dtype
    p.hidden = x.shape[-1]
    p.rows = x.size // p.hidden if p.hidden else 0
    # No copy for C-contiguous arrays (the common case); one for any other layout.
    x, dy = np.ascontiguousarray(x), np.ascontiguousarray(dy)
    gamma = None if gamma is None else np.ascontiguousarray(gamma)
    p.dx = np.empty_like(x)
    p.dgamma = None if gamma is None else np.empty_like(gamma)
    rms_buffer = None if rms is None else _rms_buffer(rms, p.rows)
    p.buffers = (x, dy, gamma, rms_buffer, p.dx, p.dgamma)
    return p


def _use_out(p, out):
    """Makes the caller's `out` = (dx, dgamma) the outputs of prepared call `p`, after checking
    that each matches what would have been allocated and shares no memory with an input: the
    server's dx must never land on x or dy (a retried call would send dx as dy)."""
    import numpy as np
    try:
        dx, dgamma = out
    except (TypeError, ValueError):
        raise TypeError("out: expected a pair (dx, dgamma)") from None
    inputs = [b for b in p.buffers[:4] if b is not None]
    checked = []
    for name, given, want in (("dx", dx, p.dx), ("dgamma", dgamma, p.dgamma)):
        if want is None:
            if given is not None:
                raise ValueError(f"out: {name} must be None without gamma")
            checked.append(None)
            continue
        if type(given) is not type(want):
            raise TypeError(f"out: {name} is a {type(given).__name__}, expected a "
                            f"{type(want).__name__} like x")
        if tuple(given.shape) != tuple(want.shape) or given.dtype != want.dtype:
            raise ValueError(f"out: {name} has shape {tuple(given.shape)} and dtype "
                             f"{given.dtype}, expected {tuple(want.shape)} and {want.dtype}")
        if _is_torch(given):
            if given.device.type != "cpu" or not given.is_contiguous():
                raise ValueError(f"out: {name} must be a contiguous CPU tensor")
            view = _torch_buffer(given, p.dtype)
        else:
            if not given.flags.c_contiguous or not given.flags.writeable:
                raise ValueError(f"out: {name} must be C-contiguous and writeable")
            view = given
        if any(np.may_share_memory(view, b) for b in inputs + [c for c in checked if c is not None]):
            raise ValueError(f"out: {name} shares memory with an input or the other output")
        checked.append(view)
    p.dx, p.dgamma = dx, dgamma
    p.buffers = p.buffers[:4] + (checked[0], checked[1])


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
        if name == "gamma" and value is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name}: expected a torch tensor like x, got {type(value).__name__}")
        if value.device.type != "cpu":
            raise ValueError(f"{name}: tensor is on {value.device}; normgrad takes CPU tensors "
                             "(move it with .cpu())")
    dtype = _torch_types().get(x.dtype)
    if dtype is None:
        raise TypeError(f"x: dtype {x.dtype} is not supported; torch tensors must be float32, "
                        "bfloat16 or float16")
    _check_shapes(x, dy, gamma)
    p = _Prepared()
    p.dtype = dtype
    p.hidden = x.shape[-1]
    p.rows = x.numel() // p.hidden if p.hidden else 0
    # detach: the server's gradients are not part of any autograd graph; contiguous: no copy
    # when already contiguous.
    x, dy = x.detach().contiguous(), dy.detach().contiguous()
    gamma = None if gamma is None else gamma.detach().contiguous()
    p.dx = torch.empty_like(x)
    p.dgamma = None if gamma is None else torch.empty_like(gamma)
    rms_buffer = None if rms is None else _rms_buffer(rms, p.rows)
    x, dy, gamma, dx, dgamma = (None if t is None else _torch_buffer(t, dtype)
                                for t in (x, dy, gamma, p.dx, p.dgamma))
    p.buffers = (x, dy, gamma, rms_buffer, dx, dgamma)
    return p


def _check_torch_cuda(x, dy, gamma, rms):
    """Checks a Backward whose x is a CUDA tensor: dy and rms on x's device, gamma anywhere."""
    import torch
    others = (("dy", dy),) + ((("gamma", gamma),) if gamma is not None else ()) + (
        (("rms", rms),) if rms is not None else ())
    for name, value in others:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name}: expected a torch tensor like x, got {type(value).__name__}")
        if name != "gamma" and value.device != x.device:
            raise ValueError(f"{name}: tensor is on {value.device}, x on {x.device}; they must "
                             "be on one device")
    if _torch_types().get(x.dtype) is None:
        raise TypeError(f"x: dtype {x.dtype} is not supported; torch tensors must be float32, "
                        "bfloat16 or float16")
    _check_shapes(x, dy, gamma)


def _device_route(transport, server_takes_cuda_ipc, target):
    """How a Backward on CUDA tensors goes: "cuda_ipc" (the server reads them in place) or
    "host" (copied to the host and back). transport "cuda_ipc" without a server that takes
    it is FAILED_PRECONDITION."""
    if transport in ("bytes", "shm"):
        return "host"
    if server_takes_cuda_ipc:
        return "cuda_ipc"
    if transport == "cuda_ipc":
        raise _make_error("FAILED_PRECONDITION",
                          f"transport \"cuda_ipc\": the server at {target} takes no CUDA IPC "
                          "for this GPU (GetServerInfo cuda_ipc.enabled is false, or its "
                          "device_uuid is another GPU's); start it with --cuda-ipc on the CUDA "
                          "backend on this GPU, or use transport \"auto\" to copy through the "
                          "host")
    return "host"


_DEVICE_DTYPES = ("f32", "bf16", "f16")


def _gamma_host(gamma, dtype, hidden):
    """gamma for backward_device as a contiguous host buffer of `dtype` and the grad_gamma
    output of the same kind (numpy array or torch CPU tensor): (grad_gamma, buffers)."""
    import numpy as np
    if _is_torch(gamma):
        import torch
        if not isinstance(gamma, torch.Tensor) or gamma.device.type != "cpu":
            raise ValueError(f"gamma: expected a host (CPU) tensor, got one on {gamma.device}")
        if _torch_types().get(gamma.dtype) != dtype:
            raise TypeError(f"gamma: dtype {gamma.dtype} is not dtype {dtype!r}")
        gamma = gamma.detach().contiguous()
        grad = torch.empty_like(gamma)
        buffers = (_torch_buffer(gamma, dtype), _torch_buffer(grad, dtype))
    else:
        if not isinstance(gamma, np.ndarray):
            raise TypeError(f"gamma: expected a numpy array or torch CPU tensor, got "
                            f"{type(gamma).__name__}")
        # numpy has no bfloat16: bf16 gamma travels as its bits in a uint16 (or int16) array.
        want = {"f32": ("float32",), "f16": ("float16",), "bf16": ("uint16", "int16")}[dtype]
        if gamma.dtype.name not in want:
            raise TypeError(f"gamma: numpy dtype {gamma.dtype} does not hold dtype {dtype!r} "
                            f"(expected {' or '.join(want)})")
        gamma = np.ascontiguousarray(gamma)
        grad = np.empty_like(gamma)
        buffers = (gamma, grad)
    if tuple(gamma.shape) != (hidden,):
        raise ValueError(f"gamma: shape {tuple(gamma.shape)}, expected ({hidden},) (hidden_dim)")
    return grad, buffers


def _pointer(name, value):
    try:
        pointer = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected a device pointer (int), got "
                        f"{type(value).__name__}") from None
    if pointer <= 0 or pointer >= 1 << 64:
        raise ValueError(f"{name}: {pointer:#x} is not a device pointer")
    return pointer


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


def _check_shapes(x, dy, gamma):
    """x and dy (..., hidden) of one shape; gamma (hidden,) or None; one dtype for them all."""
    x_shape, dy_shape = tuple(x.shape), tuple(dy.shape)
    if len(x_shape) < 1:
        raise ValueError("x: needs at least one dimension (..., hidden)")
    if dy_shape != x_shape:
        raise ValueError(f"dy: shape {dy_shape} differs from x's {x_shape}")
    if gamma is not None and tuple(gamma.shape) != (x_shape[-1],):
        raise ValueError(f"gamma: shape {tuple(gamma.shape)}, expected ({x_shape[-1]},) "
                         "(x's last dimension)")
    if dy.dtype != x.dtype or (gamma is not None and gamma.dtype != x.dtype):
        raise TypeError(f"x, dy and gamma must share one dtype; got {x.dtype}, {dy.dtype}, "
                        f"{'no gamma' if gamma is None else gamma.dtype}")


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
