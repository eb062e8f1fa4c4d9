"""Running a script the way torchrun would, through the probe, and the reference runs.

A run starts one process per rank itself (no torchrun agent: a second faster, and each rank's
output lands in a file of its own), with the variables torchrun would set. It can pretend to be
two nodes with one process each (LOCAL_RANK 0 on both, as on a cluster) or one node with two.
When a rank fails, the others get a few seconds to fail on their own and are then stopped; a
rank that waits long after the others have finished is asked for its stack first (SIGUSR1),
so the check can say where it was waiting.

Reference runs (the solution, usually in one process) are kept in a cache and reused while
the solution, utils/, model/ and the probe stay the same: a participant's second check is
faster, and the tests run each reference once.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 150         # seconds a whole run may take (tiny model, two short epochs)
HANG_AFTER = 20       # seconds a rank may go on after another one has finished
FAIL_GRACE = 4        # seconds the other ranks get to fail on their own after a failure
# A collective that one rank never joins fails after this long (15 s), with a traceback that
# shows where the waiting rank was (the lessons' default is minutes).
DIST_TIMEOUT_MINUTES = "0.25"
# The peak FLOP/s every checked run divides by (PEAK_FLOPS overrides peak_flops): known, so
# the check can recompute every MFU a script prints, and odd, so it can find it printed.
PEAK_FLOPS = 2.5e10  # small: the tiny model's MFU on a CPU is then a few per cent


def cache_root() -> Path:
    """Where the check keeps reference runs and the last run of every step (never the repo)."""
    base = os.environ.get("COURSE_CHECK_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "course-check")
    return Path(base)


@dataclass(frozen=True)
class Geometry:
    """How the ranks are laid out: `nodes` pretend nodes with `per_node` processes each."""
    nodes: int = 1
    per_node: int = 1

    @property
    def world(self) -> int:
        return self.nodes * self.per_node

    def __str__(self) -> str:
        if self.world == 1:
            return "1 process"
        if self.nodes == 1:
            return f"{self.per_node} processes on one node"
        return f"{self.nodes} nodes x {self.per_node} process{'es' if self.per_node > 1 else ''}"


ONE = Geometry(1, 1)
TWO_NODES = Geometry(2, 1)
ONE_NODE_TWO = Geometry(1, 2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_taken(output: str) -> bool:
    """Whether rank 0 could not listen on its MASTER_PORT: torch's own EADDRINUSE, or the
    course's one-line error for it (utils/launch.py)."""
    return "EADDRINUSE" in output or "so rank 0 cannot listen there" in output


def child_env(dump_dir: Path, extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_", "TORCHELASTIC_", "PET_"))
           and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                         "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               PYTHONUNBUFFERED="1", CHECK_DUMP_DIR=str(dump_dir), PEAK_FLOPS=str(PEAK_FLOPS),
               DIST_TIMEOUT_MINUTES=DIST_TIMEOUT_MINUTES, CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                          if p))
    env.update(extra or {})
    return env


class Rank:
    """One rank's process, forked from the check's fork server: torch is imported there once,
    so a rank starts in milliseconds. Its output (stdout and stderr) goes to `log`."""

    def __init__(self, probe_args: list[str], env: dict, log: Path):
        self.process = fork_context().Process(target=rank_main, args=(probe_args, env, str(log)),
                                              daemon=True)
        # multiprocessing would import the caller's main module again in the child (a test
        # runner, a participant's script calling the check): the rank needs none of it
        main = sys.modules["__main__"]
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            self.process.start()
        finally:
            sys.modules["__main__"] = main

    def poll(self) -> int | None:
        return self.process.exitcode

    def signal(self, sig) -> None:
        try:
            os.kill(self.process.pid, sig)
        except (ProcessLookupError, TypeError):
            pass

    def kill(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # the rank and anything it started
        except (ProcessLookupError, PermissionError):
            pass
        self.process.kill()
        self.process.join()


def enter_rank(env: dict, out: str, err: str | None = None, cwd: Path = ROOT) -> None:
    """The start of a rank, in the forked process: its own session (so that killing it kills
    what it started), its output in a file (stderr in `err`, or with stdout), its environment
    and its working folder. (Also tests/warm_launch.py's ranks.)"""
    os.setsid()
    for fd, path in ((1, out), (2, err)):
        if path is None:
            os.dup2(1, 2)
            continue
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)


def rank_main(probe_args: list[str], env: dict, log: str) -> None:
    """A rank of the check: enter_rank, then the probe. It works in its run's folder: a file
    the script writes to a relative path lands there (the check names it), not in the
    participant's checkout, and two runs at once do not write into one folder."""
    enter_rank(env, log, cwd=Path(log).parent)
    import selfcheck.probe
    selfcheck.probe.MODULES_AT_FORK = frozenset(sys.modules)
    selfcheck.probe.main(probe_args)


