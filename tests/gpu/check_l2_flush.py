#!/usr/bin/env python3
"""normgrad-gpu-bench flushes L2 before every timed run: runs the benchmark at --smoke shapes over
stream_trace_driver (which forwards to another driver library and writes the stream work), then
checks, from the trace, that every timed run (the start event of a cuEventElapsedTime pair up to
its stop event, with at least one launch between) is preceded, on the same stream and after the
previous run, by a memset of at least twice the L2 size bench.json reports.

    check_l2_flush.py --bench BIN --trace-driver LIB --inner-driver LIB --out-dir DIR [args...]

Extra arguments go to the benchmark. Exit 0 when it holds, 1 with the first run that breaks it.
"""
import argparse
import json
import os
import subprocess
import sys


def fail(message):
    print(f"check_l2_flush: {message}", file=sys.stderr)
    sys.exit(1)


def check(trace_lines, l2_bytes):
    """The number of timed runs when each follows a flush; else raises ValueError naming one."""
    calls = [line.split() for line in trace_lines if line.strip()]
    starts = {c[1] for c in calls if c[0] == "elapsed"}
    stops = {c[2] for c in calls if c[0] == "elapsed"}
    if not starts:
        raise ValueError("no timed run in the trace (no cuEventElapsedTime)")
    flushed_on = None  # the stream of the last flush since the previous timed run
    run = None         # (index, stream, launches) of the timed run in progress
    runs = 0
    for n, c in enumerate(calls, 1):
        if c[0] == "memset" and int(c[1]) >= 2 * l2_bytes and run is None:
            flushed_on = c[2]
        elif c[0] == "launch" and run is not None:
            run[2] += 1
        elif c[0] == "record" and c[1] in starts and run is None:
            runs += 1
            if flushed_on != c[2]:
                raise ValueError(
                    f"timed run {runs} (trace line {n}) starts with no memset of >= "
                    f"{2 * l2_bytes} bytes on its stream {c[2]} since the previous run "
                    f"(last flush on {flushed_on})")
            flushed_on = None
            run = [runs, c[2], 0]
        elif c[0] == "record" and c[1] in stops and run is not None:
            if run[2] == 0:
                raise ValueError(f"timed run {run[0]} launched nothing")
            run = None
    return runs


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bench", required=True)
    parser.add_argument("--trace-driver", required=True)
    parser.add_argument("--inner-driver", required=True)
    parser.add_argument("--out-dir", required=True)
    args, bench_args = parser.parse_known_args()
    os.makedirs(args.out_dir, exist_ok=True)
    trace_path = os.path.join(args.out_dir, "stream_trace.txt")
    json_path = os.path.join(args.out_dir, "bench_traced.json")
    env = dict(os.environ, NORMGRAD_CUDA_DRIVER=args.trace_driver,
               NORMGRAD_TRACE_INNER_DRIVER=args.inner_driver, NORMGRAD_TRACE_FILE=trace_path)
    p = subprocess.run([args.bench, "--smoke", "--json", json_path, *bench_args], env=env,
                       capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        fail(f"{args.bench} exited {p.returncode}: {p.stderr.strip()[-2000:]}")
    with open(json_path) as f:
        bench = json.load(f)
    l2 = int(bench["l2_cache_bytes"])
    if l2 <= 0 or bench.get("l2_policy") != "flush" or int(bench["l2_flush_bytes"]) < 2 * l2:
        fail(f"bench.json says l2_cache_bytes {l2}, l2_policy {bench.get('l2_policy')}, "
             f"l2_flush_bytes {bench.get('l2_flush_bytes')}: expected a flush of >= {2 * l2}")
    with open(trace_path) as f:
        lines = f.readlines()
    try:
        runs = check(lines, l2)
    except ValueError as e:
        fail(str(e))
    print(f"check_l2_flush: {runs} timed runs, each after a flush of >= {2 * l2} bytes")


if __name__ == "__main__":
    main()
