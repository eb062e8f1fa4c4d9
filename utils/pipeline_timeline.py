"""The schedule a pipeline really ran, drawn next to the one the theory predicts.

`StageBusyTimer` wraps the methods a schedule calls for every microbatch on a stage
(forward_one_chunk, backward_one_chunk and, for zero-bubble schedules, backward_weight_one_chunk)
and notes when each began and ended: F forward, B backward, or, where a zero-bubble schedule
splits the backward, I (gradients of the inputs, which the previous stage waits for) and W
(gradients of the weights, which can wait). Timestamps only: time.perf_counter on a CPU, CUDA
events on a GPU, so nothing waits for the GPU during training; they are read at the end (and the
idle share of a step when a log line asks for it). Everything a rank does between its stage's
computations is waiting for other stages (the bubble) or communicating:
    idle share of a step = 1 - busy time / step time

`draw_run_schedule` (called once, after training, on every rank) gathers the last recorded steps
of every stage; rank 0 writes, beside summary.json,
    pipeline_schedule.json   a typical step as it ran, and as the theory predicts it
    pipeline_schedule.png    one row per rank: measured above, predicted below, one time axis
    pipeline_schedule.html   the same picture with its numbers, one file that opens offline
and `python tools/pipeline_timeline.py RUN_DIR` draws the PNG and HTML again from the JSON.

The prediction: torch's own schedule class lays out each rank's actions (on stand-in stages,
as torch's schedule visualiser does), and every action starts as soon as its rank is free and its
input exists (the previous stage's forward, the next stage's backward), taking this run's own
median compute time for its stage and kind; communication costs nothing. So the distance between
the prediction and the measurement is communication and overhead, and the distance between the
prediction and the textbook formula (equal stages) is the stages' imbalance.
"""

from __future__ import annotations

import html
import json
import socket
import statistics
import time
from collections import deque
from pathlib import Path

import torch

KINDS = {"F": "forward", "B": "backward", "I": "backward, input gradients",
         "W": "backward, weight gradients"}
FILES = ("pipeline_schedule.json", "pipeline_schedule.png", "pipeline_schedule.html")
# Unit times of the textbook schedules: a backward costs two forwards (the gradients of the
# inputs and of the weights, each about one forward's matmuls); zero-bubble schedules split it
# into I and W of one unit each.
UNIT_TIMES = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


