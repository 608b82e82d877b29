"""CUDA IPC from Python: normgrad-server on the emulated CUDA driver with --cuda-ipc, and this
process the client with its own device buffers from the same emulated driver library (loaded
here with ctypes). client.backward_device hands the buffers' IPC handles to the server, which
computes in place: dx is read back from this process's device memory. Also the errors (a server
without --cuda-ipc, a pointer that is not device memory) and how the torch CUDA path picks its
route, which needs no GPU. The torch CUDA path itself runs only on a real GPU."""

import ctypes
import os
import threading
import unittest

import numpy as np

import normgrad
from gradients_test import EPS, RTOL, reference_gradients_numpy
from server_process import ServerProcess, emulated_cuda_driver, skip_without_emulated_cuda

try:
    import torch
except ImportError:
    torch = None


class EmulatedDevice:
    """Device 0 of the emulated driver in this process: its primary context current on this
    thread, allocations freed by free_all()."""

    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        ptr, size, handle = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p
        for name, args in (("cuInit", [ctypes.c_uint]),
                           ("cuDeviceGet", [ctypes.POINTER(ctypes.c_int), ctypes.c_int]),
                           ("cuDevicePrimaryCtxRetain", [ctypes.POINTER(handle), ctypes.c_int]),
                           ("cuCtxSetCurrent", [handle]),
                           ("cuMemAlloc_v2", [ctypes.POINTER(ptr), size]),
                           ("cuMemFree_v2", [ptr]),
                           ("cuMemcpyHtoDAsync_v2", [ptr, handle, size, handle]),
                           ("cuMemcpyDtoHAsync_v2", [handle, ptr, size, handle]),
                           ("cuStreamSynchronize", [handle])):
            function = getattr(self.lib, name)
            function.argtypes, function.restype = args, ctypes.c_int
        self._check(self.lib.cuInit(0), "cuInit")
        device, context = ctypes.c_int(), handle()
        self._check(self.lib.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
        self._check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device),
                    "cuDevicePrimaryCtxRetain")
        self._check(self.lib.cuCtxSetCurrent(context), "cuCtxSetCurrent")
        self.allocations = []

    @staticmethod
    def _check(result, call):
        if result != 0:
            raise RuntimeError(f"{call} failed: CUresult {result}")

    def alloc(self, nbytes):
        p = ctypes.c_uint64()
        self._check(self.lib.cuMemAlloc_v2(ctypes.byref(p), nbytes), "cuMemAlloc_v2")
        self.allocations.append(p.value)
        return p.value

    def upload(self, pointer, array):
        array = np.ascontiguousarray(array)
        self._check(self.lib.cuMemcpyHtoDAsync_v2(pointer, array.ctypes.data, array.nbytes, None),
                    "cuMemcpyHtoDAsync_v2")
        self._check(self.lib.cuStreamSynchronize(None), "cuStreamSynchronize")

    def download(self, pointer, dtype, count):
        # NaN (0xFFFF: a bfloat16 NaN) where nothing was written
        out = np.full(count, np.nan if np.dtype(dtype).kind == "f" else 0xFFFF, dtype=dtype)
        self._check(self.lib.cuMemcpyDtoHAsync_v2(out.ctypes.data, pointer, out.nbytes, None),
                    "cuMemcpyDtoHAsync_v2")
        self._check(self.lib.cuStreamSynchronize(None), "cuStreamSynchronize")
        return out

    def free_all(self):
        for p in self.allocations:
            self.lib.cuMemFree_v2(p)
        self.allocations = []


def random_case(rows, hidden, dtype, seed):
    """x, dy, gamma rounded to `dtype` (numpy) and the float64 reference on those values."""
    rng = np.random.default_rng(seed)
    x, dy = rng.uniform(-2, 2, (rows, hidden)), rng.uniform(-2, 2, (rows, hidden))
    gamma = 1 + 0.25 * rng.uniform(-1, 1, hidden)
    x, dy, gamma = (a.astype(dtype) for a in (x, dy, gamma))
    dx_ref, dgamma_ref = reference_gradients_numpy(x, dy, gamma, EPS)
    return x, dy, gamma, dx_ref, dgamma_ref


