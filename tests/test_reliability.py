"""Bad input and faults end a run at once with one line saying what to change, and nothing
written earlier is lost. Each case runs the real script (plain python, tiny preset) and checks
the exit code, that stderr holds exactly one error line and no traceback, what the line says,
and that files from before are unchanged. docs/reliability.md lists the cases.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, run_script, script_env
from distributed import free_port

pytestmark = pytest.mark.warm_start  # runs forked warm: tests/warm_launch.py
DDP = "solutions/train/to_distributed_training.py"
SCRIPTS = {"ddp": DDP, "fsdp": "solutions/train/fsdp_training.py",
           "tp": "solutions/train/tp_training.py", "pp": "solutions/train/pp_training.py",
           "nd": "solutions/train/nd_training.py", "perf": "solutions/train/perf_training.py",
           "lit": "train/Lit_training.py"}
FAULTS = ROOT / "tests" / "faults"  # sitecustomize.py: a full disk for any user, kills
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
@pytest.mark.parametrize("script", ["ddp", "perf"])
def test_fewer_training_windows_than_one_batch_stops_at_once_with_the_sizes_that_work(
        tmp_path, data_cache, script):
    start = time.monotonic()
    # (a --seq-len the validation split takes: 2,714 tokens)
    proc = run(SCRIPTS[script], *TINY, "--seq-len", "2000", "--batch-size", "64", "--out-dir",
               tmp_path / "run", COURSE_DATA_CACHE=data_cache)
    line = error_line(proc, "the train split of synthetic has", "53 windows of --seq-len 2000",
                      "one global batch of 64", "--seq-len 1670 or less",
                      "--batch-size 53 or less")
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
            "--logger", "none", "--out-dir", tmp_path / "run", "--overwrite")
    run_script(DDP, *args)
    cache_file, = cache.glob("*.pt")
    good = cache_file.read_bytes()
    cache_file.write_bytes(good[:1000])  # a copy cut short (full disk, killed rsync)
    proc = run_script(DDP, *args)
    warnings = [line for line in proc.stdout.splitlines() if "WARNING" in line]
    assert warnings == [f"WARNING: the data cache {cache_file} is damaged (it is truncated (or "
                        "not a torch.save file)): rebuilding it"]
    assert cache_file.read_bytes() == good  # rebuilt, byte for byte
    assert [p.name for p in cache.iterdir()] == [cache_file.name]  # no temporary files left


def flip_a_bit(path: Path, offset: int | None = None) -> None:
    """A bit flipped in the middle of a file (a bad copy, a parallel file system's error):
    same size, same structure, other numbers."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if offset is None else offset] ^= 0x10
    path.write_bytes(bytes(data))


def test_a_cache_damaged_without_changing_its_size_is_rebuilt_with_one_warning(tmp_path,
                                                                                text_dir):
    cache = tmp_path / "cache"
    args = (*TINY[:2], "--data-dir", text_dir, "--cache-dir", cache, "--max-steps", "0",
            "--logger", "none", "--out-dir", tmp_path / "run", "--overwrite")
    run_script(DDP, *args)
    cache_file, = cache.glob("*.pt")
    good = cache_file.read_bytes()
    flip_a_bit(cache_file)  # in the token ids: torch.load alone reads it without complaint
    torch.load(cache_file, weights_only=True)
    proc = run_script(DDP, *args)
    warnings = [line for line in proc.stdout.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and warnings[0].startswith(
        f"WARNING: the data cache {cache_file} is damaged (its record ")
    assert warnings[0].endswith("does not match its checksum (CRC-32)): rebuilding it")
    assert cache_file.read_bytes() == good


def test_a_damaged_wikitext2_cache_offline_is_named_even_when_only_a_bit_differs(tmp_path,
                                                                               data_cache):
    from utils.data import hub_cache_file, load_corpus
    synthetic = load_corpus("synthetic", cache_dir=data_cache)
    cache_file = hub_cache_file(tmp_path / "cache")
    from utils.data import _save_cached
    _save_cached(synthetic, cache_file)  # stands in for a WikiText-2 download
    flip_a_bit(cache_file)
    proc = run(DDP, *TINY[:2], "--out-dir", tmp_path / "run", COURSE_DATA_CACHE=tmp_path / "cache")
    error_line(proc, f"the data cache {cache_file} is damaged (its record ",
               "does not match its checksum (CRC-32)", "python prepare_data.py")


def test_a_cache_folder_that_cannot_be_written_trains_anyway_after_one_warning(tmp_path,
                                                                              text_dir):
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # --cache-dir inside a file: nothing can be written there
    proc = run_script(DDP, *TINY, "--max-steps", "1", "--cache-dir", blocker / "cache",
                      "--out-dir", tmp_path / "run")
    warnings = [line for line in proc.stdout.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and warnings[0].startswith(
        f"WARNING: cannot write the data cache {blocker / 'cache'}/synthetic-")
    assert "give a writable --cache-dir" in warnings[0]
    assert (tmp_path / "run" / "final_model.pt").is_file()
    # prepare_data.py exists to fill the cache: there the same is one error line
    proc = run("prepare_data.py", "--data-dir", text_dir, "--cache-dir", blocker / "cache")
    error_line(proc, "prepare_data: error: cannot write the data cache", "(Not a directory)",
               "give a writable --cache-dir")


def test_an_empty_course_data_cache_variable_means_the_default_cache(monkeypatch):
    from utils import data
    monkeypatch.setenv("COURSE_DATA_CACHE", "")
    assert data.default_cache_dir() == data.REPO_ROOT / "data_cache"


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
@pytest.mark.parametrize("script", ["ddp", "ddp-exercise", "fsdp", "tp", "pp", "nd", "perf"])
def test_a_diverging_run_stops_at_the_step_before_it_saves_anything(tmp_path, data_cache,
                                                                       script):
    path = "train/to_distributed_training.py" if script == "ddp-exercise" else SCRIPTS[script]
    out = tmp_path / "run"
    # AdamW moves every weight by about lr per step: 1e30 overflows the logits at step 2.
    # (The performance step reads the loss at log steps only, so --log-every 1 here.)
    proc = run(path, *TINY, "--lr", "1e30", "--max-steps", "5", "--log-every", "1",
               "--out-dir", out, COURSE_DATA_CACHE=data_cache)
    error_line(proc, "error: the training loss is nan at step 2", "lower --lr")
    assert not [p for p in out.rglob("*") if p.is_file()]  # nothing saved (the lock is gone)


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


# ---------------------------------------------------------------------------- a full disk
def assert_nothing_half_written(folder: Path) -> None:
    """No temporary file, no staging folder; every model file loads, every DCP folder has its
    completion marker."""
    assert not list(folder.rglob("*.tmp")) and not list(folder.rglob("*.partial"))
    for f in folder.rglob("*.pt"):
        if f.parent.name != "rng":
            torch.load(f, weights_only=True)
    for metadata in folder.rglob(".metadata"):
        assert (metadata.parent / "manifest.json").is_file(), metadata.parent


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_a_full_disk_in_any_script_ends_in_one_line_naming_the_file_and_the_space(
        tmp_path, data_cache, script):
    """Every write into the output folder fails with ENOSPC once 4 kB are written (the lock
    file fits, the first model or checkpoint does not), as on a full disk or quota."""
    out = tmp_path / "run"
    proc = run(SCRIPTS[script], *TINY, *(LIT_CPU if script == "lit" else ()), "--max-steps", "2",
               "--out-dir", out, COURSE_DATA_CACHE=data_cache,
               PYTHONPATH=os.pathsep.join([str(FAULTS), str(ROOT)]), DISK_FULL_UNDER=tmp_path,
               DISK_FULL_AFTER_BYTES=4096)
    # (TP's ranks print a warning of torch's about all-gathers on stderr: not strict there)
    line = error_line(proc, f"error: no space left on device while saving {out}/",
                      " MiB are free", "or choose another --out-dir",
                      strict=script not in ("lit", "tp"))
    if script not in ("pp", "nd"):  # the first save of a DCP folder has no size to go by
        assert "it takes about" in line  # how much to free
    assert_nothing_half_written(out)
    assert not (out / "run.lock").exists()


@pytest.fixture
def tmpfs(tmp_path):
    """A small real file system (root only; skipped otherwise): mount(size) -> its folder."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    mounted = []

    def mount(size: str) -> Path:
        point = tmp_path / f"disk{len(mounted)}"
        point.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", str(point)], check=True)


@pytest.mark.parametrize("script", ["ddp", "lit"])
def test_on_a_really_full_file_system_the_run_stops_with_one_line_and_keeps_what_was_whole(
        tmpfs, data_cache, script):
    # 1 MiB: best_model.pt of the tiny model (0.7 MiB) fits, final_model.pt then does not;
    # a Lightning checkpoint (2 MiB) does not fit at all
    out = tmpfs("1m") / "run"
    proc = run(SCRIPTS[script], *TINY, *(LIT_CPU if script == "lit" else ()), "--max-steps", "2",
               "--out-dir", out, COURSE_DATA_CACHE=data_cache)
    error_line(proc, f"error: no space left on device while saving {out}/", "MiB are free",
               strict=script != "lit")
    assert_nothing_half_written(out)
    if script == "ddp":
        assert (out / "best_model.pt").is_file() and not (out / "final_model.pt").exists()


# ---------------------------------------------------------------------------- one run per folder
def test_running_again_in_the_same_folder_refuses_to_overwrite_until_asked(tmp_path, data_cache):
    out = tmp_path / "run"
    run_script(DDP, *TINY, "--max-steps", "1", "--out-dir", out, env=script_env(data_cache))
    before = snapshot(out)
    for again in (("--max-steps", "1"), ("--max-steps", "0")):  # also: only evaluating
        proc = run(DDP, *TINY, *again, "--out-dir", out, COURSE_DATA_CACHE=data_cache)
        error_line(proc, f"error: --out-dir {out} holds the results of an earlier run "
                         "(best_model.pt, final_model.pt, summary.json, vocab.txt): delete them with "
                         "--overwrite, or choose another --out-dir")
        assert snapshot(out) == before
    proc = run_script(DDP, *TINY, "--max-steps", "2", "--out-dir", out, "--overwrite",
                      env=script_env(data_cache))
    assert (f"--overwrite: deleted the earlier run's best_model.pt, final_model.pt, summary.json, "
            f"vocab.txt in {out}") in proc.stdout
    assert json.loads((out / "summary.json").read_text())["steps"] == 2


def test_under_torchrun_the_error_line_also_ends_torchruns_report_of_the_failure(tmp_path):
    # torchrun prints about 40 lines after a failed rank's one line; its "Root Cause" is what
    # a participant reads, so it must say what to change (not "To enable traceback see ...")
    out = tmp_path / "run"
    out.mkdir()
    (out / "summary.json").write_text("{}")  # an earlier run's result
    proc = run_script(DDP, *TINY, "--out-dir", out, nproc=2, torchrun=True, check=False,
                      env=script_env())
    line = f"error: --out-dir {out} holds the results of an earlier run (summary.json)"
    assert proc.returncode != 0
    assert [l for l in proc.stderr.splitlines() if l.startswith("error:")] == [
        line + ": delete them with --overwrite, or choose another --out-dir"], proc.stderr
    assert "Root Cause" in proc.stderr, proc.stderr
    root_cause = proc.stderr.split("Root Cause", 1)[1]
    assert f"traceback : {line}" in root_cause, root_cause
    assert "To enable traceback" not in proc.stderr


def laptop_command_blocks():
    """(where, [command, ...]) for every block of shell commands a participant copies: the fenced
    blocks of README.md, docs/ and slides/, and each exercise's docstring, with the lines
    a trailing backslash continues joined."""
    blocks = []
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
               *sorted((ROOT / "slides").glob("*.md"))]:
        for i, block in enumerate(re.findall(r"^```(?:bash|sh)?\n(.*?)^```", md.read_text(),
                                             re.M | re.S)):
            blocks.append((f"{md.relative_to(ROOT)} block {i + 1}", block))
    for script in sorted((ROOT / "train").glob("*.py")):
        blocks.append((str(script.relative_to(ROOT)), ast.get_docstring(ast.parse(
            script.read_text()), clean=False) or ""))
    return [(where, re.sub(r"\\\n\s*", " ", text).splitlines()) for where, text in blocks]


def test_a_documented_command_that_runs_a_script_again_into_its_folder_says_overwrite():
    # a run never overwrites an earlier run's results: the second of two commands copied from
    # one block would stop at "holds the results of an earlier run" instead of training
    claim = {f"train/{p.name}" for p in (ROOT / "solutions" / "train").glob("*.py")
             if "claim_out_dir(" in p.read_text()}  # (the collectives lesson keeps no results)
    again = []
    for where, lines in laptop_command_blocks():
        seen = set()
        for line in lines:
            run = re.search(r"^\s*(?:\S+=\S+ )*(?:\.venv/bin/)?(?:python|torchrun)\b.*?"
                            r"\b(train/\w+\.py)(.*)", line.split("#")[0])
            if not run or run.group(1) not in claim or re.search(r"--help\b", run.group(2)):
                continue
            folder = re.search(r"--out-dir[ =](\S+)", run.group(2))
            key = (run.group(1), folder.group(1) if folder else None)
            if key in seen and not re.search(r"--overwrite|--resume", run.group(2)):
                again.append(f"{where}: {line.strip()}")
            seen.add(key)
    assert not again, "runs into the folder of a run above them, without --overwrite:\n" + \
        "\n".join(again)


def test_the_fsdp_step_continues_its_own_run_with_resume_and_says_how_otherwise(
        tmp_path, data_cache):
    out = tmp_path / "run"
    fsdp = SCRIPTS["fsdp"]
    run_script(fsdp, *TINY, "--max-steps", "1", "--out-dir", out, env=script_env(data_cache))
    proc = run(fsdp, *TINY, "--max-steps", "2", "--out-dir", out, COURSE_DATA_CACHE=data_cache)
    error_line(proc, "(checkpoints/, final_model.pt, summary.json, vocab.txt): continue it with --resume "
                     "auto, delete them with --overwrite, or choose another --out-dir")
    proc = run(fsdp, *TINY, "--max-steps", "2", "--out-dir", out, "--resume", "auto",
               "--overwrite", COURSE_DATA_CACHE=data_cache)
    error_line(proc, "--overwrite deletes the checkpoints that --resume continues from")
    proc = run_script(fsdp, *TINY, "--max-steps", "2", "--out-dir", out, "--resume", "auto",
                      env=script_env(data_cache))
    assert "resumed from" in proc.stdout
    # a restarted run (torchrun, a requeued Slurm job) continues in its folder without a flag
    run_script(DDP, *TINY, "--max-steps", "1", "--out-dir", tmp_path / "ddp",
               env=script_env(data_cache))
    run_script(DDP, *TINY, "--max-steps", "1", "--out-dir", tmp_path / "ddp",
               env=script_env(data_cache, SLURM_RESTART_COUNT=1))


def test_a_restart_of_a_run_started_with_overwrite_continues_from_its_checkpoints(
        tmp_path, data_cache):
    # a requeued `sbatch fsdp_training.sbatch --overwrite` (or torchrun --max-restarts) starts
    # the script again with the same arguments: --overwrite must not delete what it resumes from
    out, fsdp = tmp_path / "run", SCRIPTS["fsdp"]
    (out / "checkpoints").mkdir(parents=True)
    (out / "summary.json").write_text("{}")  # an earlier run's: the first start deletes it
    first = run_script(fsdp, *TINY, "--max-steps", "2", "--checkpoint-every", "1", "--out-dir",
                       out, "--overwrite", env=script_env(data_cache))
    assert "--overwrite: deleted the earlier run's summary.json" in first.stdout
    again = run_script(fsdp, *TINY, "--max-steps", "3", "--out-dir", out, "--overwrite",
                       env=script_env(data_cache, SLURM_RESTART_COUNT=1))
    assert "this is Slurm restart 1 of the run that wrote them" in again.stdout
    assert "resumed from" in again.stdout and "at step 2" in again.stdout, again.stdout
    assert json.loads((out / "summary.json").read_text())["steps"] == 3


def start_and_wait_for_the_lock(cmd, out: Path, env: dict) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not (out / "run.lock").is_file() or not (out / "run.lock").read_text().strip():
        assert proc.poll() is None and time.monotonic() < deadline, "the first run did not start"
        time.sleep(0.05)
    return proc


def test_a_second_run_in_a_busy_folder_stops_at_once_naming_the_first(tmp_path, data_cache):
    out = tmp_path / "run"
    env = script_env(data_cache, SLURM_JOB_ID="1001")  # e.g. two array tasks, one --out-dir
    first = start_and_wait_for_the_lock(
        [sys.executable, DDP, *TINY, "--epochs", "1000", "--out-dir", str(out)], out, env)
    try:
        start = time.monotonic()
        proc = run(DDP, *TINY, "--out-dir", out, env=script_env(data_cache, SLURM_JOB_ID="1002"))
        line = error_line(proc, f"error: --out-dir {out} is in use by another run (pid "
                                f"{first.pid} on {socket.gethostname()}, Slurm job 1001, started ",
                          "wait until it ends, or choose another --out-dir")
        assert "to_distributed_training.py --preset tiny" in line
        assert time.monotonic() - start < 60
    finally:
        first.kill()
        first.wait()


def test_the_lock_of_a_killed_run_is_recognised_as_stale_and_taken_over(tmp_path, data_cache):
    out = tmp_path / "run"
    env = script_env(data_cache)
    first = start_and_wait_for_the_lock(
        [sys.executable, DDP, *TINY, "--epochs", "1000", "--out-dir", str(out)], out, env)
    first.kill()  # SIGKILL: no chance to delete the lock
    first.wait()
    assert (out / "run.lock").is_file()
    proc = run_script(DDP, *TINY, "--max-steps", "1", "--out-dir", out, "--overwrite", env=env)
    notes = [line for line in proc.stdout.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and notes[0].startswith(
        f"note: {out / 'run.lock'} was left by a run that ended without releasing it (pid "
        f"{first.pid} on ")
    assert notes[0].endswith("its process is gone, so this run takes the folder over")
    assert not (out / "run.lock").exists()  # released at the end


def test_a_lock_from_another_host_is_stale_when_its_job_ended_or_it_stopped_refreshing(
        tmp_path, monkeypatch):
    from utils import run_lock
    lock = tmp_path / "run.lock"
    holder = {"host": "elsewhere", "pid": 1, "slurm_job": "77", "token": "t",
              "started": "earlier", "command": "x.py"}
    lock.write_text(json.dumps(holder))
    monkeypatch.setattr(run_lock, "_slurm_job_runs", lambda job: None)  # no squeue here
    assert run_lock.why_stale(holder, lock) is None  # refreshed just now: may still run
    os.utime(lock, (time.time() - 300, time.time() - 300))
    assert run_lock.why_stale(holder, lock) == "it was last refreshed 300 s ago"
    monkeypatch.setattr(run_lock, "_slurm_job_runs", lambda job: False)
    assert run_lock.why_stale(holder, lock) == "Slurm job 77 has ended"
    monkeypatch.setattr(run_lock, "_slurm_job_runs", lambda job: True)
    assert run_lock.why_stale(holder, lock) is None
    # a requeued job (the same job id) takes its own lock over at once
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    assert run_lock._same_run(holder, run_lock._this_run())


# ---------------------------------------------------------------------------- summary.json
def test_a_summary_with_nan_values_is_still_valid_json(tmp_path, data_cache):
    # --max-steps 0 trains nothing: no tokens/s, no MFU (NaN inside the script)
    run_script(DDP, *TINY, "--max-steps", "0", "--out-dir", tmp_path / "run",
               env=script_env(data_cache))
    text = (tmp_path / "run" / "summary.json").read_text()

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    summary = json.loads(text, parse_constant=refuse)
    assert summary["tokens_per_s"] is None and summary["mfu"] is None
    assert summary["steps"] == 0 and summary["test_loss"] > 0


# ---------------------------------------------------------------------------- process group
def test_a_rank_without_rank_0_fails_within_the_timeout_naming_the_address(tmp_path):
    port = free_port()
    start = time.monotonic()
    proc = run(DDP, *TINY, "--out-dir", tmp_path / "run", RANK=1, WORLD_SIZE=2, LOCAL_RANK=1,
               MASTER_ADDR="127.0.0.1", MASTER_PORT=port, DIST_TIMEOUT_MINUTES=0.05)
    error_line(proc, "error: rank 1 of 2 waited 0:00:03 for rank 0 at MASTER_ADDR:MASTER_PORT "
                     f"127.0.0.1:{port}", "DIST_TIMEOUT_MINUTES")
    assert time.monotonic() - start < 45


def test_while_a_rank_waits_it_says_for_whom_at_intervals(tmp_path):
    port = free_port()
    proc = run(DDP, *TINY, "--out-dir", tmp_path / "run", RANK=1, WORLD_SIZE=2, LOCAL_RANK=1,
               MASTER_ADDR="127.0.0.1", MASTER_PORT=port, DIST_TIMEOUT_MINUTES=0.05)
    assert proc.returncode == 1
    assert f"rank 1 of 2: waiting for rank 0 at 127.0.0.1:{port}, 1 s of 3 s" in proc.stdout
    proc = run(DDP, *TINY, "--out-dir", tmp_path / "run", RANK=0, WORLD_SIZE=2, LOCAL_RANK=0,
               MASTER_ADDR="127.0.0.1", MASTER_PORT=port, DIST_TIMEOUT_MINUTES=0.05)
    assert proc.returncode == 1
    assert f"rank 0 of 2: waiting for 1 of 2 ranks at 127.0.0.1:{port}, 1 s of 3 s" in proc.stdout


@pytest.fixture
def taken_port():
    """A port held by another program: it accepts connections and never answers."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("0.0.0.0", 0))
    server.listen()
    yield server.getsockname()[1]
    server.close()


@pytest.mark.parametrize("rank", [0, 1])
def test_a_master_port_taken_by_another_program_fails_within_seconds(tmp_path, taken_port, rank):
    start = time.monotonic()
    # the default timeout (5 minutes): the line must not wait for it
    proc = run(DDP, *TINY, "--out-dir", tmp_path / "run", RANK=rank, WORLD_SIZE=2,
               LOCAL_RANK=rank, MASTER_ADDR="127.0.0.1", MASTER_PORT=taken_port)
    if rank == 0:
        error_line(proc, f"error: MASTER_PORT {taken_port} is taken on {socket.gethostname()} by "
                         "another program", "choose another MASTER_PORT")
    else:
        error_line(proc, f"error: rank 1 of 2: a program answers at MASTER_ADDR:MASTER_PORT "
                         f"127.0.0.1:{taken_port} but it is not rank 0 of this run",
                   "choose another MASTER_PORT")
    assert time.monotonic() - start < 45  # seconds, not the 5-minute timeout


@pytest.mark.parametrize("env, says", [
    (dict(WORLD_SIZE="2"), "WORLD_SIZE=2 is set but RANK is not: start the script with torchrun"),
    (dict(RANK="1"), "RANK=1 is set but WORLD_SIZE is not"),
    (dict(RANK="one", WORLD_SIZE="2"), "RANK=one is not a whole number"),
    (dict(RANK="2", WORLD_SIZE="2"), "RANK=2 and WORLD_SIZE=2 do not fit: RANK must be 0 to "
                                     "WORLD_SIZE - 1"),
    (dict(RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500"),
     "RANK=1 and WORLD_SIZE=2 are set but LOCAL_RANK is not"),
    (dict(RANK="1", WORLD_SIZE="4", LOCAL_RANK="2", LOCAL_WORLD_SIZE="2",
          MASTER_ADDR="127.0.0.1", MASTER_PORT="29500"),
     "LOCAL_RANK=2 does not fit RANK=1 and LOCAL_WORLD_SIZE=2"),
    (dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
          MASTER_PORT="99999"), "MASTER_PORT=99999 is not a port (1 to 65535)"),
    (dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
          MASTER_PORT="auto"), "MASTER_PORT=auto is not a port"),
    (dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="no-such-node.invalid",
          MASTER_PORT="29500"), "MASTER_ADDR=no-such-node.invalid does not resolve to an address"),
    (dict(DIST_TIMEOUT_MINUTES="five"), "DIST_TIMEOUT_MINUTES=five is not a number of minutes"),
    (dict(DIST_TIMEOUT_MINUTES="-1"), "DIST_TIMEOUT_MINUTES=-1 is not a number of minutes"),
], ids=["world-without-rank", "rank-without-world", "rank-not-a-number", "rank-too-big",
        "no-local-rank", "local-rank-too-big", "port-too-big", "port-not-a-number",
        "address-unknown", "timeout-not-a-number", "timeout-negative"])
def test_every_launch_variable_is_checked_before_anything_waits_on_it(monkeypatch, env, says):
    from utils.launch import check_launch_environment
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "DIST_TIMEOUT_MINUTES"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as stop:
        check_launch_environment()
    assert str(stop.value.code).startswith("error: ") and says in str(stop.value.code)
    assert "\n" not in str(stop.value.code)


def test_world_size_without_rank_no_longer_trains_as_one_process(tmp_path):
    proc = run(DDP, *TINY, "--out-dir", tmp_path / "run", WORLD_SIZE=2)
    error_line(proc, "error: WORLD_SIZE=2 is set but RANK is not")
    proc = run(DDP, *TINY, "--out-dir", tmp_path / "run", DIST_TIMEOUT_MINUTES="five")
    error_line(proc, "error: DIST_TIMEOUT_MINUTES=five is not a number of minutes above 0")


def test_torchrun_restarts_without_the_store_fix_are_named_as_the_likely_cause(monkeypatch,
                                                                              capsys):
    import torch.distributed as dist
    from utils import launch
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    launch.warn_about_torchrun_restarts()  # at the first start: a warning, before any hang
    assert "export it before torchrun" in capsys.readouterr().err
    # a restarted worker whose process group fails: the line names the variable, not a rank
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")

    def refused(*args, **kwargs):
        raise RuntimeError("Gloo connectFullMesh failed with ... Connection refused")

    monkeypatch.setattr(dist, "init_process_group", refused)
    with pytest.raises(SystemExit) as stop:
        launch.init_process_group_or_exit("gloo", timeout=launch.dist_timeout())
    assert "after torchrun restart 1" in stop.value.code
    assert "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun" in stop.value.code


def test_lightning_with_a_task_that_never_starts_stops_with_one_line(tmp_path, data_cache):
    # srun started only task 0 of 2 (the other's node failed): it waits DIST_TIMEOUT_MINUTES
    one_of_two = dict(SLURM_JOB_ID="77", SLURM_JOB_NAME="Lit_training", SLURM_NTASKS="2",
                      SLURM_NNODES="1", SLURM_JOB_NUM_NODES="1", SLURM_NTASKS_PER_NODE="2",
                      SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0",
                      SLURM_STEP_NUM_TASKS="2", SLURM_NODELIST="localhost",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port())
    start = time.monotonic()
    proc = run(SCRIPTS["lit"], *TINY, "--accelerator", "cpu", "--out-dir", tmp_path / "run",
               COURSE_DATA_CACHE=data_cache, DIST_TIMEOUT_MINUTES=0.05, **one_of_two)
    error_line(proc, "error: process 0 of 2 could not reach the other processes at "
                     "MASTER_ADDR:MASTER_PORT 127.0.0.1:", "1/2 clients joined",
               "start every task with srun", strict=False)
    assert time.monotonic() - start < 90


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


def test_on_a_gpu_losses_are_read_at_the_next_save_or_log_step_and_the_first_bad_step_named(
        monkeypatch, tmp_path, capsys):
    """Reading a GPU tensor waits for the GPU: stop_if_not_finite keeps GPU losses unread
    (here CPU tensors stand in for them) until a save, a log step or the validation loss."""
    from utils import checks
    from utils.distributed_utils import save0
    monkeypatch.setattr(checks, "_on_gpu", lambda loss: isinstance(loss, torch.Tensor))
    monkeypatch.setattr(checks, "_unread", [])
    for step, loss in enumerate([2.0, float("nan"), float("inf")], 1):
        checks.stop_if_not_finite(torch.tensor(loss), step)  # kept, not read: no stop yet
    assert [step for step, _, _ in checks._unread] == [1, 2, 3]
    with pytest.raises(SystemExit):
        save0(torch.nn.Linear(2, 2), tmp_path / "model.pt")
    assert "error: the training loss is nan at step 2: training diverged" in capsys.readouterr().err
    assert not (tmp_path / "model.pt").exists() and checks._unread == []
    # finite losses are read (once, all together) by the validation check and let it pass
    checks.stop_if_not_finite(torch.tensor(1.0), 4)
    checks.stop_if_not_finite(3.5, 4, "validation loss")
    assert checks._unread == []
    # a run that never logs or saves still reads them every UNREAD_LIMIT steps
    monkeypatch.setattr(checks, "UNREAD_LIMIT", 3)
    checks.stop_if_not_finite(torch.tensor(1.0), 5)
    checks.stop_if_not_finite(torch.tensor(1.0), 6)
    with pytest.raises(SystemExit):
        checks.stop_if_not_finite(torch.tensor(float("nan")), 7)
