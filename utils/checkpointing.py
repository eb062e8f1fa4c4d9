"""Checkpoints: saving a model and its training state, whole or not at all, and finding the
checkpoint a run continues from.

- save_full_model: the full weights of a sharded model (FSDP, TP) gathered into one ordinary
  state_dict file on rank 0, for inference or sharing.
- save_sharded_model, load_sharded_model: a Distributed Checkpoint (DCP) folder in which every
  rank writes and reads its own shards, with the optimizer, train_state.json and every rank's
  random-number states (a resumed run continues exactly); use_async_checkpoint_saves lets the
  files be written while training goes on.
- atomic_folder: a folder every rank writes into that appears only when all have finished,
  with a manifest of every file's size and CRC-32 (the pipeline steps save through it too).
- Which checkpoint: checkpoint_problem (complete?), checkpoint_damage (intact?),
  sealed_folder_problem (any atomic_folder complete?),
  latest_checkpoint, newest_good_checkpoint, usable_checkpoint, read_train_state.
- Resuming a run: resume_checkpoint (--resume, restarts by torchrun or Slurm) and
  resume_position (where in the data to continue).

Single files (save0, the exported models) are written atomically by utils/files.py. Every
function works with and without a process group; call the collective ones on every rank.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_model_state_dict,
                                                     set_state_dict)
from torch.distributed.checkpoint.stateful import Stateful

from utils.checks import stop_if_a_loss_was_not_finite
from utils.distributed_utils import (all_reduce_sum, barrier, before_teardown, get_rank,
                                     get_world_size, is_root_process, print0)
from utils.files import (atomic_torch_save, crc32_file, disk_full_message, fsync_folder,
                         is_disk_full, write_synced)
from utils.launch import restart_count
from utils.rng import rng_states, set_rng_states

TRAIN_STATE_FILE = "train_state.json"
MANIFEST = "manifest.json"  # the completion marker of a checkpoint folder: its files and CRC-32s
RNG_FOLDER = "rng"          # every rank's random-number states: rank_0.pt, rank_1.pt, ...


class CheckpointError(SystemExit):
    """A checkpoint that cannot be saved or loaded, with one line that says what to do instead.

    A SystemExit: a script that does not catch it ends with status 1 and that line, not with a
    traceback of DCP's internals. Raise it on every rank at the same point (none may be left
    waiting in a collective): rank 0 prints the line, then all ranks wait for each other, so
    no rank exits (and makes torchrun stop the others) before the line is out.
    """

    def __init__(self, message: str):
        super().__init__(message)
        self.code = 1
        if is_root_process():
            print(f"error: {message}", file=sys.stderr, flush=True)
        barrier()


# ---------------------------------------------------------------------------------------------
# The full model, for inference: one ordinary state_dict file

def save_full_model(model: nn.Module, path: str | os.PathLike) -> None:
    """Gather the full weights on rank 0 (into CPU memory) and write one ordinary state_dict.

    Call it on every rank (gathering is a collective). The file loads with
    torch.load(path, weights_only=True) into a plain TransformerLM, without any process group:
    for inference or sharing. cpu_offload keeps the full model out of GPU memory; the other
    ranks receive an empty dict.
    """
    stop_if_a_loss_was_not_finite()  # a NaN loss kept on the GPU: save nothing after it
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    with quiet_sequential_gathers():
        state = get_model_state_dict(model, options=options)
    if is_root_process():
        atomic_torch_save(state, path)
    barrier()


class _SequentialGathers(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("While redistributing") and "all_gather" in message)


@contextlib.contextmanager
def quiet_sequential_gathers():
    """Leave out DTensor's warning that a weight sharded over two mesh dimensions (TP x FSDP)
    is gathered by two all_gathers in a row, which "may give inconsistent results between
    ranks due to different reduction orders": a gather adds nothing up, so for it that cannot
    happen (docs/tp.md). Other warnings of DTensor still show."""
    quiet = _SequentialGathers()
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    log.addFilter(quiet)
    try:
        yield
    finally:
        log.removeFilter(quiet)


# ---------------------------------------------------------------------------------------------
# Sharded checkpoints (FSDP, tensor parallelism): Distributed Checkpoint (DCP)

class AppState(Stateful):
    """Model and optimizer as one item for torch.distributed.checkpoint.

    DCP calls state_dict() when saving and load_state_dict() after loading. get_state_dict and
    set_state_dict translate between this rank's shards and fully qualified parameter names, so
    the files do not depend on how the model was wrapped or on how many ranks wrote them.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        if self.optimizer is None:
            return {"model": get_model_state_dict(self.model)}
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state}

    def load_state_dict(self, state_dict: dict) -> None:
        if self.optimizer is None:
            set_model_state_dict(self.model, state_dict["model"])
        else:
            set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                           optim_state_dict=state_dict["optim"])


