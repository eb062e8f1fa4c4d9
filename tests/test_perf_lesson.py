"""The performance step (train/perf_training.py): it measures, profiles and names the phases
of a step, and its fixes change the speed, not what is trained."""

from __future__ import annotations

import importlib.util
import json
import re
import sys

import pytest
import torch

from conftest import ROOT, read_summary, run_script, script_env

EXERCISE, SOLUTION = "train/perf_training.py", "solutions/train/perf_training.py"
pytestmark = pytest.mark.warm_start  # runs forked warm: tests/warm_launch.py
COMMON = ("--dataset", "synthetic", "--preset", "tiny", "--dropout", 0, "--logger", "none",
          "--seed", 3, "--batch-size", 8)
PHASES = {"forward", "backward", "optimizer", "communication"}


def load_solution():
    spec = importlib.util.spec_from_file_location("perf_training", ROOT / SOLUTION)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def trace_event_names(path) -> set[str]:
    return {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    """The exercise, and the solution with --profile on 1 and on 2 processes, 10 steps each."""
    tmp = tmp_path_factory.mktemp("perf")
    env = script_env(cache_dir=data_cache)
    args = (*COMMON, "--max-steps", 10, "--log-every", 5)
    # the solution's vocabulary unpadded (--pad-vocab 1): a padded one draws other weights
    out = {"exercise": run_script(EXERCISE, *args, "--out-dir", tmp / "exercise", env=env).stdout,
           "solution": run_script(SOLUTION, *args, "--profile", "--pad-vocab", 1,
                                  "--out-dir", tmp / "solution", env=env).stdout}
    run_script(SOLUTION, *args, "--profile", "--batch-size", 4, "--out-dir", tmp / "two",
               nproc=2, env=env, timeout=180)
    return tmp, out


def test_measuring_and_profiling_change_nothing_that_is_trained(runs):
    tmp, _ = runs
    exercise, solution = read_summary(tmp / "exercise"), read_summary(tmp / "solution")
    assert exercise["precision"] == solution["precision"] == "fp32"
    assert exercise["loss_history"] == solution["loss_history"]


def test_the_solution_reports_tokens_per_second_and_mfu_while_training(runs):
    _, out = runs
    # TODO 42's own line (the monitor's line, "step 5/10 (50%) ...", comes next to it)
    lines = [l for l in out["solution"].splitlines() if re.match(r"epoch 0 step \d+ loss", l)]
    assert len(lines) == 2 and all("tokens/s MFU" in l for l in lines)
    assert "MFU against" in out["solution"] and "float32 matmul on cpu" in out["solution"]


def test_the_profile_is_a_trace_with_the_named_phases_of_a_step(runs):
    tmp, out = runs
    traces = list((tmp / "solution" / "profile").glob("rank0.*.pt.trace.json"))
    assert len(traces) == 1
    names = trace_event_names(traces[0])
    assert PHASES <= names and "aten::mm" in names
    # the window: 1 step skipped, 2 warm-up, 3 recorded (ProfilerStep#N marks each)
    assert {n for n in names if n.startswith("ProfilerStep#")} == {"ProfilerStep#3",
                                                                   "ProfilerStep#4",
                                                                   "ProfilerStep#5"}
    assert "Self CPU time total" in out["solution"]  # the operator table
    # TODO 59 on a CPU: no kernels to compare with, and it says so
    assert "GPU busy: no GPU kernels in the profile (a CPU run, " in out["solution"]


def test_one_process_trains_without_ddp_and_two_ranks_with_it(runs):
    """TODO 63: DDP's hooks and all-reduces in the two-rank trace only."""
    tmp, _ = runs
    [one] = (tmp / "solution" / "profile").glob("rank0.*.pt.trace.json")
    [two] = (tmp / "two" / "profile").glob("rank0.*.pt.trace.json")
    assert "DistributedDataParallel.forward" in trace_event_names(two)
    assert not any("DistributedDataParallel" in (n or "") for n in trace_event_names(one))


def test_gpu_busy_reads_kernel_time_per_step_against_the_step_s_cpu_time():
    """TODO 59 on the self-check's stand-in profiles, whose rows are Kineto's: kernels 6 ms of
    each 10 ms step, counted once (each kernel has its own row on the GPU and is counted again
    in the row of the CPU operator that launched it; the ranges have GPU rows too), and the
    steps of the CPU's ProfilerStep* row; none on a CPU."""
    sys.path.insert(0, str(ROOT))  # the self-check is no package of the course's install
    from selfcheck.probe import _StandInProfiler
    gpu_busy = load_solution().gpu_busy
    assert gpu_busy(_StandInProfiler(6.0)) == pytest.approx((6.0, 10.0))
    assert gpu_busy(_StandInProfiler(0.0)) == pytest.approx((0.0, 10.0))


def kineto_events(kernel_ms: float, steps: int = 4):
    """The events torch's profiler makes of `steps` steps of 10 ms on the CPU with `kernel_ms` of
    kernels each on a GPU, built as torch.autograd.profiler's _parse_kineto_results builds them
    from Kineto's records (same classes, same names, same kernel links): each step a range
    ProfilerStep#N holding the range "forward", which holds ten aten::linear (each running
    aten::mm, which launches a GEMM kernel) and ten aten::add (an elementwise kernel); on the
    GPU the kernels and the two ranges again."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import EventList, FunctionEvent, _rewrite_name
    ids = iter(range(1, 10**6))

    def event(name, start, end, device=DeviceType.CPU, annotation=False):
        return FunctionEvent(
            id=next(ids), name=_rewrite_name(name, with_wildcard=True), thread=1 if
            device == DeviceType.CPU else 7, start_us=start, end_us=end, fwd_thread=1,
            input_shapes=[], stack=[], scope=0, use_device="cuda", cpu_memory_usage=0,
            device_memory_usage=0, is_async=False, sequence_nr=-1, device_type=device,
            trace_name=_rewrite_name(name), is_user_annotation=annotation)

    gpu, events = DeviceType.CUDA, []
    mm_us, add_us = 0.08 * kernel_ms * 1e3, 0.02 * kernel_ms * 1e3  # ten of each per step
    for s in range(steps):
        t = s * 10e3  # µs; the CPU: 6.25 ms in the step itself, 3.75 in forward
        events += [event(f"ProfilerStep#{s + 1}", t, t + 10e3, annotation=True),
                   event("forward", t + 100, t + 3850, annotation=True)]
        g = t + 1e3  # the GPU runs the step's kernels from here, one after another
        for i in range(10):
            c = t + 100 + 250 + 300 * i
            linear, mm = event("aten::linear", c, c + 300), event("aten::mm", c + 50, c + 250)
            add = event("aten::add", t + 350 + 3000 + 50 * i, t + 350 + 3050 + 50 * i)
            gemm = event("ampere_sgemm_128x64_tn", g, g + mm_us, gpu)
            elementwise = event("vectorized_elementwise_kernel", g + mm_us,
                                g + mm_us + add_us, gpu)
            g += mm_us + add_us
            if kernel_ms:  # what Kineto's correlation ids link in _parse_kineto_results
                mm.append_kernel(gemm.name, 0, mm_us)
                add.append_kernel(elementwise.name, 0, add_us)
                events += [gemm, elementwise]
            events += [linear, mm, add]
        if kernel_ms:  # the ranges on the GPU: from their first kernel's start to their last's
            # end (the step's spans the next step's first kernels: 1.5 x, forward 0.75 x)
            events += [event(f"ProfilerStep#{s + 1}", t + 1e3, t + 1e3 + 1.5 * kernel_ms * 1e3,
                             gpu, annotation=True),
                       event("forward", t + 1e3, t + 1e3 + 0.75 * kernel_ms * 1e3, gpu,
                             annotation=True)]
    profile = EventList(events, use_device="cuda")
    profile._build_tree()
    return profile


@pytest.mark.parametrize("kernel_ms", [6.0, 0.0], ids=["gpu", "cpu"])
def test_the_check_s_stand_in_profiler_has_the_rows_torch_makes_of_kineto_s_events(kernel_ms):
    """The self-check judges TODO 59's gpu_busy on a stand-in profiler (selfcheck/probe.py):
    its rows must be the ones torch's own key_averages() makes of such a profile."""
    sys.path.insert(0, str(ROOT))
    from selfcheck.probe import _StandInProfiler

    def rows(averages):
        return {(e.key, str(e.device_type), bool(e.is_user_annotation)):
                (e.count, *(round(getattr(e, f) / 1e3, 6) for f in
                            ("cpu_time_total", "self_cpu_time_total",
                             "self_device_time_total", "device_time_total")))
                for e in averages}
    assert rows(_StandInProfiler(kernel_ms).key_averages()) == rows(
        kineto_events(kernel_ms).key_averages())


@pytest.mark.parametrize("kernel_ms", [6.0, 0.0], ids=["gpu", "cpu"])
def test_gpu_busy_gives_torch_s_self_cuda_time_total_per_step(kernel_ms):
    """TODO 59's solution reads, per step, the kernel time the profile table's last line
    ("Self CUDA time total") gives, and the CPU's step time."""
    profile = kineto_events(kernel_ms)
    table = profile.key_averages().table(sort_by="self_cpu_time_total")
    total = re.search(r"Self CUDA time total: ([\d.]+)(ms|us)", table)
    total_ms = float(total.group(1)) / (1e3 if total.group(2) == "us" else 1) if total else 0

    class Stopped:  # what gpu_busy is given: a stopped torch.profiler.profile
        key_averages = profile.key_averages
    kernels_ms, step_ms = load_solution().gpu_busy(Stopped())
    assert kernels_ms == pytest.approx(total_ms / 4) == pytest.approx(kernel_ms)
    assert step_ms == pytest.approx(10.0)


def test_gpu_busy_finds_the_steps_of_a_real_profile_as_torch_groups_them():
    """On a real (CPU) profile: key_averages() groups the recorded steps into one row,
    "ProfilerStep*" (the trace names them ProfilerStep#N): gpu_busy must find it. (On the H200
    a version that looked for "ProfilerStep#" found no step and said "no GPU" on a GPU.)"""
    from torch.profiler import ProfilerActivity, profile, schedule
    gpu_busy = load_solution().gpu_busy
    layer = torch.nn.Linear(32, 32)
    prof = profile(activities=[ProfilerActivity.CPU],
                   schedule=schedule(wait=1, warmup=1, active=2, repeat=1))
    prof.start()
    for _ in range(4):
        layer(torch.randn(8, 32)).sum().backward()
        prof.step()
    prof.stop()
    kernels_ms, step_ms = gpu_busy(prof)
    assert kernels_ms == 0 and step_ms > 0


def test_the_vocabulary_is_padded_up_to_the_next_multiple():
    padded_vocab = load_solution().padded_vocab
    assert [padded_vocab(v, 64) for v in (33278, 13777, 502, 512, 1)] == [33280, 13824, 512,
                                                                           512, 64]
    assert padded_vocab(33278, 1) == 33278


def test_every_rank_writes_its_own_trace(runs):
    tmp, _ = runs
    for rank in (0, 1):
        [trace] = (tmp / "two" / "profile").glob(f"rank{rank}.*.pt.trace.json")
        assert PHASES <= trace_event_names(trace)


def test_the_collectives_lesson_finds_ddps_all_reduces_in_the_trace_one_per_bucket(runs):
    """train/collectives.py (TODOs 53 and 54) on the two-rank trace: gloo's all-reduces per
    profiled step are DDP's buckets, as ddp_bucket_bytes forms them, and the loss's one."""
    from conftest import load_script
    from model import TransformerLM
    from model.transformer import ModelConfig
    tmp, _ = runs
    lesson = load_script("solutions/train/collectives.py")
    [trace] = (tmp / "two" / "profile").glob("rank0.*.pt.trace.json")
    events = json.loads(trace.read_text())["traceEvents"]
    steps = sum(e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#")
                for e in events)
    all_reduces = [e for e in events if e.get("name") == "gloo:all_reduce"]
    with torch.device("meta"):
        model = TransformerLM(ModelConfig(**read_summary(tmp / "two")["model_config"]))
    assert steps == 3 and len(all_reduces) == 3 * (len(lesson.ddp_bucket_bytes(model)) + 1)
    seconds = lesson.allreduce_seconds_per_step(json.loads(trace.read_text()))
    assert seconds == pytest.approx(sum(e["dur"] for e in all_reduces) / 1e6 / 3) and seconds > 0


@pytest.mark.parametrize("steps, window", [(100, (1, 2, 3)), (6, (1, 2, 3)), (5, (0, 1, 4)),
                                           (2, (0, 1, 1)), (1, None), (0, None)])
def test_the_profiling_window_fits_into_the_steps_of_the_run(steps, window):
    assert load_solution().profiler_window(steps) == window


def test_a_short_run_still_writes_a_trace_and_a_one_step_run_says_why_it_has_none(tmp_path,
                                                                                  data_cache):
    env = script_env(cache_dir=data_cache)
    run_script(SOLUTION, *COMMON, "--max-steps", 3, "--profile", "--out-dir", tmp_path / "three",
               env=env)
    assert list((tmp_path / "three" / "profile").glob("rank0.*.pt.trace.json"))
    proc = run_script(SOLUTION, *COMMON, "--max-steps", 1, "--profile", "--out-dir",
                      tmp_path / "one", env=env)
    assert "too few to profile" in proc.stdout
    assert not (tmp_path / "one" / "profile").exists()
    assert (tmp_path / "one" / "summary.json").is_file()


def test_ranges_go_to_the_profiler_everywhere_and_to_nvtx_only_on_a_gpu(monkeypatch):
    module = load_solution()
    opened = []

    class Range:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            opened.append(self.name)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda.nvtx, "range", Range)
    with torch.profiler.profile() as prof:
        with module.annotate("forward", torch.device("cpu")):
            torch.ones(2) @ torch.ones(2)
    assert opened == []  # no NVTX on a CPU
    assert "forward" in {e.name for e in prof.events()}
    with module.annotate("backward", torch.device("cuda")):
        pass
    assert opened == ["backward"]