_FORK_CONTEXT = None
_SERVER_ENVIRON: dict | None = None
# what the fork server imports torch under (what only counts at import time); the rest of its
# environment is the caller's
SERVER_ENV = dict(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
                  DIST_TIMEOUT_MINUTES=DIST_TIMEOUT_MINUTES, HF_HUB_OFFLINE="1",
                  HF_DATASETS_OFFLINE="1")


def fork_server_environ() -> dict | None:
    """The environment the fork server started under (None before it started): what its
    forked processes read at start, whatever the caller's environment is by now."""
    return _SERVER_ENVIRON


def fork_context():
    """multiprocessing's fork server, started once per check (or test session) with torch,
    utils and the probe imported; the settings that only count at import time are set first."""
    global _FORK_CONTEXT, _SERVER_ENVIRON
    if _FORK_CONTEXT is None:
        import multiprocessing
        from multiprocessing import forkserver
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["selfcheck.preload"])
        saved = {k: os.environ.get(k) for k in SERVER_ENV}
        os.environ.update(SERVER_ENV)
        try:
            forkserver.ensure_running()
            _SERVER_ENVIRON = dict(os.environ)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        _FORK_CONTEXT = context
    return _FORK_CONTEXT


def code_digest() -> str:
    """What a reference run depends on besides its script and arguments."""
    h = hashlib.sha1()
    for folder in ("utils", "model"):
        for f in sorted((ROOT / folder).glob("*.py")):
            h.update(f.read_bytes())
    for name in ("probe.py", "standin.py"):
        h.update((ROOT / "selfcheck" / name).read_bytes())
    try:
        import torch
        h.update(torch.__version__.encode())
    except ImportError:
        pass
    return h.hexdigest()[:16]


