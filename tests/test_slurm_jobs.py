"""The sbatch files, unchanged, on a real Slurm cluster: two nodes with their own hostnames and
InfiniBand-style names, four (fake) GPUs each, started on this machine by tests/slurm/cluster.sh.

    .venv/bin/python -m pytest -m slurm tests/test_slurm_jobs.py --durations=0   # as root

Without root (or network namespaces) these tests skip, except in CI (CI=true), where they fail.
See docs/slurm-ci.md. Every training process runs on the CPU with gloo.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "slurm"))
from slurm_cluster import (FINAL_STATES, Cluster, ClusterUnavailable, Job,  # noqa: E402
                           python_errors)

# A job may wait in the queue for another session's jobs (see Cluster.pending_limit).
pytestmark = [pytest.mark.slurm, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[1]
IN_CI = os.environ.get("CI", "").lower() in ("true", "1", "yes")
PROCS_PER_NODE = 2  # NPROC_PER_NODE: CPU processes per node instead of one per GPU
# A short real run: the smallest model, a few steps on the small WikiText-2 folder.
SHORT_RUN = ("--preset", "tiny", "--max-steps", "5", "--log-every", "1")


@dataclass(frozen=True)
class SbatchCase:
    """One sbatch file as a participant submits it: `sbatch --nodes=N FILE ARGS`."""
    sbatch: str
    nodes: int
    world_size: int               # training processes expected in the job
    extra_args: tuple = ()        # more training arguments after SHORT_RUN
    procs_per_node: int = PROCS_PER_NODE

    def __str__(self):
        return f"{self.sbatch}-{self.nodes}node"


# One line per sbatch file and node count. A file not in the checkout yet is skipped.
CASES = [
    # the exercise as shipped: one process (no torchrun)
    SbatchCase("to_distributed_training.sbatch", nodes=1, world_size=1),
    # the finished DDP step: torchrun on every node, PROCS_PER_NODE processes each
    SbatchCase("solutions/to_distributed_training.sbatch", nodes=1, world_size=2),
    SbatchCase("solutions/to_distributed_training.sbatch", nodes=2, world_size=4),
    SbatchCase("solutions/fsdp_training.sbatch", nodes=2, world_size=4),
    SbatchCase("solutions/tp_training.sbatch", nodes=2, world_size=4),
    # Lightning: srun starts NPROC_PER_NODE tasks per node, no torchrun
    SbatchCase("solutions/Lit_training.sbatch", nodes=2, world_size=4),
    # one stage per rank, and the tiny model has 2 layers: one process per node
    SbatchCase("solutions/pp_training.sbatch", nodes=2, world_size=2, procs_per_node=1),
    # the performance step: one process on one GPU (here the CPU: --precision auto is fp32)
    SbatchCase("solutions/perf_training.sbatch", nodes=1, world_size=1),
    SbatchCase("solutions/nd_training.sbatch", nodes=2, world_size=4),
    # the memory step: one node
    SbatchCase("solutions/memory_training.sbatch", nodes=1, world_size=2),
]


# ------------------------------------------------------------------------------------ fixtures
def _load_summary_plugin(config):
    spec = importlib.util.spec_from_file_location("tests_slurm_plugin",
                                                  ROOT / "tests" / "slurm" / "plugin.py")
    if not any(getattr(p, "__file__", None) == spec.origin
               for p in config.pluginmanager.get_plugins()):
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        config.pluginmanager.register(module, "slurm-summary")


@pytest.fixture(scope="session", autouse=True)
def _slurm_summary_line(request):
    """Print 'Slurm cluster tests: N ran ...' at the end of the session."""
    _load_summary_plugin(request.config)


@pytest.fixture(scope="session")
def slurm() -> Cluster:
    """One cluster for the session: started on first use, torn down at the end (by PID)."""
    try:
        cluster, why_not = Cluster.start(), None
    except ClusterUnavailable as e:
        cluster, why_not = None, str(e)
    if why_not and IN_CI:
        pytest.fail(f"CI=true but no Slurm test cluster: {why_not}", pytrace=False)
    if why_not:
        pytest.skip(f"Slurm tests: {why_not}")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def text_dir(wikitext2_dir, tmp_path_factory) -> Path:
    """The first lines of each WikiText-2 split: real text, small enough that evaluating the
    whole validation and test split takes a moment (these tests check the plumbing, not the
    model)."""
    folder = tmp_path_factory.mktemp("wikitext-2-slice")
    for split, lines in (("train", 1000), ("valid", 150), ("test", 150)):
        with open(wikitext2_dir / f"{split}.txt") as f:
            (folder / f"{split}.txt").write_text("".join(f.readline() for _ in range(lines)))
    return folder


@pytest.fixture(scope="session")
def job_env(data_cache) -> dict:
    """Knobs the sbatch files read from the submitter's environment."""
    return {"NPROC_PER_NODE": PROCS_PER_NODE, "COURSE_DATA_CACHE": data_cache}


