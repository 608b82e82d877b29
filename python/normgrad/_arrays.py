"""What normgrad.Client does with its arguments before the C++ client sees them: numpy arrays and
torch tensors checked (shapes, dtypes, layout) and handed over as buffers without copying, the
route of device tensors (CUDA IPC or the host), gamma and rms as the server takes them."""

import operator

from .errors import _make_error

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
