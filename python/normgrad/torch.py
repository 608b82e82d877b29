"""PyTorch RMSNorm whose backward runs on a normgrad server.

    import normgrad, normgrad.torch
    client = normgrad.Client("localhost:50051")
    norm = normgrad.torch.RMSNorm(4096, eps=1e-6, client=client)   # an nn.Module with .weight
    y = norm(x)              # forward here: y = x / rms * weight, rms = sqrt(mean(x^2) + eps)
    y.sum().backward()       # x, dy and the kept per-row rms go to the server; dx, dweight back
    report = normgrad.torch.patch(model, client=client)   # a model's RMSNorm layers, replaced

The forward runs here, as the casting mode says (docs/python.md, "RMSNorm variants"):

    "llama"  rstd in float32; the normalized x cast to x's dtype, then times (offset + weight)
             (LlamaRMSNorm; the product cast to x's dtype)
    "gemma"  everything in float32, (offset + weight) too; cast to x's dtype at the end
             (GemmaRMSNorm, whose offset is 1 and weight starts at zeros)
    "none"   everything in x's dtype (a plain module without casts)

and keeps the per-row rms (float32) for the backward, so the server does not recompute it; the
server's backward rounds as the same mode does. For float32 inputs the three modes are the same
math. x may have any number of leading dimensions, any layout (non-contiguous inputs are made
contiguous: one copy) and dtype float32, bfloat16 or float16 (the server accumulates in
float32). weight may have another dtype than x: it is sent as x's dtype and its gradient cast
back. Without weight (elementwise_affine=False, weight None) y = x / rms.

x may be a CUDA tensor: the forward runs on its device, and the backward goes through
Client.backward, by CUDA IPC when the server takes it for that GPU (started with --cuda-ipc on
the same GPU; the server computes dx in place in device memory), else copied through the host
(transport "auto"; transport "cuda_ipc" makes that a normgrad.FailedPreconditionError).
"""

import dataclasses

import torch

from . import CASTING_MODES

__all__ = ["PatchResult", "RMSNorm", "patch", "rms_norm", "rms_norm_reference"]


def _check_casting_mode(casting_mode):
    if casting_mode not in CASTING_MODES:
        raise ValueError(f"casting_mode: {casting_mode!r} is not one of "
                         f"{', '.join(map(repr, CASTING_MODES))}")


def _forward(x, weight, eps, offset, casting_mode):
    """y (x's dtype) and the per-row rms (float32, keepdim) of the forward `casting_mode` says."""
    if eps is None:  # torch.nn.RMSNorm's default: the machine epsilon of x's dtype
        eps = torch.finfo(x.dtype).eps
    eps = float(eps)
    if casting_mode == "none":
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        y = x * rstd
        if weight is not None:
            y = y * (offset + weight.to(x.dtype))
        return y, rstd.float().reciprocal()
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    normalized = xf * rstd
    if casting_mode == "llama":
        normalized = normalized.to(x.dtype)
    y = normalized if weight is None else normalized * (offset + weight.float())
    return y.to(x.dtype), rstd.reciprocal()


class _RemoteRmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, offset, casting_mode, in_place, client):
        y, rms = _forward(x, weight, eps, offset, casting_mode)
        ctx.save_for_backward(x, weight, rms)
        ctx.eps = eps
        ctx.variant = {"gamma_offset": offset, "casting_mode": casting_mode}
        ctx.in_place = in_place
        ctx.client = client
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rms = ctx.saved_tensors
        dy = dy.to(x.dtype)
        # dx over dy's memory only where dy is one dense block (autograd may hand an expanded
        # gradient, whose elements share memory).
        in_place = ctx.in_place and dy.is_contiguous()
        gamma = None if weight is None else weight.detach().to(x.dtype)
        dx, dgamma = ctx.client.backward(x, dy, gamma, eps=ctx.eps, rms=rms,
                                         in_place=in_place, **ctx.variant)
        grad_x = dx if ctx.needs_input_grad[0] else None
        grad_weight = dgamma.to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_weight, None, None, None, None, None


