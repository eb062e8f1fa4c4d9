"""Watching a running job (utils/monitor.py, docs/monitoring.md): every script logs the same
metrics under the same names to TensorBoard, wandb and its log line; the gradient norm is the
whole model's, whatever the layout; the ETA holds; system metrics come from NVML or psutil.

Real runs on CPU with gloo: every script for 3 steps with --log-every 1, two ranks where the
script is parallel, and the single-process runs their gradient norms must equal.
"""

from __future__ import annotations

import gc
import json
import math
import re
import socket
import struct
import subprocess
import sys
import time
import urllib.request
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import read_summary, run_script, script_env
from distributed import run_distributed
from utils.metrics import FINAL_METRICS, Throughput
from utils.monitor import TrainingMonitor, format_duration, planned_steps
from utils.system_metrics import FIELDS, SystemSampler

pytestmark = pytest.mark.warm_start  # runs forked warm: tests/warm_launch.py
TINY = ("--dataset", "synthetic", "--preset", "tiny", "--dropout", 0, "--seed", 3,
        "--max-steps", 3, "--log-every", 1, "--batch-size", 8)
EVERY_STEP = {"train/loss", "train/tokens_per_s", "train/mfu", "train/step_s", "train/data_wait",
              "train/lr", "train/grad_norm", "memory/allocated_gib", "memory/peak_gib",
              "ranks/slowest_s", "ranks/fastest_s", "ranks/slowest_rank", "progress/eta_min"}
EVERY_EPOCH = {"val/loss", "val/ppl", "train/epoch_tokens_per_s"}
# name -> (script, processes, more arguments)
RUNS = {
    "ddp exercise": ("train/to_distributed_training.py", 1, ()),
    "ddp": ("solutions/train/to_distributed_training.py", 2, ()),
    "fsdp": ("solutions/train/fsdp_training.py", 2, ()),
    "tp": ("solutions/train/tp_training.py", 2, ()),
    "pp": ("solutions/train/pp_training.py", 2, ("--microbatches", 2)),
    "nd": ("solutions/train/nd_training.py", 2, ("--pp", 2, "--microbatches", 2)),
    "perf": ("solutions/train/perf_training.py", 1, ()),
    "lightning": ("solutions/train/Lit_training.py", 1, ("--accelerator", "cpu", "--devices", 2)),
    # the single-process runs with the same global batch: 16 for DDP and FSDP (8 per rank),
    # 8 for TP (both ranks share a batch) and PP (one pipeline)
    "one process, batch 16": ("solutions/train/to_distributed_training.py", 1,
                              ("--batch-size", 16)),
    "one process, batch 8": ("solutions/train/to_distributed_training.py", 1, ()),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache) -> dict:
    """name -> (output folder, stdout) of every run above, two at a time."""
    tmp = tmp_path_factory.mktemp("monitoring")
    env = script_env(cache_dir=data_cache)
    run_script("solutions/train/to_distributed_training.py", "--dataset", "synthetic",
               "--preset", "tiny", "--max-steps", 0, "--logger", "none",
               "--out-dir", tmp / "cache", env=env)  # the corpus is cached once, not by two runs

    def run(name):
        script, nproc, more = RUNS[name]
        out = tmp / re.sub(r"\W+", "-", name)
        proc = run_script(script, *TINY, *more, "--logger", "tensorboard", "--out-dir", out,
                          nproc=nproc if "Lit" not in script else 1, env=env, timeout=240)
        return name, (out, proc.stdout)

    with ThreadPoolExecutor(2) as pool:
        return dict(pool.map(run, RUNS))