# ---------------------------------------------------------------------------- the bubble in theory
def pipeline_bubble_fraction(stages: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """The idle share of a GPipe or 1F1B step when every stage takes equal time:
    (p - 1) / (m + p - 1). The first stage waits p - 1 microbatch slots for the last stage to
    start its backward passes, the last stage waits as long at the start: more microbatches
    shrink this share, more stages grow it. (1F1B has the same bubble; it keeps only p
    microbatches' activations alive instead of m.) With v stages per rank (interleaved 1F1B)
    every slot is v times shorter, the ramp-up and ramp-down shrink by v:
    (p - 1) / (v m + p - 1), p counting ranks."""
    return (stages - 1) / (stages_per_rank * microbatches + stages - 1)


def bubble_formula(schedule: str, ranks: int, microbatches: int, stages_per_rank: int = 1):
    """(value, text): the textbook bubble of a schedule when every stage takes equal time (a
    backward twice a forward; zero bubble: input and weight gradients one forward each)."""
    p, m, v = ranks, microbatches, stages_per_rank
    if schedule in ("gpipe", "1f1b") or (schedule == "interleaved-1f1b" and v == 1):
        return pipeline_bubble_fraction(p, m), f"(p-1)/(m+p-1) = {p - 1}/{m + p - 1}"
    if schedule == "interleaved-1f1b":
        return (pipeline_bubble_fraction(p, m, v),
                f"(p-1)/(vm+p-1) = {p - 1}/{v * m + p - 1}")
    if schedule == "zero-bubble":
        # Qi et al. 2023 (ZB-H1): the weight gradients W, which nothing waits for, fill the
        # ramp-down; of 1F1B's (p-1)(F+B) = 3(p-1) idle units only (p-1)(F+I-W) = p-1 stay, with
        # F, I and W of one unit each; with v stages per rank, v times shorter again
        return ((p - 1) / (3 * v * m + p - 1),
                f"(p-1)/(3{'v' if v > 1 else ''}m+p-1) = {p - 1}/{3 * v * m + p - 1}")
    return None, f"no formula for {schedule}"


# ---------------------------------------------------------------------------- recording
class _HostClock:
    """Marks are time.perf_counter() values (the CPU: the work is done when the call returns)."""

    def mark(self):
        return time.perf_counter()

    def ready(self, mark) -> bool:
        return True

    def seconds(self, start, end) -> float:
        return end - start

    def host_times(self, marks: list) -> list[float]:
        return list(marks)


class _CudaClock:
    """Marks are CUDA events recorded into the stream: they fire when the GPU gets there, and
    the CPU never waits for them until a time is read."""

    def mark(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ready(self, mark) -> bool:
        return mark.query()

    def seconds(self, start, end) -> float:
        end.synchronize()  # (only when a number is read: at a log step or at the end)
        return start.elapsed_time(end) / 1000

    def host_times(self, marks: list) -> list[float]:
        """Each event's time on this host's clock: one reference event, waited for once."""
        reference = self.mark()
        reference.synchronize()
        now = time.perf_counter()
        return [now - mark.elapsed_time(reference) / 1000 for mark in marks]


class _Step:
    __slots__ = ("number", "start", "end", "actions", "idle")

    def __init__(self, number: int, start):
        self.number, self.start, self.end, self.actions, self.idle = number, start, None, [], None


class IdleShare:
    """A step's idle share that is read only when asked for (float(), a sum, a format): on a GPU
    that waits for the step's last event, so a training loop can keep one per step for free."""

    __slots__ = ("_timer", "_step")

    def __init__(self, timer: StageBusyTimer, step: _Step):
        self._timer, self._step = timer, step

    def __float__(self) -> float:
        return self._timer._resolve(self._step)

    def __add__(self, other):
        return float(self) + float(other)

    __radd__ = __add__

    def __truediv__(self, other):
        return float(self) / float(other)

    def __lt__(self, other):
        return float(self) < float(other)

    def __format__(self, spec: str) -> str:
        return format(float(self), spec)

    def __repr__(self) -> str:
        return repr(float(self))


class StageBusyTimer:
    """Records when this rank's stage(s) compute, microbatch by microbatch (see the module's
    docstring): timer.start_step() before schedule.step, timer.idle_fraction() after it.

    `stage`: a PipelineStage, or a list of them (several stages per rank). The last
    `keep_steps` steps keep every action's start and end for the drawing; older ones keep only
    their idle share.
    """

    METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")

    def __init__(self, stage, device: torch.device, keep_steps: int = 6):
        self.stages = list(stage) if isinstance(stage, (list, tuple)) else [stage]
        self.clock = _CudaClock() if device.type == "cuda" else _HostClock()
        self.steps: list[_Step] = []       # every step: its idle share, read when asked for
        self.recent: deque[_Step] = deque(maxlen=keep_steps)  # with their actions
        self.current: _Step | None = None
        for s in self.stages:
            for name in self.METHODS:
                if hasattr(s, name):
                    setattr(s, name, self._recorded(getattr(s, name), name, s.stage_index))

    def _recorded(self, method, name: str, stage_index: int):
        def recorded(chunk, *args, **kwargs):
            step = self.current
            if step is None:  # evaluation, or outside a training step: not timed
                return method(chunk, *args, **kwargs)
            start = self.clock.mark()
            result = method(chunk, *args, **kwargs)
            if name == "forward_one_chunk":
                kind = "F"
            elif name == "backward_weight_one_chunk":
                kind = "W"
            else:  # a zero-bubble schedule asks for the input gradients alone: I, then W later
                full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
                kind = "B" if full else "I"
            step.actions.append((stage_index, kind, int(chunk), start, self.clock.mark()))
            return result
        return recorded

    def start_step(self) -> None:
        self._forget_old_actions()
        self.current = _Step(len(self.steps), self.clock.mark())

    def idle_fraction(self) -> float | IdleShare:
        """Share of the step since start_step() that this rank spent not computing (a float on
        a CPU; on a GPU a number that is read when used)."""
        step, self.current = self.current, None
        step.end = self.clock.mark()
        self.steps.append(step)
        self.recent.append(step)
        if isinstance(self.clock, _HostClock):
            return self._resolve(step)
        return IdleShare(self, step)

    def _resolve(self, step: _Step) -> float:
        if step.idle is None:
            span = self.clock.seconds(step.start, step.end)
            busy = sum(self.clock.seconds(a[3], a[4]) for a in step.actions)
            step.idle = 1.0 - busy / max(span, 1e-9)
        return step.idle

    def _forget_old_actions(self) -> None:
        """Steps no longer among the recent ones keep only their idle share (read once their
        last event has fired: asking an event whether it has fired does not wait)."""
        for step in self.steps[-2 * self.recent.maxlen:-self.recent.maxlen]:
            if step.actions and self.clock.ready(step.end):
                self._resolve(step)
                step.actions = []

    def recorded_steps(self) -> list[dict]:
        """The recent steps with every action's start and end in seconds on this host's
        monotonic clock (on a GPU: the one wait for the GPU of the whole run)."""
        steps = list(self.recent)
        marks = [m for s in steps for m in (s.start, s.end, *(x for a in s.actions for x in a[3:]))]
        times = iter(self.clock.host_times(marks))
        out = []
        for s in steps:
            start, end = next(times), next(times)
            actions = [[stage, kind, mb, next(times), next(times)]
                       for stage, kind, mb, *_ in s.actions]
            out.append({"step": s.number, "start": start, "end": end, "actions": actions})
        return out


# ---------------------------------------------------------------------------- the theory
def schedule_class(name_or_class):
    """A schedule class of torch.distributed.pipelining, from itself or its name."""
    if isinstance(name_or_class, str):
        import torch.distributed.pipelining as pipelining
        return getattr(pipelining, name_or_class)
    return name_or_class


def stage_ids(rank: int, ranks: int, stages_per_rank: int) -> list[int]:
    """The stages rank `rank` holds: rank, rank + ranks, ... (the loop placement of the
    interleaved schedules: every stage sends to the next rank, the last rank to the first)."""
    return [rank + k * ranks for k in range(stages_per_rank)]


class _StandInStage:
    """What a schedule asks of a stage, answered without computing or sending anything: the
    forward and backward calls are only noted, in `calls`."""

    def __init__(self, rank: int, ranks: int, stage_index: int, num_stages: int, calls=None):
        self.group_rank, self.group_size, self.submod, self.device = rank, ranks, None, "cpu"
        self.stage_index, self.num_stages = stage_index, num_stages
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.calls = calls if calls is not None else []

    def forward_one_chunk(self, chunk, *args, **kwargs):
        self.calls.append((self.stage_index, "F", chunk))

    def backward_one_chunk(self, chunk, *args, **kwargs):
        self.calls.append((self.stage_index, "B", chunk))

    def __getattr__(self, name):
        if name.endswith("_ops"):  # the messages to send and receive: none
            return lambda *args, **kwargs: []
        return lambda *args, **kwargs: None


def schedule_order(cls, ranks: int, microbatches: int, stages_per_rank: int = 1,
                   only: int | None = None) -> list[list[tuple[int, str, int]]]:
    """Each rank's computations in the order torch's schedule runs them: (stage, kind, microbatch).

    Single-stage schedules (GPipe, 1F1B): their own step loop runs on a stand-in stage that
    records forward_one_chunk and backward_one_chunk and sends nothing. Schedules with a list
    of stages (interleaved, zero bubble) compute every rank's order when built: it is read from
    a schedule built on stand-in stages. only=r: rank r's order alone, in a list of one (a
    single-stage schedule then runs one stand-in step, not one per rank).
    """
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    cls = schedule_class(cls)
    num_stages = ranks * stages_per_rank
    wanted = range(ranks) if only is None else [only]

    def stand_in(rank: int, stage_index: int, calls=None):
        return _StandInStage(rank, ranks, stage_index, num_stages, calls)

    if issubclass(cls, PipelineScheduleSingle):
        if stages_per_rank != 1:
            raise ValueError(f"{cls.__name__} runs one stage per rank, not {stages_per_rank}")
        order = []
        for rank in wanted:
            calls = []
            stage = stand_in(rank, rank, calls)
            schedule = cls(stage, n_microbatches=microbatches, loss_fn=lambda *a: None)
            targets = [None] * microbatches if stage.is_last else None
            schedule._step_microbatches([()] * microbatches, [{}] * microbatches, targets, None)
            order.append(calls)
        return order
    stages = [stand_in(0, i) for i in stage_ids(0, ranks, stages_per_rank)]
    schedule = cls(stages, n_microbatches=microbatches)
    order = []
    for rank in wanted:
        actions = []
        for a in schedule.pipeline_order[rank]:
            kind = getattr(a, "computation_type", None) if a is not None else None
            kind = getattr(kind, "value", kind)
            if kind in KINDS:
                actions.append((a.stage_index, kind, a.microbatch_index))
        order.append(actions)
    return order


def simulate(order, times=None) -> list[list[tuple[int, str, int, float, float]]]:
    """Start and end of every action when each rank runs its actions in order, each as soon as
    its rank is free and its input exists: a forward needs the previous stage's forward, a
    backward (B or I) the next stage's backward (the last stage: its own forward), W its own I.
    Communication is free. `times`: {(stage, kind): seconds} or {kind: seconds} (UNIT_TIMES)."""
    times = times or UNIT_TIMES
    last = max(stage for rank in order for stage, *_ in rank)
    done, timeline = {}, [[] for _ in order]
    pos, free = [0] * len(order), [0.0] * len(order)

    def needs(stage, kind, mb):
        if kind == "F":
            return [(stage - 1, "F", mb)] if stage > 0 else []
        if kind == "W":
            return [(stage, "I", mb)]
        if stage == last:
            return [(stage, "F", mb)]
        return [(stage + 1, "B", mb), (stage + 1, "I", mb)]  # whichever the schedule ran

    while any(pos[r] < len(order[r]) for r in range(len(order))):
        progressed = False
        for r, actions in enumerate(order):
            if pos[r] == len(actions):
                continue
            stage, kind, mb = actions[pos[r]]
            ready = [done[d] for d in needs(stage, kind, mb) if d in done]
            if needs(stage, kind, mb) and not ready:
                continue
            start = max([free[r], *ready])
            end = start + times.get((stage, kind), times.get(kind, UNIT_TIMES[kind]))
            done[(stage, kind, mb)], free[r] = end, end
            timeline[r].append((stage, kind, mb, start, end))
            pos[r] += 1
            progressed = True
        if not progressed:
            raise RuntimeError("the schedule's order deadlocks")
    return timeline


def idle_share(timeline, window=None) -> float:
    """1 - busy / (ranks x the step's length) over all ranks of a timeline."""
    starts = [a[3] for rank in timeline for a in rank]
    ends = [a[4] for rank in timeline for a in rank]
    begin, end = window or (min(starts), max(ends))
    busy = sum(a[4] - a[3] for rank in timeline for a in rank)
    return 1.0 - busy / max(len(timeline) * (end - begin), 1e-12)


# ---------------------------------------------------------------------------- one run's schedule
# The course's --schedule names and torch's classes (the scripts build them, this draws them).
SCHEDULE_CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                    "interleaved-1f1b": "ScheduleInterleaved1F1B",
                    "zero-bubble": "ScheduleInterleavedZeroBubble"}


def draw_run_schedule(out_dir, timer: StageBusyTimer, schedule: str, microbatches: int,
                      group=None) -> dict:
    """After training, on every rank of the run: gather the recorded steps of the ranks of one
    pipeline (`group`: its process group; None: the whole world), and on global rank 0 write
    FILES into `out_dir`. Returns the bubble numbers (on every rank) for summary.json."""
    import torch.distributed as dist

    initialized = dist.is_initialized()
    mine = {"host": socket.gethostname(), "stages": [s.stage_index for s in timer.stages],
            "wall_minus_monotonic": time.time() - time.perf_counter(),
            "device": str(getattr(timer.stages[0], "device", "")),
            "steps": timer.recorded_steps()}
    everyone = [mine]
    if initialized and dist.get_world_size(group) > 1:
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
    record = schedule_record(everyone, schedule, microbatches)
    if not initialized or dist.get_rank() == 0:
        write_drawing(out_dir, record)
    return {k: record[k] for k in ("bubble_measured", "bubble_predicted", "bubble_formula",
                                   "step_s_measured", "step_s_predicted")}


def schedule_record(everyone: list[dict], schedule: str, microbatches: int) -> dict:
    """The typical step of a run as it ran (`everyone`: per rank of one pipeline, in rank order,
    what draw_run_schedule gathers) and as predicted; what pipeline_schedule.json holds."""
    ranks, stages_per_rank = len(everyone), len(everyone[0]["stages"])
    formula, formula_text = bubble_formula(schedule, ranks, microbatches, stages_per_rank)
    record = {"schedule": schedule, "schedule_class": SCHEDULE_CLASSES.get(schedule, schedule),
              "ranks": ranks, "stages_per_rank": stages_per_rank,
              "num_stages": ranks * stages_per_rank, "microbatches": microbatches,
              "device": everyone[0].get("device", ""),
              "stages": [r["stages"] for r in everyone], "bubble_formula": formula,
              "formula": formula_text, "step": None, "measured": None, "predicted": None,
              "bubble_measured": None, "bubble_predicted": None, "step_s_measured": None,
              "step_s_predicted": None, "idle_per_rank": None, "compute_s": {}}
    # The steps every rank recorded; the run's first step also builds the pipeline: left out.
    common = set.intersection(*({s["step"] for s in r["steps"]} for r in everyone))
    candidates = sorted(common - {0}) or sorted(common)
    if not candidates:
        return record
    hosts = {r["host"] for r in everyone}
    # one host: every process reads the same monotonic clock; several: their wall clocks
    shift = [0.0 if len(hosts) == 1 else r["wall_minus_monotonic"] for r in everyone]
    record["clock"] = ("one host's monotonic clock" if len(hosts) == 1 else
                       f"the wall clocks of {len(hosts)} hosts (rows may be shifted by their "
                       "clocks' offset, typically under a millisecond)")
    steps = {n: [next(s for s in r["steps"] if s["step"] == n) for r in everyone]
             for n in candidates}

    def span(n):
        return (max(s["end"] + d for s, d in zip(steps[n], shift))
                - min(s["start"] + d for s, d in zip(steps[n], shift)))

    typical = sorted(candidates, key=span)[len(candidates) // 2]  # the median step
    origin = min(s["start"] + d for s, d in zip(steps[typical], shift))
    measured = []
    for rank, (s, d) in enumerate(zip(steps[typical], shift)):
        measured.append({"rank": rank, "stages": everyone[rank]["stages"],
                         "start": s["start"] + d - origin, "end": s["end"] + d - origin,
                         "actions": [[st, kind, mb, a + d - origin, b + d - origin]
                                     for st, kind, mb, a, b in s["actions"]]})
    # this run's own compute time per stage and kind: the median over the recorded steps
    durations = {}
    for n in candidates:
        for s in steps[n]:
            for st, kind, _, a, b in s["actions"]:
                durations.setdefault((st, kind), []).append(b - a)
    times = {key: statistics.median(v) for key, v in durations.items()}
    predicted = simulate(schedule_order(record["schedule_class"], ranks, microbatches,
                                        stages_per_rank), times)
    rows = [[tuple(a) for a in r["actions"]] for r in measured]
    end = max(r["end"] for r in measured)
    record.update(
        step=typical, measured=measured, predicted=[[list(a) for a in r] for r in predicted],
        bubble_measured=idle_share(rows, (0.0, end)), bubble_predicted=idle_share(predicted),
        step_s_measured=end, step_s_predicted=max(a[4] for r in predicted for a in r),
        idle_per_rank=[1 - sum(a[4] - a[3] for a in r["actions"]) / max(r["end"] - r["start"],
                                                                         1e-12)
                       for r in measured],
        compute_s={f"{st}{kind}": t for (st, kind), t in sorted(times.items())})
    return record


def write_drawing(out_dir, record: dict) -> list[Path]:
    """FILES into out_dir: the JSON always; the PNG and the HTML where matplotlib is installed
    (else one line says how to draw them later). Each file appears whole or not at all."""
    from utils.files import atomic_open, atomic_write_json, atomic_write_text

    out_dir = Path(out_dir)
    json_path, png_path, html_path = (out_dir / name for name in FILES)
    atomic_write_json(json_path, record)
    try:
        png, svg = render(record)
    except ImportError:
        print(f"pipeline schedule: {json_path} written; no matplotlib to draw it "
              "(pip install matplotlib, then python tools/pipeline_timeline.py "
              f"{out_dir})", flush=True)
        return [json_path]
    with atomic_open(png_path, "wb") as f:
        f.write(png)
    atomic_write_text(html_path, page(record, svg))
    print(f"pipeline schedule drawn: {html_path} (and .png)", flush=True)
    return [json_path, png_path, html_path]


def headline(record: dict) -> str:
    r = record
    where = (f"{r['ranks']} ranks x {r['stages_per_rank']} stages" if r["stages_per_rank"] > 1
             else f"{r['ranks']} stages")
    return f"{r['schedule']} ({r['schedule_class']}), {where}, {r['microbatches']} microbatches"


def numbers(record: dict) -> list[tuple[str, str]]:
    """The figures shown beside the picture: (what, value)."""
    r, pct = record, "{:.0%}".format
    in_units = r.get("time_unit") == "forward"

    def duration(seconds):
        return f"{seconds:g} units of a forward" if in_units else f"{seconds * 1e3:.2f} ms"

    rows = []
    if r["measured"] is not None:
        rows += [("step drawn", f"step {r['step']} (the median of the last recorded steps)"),
                 ("step time measured", duration(r["step_s_measured"])),
                 ("bubble measured", f"{pct(r['bubble_measured'])} of every rank's step "
                  f"(idle share per rank: {' '.join(pct(f) for f in r['idle_per_rank'])})")]
    elif not in_units:
        rows.append(("measured", "no training step was recorded"))
    if r["predicted"] is not None:
        rows.append(("predicted", f"{pct(r['bubble_predicted'])}, step "
                     f"{duration(r['step_s_predicted'])}: torch's order of this schedule with "
                     + ("equal stages" if in_units else "this run's own compute time per stage")
                     + ", communication free"))
    rows.append(("formula", f"{pct(r['bubble_formula'])} = {r['formula']}, for equal stages"
                 if r["bubble_formula"] is not None else r["formula"]))
    if r.get("clock"):
        rows.append(("clock", r["clock"]))
    return rows


def render(record: dict) -> tuple[bytes, str]:
    """(PNG bytes, SVG text) of the measured and the predicted step, one row per rank."""
    import io

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    panels = [("as it ran", record["measured"] and [r["actions"] for r in record["measured"]]),
              ("as predicted", record["predicted"])]
    panels = [(title, rows) for title, rows in panels if rows]
    ranks = record["ranks"]
    colours = plt.get_cmap("tab10").colors
    height = 1.6 + len(panels) * (0.55 * ranks + 0.7)
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, height), squeeze=False, sharex=True)
    end = max(a[4] for _, rows in panels for row in rows for a in row) or 1.0
    unit, label = ((1.0, "units of one forward") if record.get("time_unit") == "forward"
                   else (1e3, "ms") if end < 10 else (1.0, "s"))
    fills = {"F": 0.35, "B": 1.0, "I": 0.7, "W": 0.7}
    for ax, (title, rows) in zip(axes[:, 0], panels):
        for rank, row in enumerate(rows):
            for stage, kind, mb, a, b in row:
                colour = colours[mb % len(colours)]
                ax.barh(rank, (b - a) * unit, left=a * unit, height=0.8, color=colour,
                        alpha=fills[kind], edgecolor=colour, linewidth=0.8,
                        hatch="//" if kind == "W" else None)
                if (b - a) / end > 0.025:  # room for a label
                    text = f"{stage}{kind}{mb}" if record["stages_per_rank"] > 1 else f"{kind}{mb}"
                    ax.text((a + b) / 2 * unit, rank, text, ha="center", va="center",
                            fontsize=7, color="white" if kind == "B" else "black")
        ax.set_yticks(range(ranks))
        ax.set_yticklabels([f"rank {r}" + (f" (stage{'s' if len(s) > 1 else ''} "
                                           f"{', '.join(map(str, s))})")
                            for r, s in enumerate(record["stages"])])
        ax.invert_yaxis()
        ax.set_xlim(0, end * unit * 1.01)
        ax.set_title(title, loc="left", fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel(f"time in the step ({label})")
    legend = [Patch(facecolor="grey", alpha=fills[k], hatch="//" if k == "W" else None,
                    label=f"{k}: {KINDS[k]}") for k in ("F", "B", "I", "W")
              if any(a[1] == k for _, rows in panels for row in rows for a in row)]
    fig.legend(handles=legend + [Patch(facecolor="white", label="colour: the microbatch")],
               loc="lower center", ncol=len(legend) + 1, fontsize=8, frameon=False)
    bubble = (f": bubble measured {record['bubble_measured']:.0%}, predicted "
              f"{record['bubble_predicted']:.0%}" if record["measured"] else "")
    fig.suptitle(f"{headline(record)}{bubble}", x=0.01, ha="left", fontsize=10)
    fig.tight_layout(rect=(0, 0.4 / height, 1, 1 - 0.3 / height))
    png, svg = io.BytesIO(), io.StringIO()
    fig.savefig(png, format="png", dpi=110)
    with plt.rc_context({"svg.hashsalt": "pipeline-schedule"}):  # the same data, the same file
        fig.savefig(svg, format="svg", metadata={"Date": None})
    plt.close(fig)
    return png.getvalue(), svg.getvalue()[svg.getvalue().index("<svg"):]


def page(record: dict, svg: str) -> str:
    """One HTML file, no server and no network needed: the picture (SVG), its numbers, the data."""
    rows = "\n".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
                     for k, v in numbers(record))
    data = json.dumps(record).replace("</", "<\\/")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>Pipeline schedule: {html.escape(headline(record))}</title>
<style>
body {{ font-family: DejaVu Sans, Helvetica, Arial, sans-serif; margin: 1.5em; color: #1f2937; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
th, td {{ text-align: left; padding: 0.2em 1em 0.2em 0; vertical-align: top; }}
svg {{ max-width: 100%; height: auto; }}
</style></head><body>
<h1>Pipeline schedule</h1>
<p>{html.escape(headline(record))}, on {html.escape(record.get('device') or 'unknown device')}.</p>
<table id="numbers">
{rows}
</table>
{svg}
<p>Each row is one rank; a box is one microbatch's forward (F, light), backward (B, dark) or,
where a zero-bubble schedule splits the backward, its input gradients (I) and weight gradients (W,
hatched); with several stages per rank a box reads <i>stage kind microbatch</i> (2F3: stage 2,
forward of microbatch 3). The gaps are the bubble: the rank waited for another stage, or
communicated. Above: one step as this run executed it; below: the same schedule with this
run's own compute times and free communication (docs/pp.md).</p>
<script type="application/json" id="timeline-data">{data}</script>
</body></html>
"""
