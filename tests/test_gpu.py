"""The course on real GPUs: every script under torchrun with NCCL, and the parallel steps train
like one process, as the CPU suite shows with gloo.

Run on a GPU node before the course: `.venv/bin/python -m pytest -m gpu` (or submit
gpu_tests.sbatch). Where torch sees no CUDA GPU every test here is skipped with the reason.
One GPU runs every script, FSDP save and resume and Lightning; the equivalence checks need 2
GPUs, the 4- and 8-stage layouts of the pipeline and the capstone 4 and 8.

On GPUs the comparisons allow rel 1e-4 instead of the CPU suite's 1e-5: a batch split over
ranks or microbatches runs other cuBLAS kernels (other summation orders), and the embedding's
backward adds with atomics in no fixed order. The comparisons run with --precision fp32 (TF32
off), so this is float32 rounding; the smoke tests on one GPU run the default, --precision auto,
which is bf16 on GPUs that have it.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import gpu_env, host_gpu_count, no_gpu_reason, read_summary, run_script
from distributed import run_distributed

_REASON = no_gpu_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900),
              pytest.mark.skipif(_REASON is not None, reason=f"GPU suite: {_REASON}")]

COMMON = ("--dataset", "synthetic", "--preset", "tiny", "--dropout", 0, "--seed", 3,
          "--logger", "none", "--log-every", 1)
RTOL = 1e-4
BASELINE = "solutions/train/to_distributed_training.py"
SCRIPTS = ["to_distributed_training.py", "fsdp_training.py", "tp_training.py", "pp_training.py",
           "nd_training.py"]


def needs_gpus(n: int):
    return pytest.mark.skipif(_REASON is None and host_gpu_count() < n,
                              reason=f"needs {n} GPUs")


def run(script, out, *args, nproc=1, cache=None, torchrun=True, timeout=600, precision="fp32"):
    """A script on GPUs (one per process, under torchrun) with the tiny preset; its summary.
    fp32 unless told otherwise: the equivalence checks compare float32 runs."""
    run_script(script, *COMMON, "--precision", precision, *args, "--out-dir", out, nproc=nproc,
               torchrun=torchrun, env=gpu_env(cache_dir=cache), timeout=timeout)
    return read_summary(out)


def assert_trains_like(summary: dict, reference: dict, steps: int):
    """The same losses step by step, and the same validation and test loss."""
    assert summary["global_batch_size"] == reference["global_batch_size"]
    assert len(summary["loss_history"]) == len(reference["loss_history"]) == steps
    assert summary["loss_history"] == pytest.approx(reference["loss_history"], rel=RTOL)
    assert summary["val_loss"] == pytest.approx(reference["val_loss"], rel=RTOL)
    assert summary["test_loss"] == pytest.approx(reference["test_loss"], rel=RTOL)


def assert_ran_on_the_gpu(summary: dict, steps: int):
    assert summary["device"].startswith("cuda")
    # the default precision: bf16 where the GPU has it (Ampere and later), MFU against that peak
    ampere = torch.cuda.get_device_capability() >= (8, 0)
    assert summary["precision"] == ("bf16" if ampere else "fp32")
    assert len(summary["loss_history"]) == steps
    assert all(math.isfinite(v) for v in summary["loss_history"])
    # MFU against this GPU's peak (a data sheet, or a matmul measured on it), not the CPU's
    assert 0 < summary["mfu"] < 1, summary["peak_flops_source"]
    assert "cpu" not in summary["peak_flops_source"]


# ---- one GPU -----------------------------------------------------------------------------------

def sums_built_on_the_cpu(rank, world_size):
    from utils import distributed_utils as du
    total = du.all_reduce_sum(torch.tensor([rank + 1.0]))  # a CPU tensor into NCCL
    per_rank = du.gather_per_rank(10.0 * rank, torch.device("cpu"))
    return total.device.type, total.item(), per_rank


@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=needs_gpus(2))])
def test_the_helpers_sum_cpu_built_tensors_over_an_nccl_group(world_size):
    for device_type, total, per_rank in run_distributed(sums_built_on_the_cpu, world_size,
                                                        device="cuda"):
        assert device_type == "cuda"
        assert total == sum(range(1, world_size + 1))
        assert per_rank == [10.0 * r for r in range(world_size)]


def measured_and_data_sheet_peaks(rank, world_size):
    """{precision: (data-sheet peak, its source, measured peak)} on this process's GPU."""
    from utils.metrics import measure_matmul_flops, peak_flops
    device = torch.device("cuda", rank)
    return {precision: (*peak_flops(device, precision), measure_matmul_flops(device, dtype))
            for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}


