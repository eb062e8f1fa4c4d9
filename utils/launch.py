"""The launch environment of a training process, checked before anything waits on it.

torchrun (or srun, or a hand-made launch) tells each process who it is through environment
variables: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; DIST_TIMEOUT_MINUTES bounds
every wait. A variable that is missing, malformed or out of range would make a process train
as something else or wait forever: each ends the run with one line instead (exit status 1).

Every wait for other processes prints what it waits for at intervals
(`rank 0 of 2: waiting for 1 of 2 ranks at HOST:PORT, 30 s of 300 s`), and ends with one line
at DIST_TIMEOUT_MINUTES.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import socket
import sys
import threading
import time
from typing import NoReturn

DEFAULT_TIMEOUT_MINUTES = 5.0


def tell_torchrun(line: str) -> None:
    """Hand torchrun this process's error line, so that its report of a failed run shows it.

    Under torchrun a one-line error is printed near the top, and torchrun's report of the
    failure (ChildFailedError, about 40 lines) follows it: "Root Cause ... traceback : To enable
    traceback see ...". torchrun reads each process's error file (TORCHELASTIC_ERROR_FILE, the
    file torch's own @record writes) into that report: with this line in it, the bottom of the
    output says what to change. Nothing without torchrun, and the first line a process gives wins.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    stamp = str(int(time.time()))
    try:
        with open(path, "w") as f:  # the format of torch's ErrorHandler.record_exception
            json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                  "timestamp": stamp}}}, f)
    except OSError:
        pass  # the line is printed anyway


def exit_with_error(message: str) -> NoReturn:
    """End the process with `error: MESSAGE` (exit status 1), also in torchrun's report."""
    tell_torchrun(f"error: {message}")
    sys.exit(f"error: {message}")


def dist_timeout_problem() -> str | None:
    text = os.environ.get("DIST_TIMEOUT_MINUTES", "")
    if not text:
        return None
    try:
        minutes = float(text)
    except ValueError:
        minutes = math.nan
    if not (math.isfinite(minutes) and minutes > 0):
        return (f"DIST_TIMEOUT_MINUTES={text} is not a number of minutes above 0: set it to e.g. "
                f"5 (the default), or more for huge checkpoints, or unset it")
    return None


def dist_timeout() -> datetime.timedelta:
    """DIST_TIMEOUT_MINUTES (default 5) as a timedelta; the default if it is malformed
    (check_launch_environment says so in one line)."""
    minutes = DEFAULT_TIMEOUT_MINUTES if dist_timeout_problem() else \
        float(os.environ.get("DIST_TIMEOUT_MINUTES") or DEFAULT_TIMEOUT_MINUTES)
    return datetime.timedelta(minutes=minutes)


def _whole(name: str) -> int:
    text = os.environ[name]
    try:
        return int(text)
    except ValueError:
        exit_with_error(f"{name}={text} is not a whole number: start the script with torchrun (it sets "
              "RANK, LOCAL_RANK and WORLD_SIZE), or unset them to run one process")


def check_launch_environment(rank_variables: bool = True) -> None:
    """Stop with one line unless the variables describe a launch that can work: none of RANK
    and WORLD_SIZE (one process), or RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
    all set, whole numbers in range, the address resolvable, the port a port; and
    DIST_TIMEOUT_MINUTES, if set, a positive number. rank_variables=False checks only the
    last (Lightning sets the others itself, its own way)."""
    problem = dist_timeout_problem()
    if problem:
        exit_with_error(problem)
    env = os.environ
    if not rank_variables or ("RANK" not in env and "WORLD_SIZE" not in env):
        return
    if "RANK" not in env or "WORLD_SIZE" not in env:
        given, missing = ("WORLD_SIZE", "RANK") if "RANK" not in env else ("RANK", "WORLD_SIZE")
        exit_with_error(f"{given}={env[given]} is set but {missing} is not: start the script with torchrun "
              f"(it sets both), or unset {given} to run one process")
    rank, world_size = _whole("RANK"), _whole("WORLD_SIZE")
    if world_size < 1 or not 0 <= rank < world_size:
        exit_with_error(f"RANK={rank} and WORLD_SIZE={world_size} do not fit: RANK must be 0 to "
              "WORLD_SIZE - 1 (torchrun sets both)")
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK") if not env.get(v)]
    if missing and (world_size > 1 or "MASTER_ADDR" in missing or "MASTER_PORT" in missing):
        names = ", ".join(missing[:-1]) + (" and " if len(missing) > 1 else "") + missing[-1]
        exit_with_error(f"RANK={rank} and WORLD_SIZE={world_size} are set but {names} "
              f"{'is' if len(missing) == 1 else 'are'} not: start the script with torchrun (it "
              "sets them), or unset RANK and WORLD_SIZE to run one process")
    local_rank = _whole("LOCAL_RANK") if env.get("LOCAL_RANK") else 0
    local_world = int(env["LOCAL_WORLD_SIZE"]) if env.get("LOCAL_WORLD_SIZE", "").isdigit() \
        else world_size
    if not 0 <= local_rank < local_world or local_rank > rank:
        exit_with_error(f"LOCAL_RANK={local_rank} does not fit RANK={rank} and "
              f"{'LOCAL_WORLD_SIZE' if env.get('LOCAL_WORLD_SIZE') else 'WORLD_SIZE'}="
              f"{local_world}: it must be 0 to the processes per node - 1 (torchrun sets it)")
    port_text = env["MASTER_PORT"]
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        exit_with_error(f"MASTER_PORT={port_text} is not a port (1 to 65535): the sbatch files derive it "
              "from the job id, torchrun --standalone picks a free one")
    addr = env["MASTER_ADDR"]
    try:
        socket.getaddrinfo(addr, int(port_text))
    except (socket.gaierror, UnicodeError) as e:
        exit_with_error(f"MASTER_ADDR={addr} does not resolve to an address here "
              f"({getattr(e, 'strerror', None) or e}): use the first node of the job "
              "(scontrol show hostnames, as the sbatch files do) or its IP address")