def rms_norm(x, weight, eps=1e-6, *, client, offset=0.0, casting_mode="gemma", in_place=False):
    """y = x / sqrt(mean(x^2, -1) + eps) * (offset + weight), computed here as casting_mode
    says; its backward on `client`'s server (normgrad.Client). x: (..., hidden) CPU or CUDA
    tensor (CUDA: the backward by CUDA IPC when the server takes it, see Client.backward);
    weight: (hidden,), on x's device, or None (no scale; offset must be 0). in_place: the
    backward writes dx over the incoming gradient's memory (when it is contiguous) instead of
    a new tensor."""
    _check_casting_mode(casting_mode)
    if weight is None and offset != 0:
        raise ValueError(f"offset: {offset} without weight; an offset needs a weight")
    if weight is not None and x.shape[-1:] != weight.shape:
        raise ValueError(f"weight: shape {tuple(weight.shape)}, expected ({x.shape[-1]},) "
                         "(x's last dimension)")
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    return _RemoteRmsNorm.apply(x, weight, float(eps), float(offset), casting_mode,
                                bool(in_place), client)


def rms_norm_reference(x, weight, eps=1e-6, *, offset=0.0, casting_mode="gemma"):
    """The same forward as rms_norm, differentiated locally by PyTorch's autograd (to compare
    with, or to run without a server)."""
    _check_casting_mode(casting_mode)
    return _forward(x, weight, eps, offset, casting_mode)[0]


