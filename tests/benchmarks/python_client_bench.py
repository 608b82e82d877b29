#!/usr/bin/env python3
"""The Python client against the C++ one, in the same run on the same server (docs/python.md).

    PYTHONPATH=build/python /usr/bin/python3 tests/benchmarks/python_client_bench.py [--build-dir build]

Starts build/bin/normgrad-server (CPU backend, loopback, port 0) unless --target is given, then:
1. Throughput on a 4096 x 4096 f32 batch (64 MiB of x): client.backward through Python against
   the `normgrad backward` CLI on the same tensors in .npy files (each CLI run is a process:
   start, read the files, the call), and against normgrad-load (the C++ library in-process, the
   call alone). Prints the ratios; the target is >= 0.9 of the CLI.
2. Latency of a 1 x 896 call, one at a time: p50 of client.backward against normgrad-load's p50
   with --concurrency=1 (the C++ client); the difference is the Python layer's overhead.
A benchmark, not a test: it asserts nothing.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))


def find_latency(report):
    """latency_ms of normgrad-load's JSON report (wherever the run sits in it)."""
    if isinstance(report, dict):
        if "latency_ms" in report:
            return report["latency_ms"]
        values = report.values()
    elif isinstance(report, list):
        values = report
    else:
        return None
    for value in values:
        found = find_latency(value)
        if found is not None:
            return found
    return None


def run_load(load, target, shape, total, warmup):
    out = subprocess.run([load, f"--target={target}", "--concurrency=1", f"--total={total}",
                          f"--warmup={warmup}", f"--shapes={shape}", "--format=json",
                          "--deadline=120s"], check=True, capture_output=True, text=True).stdout
    return find_latency(json.loads(out))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--build-dir", default=os.path.join(ROOT, "build"))
    parser.add_argument("--target", help="an already running server (default: start one)")
    parser.add_argument("--repeats", type=int, default=5, help="4096x4096 calls per client")
    parser.add_argument("--small-calls", type=int, default=2000, help="1x896 calls per client")
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(args.build_dir, "python"))
    import normgrad
    binaries = os.path.join(args.build_dir, "bin")
    cli, load = os.path.join(binaries, "normgrad"), os.path.join(binaries, "normgrad-load")

    server = None
    target = args.target
    if target is None:
        os.environ.setdefault("NORMGRAD_SERVER", os.path.join(binaries, "normgrad-server"))
        from server_process import ServerProcess
        server = ServerProcess("cpu", ["--cpu-threads=0", "--worker-threads=0"])
        target = server.address
        print(server.ready_line)
    try:
        client = normgrad.Client(target, deadline=120)
        rows, hidden = 4096, 4096
        rng = np.random.default_rng(1)
        x = rng.uniform(-2, 2, (rows, hidden)).astype(np.float32)
        dy = rng.uniform(-2, 2, (rows, hidden)).astype(np.float32)
        gamma = (1 + rng.uniform(-0.25, 0.25, hidden)).astype(np.float32)

        python_s, cli_s, load_s = [], [], []
        with tempfile.TemporaryDirectory() as d:
            paths = []
            for name, array in (("x", x), ("dy", dy), ("gamma", gamma)):
                np.save(os.path.join(d, f"{name}.npy"), array)
                paths += [f"--{name}", os.path.join(d, f"{name}.npy")]
            command = [cli, f"--target={target}", "--deadline=120s", "backward", *paths,
                       "--dx", os.path.join(d, "dx.npy")]
            client.backward(x, dy, gamma)  # warm-up: connection, server buffers
            subprocess.run(command, check=True, capture_output=True)
            # Interleaved, so that a busy machine slows all three alike.
            for _ in range(args.repeats):
                start = time.perf_counter()
                client.backward(x, dy, gamma)
                python_s.append(time.perf_counter() - start)
                start = time.perf_counter()
                subprocess.run(command, check=True, capture_output=True)
                cli_s.append(time.perf_counter() - start)
                load_s.append(run_load(load, target, f"{rows}x{hidden}", 1, 1)["p50"] / 1e3)

        def rate(seconds):
            return rows / seconds

        for label, pick in (("median", statistics.median), ("best", min)):
            py, c, lib = (pick(v) for v in (python_s, cli_s, load_s))
            print(f"4096x4096 f32, {label} of {args.repeats}:")
            print(f"  python client.backward   {py * 1e3:8.1f} ms  {rate(py):9.0f} rows/s")
            print(f"  normgrad CLI (process)   {c * 1e3:8.1f} ms  {rate(c):9.0f} rows/s")
            print(f"  C++ client (load)        {lib * 1e3:8.1f} ms  {rate(lib):9.0f} rows/s")
            print(f"  ratio python / CLI        {c / py:.2f}  (target >= 0.9)")
            print(f"  ratio python / C++ client {lib / py:.2f}")

        x1, dy1, g1 = x[:1, :896].copy(), dy[:1, :896].copy(), gamma[:896].copy()
        for _ in range(100):
            client.backward(x1, dy1, g1)
        small = []
        for _ in range(args.small_calls):
            start = time.perf_counter()
            client.backward(x1, dy1, g1)
            small.append(time.perf_counter() - start)
        load_small = run_load(load, target, "1x896", args.small_calls, 100)
        p50_py, p50_cpp = statistics.median(small) * 1e3, load_small["p50"]
        print(f"1x896 f32, one call at a time, {args.small_calls} calls:")
        print(f"  python p50 {p50_py:.3f} ms, C++ client p50 {p50_cpp:.3f} ms, "
              f"Python overhead {(p50_py - p50_cpp) * 1e3:+.0f} us")
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
