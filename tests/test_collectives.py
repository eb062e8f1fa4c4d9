"""benchmarks/collectives.py measures what nccl-tests measures, with its definitions, and finds
no wrong element; the collectives lesson (train/collectives.py) predicts DDP's buckets exactly.

The benchmark runs with 2 and with 3 processes: the bus-bandwidth factors differ (2(n-1)/n is
1 and 4/3), and with 3 the split data is rounded to a multiple of the ranks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT, load_script, run_script, script_env

pytestmark = pytest.mark.warm_start  # runs forked warm: tests/warm_launch.py

BENCH = "benchmarks/collectives.py"
OPS = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "sendrecv"}
SMALL = ("--min-bytes", "1K", "--max-bytes", "8K", "--iters", 2, "--warmup", 1)


def factor(collective: str, n: int) -> float:
    """nccl-tests' doc/PERFORMANCE.md, written out again on purpose (not imported)."""
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n,
            "reduce_scatter": (n - 1) / n, "all_to_all": (n - 1) / n, "broadcast": 1.0,
            "sendrecv": 1.0}[collective]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The benchmark on 2 and on 3 processes, each with --json; the 3-process one with --plot."""
    tmp = tmp_path_factory.mktemp("collectives")
    out = {}
    for n in (2, 3):
        extra = ("--plot", tmp / "three.png") if n == 3 else ()
        proc = run_script(BENCH, *SMALL, "--json", tmp / f"{n}.json", *extra, nproc=n,
                          timeout=180)
        out[n] = (json.loads((tmp / f"{n}.json").read_text()), proc.stdout)
    return tmp, out


def test_the_bus_bandwidth_factors_are_nccl_tests_definitions():
    bench = load_script(BENCH)
    for n in (2, 3, 8):
        for op in OPS:
            assert bench.bus_factor(op, n) == pytest.approx(factor(op, n))
    assert bench.bus_factor("all_reduce", 4) == 1.5 and bench.bus_factor("all_gather", 4) == 0.75


@pytest.mark.parametrize("n", [2, 3])
def test_every_operation_at_every_size_is_correct_and_its_bandwidths_follow_the_definitions(
        runs, n):
    _, out = runs
    results, _ = out[n]
    records = results["records"]
    assert results["meta"]["world_size"] == n and results["meta"]["backend"] == "gloo"
    assert {r["collective"] for r in records} == OPS
    for op in OPS:  # 1K, 2K, 4K, 8K
        assert [r["nominal_bytes"] for r in records if r["collective"] == op] == [
            1024, 2048, 4096, 8192]
    for r in records:
        assert r["wrong"] == 0, r
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * factor(r["collective"], n))
        if r["collective"] in ("all_gather", "reduce_scatter", "all_to_all"):
            assert r["count"] % n == 0 and r["bytes"] <= r["nominal_bytes"]
        else:
            assert r["bytes"] == r["nominal_bytes"]
        assert r["count"] * 4 == r["bytes"]  # float32


def test_the_table_has_the_nccl_tests_columns_and_rank_0_alone_prints_it(runs):
    _, out = runs
    _, stdout = out[3]
    assert stdout.count("# all_reduce: 3 ranks on 1 node(s), gloo on cpu, float32") == 1
    assert "busbw = algbw x 1.333" in stdout and "busbw = algbw x 0.6667" in stdout
    assert stdout.count("#wrong") == len(OPS)
    rows = [l.split() for l in stdout.splitlines() if l.strip() and l.strip()[0].isdigit()]
    assert len(rows) == 4 * len(OPS) and all(row[-1] == "0" for row in rows)
    assert "# 24 measurements, 0 wrong element(s)" in stdout


def test_a_plot_of_one_run_and_a_comparison_of_two(runs):
    tmp, _ = runs
    assert (tmp / "three.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    proc = subprocess.run([sys.executable, BENCH, "--compare", tmp / "2.json", tmp / "3.json",
                           "--plot", tmp / "compare.png"], cwd=ROOT, env=script_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "A = 1 node x 2 (gloo, cpu); B = 1 node x 3 (gloo, cpu)" in proc.stdout
    # every collective at every size asked for, also where 3 ranks rounded the bytes down
    assert sum(l.split()[0] in ("1024", "2048", "4096", "8192")
               for l in proc.stdout.splitlines() if l.strip()) == 4 * len(OPS)
    assert (tmp / "compare.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args, message", [
    (("--ops", "all_reduce,gossip"), "unknown operation 'gossip'"),
    (("--max-bytes", "12Q"), "'12Q' is not a size"),
    (("--dtype", "float8"), "'float8' is not one of"),
    (("--compare", "nowhere.json"), "cannot read nowhere.json"),
])
def test_a_bad_flag_or_file_is_one_line_that_says_what_to_give(args, message):
    proc = subprocess.run([sys.executable, BENCH, *args], cwd=ROOT, env=script_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_the_lesson_forms_ddps_buckets_as_ddp_does(tmp_path):
    """ddp_bucket_bytes against the buckets DDP's comm hook receives after its first step (when
    its Reducer rebuilds them in the order the gradients came): the same sizes, a big output
    layer alone in its bucket."""
    probe = tmp_path / "buckets.py"
    probe.write_text(f"""
