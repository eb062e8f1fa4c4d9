"""Submit the course's sbatch files to a Slurm cluster and wait for them, with a deadline.

Two kinds of cluster:
- local (default): the private two-node cluster that tests/slurm/cluster.sh starts on this
  machine (needs root). It is started once per test session and stopped at the end, unless
  another session still uses it or it was started by hand (`cluster.sh up`).
- external (SLURM_HARNESS=external): the Slurm on PATH, e.g. on a real cluster's login node.
  Account, partition and reservation come from SBATCH_ACCOUNT/SBATCH_PARTITION/SBATCH_RESERVATION.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CLUSTER_SH = HERE / "cluster.sh"
SKIP_EXIT_CODE = 77  # cluster.sh: "cannot run on this machine"

# Job states after which nothing changes any more.
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "PREEMPTED", "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT"}

SETUP_LINE = re.compile(
    r"setup: rank (?P<rank>\d+)/(?P<world_size>\d+) local_rank (?P<local_rank>\d+) "
    r"host (?P<host>\S+) device (?P<device>\S+) backend (?P<backend>\S+) "
    r"MASTER_ADDR=(?P<master_addr>\S*) MASTER_PORT=(?P<master_port>\d*)")
# (digits only for the port: two ranks printing at once can glue their lines together)
MASTER_LINE = re.compile(r"^MASTER_ADDR=(?P<addr>\S+) MASTER_PORT=(?P<port>\d+)$", re.M)


class ClusterUnavailable(Exception):
    """This machine cannot run a test cluster (not root, no apt, no network namespaces...)."""


def python_errors(log: str) -> list[str]:
    """The lines of a log that say what went wrong in Python: the last line of every traceback,
    argparse's `prog: error: ...`, the `error: ...` of sys.exit and python's "can't open file".
    Duplicates (one per rank) are dropped; torchrun's ChildFailedError, which only says that a
    worker failed, comes last."""
    found = []
    lines = log.splitlines()
    for i, line in enumerate(lines):
        text = re.sub(r"^\[\S+\]:", "", line).strip()  # torchrun --tee prefixes
        if (re.match(r"^([\w.-]+\.py: )?error: ", text)
                or re.search(r"python[\d.]*: can't open file", text)):
            found.append(text)
        elif line.startswith("Traceback (most recent call last)"):
            for nxt in lines[i + 1:]:
                if nxt and not nxt.startswith((" ", "\t")) and not nxt.startswith("Traceback"):
                    found.append(nxt.strip())
                    break
    found.sort(key=lambda e: "ChildFailedError" in e)  # stable: keeps the order otherwise
    return list(dict.fromkeys(found))


@dataclass
class Job:
    """A finished (or cancelled) batch job and its log."""
    id: str
    command: str            # the sbatch command line, for messages
    output: Path            # the job's log (stdout and stderr)
    state: str = "UNKNOWN"
    exit_code: str = ""     # Slurm's "code:signal"
    reason: str = ""
    node_list: str = ""
    elapsed: float = 0.0
    deadline: float = 0.0
    cancelled: str = ""     # why the harness cancelled it (deadline, queue wait), or ""
    fields: dict = field(default_factory=dict, repr=False)
    daemon_log: str = field(default="", repr=False)  # local cluster: what slurmd said

    @property
    def log(self) -> str:
        try:
            return self.output.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    @property
    def completed(self) -> bool:
        return self.state == "COMPLETED"

    def setup_lines(self) -> list[dict]:
        """The `setup: rank R/W ...` line of every training process, as dicts."""
        return [m.groupdict() for m in SETUP_LINE.finditer(self.log)]

    def master_line(self) -> dict | None:
        """The `MASTER_ADDR=... MASTER_PORT=...` line the sbatch file echoes, or None."""
        found = MASTER_LINE.findall(self.log)
        return {"addr": found[0][0], "port": found[0][1], "count": len(found)} if found else None

    def describe(self, tail: int = 60) -> str:
        """What happened, for an assertion message: state, Python error, end of the log."""
        head = (f"job {self.id} [{self.command}] ended {self.state} (exit {self.exit_code}"
                f"{', ' + self.reason if self.reason not in ('', 'None') else ''}) "
                f"after {self.elapsed:.0f} s on {self.node_list or 'no node'}")
        if self.cancelled:
            head = (f"job {self.id} [{self.command}] {self.cancelled}: cancelled with scancel "
                    f"(state {self.state})")
        errors = python_errors(self.log)
        parts = [head]
        if errors:
            parts.append("Python error: " + "\n              ".join(errors[:6]))
        elif self.state not in ("COMPLETED", "UNKNOWN"):
            parts.append("Python error: none found in the log")
        lines = self.log.splitlines()
        if not self.output.exists():
            parts.append(f"the job's log {self.output} was never written")
        if self.daemon_log and self.state != "COMPLETED":
            parts.append(f"--- Slurm daemons on this job ---\n{self.daemon_log}")
        parts.append(f"--- job log {self.output} (last {min(tail, len(lines))} of {len(lines)} "
                     f"lines) ---")
        parts.extend(lines[-tail:] or ["(empty)"])
        return "\n".join(parts)


class Cluster:
    """Client side of a Slurm cluster: sbatch, scontrol and scancel with a deadline per job."""

    def __init__(self, bin_dir: Path | None, state_dir: Path | None = None):
        self.bin_dir = bin_dir          # the local cluster's client wrappers, or None for PATH
        self.state_dir = state_dir
        self.local = bin_dir is not None
        # Longest wait in the queue before a job is cancelled (the deadline of a job counts from
        # its start). On the private cluster jobs wait only for another test session's jobs
        # (a --gres=gpu:4 job has a node's GPUs to itself); a real cluster may be busy.
        self.pending_limit = float(os.environ.get("SLURM_HARNESS_PENDING_LIMIT",
                                                  240 if self.local else 3600))

    # ---------------------------------------------------------------- life cycle
    @classmethod
    def start(cls) -> "Cluster":
        """The cluster for this session; raises ClusterUnavailable when none can be had."""
        if os.environ.get("SLURM_HARNESS", "local") == "external":
            if not shutil.which("sbatch"):
                raise ClusterUnavailable("SLURM_HARNESS=external but no sbatch on PATH")
            return cls(bin_dir=None)
        if sys.platform != "linux" or os.geteuid() != 0:
            raise ClusterUnavailable(
                "the local Slurm test cluster needs root on Linux (network namespaces, slurmd); "
                "run pytest as root, or SLURM_HARNESS=external on a cluster's login node")
        state = Path(os.environ.get("SLURM_HARNESS_DIR", "/tmp/slurm-harness"))
        cluster = cls(bin_dir=state / "bin", state_dir=state)
        # Up if needed, and a lease for this process: sessions running at once share the cluster.
        proc = cluster._cluster_sh("acquire", str(os.getpid()), timeout=240)
        if proc.returncode == SKIP_EXIT_CODE:
            raise ClusterUnavailable(proc.stderr.strip().splitlines()[-1])
        if proc.returncode != 0:
            raise RuntimeError(f"tests/slurm/cluster.sh acquire failed (exit {proc.returncode}):\n"
                               f"{proc.stdout}{proc.stderr}")
        return cluster

    def stop(self) -> None:
        """Give up this session's lease; the last one out stops the local cluster."""
        if self.local:
            self._cluster_sh("release", str(os.getpid()), timeout=120)

    def _cluster_sh(self, *args, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(CLUSTER_SH), *args], capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL,
                              env=dict(os.environ, SLURM_HARNESS_DIR=str(self.state_dir)))

    # ---------------------------------------------------------------- commands
    def command(self, name: str) -> str:
        return str(self.bin_dir / name) if self.bin_dir else name

    def run(self, name: str, *args, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        proc = subprocess.run([self.command(name), *map(str, args)], capture_output=True,
                              text=True, timeout=60, **kwargs)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{name} {shlex.join(map(str, args))} failed: {proc.stderr.strip()}")
        return proc

    def job_env(self, extra: dict | None = None) -> dict:
        """The environment sbatch hands to the job (it exports the submitter's by default).

        Slurm variables of an enclosing job are dropped; on the local cluster SBATCH_* too, so a
        reservation or account set for the real cluster does not leak in."""
        drop = ("SLURM_", "SBATCH_") if self.local else ("SLURM_",)
        env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
        # tests/conftest.py hides the GPUs from the test process: a job gets the submitter's.
        host_gpus = env.pop("COURSE_TESTS_HOST_CUDA_VISIBLE_DEVICES", "<unset>")
        env.pop("CUDA_VISIBLE_DEVICES", None)
        if host_gpus != "<unset>":
            env["CUDA_VISIBLE_DEVICES"] = host_gpus
        if "VENV" not in env and sys.prefix != sys.base_prefix:
            env["VENV"] = sys.prefix  # the jobs use the Python that runs the tests
        env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        env.update({k: str(v) for k, v in (extra or {}).items()})
        return env

    def submit(self, script: str | Path, *args, output: Path, sbatch_options=(),
               env: dict | None = None, cwd: Path = ROOT) -> str:
        """sbatch [options] --output OUTPUT SCRIPT ARGS from `cwd`; returns the job id."""
        output.parent.mkdir(parents=True, exist_ok=True)  # Slurm does not create it
        cmd = ["sbatch", "--parsable", f"--output={output}", *map(str, sbatch_options),
               str(script), *map(str, args)]
        proc = subprocess.run([self.command("sbatch"), *cmd[1:]], cwd=cwd, env=self.job_env(env),
                              capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise AssertionError(f"`{shlex.join(cmd)}` was refused: {proc.stderr.strip()}")
        return proc.stdout.strip().split(";")[0]

    def job_fields(self, job_id: str) -> dict | None:
        """`scontrol show job -o` as a dict, or None once Slurm has forgotten the job."""
        proc = self.run("scontrol", "show", "job", "-o", job_id, check=False)
        if proc.returncode != 0 or "JobId=" not in proc.stdout:
            return None
        return dict(re.findall(r"(\w+(?:/\w+)?)=(\S*)", proc.stdout))

    def wait(self, job_id: str, deadline: float, poll: float = 1.0) -> tuple[dict, str]:
        """Poll each `poll` seconds until the job has ended. Cancel it (scancel) when it has run
        for more than `deadline` seconds, or waited in the queue for more than pending_limit.
        Returns scontrol's fields and why it was cancelled ("" if it was not)."""
        submitted, started, cancelled_at, why = time.monotonic(), None, 0.0, ""
        fields: dict = {}
        while True:
            fields = self.job_fields(job_id) or fields
            state = fields.get("JobState", "")
            if state in FINAL_STATES:
                return fields, why
            now = time.monotonic()
            if started is None and state not in ("", "PENDING"):
                started = now
            if not why:
                if started is not None and now - started > deadline:
                    why = f"did not finish within its deadline of {deadline:.0f} s"
                elif started is None and now - submitted > self.pending_limit:
                    why = (f"was still waiting in the queue after {self.pending_limit:.0f} s "
                           f"(Reason={fields.get('Reason')})")
                if why:
                    self.run("scancel", job_id, check=False)
                    cancelled_at = now
            elif now - cancelled_at > 30:  # Slurm could not end it: give up
                return fields, why
            time.sleep(poll)

    def sbatch(self, script: str | Path, *args, output: Path, nodes: int | None = None,
               sbatch_options=(), env: dict | None = None, deadline: float = 180,
               cwd: Path = ROOT) -> Job:
        """Submit, wait (at most `deadline` seconds of running, then scancel), return the Job."""
        options = ([f"--nodes={nodes}"] if nodes else []) + list(sbatch_options)
        command = shlex.join(["sbatch", *options, str(script), *map(str, args)])
        start = time.monotonic()
        job_id = self.submit(script, *args, output=output, sbatch_options=options, env=env,
                             cwd=cwd)
        fields, cancelled = self.wait(job_id, deadline)
        return Job(id=job_id, command=command, output=output,
                   state=fields.get("JobState", "UNKNOWN"), exit_code=fields.get("ExitCode", ""),
                   reason=fields.get("Reason", ""), node_list=fields.get("NodeList", ""),
                   elapsed=time.monotonic() - start, deadline=deadline, cancelled=cancelled,
                   fields=fields, daemon_log=self.daemon_lines(job_id))

    def daemon_lines(self, job_id: str, limit: int = 12) -> str:
        """Error lines of the local cluster's daemon logs about this job (launch failures)."""
        if not self.local:
            return ""
        found = []
        about_job = re.compile(rf"\[{job_id}\.\w+\]|\b(JobId|job|StepId)[= _]?{job_id}\b")
        for path in sorted((self.state_dir / "log").glob("*.log")):
            for line in path.read_text(errors="replace").splitlines():
                if "error" in line and about_job.search(line):
                    found.append(f"{path.name}: {line}")
        return "\n".join(found[-limit:])

    # ---------------------------------------------------------------- node names
    def hostnames(self, node_list: str) -> list[str]:
        """`scontrol show hostnames`: node[1-2] -> [node1, node2]."""
        return self.run("scontrol", "show", "hostnames", node_list).stdout.split()

    def addresses(self) -> dict[str, str]:
        """Name -> address as the local cluster's DNS answers (nodeN and nodeNi); {} if external."""
        if not self.local:
            return {}
        dns_hosts = (self.state_dir / "etc" / "dns-hosts").read_text()
        pairs = (line.split() for line in dns_hosts.splitlines())
        return {name: addr for addr, name in pairs}
