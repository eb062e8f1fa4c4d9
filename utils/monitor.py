"""Watching a running job: the metrics every training script logs while it trains.

Every script makes one TrainingMonitor and calls it in three places, the same lines everywhere:

    monitor = TrainingMonitor(args, out_dir, model, optimizer, throughput, flops_per_tok,
                              total_steps=planned_steps(args, train_loader))
    for x, y in monitor.batches(train_loader):      # times the wait for each batch
        ...                                         # the training step, unchanged
        if step % args.log_every == 0:
            print0(f"epoch {epoch} {monitor.report(step, step_loss)}")
    monitor.log_epoch(step, val_loss)               # after each validation
    monitor.close(summary)                          # the final results, into the HParams view

Every --log-every steps, report() writes to TensorBoard or wandb (names in docs/monitoring.md):
train/loss, train/tokens_per_s (all ranks) and train/mfu of the interval, train/step_s,
train/data_wait (the share of the interval spent waiting for the DataLoader), train/lr,
train/grad_norm (of the whole model, whatever the layout), memory/allocated_gib and
memory/peak_gib (the largest rank), ranks/slowest_s and ranks/fastest_s (see below),
pipeline/bubble (a pipeline's measured idle share), progress/eta_min and the system metrics of
every rank (utils/system_metrics.py). It returns the log line:

    step 200/1500 (13%) loss 2.6912 41230 tokens/s MFU 12.3% mem 1.21 GiB (peak 1.50) ETA 4m33s

Once, after the first optimizer step, it prints where a rank's memory goes (utils/memory.py):
parameters, gradients, optimizer state and the activations saved for backward, measured by
tensor sizes next to the formula's prediction, to TensorBoard (memory/*) and to `monitor.memory`,
which the scripts put into summary.json under "memory":

    memory per rank, MiB measured (formula): parameters 0.88 (0.88), gradients 0.88 (0.88), ...

On a GPU, reading a tensor's value waits for the GPU. So nothing here reads one between log
steps: the loss and the gradient norm stay on the device, the forward pass is timed with CUDA
events, and report() reads everything at once, after one synchronize and one collective.
"""

from __future__ import annotations

import math
import os
import socket
import time

import torch
import torch.distributed as dist

from utils.checks import stop_if_a_loss_was_not_finite
from utils.distributed_utils import collective_device, get_rank, get_world_size
from utils.memory import (CATEGORIES, ActivationCounter, breakdown, format_breakdown, infer_layout,
                          total)
from utils.metrics import GradNorm, MetricLogger, final_results, peak_flops, perplexity
from utils.precision import resolve_precision
from utils.system_metrics import FIELDS, start_sampler


def planned_steps(args, train_loader, batches_per_step: int = 1) -> int:
    """Optimizer steps the run will take: every epoch's batches (with gradient accumulation,
    `batches_per_step` of them make one step), or --max-steps if fewer: --max-steps counts
    optimizer steps."""
    steps = args.epochs * len(train_loader) // batches_per_step
    return steps if args.max_steps is None else min(steps, args.max_steps)


def memory_summary(ranks: list[dict]) -> dict:
    """summary.json's "memory": bytes of every rank (a list, rank order) per category, the
    formula's prediction next to it, and each rank's whole breakdown."""
    out = {k: [r["measured"][k] for r in ranks]
           for k in (*CATEGORIES, "weight_copies", "gathered")}
    out["total"] = [total(r["measured"]) for r in ranks]
    for k in ("peak", "reserved"):
        if all(k in r["measured"] for r in ranks):
            out[k] = [r["measured"][k] for r in ranks]
    out["formula"] = {k: [r["formula"][k] if r["formula"] else None for r in ranks]
                      for k in (*CATEGORIES, "gathered")}
    out["per_rank"] = ranks
    return out