def save_sharded_model(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                       path: str | os.PathLike, train_state: dict | None = None) -> Path:
    """Write a DCP checkpoint folder: every rank writes its own shards, in parallel.

    Call it on every rank, with the same `path` on a file system all ranks share. Besides the
    weights and the optimizer state, the folder holds train_state.json (step, epoch, model
    configuration: anything JSON) and every rank's random-number states (rng/rank_N.pt: what
    dropout draws next), so a resumed run continues exactly. The folder appears only when
    complete (see atomic_folder): a save that fails or is killed leaves the previous
    checkpoint untouched; a full disk ends the run with one line (CheckpointError).
    """
    path = Path(path)
    started = time.perf_counter()
    finish_checkpoint_saves()  # an asynchronous save still writing: seal it first
    _stop_if_weights_are_not_finite(model, path, (train_state or {}).get("step"))
    expected = lambda: _checkpoint_bytes(path, model, optimizer)  # noqa: E731
    if not _ASYNC["enabled"]:
        with atomic_folder(path, expected) as folder:
            dcp.save({"app": AppState(model, optimizer)}, checkpoint_id=folder)
            _write_train_and_rng_state(folder, train_state)
        _ASYNC["blocking_s"].append(time.perf_counter() - started)
        return path
    # dcp.async_save copies this rank's shards to host memory and returns; a thread writes the
    # files (on a process group of its own: collectives of two threads must not share one)
    # while training goes on. The folder is sealed by the next save or finish_checkpoint_saves.
    partial = _open_partial(path, expected)
    if _ASYNC["group"] is None:
        _ASYNC["group"] = dist.new_group(backend="gloo") if dist.is_initialized() else None
    error = None
    try:
        _write_train_and_rng_state(partial, train_state)
        future = dcp.async_save({"app": AppState(model, optimizer)}, checkpoint_id=partial,
                                process_group=_ASYNC["group"])
        _ASYNC["pending"] = (future, path, partial, expected)
    except (Exception, CheckpointException) as e:
        error = e
    if error is not None:
        _close_partial(error, path, partial, expected)  # raises CheckpointError on every rank
    _ASYNC["blocking_s"].append(time.perf_counter() - started)
    return path


def _write_train_and_rng_state(folder: Path, train_state: dict | None) -> None:
    (folder / RNG_FOLDER).mkdir(exist_ok=True)
    states = io.BytesIO()
    torch.save(rng_states(), states)
    write_synced(folder / RNG_FOLDER / f"rank_{get_rank()}.pt", states.getvalue())
    if is_root_process():
        write_synced(folder / TRAIN_STATE_FILE, json.dumps(train_state or {}, indent=1) + "\n")


def _stop_if_weights_are_not_finite(model: nn.Module, path: Path, step) -> None:
    """A checkpoint between validations (--checkpoint-every) comes after a step whose loss was
    finite but whose update may have made the weights NaN: never save those over a good
    checkpoint (a restart would resume from them). One pass over this rank's shards."""
    bad = any(not torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all()
              for p in model.parameters())
    if all_reduce_sum(torch.tensor(float(bad))).item():
        at = f" at step {step}" if step is not None else ""
        raise CheckpointError(f"the weights are NaN or infinite{at}: training diverged; not "
                              f"saving them over {path}, which keeps the last good checkpoint: "
                              "lower --lr")


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _checkpoint_bytes(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None
                      ) -> float:
    """About how many bytes a checkpoint of model and optimizer takes: the size of the previous
    one if there is one, else the tensors of all ranks' shards (a collective)."""
    for folder in (path, _sibling(path, "old")):
        if folder.is_dir():
            return _folder_bytes(folder)
    tensors = list(model.state_dict().values())
    if optimizer is not None:
        tensors += [v for s in optimizer.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor)]
    local = sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size()
                for t in tensors)
    return all_reduce_sum(torch.tensor(float(local), dtype=torch.float64)).item()