def test_a_matmul_measured_on_this_gpu_comes_near_its_data_sheet_peak(monkeypatch):
    # A GPU without a data-sheet entry (L40S, B200, ...) gets MFU against a measured matmul;
    # one too small for the GPU measures launch overhead, and MFU would come out too high.
    monkeypatch.delenv("PEAK_FLOPS", raising=False)  # the workers inherit the environment
    peaks = run_distributed(measured_and_data_sheet_peaks, 1, device="cuda")[0]
    for precision, (sheet, source, measured) in peaks.items():
        if "data sheet" not in source:
            pytest.skip(f"this GPU has no data-sheet entry to compare with ({source})")
        assert 0.4 * sheet < measured < 1.05 * sheet, (source, measured / 1e12)


@pytest.mark.parametrize("script", [f"train/{s}" for s in SCRIPTS] +
                         [f"solutions/train/{s}" for s in SCRIPTS])
def test_every_script_trains_a_few_steps_on_one_gpu_under_torchrun(script, tmp_path, data_cache):
    summary = run(script, tmp_path, "--max-steps", 3, "--batch-size", 8, cache=data_cache,
                  precision="auto")
    assert_ran_on_the_gpu(summary, steps=3)


@pytest.mark.parametrize("script", ["train/Lit_training.py", "solutions/train/Lit_training.py"])
def test_lightning_trains_on_one_gpu_and_reports_mfu_against_a_gpu_peak(script, tmp_path,
                                                                        data_cache):
    # Lightning starts its own processes (srun on a cluster): plain python, one device
    summary = run(script, tmp_path, "--max-steps", 3, "--batch-size", 8, "--devices", 1,
                  cache=data_cache, torchrun=False, precision="auto")
    assert_ran_on_the_gpu(summary, steps=3)


@pytest.fixture(scope="module")
def fsdp_whole(tmp_path_factory, data_cache):
    """The FSDP solution for 6 steps at global batch 8 on one GPU, uninterrupted."""
    out = tmp_path_factory.mktemp("fsdp_whole")
    return run("solutions/train/fsdp_training.py", out, "--max-steps", 6, "--batch-size", 8,
               cache=data_cache)


def test_fsdp_on_one_gpu_saves_and_resumes_to_the_losses_of_an_uninterrupted_run(
        fsdp_whole, tmp_path, data_cache):
    script = "solutions/train/fsdp_training.py"
    run(script, tmp_path, "--max-steps", 3, "--batch-size", 8, cache=data_cache)
    resumed = run(script, tmp_path, "--max-steps", 6, "--batch-size", 8,
                  "--resume", tmp_path / "checkpoints" / "last", cache=data_cache)
    assert resumed["steps"] == 6
    assert_trains_like(resumed, fsdp_whole, steps=6)


@pytest.mark.parametrize("n", [1, pytest.param(2, marks=needs_gpus(2)),
                               pytest.param(4, marks=needs_gpus(4)),
                               pytest.param(8, marks=needs_gpus(8))])
def test_the_pipeline_on_n_gpus_trains_like_one_process(n, tmp_path, data_cache):
    # n stages need n layers: the workshop preset has 8 (short windows keep it quick)
    preset = ("--preset", "tiny") if n <= 2 else ("--preset", "workshop", "--seq-len", 32)
    args = ("--max-steps", 3, "--batch-size", 8, *preset)
    ref = run(BASELINE, tmp_path / "ref", *args, cache=data_cache)
    pp = run("solutions/train/pp_training.py", tmp_path / "pp", *args, "--microbatches", 8,
             nproc=n, cache=data_cache)
    assert pp["pipeline_stages"] == n
    assert_trains_like(pp, ref, steps=3)


