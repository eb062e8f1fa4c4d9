"""How long tools/plan_run.py takes, and how much memory, for the workshop model and a 7B-like
model on up to 1,024 fake ranks. Prints a markdown table for docs/benchmarks.md; asserts nothing
(tests/test_plan_run.py and tests/test_nd_training.py check what the plans say).

    python benchmarks/bench_plan_run.py              # about a minute on 2 idle cores
    python benchmarks/bench_plan_run.py --only 7B

Each plan is a fresh process (python tools/plan_run.py ... --json): wall time, the CPU time of
the process (on a shared machine the honest figure: the wall time grows with the load), its peak
resident memory, and the time the tool itself reports for building the ranks (build_s and
build_cpu_s: the fake process group, the mesh, the model on the meta device, TP, FSDP, the
pipeline stage; the rest is Python importing torch and the course's modules).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEVEN_B = ["--params", "7e9", "--d-model", "4096", "--layers", "32", "--seq-len", "4096"]
CASES = {
    "workshop, 2 nodes x 4 GPUs, tp 2 x pp 2 x dp 2": [
        "--preset", "workshop", "--nodes", "2", "--gpus-per-node", "4", "--tp", "2", "--pp", "2",
        "--global-batch", "64"],
    "workshop, 256 nodes x 4 GPUs, tp 2 x pp 2 x dp 256": [
        "--preset", "workshop", "--nodes", "256", "--gpus-per-node", "4", "--tp", "2", "--pp", "2",
        "--global-batch", "4096"],
    "7B-like, 256 nodes x 4 GPUs, tp 4 x pp 4 x dp 64": [
        *SEVEN_B, "--nodes", "256", "--gpus-per-node", "4", "--tp", "4", "--pp", "4",
        "--global-batch", "512", "--microbatches", "8"],
    "7B-like, 256 nodes x 4 GPUs, tp 4 x pp 1 x dp 256 (FSDP's widest shard)": [
        *SEVEN_B, "--nodes", "256", "--gpus-per-node", "4", "--tp", "4", "--pp", "1",
        "--global-batch", "512", "--microbatches", "2"],
    "7B-like, 256 nodes x 4 GPUs, search": [
        *SEVEN_B, "--nodes", "256", "--gpus-per-node", "4", "--global-batch", "512",
        "--microbatches", "8"],
}


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def measure(argv: list[str], out: Path) -> dict:
    """Wall and CPU seconds, peak resident MiB of one plan in a fresh process, and its JSON."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    errors = out.with_suffix(".err")
    start = time.perf_counter()
    with open(errors, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "tools/plan_run.py", *argv, "--json", str(out)],
                                cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own resource usage
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    plan = json.loads(out.read_text()) if out.exists() else {}
    if proc.returncode and not plan:
        raise SystemExit(f"tools/plan_run.py {' '.join(argv)} failed:\n"
                         f"{errors.read_text()[-2000:]}")
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime,
            "rss_mib": usage.ru_maxrss / 1024, "plan": plan.get("plan", plan)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", help="run only the cases whose name contains this")
    args = p.parse_args()
    load = os.getloadavg()[0]
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores, load average {load:.1f} at the start; "
          f"Python {platform.python_version()}\n")
    print("| plan | ranks built | wall s | CPU s | of which building the ranks, wall / CPU s | "
          "peak memory MiB |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, argv) in enumerate(CASES.items()):
            if args.only and args.only not in name:
                continue
            m = measure(argv, Path(tmp) / f"{i}.json")
            built = ", ".join(str(r["rank"]) for r in m["plan"].get("ranks", []))
            plan = m["plan"]
            print(f"| {name} | {built} | {m['wall_s']:.1f} | {m['cpu_s']:.1f} | "
                  f"{plan.get('build_s', math.nan):.1f} / {plan.get('build_cpu_s', math.nan):.1f} "
                  f"| {m['rss_mib']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
