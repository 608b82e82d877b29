"""The RMSNorm variants (gamma offset, no gamma, casting modes llama/gemma/none, in place) from
Python: normgrad.torch.RMSNorm's forward and backward against reference modules written here
(Llama, Gemma and a plain module, differentiated by PyTorch's autograd in the same dtype), over
a matrix of casting modes x dtypes x offsets x weight or none x odd shapes x transports; and
Client.backward's variant arguments (dgamma None without gamma, dx written over dy, errors
that name the argument)."""

import itertools
import sys
import unittest

import numpy as np

import normgrad
from server_process import ServerProcess, SharedMemoryServer

try:
    import torch
    import normgrad.torch as ngt
except ImportError:
    torch = None

SHAPES = ((1, 1), (3, 7), (2, 33), (5, 1000), (2, 4097))
# (offset, weight): Llama's (0, a weight), Gemma's (1, a weight), and no weight at all.
SCALES = ((0.0, True), (1.0, True), (0.0, False))
EPS = 1e-6

# Tolerances of |normgrad - reference| <= ATOL * magnitude + RTOL * |reference|, per element,
# where the magnitude is the size of the terms a result is made of (magnitudes()), not of the
# result: dx = rstd * (dy*s - c*x) cancels, to about eps / x^2 of its terms at hidden 1, so its
# rounding errors are those of its terms. float32: the two sides differ in the order of float32
# sums (over hidden for dx, over rows for dweight: about 1e-7 relative each, growing with the
# length) and in 1/rms against rsqrt; 1e-5 of the magnitude leaves room for hidden 4097 while a
# gradient off by 1e-4 fails. bfloat16: the reference's autograd rounds every intermediate
# (x * rstd, the product with the weight, each backward product) to bfloat16 (2^-8 = 3.9e-3
# relative each) where the server keeps float32 until the casting mode's roundings; a few such
# roundings apart, two results differ by several ulps of bfloat16, so Liger-Kernel's bfloat16
# tolerances: 1e-1 absolute on O(1) values (here of the magnitude) and 2e-2 relative.
TOLERANCES = {"float32": (1e-5, 1e-4), "bfloat16": (1e-1, 2e-2)}


def magnitudes(x, dy, scale):
    """The largest term of y, dx and dweight (float64): |x * rstd * s|, rstd * |dy * s| (dx's
    two terms are of one size), and the sum over rows of |dy * x * rstd|."""
    x, dy = x.double().reshape(-1, x.shape[-1]), dy.double().reshape(-1, x.shape[-1])
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    s = scale.double().abs()
    return {"y": (x.abs() * rstd * s).max().item(), "dx": (dy.abs() * s * rstd).max().item(),
            "dweight": (dy * x * rstd).abs().sum(0).max().item()}


def assert_close(test, name, got, want, magnitude):
    atol, rtol = TOLERANCES[str(want.dtype).split(".")[1]]
    got, want = got.detach().double(), want.detach().double()
    excess = (got - want).abs() - (atol * magnitude + rtol * want.abs())
    test.assertLessEqual(excess.max().item(), 0.0,
                         f"{name}: max |diff| {(got - want).abs().max().item():.3g}, magnitude "
                         f"{magnitude:.3g}, max |ref| {want.abs().max().item():.3g}")


