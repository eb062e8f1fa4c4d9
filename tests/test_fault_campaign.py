"""Kill the runs that resume at any moment, inside their saves too, and check every time that
the resumed run ends exactly where a run that never stopped ends: the same weights, the same
losses, the same optimizer state. Dropout is on (0.1), so the random-number states and the
position in the data must come back exactly as well.

- The FSDP step, 2 ranks under torchrun --max-restarts 1: SIGKILL of one rank (torchrun
  restarts the workers) or SIGTERM of the whole job (as scancel or a time limit does; the job
  is then started again as a requeue does: same job id, SLURM_RESTART_COUNT=1).
- The Lightning variant, 2 tasks under an emulated srun (tests/faults/fake_srun.py): SIGKILL
  of one task (srun --kill-on-bad-exit stops the other) or SIGTERM of the job, then the requeue.

The moments: after an optimizer step, after a rank wrote its shards, after the completion
marker, between the two renames of a save, after a .ckpt or model file was written but before
its rename, or at a random time. The default suite kills a few times; FAULT_CAMPAIGN=N runs N
kills of each script at moments drawn with FAULT_SEED (default 0) and prints a tally
(docs/reliability.md reports a long campaign).
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, read_summary, script_env

FAULTS = ROOT / "tests" / "faults"
FSDP = "solutions/train/fsdp_training.py"
LIT = "train/Lit_training.py"
COMMON = ["--dataset", "synthetic", "--preset", "tiny", "--dropout", "0.1", "--seed", "3",
          "--logger", "none", "--log-every", "1"]
# 2 ranks x 4 sequences, 12 steps, "last" every 2 steps: 8 DCP saves (last at 2, 4, ..., 12;
# at the end best, then last again), 14 renames (a save over an earlier folder makes 2)
FSDP_RUN = [*COMMON, "--batch-size", "4", "--max-steps", "12", "--checkpoint-every", "2"]
LIT_RUN = [*COMMON, "--seq-len", "31", "--batch-size", "8", "--max-steps", "10",
           "--checkpoint-every", "2", "--accelerator", "cpu"]
CAMPAIGN = int(os.environ.get("FAULT_CAMPAIGN") or 0)
TIMEOUT = 300

pytestmark = pytest.mark.slow


def fault_env(env: dict, kill_at: str, rank: int, job: str) -> dict:
    return {**env, "PYTHONPATH": os.pathsep.join([str(FAULTS), str(ROOT)]), "KILL_AT": kill_at,
            "KILL_RANK": str(rank), "SLURM_JOB_ID": job,
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def torchrun(out: Path, env: dict, *extra) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--max-restarts", "1", FSDP, *FSDP_RUN, "--out-dir", str(out), *extra]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)


def fake_srun(out: Path, env: dict, restarts: int, job: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(FAULTS / "fake_srun.py"), "2", job, str(restarts), "--",
           sys.executable, LIT, *LIT_RUN, "--out-dir", str(out)]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)


def dcp_state(folder: Path, tmp: Path) -> dict:
    """A DCP checkpoint's model and optimizer state as one plain dict (no process group)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    target = tmp / f"{folder.parent.parent.name}-{folder.name}.pt"
    dcp_to_torch_save(folder, target)
    return torch.load(target, weights_only=True)["app"]


