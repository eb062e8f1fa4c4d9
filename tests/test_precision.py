"""--precision, the fused AdamW and --compile: what each setting turns on, and that training
with it still tracks plain fp32 training (on CPU, where bf16 autocast works too)."""

from __future__ import annotations

import argparse
import json
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from conftest import load_script, read_summary, run_script, script_env
from distributed import run_distributed
from model import TransformerLM, get_config
from utils import metrics
from utils.args import base_parser
from utils.precision import (autocast, lightning_precision, matmul_dtype, resolve_precision,
                             set_precision)

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
pytestmark = pytest.mark.warm_start  # runs forked warm: tests/warm_launch.py
COMMON = ("--dataset", "synthetic", "--preset", "tiny", "--dropout", 0, "--logger", "none",
          "--seed", 3, "--log-every", 1000)


@pytest.fixture
def fp32_switch():
    """Leave the global TF32 switch as the test found it."""
    before = torch.backends.cuda.matmul.fp32_precision
    yield
    torch.backends.cuda.matmul.fp32_precision = before


# ---- the flag and what it maps to --------------------------------------------------------

def test_every_script_gets_precision_and_compile_flags_defaulting_to_auto_and_off():
    args = base_parser("x.py", None).parse_args([])
    assert args.precision == "auto" and args.compile is False
    args = base_parser("x.py", None).parse_args(["--precision", "bf16", "--compile"])
    assert args.precision == "bf16" and args.compile is True
    with pytest.raises(SystemExit):
        base_parser("x.py", None).parse_args(["--precision", "fp16"])


def pretend_a_gpu(monkeypatch, major: int):
    """torch.cuda as it looks on a GPU of compute capability `major`.x, where bf16 tensors can
    be made (on a V100, by emulation: torch.cuda.is_bf16_supported() says True there)."""
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(major=major))
    monkeypatch.setattr(torch.cuda, "_check_bf16_tensor_supported", lambda d: True)


def test_auto_is_fp32_on_a_cpu_and_bf16_on_a_gpu_that_has_it(monkeypatch):
    assert resolve_precision("auto", CPU) == "fp32"
    pretend_a_gpu(monkeypatch, major=8)  # A100, H100
    assert resolve_precision("auto", CUDA) == "bf16"
    assert resolve_precision("tf32", CPU) == "tf32"  # explicit settings stay as given


def test_auto_is_fp32_on_a_v100_which_only_emulates_bf16(monkeypatch):
    pretend_a_gpu(monkeypatch, major=7)
    assert torch.cuda.is_bf16_supported()  # PyTorch's default counts emulation
    assert resolve_precision("auto", CUDA) == "fp32"
    assert resolve_precision("bf16", CUDA) == "bf16"  # asked for, it is what you get


def test_tf32_turns_the_matmul_switch_on_and_every_other_precision_turns_it_off(fp32_switch):
    assert set_precision("tf32", CUDA) == "tf32"
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    assert set_precision("bf16", CUDA) == "bf16"
    assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    set_precision("tf32", CUDA)
    assert set_precision("auto", CPU) == "fp32"
    assert torch.backends.cuda.matmul.fp32_precision == "ieee"


def test_bf16_autocast_runs_matmuls_in_bf16_and_keeps_weights_and_loss_in_fp32():
    layer = torch.nn.Linear(8, 16)
    x, y = torch.randn(4, 8), torch.randint(16, (4,))
    with autocast("bf16", CPU):
        out = layer(x)
        loss = F.cross_entropy(out, y)
    assert out.dtype == torch.bfloat16 and loss.dtype == torch.float32
    loss.backward()
    assert layer.weight.dtype == layer.weight.grad.dtype == torch.float32
    for precision in ("fp32", "tf32"):
        with autocast(precision, CPU):
            assert layer(x).dtype == torch.float32