def test_the_performance_step_on_one_gpu_is_faster_in_bf16_and_its_trace_has_kernels(
        tmp_path, data_cache):
    # The workshop preset: big enough matmuls that bf16's tensor cores show (the tiny one is
    # bound by kernel launches); short windows and 20 steps keep it to seconds.
    script = "solutions/train/perf_training.py"
    args = ("--preset", "workshop", "--seq-len", 128, "--batch-size", 16, "--max-steps", 20,
            "--log-every", 10)
    fp32 = run(script, tmp_path / "fp32", *args, cache=data_cache, precision="fp32")
    bf16 = run(script, tmp_path / "bf16", *args, "--profile", cache=data_cache, precision="bf16")
    assert "bfloat16" in bf16["peak_flops_source"]  # MFU against the bf16 peak
    assert bf16["tokens_per_s"] > fp32["tokens_per_s"]
    [trace] = (tmp_path / "bf16" / "profile").glob("rank0.*.pt.trace.json")
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)  # CUDA kernels, not only CPU ops
    assert {"forward", "backward", "optimizer"} <= {e.get("name") for e in events}


# (pp, dp, tp) for 1, 2, 4 and 8 GPUs: every degree used once the GPUs allow it
ND_LAYOUTS = {1: (1, 1, 1), 2: (2, 1, 1), 4: (2, 1, 2), 8: (2, 2, 2)}


@pytest.mark.parametrize("n", [1, pytest.param(2, marks=needs_gpus(2)),
                               pytest.param(4, marks=needs_gpus(4)),
                               pytest.param(8, marks=needs_gpus(8))])
def test_the_capstone_on_n_gpus_trains_like_one_process(n, tmp_path, data_cache):
    pp, dp, tp = ND_LAYOUTS[n]
    ref = run(BASELINE, tmp_path / "ref", "--max-steps", 3, "--batch-size", 8 * dp,
              cache=data_cache)
    nd = run("solutions/train/nd_training.py", tmp_path / "nd", "--max-steps", 3,
             "--batch-size", 8, "--pp", pp, "--dp", dp, "--tp", tp, "--microbatches", 2,
             nproc=n, cache=data_cache)
    assert_trains_like(nd, ref, steps=3)


# ---- two GPUs: the CPU suite's equivalences --------------------------------------------------

@needs_gpus(2)
def test_ddp_on_two_gpus_trains_like_one_gpu_with_the_same_global_batch(tmp_path, data_cache):
    ref = run(BASELINE, tmp_path / "one", "--max-steps", 6, "--batch-size", 16, cache=data_cache)
    two = run(BASELINE, tmp_path / "two", "--max-steps", 6, "--batch-size", 8, nproc=2,
              cache=data_cache)
    assert two["world_size"] == 2
    assert_trains_like(two, ref, steps=6)


@needs_gpus(2)
def test_fsdp_on_two_gpus_trains_like_one_process_and_resumes_on_one(fsdp_whole, tmp_path,
                                                                      data_cache):
    script = "solutions/train/fsdp_training.py"
    ref = run(BASELINE, tmp_path / "single", "--max-steps", 6, "--batch-size", 8,
              cache=data_cache)
    two = run(script, tmp_path / "two", "--max-steps", 6, "--batch-size", 4, nproc=2,
              cache=data_cache)
    assert_trains_like(two, ref, steps=6)
    assert_trains_like(fsdp_whole, ref, steps=6)
    # stopped on 2 GPUs, resumed on 1 with the same global batch: DCP reshards
    stopped = tmp_path / "stopped"
    run(script, stopped, "--max-steps", 3, "--batch-size", 4, nproc=2, cache=data_cache)
    resumed = run(script, stopped, "--max-steps", 6, "--batch-size", 8,
                  "--resume", stopped / "checkpoints" / "last", cache=data_cache)
    assert_trains_like(resumed, two, steps=6)