def assert_equal(a, b, where=""):
    """Nested dicts/lists of tensors and numbers, equal bit for bit."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


# ---------------------------------------------------------------------------------------------
# The FSDP step


@pytest.fixture(scope="module")
def fsdp_reference(tmp_path_factory, data_cache):
    """The run that never stopped (shared by every kill)."""
    out = tmp_path_factory.mktemp("campaign") / "reference"
    env = script_env(cache_dir=data_cache)
    start = time.monotonic()
    proc = torchrun(out, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, env, dcp_state(out / "checkpoints" / "last", out.parent), \
        time.monotonic() - start


NOT_FIRED = "the run ended before the moment came"


def kill_fsdp(reference, tmp_path: Path, kill_at: str, rank: int) -> str:
    """Kill one run as `kill_at` says, resume it as torchrun or a requeue would, and compare it
    with the reference. Returns what happened, for the tally."""
    whole, env, whole_state, _ = reference
    out, job = tmp_path / "killed", str(random.randrange(10**6))
    first = torchrun(out, fault_env(env, kill_at, rank, job))
    if "fault injection:" not in first.stdout and first.returncode == 0 and \
            kill_at.startswith("time:"):
        return NOT_FIRED  # a random time after the end of the run
    assert "fault injection:" in first.stdout, (kill_at, first.stdout[-2000:],
                                                first.stderr[-3000:])
    log = first.stdout
    if first.returncode != 0:  # SIGTERM of the job (or a kill torchrun could not recover)
        again = torchrun(out, {**env, "SLURM_JOB_ID": job, "SLURM_RESTART_COUNT": "1",
                               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
        assert again.returncode == 0, (kill_at, again.stdout[-2000:], again.stderr[-3000:])
        log += again.stdout
    resumed = [line for line in log.splitlines() if "restart 1: continuing from" in line
               or "no checkpoint in" in line]
    assert resumed, (kill_at, log[-3000:])
    assert read_summary(out)["loss_history"] == read_summary(whole)["loss_history"], kill_at
    mine = torch.load(out / "final_model.pt", weights_only=True)
    assert_equal(mine, torch.load(whole / "final_model.pt", weights_only=True), "final_model")
    assert_equal(dcp_state(out / "checkpoints" / "last", tmp_path), whole_state, "last")
    leftovers = [p.name for p in out.rglob("*") if p.name.endswith((".partial", ".old", ".tmp"))
                 or p.name == "run.lock"]
    assert not leftovers, leftovers
    return resumed[0].split(": ", 1)[1]


FSDP_KILLS = [  # (KILL_AT, rank): in the default suite
    ("shards:2", 1),        # SIGKILL of rank 1 inside the 2nd save, after its shard file
    ("rename:2:TERM", 0),   # SIGTERM of the job between the two renames of the 2nd save
]


@pytest.mark.parametrize("kill_at, rank", FSDP_KILLS, ids=[k for k, _ in FSDP_KILLS])
def test_the_fsdp_step_killed_inside_a_save_resumes_to_exactly_the_uninterrupted_run(
        fsdp_reference, tmp_path, kill_at, rank):
    kill_fsdp(fsdp_reference, tmp_path, kill_at, rank)


def random_fsdp_kill(rng: random.Random, seconds: float) -> tuple[str, int]:
    """A random moment of a run that takes `seconds` (the reference's wall time)."""
    event, n = rng.choice([("step", rng.randint(1, 11)), ("shards", rng.randint(1, 8)),
                           ("marker", rng.randint(1, 8)), ("rename", rng.randint(1, 14)),
                           ("torchsave", 1), ("time", round(rng.uniform(1.0, seconds), 1))])
    signal = rng.choice(["KILL", "TERM"])
    rank = 0 if event in ("marker", "rename", "torchsave") else rng.randint(0, 1)
    return f"{event}:{n}:{signal}", rank


@pytest.mark.skipif(not CAMPAIGN, reason="the long campaign: FAULT_CAMPAIGN=N")
@pytest.mark.timeout(300 + 120 * CAMPAIGN)
def test_a_campaign_of_random_kills_of_the_fsdp_step(fsdp_reference, tmp_path):
    rng = random.Random(int(os.environ.get("FAULT_SEED") or 0))
    survived = 0
    for i in range(CAMPAIGN):
        kill_at, rank = random_fsdp_kill(rng, fsdp_reference[3])
        folder = tmp_path / str(i)
        folder.mkdir()
        start = time.monotonic()
        how = kill_fsdp(fsdp_reference, folder, kill_at, rank)
        survived += how != NOT_FIRED
        shutil.rmtree(folder)
        print(f"fsdp kill {i + 1}/{CAMPAIGN}: {kill_at} rank {rank}: "
              f"{how if how == NOT_FIRED else f'survived ({how})'}, "
              f"{time.monotonic() - start:.0f} s", flush=True)
    print(f"fsdp campaign: {survived} kills, all survived", flush=True)


# ---------------------------------------------------------------------------------------------
# The Lightning variant


def lit_state(out: Path) -> dict:
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)
    return {"state_dict": ckpt["state_dict"], "optimizer_states": ckpt["optimizer_states"],
            "global_step": ckpt["global_step"]}


