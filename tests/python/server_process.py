"""A normgrad-server process for the Python package's tests: 127.0.0.1:0, no metrics port,
the CPU backend or the CUDA backend over the emulated driver (docs/ptxsim.md).

ctest passes the binaries in the environment: NORMGRAD_SERVER (normgrad-server),
NORMGRAD_CLI (normgrad), NORMGRAD_EMULATED_CUDA (libnormgrad_emulated_cuda.so, when built),
and PYTHONPATH=build/python.
"""

import ctypes
import os
import re
import signal
import subprocess
import tempfile
import threading
import socket
import unittest


def emulated_cuda_driver():
    return os.environ.get("NORMGRAD_EMULATED_CUDA", "")


def skip_without_emulated_cuda(test):
    return unittest.skipUnless(emulated_cuda_driver(),
                               "no emulated CUDA driver in this build")(test)


def _die_with_parent():
    # PR_SET_PDEATHSIG: the server is killed when the test process ends in any way (a ctest
    # timeout included), so no server outlives its test.
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


class ServerProcess:
    """Starts normgrad-server and waits for its ready line; stop() ends it (SIGKILL)."""

    def __init__(self, backend="cpu", flags=()):
        command = [os.environ["NORMGRAD_SERVER"], "--listen=127.0.0.1:0", "--metrics-listen=",
                   "--cpu-threads=2", "--worker-threads=2", f"--backend={backend}"]
        if backend == "cuda":
            command.append(f"--cuda-driver={emulated_cuda_driver()}")
        command.extend(flags)
        self.stderr = tempfile.TemporaryFile()
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self.stderr,
                                        text=True, preexec_fn=_die_with_parent)
        ready = self._ready_line(timeout=60)
        match = re.search(r"grpc=([0-9.]+:[0-9]+)", ready or "")
        if not match:
            self.stop()
            self.stderr.seek(0)
            raise RuntimeError(f"normgrad-server did not start ({command}): "
                               f"{self.stderr.read().decode(errors='replace')}")
        self.address = match.group(1)
        self.ready_line = ready

    def _ready_line(self, timeout):
        found = []

        def read():
            for line in self.process.stdout:
                if line.startswith("normgrad-server ready"):
                    found.append(line.strip())
                    return
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout)
        return found[0] if found else None

    def stop(self):
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.process.stdout.close()
        self.stderr.close()


class SharedMemoryServer(ServerProcess):
    """A server on a unix socket in a temporary directory, with --shared-memory: .target is
    the unix: target for transport "shm" (the client stages tensors in a region of its own)."""

    def __init__(self, backend="cpu", flags=()):
        self.directory = tempfile.TemporaryDirectory()
        socket_path = os.path.join(self.directory.name, "grpc.sock")
        self.target = f"unix:{socket_path}"
        super().__init__(backend, [f"--listen={self.target}", "--shared-memory", *flags])

    def stop(self):
        super().stop()
        self.directory.cleanup()


class CpuServerFixture:
    """A unittest.TestCase mixin: one CPU-backend server for the class, cls.server, and a
    Client of it, cls.client."""

    @classmethod
    def setUpClass(cls):
        import normgrad
        cls.server = ServerProcess("cpu")
        cls.client = normgrad.Client(cls.server.address, deadline=120)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.stop()


def dead_address():
    """A loopback address with nothing listening (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"
