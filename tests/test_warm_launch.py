"""tests/warm_launch.py, the lesson tests' way of starting a script's ranks: forked from a warm
server, they train exactly as under torchrun, report a failing rank as torchrun does, and an
environment a forked rank could not honour gets a real start."""

import os
import subprocess
import sys

import pytest

import warm_launch
from conftest import ROOT, read_summary, script_env

SOLUTION = "solutions/train/to_distributed_training.py"
ARGS = ["--dataset", "synthetic", "--preset", "tiny", "--dropout", "0", "--logger", "none",
        "--seed", "3", "--max-steps", "4", "--batch-size", "4", "--log-every", "1"]


def test_two_warm_ranks_train_exactly_as_two_ranks_under_torchrun(tmp_path, data_cache):
    env = script_env(cache_dir=data_cache)
    warm = warm_launch.run(SOLUTION, [*ARGS, "--out-dir", str(tmp_path / "warm")], 2, env, 240)
    assert warm.returncode == 0, warm.stderr[-3000:]
    real = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=2", SOLUTION, *ARGS, "--out-dir",
                           str(tmp_path / "real")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)
    assert real.returncode == 0, real.stderr[-3000:]
    a, b = read_summary(tmp_path / "warm"), read_summary(tmp_path / "real")
    assert a["world_size"] == b["world_size"] == 2
    assert a["loss_history"] == b["loss_history"] and a["val_loss"] == b["val_loss"]
    assert "world size 2" in warm.stdout  # rank 0's lines come back on stdout


def test_a_failing_rank_gives_its_exit_code_and_its_message_on_stderr(tmp_path, data_cache):
    env = script_env(cache_dir=data_cache)
    proc = warm_launch.run(SOLUTION, [*ARGS, "--batch-size", "0", "--out-dir", str(tmp_path)],
                           2, env, 120)
    assert proc.returncode == 2  # argparse's, as python's would be
    assert "--batch-size" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("setting", [
    {"PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "faults"), str(ROOT)])},
    {"TORCHINDUCTOR_CACHE_DIR": "/tmp/elsewhere"},
    {"OMP_NUM_THREADS": "2"},
    {"CUDA_VISIBLE_DEVICES": "0"}])
def test_what_a_process_reads_as_it_starts_gets_a_real_start(setting):
    assert warm_launch.needs_a_real_start(script_env()) is None
    assert warm_launch.needs_a_real_start({**script_env(), **setting}) == next(iter(setting))


def test_a_warm_rank_waits_for_the_others_as_long_as_its_environment_says(tmp_path):
    """The fork server imported the course's helpers under the check's 15-s timeout: a warm
    rank gets the default 5 minutes, or its own DIST_TIMEOUT_MINUTES, as a real start does."""
    script = tmp_path / "timeout.py"
    script.write_text("from utils.distributed_utils import TIMEOUT\n"
                      "print(TIMEOUT.total_seconds())\n")
    env = script_env()
    env.pop("DIST_TIMEOUT_MINUTES", None)
    assert warm_launch.run(str(script), [], 1, env, 120).stdout.split() == ["300.0"]
    env["DIST_TIMEOUT_MINUTES"] = "2"
    assert warm_launch.run(str(script), [], 1, env, 120).stdout.split() == ["120.0"]


def imported_sitecustomize(rank, world_size):
    import sys
    return getattr(sys.modules.get("sitecustomize"), "MARK", None)


def test_settings_a_test_module_set_for_a_while_reach_its_ranks_and_never_the_warm_server(
        tmp_path, monkeypatch):
    """One warm server serves a whole test process: the self-check's cases, then a file whose
    module fixture puts a stand-in on PYTHONPATH (the GPU rehearsal's NVML), then the next
    file. The stand-in's ranks start for real and load it; the server, whoever started it
    first, never does."""
    from distributed import run_distributed
    from selfcheck.runs import fork_context, fork_server_environ
    fork_context()  # as a self-check case before this test would have
    (tmp_path / "sitecustomize.py").write_text("MARK = 'stand-in loaded'\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(ROOT)]))
    assert warm_launch.needs_a_real_start(script_env()) == "PYTHONPATH"
    assert run_distributed(imported_sitecustomize, 1) == ["stand-in loaded"]
    monkeypatch.undo()
    assert warm_launch.needs_a_real_start(script_env()) is None
    assert str(tmp_path) not in fork_server_environ().get("PYTHONPATH", "")
    assert run_distributed(imported_sitecustomize, 1) == [None]


def test_before_the_warm_server_starts_a_test_modules_settings_get_a_real_start(monkeypatch):
    """The server starts at the first warm rank of a test process: not under a setting that a
    module put in place for a while, even for a rank whose own environment lacks it."""
    from selfcheck import runs
    monkeypatch.setattr(runs, "_SERVER_ENVIRON", None)  # as in a test process just begun
    assert warm_launch.needs_a_real_start(script_env()) is None
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/elsewhere")
    assert warm_launch.needs_a_real_start(script_env()) == "TORCHINDUCTOR_CACHE_DIR"
    session = {k: v for k, v in script_env().items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    assert warm_launch.needs_a_real_start(session) == "TORCHINDUCTOR_CACHE_DIR"


@pytest.mark.parametrize("server", ["not started yet", "started"])
def test_torchs_compiler_writing_its_default_cache_folder_into_the_environment_needs_no_real_start(
        server, monkeypatch):
    """The first torch.compile in a test process sets TORCHINDUCTOR_CACHE_DIR to the folder a
    rank would use anyway: the process's later warm ranks stay warm (CI once failed here)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir
    from selfcheck import runs
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(runs, "_SERVER_ENVIRON", None if server == "not started yet"
                        else {**os.environ, **runs.SERVER_ENV})  # before any compile
    cache_dir()  # what inductor does as it compiles
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == os.path.abspath(default_cache_dir())
    assert warm_launch.needs_a_real_start(script_env()) is None
    assert warm_launch.needs_a_real_start({**script_env(), "TORCHINDUCTOR_CACHE_DIR": "/x"}) \
        == "TORCHINDUCTOR_CACHE_DIR"
