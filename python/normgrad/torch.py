"""PyTorch RMSNorm whose backward runs on a normgrad server.

    import normgrad, normgrad.torch
    client = normgrad.Client("localhost:50051")
    norm = normgrad.torch.RMSNorm(4096, eps=1e-6, client=client)   # an nn.Module with .weight
    y = norm(x)              # forward here: y = x / rms * weight, rms = sqrt(mean(x^2) + eps)
    y.sum().backward()       # x, dy and the kept per-row rms go to the server; dx, dweight back

The forward computes in float32 (x and weight upcast; y cast back to x's dtype) and keeps the
per-row rms (float32) for the backward, so the server does not recompute it. x may have any
number of leading dimensions, any layout (non-contiguous inputs are made contiguous: one copy)
and dtype float32, bfloat16 or float16 (the server accumulates in float32). weight may have
another dtype than x: it is sent as x's dtype and its gradient cast back.

x may be a CUDA tensor: the forward runs on its device, and the backward goes through
Client.backward, by CUDA IPC when the server takes it for that GPU (started with --cuda-ipc on
the same GPU; the server computes dx in place in device memory), else copied through the host
(transport "auto"; transport "cuda_ipc" makes that a normgrad.FailedPreconditionError).
"""

import torch

__all__ = ["RMSNorm", "rms_norm", "rms_norm_reference"]


def _forward(x, weight, eps):
    xf = x.float()
    rms = torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = (xf / rms * weight.float()).to(x.dtype)
    return y, rms


class _RemoteRmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, client):
        y, rms = _forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rms)
        ctx.eps = eps
        ctx.client = client
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rms = ctx.saved_tensors
        dx, dgamma = ctx.client.backward(x, dy.to(x.dtype), weight.detach().to(x.dtype),
                                         eps=ctx.eps, rms=rms)
        grad_x = dx if ctx.needs_input_grad[0] else None
        grad_weight = dgamma.to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_weight, None, None


def rms_norm(x, weight, eps=1e-6, *, client):
    """y = x / sqrt(mean(x^2, -1) + eps) * weight, computed here; its backward on `client`'s
    server (normgrad.Client). x: (..., hidden) CPU or CUDA tensor (CUDA: the backward by CUDA
    IPC when the server takes it, see Client.backward); weight: (hidden,), on x's device."""
    if x.shape[-1:] != weight.shape:
        raise ValueError(f"weight: shape {tuple(weight.shape)}, expected ({x.shape[-1]},) "
                         "(x's last dimension)")
    return _RemoteRmsNorm.apply(x, weight, float(eps), client)


def rms_norm_reference(x, weight, eps=1e-6):
    """The same forward as rms_norm, differentiated locally by PyTorch's autograd (to compare
    with, or to run without a server)."""
    return _forward(x, weight, eps)[0]


class RMSNorm(torch.nn.Module):
    """RMSNorm over the last dimension with a learned `weight` (initialised to ones), like the
    RMSNorm layers of common LLM code; the backward runs on `client`'s server."""

    def __init__(self, hidden_size, eps=1e-6, *, client, dtype=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps
        self.client = client

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps, client=self.client)

    def extra_repr(self):
        return f"{self.weight.shape[0]}, eps={self.eps}, client={self.client!r}"