def train(slurm: Cluster, case: SbatchCase, out_dir: Path, data_dir: Path, job_env: dict,
          *more_args, deadline: float = 150) -> Job:
    args = (*SHORT_RUN, "--data-dir", data_dir, "--out-dir", out_dir, *case.extra_args,
            *more_args)
    # the sbatch files run train/X.py unless SCRIPT says otherwise: solutions/ runs its solution
    script = ({"SCRIPT": f"solutions/train/{Path(case.sbatch).stem}.py"}
              if case.sbatch.startswith("solutions/") else {})
    return slurm.sbatch(case.sbatch, *args, nodes=case.nodes, output=out_dir / "job.out",
                        env={**job_env, "OUT_DIR": out_dir, "NPROC_PER_NODE": case.procs_per_node,
                             **script},
                        deadline=deadline)


# ------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("case", CASES, ids=str)
def test_sbatch_file_trains_on_every_node_with_the_expected_ranks(slurm, case, tmp_path,
                                                                   text_dir, job_env):
    if not (ROOT / case.sbatch).is_file():
        pytest.skip(f"{case.sbatch} is not in this checkout yet")
    out = tmp_path / "run"
    job = train(slurm, case, out, text_dir, job_env)
    assert job.completed, job.describe()
    log, why = job.log, job.describe()
    nodes = slurm.hostnames(job.node_list)
    assert len(nodes) == case.nodes, why

    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == case.world_size, why
    assert summary["steps"] == 5 and len(summary["loss_history"]) == 5, why
    assert all(key in summary for key in ("val_loss", "test_loss")), why

    # Rank 0 alone prints the training log (print0): each line once, not once per rank.
    for line_start in ("data: ", "epoch 0 step 5/5 (100%) loss", "test loss "):
        assert sum(l.startswith(line_start) for l in log.splitlines()) == 1, \
            f"expected one line starting {line_start!r}\n{why}"

    # The test cluster's GPUs are stand-ins that torch cannot use, as with a CPU-only torch on
    # a real GPU node: the solutions (setup(), Lightning) say so once, from rank 0.
    unused = [l for l in log.splitlines() if l.startswith("WARNING: Slurm gave this job GPUs")]
    if slurm.local and case.sbatch.startswith("solutions/"):
        assert len(unused) == 1 and "training on the CPU" in unused[0], why

    setups = job.setup_lines()
    if case.world_size == 1:
        assert setups == [], why  # a single process joins no group and says nothing
        return
    # Every process reported in, with its own rank, on the nodes of the job.
    assert len(setups) == case.world_size, why
    assert sorted(int(s["rank"]) for s in setups) == list(range(case.world_size)), why
    assert {s["world_size"] for s in setups} == {str(case.world_size)}, why
    assert {s["host"] for s in setups} == set(nodes), why
    for node in nodes:
        local_ranks = sorted(int(s["local_rank"]) for s in setups if s["host"] == node)
        assert local_ranks == list(range(case.world_size // case.nodes)), why
    if slurm.local:  # no CUDA here: every rank must have fallen back to the CPU and gloo
        assert {(s["device"], s["backend"]) for s in setups} == {("cpu", "gloo")}, why

    # The rendezvous: the sbatch file picked node 0's InfiniBand address, once.
    master = job.master_line()
    assert master is not None and master["count"] == 1, why
    if slurm.local:
        assert master["addr"] == slurm.addresses()[nodes[0] + "i"], why
    # The processes agree on one master, and it is node 0 (torchrun hands its workers the
    # hostname of the rendezvous host, not the address it was given).
    assert len({(s["master_addr"], s["master_port"]) for s in setups}) == 1, why
    assert names_node(setups[0]["master_addr"], nodes[0], master["addr"]), why


def names_node(name: str, node: str, address: str) -> bool:
    """`name` is `node`, its i-name (maybe with a domain) or its address."""
    return name == address or name.split(".")[0] in (node, node + "i")


def test_a_bad_training_argument_fails_the_job_with_the_python_error(slurm, tmp_path,
                                                                     text_dir, job_env):
    case = SbatchCase("solutions/to_distributed_training.sbatch", nodes=1, world_size=2)
    job = train(slurm, case, tmp_path, text_dir, job_env, "--preset", "no-such-preset",
                deadline=90)
    assert job.state == "FAILED", job.describe()
    report = job.describe()
    assert "invalid choice: 'no-such-preset'" in report.split("--- job log")[0], report
    assert not (tmp_path / "summary.json").exists()


def test_the_gpu_suite_job_on_a_node_without_a_usable_gpu_stops_at_once_with_one_line(
        slurm, tmp_path):
    # The test cluster's nodes have GPU devices that torch cannot use, as on a node whose
    # driver is too old for torch's CUDA: the GPU tests would all be skipped, and the job look
    # fine. It must fail instead, before any test runs.
    job = slurm.sbatch("gpu_tests.sbatch", nodes=1, output=tmp_path / "job.out", deadline=90)
    assert job.state == "FAILED", job.describe()
    assert "error: no usable GPU: ask for one with --gres=gpu:N, and use a CUDA build" in job.log
    assert "0 GPU(s) visible" in job.log and "passed" not in job.log, job.describe()


# ------------------------------------------------------------------------ the harness itself
def test_a_two_node_job_sees_both_hostnames_gpus_and_infiniband_names(slurm, tmp_path):
    script = tmp_path / "probe.sbatch"
    script.write_text("""#!/bin/bash
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:4
#SBATCH --cpus-per-task=32
set -euo pipefail
echo "hostnames: $(scontrol show hostnames "$SLURM_JOB_NODELIST" | tr '\\n' ' ')"
srun bash -c 'for n in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
  echo "on $(hostname) node $SLURM_NODEID gpus $CUDA_VISIBLE_DEVICES: ${n}i is" \\
       "$(nslookup "${n}i" | awk "/^Address: / {print \\$2}")"; done'
""")
    job = slurm.sbatch(script, nodes=2, output=tmp_path / "probe.out", cwd=tmp_path, deadline=60)
    assert job.completed, job.describe()
    names = job.log.split("hostnames: ")[1].split("\n")[0].split()
    assert len(names) == 2 and names == slurm.hostnames(job.node_list), job.describe()
    lines = [l for l in job.log.splitlines() if l.startswith("on ")]
    assert len(lines) == 4, job.describe()  # each node resolves both i-names
    hosts = set()
    for line in lines:
        words = line.split()  # on HOST node ID gpus DEVS: NAMEi is ADDR
        hosts.add(words[1])
        assert words[5] == "0,1,2,3:", job.describe()
        if slurm.local:
            assert words[8] == slurm.addresses()[words[6]], job.describe()
    assert hosts == set(names), job.describe()


def test_a_job_that_outlives_its_deadline_is_cancelled_and_reported(slurm, tmp_path):
    script = tmp_path / "hang.sbatch"
    script.write_text("#!/bin/bash\necho started; sleep 600\n")
    job = slurm.sbatch(script, output=tmp_path / "hang.out", cwd=tmp_path, deadline=3)
    assert job.cancelled and job.state == "CANCELLED", job.describe()
    assert "did not finish within its deadline of 3 s" in job.describe()
    assert "started" in job.describe()


def test_python_errors_finds_argparse_messages_and_exceptions():
    log = ("Traceback (most recent call last):\n  File \"torchrun\", line 8\n"
           "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
           "usage: x.py [-h]\nx.py: error: argument --preset: invalid choice: 'zz'\n"
           "Traceback (most recent call last):\n  File \"x.py\", line 1\n    boom()\n"
           "ValueError: bad value\n[rank1]: x.py: error: argument --preset: invalid choice: 'zz'\n")
    assert python_errors(log) == [
        "x.py: error: argument --preset: invalid choice: 'zz'", "ValueError: bad value",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:"]
    assert python_errors("/v/bin/python: can't open file '/r/t.py': [Errno 2] No such file") \
        == ["/v/bin/python: can't open file '/r/t.py': [Errno 2] No such file"]


# ------------------------------------------------------------- Lightning: requeue at the time limit
def test_lightning_requeues_itself_at_a_real_time_limit_and_the_requeued_job_finishes(
        slurm, tmp_path, text_dir, job_env):
    """Lit_training.sbatch on 2 nodes (one process each) with a 2-minute limit and SIGUSR1 50 s
    before it. slurmctld checks time limits every 30 s and may send the signal up to 30 s early,
    so it comes 40-70 s after the start (earlier, before the script has set its handler, it
    would kill the processes). The script saves OUT_DIR/hpc_ckpt_N.ckpt on every rank at the end
    of a step and runs `scontrol requeue`; the job starts again with the same id and OUT_DIR
    and Lightning resumes from that checkpoint. (Lightning's own auto_requeue hung here with
    two processes: see RequeueAtTimeLimit in train/Lit_training.py.)
    Two interventions keep the test short and deterministic, both only on the requeued job
    while it waits: Slurm holds a requeued job for 120 s (Reason=BeginTime), lifted with
    StartTime=now, and its limit is raised to 4 minutes so that it is not signalled again; its
    --max-steps is the interrupted step + 5 (read by the copy of the sbatch file below)."""
    if not (ROOT / "solutions/Lit_training.sbatch").is_file():
        pytest.skip("solutions/Lit_training.sbatch is not in this checkout yet")
    import time
    import torch
    out = tmp_path / "run"
    out.mkdir()
    # The sbatch file as shipped, plus one line: training arguments the test adds later.
    text = (ROOT / "solutions/Lit_training.sbatch").read_text()
    args_line = 'ARGS=(--dataset wikitext-2 --preset workshop --out-dir "$OUT_DIR" "$@")\n'
    assert args_line in text
    variant = tmp_path / "Lit_training.sbatch"
    variant.write_text(text.replace(args_line, args_line + (
        'if [ -f "$OUT_DIR/more_args" ]; then ARGS+=($(cat "$OUT_DIR/more_args")); fi\n')))
    job_id = slurm.submit(
        variant, "--preset", "tiny", "--log-every", "1", "--data-dir", text_dir,
        "--out-dir", out, "--max-steps", "100000000", "--epochs", "100000",  # until signalled
        output=out / "job.out",
        sbatch_options=["--nodes=2", "--time=2", "--signal=SIGUSR1@50"],
        env={**job_env, "OUT_DIR": out, "NPROC_PER_NODE": 1})

    # The first run: wait for the requeue (the job waits again, with one restart).
    deadline = time.monotonic() + 150
    while True:
        fields = slurm.job_fields(job_id) or {}
        if fields.get("JobState") == "PENDING" and fields.get("Restarts") == "1":
            break
        if fields.get("JobState") in FINAL_STATES or time.monotonic() > deadline:
            slurm.run("scancel", job_id, check=False)
            log = (out / "job.out").read_text(errors="replace")
            pytest.fail(f"job {job_id} was not requeued: {fields.get('JobState')} "
                        f"(Reason={fields.get('Reason')})\n{log[-4000:]}")
        time.sleep(1)
    saved = sorted(out.glob("hpc_ckpt_*.ckpt"), key=lambda p: int(p.stem.split("_")[-1]))
    assert saved, f"no hpc_ckpt_N.ckpt in {out}"
    interrupted_at = torch.load(saved[-1], weights_only=True, map_location="cpu")["global_step"]
    assert interrupted_at > 0
    (out / "more_args").write_text(f"--max-steps {interrupted_at + 5}\n")
    slurm.run("scontrol", "update", f"JobId={job_id}", "StartTime=now", "TimeLimit=4")

    # The requeued run resumes and finishes.
    fields, cancelled = slurm.wait(job_id, deadline=150)
    job = Job(id=job_id, command=f"sbatch {variant}", output=out / "job.out",
              state=fields.get("JobState", "UNKNOWN"), exit_code=fields.get("ExitCode", ""),
              reason=fields.get("Reason", ""), node_list=fields.get("NodeList", ""),
              cancelled=cancelled, fields=fields, daemon_log=slurm.daemon_lines(job_id))
    assert job.completed and fields.get("Restarts") == "1", job.describe()
    log = job.log
    assert "restart count 0" in log and "restart count 1" in log, job.describe()
    assert (f"SIGUSR1 before the time limit: saved {saved[-1]} at step {interrupted_at}, "
            f"requeueing job {job_id}") in log, job.describe()
    assert len(job.setup_lines()) == 4, job.describe()  # 2 processes, each run
    assert f"Restored all states from the checkpoint at {saved[-1]}" in log, job.describe()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == interrupted_at + 5, job.describe()
    assert len(summary["loss_history"]) == interrupted_at + 5  # the history survived
    assert f"step {interrupted_at + 5}/" in log.split("restart count 1")[1], job.describe()


# ------------------------------------------------------------- FSDP: a requeued job resumes by itself
def test_a_requeued_fsdp_job_continues_from_its_newest_checkpoint_and_says_so(
        slurm, tmp_path, text_dir, job_env):
    """fsdp_training.sbatch on 2 nodes x 2 processes, requeued (`scontrol requeue`, as an admin
    or a node failure would) once it has written a checkpoint. The job starts again with the
    same id, OUT_DIR and SLURM_RESTART_COUNT=1, and the script continues from the newest
    checkpoint without --resume. As in the Lightning test, the requeue hold is lifted and the
    requeued run's --max-steps comes from a file the test writes while it waits.
    The job is submitted with --overwrite into a folder of an earlier run: its first start
    deletes that run's results, the requeued start keeps its own checkpoints."""
    if not (ROOT / "solutions/fsdp_training.sbatch").is_file():
        pytest.skip("solutions/fsdp_training.sbatch is not in this checkout yet")
    import time
    out = tmp_path / "run"
    out.mkdir()
    (out / "hpc_ckpt_1.ckpt").write_text("an earlier run's result (FSDP writes none such)")
    text = (ROOT / "solutions/fsdp_training.sbatch").read_text()
    args_line = 'ARGS=(--dataset wikitext-2 --preset workshop --out-dir "$OUT_DIR" "$@")\n'
    assert args_line in text
    variant = tmp_path / "fsdp_training.sbatch"
    variant.write_text(text.replace(args_line, args_line + (
        'if [ -f "$OUT_DIR/more_args" ]; then ARGS+=($(cat "$OUT_DIR/more_args")); fi\n')))
    job_id = slurm.submit(
        variant, "--preset", "tiny", "--log-every", "1", "--data-dir", text_dir,
        "--out-dir", out, "--max-steps", "100000000", "--epochs", "100000",
        "--checkpoint-every", "3", "--overwrite", output=out / "job.out",
        sbatch_options=["--nodes=2"],
        env={**job_env, "OUT_DIR": out, "SCRIPT": "solutions/train/fsdp_training.py"})
    last = out / "checkpoints" / "last"
    deadline = time.monotonic() + 120
    while not (last / "train_state.json").is_file():
        fields = slurm.job_fields(job_id) or {}
        if fields.get("JobState") in FINAL_STATES or time.monotonic() > deadline:
            slurm.run("scancel", job_id, check=False)
            pytest.fail(f"job {job_id} wrote no checkpoint: {fields.get('JobState')}\n"
                        f"{(out / 'job.out').read_text(errors='replace')[-4000:]}")
        time.sleep(0.5)
    slurm.run("scontrol", "requeue", job_id)
    while (slurm.job_fields(job_id) or {}).get("JobState") != "PENDING":
        time.sleep(0.5)
    from utils.checkpointing import latest_checkpoint, read_train_state
    newest = latest_checkpoint(out / "checkpoints")
    step = read_train_state(newest)["step"]
    (out / "more_args").write_text(f"--max-steps {step + 2}\n")
    slurm.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
    fields, cancelled = slurm.wait(job_id, deadline=150)
    job = Job(id=job_id, command=f"sbatch --nodes=2 {variant}", output=out / "job.out",
              state=fields.get("JobState", "UNKNOWN"), exit_code=fields.get("ExitCode", ""),
              reason=fields.get("Reason", ""), node_list=fields.get("NodeList", ""),
              cancelled=cancelled, fields=fields, daemon_log=slurm.daemon_lines(job_id))
    assert job.completed and fields.get("Restarts") == "1", job.describe()
    assert not (out / "hpc_ckpt_1.ckpt").exists()
    deleted = job.log.find(f"--overwrite: deleted the earlier run's hpc_ckpt_1.ckpt in {out}")
    kept = job.log.find(f"--overwrite: kept checkpoints in {out}: this is Slurm restart 1 of "
                        "the run that wrote them")
    # the first start, then the requeued one, in one log (the job file appends)
    assert 0 <= deleted < kept, job.describe()
    assert (f"Slurm restart 1: continuing from the newest complete checkpoint {newest} "
            f"(step {step})") in job.log, job.describe()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == step + 2 and len(summary["loss_history"]) == step + 2


# ------------------------------------------------------------- the network: collectives.sbatch
def test_the_collectives_job_measures_one_node_then_two_and_runs_the_lesson_on_them(
        slurm, tmp_path, text_dir, job_env):
    """collectives.sbatch on 2 nodes x 2 CPU processes: the benchmark on one node and on both,
    the comparison, the performance step's trace and the lesson (its solution) on both nodes.
    The nodes have no GPU driver: the topology and the NCCL transports say they do not apply."""
    if not (ROOT / "collectives.sbatch").is_file():
        pytest.skip("collectives.sbatch is not in this checkout yet")
    out = tmp_path / "run"
    job = slurm.sbatch(
        "collectives.sbatch", "--preset", "tiny", "--data-dir", text_dir, "--log-every", "1",
        "--batch-size", "4", output=out / "job.out", deadline=240,
        env={**job_env, "OUT_DIR": out, "SCRIPT": "solutions/train/collectives.py",
             "BENCH_ARGS": "--max-bytes 1M --iters 3 --warmup 1", "PERF_STEPS": 6,
             "LESSON_ARGS": "--max-bytes 64K --iters 2 --warmup 1"})
    assert job.completed, job.describe()
    log, why = job.log, job.describe()
    nodes = slurm.hostnames(job.node_list)
    assert len(nodes) == 2, why
    for node in nodes:  # the GPU-only parts say that they are skipped, on every node
        assert f"GPU topology on {node}: skipped, no GPU driver (nvidia-smi, rocm-smi)" in log, why
    for run in ("one_node", "two_nodes"):
        assert f"NCCL transport ({run}): not applicable, no NCCL log (gloo" in log, why

    one, two = (json.loads((out / f"{name}.json").read_text()) for name in ("one_node",
                                                                              "two_nodes"))
    assert (one["meta"]["world_size"], one["meta"]["nodes"]) == (2, 1), why
    assert (two["meta"]["world_size"], two["meta"]["nodes"]) == (4, 2), why
    assert sorted(two["meta"]["hosts"]) == sorted(nodes), why
    for result in (one, two):
        assert {r["collective"] for r in result["records"]} == {
            "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "sendrecv"}
        assert all(r["wrong"] == 0 for r in result["records"]), why
    for png in ("one_node.png", "two_nodes.png", "compare.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG", png
    assert "A = 1 node x 2 (gloo, cpu); B = 2 nodes x 2 (gloo, cpu)" in log, why

    lesson = json.loads((out / "lesson" / "summary.json").read_text())
    assert lesson["world_size"] == 4 and lesson["ring_wrong"] == 0, why
    assert lesson["fit_source"].endswith("two_nodes.json (4 ranks)"), why
    assert lesson["trace_s"] > 0 and "ms of all-reduce per step" in log, why
    # two CPU processes per node on a shared CI machine: the times may not grow with the size
    # (no prediction: NaN, which summary.json writes as null)
    assert ((lesson["predicted_s"] or 0) > 0 and "x the prediction" in log) or (
        "the times do not grow with the message size" in log), why


# ------------------------------------------------------------- the day before: preflight.sbatch
def preflight_table(log: str) -> dict[tuple[str, str], tuple[str, str]]:
    """{(check, where): (status, detail)} from the table at the end of a preflight log."""
    rows = {}
    for line in log.split("\nSTATUS  CHECK")[-1].splitlines()[1:]:
        m = re.match(r"^(PASS|WARN|FAIL|N/A) +(.+?)  +(\S+)  +(.*)$", line)
        if m:
            rows[(m.group(2), m.group(3))] = (m.group(1), m.group(4))
    return rows


def test_preflight_passes_on_cpu_nodes_with_every_gpu_line_not_applicable(slurm, tmp_path,
                                                                           text_dir, job_env):
    if not (ROOT / "preflight.sbatch").is_file():
        pytest.skip("preflight.sbatch is not in this checkout yet")
    job = slurm.sbatch("preflight.sbatch", output=tmp_path / "job.out", deadline=180,
                       env={**job_env, "DATA_DIR": text_dir, "RUNS_DIR": tmp_path / "runs",
                            "OUT_DIR": tmp_path / "preflight"})
    assert job.completed, job.describe()
    rows, why = preflight_table(job.log), job.describe()
    nodes = slurm.hostnames(job.node_list)
    for node in nodes:
        assert rows[("torch", node)][0] == "PASS", why
        for check in ("CUDA, driver, NCCL", "GPUs visible"):
            status, detail = rows[(check, node)]
            assert status == "N/A" and "no GPU driver on this node" in detail, why
        assert rows[("data cache", node)][0] == "PASS", why
        assert rows[("output folder", node)][0] == "PASS", why
    assert rows[("InfiniBand name", nodes[0])] == (
        "PASS", f"{nodes[0]}i resolves to {slurm.addresses()[nodes[0] + 'i']}: the job files "
        "use it") if slurm.local else rows[("InfiniBand name", nodes[0])][0] in ("PASS", "WARN")
    status, detail = rows[("c10d rendezvous", "job")]
    assert status == "PASS" and "4 ranks on 2 nodes" in detail, why
    for check in ("all-reduce inside a node", "all-reduce across nodes"):
        status, detail = rows[(check, "job")]
        assert status == "N/A" and "GB/s bus bandwidth" in detail and "gloo on CPUs" in detail
    assert rows[("GPU test suite", nodes[0])][0] == "N/A", why
    assert not any(status in ("PASS", "WARN") and "GPU" in check
                   for (check, _), (status, _) in rows.items() if check != "InfiniBand name")
    assert re.search(r"^preflight: \d+ PASS, 0 WARN, 0 FAIL, \d+ N/A: ready$", job.log, re.M), why


def test_a_broken_rendezvous_and_a_missing_cache_fail_the_preflight_with_what_to_do(
        slurm, tmp_path, job_env):
    if not (ROOT / "preflight.sbatch").is_file():
        pytest.skip("preflight.sbatch is not in this checkout yet")
    job = slurm.sbatch("preflight.sbatch", output=tmp_path / "job.out", deadline=180,
                       env={**job_env, "COURSE_DATA_CACHE": tmp_path / "no-cache",
                            "MASTER_ADDR": "node-nowhere", "RDZV_TIMEOUT": 5,
                            "RUNS_DIR": tmp_path / "runs", "GPU_TESTS": 0})
    assert job.state == "FAILED", job.describe()
    rows, why = preflight_table(job.log), job.describe()
    status, detail = rows[("c10d rendezvous", "node-nowhere:" + detail_port(job.log))]
    assert status == "FAIL" and "could not join" in detail, why
    assert "check that node-nowhere resolves and answers from every node" in detail, why
    for node in slurm.hostnames(job.node_list):
        status, detail = rows[("data cache", node)]
        assert status == "FAIL" and "run `python prepare_data.py` on a login node" in detail, why
    assert "fix the FAIL lines before the course" in job.log, why


def detail_port(log: str) -> str:
    return re.search(r"^MASTER_ADDR=\S+ MASTER_PORT=(\d+)$", log, re.M).group(1)


# ------------------------------------------------------------------------ site profiles
# Each profile (sites/*.env) submits the DDP step with sites/sbatch to the two test nodes. The
# test nodes have 4 GPUs and 256 CPUs each: a profile's own node size (LUMI's 8 GCDs, JUPITER's
# 72 cores per GPU) is what tests/test_sites.py checks; here SITE_GPUS_PER_NODE and
# SITE_CPUS_PER_GPU are set to what fits, and the partition is the test cluster's.
SITE_STANDINS = {
    "module": 'echo "$*" >> "$SITE_CALLS/module"',
    # apptainer exec [options] --bind LIST IMAGE COMMAND ARGS: record, run the command "inside"
    "apptainer": '''echo "$(hostname) $*" >> "$SITE_CALLS/apptainer"
[ "$1" = exec ] || exit 1; shift
while [ "${1#-}" != "$1" ]; do case $1 in --bind|-B) shift 2 ;; *) shift ;; esac; done
image=$1; shift
# the image's Python and torch: here the venv of the tests
APPTAINER_CONTAINER=$image PATH=$IMAGE_BIN:$PATH exec "$@"''',
}
SITE_FITS = {"lumi": {"SITE_GPUS_PER_NODE": 4, "SITE_ACCOUNT": "project_465000000"},
             "jupiter": {"SITE_CPUS_PER_GPU": 8}}


def sbatch_with_profile(slurm: Cluster, site: str, job_file: str, *args, output: Path,
                        env: dict, deadline: float = 150) -> tuple[Job, str]:
    """`SITE=site sites/sbatch --nodes=2 JOB_FILE ARGS` as an instructor submits it; returns the
    job and what sites/sbatch said it submitted."""
    output.parent.mkdir(parents=True, exist_ok=True)
    run_env = slurm.job_env({**env, "SITE": site})
    run_env["PATH"] = f"{slurm.bin_dir}:{run_env['PATH']}"  # the real sbatch, behind sites/sbatch
    cmd = [str(ROOT / "sites" / "sbatch"), "--parsable", f"--output={output}", "--nodes=2",
           job_file, *map(str, args)]
    proc = subprocess.run(cmd, cwd=ROOT, env=run_env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip().split(";")[0]
    start = time.monotonic()
    fields, cancelled = slurm.wait(job_id, deadline)
    return Job(id=job_id, command=f"SITE={site} sites/sbatch ... {job_file}", output=output,
               state=fields.get("JobState", "UNKNOWN"), exit_code=fields.get("ExitCode", ""),
               reason=fields.get("Reason", ""), node_list=fields.get("NodeList", ""),
               elapsed=time.monotonic() - start, deadline=deadline, cancelled=cancelled,
               fields=fields, daemon_log=slurm.daemon_lines(job_id)), proc.stderr


@pytest.mark.parametrize("site", sorted(p.stem for p in (ROOT / "sites").glob("*.env")))
def test_each_site_profile_trains_on_two_nodes_with_its_rendezvous_rule(slurm, site, tmp_path,
                                                                        text_dir, job_env):
    if not slurm.local:
        pytest.skip("the rendezvous rule is checked against the local cluster's DNS")
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    for d in (bin_dir, calls):
        d.mkdir()
    for name, body in SITE_STANDINS.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    image = tmp_path / "course.sif"
    image.write_text("")
    out = tmp_path / "run"
    env = {**job_env, "OUT_DIR": out, "NPROC_PER_NODE": PROCS_PER_NODE,
           "SCRIPT": "solutions/train/to_distributed_training.py", "SITE_CALLS": calls,
           "PATH": f"{bin_dir}:{os.environ['PATH']}", "SITE_PARTITION": "dc-gpu",
           **SITE_FITS.get(site, {})}
    if site == "lumi":
        env.update(SITE_CONTAINER=image, SITE_APPTAINER=bin_dir / "apptainer",
                   IMAGE_BIN=Path(sys.executable).parent)
    job, submitted = sbatch_with_profile(
        slurm, site, "solutions/to_distributed_training.sbatch", *SHORT_RUN, "--data-dir",
        text_dir, "--out-dir", out, output=out / "job.out", env=env)
    assert job.completed, job.describe()
    log, why = job.log, job.describe()
    nodes = slurm.hostnames(job.node_list)
    assert f"site: {site} (" in log, why
    assert "--partition=dc-gpu --gres=gpu:4" in submitted, submitted
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 * PROCS_PER_NODE and summary["steps"] == 5, why
    setups = job.setup_lines()
    assert {s["host"] for s in setups} == set(nodes) and len(setups) == 4, why

    # The rendezvous rule: JSC's sites use node 0's InfiniBand name <node>i, the others its name
    suffix = {"jsc": "i", "jupiter": "i"}.get(site, "")
    master = job.master_line()
    assert master is not None and master["addr"] == slurm.addresses()[nodes[0] + suffix], why

    if site == "lumi":  # every rank inside the image, after the profile's modules
        ran = (calls / "apptainer").read_text().splitlines()
        assert len(ran) == 2 and {line.split()[0] for line in ran} == set(nodes), ran
        assert all(f" {image} torchrun " in line for line in ran), ran
        assert "load singularity-AI-bindings" in (calls / "module").read_text()
    else:
        assert not (calls / "apptainer").exists()