def fsdp_compute_dtypes(rank, world_size):
    """What apply_fsdp(model, precision) computes a block in, and the dtypes it keeps."""
    fsdp = load_script("solutions/train/fsdp_training.py")
    result = {}
    for precision in ("fp32", "tf32", "bf16"):
        torch.manual_seed(0)
        model = fsdp.apply_fsdp(TransformerLM(get_config("tiny", vocab_size=97)), precision)
        seen = []
        model.layers["0"].mlp.in_proj.register_forward_hook(
            lambda m, inputs, out, seen=seen: seen.append((m.weight.dtype, out.dtype)))
        logits = model(torch.randint(97, (2, 8)))
        result[precision] = dict(compute=seen[0], logits=logits.dtype,
                                 master=model.layers["0"].mlp.in_proj.weight.dtype)
    return result


def test_fsdp_takes_its_mixed_precision_policy_from_the_precision_flag():
    result = run_distributed(fsdp_compute_dtypes, 1, timeout=120)[0]
    assert result["bf16"]["compute"] == (torch.bfloat16, torch.bfloat16)
    for precision in ("fp32", "tf32"):
        assert result[precision]["compute"] == (torch.float32, torch.float32)
    for r in result.values():  # fp32 master weights and fp32 logits for the loss, always
        assert r["master"] == r["logits"] == torch.float32


def test_lightning_gets_bf16_mixed_for_bf16_and_32_true_otherwise():
    assert lightning_precision("bf16") == "bf16-mixed"
    assert lightning_precision("fp32") == lightning_precision("tf32") == "32-true"


