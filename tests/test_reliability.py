"""Bad input and faults end a run at once with one line saying what to change, and nothing
written earlier is lost. Each case runs the real script (plain python, tiny preset) and checks
the exit code, that stderr holds exactly one error line and no traceback, what the line says,
and that files from before are unchanged. docs/reliability.md lists the cases.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, run_script, script_env
from distributed import free_port

DDP = "solutions/train/to_distributed_training.py"
SCRIPTS = {"ddp": DDP, "fsdp": "solutions/train/fsdp_training.py",
           "tp": "solutions/train/tp_training.py", "pp": "solutions/train/pp_training.py",
           "nd": "solutions/train/nd_training.py", "lit": "train/Lit_training.py"}
TINY = ("--preset", "tiny", "--dataset", "synthetic", "--logger", "none")
LIT_CPU = ("--accelerator", "cpu", "--devices", "1")


def error_line(proc, *fragments, strict: bool = True) -> str:
    """The run failed with one `error:` line containing `fragments`, and no traceback.

    strict: stderr holds nothing else (Lightning prints its own banners: not strict there).
    """
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1, proc.stderr[-3000:]
    if strict:
        assert proc.stderr.strip() == lines[0], proc.stderr[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def run(script, *args, env=None, timeout=120, **env_vars):
    return run_script(script, *args, env=env or script_env(**env_vars), check=False,
                      timeout=timeout)


def snapshot(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory) -> Path:
    """Small train/valid/test text files (1,000 lines of made-up words each)."""
    d = tmp_path_factory.mktemp("text")
    for split in ("train", "valid", "test"):
        (d / f"{split}.txt").write_text(
            "".join(f"w{i % 97} w{i % 13} w{i % 7} w{i % 31}\n" for i in range(1000)))
    return d


# ---------------------------------------------------------------------------- flags
@pytest.mark.parametrize("flag, value, says", [
    ("--batch-size", "0", "at least 1"), ("--seq-len", "0", "at least 1"),
    ("--max-steps", "-1", "at least 0"), ("--epochs", "0", "at least 1"),
    ("--log-every", "0", "at least 1"), ("--lr", "inf", "finite"), ("--lr", "0", "above 0"),
    ("--weight-decay", "-0.1", "at least 0"), ("--dropout", "1.5", "below 1"),
])
def test_a_bad_shared_flag_stops_before_any_work_with_one_line_naming_it(tmp_path, flag, value,
                                                                          says):
    proc = run(DDP, *TINY, "--out-dir", tmp_path / "run", flag, value)
    assert proc.returncode == 2
    error_line(proc, f"error: argument {flag}: ", says)
    assert not (tmp_path / "run").exists() and proc.stdout == ""


def test_the_argument_types_refuse_values_that_would_train_nothing_or_nan():
    from utils import args as a
    for parse, bad in [(a.positive_int, "0"), (a.positive_int, "many"), (a.non_negative_int, "-1"),
                       (a.positive_float, "nan"), (a.positive_float, "-inf"),
                       (a.non_negative_float, "inf"), (a.probability, "1"),
                       (a.positive_int_list, "3,0")]:
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)
    assert (a.positive_int("2"), a.non_negative_int("0"), a.positive_float("1e-3"),
            a.probability("0"), a.positive_int_list("3,5")) == (2, 0, 1e-3, 0.0, [3, 5])


@pytest.mark.parametrize("script, flag, value", [
    ("tp", "--tp", "0"), ("pp", "--microbatches", "0"), ("pp", "--layers-per-stage", "1,x"),
    ("nd", "--pp", "0"), ("nd", "--dp", "-1"), ("lit", "--devices", "0"),
    ("lit", "--max-steps", "0"),
])
def test_a_bad_script_specific_flag_stops_with_one_line_naming_it(tmp_path, script, flag, value):
    proc = run(SCRIPTS[script], *TINY, "--out-dir", tmp_path / "run", flag, value)
    assert proc.returncode == 2
    error_line(proc, f"error: argument {flag}: ")


# ---------------------------------------------------------------------------- data
def test_fewer_training_windows_than_one_batch_stops_at_once_with_the_sizes_that_work(
        tmp_path, data_cache):
    start = time.monotonic()
    proc = run(DDP, *TINY, "--seq-len", "8000", "--out-dir", tmp_path / "run",
               COURSE_DATA_CACHE=data_cache)
    line = error_line(proc, "the train split of synthetic has", "13 windows of --seq-len 8000",
                      "one global batch of 32", "--seq-len 3340 or less",
                      "--batch-size 13 or less")
    assert line.startswith("error: ")
    assert time.monotonic() - start < 60  # it did not train 10 epochs of nothing first
    assert not (tmp_path / "run").exists()


def test_the_largest_seq_len_and_batch_size_the_message_suggests_do_work(monkeypatch):
    from utils.data import Corpus, check_splits
    corpus = Corpus(["<unk>", "<eos>"], torch.zeros(1001, dtype=torch.long),
                    torch.zeros(50, dtype=torch.long), torch.zeros(50, dtype=torch.long), "t")
    check_splits(corpus, seq_len=31, batch_size=8, replicas=4)      # 1000 // 32 = 31 works
    with pytest.raises(SystemExit):
        check_splits(corpus, seq_len=32, batch_size=8, replicas=4)  # 31 windows < 32
    check_splits(corpus, seq_len=49, batch_size=5, replicas=4)      # 20 windows: batch 5 works
    with pytest.raises(SystemExit):
        check_splits(corpus, seq_len=49, batch_size=6, replicas=4)
    with pytest.raises(SystemExit):                                 # validation: 49 + 1 > 50 - 1
        check_splits(corpus, seq_len=50, batch_size=1, replicas=1)


def test_an_empty_split_stops_with_one_line_naming_the_split_and_its_token_count(
        tmp_path, text_dir):
    data = tmp_path / "text"
    shutil.copytree(text_dir, data)
    (data / "valid.txt").write_text("")
    proc = run(DDP, *TINY[:2], "--data-dir", data, "--cache-dir", tmp_path / "cache",
               "--out-dir", tmp_path / "run")
    error_line(proc, f"the valid split of local:{data} has 0 tokens", "put text into it")


def test_a_split_shorter_than_one_window_names_the_largest_seq_len_that_works(tmp_path, text_dir):
    data = tmp_path / "text"
    shutil.copytree(text_dir, data)
    (data / "test.txt").write_text("a b c d e f g h i\n")  # 10 tokens with <eos>
    proc = run(DDP, *TINY[:2], "--data-dir", data, "--cache-dir", tmp_path / "cache",
               "--out-dir", tmp_path / "run")
    error_line(proc, "the test split", "has 10 tokens", "use --seq-len 9 or less")


def test_a_data_file_that_is_not_utf8_is_named_with_its_line_and_byte(tmp_path, text_dir):
    data = tmp_path / "text"
    shutil.copytree(text_dir, data)
    (data / "train.txt").write_bytes(b"hello world\ncaf\xe9 au lait\n")
    proc = run(DDP, *TINY[:2], "--data-dir", data, "--cache-dir", tmp_path / "cache",
               "--out-dir", tmp_path / "run")
    error_line(proc, f"{data / 'train.txt'} is not UTF-8 text", "byte 15 (line 2)", "iconv")
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_a_truncated_cache_is_rebuilt_with_one_warning_naming_it(tmp_path, text_dir):
    cache = tmp_path / "cache"
    args = (*TINY[:2], "--data-dir", text_dir, "--cache-dir", cache, "--max-steps", "0",
            "--logger", "none", "--out-dir", tmp_path / "run")
    run_script(DDP, *args)
    cache_file, = cache.glob("*.pt")
    good = cache_file.read_bytes()
    cache_file.write_bytes(good[:1000])  # a copy cut short (full disk, killed rsync)
    proc = run_script(DDP, *args)
    warnings = [line for line in proc.stdout.splitlines() if "WARNING" in line]
    assert warnings == [f"WARNING: the data cache {cache_file} is damaged (RuntimeError when "
                        "reading it): rebuilding it"]
    assert cache_file.read_bytes() == good  # rebuilt, byte for byte
    assert [p.name for p in cache.iterdir()] == [cache_file.name]  # no temporary files left


def test_a_damaged_wikitext2_cache_offline_names_its_path_and_the_command_that_rebuilds_it(
        tmp_path):
    from utils.data import hub_cache_file
    cache_file = hub_cache_file(tmp_path / "cache")
    cache_file.parent.mkdir()
    cache_file.write_bytes(b"not a torch file")
    # --dataset auto (the default) must not fall back to the synthetic corpus without a word
    proc = run(DDP, *TINY[:2], "--out-dir", tmp_path / "run", COURSE_DATA_CACHE=tmp_path / "cache")
    error_line(proc, f"the data cache {cache_file} is damaged", "python prepare_data.py")
    proc = run("prepare_data.py", COURSE_DATA_CACHE=tmp_path / "cache")
    error_line(proc, "prepare_data: error: the data cache", "python prepare_data.py")
    assert cache_file.read_bytes() == b"not a torch file"


# ---------------------------------------------------------------------------- NaN
@pytest.mark.parametrize("script", ["ddp", "ddp-exercise", "fsdp", "tp", "pp", "nd"])
def test_a_diverging_run_stops_at_the_step_and_keeps_the_files_of_the_earlier_run(
        tmp_path, data_cache, script):
    path = "train/to_distributed_training.py" if script == "ddp-exercise" else SCRIPTS[script]
    out = tmp_path / "run"
    (out / "checkpoints" / "last").mkdir(parents=True)
    for name in ("best_model.pt", "final_model.pt", "checkpoints/last/train_state.json"):
        (out / name).write_bytes(b"weights of an earlier, good run")
    before = snapshot(out)
    # AdamW moves every weight by about lr per step: 1e30 overflows the logits at step 2.
    proc = run(path, *TINY, "--lr", "1e30", "--max-steps", "5", "--out-dir", out,
               COURSE_DATA_CACHE=data_cache)
    error_line(proc, "error: the training loss is nan at step 2", "lower --lr")
    assert snapshot(out) == before


def test_nan_weights_after_the_last_step_are_caught_by_validation_before_the_save(
        tmp_path, data_cache):
    proc = run(DDP, *TINY, "--lr", "1e30", "--max-steps", "1", "--out-dir", tmp_path / "run",
               COURSE_DATA_CACHE=data_cache)
    error_line(proc, "error: the validation loss is nan at step 1", "lower --lr")
    assert not list((tmp_path / "run").glob("*.pt"))


def test_lightning_stops_a_diverging_run_with_one_line_before_its_checkpoint(tmp_path, data_cache):
    out = tmp_path / "run"
    proc = run(SCRIPTS["lit"], *TINY, *LIT_CPU, "--lr", "1e30", "--max-steps", "5",
               "--out-dir", out, COURSE_DATA_CACHE=data_cache)
    error_line(proc, "error: the training loss is nan at step 2", strict=False)
    assert not (out / "checkpoints").exists()


# ---------------------------------------------------------------------------- output folder
@pytest.mark.parametrize("script", list(SCRIPTS))
def test_an_output_folder_that_cannot_be_written_stops_before_training(tmp_path, data_cache,
                                                                       script):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    proc = run(SCRIPTS[script], *TINY, *(LIT_CPU if script == "lit" else ()),
               "--out-dir", blocker / "run", COURSE_DATA_CACHE=data_cache)
    error_line(proc, f"error: cannot write to --out-dir {blocker / 'run'} (Not a directory)",
               strict=script != "lit")
    assert "step" not in proc.stdout


def test_a_read_only_output_folder_stops_before_training(tmp_path):
    # Outside pytest's private tmp_path, so that the user `nobody` can reach it when we are root
    # (root writes anywhere). The check comes before the data is loaded: no cache needed.
    base = Path(tempfile.mkdtemp(prefix="reliability-"))
    try:
        base.chmod(0o755)
        read_only = base / "read-only"
        read_only.mkdir(mode=0o555)
        prefix = []
        if os.geteuid() == 0:
            if not shutil.which("setpriv"):
                pytest.skip("running as root without setpriv")
            prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        proc = subprocess.run(
            [*prefix, sys.executable, DDP, *TINY, "--out-dir", str(read_only / "run")], cwd=ROOT,
            env=script_env(cache_dir=tmp_path / "no-cache"), capture_output=True, text=True,
            timeout=120)
        error_line(proc, f"error: cannot write to --out-dir {read_only / 'run'} "
                         "(Permission denied)")
    finally:
        shutil.rmtree(base)


# ---------------------------------------------------------------------------- process group
def test_a_rank_without_rank_0_fails_within_the_timeout_naming_the_address(tmp_path):
    port = free_port()
    start = time.monotonic()
    proc = run(DDP, *TINY, "--out-dir", tmp_path / "run", RANK=1, WORLD_SIZE=2, LOCAL_RANK=1,
               MASTER_ADDR="127.0.0.1", MASTER_PORT=port, DIST_TIMEOUT_MINUTES=0.05)
    error_line(proc, "error: rank 1 of 2 waited 0:00:03 for rank 0 at MASTER_ADDR:MASTER_PORT "
                     f"127.0.0.1:{port}", "DIST_TIMEOUT_MINUTES")
    assert time.monotonic() - start < 45


def test_rank_0_without_the_other_ranks_fails_within_the_timeout(tmp_path):
    start = time.monotonic()
    proc = run(DDP, *TINY, "--out-dir", tmp_path / "run", RANK=0, WORLD_SIZE=2, LOCAL_RANK=0,
               MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(), DIST_TIMEOUT_MINUTES=0.05)
    error_line(proc, "error: rank 0 of 2 waited 0:00:03 for the other ranks", "1/2",
               strict=False)
    assert time.monotonic() - start < 45


def test_rank_variables_without_a_master_address_say_to_use_torchrun(tmp_path):
    proc = run(DDP, *TINY, "--out-dir", tmp_path / "run", RANK=1, WORLD_SIZE=2)
    error_line(proc, "RANK=1 and WORLD_SIZE=2 are set but MASTER_ADDR", "torchrun")


def test_lightning_in_a_batch_script_without_srun_stops_with_one_line(tmp_path, data_cache):
    batch_step = dict(SLURM_JOB_ID="77", SLURM_JOB_NAME="Lit_training", SLURM_NTASKS="8",
                      SLURM_NNODES="2", SLURM_JOB_NUM_NODES="2", SLURM_NTASKS_PER_NODE="4",
                      SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0")
    start = time.monotonic()
    proc = run(SCRIPTS["lit"], *TINY, "--accelerator", "cpu", "--out-dir", tmp_path / "run",
               COURSE_DATA_CACHE=data_cache, **batch_step)
    error_line(proc, "error: this process runs in Slurm job 77 but srun did not start it",
               "start it with srun", strict=False)
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_lightning_waits_for_other_processes_only_as_long_as_the_course_timeout(
        monkeypatch, strategy):
    from test_lightning import load_lit_script
    from utils.distributed_utils import TIMEOUT
    for key in list(os.environ):
        if key.startswith("SLURM_"):
            monkeypatch.delenv(key)
    script = load_lit_script()
    monkeypatch.setattr(sys, "argv", ["Lit_training.py", "--strategy", strategy])
    settings = script.trainer_settings(script.parse_args())
    assert settings["strategy"]._timeout == TIMEOUT


# ---------------------------------------------------------------------------- sbatch files
@pytest.mark.parametrize("sbatch", sorted(p.name for p in ROOT.glob("*.sbatch")))
def test_an_sbatch_file_run_with_bash_says_to_submit_it_with_sbatch(sbatch):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(["bash", sbatch], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 1
    # one line; the training steps add "[training arguments]", gpu_tests.sbatch takes none
    assert proc.stderr.count("\n") == 1
    assert proc.stderr.startswith(f"error: submit this file with sbatch: sbatch {sbatch}")
