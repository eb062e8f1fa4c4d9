"""Test-only stand-in for `srun --kill-on-bad-exit=1` on one node (nothing here is part of the
course): start N tasks of a command with the variables srun gives each task, pass SIGTERM on to
all of them (as scancel and a time limit do; SIGKILL after KILL_WAIT seconds, Slurm's KillWait),
and stop the others as soon as one fails. Exit status 1 if any task failed, else 0.

    python tests/faults/fake_srun.py N JOB_ID RESTART_COUNT -- python train/Lit_training.py ...
"""

import os
import signal
import socket
import subprocess
import sys
import time

KILL_WAIT = 5


def main() -> int:
    n, job, restarts = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    command = sys.argv[sys.argv.index("--") + 1:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tasks = []
    for rank in range(n):
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env.update(SLURM_JOB_ID=job, SLURM_JOB_NAME="fake", SLURM_NNODES="1",
                   SLURM_JOB_NUM_NODES="1", SLURM_NODELIST="localhost", SLURM_NTASKS=str(n),
                   SLURM_NTASKS_PER_NODE=str(n), SLURM_PROCID=str(rank),
                   SLURM_LOCALID=str(rank), SLURM_NODEID="0", SLURM_STEP_ID="0",
                   SLURM_STEP_NUM_TASKS=str(n), SLURM_RESTART_COUNT=restarts,
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        # a process group per task: like Slurm (a cgroup per step), stopping a task stops every
        # process it started too
        tasks.append(subprocess.Popen(command, env=env, start_new_session=True))
    terminated = []

    def signal_all(sig, only_running=True):
        for t in tasks:
            if t.poll() is None or not only_running:
                try:
                    os.killpg(t.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass

    def terminate(signum, frame):
        terminated.append(time.monotonic())
        signal_all(signal.SIGTERM)

    signal.signal(signal.SIGTERM, terminate)
    failed = None
    while any(t.poll() is None for t in tasks):
        codes = [t.poll() for t in tasks]
        if failed is None and any(c not in (None, 0) for c in codes):
            failed = next(c for c in codes if c not in (None, 0))
            signal_all(signal.SIGKILL)  # --kill-on-bad-exit=1
        if terminated and time.monotonic() - terminated[0] > KILL_WAIT:
            signal_all(signal.SIGKILL)
        time.sleep(0.05)
    signal_all(signal.SIGKILL, only_running=False)  # what the tasks started and left behind
    return 1 if failed is not None or any(t.returncode for t in tasks) else 0


if __name__ == "__main__":
    sys.exit(main())
