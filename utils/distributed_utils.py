"""The distributed helpers the slides use.

Every function works under torchrun (one process per GPU or CPU slot) and in a plain
`python script.py` run with no process group, on GPU (NCCL) and on CPU (gloo).
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_model_state_dict,
                                                     set_state_dict)
from torch.distributed.checkpoint.stateful import Stateful

# A crashed or stuck rank makes the others fail after this long instead of hanging for the
# default 10 (NCCL) or 30 (gloo) minutes. Raise it with DIST_TIMEOUT_MINUTES for huge checkpoints.
TIMEOUT = datetime.timedelta(minutes=float(os.environ.get("DIST_TIMEOUT_MINUTES", 5)))


def pick_device(device: str = "auto", local_rank: int = 0) -> torch.device:
    """cuda:LOCAL_RANK when CUDA is usable (and not refused with device="cpu"), else the CPU.

    On a CPU test node Slurm may still set CUDA_VISIBLE_DEVICES: what counts is whether
    torch can use a GPU. More processes on a node than it has GPUs (--nproc_per_node=8 where
    --gres=gpu:4 was asked for) end with one line, not CUDA's "invalid device ordinal".
    """
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda was asked for, but torch sees no usable GPU here: "
                 "run on a GPU node with a CUDA build of torch, or leave out --device")
    if device in ("auto", "cuda") and torch.cuda.is_available():
        visible = torch.cuda.device_count()
        if local_rank >= visible:
            sys.exit(f"error: local rank {local_rank} on {socket.gethostname()} has no GPU of its "
                     f"own: {visible} are visible (CUDA_VISIBLE_DEVICES="
                     f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): start at most "
                     f"{visible} processes per node (torchrun --nproc_per_node=gpu), or ask "
                     "Slurm for more GPUs (--gres=gpu:N)")
        return torch.device("cuda", local_rank)
    if device == "auto" and os.environ.get("RANK", "0") == "0":
        warn_if_slurm_gpus_are_unused()
    return torch.device("cpu")


def warn_if_slurm_gpus_are_unused() -> None:
    """One line on stderr when Slurm gave this job GPUs that torch cannot use.

    A CPU-only torch (setup_env.sh on a login node without GPUs installs that one) or a
    driver older than torch's CUDA would otherwise make every job train on the CPU: it works,
    only many times slower, and nothing says why.
    """
    gpus = os.environ.get("SLURM_JOB_GPUS")
    if not gpus or torch.cuda.is_available():
        return
    why = ("a CPU-only build" if torch.version.cuda is None
           else f"built for CUDA {torch.version.cuda}: is the driver older?")
    print(f"WARNING: Slurm gave this job GPUs ({gpus}), but torch {torch.__version__} cannot "
          f"use them ({why}): training on the CPU. For the GPUs, make the environment with "
          "TORCH_VARIANT=cuda bash setup_env.sh; to train on the CPU on purpose, pass "
          "--device cpu", file=sys.stderr, flush=True)


def setup(seed: int = 0, device: str = "auto") -> tuple[int, int, torch.device, int]:
    """Join the process group when started by torchrun; returns (local_rank, rank, device, world_size).

    Picks NCCL and cuda:LOCAL_RANK when a GPU is usable, gloo and the CPU otherwise. Without
    torchrun's variables it returns (0, 0, device, 1) with a process group of one.

    Every rank is seeded with the same `seed`, so every rank builds identical initial weights:
    DDP would broadcast rank 0's weights anyway, but FSDP and tensor parallelism initialise
    each rank's own shard and rely on this.
    """
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    dev = pick_device(device, local_rank)
    if not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        # Without torchrun a group of one process (in an in-memory store) lets the same code,
        # DDP included, run with plain `python script.py`.
        single = {} if "RANK" in os.environ else dict(store=dist.HashStore(), rank=0, world_size=1)
        init_process_group_or_exit(backend, timeout=TIMEOUT,
                                   device_id=dev if dev.type == "cuda" else None, **single)
    if world_size > 1:
        # One line per rank, so a log shows at once which ranks started where.
        print(f"setup: rank {rank}/{world_size} local_rank {local_rank} host {socket.gethostname()} "
              f"device {dev} backend {dist.get_backend()} "
              f"MASTER_ADDR={os.environ.get('MASTER_ADDR')} MASTER_PORT={os.environ.get('MASTER_PORT')}",
              flush=True)
    torch.manual_seed(seed)
    return local_rank, rank, dev, world_size


def get_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_root_process() -> bool:
    """True on global rank 0, and in a run without a process group."""
    return get_rank() == 0


def print0(*args, **kwargs) -> None:
    """print on the root process only (the others would repeat the same line)."""
    if is_root_process():
        print(*args, **kwargs, flush=True)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside a DistributedDataParallel (or torch.compile) wrapper."""
    while hasattr(model, "module") or hasattr(model, "_orig_mod"):
        model = getattr(model, "module", None) or model._orig_mod
    return model


