"""A stand-in GPU: the participant's script runs on the CPU, but takes every branch it would take
on a GPU, so the check can see what it would do there.

The check has no GPU, and several TODOs go wrong only on one: a clock read before
`synchronize`, a fused AdamW never asked for, DDP's `device_ids`, `--precision auto` never
resolved, a profiler without CUDA activity, NVTX ranges. A run started with `Run(..., gpu=True)`
(the variable CHECK_STANDIN_GPU=1) gets, inside every rank, before the script is imported:

- `setup()` returns a device whose `.type` is "cuda" and `.index` the local rank, but which every
  torch function takes for the CPU (a `str` "cpu" with those two attributes): `x.to(device)`,
  `torch.zeros(..., device=device)` and `model.to(device)` stay on the CPU, while
  `device.type == "cuda"` is true in the script and in the course's helpers.
- `torch.cuda`'s functions answer as a GPU would (available, bf16-capable, `synchronize`,
  `Event`, memory counters, NVTX ranges), for callers outside torch itself: torch's own code
  still sees no CUDA, so it never tries to use one.
- What the script builds for the GPU is recorded, then built for the CPU: DDP's `device_ids`,
  AdamW's `fused` and `foreach`, autocast's device type and dtype (autocast on "cuda" runs as
  autocast on the CPU, so bf16 is really computed), the profiler's activities (CUDA dropped),
  CPUOffloadPolicy's `pin_memory` (False on the CPU), device meshes of type "cuda" (made "cpu").
- A timeline of what matters for timing, in order: the script's clock reads (`time.*`), its
  synchronisations (`synchronize(device)`, `torch.cuda.synchronize()`), every optimizer step,
  every `profiler.step()`, and every line the script prints.

Everything lands in the rank's record under "gpu" (see `install`); the helpers below read it:

    run = Run(ctx.work, "gpu", ctx.script, BATCH, geometry=ONE_NODE_TWO, gpu=True).wait()
    gpu = standin.observed(run)             # rank 0's record["gpu"] (or {} if none)
    gpu["adamw"], gpu["ddp"], gpu["autocast"], gpu["profiler"], gpu["nvtx"], gpu["offload"]
    standin.clock_reads_before_sync(gpu, is_report)   # the lines that read the clock too early
"""

from __future__ import annotations

import os
import re
import sys
import time
import types

ENV = "CHECK_STANDIN_GPU"
GPU_NAME = "NVIDIA H100 80GB HBM3 (the check's stand-in: no GPU here)"
TIMELINE_LIMIT = 4000
PROBE_FILES = (os.path.join("selfcheck", "probe.py"), os.path.join("selfcheck", "standin.py"))
# device-time keys of the profiler's table (on a GPU: what the kernels took)
DEVICE_SORT_KEYS = ("self_device_time_total", "device_time_total", "self_cuda_time_total",
                    "cuda_time_total")


def active() -> bool:
    return os.environ.get(ENV) == "1"


class StandInDevice(str):
    """A GPU to the script (`.type` "cuda", `.index` the local rank), the CPU to torch."""

    def __new__(cls, index: int):
        device = super().__new__(cls, "cpu")
        device.type, device.index = "cuda", index
        return device

    # what the script sees, as a torch.device("cuda", index) would answer (torch itself reads
    # the string, "cpu")
    def __str__(self) -> str:
        return f"cuda:{self.index}"

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)

    def __repr__(self) -> str:
        return f"device(type='cuda', index={self.index})"

    def __eq__(self, other) -> bool:
        type_, index = getattr(other, "type", None), getattr(other, "index", None)
        if isinstance(other, StandInDevice) or type(other).__name__ == "device":
            return type_ == "cuda" and index in (None, self.index)
        return False  # a torch.device is never equal to a string

    __hash__ = str.__hash__


def device_index(value):
    """What a device argument names: an int, a StandInDevice's index, a torch.device's."""
    if isinstance(value, StandInDevice):
        return value.index
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return value
    index = getattr(value, "index", None)
    return index if isinstance(index, int) else str(value)


