"""Throughput, model FLOPs utilisation (MFU), memory, and the logs every training script writes."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import resource
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

from utils.distributed_utils import all_reduce_sum, collective_device, is_root_process
from utils.data import VOCAB_FILE, write_vocab
from utils.files import atomic_write_json
# the pipeline's bubble and its timer live with the drawing of the schedule; importable from here
from utils.pipeline_timeline import StageBusyTimer, pipeline_bubble_fraction  # noqa: F401
from utils.precision import matmul_dtype, resolve_precision


def flops_per_token(n_params_non_embedding: int, n_layers: int, d_model: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 N + 12 L d T (PaLM, appendix B).

    6 N: forward (2) and backward (4) multiply-adds of every weight matrix, N counting all
    parameters except the embedding tables (lookups cost no FLOPs) but including the output
    projection. 12 L d T: the attention scores and their weighted sum, forward and backward.
    """
    return 6 * n_params_non_embedding + 12 * n_layers * d_model * seq_len


# Dense peak FLOP/s per GPU from the vendors' data sheets (which print tensor-core figures
# with sparsity: half of those), by the dtype the matmuls run in. fp32 means true fp32:
# PyTorch leaves TF32 off for matmuls unless you enable it. The first name contained in the
# device's name wins, so the PCIe and NVL cards come before the SXM ones they share a name with
# (and GH200 before H200). docs/site-*.md list the sources.
GPU_PEAK_FLOPS = {
    "H100 PCIe": {"float32": 51.2e12, "tf32": 378e12, "bfloat16": 756.5e12},
    "H100 NVL": {"float32": 60e12, "tf32": 417.5e12, "bfloat16": 835.5e12},
    "H200 NVL": {"float32": 60e12, "tf32": 417.5e12, "bfloat16": 835.5e12},
    # Grace Hopper (JUPITER, Alps): the Hopper GPU of the superchip has the H100 SXM's peaks
    "GH200": {"float32": 67e12, "tf32": 494.7e12, "bfloat16": 989.4e12},
    "H100": {"float32": 67e12, "tf32": 494.7e12, "bfloat16": 989.4e12},  # SXM
    "H200": {"float32": 67e12, "tf32": 494.7e12, "bfloat16": 989.4e12},  # SXM
    # AMD Instinct (PyTorch's ROCm build: the same torch.cuda API). fp32 matmuls run on the
    # matrix cores (their FP32 matrix figure). An MI250X is two dies (GCDs), each its own
    # torch device: the figures are per GCD, half the card's (95.7 / 383 TFLOP/s). CDNA2 has no
    # TF32: tf32 runs as fp32 there.
    "MI250X": {"float32": 47.9e12, "tf32": 47.9e12, "bfloat16": 191.5e12},  # per GCD
    "MI300X": {"float32": 163.4e12, "tf32": 653.7e12, "bfloat16": 1307.4e12},
    "MI300A": {"float32": 122.6e12, "tf32": 490.3e12, "bfloat16": 980.6e12},
    "A100": {"float32": 19.5e12, "tf32": 156e12, "bfloat16": 312e12},  # SXM and PCIe
    # Volta has neither TF32 nor bf16 units: both run no faster than fp32 there
    "V100": {"float32": 15.7e12, "tf32": 15.7e12, "bfloat16": 15.7e12},
}


def measure_matmul_flops(device: torch.device, dtype=torch.float32, n: int | None = None,
                         seconds: float = 0.3) -> float:
    """FLOP/s of the fastest of repeated square matmuls on `device`: the peak MFU divides by
    where no data sheet applies. The fastest, not the mean: other work on a shared machine only
    ever slows a matmul down. n x n, with n = 4096 on a GPU (a smaller one leaves a big GPU half
    idle, and the MFU would come out too high). On a CPU the fastest size depends on the CPU and
    the dtype (an AVX2 CPU without bf16 units: bf16 at 2.9 GFLOP/s for n = 128, 0.9 for 1024,
    where one matmul takes 2.4 s and the model's own small matmuls made MFU 250 %): the best of
    n = 128, 256, ..., doubling while one matmul takes under a tenth of `seconds`."""
    if n is not None or device.type == "cuda":
        return _fastest_matmul(device, dtype, n or 4096, seconds)[0]
    best, n = 0.0, 128
    while True:
        flops, one = _fastest_matmul(device, dtype, n, seconds / 4)
        best = max(best, flops)
        if one > seconds / 10 or n >= 4096:
            return best
        n *= 2


