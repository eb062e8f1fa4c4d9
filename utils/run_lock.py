"""One run per output folder: OUT_DIR/run.lock names the run that owns the folder.

Two runs writing into one folder (two array tasks with the same --out-dir, a job submitted
again while the first still runs) would interleave their checkpoints and overwrite each
other's files. The first run's rank 0 creates run.lock (atomically: O_CREAT | O_EXCL, which
shared file systems honour) with its host, process id, Slurm job id and torchrun run id; the
second run finds it and stops with one line naming the first. The lock is deleted when the
run ends, also after an error; a run that was killed leaves it behind, and the next run
recognises it as stale:
- the same run started again (a torchrun restart: the same run id; a requeued Slurm job: the
  same job id) takes it over;
- on the same host: its process is gone (or its id now belongs to another process);
- from another host: its Slurm job no longer runs (squeue), or, without Slurm, the holder
  stopped refreshing it (every 30 s) more than STALE_AFTER_S ago.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from utils.files import disk_full_message, is_disk_full

LOCK_FILE = "run.lock"
HEARTBEAT_S = 30
STALE_AFTER_S = 120


def _process_start(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot), or None if there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        try:
            os.kill(pid, 0)  # no /proc (macOS): only whether it exists
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "?"
    return stat.rsplit(")", 1)[1].split()[19]  # field 22, after the command in parentheses


def _this_run() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "pid_start": _process_start(os.getpid()),
            "slurm_job": os.environ.get("SLURM_JOB_ID"),
            "torchrun": os.environ.get("TORCHELASTIC_RUN_ID"),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:300],
            "token": uuid.uuid4().hex}


def describe(holder: dict) -> str:
    """`pid 123 on host n01, Slurm job 77, started 2025-01-02 10:11:12: fsdp_training.py ...`"""
    job = f", Slurm job {holder['slurm_job']}" if holder.get("slurm_job") else ""
    return (f"pid {holder.get('pid')} on {holder.get('host')}{job}, started "
            f"{holder.get('started')}: {holder.get('command')}")


def _same_run(holder: dict, me: dict) -> bool:
    return bool((me["slurm_job"] and holder.get("slurm_job") == me["slurm_job"])
                or (me["torchrun"] and holder.get("torchrun") == me["torchrun"]))


def _slurm_job_runs(job: str) -> bool | None:
    """Whether Slurm job `job` is still pending or running; None if squeue cannot tell."""
    if not shutil.which("squeue"):
        return None
    try:
        proc = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True,
                              text=True, timeout=15)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return False if "Invalid job id" in proc.stderr else None
    return bool(proc.stdout.strip())


def why_stale(holder: dict, lock: Path) -> str | None:
    """Why the run that wrote `holder` no longer runs, or None if it may still."""
    if holder.get("host") == socket.gethostname():
        start = _process_start(int(holder.get("pid", 0)))
        if start is None or start not in ("?", holder.get("pid_start")):
            return "its process is gone"
        return None
    if holder.get("slurm_job"):
        runs = _slurm_job_runs(holder["slurm_job"])
        if runs is not None:
            return None if runs else f"Slurm job {holder['slurm_job']} has ended"
    age = time.time() - lock.stat().st_mtime
    return f"it was last refreshed {age:.0f} s ago" if age > STALE_AFTER_S else None


def _read(lock: Path) -> dict | None:
    try:
        return json.loads(lock.read_text())
    except (OSError, ValueError):
        return None


def take(out_dir: str | os.PathLike, say=print) -> str | None:
    """Make this process the owner of `out_dir` (call it on one rank only, before any file is
    written there). Returns None, or one line naming the run that owns it."""
    lock = Path(out_dir) / LOCK_FILE
    me = _this_run()
    # the folders this creates: deleted again if the run ends before writing anything there
    created = [p for p in (lock.parent, *lock.parent.parents) if not p.exists()]
    for _ in range(20):
        try:
            lock.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            pass
        else:
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(json.dumps(me, indent=1) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as e:  # a full disk (creating a file needs no space, writing does)
                lock.unlink(missing_ok=True)
                for folder in created:
                    with contextlib.suppress(OSError):
                        folder.rmdir()
                if is_disk_full(e):
                    return disk_full_message(lock)
                raise
            _keep(lock, me["token"], created)
            return None
        holder = _read(lock)
        if holder is None:  # being written right now (or emptied by a crash): look again
            if lock.exists() and time.time() - lock.stat().st_mtime < 5:
                time.sleep(0.2)
                continue
            holder = {}
        stale = "" if _same_run(holder, me) else (why_stale(holder, lock) if holder else
                                                  "it is empty")
        if stale is None:
            return (f"--out-dir {out_dir} is in use by another run ({describe(holder)}): wait "
                    f"until it ends, or choose another --out-dir (if that run is gone, delete "
                    f"{lock})")
        if _remove_if_unchanged(lock, holder) and stale:
            say(f"note: {lock} was left by a run that ended without releasing it "
                f"({describe(holder)}): {stale}, so this run takes the folder over")
    return f"could not take {lock}: another run keeps taking it; choose another --out-dir"


def _remove_if_unchanged(lock: Path, holder: dict) -> bool:
    """Delete `lock` if it still holds `holder` (another run may have replaced it meanwhile:
    rename it aside first, check, and put it back if it is not the one judged stale)."""
    aside = lock.with_name(f".{LOCK_FILE}.{uuid.uuid4().hex}")
    try:
        os.rename(lock, aside)
    except FileNotFoundError:
        return False
    if (_read(aside) or {}).get("token") != holder.get("token"):
        with contextlib.suppress(OSError):
            os.rename(aside, lock)
        return False
    aside.unlink(missing_ok=True)
    return True


def _keep(lock: Path, token: str, created: list[Path]) -> None:
    """Refresh the lock while this process lives; delete it when the process ends, and the
    folders made for it if the run left nothing else there."""
    def ours() -> bool:
        return (_read(lock) or {}).get("token") == token

    stop = threading.Event()

    def heartbeat():
        while not stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                if ours():
                    os.utime(lock)

    def release():
        stop.set()
        with contextlib.suppress(OSError):
            if ours():
                lock.unlink()
                for folder in created:  # innermost first; rmdir refuses a folder with files
                    folder.rmdir()

    threading.Thread(target=heartbeat, daemon=True, name="run-lock-heartbeat").start()
    atexit.register(release)