def atomic_torch_save(obj, path: str | os.PathLike) -> None:
    """torch.save to a temporary file, then rename: a crash never leaves a half-written file
    in place of the previous good one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
        # mkstemp makes the file private; a saved model is meant to be shared within the project
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def save0(model_or_state_dict, path: str | os.PathLike) -> None:
    """Save a state dict on the root process only.

    Given a module (also a DDP-wrapped one), saves the plain model's state_dict, so the file
    loads with torch.load(weights_only=True) into a fresh, unwrapped model. Pickling the module
    itself would tie the file to this code and to DDP.
    """
    state = model_or_state_dict
    if isinstance(state, nn.Module):
        state = unwrap(state).state_dict()
    if any(type(v).__name__ == "DTensor" for v in state.values()):
        raise TypeError("save0 got sharded (DTensor) weights: use save_full_model or "
                        "save_sharded_model for FSDP and tensor-parallel models")
    if is_root_process():
        atomic_torch_save(state, path)


def collective_device(group=None) -> torch.device:
    """The device whose tensors a collective of `group` (default: all ranks) takes: the GPU of
    this process under NCCL, which has no CPU backend; the CPU under gloo or without a group."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum of `tensor` over all ranks, or over the ranks of `group` (a copy; the input is left
    alone). Tensor and pipeline parallelism pass their data-parallel group: the ranks that
    share one batch must not be counted twice.

    The copy lives on the collective's device (see collective_device): a count or a timing
    built on the CPU can be summed on a GPU run too, where NCCL would refuse it ("No backend
    type associated with device type cpu")."""
    tensor = tensor.detach().to(collective_device(group), copy=True)
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_reduce_mean(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Mean of `tensor` over all ranks (or over `group`). SUM then divide: ReduceOp.AVG is
    missing on some backends and releases (gloo before 2.x, integer tensors)."""
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    return all_reduce_sum(tensor, group) / size


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def destroy_process_group() -> None:
    """Leave the process group cleanly; does nothing without one.

    Collect garbage first, so communication objects of models that are already deleted go
    before the group does, then wait for every rank, so none tears down while another still
    communicates.
    """
    if dist.is_initialized():
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Checkpoints of sharded models (FSDP, tensor parallelism): Distributed Checkpoint (DCP)

# (imports of this section only)
import errno  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

TRAIN_STATE_FILE = "train_state.json"


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


def _sibling(path: Path, tag: str) -> Path:
    return path.parent / f".{path.name}.{tag}"


def _from_root(obj):
    """Rank 0's `obj` on every rank (a collective; the object itself without a group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _out_of_space(error: BaseException) -> bool:
    """A full disk or quota, however it surfaced: OSError ENOSPC/EDQUOT from a file write, or
    torch.save's "inline_container.cc: unexpected pos" (a short write), possibly inside DCP's
    CheckpointException, which carries every failed rank's exception."""
    errors = [error]
    if isinstance(error, CheckpointException):
        errors += [failure[0] if isinstance(failure, tuple) else failure
                   for failure in error.failures.values()]
    for e in errors:
        if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(s in str(e) for s in ("No space left on device", "Disk quota exceeded",
                                     "unexpected pos")):
            return True
    return False


def _checkpoint_mib(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None
                    ) -> float:
    """About how many MiB a checkpoint of model and optimizer takes: the size of the previous
    one if there is one, else the tensors of all ranks' shards."""
    for folder in (path, _sibling(path, "old")):
        if folder.is_dir():
            return sum(f.stat().st_size for f in folder.iterdir()) / 2**20
    tensors = list(model.state_dict().values())
    if optimizer is not None:
        tensors += [v for s in optimizer.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor)]
    local = sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size()
                for t in tensors)
    return all_reduce_sum(torch.tensor(float(local), dtype=torch.float64)).item() / 2**20


