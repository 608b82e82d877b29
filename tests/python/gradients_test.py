"""client.backward's gradients against PyTorch's own autograd in float64, for numpy and torch
inputs of every dtype, many shapes (hidden sizes 1 to 4097, 3-D inputs, multi-chunk batches),
with and without the forward's rms, on the CPU backend and on the emulated CUDA driver."""

import hashlib
import unittest

import numpy as np

import normgrad
from server_process import ServerProcess, SharedMemoryServer, skip_without_emulated_cuda

try:
    import torch
except ImportError:  # the numpy cases still run
    torch = None

EPS = 1e-5
HIDDEN_SIZES = (1, 7, 33, 896, 4096, 4097)
# Tolerance relative to the largest reference value: one rounding to the output dtype plus the
# server's float32 sums (over hidden for dx, over rows for dgamma).
RTOL = {"f32": 2e-5, "f16": 2e-3, "bf16": 1.6e-2}


def reference_gradients(x, dy, gamma, eps):
    """dx and dgamma of y = x / sqrt(mean(x^2) + eps) * gamma by torch autograd in float64
    (the inputs as given, converted exactly to float64)."""
    x64 = torch.tensor(np.asarray(x, dtype=np.float64), requires_grad=True)
    g64 = torch.tensor(np.asarray(gamma, dtype=np.float64), requires_grad=True)
    y = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * g64
    y.backward(torch.tensor(np.asarray(dy, dtype=np.float64)))
    return x64.grad.numpy(), g64.grad.numpy()


def reference_gradients_numpy(x, dy, gamma, eps):
    """The same in numpy float64 (when torch is not installed)."""
    x, dy, gamma = (np.asarray(a, dtype=np.float64) for a in (x, dy, gamma))
    h = x.shape[-1]
    rms = np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    xhat = x / rms
    g = dy * gamma
    dx = (g - xhat * (g * xhat).sum(-1, keepdims=True) / h) / rms
    return dx, (dy * xhat).reshape(-1, h).sum(0)


def as_float64(a):
    if torch is not None and isinstance(a, torch.Tensor):
        return a.detach().to(torch.float64).numpy()
    return np.asarray(a, dtype=np.float64)


class GradientCase:
    """Random inputs of one shape and dtype, rounded to the dtype before the reference sees
    them, so the only differences are the server's arithmetic and the output rounding."""

    def __init__(self, shape, dtype, kind, seed):
        rng = np.random.default_rng(seed)
        x = rng.uniform(-2, 2, shape)
        dy = rng.uniform(-2, 2, shape)
        gamma = 1 + 0.25 * rng.uniform(-1, 1, shape[-1])
        self.dtype, self.kind = dtype, kind
        if kind == "numpy":
            np_dtype = {"f32": np.float32, "f16": np.float16}[dtype]
            self.x, self.dy, self.gamma = (a.astype(np_dtype) for a in (x, dy, gamma))
        else:
            t_dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[dtype]
            self.x, self.dy, self.gamma = (torch.tensor(a).to(t_dtype) for a in (x, dy, gamma))
        reference = reference_gradients if torch is not None else reference_gradients_numpy
        self.dx_ref, self.dgamma_ref = reference(as_float64(self.x), as_float64(self.dy),
                                                 as_float64(self.gamma), EPS)

    def rms(self):
        x = as_float64(self.x)
        return np.sqrt((x * x).mean(-1) + EPS).astype(np.float32)