def test_bf16_in_the_solution_trains_close_to_fp32_and_reports_its_precision(tmp_path,
                                                                            data_cache):
    env = script_env(cache_dir=data_cache)
    run_script(SOLUTION, *COMMON, "--max-steps", 6, "--precision", "bf16", "--pad-vocab", 1,
               "--out-dir", tmp_path / "bf16", env=env)
    run_script(EXERCISE, *COMMON, "--max-steps", 6, "--precision", "bf16", "--out-dir",
               tmp_path / "exercise", env=env)
    bf16, exercise = read_summary(tmp_path / "bf16"), read_summary(tmp_path / "exercise")
    assert bf16["precision"] == "bf16" and exercise["precision"] == "fp32"  # before TODO 45: fp32
    torch.testing.assert_close(bf16["loss_history"], exercise["loss_history"], atol=0.05, rtol=0)


# ---- tools/scaling_report.py -------------------------------------------------------------

@pytest.fixture(scope="module")
def scaling_runs(tmp_path_factory, data_cache):
    """The DDP solution on 1 and on 2 CPU processes, the same global batch, 12 steps."""
    tmp = tmp_path_factory.mktemp("scaling")
    env = script_env(cache_dir=data_cache)
    args = ("--dataset", "synthetic", "--preset", "tiny", "--logger", "none", "--max-steps", 12)
    run_script("solutions/train/to_distributed_training.py", *args, "--batch-size", 16,
               "--out-dir", tmp / "one", env=env)
    run_script("solutions/train/to_distributed_training.py", *args, "--batch-size", 8,
               "--out-dir", tmp / "two", nproc=2, env=env, timeout=180)
    return tmp