class RMSNorm(torch.nn.Module):
    """RMSNorm over the last dimension whose backward runs on `client`'s server.

    offset: added to weight (Gemma: 1.0); weight starts at 1 - offset, so the scale starts at 1
    (ones; zeros for Gemma). casting_mode: "llama", "gemma" or "none" (the module docstring).
    elementwise_affine=False: no weight (weight is None; offset must be 0). eps None: the
    machine epsilon of x's dtype (torch.nn.RMSNorm's default). in_place: the backward writes dx
    over the incoming gradient's memory (when contiguous), which the caller must not need
    afterwards."""

    def __init__(self, hidden_size, eps=1e-6, *, offset=0.0, casting_mode="llama",
                 elementwise_affine=True, in_place=False, client, dtype=None):
        super().__init__()
        _check_casting_mode(casting_mode)
        if not elementwise_affine and offset != 0:
            raise ValueError(f"offset: {offset} with elementwise_affine=False; an offset needs a "
                             "weight")
        if elementwise_affine:
            self.weight = torch.nn.Parameter(
                torch.full((hidden_size,), 1.0 - offset, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.hidden_size = hidden_size
        self.eps = eps
        self.offset = float(offset)
        self.casting_mode = casting_mode
        self.in_place = bool(in_place)
        self.client = client

    @property
    def variance_epsilon(self):
        """eps under the name Hugging Face's RMSNorm layers give it."""
        return self.eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps, client=self.client, offset=self.offset,
                        casting_mode=self.casting_mode, in_place=self.in_place)

    def extra_repr(self):
        return (f"{self.hidden_size}, eps={self.eps}, offset={self.offset}, "
                f"casting_mode={self.casting_mode!r}, "
                f"elementwise_affine={self.weight is not None}, in_place={self.in_place}, "
                f"client={self.client!r}")


@dataclasses.dataclass
class PatchResult:
    """What patch did. replaced: (qualified name, old class name, settings) per layer, settings
    a dict of the new layer's eps, offset, casting_mode, in_place and elementwise_affine.
    left_alone: (qualified name, class name, reason) per norm-like layer it did not replace."""

    replaced: list = dataclasses.field(default_factory=list)
    left_alone: list = dataclasses.field(default_factory=list)


_PATCH_OVERRIDES = ("eps", "offset", "casting_mode", "in_place")


def _is_rms_norm_class(module):
    name = type(module).__name__
    native = getattr(torch.nn, "RMSNorm", None)  # torch >= 2.4
    return (name.endswith("RMSNorm") or name == "T5LayerNorm"
            or (native is not None and isinstance(module, native)))


def _norm_structure(module):
    """(weight, eps) of an RMSNorm layer patch can replace, or a string: why it cannot."""
    weight = getattr(module, "weight", None)
    params = dict(module.named_parameters(recurse=False))
    if weight is not None:
        if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 1:
            return "weight is not a 1-D parameter (hidden,)"
        if params != {"weight": weight}:
            return f"parameters {sorted(params)} besides weight"
    elif params:
        return f"parameters {sorted(params)} but no weight"
    if list(module.buffers(recurse=False)) or list(module.children()):
        return "has buffers or submodules"
    shape = getattr(module, "normalized_shape", None)
    if shape is not None and len(tuple(shape)) != 1:
        return f"normalizes over {tuple(shape)}, not one dimension"
    for attribute in ("variance_epsilon", "eps"):
        if hasattr(module, attribute):
            eps = getattr(module, attribute)
            if eps is None or isinstance(eps, (int, float)):
                return weight, eps
            return f"{attribute} is a {type(eps).__name__}, not a number"
    return "no eps or variance_epsilon attribute"


def _hidden_size(module, weight):
    """The layer's hidden size: its weight's, else what it says (None when it does not)."""
    if weight is not None:
        return weight.shape[0]
    shape = getattr(module, "normalized_shape", None)
    if shape is not None:
        return tuple(shape)[0]
    return getattr(module, "hidden_size", getattr(module, "dim", None))


def _family_settings(module, model, has_weight):
    """offset and casting mode from the model family: Gemma's (1, "gemma") where the layer's or
    the model's class name says Gemma, else Llama's (0, "llama")."""
    gemma = "Gemma" in type(module).__name__ or "Gemma" in type(model).__name__
    return {"offset": 1.0 if gemma and has_weight else 0.0,
            "casting_mode": "gemma" if gemma else "llama"}


def patch(model, *, client, **overrides):
    """Replaces every RMSNorm layer of `model` (in place) by a normgrad.torch.RMSNorm that keeps
    the layer's own weight Parameter object (optimizers and state_dict keys keep working).

    Recognised: classes named *RMSNorm or T5LayerNorm (and torch.nn.RMSNorm where torch has it)
    with a weight of shape (hidden,) or none, no other parameters or buffers, and an eps or
    variance_epsilon attribute. Offset and casting mode follow the family (Gemma in the layer's
    or the model's class name: offset 1, "gemma"; otherwise offset 0, "llama"); overrides
    (eps, offset, casting_mode, in_place) win. Other layers whose class name contains "Norm"
    are left alone and listed. Returns a PatchResult.
    """
    unknown = sorted(set(overrides) - set(_PATCH_OVERRIDES))
    if unknown:
        raise TypeError(f"patch: unknown override {', '.join(unknown)}; choose from "
                        f"{', '.join(_PATCH_OVERRIDES)}")
    result = PatchResult()
    replacements = {}  # id(old layer) -> new layer: a layer shared by two parents stays shared
    for parent_name, parent in list(model.named_modules(remove_duplicate=False)):
        # _modules, not named_children(), which yields a layer held twice once only.
        for child_name, child in list(parent._modules.items()):
            if child is None:
                continue
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            class_name = type(child).__name__
            if isinstance(child, RMSNorm) or "Norm" not in class_name:
                continue
            if not _is_rms_norm_class(child):
                result.left_alone.append((name, class_name, "not an RMSNorm class"))
                continue
            structure = _norm_structure(child)
            if isinstance(structure, str):
                result.left_alone.append((name, class_name, structure))
                continue
            weight, eps = structure
            settings = {"eps": eps, **_family_settings(child, model, weight is not None),
                        "in_place": False, **overrides, "elementwise_affine": weight is not None}
            if id(child) not in replacements:
                layer = RMSNorm(_hidden_size(child, weight), client=client, **settings)
                if weight is not None:
                    layer.weight = weight
                layer.train(child.training)
                replacements[id(child)] = layer
            setattr(parent, child_name, replacements[id(child)])
            result.replaced.append((name, class_name, settings))
    if "Norm" in type(model).__name__ and not isinstance(model, RMSNorm):
        result.left_alone.append(("", type(model).__name__, "the model itself (patch its parent)"))
    return result
