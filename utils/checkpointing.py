"""Resuming a training script from its checkpoints: which checkpoint, and where to continue.

The bookkeeping around save_sharded_model and load_sharded_model (utils/distributed_utils.py),
so the FSDP lesson shows only the ideas: what a checkpoint keeps, load on every rank after
wrapping, continue from the saved position.
"""

from __future__ import annotations

import os
from pathlib import Path

from utils.distributed_utils import (CheckpointError, newest_good_checkpoint, print0,
                                     read_train_state)


def restart_count() -> tuple[int, str]:
    """(restarts, by whom): how often this run was started again by torchrun (--max-restarts,
    after a rank died) or by Slurm (a requeued job); (0, "") for a first start."""
    for variable, launcher in (("TORCHELASTIC_RESTART_COUNT", "torchrun"),
                               ("SLURM_RESTART_COUNT", "Slurm")):
        count = int(os.environ.get(variable) or 0)
        if count:
            return count, launcher
    return 0, ""


def resume_checkpoint(resume: str | None, folder: str | os.PathLike) -> Path | None:
    """The checkpoint folder to resume from, or None to start at step 0.

    `resume` is the --resume argument: a folder, "auto" (the newest complete checkpoint in
    `folder`, i.e. OUT_DIR/checkpoints, if there is one; a damaged one is skipped with one
    line, see newest_good_checkpoint) or None. A collective: call it on every rank. A restarted
    run (torchrun --max-restarts, Slurm requeue) always takes the newest checkpoint of its own
    folder: starting again from step 0 would throw away its progress and overwrite its
    checkpoints. It says so in one line.
    """
    restarts, launcher = restart_count()
    if resume != "auto" and not restarts:
        return Path(resume) if resume else None
    newest = newest_good_checkpoint(folder)
    why = f"{launcher} restart {restarts}" if restarts else "--resume auto"
    if newest is not None:
        print0(f"{why}: continuing from the newest complete checkpoint {newest} "
               f"(step {read_train_state(newest).get('step')})")
        return newest
    if resume not in (None, "auto"):
        print0(f"{why}: no checkpoint in {folder} yet, resuming from --resume {resume}")
        return Path(resume)
    print0(f"{why}: no checkpoint in {folder} yet, starting at step 0")
    return None


def resume_position(train_state: dict, global_batch: int, batches_per_epoch: int,
                    max_steps: int | None) -> tuple[int, int, int]:
    """(step, epoch, batch) at which a run continues from a checkpoint's train_state:
    the batch after the last one it trained on (the next epoch if that one was complete).

    A run resumed with another global batch (--batch-size x ranks) is refused: a resumed run is
    expected to be the same run, continued, with the losses of a run that never stopped.
    Another global batch would make it a different run (the learning rate and AdamW's moments
    belong to the old batch size, a step would mean another amount of data, and the loss
    history and summary would mix two batch sizes under one number). Another number of ranks
    with the same global batch is fine: DCP reshards, and the data order is the same.
    """
    saved = train_state["global_batch"]
    if global_batch != saved:
        raise CheckpointError(
            f"--resume: the checkpoint was trained with a global batch of {saved} sequences, "
            f"this run has {global_batch}: use --batch-size x ranks = {saved} (or start a new "
            "run without --resume)")
    step, epoch, batch = train_state["step"], train_state["epoch"], train_state["batches_done"]
    if batch >= batches_per_epoch:  # saved at the end of an epoch
        epoch, batch = epoch + 1, 0
    if max_steps is not None and step > max_steps:
        raise CheckpointError(
            f"--resume: the checkpoint is at step {step}, past --max-steps {max_steps}: raise "
            f"--max-steps (or set it to {step} to only evaluate and export)")
    return step, epoch, batch