def scalars(out: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of a run's TensorBoard folder, read back as TensorBoard reads it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


# ------------------------------------------------------------------------- what every script logs
@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in RUNS if not n.startswith("one process")])
def test_every_script_logs_every_metric_to_tensorboard(runs, name):
    out, stdout = runs[name]
    logged = scalars(out)
    expected = EVERY_STEP | EVERY_EPOCH | set(FINAL_METRICS)
    if name in ("pp", "nd"):
        expected.add("pipeline/bubble")
    assert expected <= logged.keys(), f"missing: {sorted(expected - logged.keys())}"
    # one CPU and memory curve per rank (on a GPU also one per GPU: see test_gpu.py)
    ranks = 1 if name in ("ddp exercise", "perf") else 2
    host = socket.gethostname()
    for rank in range(ranks):
        assert f"system/{host}/rank{rank}/cpu_percent" in logged
        assert logged[f"system/{host}/rank{rank}/rss_gib"][-1][1] > 0
    # every step's values, from the second on (the first only starts the clock)
    steps = [step for step, _ in logged["train/tokens_per_s"]]
    assert steps[-2:] == ([1, 2] if name == "lightning" else [2, 3])  # Lightning: one earlier
    assert all(v > 0 for _, v in logged["train/tokens_per_s"] + logged["train/grad_norm"])
    assert 0 < logged["train/mfu"][-1][1] < 1 and 0 <= logged["train/data_wait"][-1][1] <= 1
    assert logged["train/lr"][-1][1] == pytest.approx(1e-3)
    assert logged["ranks/slowest_s"][-1][1] >= logged["ranks/fastest_s"][-1][1] > 0
    summary = read_summary(out)
    assert logged["final/test_loss"][-1][1] == pytest.approx(summary["test_loss"], rel=1e-6)
    # a run of several ranks says once whose numbers the log lines show
    assert stdout.count("  (these lines: loss, the mean of the") == (ranks > 1), stdout[-2000:]
    # the log line: progress, loss, tokens/s, MFU, memory and time left
    line = [l for l in stdout.splitlines() if l.startswith("epoch 0 step 3/3 (100%) loss ")]
    assert len(line) == 1, stdout[-2000:]
    assert re.search(r"loss [\d.]+ \d+ tokens/s MFU [\d.]+% mem [\d.]+ GiB \(peak [\d.]+\) "
                     r"ETA 0s; evaluating the validation and test splits next$", line[0]), line[0]


@pytest.mark.slow
@pytest.mark.parametrize("name, reference", [("ddp", "one process, batch 16"),
                                             ("fsdp", "one process, batch 16"),
                                             ("tp", "one process, batch 8"),
                                             ("pp", "one process, batch 8")])
def test_the_gradient_norm_is_the_whole_models_as_in_one_process(runs, name, reference):
    """DDP replicas, FSDP shards, TP shards (DTensors) and PP stages (other layers on each
    rank): the logged norm equals the single-process norm of the same global batch."""
    parallel = scalars(runs[name][0])["train/grad_norm"]
    single = scalars(runs[reference][0])["train/grad_norm"]
    assert [s for s, _ in parallel] == [s for s, _ in single] == [1, 2, 3]
    assert [v for _, v in parallel] == pytest.approx([v for _, v in single], rel=1e-5)


def wandb_records(run_dir: Path):
    """The protobuf records of an offline wandb run (its .wandb file is a LevelDB log: 32 KiB
    blocks of chunks, each with a 7-byte header; wandb 0.31 has no Python reader for it)."""
    from wandb.proto import wandb_internal_pb2
    data = next(run_dir.glob("*.wandb")).read_bytes()
    assert data[:4] == b":W&B"
    pos, block, record = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little room for a header: the block is padded
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        record += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            parsed = wandb_internal_pb2.Record()
            parsed.ParseFromString(record)
            yield parsed
            record = b""


@pytest.mark.slow
def test_the_wandb_offline_run_has_the_same_metrics_config_and_final_results(runs, tmp_path,
                                                                             data_cache):
    out = tmp_path / "wandb"
    run_script(RUNS["ddp exercise"][0], *TINY, "--logger", "wandb", "--out-dir", out,
               env=script_env(cache_dir=data_cache, WANDB_SILENT="true"))
    def keys(items):  # wandb keeps "train/loss" as the nested key ("train", "loss")
        return {item.key or "/".join(item.nested_key) for item in items}

    history, summary, config = set(), set(), set()
    for record in wandb_records(next((out / "wandb").glob("offline-run-*"))):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history |= keys(record.history.item)
        elif kind == "summary":
            summary |= keys(record.summary.update)
        elif kind in ("config", "run"):
            config |= keys(record.config.update if kind == "config" else record.run.config.update)
    tensorboard = set(scalars(runs["ddp exercise"][0]))
    assert tensorboard - set(FINAL_METRICS) == {k for k in history if not k.startswith("_")}
    assert set(FINAL_METRICS) <= summary
    assert {"lr", "batch_size", "preset", "log_every"} <= config


# ------------------------------------------------------------------------- TensorBoard itself
def start_tensorboard(logdir: Path) -> tuple[subprocess.Popen, str]:
    """A real `tensorboard --logdir` on a port the OS picks (--port 0), and its address."""
    proc = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir),
                             "--host", "127.0.0.1", "--port", "0", "--reload_interval", "1"],
                            stderr=subprocess.PIPE, text=True, env=script_env())
    for line in proc.stderr:
        found = re.search(r"at (http://127\.0\.0\.1:\d+/)", line)
        if found:
            return proc, found.group(1)
    raise AssertionError(f"tensorboard did not start (exit {proc.wait()})")