def load_sharded_model(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                       path: str | os.PathLike, model_config: dict | None = None) -> dict:
    """Load a checkpoint written by save_sharded_model into `model` (and `optimizer`).

    Call it on every rank, after wrapping the model and making the optimizer. The world size
    may differ from the one that saved: each rank reads the pieces of the files that overlap
    its own shards. With an optimizer (resuming training), each rank also gets back its
    random-number states, so dropout continues as in a run that never stopped (exactly only
    at the world size that saved: another one splits the batch, and so the dropout masks,
    differently; one line says so). Returns the checkpoint's train_state. A damaged
    checkpoint, or with `model_config` a checkpoint of another model, ends the run with one
    line (CheckpointError) before any tensor is read.
    """
    finish_checkpoint_saves()  # an asynchronous save of this run still writing
    path = usable_checkpoint(path)
    train_state = read_train_state(path)
    saved = train_state.get("model_config")
    if model_config is not None and saved is not None and saved != model_config:
        diff = ", ".join(f"{k} {saved.get(k)} (checkpoint) vs {model_config.get(k)} (now)"
                         for k in sorted(set(saved) | set(model_config))
                         if saved.get(k) != model_config.get(k))
        raise CheckpointError(f"checkpoint {path} was written for another model: {diff}; use "
                              "the --preset, --seq-len and data of the run that wrote it")
    try:
        dcp.load({"app": AppState(model, optimizer)}, checkpoint_id=path)
    except CheckpointException as e:  # damage the checks above cannot see (every rank gets it)
        first = next(iter(e.failures.values()))
        first = first[0] if isinstance(first, tuple) else first
        raise CheckpointError(f"checkpoint {path} cannot be loaded: "
                              f"{type(first).__name__}: {str(first).splitlines()[0]}") from e
    if optimizer is not None:
        _restore_rng_states(path)
    return train_state


def _restore_rng_states(path: Path) -> None:
    saved = sorted((path / RNG_FOLDER).glob("rank_*.pt"), key=lambda f: int(f.stem[5:]))
    if not saved:
        return
    rank, world_size = get_rank(), get_world_size()
    if len(saved) != world_size:
        print0(f"note: {path} holds the random-number states of {len(saved)} rank(s), this run "
               f"has {world_size}: each rank continues from rank 0's, so with dropout the "
               "losses differ slightly from a run that never stopped")
        rank = 0
    set_rng_states(torch.load(saved[rank], weights_only=True))


# ---------------------------------------------------------------------------------------------
# Asynchronous saves (--async-save)

# dcp.async_save: whether saves are asynchronous, the save still writing, the
# process group its thread uses, and how long every save call blocked the training loop
_ASYNC = {"enabled": False, "pending": None, "group": None, "blocking_s": []}


def use_async_checkpoint_saves(enabled: bool = True) -> None:
    """From now on save_sharded_model returns once this rank's shards are copied to host memory
    (dcp.async_save); the files are written while training continues. A checkpoint folder
    appears (complete, atomically) when the next save starts or finish_checkpoint_saves() is
    called: so a kill loses at most two --checkpoint-every intervals, not one."""
    _ASYNC["enabled"] = enabled
    if finish_checkpoint_saves not in before_teardown:  # destroy_process_group seals the last
        before_teardown.append(finish_checkpoint_saves)


def finish_checkpoint_saves() -> None:
    """Wait for an asynchronous save still writing and seal its folder (call on every rank,
    before reading a checkpoint or leaving the process group)."""
    if _ASYNC["pending"] is None:
        return
    future, path, partial, expected = _ASYNC["pending"]
    _ASYNC["pending"] = None
    error = None
    try:
        future.result()
    except (Exception, CheckpointException) as e:
        error = e
    _close_partial(error, path, partial, expected)


