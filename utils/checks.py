"""Checks that stop a run early, with one line saying what to change, instead of failing late
(after hours of training) or finishing silently wrong.

Every function works with and without a process group; with one, all ranks stop together and
only one of them prints the line.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from utils.launch import tell_torchrun


def _rank() -> int:
    """This process's rank (0 without a process group). This module comes below
    utils/distributed_utils.py (whose save0 stops after a NaN loss), so it asks torch itself."""
    return dist.get_rank() if dist.is_initialized() else 0


def _stop(message: str, printer: bool) -> None:
    if printer:
        print(f"error: {message}", file=sys.stderr, flush=True)
    tell_torchrun(f"error: {message}")  # every rank: whichever torchrun names, it says why
    if dist.is_initialized():  # every rank stops here: leave the group (or gloo aborts at exit)
        dist.destroy_process_group()
        _exit_without_teardown(1)
    sys.exit(1)


def _exit_without_teardown(status: int) -> None:
    """Exit as sys.exit would, but skip the interpreter's teardown of live objects.

    Stopping mid-training leaves DDP's reducer alive, holding the gloo process group; Python's
    teardown frees it while holding the GIL, and the group's destructor joins its worker thread,
    which may still be letting go of the last all-reduce's tensors and needs the GIL for that:
    a deadlock, and the run hangs after its error line (1 in about 50 diverging runs on a busy
    2-core machine, stacks taken with py-spy and gdb). The exit handlers still run (the run lock
    is released), and the output is flushed.
    """
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def stop_on_every_rank(message: str) -> None:
    """Stop a run whose every rank found the same problem (a flag that does not fit the model or
    the world size): one `error: ...` line from rank 0, not one per rank."""
    _stop(message, _rank() == 0)


# Losses on a GPU that stop_if_not_finite has not read yet: (step, loss, what)
_unread: list[tuple[int, torch.Tensor, str]] = []
UNREAD_LIMIT = 1000  # read them at the latest every this many steps


def _on_gpu(loss) -> bool:
    return isinstance(loss, torch.Tensor) and loss.device.type != "cpu"


def stop_if_not_finite(loss, step: int, what: str = "training loss") -> None:
    """Stop the run when `loss` is NaN or infinite, before anything is saved over a good file.

    Give it a loss that is the same on every rank (the all-reduced one), so all ranks stop at
    the same step. Reading a GPU tensor waits for the GPU, so a loss on a GPU is kept and read
    later, all unread ones at once: at the next log step (TrainingMonitor.report), before
    every save (save0, save_full_model, save_sharded_model, atomic_folder) and before a
    validation loss is checked. The error line still names the first step that diverged. On a
    CPU reading is free, and the check is immediate.
    """
    if _on_gpu(loss):
        _unread.append((step, loss.detach(), what))
        if len(_unread) >= UNREAD_LIMIT:
            stop_if_a_loss_was_not_finite()
        return
    stop_if_a_loss_was_not_finite()
    value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
    if not math.isfinite(value):
        _diverged(what, value, step)


def stop_if_a_loss_was_not_finite() -> None:
    """Read the losses stop_if_not_finite kept on the GPU (one wait for all), and stop at the
    first that is not finite. Call it on every rank at the same points (the losses are the same
    on every rank, so every rank decides alike)."""
    if not _unread:
        return
    pending = list(_unread)
    _unread.clear()
    finite = torch.isfinite(torch.stack([loss.reshape(()).float() for _, loss, _ in pending]))
    for (step, loss, what), ok in zip(pending, finite.tolist()):
        if not ok:
            _diverged(what, float(loss), step)


def _diverged(what: str, value: float, step: int) -> None:
    rank = _rank()
    if rank != 0:
        # rank 0 says why for all; a rank whose value is its own (the loss not all-reduced, or
        # a validation loss computed on rank 0 only) may stop alone, and must not stop silently
        print(f"error: rank {rank}: the {what} is {value} at step {step}", file=sys.stderr,
              flush=True)
    _stop(f"the {what} is {value} at step {step}: training diverged; stopping before "
          "anything is saved over earlier files: lower --lr", rank == 0)


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
    rank, world_size = _rank(), dist.get_world_size() if dist.is_initialized() else 1
    first_failing = rank if error else world_size
    if dist.is_initialized():  # NCCL takes GPU tensors only
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        t = torch.tensor(first_failing, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        first_failing = int(t.item())
    if first_failing < world_size:  # every rank stops; the first one that failed says why
        _stop(f"cannot write to {flag} {folder} ({error}): give a folder you can write to",
              rank == first_failing)


# What a run leaves in --out-dir that a later run would overwrite (checkpoints/ only when it
# holds something), and what --overwrite deletes besides (logs of the earlier run).
RESULTS = ("summary.json", "vocab.txt", "best_model.pt", "final_model.pt", "best_model",
           "final_model", "checkpoints", "hpc_ckpt_*.ckpt")
LOGS = ("tensorboard", "profile", "wandb", "wandb-cache")


def earlier_results(folder: str | os.PathLike) -> list[str]:
    """The results of an earlier run in `folder` (names, sorted)."""
    folder = Path(folder)
    found = {p.name for pattern in RESULTS for p in folder.glob(pattern)
             if not (p.is_dir() and not any(p.iterdir()))}
    return sorted(found)


def _launch_rank() -> int:
    """This process's global rank, also before a process group exists (Lightning starts its
    processes first): RANK from torchrun or Lightning, SLURM_PROCID from srun."""
    if dist.is_initialized():
        return dist.get_rank()
    for variable in ("RANK", "SLURM_PROCID"):
        if os.environ.get(variable, "").isdigit() and (variable != "SLURM_PROCID"
                                                       or "SLURM_STEP_NUM_TASKS" in os.environ):
            return int(os.environ[variable])
    if os.environ.get("NODE_RANK", "0") != "0":  # Lightning's processes on another node
        return 1
    return int(os.environ.get("LOCAL_RANK") or 0)  # Lightning's own processes on one node


def _listed(folder: Path, names: list[str]) -> str:
    """"checkpoints/, summary.json": the names in `folder`, a folder's with a slash."""
    return ", ".join(f"{n}/" if (folder / n).is_dir() else n for n in names)