def report(*args):
    import subprocess
    import sys
    return subprocess.run([sys.executable, "tools/scaling_report.py", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_the_scaling_report_compares_world_sizes_against_the_smallest_and_draws_a_png(
        scaling_runs, tmp_path):
    one, two = read_summary(scaling_runs / "one"), read_summary(scaling_runs / "two")
    png = tmp_path / "plots" / "scaling.png"
    proc = report(scaling_runs / "two" / "summary.json", scaling_runs / "one" / "summary.json",
                  "-o", png)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()[1:3]]
    assert [row[0] for row in rows] == ["1", "2"]  # sorted by world size, whatever the order given
    speedup = two["tokens_per_s"] / one["tokens_per_s"]
    assert rows[1][2] == f"{speedup:.2f}x" and rows[1][3] == "2x"
    assert rows[1][4] == f"{speedup / 2:.0%}"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


@pytest.mark.parametrize("change, words", [
    ({"script": "fsdp_training.py"}, "differ in script"),
    ({"preset": "small"}, "differ in preset"),
    ({"precision": "bf16"}, "differ in precision"),
    ({"world_size": 1}, "more than one run at world size 1"),
])
def test_the_scaling_report_refuses_runs_that_do_not_compare(scaling_runs, tmp_path, change,
                                                              words):
    """A DDP run at 1 process against an FSDP run at 2 (or another preset, precision, or two
    runs at one world size) would draw a speed-up that means nothing."""
    import json
    other = read_summary(scaling_runs / "two") | change
    (tmp_path / "summary.json").write_text(json.dumps(other))
    png = tmp_path / "scaling.png"
    proc = report(scaling_runs / "one" / "summary.json", tmp_path / "summary.json", "-o", png)
    assert proc.returncode != 0 and not png.exists()
    [line] = proc.stderr.strip().splitlines()
    assert words in line and "summary.json" in line


def test_the_scaling_report_refuses_a_file_that_is_not_a_summary_and_draws_nothing(
        scaling_runs, tmp_path):
    bad = tmp_path / "notes.json"
    bad.write_text('{"loss": 1}')
    png = tmp_path / "scaling.png"
    proc = report(scaling_runs / "one" / "summary.json", bad, "-o", png)
    assert proc.returncode != 0 and not png.exists()
    [line] = proc.stderr.strip().splitlines()
    assert "notes.json is not a training summary.json" in line


# ---- perf_training.sbatch: Nsight Systems only when asked -------------------------------

def submit_perf_sbatch(tmp_path, sbatch, **env):
    """Run the sbatch file with an srun stand-in that records its command line."""
    import os
    import subprocess
    bin_dir, venv = tmp_path / "bin", tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text("")
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\nprintf "%s\\n" "$@" > "$FAKE_LOG"\n')
    (bin_dir / "srun").chmod(0o755)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NSYS"))}
    full_env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", VENV=str(venv),
                    FAKE_LOG=str(tmp_path / "srun.args"), SLURM_SUBMIT_DIR=str(tmp_path),
                    SLURM_JOB_NAME="perf", SLURM_JOB_ID="7", SLURM_CPUS_PER_TASK="8", **env)
    proc = subprocess.run(["bash", str(ROOT / sbatch), "--max-steps", "50"], cwd=ROOT,
                          env=full_env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return (tmp_path / "srun.args").read_text().splitlines()


def test_the_sbatch_file_runs_the_script_plainly_and_under_nsys_only_with_nsys_1(tmp_path):
    # SCRIPT picks the solution, as for the other sbatch files (the default is train/'s)
    solution = "solutions/train/perf_training.py"
    plain = submit_perf_sbatch(tmp_path / "a", "solutions/perf_training.sbatch", SCRIPT=solution)
    assert "nsys" not in plain
    script = plain.index(solution)
    assert plain[script - 2:script] == ["python", "-u"] and plain[-2:] == ["--max-steps", "50"]
    traced = submit_perf_sbatch(tmp_path / "b", "solutions/perf_training.sbatch", NSYS="1",
                                SCRIPT=solution)
    out_dir = tmp_path / "b" / "runs" / "perf-7"
    start = traced.index("nsys")
    assert traced[start:start + 6] == ["nsys", "profile", "-t", "cuda,nvtx,nccl", "-o",
                                       str(out_dir / "nsys")]
    assert traced.index("python") > start
    exercise = submit_perf_sbatch(tmp_path / "c", "perf_training.sbatch", NSYS="1")
    assert "nsys" not in exercise and "train/perf_training.py" in exercise  # before its TODO


def test_on_amd_gpus_rocprof_1_runs_the_script_under_rocprofv3_into_the_job_s_folder(tmp_path):
    solution = "solutions/train/perf_training.py"
    traced = submit_perf_sbatch(tmp_path, "solutions/perf_training.sbatch", ROCPROF="1",
                                SCRIPT=solution)
    start = traced.index("rocprofv3")
    options = traced[start + 1:traced.index("--")]
    # the kernels, HIP calls, the script's ranges (ROCTX), RCCL and copies; a Perfetto trace
    assert {"--kernel-trace", "--hip-trace", "--marker-trace", "--rccl-trace"} <= set(options)
    assert options[options.index("-d") + 1] == str(tmp_path / "runs" / "perf-7" / "rocprof")
    assert options[options.index("--output-format") + 1] == "pftrace"
    assert traced[traced.index("--") + 1:traced.index("--") + 3] == ["python", "-u"]
    assert "nsys" not in traced


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_last_setting_compiles_once_falls_back_without_cuda_graphs_and_tracks_fp32(
        tmp_path, data_cache):
    """The step's last setting on a CPU: the blocks and the loss compiled in reduce-overhead
    mode (no CUDA graphs on a CPU: torch.compile goes on without them), bf16, the padded
    vocabulary, no DDP. It compiles its two graphs at the first step and nothing while
    training after it, and trains like plain fp32 within bf16's tolerance."""
    compiles = tmp_path / "compiles.json"
    env = script_env(cache_dir=data_cache, COMPILES_FILE=compiles)
    run_script(SOLUTION, *COMMON, "--max-steps", 4, "--precision", "fp32", "--out-dir",
               tmp_path / "fp32", env=env)
    run_script("tests/record_compiles.py", SOLUTION, *COMMON, "--max-steps", 8,
               "--precision", "bf16", "--compile", "--compile-mode", "reduce-overhead",
               "--out-dir", tmp_path / "last", env=env, timeout=800)
    fp32, last = read_summary(tmp_path / "fp32"), read_summary(tmp_path / "last")
    assert last["precision"] == "bf16" and last["model_config"]["vocab_size"] % 64 == 0
    torch.testing.assert_close(last["loss_history"][:4], fp32["loss_history"], atol=0.05, rtol=0)
    after_step = json.loads(compiles.read_text())["after_step"]
    assert len(after_step) == 8 and set(after_step) == {after_step[0]} and after_step[0] >= 2