def checkpoint_blocking_seconds() -> list[float]:
    """How long each save_sharded_model call held up training, in order."""
    return list(_ASYNC["blocking_s"])


# ---------------------------------------------------------------------------------------------
# Which checkpoint: complete (a manifest), intact (its checksums), the newest

def checkpoint_problem(path: str | os.PathLike) -> str | None:
    """Why `path` is not a complete checkpoint written by save_sharded_model; None if it is.

    Cheap checks only, the same on every rank: the completion marker MANIFEST is there, every
    file it names exists with its size (checkpoint_damage compares the contents), and
    train_state.json is readable.
    """
    path = Path(path)
    problem = sealed_folder_problem(path)
    if problem is not None:
        return problem
    if TRAIN_STATE_FILE not in json.loads((path / MANIFEST).read_text())["files"]:
        return f"it has no {TRAIN_STATE_FILE}, so save_sharded_model did not write it"
    try:  # readable by people, and editable (e.g. best_val): checked by reading it
        json.loads((path / TRAIN_STATE_FILE).read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"its {TRAIN_STATE_FILE} is missing or unreadable"
    return None


def sealed_folder_problem(path: str | os.PathLike) -> str | None:
    """Why `path` is not a complete folder written through atomic_folder (a checkpoint, or the
    pipeline steps' final_model); None if it is: its MANIFEST is there and every file it names
    exists with its size. Cheap: no file is read but the manifest."""
    path = Path(path)
    if not path.is_dir():
        return "there is no such folder"
    if not (path / MANIFEST).is_file():
        return f"it has no {MANIFEST}, so the save that wrote it did not finish"
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"its {MANIFEST} is unreadable"
    for name, entry in files.items():
        if name == TRAIN_STATE_FILE:  # editable by hand: checked by reading it
            continue
        what = _what_file(name)
        if not (path / name).is_file():
            return f"{what} is missing"
        if (path / name).stat().st_size != entry["bytes"]:
            return (f"{what} is truncated or damaged" if name == ".metadata"
                    else f"{what} is truncated" if (path / name).stat().st_size < entry["bytes"]
                    else f"{what} has another size than when it was written")
    return None


def _what_file(name: str) -> str:
    if name == ".metadata":
        return "its .metadata file"
    if name.endswith(".distcp"):
        return f"its shard file {name}"
    return f"its file {name}"


_verified: set = set()  # checkpoints whose contents this process has checked already


def checkpoint_damage(path: str | os.PathLike) -> str | None:
    """Why the files of the complete checkpoint `path` differ from what was written, or None:
    every rank reads its share of the files and compares their CRC-32 with the manifest (a
    collective; about a third of a second per GB and rank, docs/benchmarks.md)."""
    path = Path(path)
    marker = path / MANIFEST
    key = (str(path.resolve()), marker.stat().st_mtime_ns if marker.is_file() else None)
    if key in _verified:
        return None
    files = sorted((name, entry) for name, entry in json.loads(marker.read_text())["files"].items()
                   if name != TRAIN_STATE_FILE)  # editable by hand: checked by reading it
    problem = None
    for name, entry in files[get_rank()::get_world_size()]:
        try:
            if crc32_file(path / name) != entry["crc32"]:
                problem = f"{_what_file(name)} does not match its checksum (CRC-32)"
        except OSError as e:
            problem = f"{_what_file(name)} cannot be read ({e.strerror})"
        if problem:
            break
    problem = next((p for p in _from_all(problem) if p), None)
    if problem is None:
        _verified.add(key)
    return problem


def latest_checkpoint(folder: str | os.PathLike, exclude: str | os.PathLike | None = None
                      ) -> Path | None:
    """The complete checkpoint with the highest step in `folder` (OUT_DIR/checkpoints), or None.

    Looks at every checkpoint folder there (last, best, and .NAME.old left by a save that
    crashed between its two renames); skips incomplete ones (checkpoint_problem),
    .NAME.partial and `exclude`. At the same step it prefers `last`.
    """
    found = _checkpoints_newest_first(folder, exclude)
    return found[0] if found else None


def _checkpoints_newest_first(folder: str | os.PathLike,
                              exclude: str | os.PathLike | None = None) -> list[Path]:
    folder = Path(folder)
    found = []
    for sub in sorted(folder.iterdir()) if folder.is_dir() else []:
        if sub.name.endswith(".partial") or (exclude and sub == Path(exclude)):
            continue
        if checkpoint_problem(sub) is None:
            step = read_train_state(sub).get("step", 0)
            found.append((step, not sub.name.startswith("."), sub.name == "last", sub))
    return [f[-1] for f in sorted(found, reverse=True)]


def newest_good_checkpoint(folder: str | os.PathLike) -> Path | None:
    """latest_checkpoint, with its contents checked (a collective): a damaged one is skipped
    with one line, and the next newest is tried. What --resume auto and restarts use."""
    for candidate in _from_root(_checkpoints_newest_first(folder)):
        damage = checkpoint_damage(candidate)
        if damage is None:
            return candidate
        print0(f"WARNING: checkpoint {candidate} is damaged ({damage}): skipping it")
    return None


def read_train_state(path: str | os.PathLike) -> dict:
    """train_state.json of a checkpoint folder written by save_sharded_model."""
    path = Path(path)
    if not (path / TRAIN_STATE_FILE).is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint folder written by "
                                f"save_sharded_model (it has no {TRAIN_STATE_FILE})")
    return json.loads((path / TRAIN_STATE_FILE).read_text())