def _stop_if_rank0_found(problem: str | None, rank: int) -> None:
    """Rank 0 decided (problem, or None on the other ranks): every rank stops together with
    its one line, or all go on."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [problem]
        dist.broadcast_object_list(box, src=0)
        problem = box[0]
    if problem:
        _stop(problem, rank == 0)


def claim_lesson_out_dir(args, own_key: str) -> None:
    """Before a lesson that trains nothing and writes only OUT_DIR/summary.json (the
    collectives lesson, run again after every TODO): its own summary.json (one with `own_key`)
    is replaced without asking, but a folder holding another run's results (a training run's
    checkpoints and summary.json: runs/perf belongs after --trace, not --out-dir) is left
    alone unless --overwrite says to replace its summary.json. Call it on every rank, right
    after setup(): rank 0 decides, all ranks stop together with one line."""
    out_dir = Path(args.out_dir)
    check_writable(out_dir)
    rank, problem = _launch_rank(), None
    if rank == 0:
        summary = out_dir / "summary.json"
        try:
            own = summary.is_file() and own_key in json.loads(summary.read_text())
        except (OSError, ValueError):  # unreadable: not the lesson's
            own = False
        theirs = [n for n in earlier_results(out_dir) if not (n == "summary.json" and own)]
        if theirs and not args.overwrite:
            problem = (f"--out-dir {out_dir} holds the results of another run "
                       f"({_listed(out_dir, theirs)}): "
                       "choose another --out-dir for the lesson (a profiled run's folder goes "
                       "after --trace), or replace its summary.json with --overwrite")
    _stop_if_rank0_found(problem, rank)


def remove_leftovers(folder: Path) -> None:
    """Delete what a killed run left half-written in `folder`: temporary files (.NAME.*.tmp)
    and the staging folders of checkpoints (.NAME.partial). Nothing ever reads them; they only
    take space. Call it only while holding the folder's lock (no other run writes there)."""
    for path in folder.rglob(".*"):
        if path.is_file() and path.name.endswith(".tmp"):
            path.unlink(missing_ok=True)
        elif path.is_dir() and path.name.endswith(".partial"):
            shutil.rmtree(path, ignore_errors=True)


def claim_out_dir(args) -> None:
    """Before any training: --out-dir is writable by every rank (check_writable), belongs to
    this run alone (OUT_DIR/run.lock, see utils/run_lock.py), and holds no results of an
    earlier run, unless this run continues it (--resume, a torchrun restart, a requeued Slurm
    job) or --overwrite says to delete them first (at the first start: a restart with the same
    arguments continues from what its first start wrote). Otherwise one line says what to do.

    From here on, a full disk anywhere ends the process with one line (utils/files.py).
    Call it on every rank, right after setup(): rank 0 decides, all ranks stop together.
    """
    from utils.files import one_line_for_a_full_disk
    from utils.launch import restart_count
    from utils.run_lock import take

    out_dir = Path(args.out_dir)
    check_writable(out_dir)
    one_line_for_a_full_disk(out_dir)
    rank = _launch_rank()
    resume, overwrite = getattr(args, "resume", None), getattr(args, "overwrite", False)
    problem = None
    if rank == 0:
        found = earlier_results(out_dir)
        if resume and overwrite:
            problem = ("--overwrite deletes the checkpoints that --resume continues from: "
                       "give one of them")
        else:  # first the lock: a run still writing there is named, whatever it has written
            problem = take(out_dir, say=lambda line: print(line, flush=True))
        restarts, launcher = restart_count()
        if problem is None and found and not (resume or overwrite or restarts):
            again = "continue it with --resume auto, " if hasattr(args, "resume") else ""
            problem = (f"--out-dir {out_dir} holds the results of an earlier run "
                       f"({_listed(out_dir, found)}): "
                       f"{again}delete them with --overwrite, or choose another --out-dir")
        if problem is None:
            remove_leftovers(out_dir)
        if problem is None and overwrite and found and restarts:
            # the first start deleted the earlier run's files; these are this run's own, and
            # the restart continues from its checkpoints (a requeued `sbatch ... --overwrite`)
            print(f"--overwrite: kept {', '.join(found)} in {out_dir}: this is {launcher} "
                  f"restart {restarts} of the run that wrote them", flush=True)
        elif problem is None and overwrite and found:
            for name in [*found, *LOGS]:
                for path in out_dir.glob(name):
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
            print(f"--overwrite: deleted the earlier run's {', '.join(found)} in {out_dir}",
                  flush=True)
    _stop_if_rank0_found(problem, rank)
