"""Run a function in several fresh processes joined by a process group (for tests): gloo on
the CPU, or NCCL with one GPU per process for the GPU suite."""

from __future__ import annotations

import os
import pickle
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp

import warm_launch
from selfcheck.runs import free_port


def _context(device: str):
    """Fresh processes for the ranks. On the CPU they fork from the self-check's warm server
    (selfcheck/runs.py: torch imported once; a spawned process imports it again, seconds per
    rank; one server per process, shared with the check's own runs), unless the test's
    environment sets what a process reads as it starts otherwise than the server's
    (tests/warm_launch.py); the GPU suite spawns, so that no process inherits anything of
    CUDA's."""
    # what _worker sets itself, whichever way the rank starts
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    if device == "cuda" or warm_launch.needs_a_real_start(env):
        return mp.get_context("spawn")
    from selfcheck.runs import fork_context
    return fork_context()


def _worker(fn, rank, world_size, port, queue, args, device_type, visible_gpus, environ):
    os.environ.clear()  # the test's environment now (a forked rank has the server's)
    os.environ.update(environ)
    import utils.distributed_utils as du  # what it read from the server's environment at import
    from utils.launch import dist_timeout
    du.TIMEOUT = dist_timeout()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    # Before CUDA is initialised: the CPU suite's workers see no GPU, even on a GPU node.
    if visible_gpus is None:  # the GPU suite on a host that did not restrict its GPUs
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_gpus
    try:
        import torch
        torch.set_num_threads(1)
        if device_type == "cuda":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=device)
        else:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        dist.barrier()
        dist.destroy_process_group()
        # Plain pickle copies tensors by value: through the queue, torch would send a handle to
        # shared memory that is gone once this process exits (ConnectionResetError in the parent).
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # report instead of hanging the parent
        queue.put((rank, "error", traceback.format_exc()))


def run_distributed(fn, world_size: int, *args, timeout: float = 180, device: str = "cpu"):
    """fn(rank, world_size, *args) on `world_size` spawned processes; returns results by rank.

    device="cpu": gloo, no GPU visible. device="cuda" (GPU suite): NCCL, rank r on cuda:r.
    `fn` must be importable (defined at module level). Results travel back pickled, so return
    CPU tensors or plain values.
    """
    visible = ""
    if device == "cuda":
        from conftest import restore_host_gpus
        visible = restore_host_gpus(dict(os.environ)).get("CUDA_VISIBLE_DEVICES")
    ctx = _context(device)
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, queue, args, device,
                                               visible, dict(os.environ)))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world_size):
            rank, status, value = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank}:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("a distributed test process failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