def format_duration(seconds: float) -> str:
    """4m33s, 2h05m, 12s: short enough for a log line."""
    if not math.isfinite(seconds):
        return "?"
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class ForwardTimer:
    """Time spent in the model's forward passes while training (not in evaluation), on the
    device: CUDA events on a GPU (read at log steps only), the clock on a CPU."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds, self.events, self.start = 0.0, [], None
        model.register_forward_pre_hook(self._begin)
        model.register_forward_hook(self._end)

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _begin(self, module, args):
        self.start = self._now() if module.training else None

    def _end(self, module, args, output):
        if self.start is None:
            return
        end = self._now()
        if self.cuda:
            self.events.append((self.start, end))
        else:
            self.seconds += end - self.start
        self.start = None

    def take(self) -> float:
        """Seconds since the previous take(); on a GPU call it after synchronize()."""
        seconds = self.seconds + sum(a.elapsed_time(b) for a, b in self.events) / 1000
        self.seconds, self.events = 0.0, []
        return seconds


class TrainingMonitor:
    """What a running job logs (module docstring). Calls that communicate (report, and nothing
    else) must be made on every rank at the same step."""

    def __init__(self, args, out_dir, model: torch.nn.Module, optimizer, throughput,
                 flops_per_token: float, total_steps: int, logger=None,
                 sample_seconds: float | None = None, clock=time.perf_counter):
        self.args, self.optimizer, self.throughput = args, optimizer, throughput
        self.device = throughput.device
        self.total_steps, self.flops_per_token, self.clock = total_steps, flops_per_token, clock
        self.logger = logger if logger is not None else MetricLogger(
            args.logger, out_dir, vars(args), name=os.path.basename(os.path.normpath(out_dir)))
        precision = resolve_precision(getattr(args, "precision", "fp32"), self.device)
        self.peak = peak_flops(self.device, precision)[0] * get_world_size()
        self.grad_norm = GradNorm(model)
        self.forward = ForwardTimer(model, self.device)
        self.sampler, gpu_index = start_sampler(
            self.device, **({} if sample_seconds is None else dict(seconds=sample_seconds)))
        self.me = (socket.gethostname(), get_rank(), gpu_index)
        self.everyone = None  # (host, rank, GPU) of every rank, asked at the first report
        self.data_wait = 0.0
        self.last_tokens = self.last_seconds = self.last_steps = 0
        self.epoch_tokens = self.epoch_seconds = 0
        self.eta_start = None
        self.legend_said = False  # the line under the first report (report())
        # the memory breakdown: activations counted from the first batch to the first
        # optimizer step, then measured once (watch_memory, _measure_memory)
        self.model, self.precision = model, precision
        self.memory, self.activations, self.tokens = None, None, 0
        self.step_hook = optimizer.register_step_post_hook(self._measure_memory)
        # A pipeline's first step also runs a shape-inference pass (its graph kept a while):
        # count the second step's activations there.
        self.memory_step, self.steps_seen = (2 if hasattr(args, "microbatches") else 1), 0

    # ---- every step ----
    def batches(self, loader):
        """The loader's batches, timing how long each took to arrive (the data wait)."""
        iterator = iter(loader)
        while True:
            start = self.clock()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            self.waited(self.clock() - start)
            self.watch_memory(batch)
            yield batch

    def waited(self, seconds: float) -> None:
        """Count `seconds` of waiting for a batch (batches() calls it; Lightning's callback too)."""
        if self.throughput.last is not None:  # waits during training, not after a pause
            self.data_wait += seconds

    # ---- once: the memory breakdown ----
    def watch_memory(self, batch) -> None:
        """Count the activations the first step saves (batches() calls it with every batch)."""
        if self.memory is not None or self.step_hook is None:
            return
        if self.steps_seen + 1 < self.memory_step:
            return
        tokens = batch[0].numel() if isinstance(batch, (list, tuple)) else 0
        microbatches = getattr(self.args, "microbatches", 1) or 1
        self.tokens = max(self.tokens, tokens // microbatches)  # one microbatch's tokens
        if self.activations is None:
            self.activations = ActivationCounter(self.model).__enter__()

    def _measure_memory(self, optimizer, *args, **kwargs) -> None:
        """After the first optimizer step: every rank measures; rank 0 prints and logs."""
        self.steps_seen += 1
        if self.steps_seen < self.memory_step:
            return
        self.step_hook.remove()
        self.step_hook = None
        if self.activations is None:
            return
        self.activations.__exit__(None, None, None)
        from model.transformer import ModelConfig
        cfg = getattr(self.model, "cfg", None) or getattr(getattr(self.model, "module", None),
                                                          "cfg", None)
        cfg = cfg if isinstance(cfg, ModelConfig) else None
        layout = infer_layout(self.model, self.args, get_world_size(), self.precision)
        mine = breakdown(self.model, optimizer, self.activations, cfg, self.tokens, layout,
                         self.device, self.precision)
        everyone = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
        self.memory = memory_summary(everyone)
        if get_rank() == 0:
            line = format_breakdown(mine)
            largest = max(range(len(everyone)), key=lambda r: self.memory["total"][r])
            if largest != 0 and self.memory["total"][largest] > 1.01 * self.memory["total"][0]:
                line += f"; the largest rank ({largest}): {format_breakdown(everyone[largest])}"
            print(line, flush=True)
        self.logger.log({f"memory/{k}_mib": max(self.memory[k]) / 2**20
                         for k in (*CATEGORIES, "total")}, 1)

    # ---- every --log-every steps ----
    def report(self, step: int, loss: torch.Tensor, bubble: list | None = None) -> str:
        """Log the interval since the previous report; return the log line (without "epoch N").

        `bubble`: a pipeline's idle share of every step so far (StageBusyTimer.idle_fraction).
        """
        stop_if_a_loss_was_not_finite()  # the losses kept on the GPU since the last report
        self.throughput.lap()  # synchronizes: the interval's time is the GPU's, not the queue's
        t = self.throughput
        # the interval: timed steps only (the first after a start or a pause only starts the clock)
        seconds, tokens, steps = (t.seconds - self.last_seconds, t.tokens - self.last_tokens,
                                  t.steps - self.last_steps)
        self.last_seconds, self.last_tokens, self.last_steps = t.seconds, t.tokens, t.steps
        own = self.data_wait + self.forward.take()  # this rank's own part of the interval
        recent = bubble[-max(steps, 1):] if bubble else []
        mine = [self.data_wait / seconds if steps and seconds > 0 else math.nan,
                own / steps if steps else math.nan, *self._memory(),
                sum(recent) / len(recent) if recent else math.nan, *self.sampler.take()]
        self.data_wait = 0.0
        values = self._gather(torch.stack([
            loss.detach().to(collective_device(), torch.float64).reshape(()),
            self.grad_norm().to(torch.float64),
        ]), mine)

        loss_value, grad_norm = values[0][0], values[0][1]
        per_rank = [row[2:] for row in values]
        wait, own_s, mem, peak, idle_share = (list(col) for col in list(zip(*per_rank))[:5])
        tokens_per_s = tokens / seconds if steps and seconds > 0 else math.nan
        step_s = seconds / steps if steps else math.nan
        # ETA: the wall time per step since the first report (so evaluations count, the first
        # steps' warm-up does not); at the first report, the interval's step time
        now = self.clock()
        if self.eta_start is None:
            self.eta_start = (now, step)
        t0, s0 = self.eta_start
        per_step = (now - t0) / (step - s0) if step > s0 else step_s
        eta = per_step * max(self.total_steps - step, 0)
        metrics = {
            "train/loss": loss_value, "train/grad_norm": grad_norm,
            "train/lr": self.optimizer.param_groups[0]["lr"],
            "train/tokens_per_s": tokens_per_s,
            "train/mfu": tokens_per_s * self.flops_per_token / self.peak,
            "train/step_s": step_s,
            "train/data_wait": max(wait),
            "memory/allocated_gib": max(mem) / 2**30, "memory/peak_gib": max(peak) / 2**30,
            "ranks/slowest_s": max(own_s), "ranks/fastest_s": min(own_s),
            "ranks/slowest_rank": float(own_s.index(max(own_s))),
            "progress/eta_min": eta / 60,
        }
        if bubble:
            metrics["pipeline/bubble"] = sum(idle_share) / len(idle_share)
        metrics.update(self._system_metrics(per_rank))
        self.logger.log({k: v for k, v in metrics.items() if math.isfinite(v)}, step)
        percent = 100 * step / self.total_steps if self.total_steps else 100
        rate = (f"{tokens_per_s:.0f} tokens/s MFU {metrics['train/mfu']:.1%}" if steps
                else "(the first step only starts the clock)")
        # the last step's ETA leaves out the evaluation of the whole validation and test splits
        # that follows (on a laptop it can take longer than a short run's training): say so
        last = "; evaluating the validation and test splits next" if (
            step >= self.total_steps) else ""
        # once, under the first line of a run of several ranks: whose numbers these are
        ranks = len(per_rank)
        together = "both ranks" if ranks == 2 else f"all {ranks} ranks"
        legend = (f"\n  (these lines: loss, the mean of the {ranks} ranks; tokens/s and MFU, "
                  f"{together} together; mem, the largest rank's)"
                  if ranks > 1 and not self.legend_said else "")
        self.legend_said = True
        return (f"step {step}/{self.total_steps} ({percent:.0f}%) loss {loss_value:.4f} {rate} "
                f"mem {max(mem) / 2**30:.2f} GiB (peak {max(peak) / 2**30:.2f}) "
                f"ETA {format_duration(eta)}{last}{legend}")

    def _memory(self) -> tuple[float, float]:
        """(bytes in use now, peak bytes) of this rank: the GPU's tensors, or on a CPU the
        process's resident memory."""
        if self.device.type == "cuda":
            return (torch.cuda.memory_allocated(self.device),
                    torch.cuda.max_memory_allocated(self.device))
        from utils.metrics import peak_memory_bytes
        return self.sampler.process.memory_info().rss, peak_memory_bytes(self.device)

    def _gather(self, shared: torch.Tensor, mine: list) -> list[list[float]]:
        """[shared values, then this rank's] of every rank, read from the device once."""
        row = torch.cat([shared, torch.tensor(mine, dtype=torch.float64, device=shared.device)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            if self.everyone is None:
                self.everyone = [None] * dist.get_world_size()
                dist.all_gather_object(self.everyone, self.me)
            rows = [torch.empty_like(row) for _ in range(dist.get_world_size())]
            dist.all_gather(rows, row)
            row = torch.stack(rows)
        else:
            self.everyone = [self.me]
            row = row[None]
        return row.tolist()

    def _system_metrics(self, per_rank) -> dict:
        """One curve per node and GPU (the process's CPU use and memory per rank)."""
        metrics = {}
        for (host, rank, gpu), row in zip(self.everyone, per_rank):
            system = dict(zip(FIELDS, row[-len(FIELDS):]))
            metrics[f"system/{host}/rank{rank}/cpu_percent"] = system["cpu_percent"]
            metrics[f"system/{host}/rank{rank}/rss_gib"] = system["rss_gib"]
            if gpu >= 0:
                for field in FIELDS[2:]:
                    metrics[f"system/{host}/gpu{gpu}/{field.removeprefix('gpu_')}"] = system[field]
        return metrics

    # ---- every epoch, and at the end ----
    def log_epoch(self, step: int, val_loss: float, train_loss: float | None = None) -> None:
        """Validation loss and perplexity, the epoch's tokens/s and, where the script computes
        it, its mean training loss (call after the validation)."""
        seconds = self.throughput.seconds - self.epoch_seconds
        tokens = self.throughput.tokens - self.epoch_tokens
        self.epoch_seconds, self.epoch_tokens = self.throughput.seconds, self.throughput.tokens
        metrics = {"val/loss": val_loss, "val/ppl": perplexity(val_loss)}
        if train_loss is not None:
            metrics["train/epoch_loss"] = train_loss
        if tokens:
            metrics["train/epoch_tokens_per_s"] = tokens / seconds
        self.logger.log({k: v for k, v in metrics.items() if math.isfinite(v)}, step)

    def close(self, summary: dict | None = None) -> None:
        """Stop sampling; the final results go to the HParams view and wandb's summary."""
        self.sampler.close()
        if self.activations is not None and self.memory is None:  # no step was taken
            self.activations.__exit__(None, None, None)
            self.activations = None
        if summary is not None:
            self.logger.finish(final_results(summary), summary["steps"])
        self.logger.close()
        # let go of the model and the optimizer, so that a script's `del model, optimizer` frees
        # them (DDP's buffers while its process group still exists: the DDP step's last TODO)
        if self.step_hook is not None:  # (no optimizer step was taken)
            self.step_hook.remove()
        self.model = self.optimizer = self.grad_norm = self.activations = None