def test_the_lightning_trainer_gets_bf16_mixed_for_bf16_and_32_true_for_auto_on_cpu(monkeypatch,
                                                                                  fp32_switch):
    for var in ("SLURM_NTASKS", "SLURM_JOB_NAME", "SLURM_NNODES", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(var, raising=False)
    lit = load_script("solutions/train/Lit_training.py")
    args = argparse.Namespace(accelerator="cpu", device="cpu", devices=1, num_nodes=1,
                              strategy="ddp", precision="bf16")
    assert lit.trainer_settings(args)["precision"] == "bf16-mixed"
    args.precision = "auto"
    assert lit.trainer_settings(args)["precision"] == "32-true" and args.precision == "fp32"


# ---- MFU divides by the peak of the dtype the matmuls run in -----------------------------

@pytest.mark.parametrize("precision, peak", [("fp32", 67e12), ("tf32", 494.7e12),
                                             ("bf16", 989.4e12)])
def test_mfu_on_a_known_gpu_divides_by_the_data_sheet_peak_of_the_precision(monkeypatch,
                                                                            precision, peak):
    monkeypatch.delenv("PEAK_FLOPS", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    expected = (peak, f"H100 data sheet ({matmul_dtype(precision)})")
    assert metrics.peak_flops(CUDA, precision) == expected


@pytest.mark.parametrize("name, gpu", [("NVIDIA H100 PCIe", "H100 PCIe"),
                                       ("NVIDIA H100 NVL", "H100 NVL"),
                                       ("NVIDIA GH200 480GB", "GH200"),
                                       ("NVIDIA GH200 120GB", "GH200"),
                                       ("NVIDIA H200", "H200"),
                                       ("AMD Instinct MI250X", "MI250X"),
                                       ("AMD Instinct MI250X / MI250", "MI250X"),
                                       ("AMD Instinct MI300X", "MI300X"),
                                       ("AMD Instinct MI300A", "MI300A"),
                                       ("NVIDIA A100-SXM4-80GB", "A100"),
                                       ("Tesla V100-SXM2-32GB", "V100")])
def test_each_gpu_takes_the_peaks_of_its_own_card_not_of_one_it_shares_a_name_with(
        monkeypatch, name, gpu):
    monkeypatch.delenv("PEAK_FLOPS", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    assert metrics.peak_flops(CUDA, "bf16") == (metrics.GPU_PEAK_FLOPS[gpu]["bfloat16"],
                                                f"{gpu} data sheet (bfloat16)")


# The data sheets, in TFLOP/s (dense: tensor-core figures without sparsity), per torch device:
#   NVIDIA GH200 Grace Hopper Superchip data sheet: FP32 67, TF32 Tensor Core 494 (989 with
#     sparsity), BF16 Tensor Core 990 (1,979 with sparsity)
#   AMD Instinct MI250X data sheet (one card = 2 GCDs = 2 torch devices): FP32 Matrix 95.7,
#     BF16 383 (no TF32)
#   AMD Instinct MI300X data sheet: FP32 Matrix 163.4, TF32 Matrix 653.7, BF16 1,307.4 (dense)
#   AMD Instinct MI300A data sheet: FP32 Matrix 122.6, TF32 Matrix 490.3, BF16 980.6 (dense)
DATA_SHEETS = {
    "NVIDIA GH200 480GB": (67, 494.7, 989.4),
    "AMD Instinct MI250X": (95.7 / 2, 95.7 / 2, 383 / 2),
    "AMD Instinct MI300X": (163.4, 653.7, 1307.4),
    "AMD Instinct MI300A": (122.6, 490.3, 980.6),
}


@pytest.mark.parametrize("name", DATA_SHEETS)
def test_the_mfu_peaks_of_grace_hopper_and_amd_instinct_are_their_data_sheets(monkeypatch, name):
    monkeypatch.delenv("PEAK_FLOPS", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    peaks = [metrics.peak_flops(CUDA, p)[0] / 1e12 for p in ("fp32", "tf32", "bf16")]
    assert peaks == pytest.approx(DATA_SHEETS[name], rel=2e-3)


def test_the_pcie_h100_has_lower_peaks_than_the_sxm_h100(monkeypatch):
    monkeypatch.delenv("PEAK_FLOPS", raising=False)
    peaks = {}
    for name in ("NVIDIA H100 PCIe", "NVIDIA H100 80GB HBM3"):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, name=name: name)
        peaks[name] = [metrics.peak_flops(CUDA, p)[0] for p in ("fp32", "tf32", "bf16")]
    assert peaks["NVIDIA H100 PCIe"] == [51.2e12, 378e12, 756.5e12]
    assert all(p < s for p, s in zip(peaks["NVIDIA H100 PCIe"], peaks["NVIDIA H100 80GB HBM3"]))


@pytest.fixture
def measured(monkeypatch, tmp_path):
    """A fake matmul measurement (1 GFLOP/s, each call recorded) and an empty peak cache."""
    monkeypatch.delenv("PEAK_FLOPS", raising=False)
    monkeypatch.setenv("COURSE_PEAK_CACHE", str(tmp_path / "peaks.json"))
    metrics.measured_peak_flops.cache_clear()
    calls = []
    monkeypatch.setattr(metrics, "measure_matmul_flops",
                        lambda device, dtype, seconds=0.3: calls.append(dtype) or 1e9)
    yield calls
    metrics.measured_peak_flops.cache_clear()


def test_mfu_on_a_cpu_measures_a_matmul_in_the_precision_and_tf32_there_is_fp32(measured):
    sources = [metrics.peak_flops(CPU, p)[1] for p in ("fp32", "tf32", "bf16")]
    assert measured == [torch.float32, torch.bfloat16]  # tf32 on a CPU is fp32: measured once
    assert all(s.startswith("measured float32 matmul on cpu (") for s in sources[:2])
    assert sources[2].startswith("measured bfloat16 matmul on cpu (")


def test_a_cpu_peak_is_measured_once_per_machine_and_read_back_by_later_runs(measured):
    """Every run's MFU divides by the same number: the first run measures, the others read
    the cache (a new process: the in-memory copy is gone)."""
    first = metrics.peak_flops(CPU, "fp32")
    metrics.measured_peak_flops.cache_clear()
    assert metrics.peak_flops(CPU, "fp32") == first and measured == [torch.float32]
    assert str(metrics.peak_cache_file()) in first[1] and metrics.device_model(CPU) in first[1]


def test_measuring_the_peak_leaves_the_training_random_numbers_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    metrics.measure_matmul_flops(CPU, torch.float32, n=64, seconds=0.01)
    assert torch.equal(torch.rand(3), expected)


def test_a_cpu_peak_is_the_fastest_matmul_size_and_stops_growing_once_one_takes_long(
        monkeypatch):
    """An AVX2 CPU without bf16 units runs a bf16 matmul fastest small (2.9 GFLOP/s at 128,
    0.9 at 1024, 2.4 s each): the peak is the best size's, and no size past one that takes a
    tenth of the time allowed is tried."""
    speed = {128: 2.9e9, 256: 1.3e9, 512: 1.3e9, 1024: 0.9e9}  # FLOP/s of one n x n matmul
    tried = []

    def fastest(device, dtype, n, seconds):
        tried.append(n)
        return speed[n], 2 * n ** 3 / speed[n]
    monkeypatch.setattr(metrics, "_fastest_matmul", fastest)
    assert metrics.measure_matmul_flops(CPU, torch.bfloat16, seconds=1.0) == 2.9e9
    assert tried == [128, 256, 512]  # 512 took 0.2 s, more than a tenth of 1 s
    assert metrics.measure_matmul_flops(CPU, torch.bfloat16, n=1024) == 0.9e9  # asked for


def test_the_training_summary_reports_the_precision_and_its_peak(monkeypatch):
    monkeypatch.setenv("PEAK_FLOPS", "1e12")
    throughput = SimpleNamespace(tokens_per_s=lambda: 1000.0)
    args = SimpleNamespace(precision="bf16", batch_size=2, preset="tiny")
    summary = metrics.training_summary(
        args, get_config("tiny", vocab_size=11), SimpleNamespace(source="synthetic"),
        world_size=2, steps=1, loss_history=[], val_loss=1.0, test_loss=1.0,
        throughput=throughput, flops_per_token=1e6, device=CPU, start_time=0.0)
    assert summary["precision"] == "bf16"
    assert summary["mfu"] == pytest.approx(1000.0 * 1e6 / (1e12 * 2))


def test_mfu_above_100_percent_measures_a_peak_kept_from_a_busy_moment_again(measured, capsys):
    """A peak measured while the machine was busy (here 1 MFLOP/s) made MFU 146 % in the
    README's run; the run that sees it measures again, keeps the larger and says so."""
    _, _, key = metrics._peak_key(CPU, "float32")
    metrics.peak_cache_file().write_text(json.dumps({key: {"flops": 1e6, "measured": "x"}}))
    throughput = SimpleNamespace(tokens_per_s=lambda: 1000.0)
    args = SimpleNamespace(precision="fp32", batch_size=2, preset="tiny")
    summary = metrics.training_summary(
        args, get_config("tiny", vocab_size=11), SimpleNamespace(source="synthetic"),
        world_size=1, steps=1, loss_history=[], val_loss=1.0, test_loss=1.0,
        throughput=throughput, flops_per_token=1e4, device=CPU, start_time=0.0)
    assert summary["mfu"] == pytest.approx(10.0)  # this run's figures stay as logged
    assert "note: MFU above 100 %" in capsys.readouterr().out
    metrics.measured_peak_flops.cache_clear()      # the next run reads the new measurement
    assert metrics.peak_flops(CPU, "fp32")[0] == 1e9 and measured == [torch.float32]


# ---- training with it --------------------------------------------------------------------

@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory, data_cache):
    """The DDP solution, one process, 12 steps: fp32 and bf16 from the same start."""
    tmp = tmp_path_factory.mktemp("precision")
    env = script_env(cache_dir=data_cache)
    for precision in ("fp32", "bf16"):
        run_script("solutions/train/to_distributed_training.py", *COMMON, "--max-steps", 12,
                   "--batch-size", 8, "--precision", precision, "--out-dir", tmp / precision,
                   env=env)
    return {p: read_summary(tmp / p) for p in ("fp32", "bf16")}


def test_the_cpu_default_is_fp32_so_the_equivalence_tests_compare_fp32_runs(tmp_path, data_cache):
    run_script("solutions/train/to_distributed_training.py", *COMMON, "--max-steps", 1,
               "--out-dir", tmp_path, env=script_env(cache_dir=data_cache))
    summary = read_summary(tmp_path)
    assert summary["precision"] == "fp32" and "float32" in summary["peak_flops_source"]


def test_bf16_on_cpu_trains_with_finite_losses_close_to_fp32(ddp_runs):
    fp32, bf16 = ddp_runs["fp32"], ddp_runs["bf16"]
    assert bf16["precision"] == "bf16" and "bfloat16" in bf16["peak_flops_source"]
    losses = torch.tensor(bf16["loss_history"])
    assert len(losses) == 12 and torch.isfinite(losses).all()
    assert losses[-1] < losses[0] - 0.1  # it learns
    # bf16 keeps 8 bits of mantissa: the losses differ, by far less than the learning
    torch.testing.assert_close(losses, torch.tensor(fp32["loss_history"]), atol=0.05, rtol=0)
    assert bf16["val_loss"] == pytest.approx(fp32["val_loss"], abs=0.05)


def fused_and_foreach_adamw_on_fsdp_shards(rank, world_size):
    """The GPU path (fused AdamW) on DTensor shards, run on CPU, where fused AdamW exists too."""
    from torch.distributed.fsdp import fully_shard
    result = {}
    for fused in (False, True):
        torch.manual_seed(0)
        model = TransformerLM(get_config("tiny", vocab_size=97, dropout=0.0))
        for block in model.layers.values():
            fully_shard(block)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            batch = torch.randint(97, (4, 33), generator=g).chunk(world_size)[rank]
            loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        result[fused] = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return result


@pytest.mark.slow
def test_fused_adamw_steps_fsdp_shards_like_the_default_adamw():
    result = run_distributed(fused_and_foreach_adamw_on_fsdp_shards, 2, timeout=120)[0]
    assert result[True].keys() == result[False].keys()
    for name, weight in result[False].items():  # AdamW magnifies rounding differences to ~1e-5
        torch.testing.assert_close(result[True][name], weight, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_fsdp_with_bf16_uses_the_policy_and_tracks_the_fp32_run(tmp_path, data_cache):
    env = script_env(cache_dir=data_cache)
    for precision in ("fp32", "bf16"):
        run_script("solutions/train/fsdp_training.py", *COMMON, "--max-steps", 6,
                   "--batch-size", 4, "--precision", precision, "--out-dir", tmp_path / precision,
                   nproc=2, env=env, timeout=180)
    fp32, bf16 = read_summary(tmp_path / "fp32"), read_summary(tmp_path / "bf16")
    assert bf16["precision"] == "bf16" and bf16["args"]["precision"] == "bf16"
    torch.testing.assert_close(bf16["loss_history"], fp32["loss_history"], atol=0.05, rtol=0)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_compile_trains_like_eager_and_compiles_training_and_evaluation_once_each(tmp_path,
                                                                                 data_cache):
    """torch.compile on CPU works but compiles slowly: the tiny model, two short epochs (26
    steps of 128 sequences each, an evaluation after each, its last batch a short one),
    against 3 eager steps."""
    compiles = tmp_path / "compiles.json"
    env = script_env(cache_dir=data_cache, COMPILES_FILE=compiles)
    for name, extra in (("eager", ("--max-steps", 3)), ("compiled", ("--compile",))):
        run_script("tests/record_compiles.py", "solutions/train/to_distributed_training.py",
                   *COMMON, "--epochs", 2, "--batch-size", 128, *extra,
                   "--out-dir", tmp_path / name, env=env, timeout=800)
    eager, compiled = read_summary(tmp_path / "eager"), read_summary(tmp_path / "compiled")
    assert compiled["args"]["compile"] is True and compiled["steps"] == 52
    torch.testing.assert_close(compiled["loss_history"][:3], eager["loss_history"], atol=1e-4,
                               rtol=0)
    # one graph for training, compiled at the first step; one for evaluation (no gradients),
    # compiled at the first evaluation; nothing again in the second epoch, its evaluation, the
    # short last batches (padded to one shape) or the test split
    counts = json.loads(compiles.read_text())
    assert len(counts["after_step"]) == 52
    assert set(counts["after_step"][:26]) == {1} and set(counts["after_step"][26:]) == {2}
    assert counts["at_exit"] == 2
    # the checkpoint keys are the plain model's: compiling blocks in place adds no prefix
    keys = torch.load(tmp_path / "compiled" / "final_model.pt", weights_only=True).keys()
    assert keys == torch.load(tmp_path / "eager" / "final_model.pt", weights_only=True).keys()


def test_the_final_line_names_a_run_without_timed_steps_and_a_cpus_resident_memory():
    from utils.metrics import peak_memory_text, speed_text
    assert speed_text({"tokens_per_s": 1234.4, "mfu": 0.123}) == "1234 tokens/s, MFU 12.3%"
    assert speed_text({"tokens_per_s": math.nan, "mfu": math.nan}) == \
        "no training step timed in this run"
    summary = {"peak_mem_bytes": 395 * 2**20}
    assert peak_memory_text(summary, torch.device("cpu")) == \
        "peak memory 395 MiB (resident size of the process)"
    assert peak_memory_text(summary, torch.device("cuda")) == "peak memory 395 MiB"


def test_compiled_runs_leave_their_warm_up_steps_out_of_tokens_per_s_and_say_so(monkeypatch):
    from utils import metrics
    clock = iter([0.0, 10.0, 20.0, 21.0, 22.0])  # the ends of 3 slow steps (compiling), 2 fast
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    throughput = metrics.Throughput(torch.device("cpu"), warmup_steps=3)
    for _ in range(5):
        throughput.step(100)
    assert throughput.steps == 2 and throughput.seconds == 2.0  # steps 4 and 5
    text = metrics.speed_text({"tokens_per_s": 100.0, "mfu": 0.5, "args": {"compile": True}})
    assert text.startswith("100 tokens/s, MFU 50.0%") and "compiling left out" in text


def test_the_clock_restarts_only_once_the_device_has_finished_the_untimed_step(monkeypatch):
    """A GPU runs behind Python: read the clock before it finished the untimed step, and that
    step's work lands in the first timed interval (the H200 run, epochs of 6 steps at batch
    128: 17 % fewer tokens/s than trained)."""
    from utils import metrics
    events, clock = [], iter(range(100))
    monkeypatch.setattr(metrics, "synchronize", lambda device: events.append("sync"))
    monkeypatch.setattr(metrics.time, "perf_counter",
                        lambda: events.append("clock") or float(next(clock)))
    throughput = metrics.Throughput(torch.device("cpu"), warmup_steps=2)
    throughput.step(10)  # untimed: starts the clock
    throughput.step(10)  # untimed (warm-up): restarts it
    assert events == ["sync", "clock", "sync", "clock"]
    throughput.step(10)  # timed: no wait for the device, one clock read
    assert events[4:] == ["clock"] and throughput.steps == 1
    throughput.pause()
    events.clear()
    throughput.step(10)  # after a pause (an evaluation): untimed again
    assert events == ["sync", "clock"] and throughput.steps == 1
