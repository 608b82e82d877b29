#!/usr/bin/env python3
"""PyTorch's RMSNorm backward on the shapes normgrad-gpu-bench measured, and the kit's verdict.

    torch_rmsnorm_bench.py --kernels-json bench.json --out summary.json [--iters N]
                           [--allow-cpu] [--no-torch]

For each (dtype, rows, hidden) in bench.json, the backward pass (dx and dgamma from a given dy;
the forward runs outside the timed region) of three PyTorch baselines, each where the installed
PyTorch has it and skipped with its reason where not:
  - eager:      a hand-written RMSNorm (y = x * rsqrt(mean(x^2) + eps) * gamma in f32), autograd;
  - compile:    the same function through torch.compile(dynamic=False), compiled afresh for each
                shape and dtype (its warm-up run compiles; Dynamo's cache is reset in between, so
                its recompile limit never turns it back into eager);
  - functional: torch.nn.functional.rms_norm (PyTorch 2.4 and newer), autograd.
Median of up to N timed runs, at least MIN_TIMED_RUNS and then only while their sum stays within
TIMED_BUDGET_MS (CUDA events on a GPU; wall clock on the CPU with --allow-cpu). On a GPU, L2 is
flushed before every run the way normgrad-gpu-bench does it: a write of bench.json's
l2_flush_bytes (twice the L2 size), not timed.

Prints one table and the targets, and writes summary.json: bench.json plus, per result,
torch_<baseline>_ms, speedup_vs_torch_<baseline> = torch ms / row-resident ms (> 1: normgrad
faster), large_shape, meets_copy_target and faster_than_torch; "baselines" ({"measured_shapes":
N} or {"skipped": why}); and "targets": the row-resident kernel at >= 90% of the copy kernel's
bandwidth on the large shapes (rows x hidden >= 4096 x 4096), and faster than every PyTorch
baseline on every shape (judged only when PyTorch ran on a GPU). --no-torch writes the summary
without PyTorch figures. Exit 1 with one line on stderr when the input is unusable.
"""
import argparse
import json
import statistics
import sys
import time

BASELINES = ("eager", "compile", "functional")
COPY_TARGET = 0.90            # row-resident bandwidth / copy bandwidth, on the large shapes
LARGE_ELEMENTS = 4096 * 4096  # rows x hidden from which a shape counts as large
# Rows wider than this are streamed (x and dy read twice): measured and compared with the
# batched kernel, not judged against the copy target, which is about rows held in registers.
HELD_HIDDEN_MAX = 16384
MIN_TIMED_RUNS = 5
TIMED_BUDGET_MS = 500.0

torch = None  # imported in main() only where PyTorch is wanted


def fail(message):
    print(f"torch_rmsnorm_bench: {message}", file=sys.stderr)
    sys.exit(1)


def rmsnorm(x, gamma, eps):
    x32 = x.float()
    inv = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (x32 * inv * gamma.float()).to(x.dtype)


def functional_rmsnorm(x, gamma, eps):
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), gamma, eps)


def time_backward(fn, x, gamma, dy, iters, device, flush):
    """Median ms of the backward pass only, after a warm-up run (which also compiles)."""
    samples = []
    for i in range(iters + 1):
        if i > MIN_TIMED_RUNS and sum(samples) > TIMED_BUDGET_MS:
            break
        xr = x.detach().requires_grad_(True)
        gr = gamma.detach().requires_grad_(True)
        y = fn(xr, gr, 1e-5)
        if device == "cuda":
            if flush is not None:
                flush.fill_(i & 1)  # evicts what the forward and the last run left in L2
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
        if i > 0:
            samples.append(ms)
    return statistics.median(samples)


def compile_rmsnorm():
    """rmsnorm through torch.compile, specialized to the shapes it is called with."""
    dynamo = getattr(torch, "_dynamo", None)
    if dynamo is not None and hasattr(dynamo, "reset"):
        dynamo.reset()
    return torch.compile(rmsnorm, dynamic=False)


