"""A call interrupted (Ctrl-C) while the server computes in the client's shared-memory staging
region must not let the server's late writes land in the next call's memory: the next, larger
call over the same Client returns OK only with the right gradient. Interrupts land at many
points of the first call (before, during and after its chunks); every OK result of the next call
is checked against a float64 reference."""

import os
import signal
import tempfile
import threading
import time
import unittest

import numpy as np

import normgrad
from server_process import ServerProcess


def reference(x, dy, gamma, eps):
    x64, dy64, g64 = (a.astype(np.float64) for a in (x, dy, gamma))
    rms = np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + eps)
    xhat = x64 / rms
    gdy = dy64 * g64
    dx = (gdy - xhat * np.mean(gdy * xhat, axis=1, keepdims=True)) / rms
    return dx, np.sum(dy64 * xhat, axis=0)


def batch(rows, hidden, seed):
    rng = np.random.default_rng(seed)
    return (rng.uniform(-2, 2, (rows, hidden)).astype(np.float32),
            rng.uniform(-2, 2, (rows, hidden)).astype(np.float32),
            rng.uniform(0.5, 1.5, hidden).astype(np.float32))


class InterruptedShmCallTest(unittest.TestCase):
    def test_the_next_call_after_an_interrupted_one_is_right_or_fails(self):
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        self.addCleanup(signal.signal, signal.SIGINT, previous)
        directory = tempfile.mkdtemp(prefix="normgrad-integrity-")
        socket_path = os.path.join(directory, "grpc.sock")
        server = ServerProcess("cpu", [f"--listen=unix:{socket_path}", "--shared-memory"])
        self.addCleanup(server.stop)
        client = normgrad.Client(f"unix:{socket_path}", transport="shm", deadline=60,
                                 max_attempts=1)
        first = batch(3200, 4096, 1)
        second = batch(5120, 4096, 2)
        want_dx, want_dgamma = reference(*second, 1e-5)
        interrupted = oks = 0
        for trial in range(8):
            delay = 0.002 + 0.012 * trial  # from before the first chunk to after the last
            timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))
            try:
                timer.start()
                client.backward(*first, eps=1e-5)
                time.sleep(delay + 0.2)  # a signal that came after the call lands here
            except KeyboardInterrupt:
                interrupted += 1
            finally:
                timer.join()
            try:
                dx, dgamma = client.backward(*second, eps=1e-5)
            except normgrad.Error:
                continue  # failing is allowed; a wrong OK is not
            oks += 1
            bad_rows = np.sum(np.any(np.abs(dx - want_dx) > 1e-3 * (1 + np.abs(want_dx)), axis=1))
            self.assertEqual(bad_rows, 0, f"trial {trial}: OK with {bad_rows} wrong rows of dx")
            np.testing.assert_allclose(dgamma, want_dgamma, rtol=1e-4, atol=1e-2,
                                       err_msg=f"trial {trial}: OK with a wrong grad_gamma")
        print(f"integrity: {interrupted} of 8 first calls interrupted, {oks} next calls OK, all "
              "right", flush=True)
        self.assertGreater(interrupted, 0, "no call was interrupted: the test proved nothing")
        self.assertGreater(oks, 0)


if __name__ == "__main__":
    unittest.main()