@needs_gpus(2)
def test_tensor_parallel_on_two_gpus_trains_like_one_process(tmp_path, data_cache):
    ref = run(BASELINE, tmp_path / "ref", "--max-steps", 4, "--batch-size", 8, cache=data_cache)
    tp = run("solutions/train/tp_training.py", tmp_path / "tp", "--max-steps", 4,
             "--batch-size", 8, "--tp", 2, nproc=2, cache=data_cache)
    assert tp["tensor_parallel_size"] == 2
    assert_trains_like(tp, ref, steps=4)


@needs_gpus(2)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_pipeline_stages_on_two_gpus_train_like_one_process(schedule, tmp_path, data_cache):
    ref = run(BASELINE, tmp_path / "ref", "--max-steps", 4, "--batch-size", 8, cache=data_cache)
    pp = run("solutions/train/pp_training.py", tmp_path / "pp", "--max-steps", 4,
             "--batch-size", 8, "--schedule", schedule, "--microbatches", 4, nproc=2,
             cache=data_cache)
    assert pp["schedule"] == schedule and len(pp["idle_fraction_per_stage"]) == 2
    assert_trains_like(pp, ref, steps=4)


def test_every_gpu_of_a_run_has_its_utilisation_memory_power_and_temperature_curves(
        tmp_path, data_cache):
    """The system sampler on a real GPU (NVML, found by UUID): one DDP run on one GPU logs
    its GPU's curves next to the training metrics, with plausible values."""
    import socket

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run_script(BASELINE, *COMMON[:-4], "--max-steps", 20, "--log-every", 5, "--logger",
               "tensorboard", "--out-dir", tmp_path, nproc=1, torchrun=True,
               env=gpu_env(cache_dir=data_cache), timeout=600)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    prefix = f"system/{socket.gethostname()}/gpu"
    gpus = {t.split("/")[2] for t in tags if t.startswith(prefix)}
    assert len(gpus) == 1, tags
    last = {t.rsplit("/", 1)[1]: events.Scalars(t)[-1].value
            for t in tags if t.startswith(f"system/{socket.gethostname()}/{gpus.pop()}/")}
    assert 0 <= last["utilization"] <= 100 and 0 < last["memory_gib"] < 1000
    assert 0 < last["power_w"] < 2000 and 0 < last["temperature_c"] < 120
    assert events.Scalars("memory/peak_gib")[-1].value > 0  # torch.cuda.max_memory_allocated


def sample_own_gpu(rank, world_size):
    from utils.system_metrics import FIELDS, start_sampler
    sampler, index = start_sampler(torch.device("cuda", rank), seconds=60)
    try:
        return index, dict(zip(FIELDS, sampler.take()))
    finally:
        sampler.close()


def test_the_sampler_finds_this_processs_gpu_in_nvml():
    # in a fresh process: this one hides the GPUs (conftest.py)
    (index, values), = run_distributed(sample_own_gpu, 1, device="cuda")
    assert index >= 0 and values["gpu_memory_gib"] > 0 and values["gpu_temperature_c"] > 0


def test_the_memory_breakdown_on_one_gpu_matches_the_formula_and_fits_under_the_allocator_peak(
        tmp_path, data_cache):
    """The GPU-only part of the breakdown: the allocator's peak and reserved bytes, next to the
    tensors counted by category (which must still equal the formula on a GPU, in fp32)."""
    summary = run("solutions/train/to_distributed_training.py", tmp_path, "--max-steps", 3,
                  "--batch-size", 8, cache=data_cache)
    memory = summary["memory"]
    for category in ("parameters", "gradients", "optimizer", "activations"):
        assert memory[category][0] == pytest.approx(memory["formula"][category][0], rel=0.1)
    # the allocator holds at least the counted tensors at its peak, and reserves at least that
    assert memory["total"][0] <= memory["peak"][0] <= memory["reserved"][0]
