#!/usr/bin/env python3
"""The summary `scripts/dev.sh test` prints at its end (docs/testing.md, "Stage times").

    scripts/ci_summary.py DIR

DIR holds what the stages wrote while they ran:
  stages.tsv          one line per stage: name, seconds, "passed" or "FAILED"
  ctest-STAGE-N.xml   each ctest run's JUnit report (ctest --output-junit)
  timed-STAGE.tsv     timed steps that are not ctest tests: name, seconds (the fuzzing runs)
  checks-STAGE.txt    one line per check a script made (the container stage's `ok:` lines)

Prints each stage's time and test count (ctest tests run, passed, failed, skipped; the other
timed steps and checks), the whole run, and the 15 slowest tests of all stages with their times,
so that a change sees what it costs CI. Exits 0: the stages' own exit statuses decide the run.
"""

import collections
import os
import pathlib
import platform
import re
import sys
import xml.etree.ElementTree as ElementTree

SLOWEST = 15


def machine():
    """'MODEL, AVX-512|AVX2|no AVX2, N cores' from one read of /proc/cpuinfo."""
    model, flags = platform.processor() or "unknown CPU", set()
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    found = re.search(r"^model name\s*:\s*(.*)$", text, re.M)
    if found:
        model = found.group(1).strip()
    found = re.search(r"^flags\s*:(.*)$", text, re.M)
    if found:
        flags = set(found.group(1).split())
    simd = "AVX-512" if "avx512f" in flags else ("AVX2" if "avx2" in flags else "no AVX2")
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = "?"
    return f"{model}, {simd}, {cores} cores"


def read_junit(path):
    """[(test name, seconds, status)] of one ctest JUnit file; status run/fail/skipped."""
    tests = []
    root = ElementTree.parse(path).getroot()
    for case in root.iter("testcase"):
        status = case.get("status", "run")
        if case.find("failure") is not None or status == "fail":
            status = "fail"
        elif case.find("skipped") is not None or status in ("disabled", "notrun", "skipped"):
            status = "skipped"
        else:
            status = "run"
        tests.append((case.get("name", "?"), float(case.get("time", "0") or 0), status))
    return tests


def main(argv):
    if len(argv) != 2:
        print("usage: ci_summary.py DIR", file=sys.stderr)
        return 2
    folder = pathlib.Path(argv[1])
    stages = []
    stages_file = folder / "stages.tsv"
    if stages_file.exists():
        for line in stages_file.read_text().splitlines():
            fields = line.split("\t")
            if len(fields) == 3:
                stages.append((fields[0], int(fields[1]), fields[2]))

    counts = {}
    everything = []  # (seconds, stage, name)
    for name, _, _ in stages:
        count = collections.Counter()
        for report in sorted(folder.glob(f"ctest-{name}-*.xml")):
            try:
                tests = read_junit(report)
            except ElementTree.ParseError as error:
                print(f"[ci] {report.name}: unreadable ({error})")
                continue
            for test, seconds, status in tests:
                count[status] += 1
                everything.append((seconds, name, test))
        timed = folder / f"timed-{name}.tsv"
        if timed.exists():
            for line in timed.read_text().splitlines():
                step, _, seconds = line.partition("\t")
                count["timed"] += 1
                everything.append((float(seconds), name, step))
        checks = folder / f"checks-{name}.txt"
        if checks.exists():
            count["checks"] = len(checks.read_text().splitlines())
        counts[name] = count

    print(f"[ci] summary ({machine()})")
    print(f"[ci] {'stage':<10} {'seconds':>8} {'result':<7} {'tests':>6} {'passed':>7} "
          f"{'failed':>7} {'skipped':>8}  other")
    total_seconds = 0
    total = collections.Counter()
    for name, seconds, result in stages:
        count = counts[name]
        run = count["run"] + count["fail"] + count["skipped"]
        other = []
        if count["timed"]:
            other.append(f"{count['timed']} timed steps")
        if count["checks"]:
            other.append(f"{count['checks']} checks")
        print(f"[ci] {name:<10} {seconds:>8} {result:<7} {run:>6} {count['run']:>7} "
              f"{count['fail']:>7} {count['skipped']:>8}  {', '.join(other)}")
        total_seconds += seconds
        total.update(count)
    run = total["run"] + total["fail"] + total["skipped"]
    print(f"[ci] {'all':<10} {total_seconds:>8} {'':<7} {run:>6} {total['run']:>7} "
          f"{total['fail']:>7} {total['skipped']:>8}  ({total_seconds // 60} min "
          f"{total_seconds % 60} s)")
    print(f"[ci] the {SLOWEST} slowest tests and steps:")
    for seconds, stage, test in sorted(everything, reverse=True)[:SLOWEST]:
        print(f"[ci] {seconds:>9.2f} s  {stage:<10} {test}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