@pytest.fixture(scope="module")
def lit_reference(tmp_path_factory, data_cache):
    pytest.importorskip("lightning")
    out = tmp_path_factory.mktemp("lit_campaign") / "reference"
    env = {**script_env(cache_dir=data_cache), "PYTHONPATH": str(ROOT)}
    start = time.monotonic()
    proc = fake_srun(out, env, 0, "500")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, env, lit_state(out), time.monotonic() - start


def kill_lightning(reference, tmp_path: Path, kill_at: str, rank: int) -> str:
    whole, env, whole_state, _ = reference
    out, job = tmp_path / "killed", str(random.randrange(10**6))
    first = fake_srun(out, fault_env(env, kill_at, rank, job), 0, job)
    log = first.stdout + first.stderr
    if "fault injection:" not in log and first.returncode == 0 and kill_at.startswith("time:"):
        return NOT_FIRED
    assert "fault injection:" in log, (kill_at, log[-3000:])
    assert first.returncode != 0, kill_at
    again = fake_srun(out, env, 1, job)  # the requeued job: same id and OUT_DIR
    log = again.stdout + again.stderr
    assert again.returncode == 0, (kill_at, log[-4000:])
    resumed = [line for line in log.splitlines() if line.startswith("Slurm restart 1:")]
    assert resumed, (kill_at, log[-3000:])
    assert read_summary(out)["loss_history"] == read_summary(whole)["loss_history"], kill_at
    assert read_summary(out)["test_loss"] == read_summary(whole)["test_loss"], kill_at
    assert_equal(lit_state(out), whole_state, "last.ckpt")
    assert not [p for p in out.rglob("*") if p.name.endswith((".tmp", ".damaged"))]
    return resumed[0].split(": ", 1)[1]


LIT_KILLS = [("torchsave:3", 0)]  # SIGKILL of task 0 (it writes them) once its 3rd .ckpt is
                                  # written, before the rename


@pytest.mark.parametrize("kill_at, rank", LIT_KILLS, ids=[k for k, _ in LIT_KILLS])
def test_the_lightning_variant_killed_inside_a_checkpoint_save_is_requeued_to_the_same_end(
        lit_reference, tmp_path, kill_at, rank):
    kill_lightning(lit_reference, tmp_path, kill_at, rank)


def random_lightning_kill(rng: random.Random, seconds: float) -> tuple[str, int]:
    # 7 .ckpt files: step=N.ckpt at 2, 4, ..., 10, then best and last after the validation
    event, n = rng.choice([("step", rng.randint(1, 9)), ("torchsave", rng.randint(1, 7)),
                           ("time", round(rng.uniform(1.0, seconds), 1))])
    # only task 0 writes .ckpt files
    rank = 0 if event == "torchsave" else rng.randint(0, 1)
    return f"{event}:{n}:{rng.choice(['KILL', 'TERM'])}", rank


@pytest.mark.skipif(not CAMPAIGN, reason="the long campaign: FAULT_CAMPAIGN=N")
@pytest.mark.timeout(300 + 300 * CAMPAIGN)
def test_a_campaign_of_random_kills_of_the_lightning_variant(lit_reference, tmp_path):
    rng = random.Random(int(os.environ.get("FAULT_SEED") or 0))
    survived = 0
    for i in range(CAMPAIGN):
        kill_at, rank = random_lightning_kill(rng, lit_reference[3])
        folder = tmp_path / str(i)
        folder.mkdir()
        start = time.monotonic()
        how = kill_lightning(lit_reference, folder, kill_at, rank)
        survived += how != NOT_FIRED
        shutil.rmtree(folder)
        print(f"lightning kill {i + 1}/{CAMPAIGN}: {kill_at} task {rank}: "
              f"{how if how == NOT_FIRED else f'survived ({how})'}, "
              f"{time.monotonic() - start:.0f} s", flush=True)
    print(f"lightning campaign: {survived} kills, all survived", flush=True)