def _fastest_matmul(device: torch.device, dtype, n: int, seconds: float) -> tuple[float, float]:
    """(FLOP/s, seconds) of the fastest n x n matmul repeated for `seconds` (at least once)."""
    # its own generator: measuring must not move the training's random numbers (dropout)
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    a @ b  # warm-up
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < seconds:
        synchronize(device)
        t = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best, best


def peak_flops(device: torch.device, precision: str = "fp32") -> tuple[float, str]:
    """(peak FLOP/s of one device for the matmul dtype `precision` runs in, where it comes from).

    $PEAK_FLOPS overrides; a known GPU uses its data sheet; anything else is measured, with a
    matmul in that dtype (tf32 on a CPU is float32: see utils/precision.py), once per machine:
    a peak measured again in every run would move every run's MFU with the machine's load, and
    two runs' MFU would not compare (measured_peak_flops keeps it).
    """
    if os.environ.get("PEAK_FLOPS"):
        return float(os.environ["PEAK_FLOPS"]), "PEAK_FLOPS"
    kind = matmul_dtype(precision, device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for gpu, peaks in GPU_PEAK_FLOPS.items():
            if gpu in name:
                return peaks[kind], f"{gpu} data sheet ({kind})"
    return measured_peak_flops(device, kind)


def peak_cache_file() -> Path:
    """Where measured peaks are kept: $COURSE_PEAK_CACHE, or ~/.cache/course/peak_flops.json."""
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "course"
    return Path(os.environ.get("COURSE_PEAK_CACHE") or default / "peak_flops.json")


def device_model(device: torch.device) -> str:
    """The device's model name: the GPU's, or the CPU's from /proc/cpuinfo."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=None)
def measured_peak_flops(device: torch.device, kind: str) -> tuple[float, str]:
    """A matmul's FLOP/s on this device in `kind`, measured on the first call on this machine
    (model, threads, torch) and read from peak_cache_file() afterwards: every run's MFU then
    divides by the same number. Delete the file (or set PEAK_FLOPS) to measure again."""
    model, threads, key = _peak_key(device, kind)
    path = peak_cache_file()
    with _exclusive(path):  # the ranks of a node measure one after the other, not all at once
        known = _read_peaks(path)
        entry = known.get(key)
        if not (isinstance(entry, dict) and entry.get("flops", 0) > 0):
            entry = _measure_and_keep(device, kind, path, known, key)
    return entry["flops"], (f"measured {kind} matmul on {device.type} ({model}, {threads} "
                            f"threads, {entry['measured']}; kept in {path})")


def measure_peak_again(device: torch.device, kind: str, kept: float) -> None:
    """MFU above 100 %: the kept peak was measured while the machine was busy (other jobs, or the
    ranks of a run measuring at once). Measure again, keep the larger for the next runs, and say
    so (this run's figures stay as they are, consistent with its log)."""
    _, _, key = _peak_key(device, kind)
    path = peak_cache_file()
    with _exclusive(path):
        known = _read_peaks(path)
        old = known.get(key, {}).get("flops", kept) if isinstance(known.get(key), dict) else kept
        entry = _measure_and_keep(device, kind, path, known, key, at_least=old)
    print(f"note: MFU above 100 %: the {kind} peak kept in {path} ({kept / 1e9:.1f} GFLOP/s) was "
          f"measured while this machine was busy; measured again: {entry['flops'] / 1e9:.1f} "
          "GFLOP/s, kept for the next runs", flush=True)


def _peak_key(device: torch.device, kind: str) -> tuple[str, int, str]:
    model, threads = device_model(device), torch.get_num_threads()
    return model, threads, (f"{model} | {device.type} | {threads} threads | {kind} | "
                            f"torch {torch.__version__}")


def _read_peaks(path: Path) -> dict:
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def _measure_and_keep(device, kind: str, path: Path, known: dict, key: str,
                      at_least: float = 0.0) -> dict:
    dtype = torch.bfloat16 if kind == "bfloat16" else torch.float32
    entry = {"flops": max(measure_matmul_flops(device, dtype, seconds=1.0), at_least),
             "measured": time.strftime("%Y-%m-%d")}
    try:  # a private copy, then a rename: a reader never sees half a file
        known[key] = entry
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: measured again next time, nothing else changes
    return entry


@contextlib.contextmanager
def _exclusive(path: Path):
    """Hold a lock file next to `path` (or nothing, where none can be made)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_name(path.name + ".lock"), "w")  # noqa: SIM115
    except OSError:
        yield
        return
    import fcntl
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def synchronize(device: torch.device) -> None:
    """Wait for the GPU: without it, timers measure only how fast work was queued."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak GPU memory allocated by tensors, or on the CPU the process's peak resident size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def speed_text(summary: dict) -> str:
    """"N tokens/s, MFU x%" of a run's timed steps, or why there are none (a run resumed at
    --max-steps only evaluates and exports: no step was timed, so no speed)."""
    if not math.isfinite(summary.get("tokens_per_s", math.nan)):
        return "no training step timed in this run"
    text = f"{summary['tokens_per_s']:.0f} tokens/s, MFU {summary['mfu']:.1%}"
    if summary.get("args", {}).get("compile"):
        text += " (compiling left out: the first steps and those after an evaluation are not timed)"
    return text


def peak_memory_text(summary: dict, device: torch.device) -> str:
    """The peak memory for the final line: on a CPU it is the whole process's resident size
    (Python, torch and the data included), not only the tensors."""
    text = f"peak memory {summary['peak_mem_bytes'] / 2**20:.0f} MiB"
    return text if device.type == "cuda" else text + " (resident size of the process)"


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes of this rank's parameters, gradients and optimizer state.

    Under DDP every rank holds all of them; under FSDP only its shard (a DTensor's local part),
    which is what sharding saves, whatever else (activations, buffers) the device holds.
    """
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters()
                                                 if p.grad is not None]
    if optimizer is not None:
        tensors += [v for state in optimizer.state.values() for v in state.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0]  # leave out step counters
    return sum(local(t).numel() * t.element_size() for t in tensors)


class Throughput:
    """Training tokens per second: the time from each step to the next, with pauses left out.

    Call step(tokens) after every optimizer step and pause() before an evaluation: the first
    step after the start or a pause only starts the clock again, so warm-up, evaluation and
    data-loader restarts do not count as training time. `warmup_steps`: how many steps at the
    start only restart the clock (torch.compile compiles in the first; CUDA graphs record in
    the next ones).
    """

    def __init__(self, device: torch.device, warmup_steps: int = 1):
        self.device = device
        self.tokens, self.seconds, self.steps, self.last = 0, 0.0, 0, None
        self.warmup = warmup_steps - 1  # untimed steps left after the first

    def step(self, tokens: int) -> None:
        if self.last is None or self.warmup > 0:  # an untimed step: the clock (re)starts
            if self.last is not None:
                self.warmup -= 1
            # once the GPU has finished it: a GPU runs behind Python, and the untimed step's
            # work would otherwise land in the first timed interval (with epochs of 6 steps,
            # the H200 run reported 17 % fewer tokens/s than it trained)
            synchronize(self.device)
            self.last = time.perf_counter()
            return
        now = time.perf_counter()
        self.tokens += tokens
        self.seconds += now - self.last
        self.steps += 1
        self.last = now

    def lap(self) -> None:
        """Bring `seconds` up to now without pausing: the queued steps finish first (a GPU
        runs behind Python), so an interval's time is the device's, not the queue's."""
        synchronize(self.device)
        if self.last is not None:
            now = time.perf_counter()
            self.seconds += now - self.last
            self.last = now

    def pause(self) -> None:
        synchronize(self.device)  # finish the queued steps: their time belongs to training
        if self.last is not None:
            self.seconds += time.perf_counter() - self.last
        self.last = None

    def tokens_per_s(self) -> float:
        self.pause()
        return self.tokens / self.seconds if self.tokens else float("nan")


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))  # exp overflows past ~700; 50 is already "untrained"


class GradNorm:
    """The L2 norm of the whole model's gradient, the same number for every layout: DDP
    replicas, FSDP or tensor-parallel shards (DTensors) and pipeline stages (each rank holds
    other layers). Call it on every rank (one all-reduce) after backward; it returns a tensor on
    the device, so nothing waits for the GPU until the value is read.

    Every rank adds up the squares of the gradient pieces it holds, each weighted by
    shards / holders: a parameter held by 4 ranks in 2 different shards (TP 2 x DP 2) counts
    each rank's piece half, a replicated one (DDP) 1 / world size, a pipeline stage's own layers
    fully. Which ranks hold which parameter is asked once, by name.
    """

    def __init__(self, model: torch.nn.Module):
        self.params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.weights = None
        self.replicated = False  # every rank holds every parameter whole: no all-reduce needed

    def _weights(self, device) -> torch.Tensor:
        names = [name for name, _ in self.params]
        holders = Counter(names)
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, names)
            holders = Counter(n for rank_names in everyone for n in rank_names)
        weights = []
        for name, p in self.params:
            shards = 1
            if hasattr(p, "device_mesh"):  # a DTensor: its mesh dimensions that split it
                shards = math.prod(p.device_mesh.size(i) for i, placement in
                                   enumerate(p.placements) if placement.is_shard())
            weights.append(shards / holders[name])
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.replicated = all(holders[name] == world_size and not hasattr(p, "device_mesh")
                              for name, p in self.params)
        if self.replicated:  # DDP: each rank's own norm is the model's, with no collective
            return torch.ones(len(weights), dtype=torch.float64, device=device)
        return torch.tensor(weights, dtype=torch.float64, device=device)

    def __call__(self) -> torch.Tensor:
        grads = [(i, p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad)
                 for i, (_, p) in enumerate(self.params) if p.grad is not None]
        device = collective_device()
        if self.weights is None:
            self.weights = self._weights(device)
        if not grads:
            squares = torch.zeros((), dtype=torch.float64, device=device)
        else:
            norms = torch._foreach_norm([g for _, g in grads])  # one kernel for all
            squares = (torch.stack(norms).to(device, torch.float64) ** 2
                       * self.weights[[i for i, _ in grads]]).sum()
        return (squares if self.replicated else all_reduce_sum(squares)).sqrt()