import importlib.util, json, sys, torch, torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from model import TransformerLM, get_config
spec = importlib.util.spec_from_file_location("lesson", "{ROOT / 'solutions/train/collectives.py'}")
lesson = importlib.util.module_from_spec(spec); spec.loader.exec_module(lesson)
dist.init_process_group("gloo")
found = {{}}
for preset, vocab in (("tiny", 33278), ("small", 3000)):
    model = TransformerLM(get_config(preset, vocab_size=vocab))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    seen = []
    def hook(state, bucket):  # DDP checks these names
        seen.append(bucket.buffer().numel() * bucket.buffer().element_size())
        return allreduce_hook(None, bucket)
    ddp.register_comm_hook(None, hook)
    for _ in range(2):
        seen.clear()
        ddp(torch.randint(vocab, (1, 8))).sum().backward()
    found[preset] = [seen, lesson.ddp_bucket_bytes(model)]
    del ddp  # free the reducer while the group exists (at exit it aborted now and then)
if dist.get_rank() == 0:
    print(json.dumps(found))
import gc; gc.collect()  # every reducer freed, then every rank done, before leaving the group
dist.barrier()
dist.destroy_process_group()
""")
    proc = run_script(str(probe), nproc=2, timeout=180)
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    for preset, (ddp, lesson) in found.items():
        assert ddp == lesson, preset
    assert len(found["tiny"][0]) == 2 and len(found["small"][0]) == 2


def test_the_lesson_in_one_process_says_that_a_ring_needs_two_ranks(tmp_path):
    proc = run_script("solutions/train/collectives.py", "--preset", "tiny", "--dataset",
                      "synthetic", "--out-dir", tmp_path, check=False, timeout=120,
                      env=script_env(cache_dir=tmp_path / "cache"))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: a ring needs 2 or more ranks: torchrun --standalone --nproc_per_node=3 "
        "train/collectives.py ...")


def test_the_lesson_leaves_the_folder_of_another_run_alone_with_one_line(tmp_path):
    """--out-dir runs/perf (the folder meant for --trace): the lesson would replace the profiled
    run's summary.json; it stops with one line instead, and the folder is as it was. The job
    file's training flags (--batch-size) are accepted on the way."""
    perf = tmp_path / "perf"
    (perf / "checkpoints").mkdir(parents=True)
    (perf / "checkpoints" / "step_10").write_text("a checkpoint")
    (perf / "summary.json").write_text(json.dumps({"world_size": 2, "tokens_per_s": 1e4}))
    before = {p: p.read_bytes() for p in perf.rglob("*") if p.is_file()}
    proc = run_script("solutions/train/collectives.py", "--preset", "tiny", "--dataset",
                      "synthetic", "--batch-size", 8, "--out-dir", perf, nproc=2, check=False,
                      timeout=180, env=script_env(cache_dir=tmp_path / "cache"))
    # (torchrun's own report of the failure has a traceback of torchrun; the ranks have none)
    assert proc.returncode != 0 and 'collectives.py", line' not in proc.stderr, proc.stderr
    assert proc.stderr.count(f"error: --out-dir {perf} holds the results of another run "
                             "(checkpoints/, summary.json): choose another --out-dir for the "
                             "lesson (a profiled run's folder goes after --trace), or replace "
                             "its summary.json with --overwrite") >= 1, proc.stderr
    assert {p: p.read_bytes() for p in perf.rglob("*") if p.is_file()} == before