def to_bf16_bits(a):
    """float values rounded to bfloat16 (to nearest even), as their 16 bits in uint16."""
    bits = np.asarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16_bits(bits):
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def reference_given_rms(x, dy, gamma, rms):
    """dx and dgamma in float64 with the per-row rms used as given (kernels/rmsnorm/reference.h)."""
    x, dy, gamma = (np.asarray(a, dtype=np.float64) for a in (x, dy, gamma))
    r = np.asarray(rms, dtype=np.float64)[:, None]
    dx = (gamma * dy - x / r**2 * (x * dy * gamma).mean(-1, keepdims=True)) / r
    return dx, (dy * x / r).sum(0)


def assert_close(test, got, want, rtol, what):
    scale = max(float(np.abs(want).max()), 1e-30)
    error = float(np.abs(np.asarray(got, dtype=np.float64) - want).max()) / scale
    test.assertLessEqual(error, rtol, f"{what}: max error {error:.3g} of the largest value")


class EmulatedCudaServerTest(unittest.TestCase):
    """A CUDA-backend server over the emulated driver, and device memory of this process."""

    SERVER_FLAGS = []
    SERVER_ENVIRONMENT = {}  # set for the server process only

    @classmethod
    def setUpClass(cls):
        # The native module's driver loader reads this at its first CUDA call: the same library
        # as the one this process allocates from, so both see one device and one memory.
        os.environ["NORMGRAD_CUDA_DRIVER"] = emulated_cuda_driver()
        cls.device = EmulatedDevice(emulated_cuda_driver())
        os.environ.update(cls.SERVER_ENVIRONMENT)
        try:
            cls.server = ServerProcess("cuda", cls.SERVER_FLAGS)
        finally:
            for name in cls.SERVER_ENVIRONMENT:
                del os.environ[name]
        cls.client = normgrad.Client(cls.server.address, deadline=120, max_attempts=1)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.stop()
        cls.device.free_all()

    def refused_backward_device(self, seed):
        """The message of the FailedPreconditionError a 2 x 64 backward_device call gets."""
        x, dy, gamma, _, _ = random_case(2, 64, np.float32, seed)
        base = self.device.alloc(3 * x.nbytes)
        with self.assertRaises(normgrad.FailedPreconditionError) as caught:
            self.client.backward_device(base, base + x.nbytes, base + 2 * x.nbytes, gamma,
                                        num_rows=2, hidden_dim=64)
        return caught.exception.message


