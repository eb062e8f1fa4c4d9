"""Shared test helpers: run the course's scripts as real processes (plain python or torchrun)."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import warm_launch

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_WIKITEXT2_SMALL = ROOT.parent / "shared" / "data" / "wikitext-2-small"

# The CPU suite runs on the CPU, also on a GPU node: this process, every script it starts and
# every spawned worker see no GPU (else a two-rank test puts rank 1 on cuda:1, and in-process
# tests pick CUDA where they expect the CPU). Set before anything initialises CUDA; the
# original value is kept (for the children too) so that the GPU suite, tests/test_gpu.py, can
# hand the GPUs back to its own scripts with gpu_env().
HOST_CUDA_KEY = "COURSE_TESTS_HOST_CUDA_VISIBLE_DEVICES"
os.environ.setdefault(HOST_CUDA_KEY, os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"))
os.environ["CUDA_VISIBLE_DEVICES"] = ""


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    """`-n 2` (README, pytest-xdist): whole test files per test process, so a file's module
    fixtures (the check's warm fork server and reference runs) serve all its tests and the
    real-Slurm tests share one cluster; the GPU tests alone go one by one (see
    pytest_xdist_make_scheduler). Here rather than `--dist loadfile` in pyproject.toml: that
    would stop every pytest call where pytest-xdist is not installed."""
    if getattr(config.option, "dist", "no") == "load":  # what -n alone chooses
        config.option.dist = "loadfile"


# the self-check's steps (selfcheck.steps.ORDER), as its tests' ids begin: `[perf-42-...]`
CHECK_STEP_ID = re.compile(r"\[(ddp|sbatch|fsdp|tp|pp|perf-sbatch|perf|collectives|memory)[-\]]")


def xdist_scope(nodeid: str) -> str:
    """What one xdist process runs together: a test file, except for two files too long to be
    one. The GPU suite's tests on GPUs (`[gpu-...]`, the `on` fixture) spread over the
    processes: each script run there is a torchrun of about 20 s, mostly start-up, so `pytest
    -m gpu -n 4` takes a quarter of the time on a GPU node, where whole files would put all of
    them on one process (an H200, 2026-11-27: 10 tests in 197 s); in CI they are skipped, and
    the rehearsal stays whole. The self-check's cases go one step at a time: whole, the file
    kept one process busy for 35 of CI's 38 minutes (2102 s, 2026-11-28), as long as all the
    other files together on the other, and any case more made it the longest; a step's cases
    still share their process's warm fork server and reference runs."""
    path, _, test = nodeid.partition("::")
    if path.endswith("test_gpu.py") and "[gpu" in test:
        return nodeid
    step = CHECK_STEP_ID.search(test) if path.endswith("test_check.py") else None
    return f"{path}::{step.group(1)}" if step else path


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: unknown where it is not installed
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FilesButGpuTestsAlone(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return xdist_scope(nodeid)

    return FilesButGpuTestsAlone(config, log)


def script_env(cache_dir: Path | str | None = None, **extra) -> dict:
    """The environment for a script under test: offline, one thread per process, no Slurm,
    no GPU (see gpu_env for the GPU suite)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               PYTHONUNBUFFERED="1", WANDB_MODE="offline", CUDA_VISIBLE_DEVICES="")
    if cache_dir is not None:
        env["COURSE_DATA_CACHE"] = str(cache_dir)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def restore_host_gpus(env: dict) -> dict:
    """`env` with the GPUs this machine had before the test session hid them."""
    host = env.get(HOST_CUDA_KEY, os.environ[HOST_CUDA_KEY])
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if host != "<unset>":
        env["CUDA_VISIBLE_DEVICES"] = host
    return env


def gpu_env(cache_dir: Path | str | None = None, **extra) -> dict:
    """script_env for the GPU suite: the machine's GPUs visible again, and this checkout
    importable. A GPU node's Python need not have it installed (`pip install -e .`): there
    every script run failed with "No module named 'model'" before it reached the GPU."""
    env = restore_host_gpus(script_env(cache_dir, **extra))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


@functools.cache
def host_gpu_count() -> int:
    """CUDA GPUs torch can use on this machine (asked in a fresh process: this one hides them)."""
    import torch
    if torch.version.cuda is None:
        return 0
    proc = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                          env=gpu_env(), capture_output=True, text=True, timeout=120)
    return int(proc.stdout.split()[-1]) if proc.returncode == 0 and proc.stdout.strip() else 0


def no_gpu_reason() -> str | None:
    """Why the GPU suite cannot run here (one line), or None where it can."""
    import torch
    if torch.version.cuda is None:
        return f"no CUDA: torch {torch.__version__} is a CPU-only build"
    if host_gpu_count() == 0:
        return f"no CUDA GPU visible (torch {torch.__version__}, CUDA {torch.version.cuda})"
    return None


_warm_start = False  # this test module's runs fork from the warm server (the marker below)


@pytest.fixture(scope="module", autouse=True)
def _launch_of_this_module(request):
    """`pytestmark = pytest.mark.warm_start` in a test module: its run_script calls fork the
    ranks from a warm server (tests/warm_launch.py) instead of starting python or torchrun,
    which import torch again in every process (5 of the 6.5 s of a tiny run). For modules about
    what the scripts compute; modules about launching, signals or a process's memory start
    real processes. COURSE_TESTS_REAL_START=1 starts real processes everywhere."""
    global _warm_start
    _warm_start = (request.node.get_closest_marker("warm_start") is not None
                   and os.environ.get("COURSE_TESTS_REAL_START") != "1")
    yield
    _warm_start = False


def run_script(script: str, *args, nproc: int = 1, env: dict | None = None, timeout: float = 300,
               check: bool = True, torchrun_args=(), torchrun: bool | None = None
               ) -> subprocess.CompletedProcess:
    """Run a course script from the repository root: plain python for nproc=1, else torchrun
    (torchrun=True: torchrun also for one process). In a module marked warm_start the ranks
    are forked from a warm server with torchrun's environment instead, except where torchrun
    itself is asked for (torchrun=True, torchrun_args) or `env` sets what a process reads as it
    starts (tests/warm_launch.py: a sitecustomize on PYTHONPATH, torch's settings, the GPUs).

    With check, a failing run raises with the tail of its output in the message.
    """
    env = env or script_env()
    if _warm_start and not (torchrun or torchrun_args or warm_launch.needs_a_real_start(env)):
        proc = warm_launch.run(script, [str(a) for a in args], nproc, env, timeout)
        cmd = [f"(ranks forked warm, {nproc} x)", script, *map(str, args)]
    else:
        if not (torchrun or (torchrun is None and nproc > 1)):
            cmd = [sys.executable, script]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={nproc}", *torchrun_args, script]
        cmd += [str(a) for a in args]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited with {proc.returncode}\n"
                             f"--- stdout (tail)\n{proc.stdout[-3000:]}\n"
                             f"--- stderr (tail)\n{proc.stderr[-5000:]}")
    return proc


def load_script(script: str):
    """A course script (e.g. "solutions/train/tp_training.py") as a module, to call its
    functions; its main() does not run."""
    spec = importlib.util.spec_from_file_location(script.replace("/", "_"), ROOT / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_summary(out_dir: Path | str) -> dict:
    return json.loads((Path(out_dir) / "summary.json").read_text())


def load_dcp_like(folder: Path | str, like: dict) -> dict:
    """A DCP checkpoint loaded in this one process into tensors shaped like `like`'s, filled
    with NaN first: a key the checkpoint lacks stays NaN and fails any comparison."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    state = {k: torch.full_like(v, float("nan")) for k, v in like.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that no process group exists here
        dcp.load(state, checkpoint_id=Path(folder))
    return state


def assert_same_weights(got: dict, ref: dict, atol: float = 1e-4):
    """Two runs' weights agree after a few AdamW steps.

    AdamW divides each gradient element by its own running size, so a 1e-8 difference in the
    gradients becomes a ~1e-5 difference in the weights. Where a gradient element is itself near
    AdamW's eps (1e-8), its step g / (|g| + eps) is far more sensitive: one element in ten
    thousand may then miss `atol`, but never by more than ten times. A wrong split or a missing
    all-reduce moves most elements, and by far more.
    """
    assert got.keys() == ref.keys()
    for k, v in ref.items():
        diff = (got[k].float() - v.float()).abs()
        outliers = int((diff > atol).sum())
        assert outliers <= max(1, v.numel() // 10_000) and float(diff.max()) <= 10 * atol, (
            f"{k}: {outliers} of {v.numel()} elements differ by more than {atol:g} "
            f"(largest difference {float(diff.max()):.3g})")


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    """One tokenised-data cache for the whole session: each corpus is built once."""
    return tmp_path_factory.mktemp("data_cache")


@pytest.fixture(scope="session")
def wikitext2_dir() -> Path:
    """Real WikiText-2 text laid out as train/valid/test (CI: ../shared/data/wikitext-2-small)."""
    path = Path(os.environ.get("WIKITEXT2_DIR", DEFAULT_WIKITEXT2_SMALL))
    if not (path / "train.txt").is_file():
        pytest.skip(f"no WikiText-2 text at {path}: set WIKITEXT2_DIR to a folder with "
                    "train.txt, valid.txt and test.txt")
    return path