if torch is not None:
    class ReferenceNorm(torch.nn.Module):
        """A reference RMSNorm's parameters: weight (hidden,) of ones, or none; eps; offset.
        The matrix sets the weight it compares with; the subclasses are the forwards."""

        def __init__(self, hidden, eps, offset, affine, dtype):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(hidden, dtype=dtype)) if affine else None
            self.eps, self.offset = eps, offset

    class LlamaRMSNorm(ReferenceNorm):
        """LlamaRMSNorm (Hugging Face transformers), with an offset added to the weight."""

        def forward(self, hidden_states):
            input_dtype = hidden_states.dtype
            hidden_states = hidden_states.to(torch.float32)
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
            if self.weight is None:
                return hidden_states.to(input_dtype)
            return (self.offset + self.weight) * hidden_states.to(input_dtype)

    class GemmaRMSNorm(ReferenceNorm):
        """GemmaRMSNorm (Hugging Face transformers): float32 throughout, scale offset + weight
        (offset 1 in Gemma, whose weight starts at zeros)."""

        def _norm(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

        def forward(self, x):
            output = self._norm(x.float())
            if self.weight is not None:
                output = output * (self.offset + self.weight.float())
            return output.type_as(x)

    class PlainRMSNorm(ReferenceNorm):
        """An RMSNorm without casts: every operation in x's dtype."""

        def forward(self, x):
            y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
            return y if self.weight is None else y * (self.offset + self.weight)

    REFERENCES = {"llama": LlamaRMSNorm, "gemma": GemmaRMSNorm, "none": PlainRMSNorm}


class TwoTransports:
    """A CPU-backend server per transport and a Client each: clients["bytes"], ["shm"]."""

    @classmethod
    def setUpClass(cls):
        cls.servers = [ServerProcess("cpu"), SharedMemoryServer("cpu")]
        cls.clients = {
            "bytes": normgrad.Client(cls.servers[0].address, transport="bytes", deadline=120),
            "shm": normgrad.Client(cls.servers[1].target, transport="shm", deadline=120)}

    @classmethod
    def tearDownClass(cls):
        for client in cls.clients.values():
            client.close()
        for server in cls.servers:
            server.stop()


@unittest.skipIf(torch is None, "torch is not installed")
class VariantMatrixTest(TwoTransports, unittest.TestCase):

    def check_case(self, transport, mode, dtype, offset, affine, shape, seed):
        generator = torch.Generator().manual_seed(seed)
        x = (2 * torch.randn(shape, generator=generator)).to(dtype)
        dy = torch.randn(shape, generator=generator).to(dtype)
        hidden = shape[-1]
        layer = ngt.RMSNorm(hidden, EPS, offset=offset, casting_mode=mode,
                            elementwise_affine=affine, client=self.clients[transport],
                            dtype=dtype)
        reference = REFERENCES[mode](hidden, EPS, offset, affine, dtype)
        if affine:
            weight = (1 - offset + 0.1 * torch.randn(hidden, generator=generator)).to(dtype)
            with torch.no_grad():
                layer.weight.copy_(weight)
                reference.weight.copy_(weight)
        outputs = []
        for module in (layer, reference):
            x_leaf = x.clone().requires_grad_(True)
            y = module(x_leaf)
            y.backward(dy)
            outputs.append((y, x_leaf.grad, module.weight))
        (y, dx, w), (y_ref, dx_ref, w_ref) = outputs
        self.assertEqual(y.dtype, dtype)
        scale = offset + w.detach().double() if affine else torch.ones(hidden)
        size = magnitudes(x, dy, scale)
        assert_close(self, "y", y, y_ref, size["y"])
        assert_close(self, "dx", dx, dx_ref, size["dx"])
        if affine:
            assert_close(self, "dweight", w.grad, w_ref.grad, size["dweight"])
        else:
            self.assertIsNone(w)

    def test_matrix_against_reference_modules(self):
        cases = list(itertools.product(("bytes", "shm"), ("llama", "gemma", "none"),
                                       (torch.float32, torch.bfloat16), SCALES, SHAPES))
        for seed, (transport, mode, dtype, (offset, affine), shape) in enumerate(cases):
            with self.subTest(transport=transport, mode=mode, dtype=dtype, offset=offset,
                              weight=affine, shape=shape):
                self.check_case(transport, mode, dtype, offset, affine, shape, seed)
        print(f"variant matrix: {len(cases)} cases (2 transports x 3 casting modes x 2 dtypes "
              f"x {len(SCALES)} offset/weight x {len(SHAPES)} shapes)", file=sys.stderr)

    def test_float32_modes_give_the_same_bits(self):
        # For float32 the casting modes are one math (docs/python.md): the same gradients.
        x, dy = torch.randn(3, 257), torch.randn(3, 257)
        gamma = 1 + 0.1 * torch.randn(257)
        rms = torch.sqrt(x.pow(2).mean(-1) + EPS)
        results = [self.clients["bytes"].backward(x, dy, gamma, rms=rms, gamma_offset=0.5,
                                                  casting_mode=mode)
                   for mode in normgrad.CASTING_MODES]
        for dx, dgamma in results[1:]:
            self.assertTrue(torch.equal(dx, results[0][0]))
            self.assertTrue(torch.equal(dgamma, results[0][1]))


@unittest.skipIf(torch is None, "torch is not installed")
class ClientVariantArgumentsTest(TwoTransports, unittest.TestCase):
    def test_no_gamma_returns_no_dgamma(self):
        x, dy = np.random.default_rng(0).standard_normal((2, 2, 48)).astype(np.float32), \
            np.random.default_rng(1).standard_normal((2, 2, 48)).astype(np.float32)
        for transport, client in self.clients.items():
            with self.subTest(transport=transport):
                dx, dgamma = client.backward(x, dy, None, casting_mode="llama")
                self.assertIsNone(dgamma)
                # gamma = ones with the same math gives the same dx.
                dx_ones, _ = client.backward(x, dy, np.ones(48, np.float32),
                                             casting_mode="llama")
                np.testing.assert_array_equal(dx, dx_ones)

    def test_in_place_writes_dx_over_dy(self):
        generator = torch.Generator().manual_seed(2)
        for transport, client in self.clients.items():
            for dtype in (torch.float32, torch.bfloat16):
                with self.subTest(transport=transport, dtype=dtype):
                    x = torch.randn(4, 4097, generator=generator).to(dtype)
                    dy = torch.randn(4, 4097, generator=generator).to(dtype)
                    gamma = torch.randn(4097, generator=generator).to(dtype)
                    options = {"gamma_offset": 1.0, "casting_mode": "gemma"}
                    dx_out, dgamma_out = client.backward(x, dy, gamma, **options)
                    pointer = dy.data_ptr()
                    dx, dgamma = client.backward(x, dy, gamma, in_place=True, **options)
                    self.assertIs(dx, dy)
                    self.assertEqual(dy.data_ptr(), pointer)
                    self.assertTrue(torch.equal(dx, dx_out))
                    self.assertTrue(torch.equal(dgamma, dgamma_out))
        x = np.ones((3, 8), np.float32)
        dy = np.arange(24, dtype=np.float32).reshape(3, 8)
        dx_out, _ = self.clients["bytes"].backward(x, dy, None)
        dx, _ = self.clients["bytes"].backward(x, dy, None, in_place=True)
        self.assertIs(dx, dy)
        np.testing.assert_array_equal(dy, dx_out)

    def test_in_place_in_the_torch_layer(self):
        # The layer's in-place backward gives the out-of-place one's gradients.
        x = torch.randn(6, 300)
        grads = []
        for in_place in (False, True):
            layer = ngt.RMSNorm(300, offset=1.0, casting_mode="gemma", in_place=in_place,
                                client=self.clients["shm"])
            x_leaf = x.clone().requires_grad_(True)
            (layer(x_leaf) * torch.arange(300.0)).sum().backward()
            grads.append((x_leaf.grad, layer.weight.grad))
        self.assertTrue(torch.equal(grads[0][0], grads[1][0]))
        self.assertTrue(torch.equal(grads[0][1], grads[1][1]))

    def test_errors_name_the_argument(self):
        client = self.clients["bytes"]
        x = torch.randn(2, 8)
        with self.assertRaisesRegex(ValueError, "^casting_mode: 'llamma' is not one of"):
            client.backward(x, x, torch.ones(8), casting_mode="llamma")
        with self.assertRaisesRegex(ValueError, "^gamma_offset: 1.0 without gamma"):
            client.backward(x, x, None, gamma_offset=1.0)
        with self.assertRaisesRegex(ValueError, "^gamma_offset: inf is not finite"):
            client.backward(x, x, torch.ones(8), gamma_offset=float("inf"))
        with self.assertRaisesRegex(TypeError, "^gamma_offset: expected a number"):
            client.backward(x, x, torch.ones(8), gamma_offset="one")
        with self.assertRaisesRegex(ValueError, "^dy: in_place=True .* contiguous"):
            client.backward(x, torch.randn(8, 2).t(), None, in_place=True)
        read_only = np.ones((2, 8), np.float32)
        read_only.flags.writeable = False
        with self.assertRaisesRegex(ValueError, "^dy: in_place=True .* writable"):
            client.backward(read_only, read_only, None, in_place=True)
        with self.assertRaisesRegex(TypeError, "no gamma"):
            client.backward(x, x.double(), None)
        with self.assertRaisesRegex(ValueError, "^casting_mode: 'LLAMA' is not one of"):
            ngt.RMSNorm(8, casting_mode="LLAMA", client=client)
        with self.assertRaisesRegex(ValueError, "^offset: 1.0 with elementwise_affine=False"):
            ngt.RMSNorm(8, offset=1.0, elementwise_affine=False, client=client)


if __name__ == "__main__":
    unittest.main()