@skip_without_emulated_cuda
class CudaIpcTest(EmulatedCudaServerTest):
    SERVER_FLAGS = ["--cuda-ipc"]

    def place(self, x, dy):
        """x, dy and room for dx in one device allocation, [x | dy | dx]: their pointers."""
        nbytes = x.nbytes
        base = self.device.alloc(3 * nbytes)
        self.device.upload(base, x)
        self.device.upload(base + nbytes, dy)
        return base, base + nbytes, base + 2 * nbytes

    def check(self, dtype_name, np_dtype, rows, hidden, seed, with_rms=False, kernel=None):
        x, dy, gamma, dx_ref, dgamma_ref = random_case(rows, hidden, np_dtype, seed)
        x_ptr, dy_ptr, dx_ptr = self.place(x, dy)
        rms_ptr = None
        if with_rms:
            # 1.25 times the true rms: results that only the given values explain.
            x64 = x.astype(np.float64)
            rms = (1.25 * np.sqrt((x64 * x64).mean(-1) + EPS)).astype(np.float32)
            dx_ref, dgamma_ref = reference_given_rms(x, dy, gamma, rms)
            rms_ptr = self.device.alloc(64 + rms.nbytes) + 64  # not at its allocation's base
            self.device.upload(rms_ptr, rms)
        grad_gamma = self.client.backward_device(
            x_ptr, dy_ptr, dx_ptr, gamma, num_rows=rows, hidden_dim=hidden, dtype=dtype_name,
            eps=EPS, rms_ptr=rms_ptr, kernel=kernel)
        self.assertIsInstance(grad_gamma, np.ndarray)
        self.assertEqual((grad_gamma.dtype, grad_gamma.shape), (gamma.dtype, gamma.shape))
        dx = self.device.download(dx_ptr, np_dtype, rows * hidden).reshape(rows, hidden)
        assert_close(self, dx, dx_ref, RTOL[dtype_name], "dx")
        assert_close(self, grad_gamma, dgamma_ref, RTOL[dtype_name], "grad_gamma")

    def test_f32_gradients_are_computed_in_place_in_this_processs_device_memory(self):
        self.check("f32", np.float32, rows=6, hidden=256, seed=1)

    def test_f32_with_the_forwards_rms_at_an_offset_in_its_own_allocation(self):
        # hidden 32 with a given rms: the warp kernel, whose grad_gamma the server sums on the
        # host from the device buffers.
        self.check("f32", np.float32, rows=8, hidden=32, seed=2, with_rms=True,
                   kernel="rms_norm_backward")

    def test_f16_gradients(self):
        self.check("f16", np.float16, rows=4, hidden=128, seed=3)

    def test_bf16_gradients_with_gamma_as_uint16_bits(self):
        rows, hidden = 4, 128
        x, dy, gamma, _, _ = random_case(rows, hidden, np.float32, 9)
        x, dy, gamma = to_bf16_bits(x), to_bf16_bits(dy), to_bf16_bits(gamma)
        dx_ref, dgamma_ref = reference_gradients_numpy(
            from_bf16_bits(x), from_bf16_bits(dy), from_bf16_bits(gamma), EPS)
        x_ptr, dy_ptr, dx_ptr = self.place(x, dy)
        grad_gamma = self.client.backward_device(x_ptr, dy_ptr, dx_ptr, gamma, num_rows=rows,
                                                 hidden_dim=hidden, dtype="bf16", eps=EPS)
        self.assertEqual(grad_gamma.dtype, np.uint16)
        dx = self.device.download(dx_ptr, np.uint16, rows * hidden).reshape(rows, hidden)
        assert_close(self, from_bf16_bits(dx), dx_ref, RTOL["bf16"], "dx")
        assert_close(self, from_bf16_bits(grad_gamma), dgamma_ref, RTOL["bf16"], "grad_gamma")

    def run_device(self, x, dy, gamma, rows, hidden, in_place, **options):
        """One backward_device on fresh device copies of x and dy, dx over dy when in_place:
        (dx, grad_gamma) read back."""
        x_ptr, dy_ptr, dx_ptr = self.place(x, dy)
        if in_place:
            dx_ptr = dy_ptr
        grad_gamma = self.client.backward_device(x_ptr, dy_ptr, dx_ptr, gamma, num_rows=rows,
                                                 hidden_dim=hidden, in_place=in_place, **options)
        return self.device.download(dx_ptr, x.dtype, rows * hidden), grad_gamma

    def test_in_place_writes_dx_over_dy_with_the_out_of_place_bits(self):
        # The row-resident kernel, and the warp kernel whose grad_gamma the server sums on the
        # host from x and dy (read before dx is written over dy).
        for hidden, options in ((256, {}), (32, {"kernel": "rms_norm_backward"})):
            with self.subTest(hidden=hidden):
                x, dy, gamma, dx_ref, _ = random_case(6, hidden, np.float32, 11)
                rms_ptr = None
                if options:
                    x64 = x.astype(np.float64)
                    rms = np.sqrt((x64 * x64).mean(-1) + EPS).astype(np.float32)
                    rms_ptr = self.device.alloc(rms.nbytes)
                    self.device.upload(rms_ptr, rms)
                apart = self.run_device(x, dy, gamma, 6, hidden, False, eps=EPS, rms_ptr=rms_ptr,
                                        **options)
                over = self.run_device(x, dy, gamma, 6, hidden, True, eps=EPS, rms_ptr=rms_ptr,
                                       **options)
                np.testing.assert_array_equal(over[0], apart[0])
                np.testing.assert_array_equal(over[1], apart[1])
                assert_close(self, over[0].reshape(6, hidden), dx_ref, RTOL["f32"], "dx")

    def test_dx_at_dy_without_in_place_is_invalid_argument_naming_it(self):
        x, dy, gamma, _, _ = random_case(2, 64, np.float32, 12)
        x_ptr, dy_ptr, _ = self.place(x, dy)
        with self.assertRaises(normgrad.InvalidArgumentError) as caught:
            self.client.backward_device(x_ptr, dy_ptr, dy_ptr, gamma, num_rows=2, hidden_dim=64)
        self.assertIn("set in_place", caught.exception.message)

    def test_the_server_takes_cuda_ipc_for_this_device(self):
        info = self.client.info()
        self.assertTrue(info["cuda_ipc"]["enabled"])
        self.assertTrue(self.client.takes_cuda_ipc(0))

    def test_a_pointer_that_is_not_device_memory_is_invalid_argument_naming_it(self):
        x, dy, gamma, _, _ = random_case(2, 64, np.float32, 4)
        x_ptr, dy_ptr, dx_ptr = self.place(x, dy)
        host = np.zeros(2 * 64, dtype=np.float32)
        with self.assertRaises(normgrad.InvalidArgumentError) as caught:
            self.client.backward_device(x_ptr, host.ctypes.data, dx_ptr, gamma, num_rows=2,
                                        hidden_dim=64)
        message = caught.exception.message
        self.assertIn("dy_ptr: cuMemGetAddressRange(0x", message)
        self.assertIn(f"{host.ctypes.data:x}", message)
        # The server is not involved, and the Client keeps working.
        self.check("f32", np.float32, rows=2, hidden=64, seed=5)

    def test_a_thread_without_the_context_current_gets_the_drivers_error(self):
        x, dy, gamma, _, _ = random_case(2, 64, np.float32, 10)
        x_ptr, dy_ptr, dx_ptr = self.place(x, dy)
        caught = []

        def call():  # a new thread: no CUDA context current on it
            try:
                self.client.backward_device(x_ptr, dy_ptr, dx_ptr, gamma, num_rows=2,
                                            hidden_dim=64)
            except normgrad.Error as e:
                caught.append(e)
        thread = threading.Thread(target=call)
        thread.start()
        thread.join()
        self.assertEqual(len(caught), 1)
        self.assertIsInstance(caught[0], normgrad.InvalidArgumentError)
        self.assertIn("x_ptr: cuMemGetAddressRange(0x", caught[0].message)
        self.assertIn("CUDA_ERROR_INVALID_CONTEXT", caught[0].message)

    def test_a_range_past_the_allocation_is_refused_by_the_server_naming_the_field(self):
        x, dy, gamma, _, _ = random_case(4, 64, np.float32, 6)
        x_ptr, dy_ptr, _ = self.place(x, dy)
        dx_ptr = self.device.alloc(x.nbytes)
        with self.assertRaises(normgrad.InvalidArgumentError) as caught:
            # 5 rows where dx's allocation holds 4
            self.client.backward_device(x_ptr, dy_ptr, dx_ptr, gamma[:64], num_rows=5,
                                        hidden_dim=64)
        self.assertIn("cuda_ipc.grad_input.offset is 0 with 1280 bytes to access, past the end "
                      "of the 1024-byte region", caught.exception.message)

    def test_host_side_argument_checks(self):
        gamma = np.ones(64, dtype=np.float32)
        with self.assertRaisesRegex(ValueError, "num_rows = 0"):
            self.client.backward_device(1, 2, 3, gamma, num_rows=0, hidden_dim=64)
        with self.assertRaisesRegex(TypeError, "x_ptr: expected a device pointer"):
            self.client.backward_device("x", 2, 3, gamma, num_rows=1, hidden_dim=64)
        with self.assertRaisesRegex(ValueError, r"gamma: shape \(64,\), expected \(32,\)"):
            self.client.backward_device(1, 2, 3, gamma, num_rows=1, hidden_dim=32)
        with self.assertRaisesRegex(TypeError, "gamma: numpy dtype float32 does not hold dtype "
                                               "'f16'"):
            self.client.backward_device(1, 2, 3, gamma, num_rows=1, hidden_dim=64, dtype="f16")
        with self.assertRaisesRegex(ValueError, "dtype 'f64' is not one of"):
            self.client.backward_device(1, 2, 3, gamma, num_rows=1, hidden_dim=64, dtype="f64")