class GradientsTestBase:
    backend = "cpu"
    # The emulated driver interprets PTX: fewer rows there.
    rows = 5

    transport = "auto"

    @classmethod
    def setUpClass(cls):
        cls.server = ServerProcess(cls.backend)
        cls.client = normgrad.Client(cls.server.address, transport=cls.transport, deadline=120)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.stop()

    def check(self, case, dx, dgamma):
        kind_type = torch.Tensor if case.kind == "torch" else np.ndarray
        self.assertIsInstance(dx, kind_type)
        self.assertIsInstance(dgamma, kind_type)
        self.assertEqual(tuple(dx.shape), tuple(case.x.shape))
        self.assertEqual(dx.dtype, case.x.dtype)
        self.assertEqual(tuple(dgamma.shape), tuple(case.gamma.shape))
        self.assertEqual(dgamma.dtype, case.gamma.dtype)
        for name, got, want in (("dx", dx, case.dx_ref), ("dgamma", dgamma, case.dgamma_ref)):
            got = as_float64(got)
            scale = max(np.abs(want).max(), 1e-30)
            error = np.abs(got - want).max() / scale
            self.assertLessEqual(error, RTOL[case.dtype],
                                 f"{name}: max error {error:.3g} of max |ref| {scale:.3g} for "
                                 f"{case.kind} {case.dtype} {tuple(case.x.shape)}")

    def run_case(self, shape, dtype, kind, with_rms=False, seed=0):
        case = GradientCase(shape, dtype, kind, seed)
        rms = case.rms() if with_rms else None
        dx, dgamma = self.client.backward(case.x, case.dy, case.gamma, eps=EPS, rms=rms)
        self.check(case, dx, dgamma)

    def kinds(self):
        yield "numpy", "f32"
        yield "numpy", "f16"
        if torch is not None:
            yield "torch", "f32"
            yield "torch", "bf16"
            yield "torch", "f16"

    def test_hidden_sizes_every_dtype(self):
        for hidden in HIDDEN_SIZES:
            for kind, dtype in self.kinds():
                with self.subTest(hidden=hidden, kind=kind, dtype=dtype):
                    self.run_case((self.rows, hidden), dtype, kind, seed=hidden)

    def test_three_dimensional_inputs(self):
        for shape in ((2, 3, 33), (3, 2, 896)):
            for kind, dtype in self.kinds():
                with self.subTest(shape=shape, kind=kind, dtype=dtype):
                    self.run_case(shape, dtype, kind, seed=len(shape))

    def test_forward_rms_given(self):
        for kind, dtype in self.kinds():
            with self.subTest(kind=kind, dtype=dtype):
                self.run_case((self.rows, 896), dtype, kind, with_rms=True, seed=7)

    def test_info_health_and_emit_ptx(self):
        info = self.client.info()
        self.assertEqual(info["backend"], self.backend)
        self.assertIn("limits", info)
        self.assertEqual(self.client.health(), "SERVING")
        ptx = self.client.emit_ptx("batched_rms_norm_backward", 896, target="sm_90",
                                   dtype="bf16")
        self.assertIsInstance(ptx, normgrad.PtxResult)
        self.assertEqual(ptx.entry, "batched_rms_norm_backward")
        self.assertIn(".entry batched_rms_norm_backward", ptx.ptx)
        self.assertIn(".target sm_90", ptx.ptx)
        self.assertEqual(ptx.sha256, hashlib.sha256(ptx.ptx.encode()).hexdigest())
        self.assertEqual(ptx.cubin, b"")
        self.assertEqual(ptx.target, "sm_90")
        # The variants: each its own PTX; an offset without a weight is refused here.
        texts = {ptx.ptx}
        kernel = "rms_norm_backward_row_resident"
        plain = self.client.emit_ptx(kernel, 4096, target="sm_90", dtype="bf16")
        for variant in ({"gamma_offset": 1.0}, {"casting_mode": "llama"}, {"no_gamma": True}):
            with self.subTest(**variant):
                other = self.client.emit_ptx(kernel, 4096, target="sm_90", dtype="bf16",
                                             **variant)
                self.assertIn(".entry rms_norm_backward_row_resident", other.ptx)
                self.assertNotEqual(other.ptx, plain.ptx)
                self.assertNotIn(other.ptx, texts)
                texts.add(other.ptx)
        with self.assertRaisesRegex(ValueError, "gamma_offset: 1.0 without gamma"):
            self.client.emit_ptx(kernel, 4096, no_gamma=True, gamma_offset=1.0)


