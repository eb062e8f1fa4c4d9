"""Measure what each parallelism costs per rank: parameters held and bytes sent per step.

    python benchmarks/parallelism_costs.py                  # 4 CPU processes, preset small
    python benchmarks/parallelism_costs.py --nproc 8 --preset tiny --dataset synthetic

Runs every layout of the course on the same processes twice, for --short and --long training
steps, and reports per rank:
- parameters held (from the script's summary.json, or the whole model for DDP);
- bytes sent per training step: Linux counts every byte a process writes to a socket in
  /proc/self/io (wchar); gloo sends its collectives and point-to-point messages over TCP, so
  (sent in the long run - sent in the short run) / (long - short) is the traffic of one step,
  with start-up, evaluation and checkpoints cancelled out.
On GPUs NCCL's traffic does not pass through the process's sockets: the numbers are a CPU/gloo
measurement of the same algorithms (ring all-reduce: 2(n-1)/n bytes per byte reduced).
"""

from __future__ import annotations

import argparse
import json
import runpy
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name -> (script, extra arguments) for n processes
def layouts(n: int) -> dict[str, tuple[str, list]]:
    half = n // 2
    return {
        f"DDP {n}": ("solutions/train/to_distributed_training.py", []),
        f"FSDP {n}": ("train/nd_training.py", ["--dp", n]),
        f"TP {n}": ("solutions/train/tp_training.py", ["--tp", n]),
        f"TP {half} x FSDP 2": ("solutions/train/tp_training.py", ["--tp", half]),
        f"PP 2 x FSDP {half}": ("train/nd_training.py", ["--pp", 2, "--dp", half]),
        f"PP 2 x TP {half}": ("train/nd_training.py", ["--pp", 2, "--tp", half]),
    }


def sent_bytes() -> int:
    for line in open("/proc/self/io"):
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise RuntimeError("no wchar in /proc/self/io")


def run_and_count(script: str, out_dir: str) -> None:
    """Inside each rank: run the training script, then write how many bytes this process sent."""
    import atexit
    import os

    rank = os.environ.get("RANK", "0")
    atexit.register(lambda: Path(out_dir, f"sent_bytes.{rank}").write_text(str(sent_bytes())))
    sys.argv = [script] + sys.argv[1:]
    runpy.run_path(script, run_name="__main__")


def launch(script, extra, args, steps, out_dir) -> tuple[list[int], dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={args.nproc}", __file__, "--as-rank", script, out_dir,
           "--dataset", args.dataset, "--preset", args.preset, "--batch-size", args.batch_size,
           "--max-steps", steps, "--dropout", 0, "--logger", "none", "--out-dir", out_dir, *extra]
    env = dict(__import__("os").environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    subprocess.run([str(c) for c in cmd], cwd=ROOT, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    sent = [int(Path(out_dir, f"sent_bytes.{r}").read_text()) for r in range(args.nproc)]
    return sent, json.loads(Path(out_dir, "summary.json").read_text())


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--as-rank":
        script, out_dir = sys.argv[2], sys.argv[3]
        del sys.argv[1:4]
        return run_and_count(script, out_dir)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--preset", default="small")
    p.add_argument("--dataset", default="synthetic")
    p.add_argument("--batch-size", type=int, default=8, help="per data-parallel replica")
    p.add_argument("--short", type=int, default=1)
    p.add_argument("--long", type=int, default=5)
    p.add_argument("--only", help="run only the layouts whose name contains this")
    args = p.parse_args()
    print(f"| layout ({args.nproc} processes, preset {args.preset}, batch {args.batch_size} "
          "per replica) | parameters per rank (max) | MB sent per step and rank (max) |")
    print("|---|---|---|")
    for name, (script, extra) in layouts(args.nproc).items():
        if args.only and args.only not in name:
            continue
        with tempfile.TemporaryDirectory() as short_dir, tempfile.TemporaryDirectory() as long_dir:
            short, _ = launch(script, extra, args, args.short, short_dir)
            long, summary = launch(script, extra, args, args.long, long_dir)
        per_step = [(b - a) / (args.long - args.short) for a, b in zip(short, long, strict=True)]
        params = summary.get("params_per_rank")
        if params is None:  # DDP: every rank holds the whole model
            from model import TransformerLM, get_config
            cfg = summary["model_config"]
            params = TransformerLM(get_config(args.preset, vocab_size=cfg["vocab_size"],
                                              max_seq_len=cfg["max_seq_len"])).num_params()
        params = max(params) if isinstance(params, list) else params
        print(f"| {name} | {params / 1e6:.3f}M | {max(per_step) / 1e6:.2f} "
              f"(median {statistics.median(per_step) / 1e6:.2f}) |", flush=True)


if __name__ == "__main__":
    main()
