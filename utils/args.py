"""The command-line flags every training script of the course shares."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from model import PRESETS
from utils.data import DATASETS


# ---- argparse types: a bad value stops the run at once with one line naming the flag ----

def positive_int(text: str) -> int:
    """An int of at least 1 (batch sizes, lengths, degrees, epochs)."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not allowed: give a whole number of at least 1")
    return value


def non_negative_int(text: str) -> int:
    """An int of at least 0 (--max-steps 0 only evaluates, --num-workers 0 loads in-process)."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is not allowed: give a whole number of at least 0")
    return value


def positive_float(text: str) -> float:
    """A finite float above 0 (the learning rate: inf or nan would train nothing but NaN)."""
    value = _float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} is not allowed: give a finite number above 0")
    return value


def non_negative_float(text: str) -> float:
    """A finite float of at least 0 (weight decay)."""
    value = _float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{value} is not allowed: give a finite number of at least 0")
    return value


def probability(text: str) -> float:
    """A float in [0, 1) (dropout)."""
    value = _float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not allowed: give a number from 0 to below 1")
    return value


def vocab_cap(text: str) -> int:
    """An int of at least 2 (--max-vocab: the vocabulary always holds <unk> and <eos>)."""
    value = _int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(
            f"{value} is not allowed: give a whole number of at least 2 (<unk> and <eos> "
            "are always in the vocabulary)")
    return value


def positive_int_list(text: str) -> list[int]:
    """Comma-separated ints of at least 1, e.g. 3,5 (--layers-per-stage)."""
    return [positive_int(n) for n in text.split(",")]


def byte_size(text: str) -> int:
    """A message size in bytes, with nccl-tests' binary suffixes: 1024, 64K, 8M, 1G."""
    import re
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(i?B)?\s*", text, re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: give bytes, e.g. 1024, 64K, "
                                         "8M or 1G")
    value = int(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[m.group(2).upper()]
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed: give at least 1 byte")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text} is not allowed: give a finite number")
    return value


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: `<script>: error: argument --x: ...`.

    argparse prints the whole usage first, which for our scripts is a screenful that hides
    the line saying what to change; --help still shows it.
    """

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


# ---- defaults ----

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


# the flags base_parser(trains=False) accepts without listing them in --help
UNUSED_WITHOUT_TRAINING = {"num_workers", "dropout", "epochs", "max_steps", "batch_size", "lr",
                           "weight_decay", "precision", "compile", "logger", "log_every"}


def base_parser(script: str, description: str | None,
                trains: bool = True) -> argparse.ArgumentParser:
    """The flags every script shares. With trains=False (a lesson that trains nothing: the
    collectives lesson), the training, performance and logging flags are still accepted (a job
    file hands the same arguments to a training run and to the lesson) but left out of --help."""
    p = OneLineParser(description=description,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    data = p.add_argument_group("data")
    data.add_argument("--dataset", choices=list(DATASETS), default="auto",
                      help="auto: WikiText-2 if cached, given by --data-dir or downloadable, "
                           "else the synthetic corpus (with a warning); wikitext-103: 50x "
                           "the text, for scaling runs (prepare_data.py --dataset wikitext-103)")
    data.add_argument("--data-dir", help="folder with train.txt/valid.txt/test.txt "
                                         "(or wiki.{train,valid,test}.tokens)")
    data.add_argument("--max-vocab", type=vocab_cap, default=None, metavar="N",
                      help="keep the N most frequent training words, the others become <unk> "
                           "(default: 32768 for wikitext-103, no cap otherwise)")
    data.add_argument("--cache-dir", help="tokenised-data cache (default $COURSE_DATA_CACHE "
                                          "or data_cache/ in the repository)")
    data.add_argument("--seq-len", type=positive_int, default=None,
                      help="tokens per sample (default: the preset's max_seq_len)")
    data.add_argument("--num-workers", type=non_negative_int, default=default_num_workers(),
                      help="DataLoader workers per rank (default from SLURM_CPUS_PER_TASK)")
    model = p.add_argument_group("model")
    model.add_argument("--preset", choices=list(PRESETS), default="workshop")
    model.add_argument("--n-layers", type=positive_int, default=None, metavar="N",
                       help="Transformer blocks (default: the preset's; e.g. more blocks to "
                            "give every pipeline stage some, or several per rank)")
    model.add_argument("--dropout", type=probability, default=None,
                       help="dropout probability (default: the preset's)")
    train = p.add_argument_group("training")
    train.add_argument("--epochs", type=positive_int, default=10)
    train.add_argument("--max-steps", type=non_negative_int, default=None,
                       help="stop after this many optimizer steps (a short run; 0: only evaluate)")
    train.add_argument("--batch-size", type=positive_int, default=32, help="sequences per step and rank")
    train.add_argument("--lr", type=positive_float, default=1e-3)
    train.add_argument("--weight-decay", type=non_negative_float, default=0.1)
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
                     help="checkpoints, logs and summary.json (default runs/<script>[-<job id>]); "
                          "one run at a time (OUT_DIR/run.lock)")
    out.add_argument("--overwrite", action="store_true",
                     help="delete the results of an earlier run in --out-dir first (without it, "
                          "a run refuses to start where one finished, unless it resumes it)")
    out.add_argument("--logger", choices=["none", "tensorboard", "wandb"], default="tensorboard")
    out.add_argument("--log-every", type=positive_int, default=10, help="steps between loss prints")
    if not trains:
        for action in p._actions:
            if action.dest in UNUSED_WITHOUT_TRAINING:
                action.help = argparse.SUPPRESS
            elif action.dest == "out_dir":
                action.help = "summary.json (default runs/<script>[-<job id>])"
            elif action.dest == "overwrite":
                action.help = ("write summary.json into a folder that holds another run's "
                               "results (without it, the lesson refuses to)")
    return p

