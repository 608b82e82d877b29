#!/usr/bin/env python3
"""The GPU kit's summary (torch_rmsnorm_bench.py) on made-up figures: the ratios, which shapes
count as large, and the two targets' verdicts. Needs neither a GPU nor PyTorch.

    python3 tests/gpu/torch_rmsnorm_bench_test.py
"""
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import unittest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_rmsnorm_bench.py")
spec = importlib.util.spec_from_file_location("torch_rmsnorm_bench", SCRIPT)
kit = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kit)


def result(dtype, rows, hidden, ms, of_copy):
    return {"dtype": dtype, "rows": rows, "hidden": hidden, "row_resident_ms": ms,
            "row_resident_of_copy": of_copy}


BENCH = {
    "device": "made up", "target": "sm_90", "l2_policy": "flush", "l2_flush_bytes": 104857600,
    "results": [
        result("f32", 1, 896, 0.010, 0.02),           # small: no copy target
        result("f32", 4096, 4096, 0.200, 0.93),       # large, meets it
        result("bf16", 16384, 4096, 0.400, 0.85),     # large, short of it
        result("bf16", 32768, 896, 0.100, 0.90),      # large (29M elements), exactly at it
    ],
}


class SummaryTest(unittest.TestCase):
    def test_copy_target_judges_only_large_shapes(self):
        s = kit.summarize(BENCH, [{} for _ in BENCH["results"]], None, {})
        self.assertEqual([e["large_shape"] for e in s["results"]], [False, True, True, True])
        self.assertEqual([e["meets_copy_target"] for e in s["results"]],
                         [None, True, False, True])
        target = s["targets"]["copy_fraction_on_large_shapes"]
        self.assertIs(target["holds"], False)
        self.assertEqual(target["failing"], ["bf16 16384x4096"])

    def test_streamed_rows_are_not_judged_against_the_copy_target(self):
        bench = dict(BENCH, results=[result("f32", 1024, 65536, 1.0, 0.70),
                                     result("bf16", 4096, 4096, 0.1, 0.95)])
        s = kit.summarize(bench, [{}, {}], None, {})
        self.assertEqual([e["large_shape"] for e in s["results"]], [False, True])
        self.assertEqual([e["meets_copy_target"] for e in s["results"]], [None, True])
        self.assertIs(s["targets"]["copy_fraction_on_large_shapes"]["holds"], True)

    def test_ratios_and_faster_than_every_baseline(self):
        times = [{"eager": 0.05, "compile": 0.02, "functional": 0.03},
                 {"eager": 0.60, "compile": 0.30, "functional": 0.40},
                 {"eager": 1.20, "compile": 0.38, "functional": None},  # compile beats us here
                 {"eager": 0.30, "compile": 0.20}]
        s = kit.summarize(BENCH, times, "cuda", {})
        first = s["results"][0]
        self.assertAlmostEqual(first["speedup_vs_torch_eager"], 5.0)
        self.assertAlmostEqual(first["speedup_vs_torch_compile"], 2.0)
        self.assertAlmostEqual(first["speedup_vs_torch_functional"], 3.0)
        self.assertIsNone(s["results"][2]["speedup_vs_torch_functional"])
        self.assertIsNone(s["results"][3]["torch_functional_ms"])
        self.assertEqual([e["faster_than_torch"] for e in s["results"]],
                         [True, True, False, True])
        target = s["targets"]["faster_than_torch"]
        self.assertIs(target["holds"], False)
        self.assertEqual(target["failing"], ["bf16 16384x4096"])

        times[2]["compile"] = 0.41
        s = kit.summarize(BENCH, times, "cuda", {})
        self.assertIs(s["targets"]["faster_than_torch"]["holds"], True)

    def test_torch_on_the_cpu_or_absent_is_not_judged(self):
        times = [{"eager": 0.001} for _ in BENCH["results"]]  # "faster" than us: not comparable
        for device, why in (("cpu", "PyTorch ran on the CPU"), (None, "no PyTorch")):
            s = kit.summarize(BENCH, times if device else [{}] * 4, device, {})
            target = s["targets"]["faster_than_torch"]
            self.assertIsNone(target["holds"])
            self.assertEqual(target["why_not_judged"], why)
            self.assertEqual([e["faster_than_torch"] for e in s["results"]], [None] * 4)

    def test_skipped_baselines_keep_their_reason(self):
        times = [{"eager": 1.0, "compile": 2.0}] * 3 + [{"eager": 1.0}]  # compile failed once
        s = kit.summarize(BENCH, times, "cuda",
                          {"functional": "torch 2.1 has no torch.nn.functional.rms_norm"})
        self.assertEqual(s["baselines"]["functional"],
                         {"skipped": "torch 2.1 has no torch.nn.functional.rms_norm"})
        self.assertEqual(s["baselines"]["eager"], {"measured_shapes": 4})
        self.assertEqual(s["baselines"]["compile"], {"measured_shapes": 3})


class CommandLineTest(unittest.TestCase):
    def run_script(self, bench_text, *extra):
        with tempfile.TemporaryDirectory() as d:
            bench_path = os.path.join(d, "bench.json")
            out_path = os.path.join(d, "summary.json")
            with open(bench_path, "w") as f:
                f.write(bench_text)
            p = subprocess.run([sys.executable, SCRIPT, "--kernels-json", bench_path, "--out",
                                out_path, *extra], capture_output=True, text=True, timeout=60)
            summary = None
            if os.path.exists(out_path):
                with open(out_path) as f:
                    summary = json.load(f)
            return p, summary

    def test_no_torch_writes_the_summary_and_prints_the_verdicts(self):
        p, summary = self.run_script(json.dumps(BENCH), "--no-torch")
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("target copy_fraction_on_large_shapes", p.stdout)
        self.assertIn("FAILS at bf16 16384x4096", p.stdout)
        self.assertIn("not judged (no PyTorch)", p.stdout)
        self.assertIn("L2: flush (104857600 bytes", p.stdout)
        self.assertEqual(summary["baselines"]["compile"], {"skipped": "--no-torch"})
        self.assertEqual(len(summary["results"]), 4)

    def test_unusable_input_is_one_line_and_exit_1(self):
        p, summary = self.run_script('{"results": [{"dtype": "f32", "rows": 1}]}', "--no-torch")
        self.assertEqual(p.returncode, 1)
        self.assertIn("cannot read", p.stderr)
        self.assertIn("hidden", p.stderr)
        self.assertIsNone(summary)


if __name__ == "__main__":
    unittest.main()