def available_baselines(device):
    """{name: maker} of the baselines this PyTorch has, and {name: reason} of the others; a maker
    returns the function to time for the next shape."""
    found, skipped = {"eager": lambda: rmsnorm}, {}
    if not hasattr(torch, "compile"):
        skipped["compile"] = f"torch {torch.__version__} has no torch.compile (added in 2.0)"
    else:
        try:
            compiled = compile_rmsnorm()
            x = torch.randn(4, 64, device=device, requires_grad=True)
            compiled(x, torch.ones(64, device=device, requires_grad=True), 1e-5).sum().backward()
            found["compile"] = compile_rmsnorm
        except Exception as e:  # a missing compiler toolchain, an unsupported platform, ...
            first = (str(e).splitlines() or [""])[0][:160]
            skipped["compile"] = f"torch.compile failed: {type(e).__name__}: {first}"
    if hasattr(torch.nn.functional, "rms_norm"):
        found["functional"] = lambda: functional_rmsnorm
    else:
        skipped["functional"] = (f"torch {torch.__version__} has no "
                                 "torch.nn.functional.rms_norm (added in 2.4)")
    return found, skipped


def summarize(bench, torch_ms, torch_device, skipped):
    """The summary: bench.json's results with the PyTorch times, ratios and verdicts.

    torch_ms: one {baseline: ms or None} per result (None where not measured); skipped:
    {baseline: reason}; torch_device: "cuda", "cpu" or None (no PyTorch).
    """
    results = []
    copy_failing, torch_failing = [], []
    for r, times in zip(bench["results"], torch_ms):
        entry = dict(r)
        shape = f"{r['dtype']} {r['rows']}x{r['hidden']}"
        ours = r["row_resident_ms"]
        entry["torch_device"] = torch_device
        speedups = []
        for name in BASELINES:
            ms = times.get(name)
            entry[f"torch_{name}_ms"] = ms
            speedup = ms / ours if ms and ours > 0 else None
            entry[f"speedup_vs_torch_{name}"] = speedup
            if speedup is not None:
                speedups.append(speedup)
        entry["large_shape"] = (r["rows"] * r["hidden"] >= LARGE_ELEMENTS
                                and r["hidden"] <= HELD_HIDDEN_MAX)
        entry["meets_copy_target"] = (r["row_resident_of_copy"] >= COPY_TARGET
                                      if entry["large_shape"] else None)
        if entry["meets_copy_target"] is False:
            copy_failing.append(shape)
        entry["faster_than_torch"] = (all(s > 1 for s in speedups)
                                      if torch_device == "cuda" and speedups else None)
        if entry["faster_than_torch"] is False:
            torch_failing.append(shape)
        results.append(entry)

    large = [e for e in results if e["large_shape"]]
    copy_target = {
        "target": (f"row_resident_of_copy >= {COPY_TARGET} where rows x hidden >= 4096 x 4096 "
                   f"and hidden <= {HELD_HIDDEN_MAX}"),
        "holds": not copy_failing if large else None,
        "failing": copy_failing,
    }
    if not large:
        copy_target["why_not_judged"] = "no large shape in this run"
    torch_target = {
        "target": "faster than every PyTorch baseline on every shape",
        "holds": None,
        "failing": torch_failing,
    }
    if torch_device != "cuda":
        torch_target["why_not_judged"] = (
            "PyTorch ran on the CPU" if torch_device == "cpu" else "no PyTorch")
    elif not any(e["faster_than_torch"] is not None for e in results):
        torch_target["why_not_judged"] = "no PyTorch baseline measured"
    else:
        torch_target["holds"] = not torch_failing
    summary = dict(bench)
    summary["results"] = results
    summary["torch_device"] = torch_device
    summary["baselines"] = {
        name: ({"skipped": skipped[name]} if name in skipped else
               {"measured_shapes": sum(1 for t in torch_ms if t.get(name) is not None)})
        for name in BASELINES}
    summary["targets"] = {"copy_fraction_on_large_shapes": copy_target,
                          "faster_than_torch": torch_target}
    return summary


def fmt(v, spec):
    return format(v, spec) if v is not None else "-"


