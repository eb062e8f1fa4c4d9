"""The drawing of a pipeline's schedule (utils/pipeline_timeline.py): the theory is torch's own
order of each schedule, its bubble is the textbook formula, the timer records every microbatch's
forward and backward (and a zero-bubble schedule's two halves) without waiting for anything, and
a typical step is chosen and aligned the same way for any run. The runs themselves:
tests/test_pp_lesson.py and tests/test_nd_training.py."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, gpu_env, load_script, no_gpu_reason
from utils.pipeline_timeline import (SCHEDULE_CLASSES, IdleShare, StageBusyTimer, bubble_formula,
                                     idle_share, schedule_order, schedule_record, simulate)

GRID = [(p, m) for p in (2, 3, 4, 8) for m in (p, 2 * p, 4 * p)]


@pytest.mark.parametrize("schedule, per_rank", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2),
                                                ("interleaved-1f1b", 4), ("zero-bubble", 1),
                                                ("zero-bubble", 2)])
def test_the_bubble_formula_is_the_idle_share_of_torch_s_own_order_with_equal_stages(schedule,
                                                                                     per_rank):
    for p, m in GRID:
        order = schedule_order(SCHEDULE_CLASSES[schedule], p, m, per_rank)
        # every rank runs every one of its stages' microbatches once, forward and backward
        kinds = ["F", "I", "W"] if schedule == "zero-bubble" else ["F", "B"]
        for rank, actions in enumerate(order):
            stages = [rank + k * p for k in range(per_rank)]
            assert sorted(actions) == sorted((s, k, mb) for s in stages for k in kinds
                                             for mb in range(m)), (schedule, p, m, rank)
        formula, _ = bubble_formula(schedule, p, m, per_rank)
        assert idle_share(simulate(order)) == pytest.approx(formula, abs=1e-12), (schedule, p, m)


def test_1f1b_keeps_at_most_as_many_microbatches_in_flight_as_stages_gpipe_all_of_them():
    def in_flight(order):
        alive, peak = 0, 0
        for _, kind, _ in order[0]:
            alive += 1 if kind == "F" else -1
            peak = max(peak, alive)
        return peak
    assert in_flight(schedule_order("Schedule1F1B", 4, 12)) == 4
    assert in_flight(schedule_order("ScheduleGPipe", 4, 12)) == 12


class FakeStage:
    """The three methods a schedule calls on a stage, each taking a known time."""

    def __init__(self, stage_index):
        self.stage_index = stage_index

    def forward_one_chunk(self, chunk, args, kwargs=None):
        busy(0.002)
        return f"output {chunk}"

    def backward_one_chunk(self, chunk, loss=None, full_backward=True, last_backward=False):
        busy(0.003)

    def backward_weight_one_chunk(self, chunk, last_backward=False):
        busy(0.001)


def busy(seconds):
    import time
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class StandInCudaEvent:
    """torch.cuda.Event as the timer uses it, on the host clock: record() marks the time,
    elapsed_time(end) is end minus start in milliseconds, and synchronize() waits for nothing
    (on a GPU it waits for the stream to get there)."""

    def __init__(self, enable_timing=False):
        assert enable_timing, "an event without enable_timing has no time to read"
        self.time = None

    def record(self):
        self.time = time.perf_counter()

    def query(self):
        return self.time is not None

    def synchronize(self):
        assert self.time is not None, "waited for an event that was never recorded"

    def elapsed_time(self, end):
        assert self.time is not None and end.time is not None
        return (end.time - self.time) * 1000


@pytest.fixture(params=["cpu", "cuda (stand-in events)"])
def timer_device(request, monkeypatch):
    """The host clock, and the CUDA-event clock rehearsed on the CPU with stand-in events (the
    real one runs in test_on_a_gpu_the_timer_never_waits_for_the_gpu_during_training)."""
    if request.param == "cpu":
        return torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "Event", StandInCudaEvent)
    return torch.device("cuda", 0)


def test_the_timer_records_every_action_of_a_step_and_nothing_outside_one(timer_device):
    stages = [FakeStage(0), FakeStage(2)]
    timer = StageBusyTimer(stages, timer_device, keep_steps=2)
    stages[0].forward_one_chunk(0, ())  # evaluation: not timed, and the call still works
    idle = []
    for _ in range(3):
        timer.start_step()
        assert stages[0].forward_one_chunk(0, ()) == "output 0"
        stages[1].forward_one_chunk(0, ())
        stages[1].backward_one_chunk(0, full_backward=False)  # zero bubble: I ...
        stages[1].backward_weight_one_chunk(0)               # ... then W
        stages[0].backward_one_chunk(0, loss=None)           # a full backward: B
        busy(0.004)                                          # waiting for another stage
        idle.append(timer.idle_fraction())
    steps = timer.recorded_steps()
    assert [s["step"] for s in steps] == [1, 2]  # the last keep_steps steps keep their actions
    actions = steps[-1]["actions"]
    assert [a[:3] for a in actions] == [[0, "F", 0], [2, "F", 0], [2, "I", 0], [2, "W", 0],
                                        [0, "B", 0]]
    assert all(steps[-1]["start"] <= a[3] <= a[4] <= steps[-1]["end"] for a in actions)
    assert actions[0][4] - actions[0][3] >= 0.002  # the forward's own time
    for share, recorded in zip(idle[1:], steps):  # the idle share is what the record shows
        busy_s = sum(a[4] - a[3] for a in recorded["actions"])
        assert float(share) == pytest.approx(1 - busy_s / (recorded["end"] - recorded["start"]))
        assert float(share) > 0  # (the 4 ms of waiting)


def test_an_idle_share_read_later_adds_up_like_a_float():
    timer = StageBusyTimer(FakeStage(0), torch.device("cpu"))
    timer.start_step()
    timer.stages[0].forward_one_chunk(0, ())
    share = IdleShare(timer, timer.current)
    timer.current.end = timer.clock.mark()
    value = float(share)
    assert sum([share, share]) / 2 == pytest.approx(value)  # what the log line does with them
    assert f"{share:.3f}" == f"{value:.3f}"


def step(start, actions, end):
    return {"step": 1, "start": start, "end": end, "actions": actions}


def test_the_record_aligns_ranks_by_one_host_s_clock_or_by_wall_clocks():
    # rank 1 receives each message half a unit after rank 0 sent it
    first = {"host": "a", "stages": [0], "wall_minus_monotonic": 100.0,
             "steps": [step(10.0, [[0, "F", 0, 10.0, 11.0], [0, "B", 0, 14.5, 16.5]], 16.5)]}
    second = {"host": "a", "stages": [1], "wall_minus_monotonic": 50.0,
              "steps": [step(10.0, [[1, "F", 0, 11.5, 12.5], [1, "B", 0, 12.5, 14.5]], 14.5)]}
    record = schedule_record([first, second], "gpipe", 1)
    assert record["clock"] == "one host's monotonic clock"
    assert record["measured"][1]["actions"][0][3] == pytest.approx(1.5)  # 11.5 - 10.0
    assert record["step_s_measured"] == pytest.approx(6.5)
    # busy 3 + 3 of 2 x 6.5; predicted with the same compute times but free messages: 3 of 6
    assert record["bubble_measured"] == pytest.approx(1 - 6 / 13)
    assert record["bubble_predicted"] == pytest.approx(0.5)
    assert record["step_s_predicted"] == pytest.approx(6.0)
    assert record["idle_per_rank"] == pytest.approx([1 - 3 / 6.5, 1 - 3 / 4.5])
    second["host"] = "b"  # another node: its monotonic clock means nothing here, its wall clock does
    record = schedule_record([first, second], "gpipe", 1)
    assert "wall clocks of 2 hosts" in record["clock"]
    assert record["measured"][0]["actions"][0][3] == pytest.approx(50.0)  # 110 - (10 + 50)


def test_tools_pipeline_timeline_draws_the_theory_of_any_schedule(tmp_path, capsys):
    tool = load_script("tools/pipeline_timeline.py")
    assert tool.main(["--schedule", "zero-bubble", "--ranks", "3", "--microbatches", "6",
                      "--out", str(tmp_path)]) == 0
    page = (tmp_path / "pipeline_schedule.html").read_text()
    assert "(p-1)/(3m+p-1) = 2/20" in page and "10%" in page
    with pytest.raises(SystemExit) as stop:  # 9 microbatches do not make rounds of 4
        tool.main(["--schedule", "interleaved-1f1b", "--ranks", "4", "--microbatches", "9",
                   "--out", str(tmp_path)])
    assert stop.value.code == 2
    assert "torch cannot build interleaved-1f1b" in capsys.readouterr().err.strip().splitlines()[-1]


GPU_CHECK = """
import torch
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from utils.pipeline_timeline import StageBusyTimer
import torch.distributed as dist
dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1,
                        device_id=torch.device("cuda", 0))