def fetch(url: str, body: dict | None = None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={
        "Content-Type": "application/json", "X-XSRF-Protected": "1"})  # TensorBoard wants it
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_real_tensorboard_server_answers_the_runs_scalars_and_hparams(runs):
    out, _ = runs["ddp"]
    proc, url = start_tensorboard(out.parent)
    run = out.name + "/tensorboard"
    try:
        deadline = time.monotonic() + 120
        while True:  # TensorBoard reads the folder in the background after it starts
            tags = fetch(url + "data/plugin/scalars/tags")
            if "train/tokens_per_s" in tags.get(run, {}) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert EVERY_STEP | EVERY_EPOCH <= set(tags[run])
        points = fetch(url + f"data/plugin/scalars/scalars?run={run}&tag=train/grad_norm")
        assert [p[1] for p in points] == [1, 2, 3]
        experiment = fetch(url + "data/plugin/hparams/experiment", {"experimentName": ""})
        hparams = {h["name"] for h in experiment["hparamInfos"]}
        metrics = {m["name"]["tag"] for m in experiment["metricInfos"]}
        assert {"lr", "batch_size", "preset", "log_every"} <= hparams
        assert set(FINAL_METRICS) <= metrics
        groups = fetch(url + "data/plugin/hparams/session_groups", {
            "experimentName": "", "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS",
                                                      "STATUS_FAILURE", "STATUS_RUNNING"],
            "colParams": [], "startIndex": 0, "sliceSize": 100})
        sessions = {g["name"]: g for g in groups["sessionGroups"]}
        assert run in sessions and sessions[run]["hparams"]["lr"] == pytest.approx(1e-3)
        values = {m["name"]["tag"]: m["value"] for m in sessions[run]["metricValues"]}
        assert values["final/test_loss"] == pytest.approx(read_summary(out)["test_loss"], rel=1e-6)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# ------------------------------------------------------------------------- the monitor in-process
class Recorder:
    """A logger that keeps what it is given (in place of TensorBoard or wandb)."""

    def __init__(self):
        self.logged = []

    def log(self, metrics, step):
        self.logged.append((step, metrics))

    def finish(self, results, step):
        self.logged.append((step, results))

    def close(self):
        pass