def warn_about_torchrun_restarts() -> None:
    """torchrun --max-restarts without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: restarted workers
    may read the dead workers' addresses from torchrun's store and hang or fail to connect
    (pytorch/pytorch#135712). Only torchrun's environment can fix it: say so at the start."""
    if (os.environ.get("TORCHELASTIC_RUN_ID") and os.environ.get("RANK") == "0"
            and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS") or 0) > 0
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            and os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1"):
        print("WARNING: torchrun restarts workers (--max-restarts), but "
              "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 is not set: restarted workers may hang or "
              "fail to connect (pytorch/pytorch#135712); export it before torchrun",
              file=sys.stderr, flush=True)


def restart_count() -> tuple[int, str]:
    """(restarts, by whom): how often this run was started again by torchrun (--max-restarts,
    after a rank died) or by Slurm (a requeued job); (0, "") for a first start."""
    for variable, launcher in (("TORCHELASTIC_RESTART_COUNT", "torchrun"),
                               ("SLURM_RESTART_COUNT", "Slurm")):
        count = int(os.environ.get(variable) or 0)
        if count:
            return count, launcher
    return 0, ""


def _interval(timeout_s: float) -> float:
    """How often a wait says what it waits for: every 30 s, more often for short timeouts."""
    return min(30.0, max(1.0, timeout_s / 10))


def _endpoint(addr: str, port: int | str) -> str:
    return f"MASTER_ADDR:MASTER_PORT {addr}:{port}"


def rendezvous_store(rank: int, world_size: int, addr: str, port: int,
                     timeout: datetime.timedelta):
    """The TCPStore through which the processes of a launch without torchrun (srun, by hand)
    find each other, once all of them are there; rank 0 serves it at MASTER_ADDR:MASTER_PORT.

    Rank 0 fails at once with one line when the port is taken; the others when the program
    that answers there is not rank 0's store. Every rank prints what it waits for at
    intervals, and stops with one line after `timeout`.
    """
    import torch.distributed as dist
    seconds = timeout.total_seconds()
    start = time.monotonic()
    if rank == 0:
        try:
            store = dist.TCPStore(addr, port, world_size, is_master=True, timeout=timeout,
                                  wait_for_workers=False)
        except (RuntimeError, ValueError) as e:
            if "EADDRINUSE" in str(e) or "address already in use" in str(e).lower():
                exit_with_error(f"MASTER_PORT {port} is taken on {socket.gethostname()} by another "
                      f"program, so rank 0 cannot listen there: choose another MASTER_PORT (the "
                      f"sbatch files derive it from the job id), or find the program with "
                      f"ss -ltnp 'sport = :{port}'")
            raise
    else:
        store = _connect_to_rank_0(rank, world_size, addr, port, seconds, start)
    store.add("course/joined", 1)
    next_report = start + _interval(seconds)
    while (joined := store.add("course/joined", 0)) < world_size:
        now = time.monotonic()
        if now - start >= seconds:
            who = "the other ranks" if rank == 0 else "the other ranks and rank 0"
            exit_with_error(f"rank {rank} of {world_size} waited {timeout} for {who} at "
                  f"{_endpoint(addr, port)}, and {world_size - joined} of {world_size} never "
                  f"came ({joined}/{world_size} joined): start every rank together (torchrun, "
                  "or srun in the sbatch file), or raise DIST_TIMEOUT_MINUTES")
        if now >= next_report:
            print(f"rank {rank} of {world_size}: waiting for {world_size - joined} of "
                  f"{world_size} ranks at {addr}:{port}, {now - start:.0f} s of {seconds:.0f} s",
                  flush=True)
            next_report += _interval(seconds)
        time.sleep(0.1)
    return store


def _connect_to_rank_0(rank, world_size, addr, port, seconds, start):
    import torch.distributed as dist
    next_report = start + _interval(seconds)
    while True:  # until rank 0 listens
        try:
            socket.create_connection((addr, port), timeout=1).close()
            break
        except OSError:
            pass
        now = time.monotonic()
        if now - start >= seconds:
            exit_with_error(f"rank {rank} of {world_size} waited "
                  f"{datetime.timedelta(seconds=round(seconds))} for rank 0 at "
                  f"{_endpoint(addr, port)}, and nothing answered there: start every rank "
                  "together (torchrun, or srun in the sbatch file), check MASTER_ADDR, or raise "
                  "DIST_TIMEOUT_MINUTES")
        if now >= next_report:
            print(f"rank {rank} of {world_size}: waiting for rank 0 at {addr}:{port}, "
                  f"{now - start:.0f} s of {seconds:.0f} s", flush=True)
            next_report += _interval(seconds)
        time.sleep(min(1.0, max(0.05, start + seconds - time.monotonic())))
    # Something listens. A TCPStore client talking to another program waits forever whatever
    # its timeout, so connect in a thread and give up after a few seconds.
    result = []

    def connect():
        try:
            result.append(dist.TCPStore(addr, port, world_size, is_master=False,
                                        timeout=datetime.timedelta(seconds=seconds)))
        except Exception as e:  # noqa: BLE001 - reported below
            result.append(e)

    probe = threading.Thread(target=connect, daemon=True)
    probe.start()
    probe.join(min(5.0, max(2.0, seconds)))
    if not result:
        exit_with_error(f"rank {rank} of {world_size}: a program answers at {_endpoint(addr, port)} but "
              "it is not rank 0 of this run (another program holds MASTER_PORT, or an older "
              "run): choose another MASTER_PORT for every rank, or check MASTER_ADDR")
    if isinstance(result[0], Exception):
        reason = str(result[0]).strip().splitlines()[0][:200]
        exit_with_error(f"rank {rank} of {world_size} could not join rank 0 at {_endpoint(addr, port)} "
              f"({reason}): start every rank together, or check MASTER_ADDR and MASTER_PORT")
    return result[0]


class WaitReporter:
    """While a wait we cannot look into runs (the process group's start under torchrun), say
    at intervals what this process waits for, and end it with `line` (exit status 1) if it
    outlasts `timeout` by half (torch's own timeout should have fired by then)."""

    def __init__(self, what: str, timeout: datetime.timedelta, line: str):
        self.what, self.seconds, self.line = what, timeout.total_seconds(), line
        self.done = threading.Event()

    def __enter__(self):
        threading.Thread(target=self._watch, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.done.set()

    def _watch(self):
        start = time.monotonic()
        while not self.done.wait(_interval(self.seconds)):
            waited = time.monotonic() - start
            if waited >= 1.5 * self.seconds:
                print(f"error: {self.line}", file=sys.stderr, flush=True)
                os._exit(1)
            print(f"{self.what}, {waited:.0f} s of {self.seconds:.0f} s", flush=True)


def init_process_group_or_exit(backend: str, **kwargs) -> None:
    """dist.init_process_group, but a rendezvous that fails (no rank 0 at MASTER_ADDR:MASTER_PORT,
    ranks missing, the port taken by another program) ends the process with one line instead
    of a traceback or a silent hang, and every wait says at intervals what it waits for.

    Without torchrun (srun, or by hand) the processes meet in a store of our own
    (rendezvous_store, above), whose waits we can see into. Every wait is bounded by
    `timeout` (default: DIST_TIMEOUT_MINUTES).
    """
    import torch.distributed as dist
    timeout = kwargs.get("timeout") or dist_timeout()
    rank, world_size = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if "store" not in kwargs and "TORCHELASTIC_RUN_ID" not in os.environ:
        kwargs.update(store=rendezvous_store(int(rank), int(world_size), addr, int(port), timeout),
                      rank=int(rank), world_size=int(world_size))
    waited = "for the other ranks" if rank == "0" else "for rank 0"
    advice = "start every rank together (torchrun, or srun in the sbatch file), or raise " \
             "DIST_TIMEOUT_MINUTES"
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart != "0" and os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1":
        # the likely cause of a failed restart (pytorch/pytorch#135712), not a missing rank
        waited += f" after torchrun restart {restart}"
        advice = "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun: restarted " \
                 "workers otherwise meet the dead workers' addresses (pytorch/pytorch#135712)"
    where = f"MASTER_ADDR:MASTER_PORT {addr}:{port}"
    try:
        if int(world_size) > 1:
            with WaitReporter(f"rank {rank} of {world_size}: waiting {waited} at {addr}:{port} "
                              "to start the process group", timeout,
                              f"rank {rank} of {world_size} waited {timeout} {waited} at {where}:"
                              f" {advice}"):
                dist.init_process_group(backend, **kwargs)
        else:
            dist.init_process_group(backend, **kwargs)
    except (ValueError, RuntimeError) as e:  # DistError is a RuntimeError
        reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        exit_with_error(f"rank {rank} of {world_size} waited {timeout} {waited} at {where} "
                        f"({reason.rstrip('.')}): {advice}")
