"""Test-only: make a CPU run fail where a GPU run would (the tests put this folder on PYTHONPATH;
Python imports sitecustomize at start-up). Nothing here is part of the course.

The GPU suite (tests/test_gpu.py) runs on the CPU in CI as a rehearsal. What differs on a GPU
and can be reproduced on a CPU is reproduced here, each switched on by its variable:

REHEARSE_STRICT_STAGES=1: every pipeline stage checks the outputs of each forward against the
    shapes and dtypes of its first forward, and stops as torch 2.11 does at every step on a GPU
    ("Stage 1 forward outputs: value 0 has a dtype mismatch: expected torch.bfloat16 actual
    torch.float32"). Newer torch checks only under TORCH_DISTRIBUTED_DEBUG=DETAIL, so without
    this a stage that evaluates in another precision than it trained in passes on a CPU and
    crashes on the first GPU that runs bf16 by default.
REHEARSE_GPU_SAMPLER=1: the system sampler (utils/system_metrics.py) finds a stand-in GPU for
    every process, numbered by its local rank, with fixed plausible NVML values: the values
    need a GPU, reading them back from TensorBoard does not.
"""

import os


class PipeliningShapeError(RuntimeError):
    """The name torch 2.11 gives the error (torch.distributed.pipelining._utils)."""


def _check_stage_outputs(stage_init):
    def __init__(self, submodule, stage_index, *args, **kwargs):
        stage_init(self, submodule, stage_index, *args, **kwargs)
        first = []

        def check(module, inputs, output):
            outputs = output if isinstance(output, (tuple, list)) else (output,)
            metas = [(tuple(t.shape), t.dtype) for t in outputs if hasattr(t, "dtype")]
            if not first:
                first.extend(metas)
                return
            for i, ((shape, dtype), (want_shape, want_dtype)) in enumerate(zip(metas, first)):
                if dtype != want_dtype:
                    raise PipeliningShapeError(
                        f"Stage {stage_index} forward outputs: value {i} has a dtype mismatch: "
                        f"expected {want_dtype} actual {dtype}")
                if shape != want_shape:
                    raise PipeliningShapeError(
                        f"Stage {stage_index} forward outputs: value {i} has a shape mismatch: "
                        f"expected {want_shape} actual {shape}")

        submodule.register_forward_hook(check)

    return __init__


if os.environ.get("REHEARSE_STRICT_STAGES") == "1":
    from torch.distributed.pipelining import PipelineStage

    PipelineStage.__init__ = _check_stage_outputs(PipelineStage.__init__)


class StandInNvml:
    """The NVML calls SystemSampler makes, answered with one busy GPU's plausible values."""

    NVML_TEMPERATURE_GPU = 0

    def nvmlDeviceGetUtilizationRates(self, handle):
        class Rates:
            gpu = 87
        return Rates()

    def nvmlDeviceGetMemoryInfo(self, handle):
        class Memory:
            used = 3 * 2**30
        return Memory()

    def nvmlDeviceGetPowerUsage(self, handle):
        return 412_000  # milliwatts

    def nvmlDeviceGetTemperature(self, handle, sensor):
        return 54

    def nvmlDeviceGetIndex(self, handle):
        return handle


if os.environ.get("REHEARSE_GPU_SAMPLER") == "1":
    import utils.system_metrics as _system_metrics

    def _start_stand_in_sampler(device, seconds=_system_metrics.SAMPLE_SECONDS):
        nvml, index = StandInNvml(), int(os.environ.get("LOCAL_RANK", 0))
        return _system_metrics.SystemSampler(index, nvml, seconds), index

    _system_metrics.start_sampler = _start_stand_in_sampler
