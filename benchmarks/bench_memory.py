"""The memory step's numbers for docs/memory.md and docs/benchmarks.md: bytes per rank of every
layout at 1, 2 and 4 ranks against the formula, what activation checkpointing saves and costs,
and how long a checkpoint save blocks training with and without dcp.async_save. Prints markdown
tables; asserts nothing (tests/test_memory*.py hold the measurements to the formula).

    python benchmarks/bench_memory.py                       # small preset, about 5 minutes on 2 cores
    python benchmarks/bench_memory.py --preset tiny --ranks 1 2

Every run is the solution itself (torchrun, gloo on the CPU, synthetic data, dropout off); the
bytes are the breakdown the script writes into summary.json (tensor sizes: the same on a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20
LAYOUTS = [("ddp", []), ("zero1", []), ("zero2", []), ("zero3", []), ("offload", []),
           ("zero3", ["--activation-checkpointing"])]


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def run(script: str, ranks: int, out: Path, *args) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={ranks}", script, "--dataset", "synthetic", "--dropout", "0",
           "--logger", "none", "--epochs", "1", "--overwrite", "--out-dir", str(out), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads((out / "summary.json").read_text())


def layout_table(preset: str, ranks_list: list[int], batch: int, steps: int, tmp: Path) -> None:
    print(f"\n### Bytes per rank (MiB), measured (formula): preset {preset}, {batch} sequences "
          "per rank\n")
    print("| layout | ranks | parameters | gradients | optimizer | activations | gathered after "
          "forward | total | tokens/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for layout, extra in LAYOUTS:
        name = layout + (" + checkpointing" if extra else "")
        for ranks in ranks_list:
            s = run("solutions/train/memory_training.py", ranks, tmp / f"{name}-{ranks}".replace(
                " ", ""), "--preset", preset, "--batch-size", str(batch), "--max-steps",
                str(steps), "--layout", layout, *extra)
            m = s["memory"]["per_rank"][0]
            cells = [f"{m['measured'][k] / MiB:.2f} ({m['formula'][k] / MiB:.2f})"
                     for k in ("parameters", "gradients", "optimizer", "activations",
                               "gathered")]
            total = sum(m["measured"][k] for k in ("parameters", "gradients", "optimizer",
                                                   "activations", "gathered"))
            where = " (host)" if m["layout"]["offload"] else ""
            print(f"| {name}{where} | {ranks} | {' | '.join(cells)} | {total / MiB:.2f} | "
                  f"{s['tokens_per_s']:.0f} |", flush=True)


def checkpointing_table(preset: str, batch: int, steps: int, repeats: int, tmp: Path) -> None:
    print(f"\n### Activation checkpointing: bytes saved, time paid (1 process, preset {preset}, "
          f"{batch} sequences, {steps} steps, median of {repeats} runs, alternating)\n")
    print("| blocks | activations MiB | step ms | tokens/s |")
    print("|---|---|---|---|")
    results = {False: [], True: []}
    for i in range(repeats):
        for ac in (False, True):
            s = run("solutions/train/memory_training.py", 1, tmp / f"ac{ac}{i}", "--preset", preset,
                    "--batch-size", str(batch), "--max-steps", str(steps),
                    *(["--activation-checkpointing"] if ac else []))
            results[ac].append((s["memory"]["activations"][0], s["tokens_per_s"],
                                batch * s["seq_len"]))
    for ac, rows in results.items():
        rate = sorted(r[1] for r in rows)[len(rows) // 2]
        print(f"| {'checkpointed' if ac else 'kept'} | {rows[0][0] / MiB:.2f} | "
              f"{1000 * rows[0][2] / rate:.1f} | {rate:.0f} |", flush=True)


def async_table(preset: str, batch: int, steps: int, every: int, tmp: Path) -> None:
    print(f"\n### A checkpoint save blocks training (s per save): FSDP step, preset {preset}, "
          f"2 ranks, --checkpoint-every {every}\n")
    print("| save | saves | mean blocking | max blocking | tokens/s |")
    print("|---|---|---|---|---|")
    for flag in ([], ["--async-save"]):
        s = run("solutions/train/fsdp_training.py", 2, tmp / f"fsdp{len(flag)}", "--preset", preset,
                "--batch-size", str(batch), "--max-steps", str(steps), "--checkpoint-every",
                str(every), *flag)
        times = s["checkpoint_save_blocking_s"]
        print(f"| {'dcp.async_save' if flag else 'dcp.save'} | {len(times)} | "
              f"{sum(times) / len(times):.3f} | {max(times):.3f} | {s['tokens_per_s']:.0f} |",
              flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--only", choices=["layouts", "checkpointing", "async"])
    args = p.parse_args()
    import torch
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        if args.only in (None, "layouts"):
            layout_table(args.preset, args.ranks, args.batch_size, args.steps, Path(tmp))
        if args.only in (None, "checkpointing"):
            checkpointing_table(args.preset, args.batch_size, 3 * args.steps, 3, Path(tmp))
        if args.only in (None, "async"):
            async_table(args.preset, args.batch_size, 4 * args.steps, 4, Path(tmp))


if __name__ == "__main__":
    main()
