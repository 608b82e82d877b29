"""One Client shared by many threads, and many backward_async calls in flight at once: every
result is the right one (each call has its own inputs and expected gradients)."""

import concurrent.futures
import threading
import unittest

import numpy as np

import normgrad
from server_process import ServerProcess

EPS = 1e-5


def reference(x, dy, gamma):
    x, dy, gamma = (a.astype(np.float64) for a in (x, dy, gamma))
    h = x.shape[-1]
    rms = np.sqrt((x * x).mean(-1, keepdims=True) + EPS)
    xhat = x / rms
    g = dy * gamma
    return (g - xhat * (g * xhat).sum(-1, keepdims=True) / h) / rms, (dy * xhat).sum(0)


def problem(seed):
    rng = np.random.default_rng(seed)
    rows, hidden = int(rng.integers(1, 64)), int(rng.choice([7, 33, 896, 4097]))
    x = rng.uniform(-2, 2, (rows, hidden)).astype(np.float32)
    dy = rng.uniform(-2, 2, (rows, hidden)).astype(np.float32)
    gamma = (1 + rng.uniform(-0.25, 0.25, hidden)).astype(np.float32)
    return x, dy, gamma


class ConcurrencyTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = ServerProcess("cpu")
        cls.client = normgrad.Client(cls.server.address, deadline=120, async_workers=8)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.stop()

    def assert_gradients(self, seed, dx, dgamma):
        x, dy, gamma = problem(seed)
        dx_ref, dgamma_ref = reference(x, dy, gamma)
        np.testing.assert_allclose(dx, dx_ref, rtol=1e-4, atol=1e-4 * np.abs(dx_ref).max(),
                                   err_msg=f"dx of problem {seed}")
        np.testing.assert_allclose(dgamma, dgamma_ref, rtol=1e-4,
                                   atol=1e-4 * np.abs(dgamma_ref).max(),
                                   err_msg=f"dgamma of problem {seed}")

    def test_threads_share_one_client(self):
        results, errors = {}, []

        def work(first):
            try:
                for seed in range(first, first + 6):
                    results[seed] = self.client.backward(*problem(seed), eps=EPS)
            except Exception as e:  # reported below, on the test's thread
                errors.append(e)
        threads = [threading.Thread(target=work, args=(i * 100,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(errors, [])
        self.assertEqual(len(results), 48)
        for seed, (dx, dgamma) in results.items():
            self.assert_gradients(seed, dx, dgamma)

    def test_backward_async_many_in_flight(self):
        inputs = {seed: problem(seed) for seed in range(1000, 1040)}
        futures = {self.client.backward_async(*inputs[seed], eps=EPS): seed for seed in inputs}
        for future in futures:
            self.assertIsInstance(future, concurrent.futures.Future)
        done = 0
        for future in concurrent.futures.as_completed(futures, timeout=120):
            dx, dgamma = future.result()
            self.assert_gradients(futures[future], dx, dgamma)
            done += 1
        self.assertEqual(done, 40)

    def test_async_errors_arrive_through_the_future(self):
        x, dy, gamma = problem(5)
        future = self.client.backward_async(x, dy, gamma, eps=0.0)
        with self.assertRaises(normgrad.InvalidArgumentError):
            future.result(timeout=60)

    def test_threads_and_async_calls_together(self):
        futures = [self.client.backward_async(*problem(seed), eps=EPS) for seed in range(2000, 2016)]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            blocking = list(pool.map(lambda s: (s, self.client.backward(*problem(s), eps=EPS)),
                                     range(3000, 3016)))
        for seed, future in zip(range(2000, 2016), futures):
            self.assert_gradients(seed, *future.result(timeout=120))
        for seed, (dx, dgamma) in blocking:
            self.assert_gradients(seed, dx, dgamma)


if __name__ == "__main__":
    unittest.main()