model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)]).cuda()
stage = PipelineStage(model, 0, 1, torch.device("cuda"))
schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=lambda out, y: out.square().mean())
x, y = torch.randn(32, 512, device="cuda"), torch.zeros(32, device="cuda")
schedule.step(x, target=y)  # the first step builds the stage
torch.cuda.synchronize()
torch.cuda.set_sync_debug_mode("error")  # any wait for the GPU raises from here on
try:
    schedule.step(x, target=y)
except RuntimeError as e:
    print("torch's schedule itself waits for the GPU:", e)
    raise SystemExit(0)
timer = StageBusyTimer(stage, torch.device("cuda"))
shares = []
for _ in range(5):
    timer.start_step()
    schedule.step(x, target=y)
    shares.append(timer.idle_fraction())
torch.cuda.set_sync_debug_mode(0)
values = [float(s) for s in shares]  # read now: the only wait
steps = timer.recorded_steps()
assert all(0 <= v < 1 for v in values), values
assert len(steps[-1]["actions"]) == 8, steps[-1]["actions"]
print("no wait for the GPU in 5 steps; idle shares", [round(v, 3) for v in values])
dist.destroy_process_group()
"""


@pytest.mark.gpu
@pytest.mark.skipif(no_gpu_reason() is not None, reason=f"GPU: {no_gpu_reason()}")
def test_on_a_gpu_the_timer_never_waits_for_the_gpu_during_training():
    proc = subprocess.run([sys.executable, "-c", GPU_CHECK], cwd=ROOT, env=gpu_env(
        PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if "torch's schedule itself waits" in proc.stdout:
        pytest.skip(proc.stdout.strip().splitlines()[-1])  # this torch's, not the timer's
    assert "no wait for the GPU in 5 steps" in proc.stdout