def test_the_lesson_s_help_lists_only_the_flags_it_reads():
    """The lesson trains nothing: --help leaves out the training flags it accepts (a job file
    hands the same arguments to the profiled run and to the lesson)."""
    proc = subprocess.run([sys.executable, "solutions/train/collectives.py", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=True)
    options = proc.stdout.split("\noptions:")[1]  # (the docstring above shows other commands)
    for flag in ("--preset", "--data-dir", "--out-dir", "--trace", "--max-bytes", "--seed"):
        assert flag in options, flag
    for flag in ("--epochs", "--max-steps", "--batch-size", "--lr", "--precision", "--compile",
                 "--logger", "--log-every", "--dropout", "--num-workers", "checkpoints"):
        assert flag not in options, flag


def test_the_lesson_says_when_the_trace_is_of_another_run_than_its_prediction(tmp_path):
    """--trace of a run on other ranks and another vocabulary: one line says so and what to run
    alike, before the comparison (which is then of two different runs)."""
    perf = tmp_path / "perf"
    (perf / "profile").mkdir(parents=True)
    (perf / "summary.json").write_text(json.dumps({
        "world_size": 3, "data_vocab_size": 33278,
        "model_config": {"vocab_size": 33280, "d_model": 64, "n_heads": 4, "n_layers": 2,
                         "d_ff": 256, "max_seq_len": 32, "dropout": 0.1}}))
    events = [{"ph": "X", "name": "ProfilerStep#1", "cat": "user_annotation", "dur": 9000},
              {"ph": "X", "name": "gloo:all_reduce", "cat": "user_annotation", "dur": 3000}]
    (perf / "profile" / "rank0.1.pt.trace.json").write_text(json.dumps({"traceEvents": events}))
    proc = run_script("solutions/train/collectives.py", "--preset", "tiny", "--dataset",
                      "synthetic", "--max-bytes", "4K", "--iters", 1, "--warmup", 1,
                      "--trace", perf, "--out-dir", tmp_path / "out", nproc=2, timeout=180,
                      env=script_env(cache_dir=tmp_path / "cache"))
    vocab = json.loads((tmp_path / "out" / "summary.json").read_text())["model_config"][
        "vocab_size"]
    assert (f"WARNING: the trace is from 3 ranks and a model of 33278 words, this run has 2 "
            f"ranks and {vocab} words: the prediction is for another run; run with the same "
            "--nproc_per_node and --data-dir as the profiled run") in proc.stdout, proc.stdout
    assert "3.00 ms of all-reduce per step" in proc.stdout
    # the same run's shape: nothing to say
    summary = json.loads((perf / "summary.json").read_text())
    summary.update(world_size=2, data_vocab_size=vocab)
    (perf / "summary.json").write_text(json.dumps(summary))
    proc = run_script("solutions/train/collectives.py", "--preset", "tiny", "--dataset",
                      "synthetic", "--max-bytes", "4K", "--iters", 1, "--warmup", 1,
                      "--trace", perf, "--out-dir", tmp_path / "out", nproc=2, timeout=180,
                      env=script_env(cache_dir=tmp_path / "cache"))
    assert "the trace is from" not in proc.stdout and "ms of all-reduce per step" in proc.stdout
