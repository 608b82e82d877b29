"""normgrad.torch: rms_norm and RMSNorm run the forward here and the backward on the server.
Gradients against the same forward differentiated by PyTorch (float64 and the input dtype),
for any leading dimensions, non-contiguous inputs, requires_grad on either input or both, half
precisions; and a small training run whose loss curve with the remote backward matches the
local one."""

import unittest

from server_process import CpuServerFixture

try:
    import torch
    import normgrad.torch as ngt
except ImportError:
    torch = None

# Relative to the largest gradient: output rounding plus float32 sums on the server.
RTOL = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}
# Largest relative difference between the remote and the local loss curves of the training
# run (float32 everywhere; the two differ only in the backward's float rounding, about 1e-7).
LOSS_CURVE_RTOL = 1e-5


def max_relative_error(got, want):
    got, want = got.detach().double(), want.detach().double()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


@unittest.skipIf(torch is None, "torch is not installed")
class TorchModuleTest(CpuServerFixture, unittest.TestCase):
    def compare(self, x, weight, eps=1e-6, grad_x=True, grad_w=True, dy=None):
        """Gradients of rms_norm (remote backward) against float64 autograd of the same
        forward on the same (rounded) inputs."""
        x_remote = x.detach().clone().requires_grad_(grad_x)
        w_remote = weight.detach().clone().requires_grad_(grad_w)
        y = ngt.rms_norm(x_remote, w_remote, eps, client=self.client)
        self.assertEqual(y.dtype, x.dtype)
        self.assertEqual(y.shape, x.shape)
        if dy is None:
            dy = torch.randn(x.shape, dtype=torch.float64).to(x.dtype)
        y.backward(dy)

        x64 = x.detach().double().requires_grad_(True)
        w64 = weight.detach().double().requires_grad_(True)
        ngt.rms_norm_reference(x64, w64, eps).backward(dy.double())
        tolerance = RTOL[str(x.dtype).split(".")[1]]
        if grad_x:
            self.assertEqual(x_remote.grad.dtype, x.dtype)
            self.assertLessEqual(max_relative_error(x_remote.grad, x64.grad), tolerance)
        else:
            self.assertIsNone(x_remote.grad)
        if grad_w:
            self.assertEqual(w_remote.grad.dtype, weight.dtype)
            self.assertLessEqual(max_relative_error(w_remote.grad, w64.grad), tolerance)
        else:
            self.assertIsNone(w_remote.grad)

    def test_leading_dimensions(self):
        torch.manual_seed(0)
        for shape in ((7,), (3, 33), (2, 3, 896), (2, 2, 2, 65)):
            with self.subTest(shape=shape):
                self.compare(torch.randn(shape), 1 + 0.1 * torch.randn(shape[-1]))

    def test_non_contiguous_inputs(self):
        torch.manual_seed(1)
        base = torch.randn(64, 12)
        x = base.t()  # (12, 64), strides (1, 12)
        self.assertFalse(x.is_contiguous())
        dy = torch.randn(64, 12).t()
        self.compare(x, 1 + 0.1 * torch.randn(64), dy=dy)
        # Every other column of a wider tensor, and an expanded (stride 0) upstream gradient.
        wide = torch.randn(5, 2 * 33)[:, ::2]
        self.assertFalse(wide.is_contiguous())
        self.compare(wide, torch.ones(33), dy=torch.ones(33).expand(5, 33))

    def test_requires_grad_on_either_or_both(self):
        torch.manual_seed(2)
        x, w = torch.randn(4, 33), 1 + 0.1 * torch.randn(33)
        for grad_x, grad_w in ((True, True), (True, False), (False, True)):
            with self.subTest(grad_x=grad_x, grad_w=grad_w):
                self.compare(x, w, grad_x=grad_x, grad_w=grad_w)

    def test_half_precisions(self):
        torch.manual_seed(3)
        for dtype in (torch.bfloat16, torch.float16):
            for hidden in (33, 896, 4097):
                with self.subTest(dtype=dtype, hidden=hidden):
                    self.compare(torch.randn(3, hidden).to(dtype),
                                 (1 + 0.1 * torch.randn(hidden)).to(dtype))

    def test_half_input_with_float32_weight(self):
        torch.manual_seed(4)
        x = torch.randn(3, 896).to(torch.bfloat16).requires_grad_(True)
        layer = ngt.RMSNorm(896, client=self.client)
        self.assertEqual(layer.weight.dtype, torch.float32)
        layer(x).float().pow(2).sum().backward()
        self.assertEqual(x.grad.dtype, torch.bfloat16)
        self.assertEqual(layer.weight.grad.dtype, torch.float32)
        self.assertTrue(torch.isfinite(layer.weight.grad).all())

    def test_rmsnorm_module(self):
        layer = ngt.RMSNorm(896, eps=1e-5, client=self.client, dtype=torch.float16)
        self.assertIsInstance(layer, torch.nn.Module)
        self.assertEqual([name for name, _ in layer.named_parameters()], ["weight"])
        self.assertEqual(layer.weight.dtype, torch.float16)
        self.assertIn("896", repr(layer))
        x = torch.randn(2, 5, 896).to(torch.float16).requires_grad_(True)
        layer(x).float().sum().backward()
        self.assertEqual(layer.weight.grad.shape, (896,))
        self.assertEqual(x.grad.shape, x.shape)

    def test_training_loss_curve_matches_local(self):
        """Three RMSNorm layers in a small MLP, 40 SGD steps, remote backward vs local. SGD
        with momentum, not Adam: Adam's per-parameter scaling would hide a gradient off by a
        constant factor. Measured: the curves differ by about 1e-7 (relative); a dx off by
        0.1% moves them by 1.1e-5, a dgamma off by 1% by 8e-5."""
        torch.manual_seed(5)
        hidden = 64
        inputs = torch.randn(32, 8, hidden)
        targets = torch.randn(32, 8, hidden)

        class Block(torch.nn.Module):
            def __init__(self, norm):
                super().__init__()
                self.norm = norm
                self.linear = torch.nn.Linear(hidden, hidden)

            def forward(self, x):
                return x + torch.nn.functional.gelu(self.linear(self.norm(x)))

        class LocalRMSNorm(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.weight = torch.nn.Parameter(torch.ones(hidden))

            def forward(self, x):
                return ngt.rms_norm_reference(x, self.weight, 1e-6)

        def model(make_norm):
            torch.manual_seed(6)
            return torch.nn.Sequential(*[Block(make_norm()) for _ in range(3)])

        def train(net):
            optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
            losses = []
            for step in range(40):
                batch = slice((step % 4) * 8, (step % 4) * 8 + 8)
                loss = torch.nn.functional.mse_loss(net(inputs[batch]), targets[batch])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
            return losses

        remote = train(model(lambda: ngt.RMSNorm(hidden, client=self.client)))
        local = train(model(LocalRMSNorm))
        self.assertLess(remote[-1], 0.9 * remote[0])  # it learns
        worst = max(abs(r - l) / abs(l) for r, l in zip(remote, local))
        self.assertLessEqual(worst, LOSS_CURVE_RTOL,
                             f"remote {remote[::10]} vs local {local[::10]}")


if __name__ == "__main__":
    unittest.main()