class MetricLogger:
    """Scalars to TensorBoard or wandb (offline), on the root process only.

    Each backend is imported only when chosen, so neither is needed for `--logger none`.
    The run's flags go to TensorBoard's HParams view (and wandb's config) at the start, its
    final results (`finish`) to the same view's metric columns (and wandb's summary).
    """

    def __init__(self, kind: str, out_dir: str | os.PathLike, config: dict, name: str):
        self.kind = kind if is_root_process() else "none"
        self.writer = self.run = None
        out_dir = Path(out_dir)
        if self.kind == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(log_dir=str(out_dir / "tensorboard"))
        elif self.kind == "wandb":
            import wandb
            # Compute nodes have no internet: log offline, then `wandb sync` from a login node.
            os.environ.setdefault("WANDB_MODE", "offline")
            os.environ.setdefault("WANDB_DIR", str(out_dir))
            os.environ.setdefault("WANDB_CACHE_DIR", str(out_dir / "wandb-cache"))
            out_dir.mkdir(parents=True, exist_ok=True)
            self.run = wandb.init(project="distributed-training-course", name=name,
                                  config=config, dir=str(out_dir))
        elif self.kind != "none":
            raise ValueError(f"unknown logger {kind!r}: use none, tensorboard or wandb")
        if self.writer is not None:
            write_hparams(self.writer, config)

    def log(self, metrics: dict, step: int) -> None:
        if self.writer is not None:
            for k, v in metrics.items():
                self.writer.add_scalar(k, v, step)
        if self.run is not None:
            self.run.log(metrics, step=step)

    def finish(self, results: dict, step: int) -> None:
        """The run's final results: FINAL_METRICS columns of the HParams view, wandb's summary."""
        results = {k: v for k, v in results.items() if k in FINAL_METRICS}
        if self.writer is not None:
            for k, v in results.items():
                self.writer.add_scalar(k, v, step)
        if self.run is not None:
            self.run.summary.update(results)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.run is not None:
            self.run.finish()


