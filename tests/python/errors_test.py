"""Every failure reaches Python as normgrad.Error (the subclass of its gRPC code) with the
server's message unchanged (compared with what the C++ CLI prints for the same request); a dead
server is UNAVAILABLE after the client's retries; a deadline is DEADLINE_EXCEEDED; Ctrl-C
cancels a call in progress; arguments Python can judge are ValueError/TypeError."""

import os
import signal
import subprocess
import tempfile
import threading
import time
import unittest

import numpy as np

import normgrad
from server_process import ServerProcess, dead_address, skip_without_emulated_cuda


def batch(rows, hidden, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return (rng.uniform(-2, 2, (rows, hidden)).astype(dtype),
            rng.uniform(-2, 2, (rows, hidden)).astype(dtype),
            np.ones(hidden, dtype=dtype))


def cli_error(address, x, dy, gamma, *flags, before=()):
    """What `normgrad backward` prints for the same request: (CODE, message)."""
    with tempfile.TemporaryDirectory() as directory:
        paths = []
        for name, array in (("x", x), ("dy", dy), ("gamma", gamma)):
            path = os.path.join(directory, f"{name}.npy")
            np.save(path, array)
            paths += [f"--{name}", path]
        run = subprocess.run([os.environ["NORMGRAD_CLI"], f"--target={address}", *before,
                              "backward", *paths, *flags], capture_output=True, text=True,
                             timeout=60)
    line = run.stderr.strip().splitlines()[-1]
    assert run.returncode == 1 and line.startswith("error: "), (run.returncode, run.stderr)
    code, message = line[len("error: "):].split(": ", 1)
    return code, message


class ServerErrorsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = ServerProcess("cpu", ["--max-hidden-dim=64",
                                           "--nvjitlink=/nonexistent/libnvJitLink.so"])
        cls.addClassCleanup(cls.server.stop)  # also when the rest of setUpClass fails
        cls.client = normgrad.Client(cls.server.address, deadline=30)
        # A token needs TLS on the server: a self-signed certificate for 127.0.0.1.
        cls.secrets = tempfile.TemporaryDirectory()
        d = cls.secrets.name
        cls.cert, key, token = (os.path.join(d, n) for n in ("cert.pem", "key.pem", "token"))
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                        "-keyout", key, "-out", cls.cert, "-subj", "/CN=localhost",
                        "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                       check=True, capture_output=True)
        with open(token, "w") as f:
            f.write("s3cret-token\n")
        cls.secured = ServerProcess("cpu", [f"--auth-token-file={token}",
                                            f"--tls-cert={cls.cert}", f"--tls-key={key}"])
        cls.addClassCleanup(cls.secured.stop)
        with open(cls.cert) as f:
            cls.tls = normgrad.Tls(root_certs=f.read())

    @classmethod
    def tearDownClass(cls):
        cls.secrets.cleanup()

    def assert_error(self, call, code, cls):
        with self.assertRaises(normgrad.Error) as raised:
            call()
        error = raised.exception
        self.assertIsInstance(error, cls)
        self.assertEqual(error.code, code)
        self.assertEqual(str(error), f"{code}: {error.message}")
        return error

    def assert_cli_says_the_same(self, x, dy, gamma, cli_flags, **backward_kwargs):
        """backward's INVALID_ARGUMENT is the one the CLI reports for `cli_flags`."""
        error = self.assert_error(lambda: self.client.backward(x, dy, gamma, **backward_kwargs),
                                  "INVALID_ARGUMENT", normgrad.InvalidArgumentError)
        self.assertEqual((error.code, error.message),
                         cli_error(self.server.address, x, dy, gamma, *cli_flags))
        return error

    def test_invalid_eps_is_the_servers_message(self):
        x, dy, gamma = batch(3, 8)
        error = self.assert_cli_says_the_same(x, dy, gamma, ["--eps", "0"], eps=0.0)
        self.assertIn("header.eps is 0", error.message)

    def test_unknown_kernel_is_the_servers_message(self):
        x, dy, gamma = batch(3, 8)
        error = self.assert_cli_says_the_same(x, dy, gamma, ["--kernel", "fast_one"],
                                              kernel="fast_one")
        self.assertIn('"fast_one" is unknown', error.message)

    def test_kernel_that_cannot_run_the_shape(self):
        x, dy, gamma = batch(2, 33)
        error = self.assert_error(
            lambda: self.client.backward(x, dy, gamma, kernel="rms_norm_backward"),
            "INVALID_ARGUMENT", normgrad.InvalidArgumentError)
        self.assertIn('"rms_norm_backward" cannot run this batch', error.message)

    def test_bad_rms_value_names_the_row(self):
        x, dy, gamma = batch(3, 8)
        rms = np.array([1.0, -2.0, 1.0], dtype=np.float32)
        error = self.assert_error(lambda: self.client.backward(x, dy, gamma, rms=rms),
                                  "INVALID_ARGUMENT", normgrad.InvalidArgumentError)
        self.assertIn("rms of row 1 is -2", error.message)

    def test_hidden_dim_above_the_limit_is_resource_exhausted(self):
        x, dy, gamma = batch(2, 65)
        error = self.assert_error(lambda: self.client.backward(x, dy, gamma),
                                  "RESOURCE_EXHAUSTED", normgrad.ResourceExhaustedError)
        self.assertEqual((error.code, error.message),
                         cli_error(self.server.address, x, dy, gamma))
        self.assertIn("above the server's limit of 64", error.message)

    def test_emit_ptx_errors(self):
        error = self.assert_error(
            lambda: self.client.emit_ptx("batched_rms_norm_backward", 64, target="sm_ninety"),
            "INVALID_ARGUMENT", normgrad.InvalidArgumentError)
        self.assertIn('"sm_ninety"', error.message)
        error = self.assert_error(lambda: self.client.emit_ptx("nope", 64),
                                  "INVALID_ARGUMENT", normgrad.InvalidArgumentError)
        self.assertIn('kernel "nope" is unknown', error.message)
        with self.assertRaisesRegex(ValueError, 'dtype "f64" is not f32, bf16 or f16'):
            self.client.emit_ptx("batched_rms_norm_backward", 64, dtype="f64")

    def test_cubin_without_nvjitlink_is_failed_precondition(self):
        error = self.assert_error(
            lambda: self.client.emit_ptx("batched_rms_norm_backward", 64, target="sm_90",
                                         cubin=True),
            "FAILED_PRECONDITION", normgrad.FailedPreconditionError)
        self.assertIn("nvJitLink is not available on this server", error.message)
        self.assertIn("/nonexistent/libnvJitLink.so", error.message)

    def test_shared_memory_over_tcp_is_failed_precondition(self):
        x, dy, gamma = batch(2, 8)
        client = normgrad.Client(self.server.address, transport="shm", deadline=30)
        self.assert_error(lambda: client.backward(x, dy, gamma), "FAILED_PRECONDITION",
                          normgrad.FailedPreconditionError)

    def test_unknown_health_service_is_not_found(self):
        self.assert_error(lambda: self.client.health("no.such.Service"), "NOT_FOUND",
                          normgrad.NotFoundError)

    def test_missing_or_wrong_token_is_unauthenticated(self):
        x, dy, gamma = batch(2, 8)
        for token in (None, "wrong"):
            with self.subTest(token=token):
                client = normgrad.Client(self.secured.address, token=token, tls=self.tls,
                                         deadline=30)
                error = self.assert_error(lambda: client.backward(x, dy, gamma),
                                          "UNAUTHENTICATED", normgrad.UnauthenticatedError)
                before = ["--tls", "--tls-ca", self.cert] + (["--token", token] if token else [])
                self.assertEqual((error.code, error.message),
                                 cli_error(self.secured.address, x, dy, gamma, before=before))
        client = normgrad.Client(self.secured.address, token="s3cret-token", tls=self.tls,
                                 deadline=30)
        dx, dgamma = client.backward(x, dy, gamma)
        self.assertEqual(dx.shape, x.shape)
        self.assertEqual(client.health(), "SERVING")

    def test_untrusted_server_certificate_is_unavailable(self):
        client = normgrad.Client(self.secured.address, tls=True, max_attempts=1, deadline=30)
        self.assert_error(lambda: client.health(), "UNAVAILABLE", normgrad.UnavailableError)

    def test_token_in_clear_text_to_a_remote_host_is_refused(self):
        with self.assertRaises(normgrad.InvalidArgumentError) as raised:
            normgrad.Client("192.0.2.1:50051", token="tok-SECRET-123")
        self.assertIn("bearer_token: refusing to send it in clear text", raised.exception.message)
        self.assertNotIn("SECRET", raised.exception.message)

    def test_deadline_is_deadline_exceeded(self):
        # 64 MiB of x and of dy cannot cross loopback and come back in 20 ms.
        x, dy, gamma = batch(262144, 64)
        client = normgrad.Client(self.server.address, deadline=0.02)
        self.assert_error(lambda: client.backward(x, dy, gamma), "DEADLINE_EXCEEDED",
                          normgrad.DeadlineExceededError)
        self.assertEqual(self.client.health(), "SERVING")


class ClientSideErrorsTest(unittest.TestCase):
    def test_dead_server_is_unavailable_after_the_retries(self):
        x, dy, gamma = batch(2, 8)
        address = dead_address()
        timings = {}
        for attempts in (1, 4):
            client = normgrad.Client(address, max_attempts=attempts, deadline=30)
            start = time.monotonic()
            with self.assertRaises(normgrad.UnavailableError) as raised:
                client.backward(x, dy, gamma)
            timings[attempts] = time.monotonic() - start
            self.assertEqual(raised.exception.code, "UNAVAILABLE")
            self.assertTrue(raised.exception.message)
        # Three retries wait at least 0.8 * (50 + 100 + 200) ms of backoff.
        self.assertGreaterEqual(timings[4], 0.28)
        self.assertLess(timings[1], timings[4])

    def test_unknown_transport_is_a_value_error(self):
        with self.assertRaisesRegex(ValueError, "transport 'udp' is not available.*auto, bytes, shm"):
            normgrad.Client("localhost:1", transport="udp")
        self.assertEqual(normgrad.Client("localhost:1", transport="shm").transport, "shm")

    def test_arguments_python_can_judge(self):
        client = normgrad.Client(dead_address())
        x, dy, gamma = batch(2, 8)
        with self.assertRaisesRegex(TypeError, "float64 is not supported"):
            client.backward(x.astype(np.float64), dy, gamma)
        with self.assertRaisesRegex(ValueError, "dy: shape"):
            client.backward(x, dy[:1], gamma)
        with self.assertRaisesRegex(ValueError, "gamma: shape"):
            client.backward(x, dy, gamma[:3])
        with self.assertRaisesRegex(TypeError, "share one dtype"):
            client.backward(x, dy.astype(np.float16), gamma)
        with self.assertRaisesRegex(ValueError, "rms: 3 values, expected one per row"):
            client.backward(x, dy, gamma, rms=np.ones(3, np.float32))
        with self.assertRaisesRegex(ValueError, "deadline"):
            normgrad.Client("localhost:1", deadline=0)


@skip_without_emulated_cuda
class CtrlCTest(unittest.TestCase):
    """SIGINT during a long call (the emulated driver interprets every PTX instruction) raises
    KeyboardInterrupt at once and cancels the call; the Client keeps working."""

    def test_ctrl_c_cancels_the_call(self):
        # Python's own Ctrl-C handler, also when this process was started with SIGINT ignored
        # (a background job of a non-interactive shell).
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        self.addCleanup(signal.signal, signal.SIGINT, previous)
        server = ServerProcess("cuda")
        try:
            client = normgrad.Client(server.address, deadline=600)
            # About 8 s of interpretation if it ran to the end (4 s for half the rows, measured
            # with the signal check taken out of the wait: the test then fails).
            x = dy = np.full((8192, 4096), 0.5, dtype=np.float32)
            gamma = np.ones(4096, dtype=np.float32)
            timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
            start = time.monotonic()
            timer.start()
            with self.assertRaises(KeyboardInterrupt):
                client.backward(x, dy, gamma)
            elapsed = time.monotonic() - start
            timer.join()
            self.assertLess(elapsed, 2.0)
            small = batch(2, 8)
            dx, _ = client.backward(*small)
            self.assertEqual(dx.shape, (2, 8))
        finally:
            server.stop()


if __name__ == "__main__":
    unittest.main()
