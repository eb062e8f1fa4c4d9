"""The distributed helpers the slides use: join and leave the process group, ranks, printing
and saving on one rank, and the collectives that add up losses and counts over ranks.

Every function works under torchrun (one process per GPU or CPU slot) and in a plain
`python script.py` run with no process group, on GPU (NCCL) and on CPU (gloo).

Here, top to bottom: setup (with pick_device), get_rank, get_world_size, is_root_process,
print0, save0, collective_device, all_reduce_sum, all_reduce_mean, gather_per_rank, barrier,
destroy_process_group. Elsewhere:
- checkpoints (save_full_model, save_sharded_model, load_sharded_model, atomic_folder,
  resuming): utils/checkpointing.py
- the launch environment and the rendezvous (RANK, MASTER_ADDR, DIST_TIMEOUT_MINUTES, the
  waits for other ranks): utils/launch.py
- checks that stop a run with one line (a NaN loss, --out-dir): utils/checks.py
- files written whole or not at all: utils/files.py
"""

from __future__ import annotations

import gc
import os
import socket
import sys

import torch
import torch.distributed as dist
from torch import nn

from utils.checks import stop_if_a_loss_was_not_finite
from utils.files import atomic_torch_save
from utils.launch import (check_launch_environment, dist_timeout, exit_with_error,
                          init_process_group_or_exit, warn_about_torchrun_restarts)

# A crashed or stuck rank makes the others fail after this long instead of hanging for the
# default 10 (NCCL) or 30 (gloo) minutes. Raise it with DIST_TIMEOUT_MINUTES for huge checkpoints.
TIMEOUT = dist_timeout()


def pick_device(device: str = "auto", local_rank: int = 0) -> torch.device:
    """cuda:LOCAL_RANK when CUDA is usable (and not refused with device="cpu"), else the CPU.

    On a CPU test node Slurm may still set CUDA_VISIBLE_DEVICES: what counts is whether
    torch can use a GPU. More processes on a node than it has GPUs (--nproc_per_node=8 where
    --gres=gpu:4 was asked for) end with one line, not CUDA's "invalid device ordinal".
    """
    if device == "cuda" and not torch.cuda.is_available():
        exit_with_error("--device cuda was asked for, but torch sees no usable GPU here: run on "
                        "a GPU node with a CUDA (or ROCm) build of torch, or leave out --device")
    if device in ("auto", "cuda") and torch.cuda.is_available():
        visible = torch.cuda.device_count()
        if local_rank >= visible:
            exit_with_error(f"local rank {local_rank} on {socket.gethostname()} has no GPU of its "
                            f"own: {visible} are visible (CUDA_VISIBLE_DEVICES="
                            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): start at most "
                            f"{visible} processes per node (torchrun --nproc_per_node=gpu), or "
                            "ask Slurm for more GPUs (--gres=gpu:N)")
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
    # A ROCm build (AMD GPUs) has torch.version.hip where a CUDA build has torch.version.cuda.
    hip = getattr(torch.version, "hip", None)
    if hip:
        why, variant = f"built for ROCm {hip}: is the driver older?", "rocm"
    elif torch.version.cuda:
        why, variant = f"built for CUDA {torch.version.cuda}: is the driver older?", "cuda"
    else:
        why, variant = "a CPU-only build", "cuda"
    print(f"WARNING: Slurm gave this job GPUs ({gpus}), but torch {torch.__version__} cannot "
          f"use them ({why}): training on the CPU. For the GPUs, make the environment with "
          f"TORCH_VARIANT={variant} bash setup_env.sh; to train on the CPU on purpose, pass "
          "--device cpu", file=sys.stderr, flush=True)


def setup(seed: int = 0, device: str = "auto") -> tuple[int, int, torch.device, int]:
    """Join the process group when started by torchrun; returns (local_rank, rank, device, world_size).

    Picks NCCL and cuda:LOCAL_RANK when a GPU is usable, gloo and the CPU otherwise. Without
    torchrun's variables it returns (0, 0, device, 1) with a process group of one.

    Every rank is seeded with the same `seed`, so every rank builds identical initial weights:
    DDP would broadcast rank 0's weights anyway, but FSDP and tensor parallelism initialise
    each rank's own shard and rely on this.
    """
    check_launch_environment()  # one line for a variable that is missing or wrong, not a hang
    warn_about_torchrun_restarts()
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


def save0(model_or_state_dict, path: str | os.PathLike) -> None:
    """Save a state dict on the root process only.

    Given a module (also a DDP-wrapped one), saves the plain model's state_dict, so the file
    loads with torch.load(weights_only=True) into a fresh, unwrapped model. Pickling the module
    itself would tie the file to this code and to DDP.
    """
    stop_if_a_loss_was_not_finite()  # a NaN loss kept on the GPU: save nothing after it
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


def gather_per_rank(value: float, device: torch.device) -> list[float]:
    """`value` of every rank, in rank order, on every rank (for per-rank reports)."""
    values = torch.zeros(get_world_size(), dtype=torch.float64, device=device)
    values[get_rank()] = value
    return all_reduce_sum(values).tolist()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# What must end while the process group still exists: utils/checkpointing.py adds the sealing
# of an asynchronous save that is still writing.
before_teardown: list = []


def destroy_process_group() -> None:
    """Leave the process group cleanly; does nothing without one.

    Collect garbage first, so communication objects of models that are already deleted go
    before the group does, then wait for every rank, so none tears down while another still
    communicates.
    """
    for finish in before_teardown:  # an asynchronous checkpoint save still writing: seal it
        finish()
    if dist.is_initialized():
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


# Names that moved to utils/checkpointing.py: a file written before the move stops with one
# line naming the new place, not with an ImportError's traceback.
MOVED_TO_CHECKPOINTING = set(
    "CheckpointError AppState MANIFEST RNG_FOLDER TRAIN_STATE_FILE atomic_folder save_full_model "
    "save_sharded_model load_sharded_model use_async_checkpoint_saves finish_checkpoint_saves "
    "checkpoint_blocking_seconds checkpoint_problem checkpoint_damage latest_checkpoint "
    "newest_good_checkpoint usable_checkpoint read_train_state quiet_sequential_gathers".split())


def __getattr__(name: str):
    if name in MOVED_TO_CHECKPOINTING:
        raise SystemExit(f"error: cannot import name '{name}' from utils.distributed_utils: it "
                         f"is in utils.checkpointing now: from utils.checkpointing import {name}")
    raise AttributeError(f"module 'utils.distributed_utils' has no attribute '{name}'")