# The HParams view's metric columns: the last value of these scalars in each run.
FINAL_METRICS = ("final/val_loss", "final/test_loss", "final/test_ppl", "final/tokens_per_s",
                 "final/mfu", "final/peak_mem_gib", "final/wall_time_s")


def final_results(summary: dict) -> dict:
    """FINAL_METRICS from a training_summary."""
    return {"final/val_loss": summary["val_loss"], "final/test_loss": summary["test_loss"],
            "final/test_ppl": summary["test_ppl"], "final/tokens_per_s": summary["tokens_per_s"],
            "final/mfu": summary["mfu"], "final/peak_mem_gib": summary["peak_mem_bytes"] / 2**30,
            "final/wall_time_s": summary["wall_time_s"]}


def hparam_value(value):
    """What the HParams view can show: numbers, strings and booleans (None and lists as text)."""
    return value if isinstance(value, (bool, int, float, str)) else str(value)


def write_hparams(writer, config: dict) -> None:
    """The flags of this run into its own event file (SummaryWriter.add_hparams would start a
    second run in a subfolder, apart from the curves), listing FINAL_METRICS as the columns."""
    from torch.utils.tensorboard.summary import hparams
    experiment, start, end = hparams({k: hparam_value(v) for k, v in config.items()},
                                     {k: math.nan for k in FINAL_METRICS})
    for summary in (experiment, start, end):
        writer.file_writer.add_summary(summary)