class _Event:
    """torch.cuda.Event on the stand-in: the host clock."""

    def __init__(self, enable_timing=False, *a, **k):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def query(self):
        return True

    def wait(self, stream=None):
        pass

    def elapsed_time(self, end) -> float:
        return ((end.t or 0.0) - (self.t or 0.0)) * 1000


def install(probe) -> None:
    """Patch torch for a stand-in GPU; what the script does lands in probe.record["gpu"]."""
    import torch
    import torch.distributed.device_mesh as dm
    from torch.nn.parallel import DistributedDataParallel

    import utils.distributed_utils as du
    import utils.precision as up

    script = probe.script
    torch_dir = os.path.dirname(torch.__file__)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    gpu = probe.record["gpu"] = {
        "device_index": local_rank, "timeline": [], "ddp": [], "adamw": [], "autocast": [], "autocast_asked": [],
        "precision": [], "profiler": {"activities": [], "started": 0, "steps": 0, "stopped": 0},
        "nvtx": [], "nvtx_open": 0, "offload": [], "meshes": [], "cuda_calls": {}}
    timeline = gpu["timeline"]

    def from_script(depth: int = 1) -> int | None:
        """The script's line, if the caller `depth` frames above the caller of this function
        is the participant's script (1: whoever called the function that asks)."""
        frame = sys._getframe(depth + 1)
        return frame.f_lineno if frame.f_code.co_filename == script else None

    def from_torch() -> bool:
        """Whether the function that asks was called by torch's own code."""
        return sys._getframe(2).f_code.co_filename.startswith(torch_dir)

    def event(kind: str, line=None, **extra) -> None:
        if len(timeline) < TIMELINE_LIMIT:
            timeline.append({"kind": kind, "line": line, **extra})

    # -- the device setup() returns
    setup = du.setup

    def setup_(*a, **k):
        local, rank, _device, world = setup(*a, **k)
        return local, rank, StandInDevice(local), world
    du.setup = setup_

    # -- torch.cuda, as a GPU would answer (torch's own code still sees no CUDA)
    cuda = torch.cuda
    real = {name: getattr(cuda, name) for name in (
        "is_available", "device_count", "current_device", "set_device", "synchronize",
        "is_bf16_supported", "get_device_name", "get_device_properties",
        "get_device_capability", "memory_allocated", "max_memory_allocated", "memory_reserved",
        "max_memory_reserved", "reset_peak_memory_stats", "empty_cache", "Event",
        "get_rng_state_all", "set_rng_state_all", "manual_seed", "manual_seed_all")
        if hasattr(cuda, name)}

    def counted(name):
        gpu["cuda_calls"][name] = gpu["cuda_calls"].get(name, 0) + 1

    def standin(name, value):
        def call(*a, **k):
            if from_torch():
                return real[name](*a, **k)
            counted(name)
            return value(*a, **k) if callable(value) else value
        call.__name__ = name
        return call

    properties = types.SimpleNamespace(
        name=GPU_NAME, total_memory=80 * 2**30, major=9, minor=0, multi_processor_count=132,
        uuid="GPU-00000000-0000-0000-0000-000000000000")
    cuda.is_available = standin("is_available", True)
    cuda.device_count = standin("device_count", int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    cuda.current_device = standin("current_device", local_rank)
    cuda.set_device = standin("set_device", None)
    cuda.is_bf16_supported = standin("is_bf16_supported", True)
    cuda.get_device_name = standin("get_device_name", GPU_NAME)
    cuda.get_device_properties = standin("get_device_properties", properties)
    cuda.get_device_capability = standin("get_device_capability", (9, 0))
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                 "max_memory_reserved"):
        setattr(cuda, name, standin(name, 0))
    for name in ("reset_peak_memory_stats", "empty_cache", "set_rng_state_all", "manual_seed",
                 "manual_seed_all"):
        if name in real:
            setattr(cuda, name, standin(name, None))
    cuda.get_rng_state_all = standin("get_rng_state_all", lambda *a, **k: [])

    def cuda_synchronize(*a, **k):
        if from_torch():
            return None
        counted("synchronize")
        # the script's own call: directly, or through utils.metrics.synchronize (and the
        # probe's wrapper of it); not the course's helpers' (the monitor's)
        frame = sys._getframe(1)
        while frame is not None and (frame.f_code.co_filename.endswith(PROBE_FILES) or (
                frame.f_code.co_name == "synchronize"
                and frame.f_code.co_filename.endswith(os.path.join("utils", "metrics.py")))):
            frame = frame.f_back
        line = frame.f_lineno if frame is not None and frame.f_code.co_filename == script \
            else None
        event("sync", line, script=line is not None)
    cuda.synchronize = cuda_synchronize
    cuda.Event = _Event

    nvtx = cuda.nvtx

    class _Range:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            gpu["nvtx"].append(str(self.name)[:80]) if len(gpu["nvtx"]) < 200 else None
            return self

        def __exit__(self, *exc):
            return False

        def __call__(self, fn):  # torch's range is a decorator too (@contextmanager's)
            def ranged(*a, **k):
                with _Range(self.name):
                    return fn(*a, **k)
            return ranged

    nvtx.range = lambda msg, *a, **k: _Range(msg)

    def range_push(msg, *a, **k):
        gpu["nvtx_open"] += 1  # (a range pushed and never popped stays open to the end)
        gpu["nvtx"].append(str(msg)[:80]) if len(gpu["nvtx"]) < 200 else None
        return gpu["nvtx_open"] - 1  # the depth it starts at, as NVTX returns it

    def range_pop(*a, **k):
        gpu["nvtx_open"] = max(gpu["nvtx_open"] - 1, 0)
        return gpu["nvtx_open"]

    # range_start / range_end: a range ended by its id (it may end on another thread); counted
    # open like a pushed one until then
    def range_start(msg, *a, **k):
        range_push(msg)
        return len(gpu["nvtx"])

    nvtx.range_push, nvtx.range_pop = range_push, range_pop
    nvtx.range_start, nvtx.range_end = range_start, lambda range_id, *a, **k: range_pop()
    nvtx.mark = lambda msg, *a, **k: None

    # -- the clock, as the script reads it
    for name in ("perf_counter", "time", "monotonic", "perf_counter_ns", "monotonic_ns",
                 "time_ns"):
        original = getattr(time, name)

        def clock(_original=original, _name=name):
            frame = sys._getframe(1)
            if frame.f_code.co_filename == script:
                event("clock", frame.f_lineno, func=_name)
            return _original()
        clock.__name__ = name
        setattr(time, name, clock)

    # -- every optimizer step (the end of the work a step queues on the GPU)
    from torch.optim.optimizer import register_optimizer_step_post_hook
    register_optimizer_step_post_hook(lambda optimizer, a, k: event(
        "step", None, optimizer=type(optimizer).__name__))

    # -- DDP's device_ids: recorded, then None (the module is on the CPU)
    ddp_init = DistributedDataParallel.__init__

    def ddp_init_(self, module, device_ids=None, output_device=None, *a, **k):
        gpu["ddp"].append({"device_ids": None if device_ids is None else
                           [device_index(d) for d in device_ids],
                           "output_device": device_index(output_device),
                           "line": from_script()})
        return ddp_init(self, module, None, None, *a, **k)
    DistributedDataParallel.__init__ = ddp_init_

    # -- AdamW's implementation (the arguments' values, as given)
    adamw_init = torch.optim.AdamW.__init__

    def adamw_init_(self, *a, **k):
        gpu["adamw"].append({key: k[key] for key in ("fused", "foreach") if key in k
                             and isinstance(k[key], (bool, type(None)))})
        return adamw_init(self, *a, **k)
    torch.optim.AdamW.__init__ = adamw_init_

    # -- autocast on "cuda" runs as autocast on the CPU (bf16 is really computed)
    base = torch.amp.autocast_mode.autocast

    class autocast(base):  # noqa: N801 - torch's name
        def __init__(self, device_type, dtype=None, enabled=True, cache_enabled=None):
            device_type = getattr(device_type, "type", device_type)
            if len(gpu["autocast"]) < 50:
                gpu["autocast"].append({"device_type": str(device_type), "enabled": bool(enabled),
                                        "dtype": str(dtype).replace("torch.", "")
                                        if dtype is not None else None})
            super().__init__("cpu" if device_type == "cuda" else device_type, dtype=dtype,
                             enabled=enabled, cache_enabled=cache_enabled)
    torch.autocast = torch.amp.autocast = autocast

    course_autocast = up.autocast

    def autocast_(precision, *a, **k):
        if len(gpu["autocast_asked"]) < 50:
            gpu["autocast_asked"].append(str(precision))
        return course_autocast(precision, *a, **k)
    up.autocast = autocast_

    resolve = up.set_precision

    def set_precision_(precision, device, *a, **k):
        result = resolve(precision, device, *a, **k)
        gpu["precision"].append({"asked": str(precision), "returned": str(result)})
        return result
    up.set_precision = set_precision_

    # -- the profiler: its activities (CUDA dropped here), starts, steps and stops
    import torch.profiler as tprof
    profile = tprof.profiler.profile
    state = gpu["profiler"]
    profile_init = profile.__init__

    def profile_init_(self, *a, activities=None, **k):
        names = sorted(str(x).rsplit(".", 1)[-1] for x in (activities or []))
        state["activities"].append(names)
        kept = [x for x in (activities or []) if "CUDA" not in str(x)] or None
        return profile_init(self, *a, activities=kept, **k)
    profile.__init__ = profile_init_
    for method, key in (("start", "started"), ("stop", "stopped"), ("step", "steps")):
        original = getattr(profile, method)

        def counting(self, *a, _original=original, _key=key, **k):
            state[_key] += 1
            if _key == "steps":
                event("profiler.step", from_script())
            return _original(self, *a, **k)
        setattr(profile, method, counting)

    # -- FSDP's offload: pinned host memory needs a GPU
    import torch.distributed.fsdp as fsdp
    offload_init = fsdp.CPUOffloadPolicy.__init__

    def offload_init_(self, pin_memory=True, *a, **k):
        gpu["offload"].append({"pin_memory": bool(pin_memory)})
        offload_init(self, False, *a, **k)
    fsdp.CPUOffloadPolicy.__init__ = offload_init_

    # -- device meshes of type "cuda" (gloo here): recorded, built on the CPU
    init_mesh = dm.init_device_mesh

    def init_device_mesh_(device_type, *a, **k):
        gpu["meshes"].append(str(device_type))
        return init_mesh("cpu" if str(device_type) == "cuda" else device_type, *a, **k)
    dm.init_device_mesh = init_device_mesh_

    # -- what the script prints, in the timeline
    probe.on_print = lambda text, line: event("print", line, text=text[:120])


