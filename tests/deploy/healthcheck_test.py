#!/usr/bin/python3
"""Runs the Dockerfile's HEALTHCHECK command, as written there, against real servers.

Usage: healthcheck_test.py REPO_ROOT NORMGRAD_SERVER_BINARY NORMGRAD_CLI_BINARY
Checks: with NORMGRAD_HEALTH_ARGS unset the probe is `normgrad health` on the port of the
Dockerfile's --listen; with it set, a TLS server is SERVING through its plaintext --health-listen
port and over TLS with --tls-ca, and a plaintext probe of the TLS port fails (exit status not 0).
No container engine is needed: the command runs under sh as Docker would run it.
"""
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

ROOT = sys.argv[1] if len(sys.argv) > 1 else "."
SERVER = sys.argv[2] if len(sys.argv) > 2 else "build/bin/normgrad-server"
CLI = sys.argv[3] if len(sys.argv) > 3 else "build/bin/normgrad"


def dockerfile():
    with open(f"{ROOT}/Dockerfile") as f:
        return f.read()


def healthcheck_argv():
    m = re.search(r"^HEALTHCHECK .*\\\n\s*CMD (\[.+\])$", dockerfile(), re.M)
    assert m, "Dockerfile: no HEALTHCHECK ... CMD [...] (exec form)"
    return json.loads(m.group(1))


def run_probe(bin_dir, health_args=None):
    env = {k: v for k, v in os.environ.items() if k != "NORMGRAD_HEALTH_ARGS"}
    env["PATH"] = f"{bin_dir}:{env.get('PATH', '/usr/bin:/bin')}"
    if health_args is not None:
        env["NORMGRAD_HEALTH_ARGS"] = health_args
    return subprocess.run(healthcheck_argv(), env=env, capture_output=True, text=True, timeout=60)


class Server:
    """normgrad-server on loopback with TLS and a plaintext health port; ports from its ready line."""

    def __init__(self, cert, key):
        self.proc = subprocess.Popen(
            [SERVER, "--listen=127.0.0.1:0", "--metrics-listen=", "--backend=cpu",
             f"--tls-cert={cert}", f"--tls-key={key}", "--health-listen=127.0.0.1:0"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = self._ready_line(60)
        self.grpc_port = int(re.search(r" grpc=127\.0\.0\.1:(\d+)", line).group(1))
        self.health_port = int(re.search(r" health=127\.0\.0\.1:(\d+)", line).group(1))

    def _ready_line(self, seconds):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            ready, _, _ = select.select([self.proc.stdout], [], [], 1.0)
            if ready:
                line = self.proc.stdout.readline()
                if line.startswith("normgrad-server ready "):
                    return line
                if not line:
                    break
        self.stop()
        raise AssertionError(f"normgrad-server printed no ready line within {seconds} s")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class HealthcheckTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="normgrad-healthcheck-")
        cls.cert = os.path.join(cls.dir, "server.pem")
        cls.key = os.path.join(cls.dir, "server.key")
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", cls.key,
             "-out", cls.cert, "-days", "2", "-subj", "/CN=localhost",
             "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
            check=True, capture_output=True)
        cls.bin_dir = os.path.join(cls.dir, "bin")
        os.mkdir(cls.bin_dir)
        os.symlink(os.path.abspath(CLI), os.path.join(cls.bin_dir, "normgrad"))
        cls.server = Server(cls.cert, cls.key)

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()
        shutil.rmtree(cls.dir, ignore_errors=True)

    def test_default_probe_targets_the_dockerfile_listen_port(self):
        # A stand-in `normgrad` that prints its arguments: the default must not need port 50051
        # free on the test machine to be checked.
        fake_dir = os.path.join(self.dir, "fake")
        os.makedirs(fake_dir, exist_ok=True)
        fake = os.path.join(fake_dir, "normgrad")
        with open(fake, "w") as f:
            f.write('#!/bin/sh\necho "$@"\n')
        os.chmod(fake, 0o755)
        listen = re.search(r'"--listen=[^":]*:(\d+)"', dockerfile()).group(1)
        out = run_probe(fake_dir)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(out.stdout.split(), ["health", f"--target=127.0.0.1:{listen}"])

    def test_tls_server_is_serving_through_its_health_port(self):
        out = run_probe(self.bin_dir, f"--target=127.0.0.1:{self.server.health_port}")
        self.assertEqual((out.returncode, out.stdout.strip()), (0, "SERVING"), out.stderr)

    def test_tls_server_is_serving_over_tls_with_the_ca(self):
        # An IP target and the certificate's name: no name lookup. Resolving "localhost", the
        # c-ares library gRPC uses leaks 10 bytes (ares_gethostbyname), which fails the asan stage.
        out = run_probe(self.bin_dir, f"--target=127.0.0.1:{self.server.grpc_port} "
                        f"--tls-ca {self.cert} --tls-server-name localhost")
        self.assertEqual((out.returncode, out.stdout.strip()), (0, "SERVING"), out.stderr)

    def test_plaintext_probe_of_the_tls_port_fails(self):
        out = run_probe(self.bin_dir, f"--target=127.0.0.1:{self.server.grpc_port}")
        self.assertNotEqual(out.returncode, 0, out.stdout)
        self.assertIn("UNAVAILABLE", out.stderr)


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], "-v"])
