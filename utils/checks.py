"""Checks that stop a run early, with one line saying what to change, instead of failing late
(after hours of training) or finishing silently wrong.

Every function works with and without a process group; with one, all ranks stop together and
only one of them prints the line.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from utils.distributed_utils import collective_device, get_rank, get_world_size


def _stop(message: str, printer: bool) -> None:
    if printer:
        print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


def stop_if_not_finite(loss, step: int, what: str = "training loss") -> None:
    """Stop the run when `loss` is NaN or infinite, before anything is saved over a good file.

    Give it a loss that is the same on every rank (the all-reduced one), so all ranks stop at
    the same step. Reading the value waits for the step to finish (one sync per step).
    """
    value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
    if not math.isfinite(value):
        _stop(f"the {what} is {value} at step {step}: training diverged; stopping before "
              "anything is saved over earlier files: lower --lr", get_rank() == 0)


def check_writable(folder: str | os.PathLike, flag: str = "--out-dir") -> None:
    """Check that this process can write into `folder` (or create it), before any training.

    Every rank checks, because every rank writes there (sharded checkpoints) and because a
    folder on a node's local disk may work on one node and not on another. mkstemp gives each
    rank its own file name, so ranks on a shared file system do not collide. When any rank
    fails, all stop; the first failing rank prints the line.
    """
    folder = Path(folder)
    # Probe the folder, or the nearest folder above it that exists (where it would be created):
    # a run that stops later for another reason leaves no empty output folder behind.
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    error = None
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        error = e.strerror or str(e)
    rank, world_size = get_rank(), get_world_size()
    first_failing = rank if error else world_size
    if dist.is_initialized():
        t = torch.tensor(first_failing, device=collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        first_failing = int(t.item())
    if first_failing < world_size:  # every rank stops; the first one that failed says why
        _stop(f"cannot write to {flag} {folder} ({error}): give a folder you can write to",
              rank == first_failing)
