"""Lightning's checkpoints made as safe as the plain scripts' (utils/checkpointing.py):
written atomically, checked when read back, carrying every rank's random-number states, and
resumed from the newest good one after a requeue. Only the Lightning variant imports this file.

Lightning alone writes a .ckpt through fsspec into a temporary file in /tmp and then copies
it over: a kill or a full disk during that copy leaves a truncated .ckpt in the output folder
(and a later requeue resumes from whichever hpc_ckpt_N.ckpt is newest, damaged or not).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import TorchCheckpointIO

from utils.files import atomic_torch_save, torch_file_problem
from utils.launch import restart_count
from utils.rng import rng_states, set_rng_states


class AtomicCheckpointIO(TorchCheckpointIO):
    """torch.save to a temporary file beside the checkpoint, fsync, rename (utils/files.py): a
    .ckpt is complete or absent. A full disk ends the run with one line."""

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        atomic_torch_save(checkpoint, path)


class RandomStates(Callback):
    """Every rank's random-number states (Python, NumPy, torch CPU and CUDA) in each checkpoint
    (rank 0 writes the file: it gathers them), and put back on resume, so dropout continues
    exactly (at the world size that saved; at another one each rank continues from rank 0's)."""

    def state_dict(self) -> dict:
        mine = rng_states()
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return {"ranks": [mine]}
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)  # every rank saves together (a collective)
        return {"ranks": ranks}

    def load_state_dict(self, state_dict: dict) -> None:
        ranks = state_dict["ranks"]
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        set_rng_states(ranks[rank] if len(ranks) == world_size else ranks[0])


def checkpoint_step(path: str | os.PathLike) -> int:
    """The global step a Lightning .ckpt was saved at (mmap: the tensors are not read)."""
    return int(torch.load(path, mmap=True, map_location="cpu", weights_only=True)["global_step"])


def candidates(out_dir: str | os.PathLike) -> list[Path]:
    """Every .ckpt a run in `out_dir` writes: hpc_ckpt_N.ckpt (requeue at the time limit) and
    checkpoints/*.ckpt (best, last, and every --checkpoint-every steps)."""
    out_dir = Path(out_dir)
    return sorted([*out_dir.glob("hpc_ckpt_*.ckpt"), *(out_dir / "checkpoints").glob("*.ckpt")])


def newest_good_checkpoint(out_dir: str | os.PathLike, say=print, rank_0: bool = True
                           ) -> Path | None:
    """The .ckpt with the highest step whose contents match their checksums. Rank 0 renames a
    damaged one to NAME.damaged (so that Lightning's own requeue logic cannot pick it either)
    and says so in one line; the other processes come to the same answer without a word."""
    found, damaged = [], []
    for path in candidates(out_dir):
        try:  # cheap: the step only (mmap reads no tensor)
            found.append((checkpoint_step(path), path.name.startswith("hpc_ckpt_"), path))
        except Exception:  # noqa: BLE001 - any unreadable checkpoint is damaged
            damaged.append((path, torch_file_problem(path) or "it cannot be read"))
    good = None
    for *_, path in sorted(found, reverse=True):  # the newest first, until one is whole
        problem = torch_file_problem(path)
        if problem is None:
            good = path
            break
        damaged.append((path, problem))
    for path, problem in damaged if rank_0 else []:
        aside = path.with_name(path.name + ".damaged")
        with contextlib.suppress(OSError):
            os.replace(path, aside)
        say(f"WARNING: checkpoint {path} is damaged ({problem}): skipping it (moved to "
            f"{aside.name})")
    return good


def resume_path(resume: str | None, out_dir: str | os.PathLike, say=print,
                rank_0: bool = True) -> str | None:
    """What trainer.fit(ckpt_path=...) resumes from: --resume PATH (checked: one line if it is
    damaged), or with --resume auto or a requeued job (SLURM_RESTART_COUNT) the newest good
    checkpoint of `out_dir`; None to start at step 0. Every process calls it before
    trainer.fit and comes to the same answer; only rank 0 (`rank_0`) speaks and renames."""
    restarts, launcher = restart_count()
    if resume not in (None, "auto"):
        problem = torch_file_problem(resume) if Path(resume).is_file() else "there is no such file"
        if problem:
            other = newest_good_checkpoint(out_dir, say, rank_0)
            instead = f"resume from {other} instead" if other else "start again without --resume"
            raise SystemExit(f"error: checkpoint {resume} cannot be loaded: {problem}; {instead}"
                             if rank_0 else 1)
        if not restarts:
            return resume
    if resume is None and not restarts:
        return None
    why = f"{launcher} restart {restarts}" if restarts else "--resume auto"
    newest = newest_good_checkpoint(out_dir, say, rank_0)
    if newest is not None:
        say(f"{why}: continuing from the newest complete checkpoint {newest} "
            f"(step {checkpoint_step(newest)})")
        return str(newest)
    if resume not in (None, "auto"):
        say(f"{why}: no checkpoint in {out_dir} yet, resuming from --resume {resume}")
        return resume
    say(f"{why}: no checkpoint in {out_dir} yet, starting at step 0")
    return None