@skip_without_emulated_cuda
class CudaIpcOffTest(EmulatedCudaServerTest):
    """A CUDA-backend server started without --cuda-ipc."""

    def test_backward_device_is_failed_precondition_naming_the_flag(self):
        message = self.refused_backward_device(seed=7)
        self.assertIn("takes no CUDA IPC", message)
        self.assertIn("--cuda-ipc", message)

    def test_the_client_sees_that_it_takes_none(self):
        # GetServerInfo leaves cuda_ipc unset (so out of the JSON) when it is off.
        self.assertFalse(self.client.info().get("cuda_ipc", {}).get("enabled", False))
        self.assertFalse(self.client.takes_cuda_ipc(0))


@skip_without_emulated_cuda
class CudaIpcOtherGpuTest(EmulatedCudaServerTest):
    """A server with --cuda-ipc on another (emulated) GPU than this process's device 0."""

    SERVER_FLAGS = ["--cuda-ipc"]
    SERVER_ENVIRONMENT = {"NORMGRAD_EMULATED_DEVICE_UUID": "0123456789abcdef0123456789abcdef"}

    def test_the_client_sees_that_it_takes_none_for_this_device(self):
        self.assertTrue(self.client.info()["cuda_ipc"]["enabled"])
        self.assertFalse(self.client.takes_cuda_ipc(0))

    def test_backward_device_is_failed_precondition_naming_both_gpus(self):
        self.assertIn("is not this server's GPU (0123456789abcdef",
                      self.refused_backward_device(seed=8))


