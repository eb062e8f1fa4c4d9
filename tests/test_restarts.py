"""Checkpoints survive what goes wrong on a cluster: a rank that dies, a damaged checkpoint, a
full disk, a save cut short between its two renames (docs/reliability.md lists them).

Real processes on CPU with gloo, on the FSDP lesson's solution script, with dropout on. A
restarted run is correct when its losses and weights equal those of a run that never stopped,
bit for bit (tests/test_fault_campaign.py kills at many more moments).
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess

import pytest
import torch

from conftest import ROOT, read_summary, run_script, script_env
from distributed import run_distributed
from model import TransformerLM, get_config

SOLUTION = "solutions/train/fsdp_training.py"
COMMON = ["--dataset", "synthetic", "--preset", "tiny", "--dropout", "0.1", "--seed", "3",
          "--logger", "none", "--log-every", "1"]
# 2 ranks x 4 sequences; "last" every 3 steps, and at the end (step 10, also "best")
RUN = [*COMMON, "--batch-size", 4, "--max-steps", 10, "--checkpoint-every", 3]
TIMEOUT = 120  # seconds, for every multi-process run
FAULTS = ROOT / "tests" / "faults"  # sitecustomize.py: KILL_AT_STEP / KILL_RANK

pytestmark = pytest.mark.slow  # real processes (started as torchrun does: the kill test compares with a torchrun run bit for bit)


def last_error_line(proc) -> str:
    return proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, data_cache):
    """The run that never stopped, at 2 ranks; its checkpoints are copied by other tests."""
    out = tmp_path_factory.mktemp("restarts") / "uninterrupted"
    env = script_env(cache_dir=data_cache)
    run_script(SOLUTION, *RUN, "--out-dir", out, nproc=2, env=env, timeout=TIMEOUT)
    return out, env


def copy_checkpoints(uninterrupted, tmp_path):
    folder = tmp_path / "checkpoints"
    shutil.copytree(uninterrupted[0] / "checkpoints", folder)
    return folder


def assert_same_weights(a, b, atol=1e-4):
    a, b = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=lambda m, k=k: f"{k}: {m}")


# ---------------------------------------------------------------------------------------------
# A rank dies: torchrun restarts the workers, they continue from the newest checkpoint


def test_a_rank_killed_at_step_7_costs_at_most_checkpoint_every_steps_and_changes_nothing(
        uninterrupted, tmp_path):
    whole, env = uninterrupted
    out = tmp_path / "killed"
    # rank 1 kills itself (SIGKILL) after its 7th step, on the first start only.
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: without it the restarted workers share torchrun's
    # store with the dead ones and may read their stale addresses (pytorch/pytorch#135712):
    # "Gloo connectFullMesh failed ... Connection refused" (NCCL: the same with a stale id).
    env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(FAULTS), env.get("PYTHONPATH")])),
           "KILL_AT_STEP": "7", "KILL_RANK": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    proc = run_script(SOLUTION, *RUN, "--out-dir", out, nproc=2, env=env, timeout=2 * TIMEOUT,
                      torchrun_args=["--max-restarts", "1"])
    log = proc.stdout
    assert "fault injection: rank 1 killed after step 7" in log, log[-3000:]
    # one line says where it continued: the checkpoint of step 6 (--checkpoint-every 3)
    restart_lines = [l for l in log.splitlines() if l.startswith("torchrun restart 1:")]
    assert restart_lines == [f"torchrun restart 1: continuing from the newest complete checkpoint "
                             f"{out / 'checkpoints' / 'last'} (step 6)"], log[-3000:]
    assert f"resumed from {out / 'checkpoints' / 'last'} at step 6, epoch 0, batch 6" in log
    resumed, reference = read_summary(out), read_summary(whole)
    assert resumed["steps"] == 10
    # exactly: with dropout, only if every rank's random-number states came back too
    assert resumed["loss_history"] == reference["loss_history"]
    assert_same_weights(out / "final_model.pt", whole / "final_model.pt", atol=0)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["best", "last"]


def test_a_slurm_requeue_and_resume_auto_take_the_newest_checkpoint_and_say_so(
        uninterrupted, tmp_path, monkeypatch, capsys):
    from utils.checkpointing import resume_checkpoint
    folder = copy_checkpoints(uninterrupted, tmp_path)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert resume_checkpoint(None, folder) == folder / "last"
    assert capsys.readouterr().out == (f"Slurm restart 1: continuing from the newest complete "
                                       f"checkpoint {folder / 'last'} (step 10)\n")
    monkeypatch.delenv("SLURM_RESTART_COUNT")
    assert resume_checkpoint(None, folder) is None  # a first start without --resume
    assert resume_checkpoint("auto", tmp_path / "nothing") is None
    assert capsys.readouterr().out == (f"--resume auto: no checkpoint in {tmp_path / 'nothing'} "
                                       "yet, starting at step 0\n")


# ---------------------------------------------------------------------------------------------
# Damaged checkpoints: one line, naming the checkpoint to use instead


def damage(folder, how):
    if how == "missing shard":
        (folder / "last" / "__1_0.distcp").unlink()
    elif how == "truncated metadata":
        with open(folder / "last" / ".metadata", "r+b") as f:
            f.truncate(100)
    elif how == "truncated shard":
        with open(folder / "last" / "__0_0.distcp", "r+b") as f:
            f.truncate(1000)
    elif how == "flipped bit":  # same size, same structure: only the numbers differ
        data = bytearray((folder / "last" / "__0_0.distcp").read_bytes())
        data[len(data) // 2] ^= 0x10
        (folder / "last" / "__0_0.distcp").write_bytes(bytes(data))
    elif how == "no marker":  # a save killed before its manifest (never renamed, normally)
        (folder / "last" / "manifest.json").unlink()


@pytest.mark.parametrize("how, problem", [
    ("missing shard", "its shard file __1_0.distcp is missing"),
    ("truncated metadata", "its .metadata file is truncated or damaged"),
    ("truncated shard", "its shard file __0_0.distcp is truncated"),
    ("flipped bit", "its shard file __0_0.distcp does not match its checksum (CRC-32)"),
    ("no marker", "it has no manifest.json, so the save that wrote it did not finish"),
])
def test_a_damaged_checkpoint_is_refused_with_one_line_naming_the_previous_good_one(
        uninterrupted, tmp_path, how, problem):
    _, env = uninterrupted
    folder = copy_checkpoints(uninterrupted, tmp_path)
    damage(folder, how)
    proc = run_script(SOLUTION, *COMMON, "--batch-size", 8, "--max-steps", 12,
                      "--out-dir", tmp_path / "out", "--resume", folder / "last", env=env,
                      timeout=TIMEOUT, check=False)
    assert proc.returncode == 1
    assert last_error_line(proc) == (f"error: checkpoint {folder / 'last'} cannot be loaded: "
                                     f"{problem}; resume from {folder / 'best'} (step 10) instead")
    assert "Traceback" not in proc.stderr
    # --resume auto (and a restart) skips the damaged one
    from utils.checkpointing import newest_good_checkpoint
    assert newest_good_checkpoint(folder) == folder / "best"


def test_resume_auto_skips_a_damaged_newest_checkpoint_with_one_line(uninterrupted, tmp_path):
    _, env = uninterrupted
    out = tmp_path / "out"
    folder = copy_checkpoints(uninterrupted, out)
    damage(folder, "flipped bit")
    proc = run_script(SOLUTION, *COMMON, "--batch-size", 4, "--max-steps", 10, "--out-dir", out,
                      "--resume", "auto", nproc=2, env=env, timeout=TIMEOUT)
    assert (f"WARNING: checkpoint {folder / 'last'} is damaged (its shard file __0_0.distcp "
            "does not match its checksum (CRC-32)): skipping it") in proc.stdout
    assert (f"--resume auto: continuing from the newest complete checkpoint {folder / 'best'} "
            "(step 10)") in proc.stdout


def test_a_resumed_run_that_diverges_stops_before_it_saves_over_its_checkpoint(uninterrupted,
                                                                              tmp_path):
    _, env = uninterrupted
    out = tmp_path / "out"
    folder = copy_checkpoints(uninterrupted, out)
    before = {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    # The weights turn NaN after the first step of the resumed run (a fault hook: --lr would
    # not do, the optimizer's state restores the checkpoint's learning rate)
    env = {**env, "PYTHONPATH": os.pathsep.join([str(FAULTS), str(ROOT)]), "NAN_AT_STEP": "1"}
    proc = run_script(SOLUTION, *COMMON, "--batch-size", 8, "--max-steps", 14,
                      "--checkpoint-every", 1, "--out-dir", out, "--resume", "auto", env=env,
                      timeout=TIMEOUT, check=False)
    assert proc.returncode == 1
    # the loss of step 11 was still finite; its update made the weights NaN: not saved
    assert last_error_line(proc) == (
        f"error: the weights are NaN or infinite at step 11: training diverged; not saving them "
        f"over {folder / 'last'}, which keeps the last good checkpoint: lower --lr")
    assert {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()} \
        == before


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process
def test_without_another_good_checkpoint_the_line_says_start_without_resume(uninterrupted,
                                                                             tmp_path):
    from utils.checkpointing import CheckpointError, load_sharded_model
    folder = copy_checkpoints(uninterrupted, tmp_path)
    shutil.rmtree(folder / "best")
    damage(folder, "missing shard")
    model = TransformerLM(get_config("tiny", vocab_size=502, dropout=0.0))
    with pytest.raises(CheckpointError, match=r"is missing; start again without --resume$"):
        load_sharded_model(model, None, folder / "last")


# ---------------------------------------------------------------------------------------------
# A save cut short between its two renames (last -> .last.old, .last.partial -> last)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_save_stopped_between_its_renames_loads_the_previous_checkpoint_and_says_so(
        uninterrupted, tmp_path, capsys):
    from utils.checkpointing import latest_checkpoint, load_sharded_model, save_sharded_model
    folder = copy_checkpoints(uninterrupted, tmp_path)
    shutil.rmtree(folder / "best")
    os.replace(folder / "last", folder / ".last.old")  # the first rename happened, not the second
    assert latest_checkpoint(folder) == folder / ".last.old"  # --resume auto and restarts
    model = TransformerLM(get_config("tiny", vocab_size=502, dropout=0.0))
    optimizer = torch.optim.AdamW(model.parameters())
    assert load_sharded_model(model, optimizer, folder / "last")["step"] == 10
    assert capsys.readouterr().out.splitlines()[0] == (
        f"checkpoint {folder / 'last'} is missing: a save stopped between its two renames; "
        f"loading the previous checkpoint {folder / '.last.old'}")
    # the next save puts a complete "last" in place and only then deletes the old one
    save_sharded_model(model, optimizer, folder / "last", {"step": 11})
    assert sorted(p.name for p in folder.iterdir()) == ["last"]
    assert load_sharded_model(model, optimizer, folder / "last")["step"] == 11


def test_the_script_resumes_from_the_previous_checkpoint_after_a_save_stopped_between_renames(
        uninterrupted, tmp_path):
    whole, env = uninterrupted
    folder = copy_checkpoints(uninterrupted, tmp_path)
    os.replace(folder / "last", folder / ".last.old")
    proc = run_script(SOLUTION, *COMMON, "--batch-size", 8, "--max-steps", 10,
                      "--out-dir", tmp_path / "out", "--resume", folder / "last", env=env,
                      timeout=TIMEOUT)
    assert (f"loading the previous checkpoint {folder / '.last.old'}" in proc.stdout)
    assert f"resumed from {folder / 'last'} at step 10" in proc.stdout
    # at --max-steps already: it only evaluates and exports, and says it timed no step
    assert "no training step timed in this run" in proc.stdout and "nan tokens/s" not in proc.stdout
    assert read_summary(tmp_path / "out")["loss_history"] == read_summary(whole)["loss_history"]


# ---------------------------------------------------------------------------------------------
# A full disk during a save


def save_on_a_full_disk(rank, world_size, ckpt, error):
    """Save a good checkpoint, then one during which rank 1's write fails with `error`."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from utils.checkpointing import (CheckpointError, checkpoint_problem,
                                     read_train_state, save_sharded_model)
    from test_fsdp_lesson import sharded_model
    model = sharded_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    save_sharded_model(model, optimizer, ckpt, {"step": 1})
    write_data = FileSystemWriter.write_data

    def fail_on_rank_1(self, plan, planner):
        if rank == 1:
            write_data(self, plan, planner).wait()
            raise error
        return write_data(self, plan, planner)

    FileSystemWriter.write_data = fail_on_rank_1
    try:
        save_sharded_model(model, optimizer, ckpt, {"step": 2})
        message = None
    except CheckpointError as e:
        message = str(e)
    finally:
        FileSystemWriter.write_data = write_data
    from pathlib import Path
    return (message, sorted(p.name for p in Path(ckpt).parent.iterdir()),
            checkpoint_problem(ckpt), read_train_state(ckpt)["step"])