def usable_checkpoint(path: str | os.PathLike) -> Path:
    """`path` if it is a complete checkpoint whose files match their checksums; its .NAME.old
    if a save crashed between its two renames (NAME gone, the previous checkpoint complete
    under the other name). Otherwise one line (CheckpointError) naming the problem and the
    checkpoint to use instead. A collective: call it on every rank."""
    path = Path(path)
    problem = checkpoint_problem(path)
    if problem is None:
        problem = checkpoint_damage(path)
        if problem is None:
            return path
    else:
        old = _sibling(path, "old")
        if not path.exists() and checkpoint_problem(old) is None and checkpoint_damage(old) is None:
            print0(f"checkpoint {path} is missing: a save stopped between its two renames; "
                   f"loading the previous checkpoint {old}")
            return old
    other = latest_checkpoint(path.parent, exclude=path)
    instead = (f"resume from {other} (step {read_train_state(other).get('step')}) instead"
               if other else "start again without --resume")
    raise CheckpointError(f"checkpoint {path} cannot be loaded: {problem}; {instead}")


# ---------------------------------------------------------------------------------------------
# Resuming a run: which checkpoint, and where in the data to continue

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


# ---------------------------------------------------------------------------------------------
# The atomic folder: written as .NAME.partial, sealed with a manifest, renamed into place

@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike, expected_bytes=None):
    """A folder that every rank writes into, appearing under `path` only when every rank has
    finished:
        with atomic_folder(out_dir / "final_model") as folder:
            dcp.save(model.state_dict(), checkpoint_id=folder)

    Call it on every rank, with the same `path` on a file system all ranks share. The ranks
    write into .NAME.partial. When all are done without error, each computes the CRC-32 of its
    share of the files, and rank 0 writes the completion marker MANIFEST (manifest.json: every
    file with its size and CRC-32), renames the previous NAME to .NAME.old, .NAME.partial to
    NAME, and deletes .NAME.old. So a kill or a full disk at any moment leaves the previous
    folder complete (killed between the two renames: as .NAME.old, which the loaders find), and
    a folder without its marker is never taken for a complete one. If any rank fails, all
    raise CheckpointError with one line (a full disk: the space to free, estimated by
    `expected_bytes`, a function called on every rank) and .NAME.partial is deleted.
    """
    stop_if_a_loss_was_not_finite()  # a NaN loss kept on the GPU: save nothing after it
    path = Path(path)
    partial = _open_partial(path, expected_bytes)
    error = None
    try:
        yield partial
    # (DCP's CheckpointException is a BaseException, not an Exception)
    except (Exception, CheckpointException) as e:  # every rank must learn of it, all stop
        error = e
    _close_partial(error, path, partial, expected_bytes)