class CpuBackendGradientsTest(GradientsTestBase, unittest.TestCase):
    backend = "cpu"
    rows = 5

    def test_multi_chunk_batch(self):
        # 300 rows of 4096 f32: 4.8 MiB of x, five 1 MiB chunks each way.
        for kind, dtype in self.kinds():
            if dtype == "f32":
                with self.subTest(kind=kind):
                    self.run_case((300, 4096), dtype, kind, seed=300)

    def test_out_arrays_are_filled_and_returned(self):
        for kind, dtype in self.kinds():
            with self.subTest(kind=kind, dtype=dtype):
                case = GradientCase((6, 896), dtype, kind, 11)
                make = torch.empty_like if kind == "torch" else np.empty_like
                dx_out, dgamma_out = make(case.x), make(case.gamma)
                dx, dgamma = self.client.backward(case.x, case.dy, case.gamma, eps=EPS,
                                                  out=(dx_out, dgamma_out))
                self.assertIs(dx, dx_out)
                self.assertIs(dgamma, dgamma_out)
                self.check(case, dx, dgamma)
                fresh_dx, fresh_dgamma = self.client.backward(case.x, case.dy, case.gamma,
                                                              eps=EPS)
                self.assertTrue(np.array_equal(as_float64(dx), as_float64(fresh_dx)))
                self.assertTrue(np.array_equal(as_float64(dgamma), as_float64(fresh_dgamma)))

    def test_out_arrays_that_do_not_fit_are_refused(self):
        case = GradientCase((4, 8), "f32", "numpy", 12)
        x, dy, gamma = case.x, case.dy, case.gamma
        bad = (
            ((np.empty((4, 9), np.float32), np.empty(8, np.float32)), ValueError, "shape"),
            ((np.empty((4, 8), np.float64), np.empty(8, np.float32)), ValueError, "dtype"),
            ((np.empty((8, 4), np.float32).T, np.empty(8, np.float32)), ValueError,
             "C-contiguous"),
            ((dy, np.empty(8, np.float32)), ValueError, "shares memory"),
            ((np.empty((4, 8), np.float32), gamma), ValueError, "shares memory"),
            ((np.empty((4, 8), np.float32),), TypeError, "pair"),
        )
        for out, error, message in bad:
            with self.subTest(message=message):
                with self.assertRaisesRegex(error, message):
                    self.client.backward(x, dy, gamma, eps=EPS, out=out)
        with self.assertRaisesRegex(ValueError, "in_place"):
            self.client.backward(x, dy, gamma, eps=EPS, in_place=True,
                                 out=(np.empty_like(x), np.empty_like(gamma)))

    def test_non_contiguous_numpy_inputs(self):
        case = GradientCase((33, 8), "f32", "numpy", 3)
        x_t, dy_t = np.ascontiguousarray(case.x.T).T, np.ascontiguousarray(case.dy.T).T
        self.assertFalse(x_t.flags.c_contiguous)
        dx, dgamma = self.client.backward(x_t, dy_t, case.gamma, eps=EPS)
        self.check(case, dx, dgamma)


class SharedMemoryGradientsTest(GradientsTestBase, unittest.TestCase):
    """The same cases through the shared-memory transport: a unix socket target whose server
    runs with --shared-memory (the client stages the tensors in a region of its own)."""

    backend = "cpu"
    rows = 5
    transport = "shm"

    @classmethod
    def setUpClass(cls):
        cls.server = SharedMemoryServer("cpu")
        cls.client = normgrad.Client(cls.server.target, transport=cls.transport, deadline=120)


@skip_without_emulated_cuda
class EmulatedCudaGradientsTest(GradientsTestBase, unittest.TestCase):
    backend = "cuda"
    rows = 2


if __name__ == "__main__":
    unittest.main()
