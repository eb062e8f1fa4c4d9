"""Shared test helpers: run the course's scripts as real processes (plain python or torchrun)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_WIKITEXT2_SMALL = ROOT.parent / "shared" / "data" / "wikitext-2-small"


def script_env(cache_dir: Path | str | None = None, **extra) -> dict:
    """The environment for a script under test: offline, one thread per process, no Slurm."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               PYTHONUNBUFFERED="1", WANDB_MODE="offline")
    if cache_dir is not None:
        env["COURSE_DATA_CACHE"] = str(cache_dir)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_script(script: str, *args, nproc: int = 1, env: dict | None = None, timeout: float = 300,
               check: bool = True, torchrun_args=()) -> subprocess.CompletedProcess:
    """Run a course script from the repository root: plain python for nproc=1, else torchrun.

    With check, a failing run raises with the tail of its output in the message.
    """
    if nproc == 1:
        cmd = [sys.executable, script]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", *torchrun_args, script]
    cmd += [str(a) for a in args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env or script_env(), capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited with {proc.returncode}\n"
                             f"--- stdout (tail)\n{proc.stdout[-3000:]}\n"
                             f"--- stderr (tail)\n{proc.stderr[-5000:]}")
    return proc


def read_summary(out_dir: Path | str) -> dict:
    return json.loads((Path(out_dir) / "summary.json").read_text())


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