def _open_partial(path: Path, expected_bytes=None) -> Path:
    """atomic_folder's start: an empty .NAME.partial, on every rank (a collective)."""
    partial, old = _sibling(path, "partial"), _sibling(path, "old")
    error = None
    if is_root_process():
        try:
            shutil.rmtree(partial, ignore_errors=True)  # left over from an interrupted save
            if path.exists():  # NAME is complete: an .NAME.old beside it is a leftover too
                shutil.rmtree(old, ignore_errors=True)
            partial.mkdir(parents=True)
        except OSError as e:
            error = e
    _stop_if_any_failed(error, path, partial, expected_bytes)
    return partial


def _close_partial(error, path: Path, partial: Path, expected_bytes=None) -> None:
    """atomic_folder's end: every rank has written (or failed); seal .NAME.partial as NAME."""
    _stop_if_any_failed(error, path, partial, expected_bytes)  # also: every rank is done writing
    _stop_if_any_failed(_seal_folder(partial, path, _sibling(path, "old")), path, partial,
                        expected_bytes)
    barrier()  # nobody reads `path` before it is complete


def _stop_if_any_failed(error: BaseException | None, path: Path, partial: Path,
                        expected_bytes) -> None:
    """A collective: if any rank has an error, delete `partial` and raise CheckpointError on
    every rank (one line, from the first failing rank's error)."""
    failures = _from_all(None if error is None else _describe(error))
    if not any(failures):
        return
    if is_root_process():
        shutil.rmtree(partial, ignore_errors=True)
    if any(f and f[3] for f in failures):
        size = expected_bytes() if expected_bytes else None
        raise CheckpointError(disk_full_message(path, size)) from error
    rank, (failed_rank, kind, text, _) = next((r, f) for r, f in enumerate(failures) if f)
    raise CheckpointError(f"rank {rank if failed_rank is None else failed_rank} could not save "
                          f"{path}: {kind}: {text}") from error


def _describe(error: BaseException) -> tuple[int | None, str, str, bool]:
    """(failing rank if known, type, first line, full disk?) of an error; DCP's
    CheckpointException (raised on every rank) names the rank that failed and its error."""
    inner, rank = error, None
    if isinstance(error, CheckpointException) and error.failures:
        rank, inner = next(iter(error.failures.items()))
        inner = inner[0] if isinstance(inner, tuple) else inner
    text = (str(inner).strip().splitlines() or [""])[0][:300]
    return rank, type(inner).__name__, text, is_disk_full(error)


def _seal_folder(partial: Path, path: Path, old: Path) -> Exception | None:
    """Every rank checksums its share of the files in `partial`; rank 0 writes the marker
    MANIFEST and renames `partial` to `path`. Returns this rank's error, if any."""
    files = _from_root(sorted(f.relative_to(partial).as_posix() for f in partial.rglob("*")
                              if f.is_file()) if is_root_process() else None)
    error = None
    try:
        mine = {name: {"bytes": (partial / name).stat().st_size,
                       "crc32": crc32_file(partial / name)}
                for name in files[get_rank()::get_world_size()]}
    except OSError as e:
        mine, error = None, e
    shares = _from_all(mine)
    if is_root_process() and all(share is not None for share in shares):
        try:
            entries = {name: entry for share in shares for name, entry in share.items()}
            manifest = {"files": dict(sorted(entries.items())), "world_size": get_world_size()}
            write_synced(partial / MANIFEST, json.dumps(manifest, indent=1) + "\n")
            fsync_folder(partial)
            if path.exists():
                os.replace(path, old)
            os.replace(partial, path)
            fsync_folder(path.parent)
            shutil.rmtree(old, ignore_errors=True)
        except OSError as e:
            error = e
    return error


def _sibling(path: Path, tag: str) -> Path:
    return path.parent / f".{path.name}.{tag}"


def _from_root(obj):
    """Rank 0's `obj` on every rank (a collective; the object itself without a group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _from_all(obj) -> list:
    """Every rank's `obj`, in rank order, on every rank (a collective)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    objects = [None] * dist.get_world_size()
    dist.all_gather_object(objects, obj)
    return objects
