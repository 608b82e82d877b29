#!/usr/bin/env python3
"""PyTorch's RMSNorm backward on the shapes normgrad-gpu-bench measured, as ratios.

    torch_rmsnorm_bench.py --kernels-json bench.json --out summary.json [--iters N]
                           [--allow-cpu] [--no-torch]

For each (dtype, rows, hidden) in bench.json: the backward of a hand-written RMSNorm
(y = x * rsqrt(mean(x^2) + eps) * gamma, autograd for dx and dgamma with dy given), eager and,
when it compiles, torch.compile'd; median of N timed runs (CUDA events on a GPU, wall clock on
the CPU with --allow-cpu). Prints one table and writes summary.json: the benchmark's rows plus
torch_eager_ms, torch_compile_ms (null when unavailable) and speedup_vs_torch_* =
torch time / row-resident time (> 1: normgrad faster). --no-torch writes the summary without
PyTorch columns. Exit 1 with one line on stderr when the input is unusable.
"""
import argparse
import json
import statistics
import sys
import time


def fail(message):
    print(f"torch_rmsnorm_bench: {message}", file=sys.stderr)
    sys.exit(1)


def rmsnorm(x, gamma, eps):
    x32 = x.float()
    inv = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (x32 * inv * gamma.float()).to(x.dtype)


def time_backward(fn, x, gamma, dy, iters, device):
    """Median ms of the backward pass only (the forward runs outside the timed region)."""
    samples = []
    for i in range(iters + 1):
        xr = x.detach().requires_grad_(True)
        gr = gamma.detach().requires_grad_(True)
        y = fn(xr, gr, 1e-5)
        if device == "cuda":
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            stop = torch.cuda.Event(enable_timing=True)
            start.record()
            y.backward(dy)
            stop.record()
            stop.synchronize()
            ms = start.elapsed_time(stop)
        else:
            t0 = time.perf_counter()
            y.backward(dy)
            ms = (time.perf_counter() - t0) * 1e3
        if i > 0:  # the first run warms up (and compiles)
            samples.append(ms)
    return statistics.median(samples)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--kernels-json", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--allow-cpu", action="store_true")
    parser.add_argument("--no-torch", action="store_true")
    args = parser.parse_args()
    if args.iters < 1:
        fail("--iters must be at least 1")
    try:
        with open(args.kernels_json) as f:
            bench = json.load(f)
        results = bench["results"]
    except (OSError, ValueError, KeyError) as e:
        fail(f"cannot read {args.kernels_json}: {e}")

    device = None
    compiled = None
    if not args.no_torch:
        global torch
        import torch  # noqa: PLC0415 (only where PyTorch is installed)
        if torch.cuda.is_available():
            device = "cuda"
        elif args.allow_cpu:
            device = "cpu"
        else:
            fail("torch has no CUDA device (use --allow-cpu only for a smoke run)")
        try:
            compiled = torch.compile(rmsnorm)
            x = torch.randn(4, 64, device=device, requires_grad=True)
            compiled(x, torch.ones(64, device=device, requires_grad=True), 1e-5).sum().backward()
        except Exception as e:  # torch.compile is optional: missing compiler, old torch, ...
            print(f"torch.compile unavailable: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            compiled = None
        iters = min(args.iters, 3) if device == "cpu" else args.iters

    dtypes = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}
    rows_out = []
    header = (f"{'dtype':5} {'rows x hidden':>14} {'normgrad ms':>12} {'torch ms':>10} "
              f"{'speedup':>8} {'compile ms':>11} {'speedup':>8} {'of copy':>8}")
    print(f"device: {bench.get('device')} ({bench.get('target')}); torch on {device or 'none'}")
    print(header)
    for r in results:
        entry = dict(r)
        eager_ms = compile_ms = None
        if device is not None:
            dt = getattr(torch, dtypes[r["dtype"]])
            g = torch.Generator(device="cpu").manual_seed(0)
            x = torch.randn(r["rows"], r["hidden"], generator=g).to(device=device, dtype=dt)
            dy = torch.randn(r["rows"], r["hidden"], generator=g).to(device=device, dtype=dt)
            gamma = (torch.rand(r["hidden"], generator=g) + 0.5).to(device=device, dtype=dt)
            eager_ms = time_backward(rmsnorm, x, gamma, dy, iters, device)
            if compiled is not None:
                try:
                    compile_ms = time_backward(compiled, x, gamma, dy, iters, device)
                except Exception as e:
                    print(f"torch.compile failed at {r['rows']}x{r['hidden']}: {type(e).__name__}")
        ours = r["row_resident_ms"]
        entry["torch_device"] = device
        entry["torch_eager_ms"] = eager_ms
        entry["torch_compile_ms"] = compile_ms
        entry["speedup_vs_torch_eager"] = eager_ms / ours if eager_ms and ours > 0 else None
        entry["speedup_vs_torch_compile"] = compile_ms / ours if compile_ms and ours > 0 else None
        rows_out.append(entry)

        def fmt(v, spec):
            return format(v, spec) if v is not None else "-"

        print(f"{r['dtype']:5} {str(r['rows']) + 'x' + str(r['hidden']):>14} {ours:12.4f} "
              f"{fmt(eager_ms, '10.4f'):>10} {fmt(entry['speedup_vs_torch_eager'], '8.2f'):>8} "
              f"{fmt(compile_ms, '11.4f'):>11} {fmt(entry['speedup_vs_torch_compile'], '8.2f'):>8} "
              f"{r['row_resident_of_copy']:8.3f}")
    summary = dict(bench)
    summary["results"] = rows_out
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