def save_sharded_model(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                       path: str | os.PathLike, train_state: dict | None = None) -> Path:
    """Write a DCP checkpoint folder: every rank writes its own shards, in parallel.

    Call it on every rank, with the same `path` on a file system all ranks share. The folder
    appears only when complete: DCP writes into .NAME.partial next to it, rank 0 adds
    train_state.json (step, epoch, model configuration: anything JSON), then renames the old
    folder to .NAME.old, .NAME.partial to NAME, and deletes .NAME.old. A save that fails leaves
    the previous checkpoint untouched and deletes .NAME.partial; a full disk ends the run with
    one line (CheckpointError). A crash between the two renames leaves the previous checkpoint
    as .NAME.old: load_sharded_model and latest_checkpoint use it, the next save deletes it.
    """
    path = Path(path)
    partial, old = _sibling(path, "partial"), _sibling(path, "old")
    if is_root_process():
        shutil.rmtree(partial, ignore_errors=True)  # left over from an interrupted save
        if path.exists():  # NAME is complete: an .NAME.old beside it is a leftover too
            shutil.rmtree(old, ignore_errors=True)
        partial.mkdir(parents=True)
    barrier()
    failure = None
    try:
        dcp.save({"app": AppState(model, optimizer)}, checkpoint_id=partial)
    except CheckpointException as e:  # DCP reports any rank's failure on every rank
        failure = e
    if failure is None:
        finished = None
        if is_root_process():
            try:
                (partial / TRAIN_STATE_FILE).write_text(json.dumps(train_state or {}, indent=1)
                                                        + "\n")
                if path.exists():
                    os.replace(path, old)
                os.replace(partial, path)
                shutil.rmtree(old, ignore_errors=True)
            except OSError as e:
                failure = finished = e
        finished = _from_root(finished)  # the other ranks learn whether rank 0 could finish
        if finished is not None and failure is None:
            failure = OSError(f"rank 0 could not finish saving {path}: {finished}")
            failure.errno = finished.errno
    if failure is None:
        barrier()  # nobody reads `path` before it is complete
        return path
    if is_root_process():
        shutil.rmtree(partial, ignore_errors=True)
    barrier()
    if _out_of_space(failure):
        size = _checkpoint_mib(path, model, optimizer)
        free = shutil.disk_usage(path.parent).free / 2**20
        raise CheckpointError(
            f"no space left on device while saving {path}: free {max(size - free, 0.1):.1f} MiB "
            f"there (a checkpoint takes about {size:.1f} MiB, {free:.1f} MiB are free) or "
            "choose another --out-dir") from failure
    raise failure


def checkpoint_problem(path: str | os.PathLike) -> str | None:
    """Why `path` is not a complete checkpoint written by save_sharded_model; None if it is.

    Cheap checks only, the same on every rank: train_state.json and DCP's .metadata can be
    read, and every shard file the metadata names exists and is long enough.
    """
    path = Path(path)
    if not path.is_dir():
        return "there is no such folder"
    if not (path / TRAIN_STATE_FILE).is_file():
        return f"it has no {TRAIN_STATE_FILE}, so save_sharded_model did not write it"
    try:
        json.loads((path / TRAIN_STATE_FILE).read_text())
    except (OSError, ValueError):
        return f"its {TRAIN_STATE_FILE} is unreadable"
    if not (path / ".metadata").is_file():
        return "its .metadata file is missing"
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception:
        return "its .metadata file is truncated or damaged"
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0),
                                         info.offset + info.length)
    for name, size in sorted(needed.items()):
        if not (path / name).is_file():
            return f"its shard file {name} is missing"
        if (path / name).stat().st_size < size:
            return f"its shard file {name} is truncated"
    return None


def latest_checkpoint(folder: str | os.PathLike, exclude: str | os.PathLike | None = None
                      ) -> Path | None:
    """The complete checkpoint with the highest step in `folder` (OUT_DIR/checkpoints), or None.

    Looks at every checkpoint folder there (last, best, and .NAME.old left by a save that
    crashed between its two renames); skips damaged ones, .NAME.partial and `exclude`.
    At the same step it prefers `last`.
    """
    folder = Path(folder)
    found = []
    for sub in sorted(folder.iterdir()) if folder.is_dir() else []:
        if sub.name.endswith(".partial") or (exclude and sub == Path(exclude)):
            continue
        if checkpoint_problem(sub) is None:
            step = read_train_state(sub).get("step", 0)
            found.append((step, not sub.name.startswith("."), sub.name == "last", sub))
    return max(found)[-1] if found else None


def read_train_state(path: str | os.PathLike) -> dict:
    """train_state.json of a checkpoint folder written by save_sharded_model."""
    path = Path(path)
    if not (path / TRAIN_STATE_FILE).is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint folder written by "
                                f"save_sharded_model (it has no {TRAIN_STATE_FILE})")
    return json.loads((path / TRAIN_STATE_FILE).read_text())