# what the stand-in cannot follow (a script that reaches for a real GPU itself: x.cuda(), a
# torch.device("cuda") of its own, CUDA streams): not the script's mistake, not judged
LIMITS = re.compile(r"not compiled with CUDA|No CUDA GPUs|Found no NVIDIA driver|CUDA driver|"
                    r"NVTX functions not installed|cudaGetDeviceCount|no CUDA-capable device|"
                    r"Cannot access accelerator device", re.I)


def beyond_the_standin(failure) -> bool:
    """Whether a stand-in run stopped because it met real CUDA (see LIMITS)."""
    return failure is not None and bool(LIMITS.search(failure.message or ""))


# ------------------------------------------------------------------------ reading the record
def observed(run, rank: int = 0) -> dict:
    """The stand-in's record of one rank of a run started with gpu=True ({} if none)."""
    records = run.ranks if run.ranks else []
    record = records[rank] if rank < len(records) else None
    return (record or {}).get("gpu") or {}


def clock_reads_before_sync(gpu: dict, is_report) -> list[int]:
    """Lines where the script read the clock to end an interval while the GPU could still be
    working: after the last optimizer step and before the report that `is_report(text)` finds,
    with no synchronisation of the script's own in between."""
    late, last_step, synced, reads = [], None, True, []
    for e in gpu.get("timeline", []):
        kind = e["kind"]
        if kind == "step":
            last_step, synced, reads = e, False, []
        elif kind == "sync" and e.get("script"):
            synced = True
        elif kind == "clock" and last_step is not None:
            reads.append((e["line"], synced))
        elif kind == "print" and is_report(e.get("text", "")) and last_step is not None:
            late += [line for line, was_synced in reads if not was_synced]
            reads = []
    return sorted(set(late))