def verdict(target):
    if target["holds"] is None:
        return f"not judged ({target.get('why_not_judged', '')})"
    if target["holds"]:
        return "holds"
    return "FAILS at " + ", ".join(target["failing"])


def print_summary(summary):
    torch_l2 = {"cuda": "the same flush", "cpu": "no flush (CPU)"}.get(summary["torch_device"],
                                                                      "not run")
    print(f"device: {summary.get('device')} ({summary.get('target')}); "
          f"torch on {summary['torch_device'] or 'none'}; L2: {summary.get('l2_policy', '?')} "
          f"({summary.get('l2_flush_bytes', '?')} bytes before every kernel run; PyTorch: "
          f"{torch_l2})")
    for name, b in summary["baselines"].items():
        if "skipped" in b:
            print(f"baseline {name}: skipped: {b['skipped']}")
    print(f"{'dtype':5} {'rows x hidden':>14} {'normgrad ms':>12} {'of copy':>8} "
          + " ".join(f"{name + ' ms':>13} {'x':>6}" for name in BASELINES))
    for e in summary["results"]:
        cells = " ".join(f"{fmt(e[f'torch_{n}_ms'], '13.4f'):>13} "
                         f"{fmt(e[f'speedup_vs_torch_{n}'], '6.2f'):>6}" for n in BASELINES)
        print(f"{e['dtype']:5} {str(e['rows']) + 'x' + str(e['hidden']):>14} "
              f"{e['row_resident_ms']:12.4f} {e['row_resident_of_copy']:8.3f} {cells}")
    print("(x = torch ms / normgrad ms: above 1, normgrad is faster)")
    for key, target in summary["targets"].items():
        print(f"target {key} ({target['target']}): {verdict(target)}")


def main():
    global torch
    parser = argparse.ArgumentParser()
    parser.add_argument("--kernels-json", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--allow-cpu", action="store_true")
    parser.add_argument("--no-torch", action="store_true")
    args = parser.parse_args()
    if args.iters < 1:
        fail(f"--iters must be at least 1 (got {args.iters})")
    try:
        with open(args.kernels_json) as f:
            bench = json.load(f)
        for r in bench["results"]:
            for key in ("dtype", "rows", "hidden", "row_resident_ms", "row_resident_of_copy"):
                r[key]
    except (OSError, ValueError, KeyError, TypeError) as e:
        fail(f"cannot read {args.kernels_json}: {type(e).__name__}: {e}")

    device = None
    found, skipped = {}, {name: "--no-torch" for name in BASELINES}
    torch_ms = [{} for _ in bench["results"]]
    if not args.no_torch:
        import torch as torch_module  # noqa: PLC0415 (only where PyTorch is installed)
        torch = torch_module
        if torch.cuda.is_available():
            device = "cuda"
        elif args.allow_cpu:
            device = "cpu"
        else:
            fail("torch has no CUDA device (use --allow-cpu only for a smoke run)")
        found, skipped = available_baselines(device)
        iters = min(args.iters, 3) if device == "cpu" else args.iters
        flush = None
        if device == "cuda":
            flush = torch.empty(int(bench.get("l2_flush_bytes", 256 << 20)), dtype=torch.uint8,
                                device=device)
        dtypes = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
        for r, times in zip(bench["results"], torch_ms):
            g = torch.Generator(device="cpu").manual_seed(0)
            dt = dtypes[r["dtype"]]
            x = torch.randn(r["rows"], r["hidden"], generator=g).to(device=device, dtype=dt)
            dy = torch.randn(r["rows"], r["hidden"], generator=g).to(device=device, dtype=dt)
            gamma = (torch.rand(r["hidden"], generator=g) + 0.5).to(device=device, dtype=dt)
            for name, make in found.items():
                try:
                    times[name] = time_backward(make(), x, gamma, dy, iters, device, flush)
                except Exception as e:  # one shape the baseline cannot do: say so, go on
                    print(f"{name} failed at {r['dtype']} {r['rows']}x{r['hidden']}: "
                          f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}")
            del x, dy, gamma
    summary = summarize(bench, torch_ms, device, skipped)
    print_summary(summary)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