def usable_checkpoint(path: str | os.PathLike) -> Path:
    """`path` if it is a complete checkpoint; its .NAME.old if a save crashed between its two
    renames (NAME gone, the previous checkpoint complete under the other name). Otherwise one
    line (CheckpointError) naming the problem and the checkpoint to use instead."""
    path = Path(path)
    problem = checkpoint_problem(path)
    if problem is None:
        return path
    old = _sibling(path, "old")
    if not path.exists() and checkpoint_problem(old) is None:
        print0(f"checkpoint {path} is missing: a save stopped between its two renames; "
               f"loading the previous checkpoint {old}")
        return old
    other = latest_checkpoint(path.parent, exclude=path)
    instead = (f"resume from {other} (step {read_train_state(other).get('step')}) instead"
               if other else "start again without --resume")
    raise CheckpointError(f"checkpoint {path} cannot be loaded: {problem}; {instead}")


def load_sharded_model(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                       path: str | os.PathLike, model_config: dict | None = None) -> dict:
    """Load a checkpoint written by save_sharded_model into `model` (and `optimizer`).

    Call it on every rank, after wrapping the model and making the optimizer. The world size
    may differ from the one that saved: each rank reads the pieces of the files that overlap
    its own shards. Returns the checkpoint's train_state. A damaged checkpoint, or with
    `model_config` a checkpoint of another model, ends the run with one line (CheckpointError)
    before any tensor is read.
    """
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
    return train_state


def save_full_model(model: nn.Module, path: str | os.PathLike) -> None:
    """Gather the full weights on rank 0 (into CPU memory) and write one ordinary state_dict.

    Call it on every rank (gathering is a collective). The file loads with
    torch.load(path, weights_only=True) into a plain TransformerLM, without any process group:
    for inference or sharing. cpu_offload keeps the full model out of GPU memory; the other
    ranks receive an empty dict.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    if is_root_process():
        atomic_torch_save(state, path)
    barrier()


def gather_per_rank(value: float, device: torch.device) -> list[float]:
    """`value` of every rank, in rank order, on every rank (for per-rank reports)."""
    values = torch.zeros(get_world_size(), dtype=torch.float64, device=device)
    values[get_rank()] = value
    return all_reduce_sum(values).tolist()



def init_process_group_or_exit(backend: str, **kwargs) -> None:
    """dist.init_process_group, but a rendezvous that fails (no rank 0 at MASTER_ADDR:MASTER_PORT,
    ranks missing, variables unset) ends the process with one line instead of a traceback.

    Every wait is bounded by `timeout` (TIMEOUT, from DIST_TIMEOUT_MINUTES): torch uses it for
    connecting to rank 0's store and for rank 0 waiting for the others (it retries once, so
    a failure shows after one to three times the timeout).
    """
    timeout = kwargs.get("timeout", TIMEOUT)
    rank, world_size = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if "store" not in kwargs and not (addr and port):
        sys.exit(f"error: RANK={rank} and WORLD_SIZE={world_size} are set but MASTER_ADDR or "
                 "MASTER_PORT is not: start the script with torchrun (it sets them), or unset "
                 "RANK and WORLD_SIZE to run one process")
    if "store" not in kwargs and rank != "0" and "TORCHELASTIC_RUN_ID" not in os.environ:
        # Started by hand or by srun, not torchrun: wait for rank 0's store ourselves, so that
        # a missing rank 0 gives one line (torch's own failure prints pages of C++ frames).
        if not _port_opens(addr, int(port), timeout.total_seconds()):
            sys.exit(f"error: rank {rank} of {world_size} waited {timeout} for rank 0 at "
                     f"MASTER_ADDR:MASTER_PORT {addr}:{port}, and nothing answered there: start "
                     "every rank together (torchrun, or srun in the sbatch file), check "
                     "MASTER_ADDR, or raise DIST_TIMEOUT_MINUTES")
    try:
        dist.init_process_group(backend, **kwargs)
    except (ValueError, RuntimeError) as e:  # DistError is a RuntimeError
        reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        waited = ("for the other ranks" if rank == "0" else "for rank 0")
        sys.exit(f"error: rank {rank} of {world_size} waited {timeout} {waited} at "
                 f"MASTER_ADDR:MASTER_PORT {addr}:{port} ({reason.rstrip('.')}): start every rank "
                 "together (torchrun, or srun in the sbatch file), or raise DIST_TIMEOUT_MINUTES")


def _port_opens(host: str, port: int, seconds: float) -> bool:
    """Whether host:port accepts a TCP connection within `seconds` (tried every second)."""
    import time
    deadline = time.monotonic() + seconds
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