@pytest.mark.parametrize("error", [
    OSError(errno.ENOSPC, "No space left on device"),
    RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1088 vs 1004"),
], ids=["ENOSPC", "inline_container"])
def test_a_full_disk_during_a_save_gives_one_line_and_keeps_the_previous_checkpoint(
        tmp_path, error):
    ckpt = tmp_path / "checkpoints" / "last"
    message, left, problem, step = run_distributed(save_on_a_full_disk, 2, str(ckpt), error,
                                                   timeout=TIMEOUT)[0]
    assert message.startswith(f"no space left on device while saving {ckpt}: free ")
    assert message.endswith(" MiB are free) or choose another --out-dir")
    assert left == ["last"]  # no .last.partial
    assert problem is None and step == 1  # the previous checkpoint, complete


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 4 MiB file system: room for one checkpoint of the tiny model (2.4 MiB), not two."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    mount_point = tmp_path / "small_disk"
    mount_point.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount_point)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=True)


def test_the_script_on_a_full_disk_stops_with_one_line_and_leaves_the_last_good_checkpoint(
        small_tmpfs, data_cache):
    from utils.checkpointing import checkpoint_problem, read_train_state
    out = small_tmpfs / "run"
    proc = run_script(SOLUTION, *COMMON, "--batch-size", 4, "--max-steps", 6,
                      "--checkpoint-every", 2, "--out-dir", out, nproc=2,
                      env=script_env(cache_dir=data_cache), timeout=TIMEOUT, check=False)
    assert proc.returncode != 0
    errors = [l for l in proc.stderr.splitlines() if l.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith(f"error: no space left on device while saving "
                                f"{out / 'checkpoints' / 'last'}: free ")
    assert errors[0].endswith("or choose another --out-dir")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["last"]
    assert checkpoint_problem(out / "checkpoints" / "last") is None
    assert read_train_state(out / "checkpoints" / "last")["step"] == 2