def monitored(model=None, total_steps=100, **kwargs):
    model = model or torch.nn.Linear(4, 4)
    args = SimpleNamespace(logger="none", precision="fp32", log_every=10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    throughput = Throughput(torch.device("cpu"))
    recorder = Recorder()
    monitor = TrainingMonitor(args, "unused", model, optimizer, throughput, 1e6, total_steps,
                              logger=recorder, **kwargs)
    return model, optimizer, throughput, monitor, recorder


def test_the_eta_leaves_the_first_steps_warm_up_out_and_matches_the_time_left(monkeypatch):
    """Five slow first steps (compiling: 2 s each), then steady steps of 30 ms and an evaluation
    of 50 ms after step 20, on the monitor's clock (a real one would count whatever else runs on
    the machine): the ETA reported at step 10 against the time that was left."""
    monkeypatch.setenv("PEAK_FLOPS", "1e12")
    now = [0.0]
    model, optimizer, throughput, monitor, recorder = monitored(total_steps=40,
                                                                clock=lambda: now[0])
    step = 0
    for _ in monitor.batches(range(40)):
        model(torch.randn(8, 4)).sum().backward()
        optimizer.step()
        now[0] += 2.0 if step < 5 else 0.03
        step += 1
        throughput.step(32)
        if step % 5 == 0:
            monitor.report(step, torch.tensor(1.0))
            if step == 10:
                eta, reported_at = recorder.logged[-1][1]["progress/eta_min"] * 60, now[0]
        if step == 20:
            throughput.pause()
            now[0] += 0.05  # an evaluation
    remaining = now[0] - reported_at
    assert remaining == pytest.approx(30 * 0.03 + 0.05)
    # 30 steady steps: the warm-up is not in it, nor the evaluation no step has seen yet
    assert eta == pytest.approx(30 * 0.03)
    assert abs(eta - remaining) <= 0.25 * remaining


def test_a_closed_monitor_lets_the_model_and_optimizer_go():
    """The DDP step's last TODO deletes the model and the optimizer before leaving the process
    group, so that DDP's buffers are freed while the group exists: the monitor must not keep
    them alive after close()."""
    model, optimizer, _, monitor, _ = monitored(model=torch.nn.Linear(4, 4))
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    gone_model, gone_optimizer = weakref.ref(model), weakref.ref(optimizer)
    monitor.close()
    del model, optimizer
    gc.collect()
    assert gone_model() is None and gone_optimizer() is None


def test_the_eta_counts_evaluations_once_they_have_happened(monkeypatch):
    monkeypatch.setenv("PEAK_FLOPS", "1e12")
    now = [0.0]
    _, _, throughput, monitor, recorder = monitored(total_steps=100, clock=lambda: now[0])
    throughput.step(1)  # the clock starts
    monitor.report(10, torch.tensor(1.0))  # the first report: the ETA's reference point
    now[0] += 10 * 1.0 + 5.0  # 10 steps of 1 s and an evaluation of 5 s
    monitor.report(20, torch.tensor(1.0))
    eta = recorder.logged[-1][1]["progress/eta_min"] * 60
    assert eta == pytest.approx(80 * 1.5)


def test_durations_read_as_hours_minutes_and_seconds():
    assert [format_duration(s) for s in (7, 273, 7500, math.inf)] == ["7s", "4m33s", "2h05m", "?"]


def test_planned_steps_are_every_epochs_batches_or_max_steps():
    loader = [0] * 30
    assert planned_steps(SimpleNamespace(epochs=3, max_steps=None), loader) == 90
    assert planned_steps(SimpleNamespace(epochs=3, max_steps=50), loader) == 50


def test_with_accumulation_planned_steps_count_optimizer_steps_as_max_steps_does():
    loader = [0] * 30  # 4 batches per step: 7 steps per epoch (the 2 left over start the next)
    assert planned_steps(SimpleNamespace(epochs=3, max_steps=None), loader, 4) == 22
    assert planned_steps(SimpleNamespace(epochs=3, max_steps=20), loader, 4) == 20


def test_evaluation_forward_passes_and_pauses_are_not_training_time(monkeypatch):
    monkeypatch.setenv("PEAK_FLOPS", "1e12")
    model, _, throughput, monitor, _ = monitored()
    model(torch.randn(2, 4))
    model.eval()
    model(torch.randn(2, 4))
    assert monitor.forward.take() > 0
    model(torch.randn(2, 4))
    assert monitor.forward.take() == 0
    list(monitor.batches([1, 2]))  # the throughput clock has not started: no training yet
    assert monitor.data_wait == 0


class SlowOnRankOne(torch.nn.Module):
    """A layer whose forward pass takes about 20 ms longer on rank 1: a straggler."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        if torch.distributed.get_rank() == 1:
            start = time.perf_counter()
            while time.perf_counter() - start < 0.02:
                pass
        return self.linear(x)


def straggler_run(rank, world_size):
    import os
    os.environ["PEAK_FLOPS"] = "1e12"
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model, optimizer, throughput, monitor, recorder = monitored(DDP(SlowOnRankOne()))
    for _ in range(1, 6):
        model(torch.randn(8, 4)).sum().backward()
        optimizer.step()
        throughput.step(32)
    monitor.report(5, torch.tensor(1.0))
    monitor.close()
    return recorder.logged[-1][1]


@pytest.mark.timeout(120)
def test_a_straggler_shows_as_the_slowest_rank_with_its_extra_time():
    metrics = run_distributed(straggler_run, 2)[0]
    assert metrics["ranks/slowest_rank"] == 1
    assert metrics["ranks/slowest_s"] - metrics["ranks/fastest_s"] >= 0.015
    # the straggler holds back the others: every rank's step takes the slow one's time
    assert metrics["train/step_s"] >= 0.02


# ------------------------------------------------------------------------- system metrics
class FakeNVML:
    """The calls of nvidia-ml-py the sampler makes, with a GPU at 87 %, 30 GiB, 412 W, 71 C."""
    NVML_TEMPERATURE_GPU = 0

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=87, memory=40)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(used=30 * 2**30, total=80 * 2**30)

    def nvmlDeviceGetPowerUsage(self, handle):
        return 412_000  # milliwatts

    def nvmlDeviceGetTemperature(self, handle, sensor):
        assert sensor == self.NVML_TEMPERATURE_GPU
        return 71

    def nvmlDeviceGetIndex(self, handle):
        return 3


def test_the_gpu_sampler_reads_utilisation_memory_power_and_temperature_from_nvml():
    sampler = SystemSampler(gpu_handle="gpu-handle", nvml=FakeNVML(), seconds=0.01)
    try:
        deadline = time.monotonic() + 30
        while not sampler._samples and time.monotonic() < deadline:  # the thread samples
            time.sleep(0.01)
        assert sampler._samples, "the background thread took no sample"
        values = dict(zip(FIELDS, sampler.take()))
    finally:
        sampler.close()
    assert (values["gpu_utilization"], values["gpu_memory_gib"], values["gpu_power_w"],
            values["gpu_temperature_c"]) == (87, 30, 412, 71)
    assert values["cpu_percent"] >= 0 and values["rss_gib"] > 0


def test_every_gpu_gets_its_own_curve_named_by_node_and_nvml_index(monkeypatch):
    monkeypatch.setenv("PEAK_FLOPS", "1e12")
    _, _, throughput, monitor, recorder = monitored()
    monitor.sampler.close()
    monitor.sampler = SystemSampler(gpu_handle="gpu-handle", nvml=FakeNVML(), seconds=60)
    monitor.me = ("jwb0042", 0, FakeNVML().nvmlDeviceGetIndex(None))
    throughput.step(1)
    monitor.report(1, torch.tensor(1.0))
    monitor.close()
    logged = recorder.logged[-1][1]
    assert logged["system/jwb0042/gpu3/utilization"] == 87
    assert logged["system/jwb0042/gpu3/power_w"] == 412
    assert logged["system/jwb0042/gpu3/memory_gib"] == 30
    assert logged["system/jwb0042/gpu3/temperature_c"] == 71
    assert logged["system/jwb0042/rank0/rss_gib"] > 0


class FakeAmdSmi:
    """The calls of ROCm's amdsmi package the sampler makes: a node of two MI250X GCDs, the
    second at 87 %, 30 GiB, 412 W (MI250X reports no current power, only the average), 71 C."""
    AmdSmiMemoryType = SimpleNamespace(VRAM="vram")
    AmdSmiTemperatureType = SimpleNamespace(HOTSPOT="hotspot")
    AmdSmiTemperatureMetric = SimpleNamespace(CURRENT="current")

    def amdsmi_get_processor_handles(self):
        return ["gcd0", "gcd1"]

    def amdsmi_get_gpu_device_bdf(self, h):
        return {"gcd0": "0000:c1:00.0", "gcd1": "0000:c6:00.0"}[h]

    def amdsmi_get_gpu_activity(self, h):
        return {"gfx_activity": 87 if h == "gcd1" else 0, "umc_activity": 40}

    def amdsmi_get_gpu_memory_usage(self, h, kind):
        assert kind == "vram"
        return 30 * 2**30

    def amdsmi_get_power_info(self, h):
        return {"current_socket_power": "N/A", "average_socket_power": 412}

    def amdsmi_get_temp_metric(self, h, sensor, metric):
        assert (sensor, metric) == ("hotspot", "current")
        return 71


def test_on_an_amd_gpu_the_sampler_reads_the_same_values_from_amd_smi(monkeypatch):
    from utils import system_metrics
    smi = system_metrics.AmdSmiAsNvml(FakeAmdSmi())
    monkeypatch.setattr(torch.version, "hip", "7.1.25424", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(
        pci_domain_id=0, pci_bus_id=0xc6, pci_device_id=0))
    handle = system_metrics.amdsmi_handle(torch.device("cuda", 0), smi)
    assert handle == ("gcd1", 1)  # by PCI address: torch's cuda:0 is the node's second GCD
    sampler = SystemSampler(gpu_handle=handle, nvml=smi, seconds=60)
    sampler.close()
    values = dict(zip(FIELDS, sampler.take()))
    assert (values["gpu_utilization"], values["gpu_memory_gib"], values["gpu_power_w"],
            values["gpu_temperature_c"]) == (87, 30, 412, 71)
    assert system_metrics.nvml_index(handle, smi) == 1


def test_without_amd_smi_an_amd_gpu_s_values_are_left_out(monkeypatch):
    from utils import system_metrics
    monkeypatch.setattr(torch.version, "hip", "7.1.25424", raising=False)
    monkeypatch.setitem(sys.modules, "amdsmi", None)  # import amdsmi fails
    sampler, index = system_metrics.start_sampler(torch.device("cuda", 0), seconds=60)
    sampler.close()
    assert index == -1 and math.isnan(dict(zip(FIELDS, sampler.take()))["gpu_utilization"])


def test_a_value_the_gpu_does_not_report_is_left_out_and_the_others_kept():
    class NoPower(FakeNVML):
        def nvmlDeviceGetPowerUsage(self, handle):
            raise RuntimeError("NVMLError_NotSupported")
    sampler = SystemSampler(gpu_handle="gpu-handle", nvml=NoPower(), seconds=60)
    sampler.close()
    values = dict(zip(FIELDS, sampler.take()))
    assert math.isnan(values["gpu_power_w"]) and values["gpu_utilization"] == 87
