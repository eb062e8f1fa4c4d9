"""The monitoring deck's TensorBoard screenshots, from real runs of the course.

    python tools/monitoring_figures.py [--data-dir ../shared/data/wikitext-2-small] [--out runs/figures]

1. Trains the runs the deck compares (CPU, gloo, the tiny preset):
   - data:      the DDP step on WikiText-2 text with --num-workers 0 against --num-workers 2
   - comm:      two ranks of DDP against two ranks of tensor parallelism (an all-reduce per layer)
   - straggler: two DDP ranks, each pinned to its own core, and for a while a busy loop on
                rank 1's core (a noisy neighbour on one node)
2. Starts a real `tensorboard --logdir` server (on a free port) over each group of runs, and
3. photographs it with headless Chromium (Debian's `chromium`) into slides/figures/monitoring-*.png.

Nothing is drawn by hand: what the slides show is what TensorBoard showed for these runs.
Timings depend on the machine (docs/monitoring.md quotes the one they were taken on).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "slides" / "figures"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--hide-scrollbars"]
TINY = ["--preset", "tiny", "--logger", "tensorboard", "--log-every", "10"]


def env(**extra) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
    e.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1")
    e.update({k: str(v) for k, v in extra.items()})
    return e


def run(cmd, **kwargs):
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run([str(c) for c in cmd], cwd=ROOT, check=True, env=kwargs.pop("env", env()),
                   stdout=subprocess.DEVNULL, **kwargs)


def torchrun(nproc, script, *args):
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
         script, *args])


def train_runs(out: Path, data_dir: Path) -> None:
    ddp = "solutions/train/to_distributed_training.py"
    for workers in (0, 2):
        run([sys.executable, ddp, *TINY, "--data-dir", data_dir, "--max-vocab", 4096, "--epochs", 3,
             "--num-workers", workers, "--out-dir", out / "data" / f"num-workers-{workers}"])
    torchrun(2, ddp, *TINY, "--dataset", "synthetic", "--max-steps", 300,
             "--out-dir", out / "comm" / "ddp-2-ranks")
    torchrun(2, "solutions/train/tp_training.py", *TINY, "--dataset", "synthetic",
             "--max-steps", 300, "--out-dir", out / "comm" / "tp-2-ranks")
    straggler(out / "straggler" / "ddp-2-ranks-busy-neighbour", ddp)


def straggler(out: Path, script: str) -> None:
    """Two ranks started by hand, each pinned to a core; a busy loop shares rank 1's core from
    the 4th to the 12th second."""
    port = 29000 + os.getpid() % 1000
    common = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=2, OMP_NUM_THREADS=1)
    cmd = [script, *TINY, "--dataset", "synthetic", "--max-steps", 900, "--out-dir", out]
    ranks = [subprocess.Popen(["taskset", "-c", str(rank), sys.executable, *map(str, cmd)],
                              cwd=ROOT, stdout=subprocess.DEVNULL,
                              env=env(**common, RANK=rank, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=2))
             for rank in (0, 1)]
    time.sleep(4)
    hog = subprocess.Popen(["taskset", "-c", "1", sys.executable, "-c", "while True: pass"])
    time.sleep(8)
    hog.kill()
    for p in ranks:
        if p.wait() != 0:
            raise SystemExit(f"a straggler-run rank failed ({p.args})")


class TensorBoard:
    """A real `tensorboard --logdir` on a port the OS picks."""

    def __init__(self, logdir: Path):
        self.proc = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir",
                                      str(logdir), "--host", "127.0.0.1", "--port", "0"],
                                     stderr=subprocess.PIPE, text=True, env=env())
        for line in self.proc.stderr:
            found = re.search(r"at (http://127\.0\.0\.1:\d+/)", line)
            if found:
                self.url = found.group(1)
                break
        else:
            raise SystemExit("tensorboard did not start")
        for _ in range(60):  # until it has read the runs
            with urllib.request.urlopen(self.url + "data/runs") as r:
                if len(r.read()) > 2:
                    break
            time.sleep(1)

    def close(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)


def screenshot(url: str, png: Path, size=(1400, 820)) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("no chromium: apt-get install chromium")
    with tempfile.TemporaryDirectory() as profile:  # a fresh profile every time
        subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                        f"--window-size={size[0]},{size[1]}", "--virtual-time-budget=20000",
                        f"--screenshot={png}", url], check=True, capture_output=True, timeout=180)
    print("wrote", png.relative_to(ROOT), flush=True)


def scalars_url(base: str, tags: str) -> str:
    return (base + "?darkMode=false#scalars&_smoothingWeight=0&tagFilter="
            + urllib.parse.quote(tags, safe=""))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data" / "wikitext-2-small")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "figures")
    p.add_argument("--skip-training", action="store_true", help="photograph the runs in --out again")
    args = p.parse_args()
    if not args.skip_training:
        shutil.rmtree(args.out, ignore_errors=True)
        train_runs(args.out, args.data_dir.resolve())
    shots = [("data", "train/(data_wait|tokens_per_s|step_s)", "monitoring-data.png"),
             ("comm", "train/(tokens_per_s|mfu|step_s|data_wait)", "monitoring-comm.png"),
             ("straggler", "ranks/|train/step_s", "monitoring-straggler.png"),
             ("straggler", "system/", "monitoring-system.png")]
    for group, tags, name in shots:
        tensorboard = TensorBoard(args.out / group)
        try:
            screenshot(scalars_url(tensorboard.url, tags), FIGURES / name)
        finally:
            tensorboard.close()
    tensorboard = TensorBoard(args.out)
    try:
        # wide enough for the final/* columns after the flags
        screenshot(tensorboard.url + "?darkMode=false#hparams", FIGURES / "monitoring-hparams.png",
                   size=(2400, 700))
    finally:
        tensorboard.close()


if __name__ == "__main__":
    main()
