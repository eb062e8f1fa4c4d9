"""Run a pipeline training script (argv[1:]) recording the collectives of one training step and
the shapes of its model's parameters. Each rank writes $RECORD_DIR/rank<N>.json at exit:
{"collectives": [{"op", "group", "bytes"}, ...], "shapes": {name: shape of the local piece}}.
(tests/test_nd_training.py holds tools/plan_run.py's plan to them.)

The window opens when the schedule's step() is called the second time (the first infers the
pipeline's shapes) and closes at the third call: one step's forward, backward and gradient
reduction, and what the script does between two steps (the loss it reports, the log line).

Every collective passes the dispatcher as an operator of the c10d namespaces (c10d.send,
_c10d_functional.all_reduce, ...): a TorchDispatchMode sees them all with their process group
and tensors. For DTensor operations it steps aside (returns NotImplemented), so that DTensor
runs them and the collectives it issues inside (loss_parallel's all-reduces) come back to it.
"""

import atexit
import json
import os
import runpy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.pipelining.schedules import PipelineScheduleSingle
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

# c10d's operator names -> the names of the plan (and of nccl-tests)
OPS = {"_allgather_base_": "all_gather", "allgather_": "all_gather",
       "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
       "all_reduce": "all_reduce", "allreduce_": "all_reduce", "send": "send", "recv_": "recv",
       "broadcast_": "broadcast", "all_gather_into_tensor": "all_gather"}
recorded = {"collectives": [], "shapes": {}}


def group_of(args) -> list[int] | None:
    for a in args:
        if type(a).__name__ == "ScriptObject":  # a ProcessGroup, as the dispatcher passes it
            return dist.get_process_group_ranks(dist.ProcessGroup.unbox(a))
        if isinstance(a, str):  # functional collectives name their group
            try:
                return dist.get_process_group_ranks(_resolve_process_group(a))
            except (KeyError, ValueError, RuntimeError):
                continue
    return None


def tensors(args):
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from tensors(a)


class Recorder(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        name = func.__name__.split(".")[0]
        if "c10d" in func.namespace and name in OPS:
            # the size nccl-tests gives a collective: its largest buffer
            size = max(t.numel() * t.element_size() for t in tensors(args))
            recorded["collectives"].append({"op": OPS[name], "group": group_of(args),
                                            "bytes": size})
        return func(*args, **(kwargs or {}))


recorder, steps = Recorder(), [0]
original_step = PipelineScheduleSingle.step


def step(self, *args, **kwargs):
    steps[0] += 1
    if steps[0] == 2:
        recorder.__enter__()
    elif steps[0] == 3:
        recorder.__exit__(None, None, None)
        model = self._stage.submod  # between steps: FSDP holds the shards only
        recorded["shapes"] = {n: list(p.to_local().shape) for n, p in model.named_parameters()}
    return original_step(self, *args, **kwargs)


def write() -> None:
    Path(os.environ["RECORD_DIR"], f"rank{os.environ.get('RANK', '0')}.json").write_text(
        json.dumps(recorded))


PipelineScheduleSingle.step = step
atexit.register(write)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