class Run:
    """One run of `script` through the probe: start it now, wait() for it later."""

    def __init__(self, work: Path, name: str, script: Path, batch: int, extra=(),
                 geometry: Geometry = ONE, env: dict | None = None, reference: bool = False,
                 eval_probe: bool = False, optional: dict | None = None, gpu: bool = False):
        self.name, self.script, self.geometry = name, Path(script), geometry
        self.dir = work / name.replace(" ", "-")  # a folder name a shell takes as one word
        self.out = self.dir / "out"
        self.procs, self.store = [], None
        self.args = run_args(work / "data", self.dir / "cache", self.out, batch, extra)
        if gpu:  # a stand-in GPU: the script takes its GPU branches (selfcheck/standin.py)
            env = {**(env or {}), "CHECK_STANDIN_GPU": "1"}
        if optional:  # {flag: how many values}: dropped by the probe if the script lacks it
            env = {**(env or {}), "CHECK_OPTIONAL_FLAGS": ",".join(
                f"{flag}={n}" for flag, n in optional.items())}
        if reference:
            key = hashlib.sha1(repr((self.script.read_text(), batch, list(extra), str(geometry),
                                     sorted((env or {}).items()), eval_probe, code_digest()))
                               .encode()).hexdigest()[:20]
            cache = os.environ.get("CHECK_REFERENCE_CACHE") or cache_root() / "reference"
            self.store = Path(cache) / key
            if (self.store / "done").is_file():
                self.dir, self.out = self.store, self.store / "out"
                self.procs = None
                return
        self.start(env or {}, eval_probe)

    def start(self, env: dict, eval_probe: bool) -> None:
        self.start_args = (env, eval_probe)
        dump = self.dir / "dump"
        dump.mkdir(parents=True, exist_ok=True)
        port = free_port()
        self.started = time.monotonic()
        probe_args = [str(self.script), *self.args, *(["--eval-probe"] if eval_probe else [])]
        for rank in range(self.geometry.world):
            node, local = divmod(rank, self.geometry.per_node)
            rank_env = child_env(dump, env)
            if self.geometry.world > 1:
                rank_env.update(RANK=str(rank), LOCAL_RANK=str(local),
                                WORLD_SIZE=str(self.geometry.world),
                                LOCAL_WORLD_SIZE=str(self.geometry.per_node),
                                GROUP_RANK=str(node), ROLE_RANK=str(rank), NODE_RANK=str(node),
                                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            self.procs.append(Rank(probe_args, rank_env, self.dir / f"rank{rank}.out"))

    # ------------------------------------------------------------------------------ waiting
    def wait(self) -> Run:
        if self.procs is not None:
            for _attempt in range(3):
                self.ended = self.supervise()
                self.write_output()
                if not self.port_was_taken():
                    break
                # another program took the free port between our choice and rank 0's listen
                for f in self.dir.glob("rank*.*"):
                    f.unlink()
                for f in (self.dir / "dump").glob("*"):
                    f.unlink()
                self.procs = []
                self.start(*self.start_args)
        self.load()
        if self.store is not None and self.procs is not None and not self.crashed:
            partial = self.store.with_name(self.store.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            shutil.copytree(self.dir, partial)
            (partial / "done").write_text("")
            shutil.rmtree(self.store, ignore_errors=True)
            os.replace(partial, self.store)
        return self

    def supervise(self) -> dict:
        """Wait for every rank; returns {rank: "exit <code>" | "hung" | "timeout"}."""
        ended, first_failure, first_success = {}, None, None
        while len(ended) < len(self.procs):
            now = time.monotonic()
            for rank, proc in enumerate(self.procs):
                if rank in ended:
                    continue
                code = proc.poll()
                if code is not None:
                    ended[rank] = f"exit {code}"
                    if code != 0 and first_failure is None:
                        first_failure = now
                    if code == 0 and first_success is None:
                        first_success = now
            running = [r for r in range(len(self.procs)) if r not in ended]
            if not running:
                break
            reason = None
            if now - self.started > TIMEOUT:
                reason = "timeout"
            elif first_failure is not None and now - first_failure > FAIL_GRACE:
                reason = "stopped"   # another rank failed first
            elif first_success is not None and now - first_success > HANG_AFTER:
                reason = "hung"      # waits for a rank that has already finished
            if reason:
                self.stop(running, ended, reason)
                break
            time.sleep(0.05)
        return ended

    def stop(self, running, ended, reason) -> None:
        for rank in running:
            self.procs[rank].signal(signal.SIGUSR1)  # the probe writes its stack
        time.sleep(0.5)
        for rank in running:
            self.procs[rank].kill()
            ended[rank] = reason

    def port_was_taken(self) -> bool:
        text = (self.dir / "rank0.out").read_text(errors="replace") if (
            self.dir / "rank0.out").is_file() else ""
        dump = self.dir / "dump" / "rank0.json"
        if dump.is_file():
            text += dump.read_text(errors="replace")
        return self.geometry.world > 1 and port_taken(text)

    def write_output(self) -> None:
        """All ranks' output in one file, each line marked with its rank (for the participant)."""
        lines = []
        for rank in range(self.geometry.world):
            log = self.dir / f"rank{rank}.out"
            text = log.read_text(errors="replace") if log.is_file() else ""
            if not log.is_file():
                log.write_text("")
            prefix = f"[rank{rank}] " if self.geometry.world > 1 else ""
            lines += [prefix + line for line in text.splitlines()]
        (self.dir / "output.txt").write_text("\n".join(lines) + "\n")
        (self.dir / "ended.json").write_text(json.dumps(self.ended))

    def load(self) -> None:
        self.output = (self.dir / "output.txt").read_text(errors="replace")
        self.outputs = [(self.dir / f"rank{r}.out").read_text(errors="replace")
                        for r in range(self.geometry.world)]
        self.ended = json.loads((self.dir / "ended.json").read_text())
        self.ended = {int(k): v for k, v in self.ended.items()}
        self.ranks = []
        for r in range(self.geometry.world):
            f = self.dir / "dump" / f"rank{r}.json"
            try:
                self.ranks.append(json.loads(f.read_text()) if f.is_file() else None)
            except ValueError:
                self.ranks.append(None)
        self.stacks = [(self.dir / "dump" / f"rank{r}.stack").read_text(errors="replace")
                       if (self.dir / "dump" / f"rank{r}.stack").is_file() else ""
                       for r in range(self.geometry.world)]
        f = self.out / "summary.json"
        try:
            self.summary = json.loads(f.read_text()) if f.is_file() else None
        except ValueError:
            self.summary = None

    @property
    def crashed(self) -> bool:
        return (any(v != "exit 0" for v in self.ended.values()) or self.summary is None
                or any(r is None for r in self.ranks))

    @property
    def failure(self):
        from selfcheck.failures import analyse
        return analyse(self)


SEQ_LEN = 16
EPOCHS = 2


def run_args(data_dir, cache_dir, out_dir, batch, extra=()):
    """The arguments every checked run gets: a tiny model on the tiny corpus (write_tiny_text),
    no dropout, two epochs, every step logged. `extra` comes last and wins."""
    return ["--data-dir", str(data_dir), "--cache-dir", str(cache_dir), "--out-dir", str(out_dir),
            "--preset", "tiny", "--seq-len", str(SEQ_LEN), "--dropout", "0", "--epochs",
            str(EPOCHS), "--batch-size", str(batch), "--logger", "none", "--log-every", "1",
            "--num-workers", "0", "--device", "cpu", *extra]


def write_tiny_text(folder: Path) -> Path:
    """A made-up corpus with a skewed word distribution: 40 training windows of SEQ_LEN."""
    import random
    rng = random.Random(1234)
    words = [f"w{i}" for i in range(40)]
    weights = [1.0 / (i + 1) for i in range(40)]
    folder.mkdir(parents=True, exist_ok=True)
    for split, n_tokens in (("train", 40 * SEQ_LEN + 1), ("valid", 11 * SEQ_LEN + 1),
                            ("test", 7 * SEQ_LEN + 1)):
        lines, count = [], 0
        while count < n_tokens:
            k = rng.randint(4, 12)
            lines.append(" ".join(rng.choices(words, weights, k=k)))
            count += k + 1
        (folder / f"{split}.txt").write_text("\n".join(lines) + "\n")
    return folder