def training_summary(args, cfg, corpus, *, world_size: int, steps: int, loss_history: list,
                     val_loss: float, test_loss: float, throughput: Throughput,
                     flops_per_token: float, device: torch.device, start_time: float,
                     data_parallel_size: int | None = None, **extra) -> dict:
    """What every training script reports at the end (written as summary.json).

    loss_history holds the global mean training loss of every optimizer step; the global batch
    is --batch-size times the data-parallel size (the world size unless TP/PP). tokens_per_s
    counts all ranks; MFU divides by the peak of all devices (see flops_per_token) in the dtype
    of args.precision; memory is this rank's peak. `device` is the one this rank trained on: the
    peak and the memory are its.
    """
    tokens_per_s = throughput.tokens_per_s()
    # The peak of the dtype the matmuls ran in: bf16 against the bf16 peak, fp32 against fp32.
    precision = resolve_precision(getattr(args, "precision", "fp32"), device)
    peak, peak_source = peak_flops(device, precision)
    mfu = tokens_per_s * flops_per_token / (peak * world_size)
    if mfu > 1 and peak_source.startswith("measured") and is_root_process():
        measure_peak_again(device, matmul_dtype(precision, device), peak)
    return dict(
        world_size=world_size, steps=steps,
        global_batch_size=args.batch_size * (data_parallel_size or world_size),
        seq_len=cfg.max_seq_len,
        # float() per entry, not torch.stack: a resumed run's restored losses and the new ones
        # need not share a device (or be tensors at all); detached, as a loss may still carry
        # its graph (a pipeline schedule's microbatch losses do)
        loss_history=[float(loss.detach() if torch.is_tensor(loss) else loss)
                      for loss in loss_history],
        val_loss=val_loss, val_ppl=perplexity(val_loss),
        test_loss=test_loss, test_ppl=perplexity(test_loss),
        tokens_per_s=tokens_per_s, flops_per_token=flops_per_token,
        mfu=mfu, device=str(device), device_type=device.type,
        script=Path(sys.argv[0]).name,  # which lesson wrote it (tools/scaling_report.py compares)
        peak_flops_per_device=peak, peak_flops_source=peak_source,
        peak_mem_bytes=peak_memory_bytes(device), wall_time_s=time.time() - start_time,
        precision=precision, data=corpus.source, preset=args.preset, model_config=cfg.to_dict(),
        # the data's words (the model's vocabulary may be padded beyond them: a performance fix)
        data_vocab_size=getattr(corpus, "vocab_size", cfg.vocab_size),
        args=vars(args),
        **extra)


def write_summary(out_dir: str | os.PathLike, summary: dict,
                  vocab: list[str] | None = None) -> Path:
    """OUT_DIR/summary.json from the root process: what tests and benchmarks read back.
    Written atomically; NaN and infinities (a run that trained no step has no tokens/s) are
    written as null, so the file stays valid JSON. With `vocab` (the corpus's words), also
    OUT_DIR/vocab.txt: with it tools/generate.py writes the model's text without the data."""
    path = Path(out_dir) / "summary.json"
    if is_root_process():
        if vocab is not None:
            write_vocab(vocab, Path(out_dir) / VOCAB_FILE)
        atomic_write_json(path, summary)
    return path
