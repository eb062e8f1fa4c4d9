"""The command-line flags every training script of the course shares."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from model import PRESETS


def default_num_workers() -> int:
    """DataLoader workers per rank: the CPUs Slurm gave each rank, less one for the main process.

    The windows are sliced from a tensor in memory, so a few workers are plenty (capped at 4);
    outside a Slurm job the main process alone is enough.
    """
    cpus = os.environ.get("SLURM_CPUS_PER_TASK")
    if not cpus:
        return 0
    # torchrun starts LOCAL_WORLD_SIZE processes inside one Slurm task: they share its CPUs.
    per_rank = int(cpus) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return max(0, min(4, per_rank - 1))


def default_out_dir(script: str) -> str:
    """runs/<script>[-<job id>]: the same on every rank (a timestamp would not be)."""
    job = os.environ.get("SLURM_JOB_ID")
    return str(Path("runs") / (Path(script).stem + (f"-{job}" if job else "")))


def base_parser(script: str, description: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    data = p.add_argument_group("data")
    data.add_argument("--dataset", choices=["auto", "wikitext-2", "synthetic"], default="auto",
                      help="auto: WikiText-2 if cached, given by --data-dir or downloadable, "
                           "else the synthetic corpus (with a warning)")
    data.add_argument("--data-dir", help="folder with train.txt/valid.txt/test.txt "
                                         "(or wiki.{train,valid,test}.tokens)")
    data.add_argument("--cache-dir", help="tokenised-data cache (default $COURSE_DATA_CACHE "
                                          "or data_cache/ in the repository)")
    data.add_argument("--seq-len", type=int, default=None,
                      help="tokens per sample (default: the preset's max_seq_len)")
    data.add_argument("--num-workers", type=int, default=default_num_workers(),
                      help="DataLoader workers per rank (default from SLURM_CPUS_PER_TASK)")
    model = p.add_argument_group("model")
    model.add_argument("--preset", choices=list(PRESETS), default="workshop")
    model.add_argument("--dropout", type=float, default=None,
                       help="dropout probability (default: the preset's)")
    train = p.add_argument_group("training")
    train.add_argument("--epochs", type=int, default=10)
    train.add_argument("--max-steps", type=int, default=None,
                       help="stop after this many optimizer steps (a short run)")
    train.add_argument("--batch-size", type=int, default=32, help="sequences per step and rank")
    train.add_argument("--lr", type=float, default=1e-3)
    train.add_argument("--weight-decay", type=float, default=0.1)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    perf = p.add_argument_group("performance (docs/performance.md)")
    perf.add_argument("--precision", choices=["auto", "fp32", "tf32", "bf16"], default="auto",
                      help="matmul precision: bf16 = autocast with fp32 master weights, tf32 = "
                           "fp32 tensors on tensor cores; auto: bf16 on a GPU that has it, "
                           "else fp32")
    perf.add_argument("--compile", action="store_true",
                      help="torch.compile the Transformer blocks (slow first steps)")
    out = p.add_argument_group("output")
    out.add_argument("--out-dir", default=default_out_dir(script),
                     help="checkpoints, logs and summary.json (default runs/<script>[-<job id>])")
    out.add_argument("--logger", choices=["none", "tensorboard", "wandb"], default="tensorboard")
    out.add_argument("--log-every", type=int, default=10, help="steps between loss prints")
    return p