class CudaRouteTest(unittest.TestCase):
    """How Client.backward sends torch CUDA tensors, decided without a GPU."""

    def test_auto_uses_cuda_ipc_when_the_server_takes_it_else_the_host(self):
        self.assertEqual(normgrad._device_route("auto", True, "t"), "cuda_ipc")
        self.assertEqual(normgrad._device_route("auto", False, "t"), "host")

    def test_host_transports_copy_through_the_host(self):
        for transport in ("bytes", "shm"):
            self.assertEqual(normgrad._device_route(transport, True, "t"), "host")

    def test_cuda_ipc_without_a_server_that_takes_it_is_failed_precondition(self):
        self.assertEqual(normgrad._device_route("cuda_ipc", True, "t"), "cuda_ipc")
        with self.assertRaises(normgrad.FailedPreconditionError) as caught:
            normgrad._device_route("cuda_ipc", False, "127.0.0.1:1")
        self.assertIn('transport "cuda_ipc": the server at 127.0.0.1:1 takes no CUDA IPC',
                      caught.exception.message)
        self.assertIn("--cuda-ipc", caught.exception.message)

    def test_cuda_ipc_is_a_transport_and_takes_no_host_arrays(self):
        self.assertIn("cuda_ipc", normgrad.TRANSPORTS)
        client = normgrad.Client("127.0.0.1:1", transport="cuda_ipc")  # connects at a call
        x = np.ones((2, 8), dtype=np.float32)
        with self.assertRaisesRegex(ValueError, 'x: transport "cuda_ipc" takes torch CUDA '
                                                'tensors .* got a host ndarray'):
            client.backward(x, x, np.ones(8, dtype=np.float32))
        if torch is not None:
            t = torch.ones(2, 8)
            with self.assertRaisesRegex(ValueError, "got a host Tensor"):
                client.backward(t, t, torch.ones(8))

    def test_backward_device_needs_a_transport_that_takes_device_memory(self):
        client = normgrad.Client("127.0.0.1:1", transport="bytes")
        with self.assertRaisesRegex(ValueError, "backward_device needs \"auto\" or \"cuda_ipc\""):
            client.backward_device(1, 2, 3, np.ones(8, dtype=np.float32), num_rows=1,
                                   hidden_dim=8)


if __name__ == "__main__":
    unittest.main()
