"""Start a course script's ranks as torchrun would, but forked from a warm server that has
imported torch and the course's modules once (selfcheck/preload.py, as the self-check does):
a rank then starts in milliseconds instead of importing torch again (about 5 of the 6.5
seconds a tiny run of the DDP solution takes).

Each rank is its own process with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), its own stdout and stderr, and the script run as
__main__. When a rank fails the others are stopped, as torchrun does. What torchrun itself
does (restarts, its log folders, signals to the group) is not here: tests about launching use
torchrun.
"""

from __future__ import annotations

import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rank_main(script: str, argv: list[str], env: dict, out: str, err: str) -> None:
    """One rank, in the forked process: the script as `python script.py ARGV` would run it,
    its exit code as python's (a SystemExit's message on stderr, a crash's traceback)."""
    from selfcheck.runs import enter_rank
    enter_rank(env, out, err)
    # What a module computed from the environment when the server imported it is the
    # server's (the check's 15-s DIST_TIMEOUT_MINUTES): computed again from this rank's, as a
    # real start would
    import utils.distributed_utils as du
    from utils.launch import dist_timeout
    du.TIMEOUT = dist_timeout()
    sys.argv = [script, *argv]
    sys.path[0] = str((ROOT / script).parent)  # as `python script.py` sets it
    code = 0
    try:
        runpy.run_path(str(ROOT / script), run_name="__main__")
    except SystemExit as stop:
        if isinstance(stop.code, int) or stop.code is None:
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - a crash prints its traceback, as python does
        import traceback
        traceback.print_exc()
        code = 1
    import atexit
    atexit._run_exitfuncs()  # what the script registered, as at an interpreter's exit
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# Read when the interpreter or torch starts, which a forked rank skips: an environment that
# sets one of them differently from the warm server's (a sitecustomize on PYTHONPATH, a
# preloaded library, torch's or OpenMP's settings) needs a real start.
AT_START = ("PYTHON", "LD_", "TORCH", "OMP_", "MKL_", "KMP_", "CUDA_")
SAME_EITHER_WAY = {"PYTHONUNBUFFERED"}  # the ranks' output is line-buffered files anyway
# This process's environment as the session began (conftest.py imports this module first).
# The warm server is one per test process, shared by every test file it runs and by the
# self-check's runs: it starts under this environment only, never under the settings that one
# test module has set for a while (the GPU rehearsal's stand-in NVML on PYTHONPATH), which
# the ranks of every later file would otherwise inherit.
SESSION_ENV = dict(os.environ)


def _as_read(environ: dict) -> dict:
    """`environ` as a starting process understands it. torch's compiler writes its default
    cache folder into this process's environment the first time it compiles (any test that
    compiles in-process): that means what no setting means, not a change to start for."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    if environ.get("TORCHINDUCTOR_CACHE_DIR") == os.path.abspath(default_cache_dir()):
        return {k: v for k, v in environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    return environ


def needs_a_real_start(env: dict) -> str | None:
    """The first setting of `env` a warm rank would not honour, or None: one that differs from
    the server's, or, before the server has started, from the session's, or one that this
    process has changed since the session began (the server would start under it)."""
    from selfcheck.runs import SERVER_ENV, fork_server_environ
    started = fork_server_environ()
    server = _as_read(started or {**SESSION_ENV, **SERVER_ENV})
    now = _as_read({**os.environ, **SERVER_ENV})
    env = _as_read(env)
    for key in sorted(set(env) | set(server) | set(now)):
        if key.startswith(AT_START) and key not in SAME_EITHER_WAY and (
                env.get(key) != server.get(key) or not started and now.get(key) != server.get(key)):
            return key
    return None


def run(script: str, argv: list[str], nproc: int, env: dict, timeout: float
        ) -> subprocess.CompletedProcess:
    from selfcheck.runs import fork_context, free_port
    context = fork_context()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="warm-") as tmp:
        ranks = []
        for rank in range(nproc):
            rank_env = dict(env)
            if nproc > 1:
                rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                                LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0",
                                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            out, err = f"{tmp}/{rank}.out", f"{tmp}/{rank}.err"
            process = context.Process(target=_rank_main,
                                      args=(script, argv, rank_env, out, err), daemon=True)
            main = sys.modules["__main__"]  # the test runner's: the rank needs none of it
            sys.modules["__main__"] = types.ModuleType("__main__")
            try:
                process.start()
            finally:
                sys.modules["__main__"] = main
            ranks.append((process, out, err))
        deadline = time.monotonic() + timeout
        code = None
        while any(p.exitcode is None for p, _, _ in ranks):
            failed = [p.exitcode for p, _, _ in ranks if p.exitcode not in (None, 0)]
            if failed and code is None:
                code = failed[0]
                grace = time.monotonic() + 5  # torchrun stops the others at once; 5 s to flush
                deadline = min(deadline, grace)
            if time.monotonic() > deadline:
                for p, _, _ in ranks:
                    if p.exitcode is None:
                        try:
                            os.killpg(p.pid, signal.SIGKILL)
                        except (ProcessLookupError, PermissionError):
                            pass
                        p.kill()
                        p.join()
                if code is None:
                    raise subprocess.TimeoutExpired([script, *argv], timeout)
                break
            time.sleep(0.05)
        codes = [p.exitcode for p, _, _ in ranks]
        code = code if code is not None else next((c for c in codes if c), 0)
        stdout = "".join(Path(out).read_text(errors="replace") for _, out, _ in ranks)
        stderr = "".join(Path(err).read_text(errors="replace") for _, _, err in ranks)
    return subprocess.CompletedProcess([sys.executable, script, *argv], code, stdout, stderr)
