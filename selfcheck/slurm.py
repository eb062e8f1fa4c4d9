"""A job file run as Slurm would run it, with stand-ins for the cluster's commands.

`submit()` reads the file's #SBATCH lines like sbatch (nodes, tasks per node, GPUs, CPUs; options
given on the command line win), sets the variables a job sees (SLURM_*, CUDA_VISIBLE_DEVICES for
the GPUs asked for), and runs the file with bash. Stand-ins on PATH record what would start:
    scontrol   prints the job's node names, one line at a time (as a big job's list arrives:
               a reader that stops early, `head -n 1`, kills it with SIGPIPE)
    nslookup   answers the InfiniBand names <node>i it was given, NXDOMAIN for the rest
    getent     the same names (getent hosts NAME), "not found" for the rest
    srun       starts its command once per task on every node (SLURM_NODEID, SLURM_PROCID, ...)
    torchrun   records its arguments and how many processes it would start (gpu: the GPUs
               visible to it), starts nothing
    python     records its arguments (a process srun starts directly); python -m
               torch.distributed.run is torchrun
    nsys       records its arguments, writes the report (refusing to overwrite one without
               --force-overwrite=true, as nsys does), then records the program it wraps
Every record is one JSON line in the job's launch log: `Job.launches`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

STANDIN = r'''#!PYTHON
import json, os, sys, time
name, args = os.path.basename(sys.argv[0]), sys.argv[1:]
env = os.environ

def log(**entry):
    entry.update(cmd=name, node=int(env.get("SLURM_NODEID", -1)),
                 task=int(env.get("SLURM_LOCALID", -1)), args=args)
    with open(env["FAKE_LOG"], "a") as f:
        f.write(json.dumps(entry) + "\n")

def option(names, default=None, words=None):
    """The value of --name=value / --name value / -n value in `words`."""
    words = args if words is None else words
    for i, a in enumerate(words):
        for n in names:
            if a == n and i + 1 < len(words):
                return words[i + 1]
            if a.startswith(n + "=") and n.startswith("--"):
                return a.split("=", 1)[1]
    return default

nodes = env["FAKE_NODES"].split()
if name == "python" and args[:2] == ["-m", "torch.distributed.run"]:
    name, args = "torchrun", args[2:]  # torchrun's own module: the same program
if name == "scontrol":
    # scontrol takes a prefix of a subcommand of 5 letters or more: show hostname(s)
    if len(args) > 1 and args[0] == "show" and len(args[1]) >= 5 and \
            "hostnames".startswith(args[1].lower()):
        try:
            for n in nodes:
                sys.stdout.write(n + "\n")
                sys.stdout.flush()
                time.sleep(0.05)
        except BrokenPipeError:
            os._exit(141)  # what SIGPIPE does to the real one
    sys.exit(0)
if name == "nslookup":
    dns = dict(e.split("=", 1) for e in env.get("FAKE_DNS", "").split() if "=" in e)
    host = args[-1] if args else ""
    if host in dns:
        print(f"Server:\t\t127.0.0.53\nAddress:\t127.0.0.53#53\n\nName:\t{host}\nAddress: {dns[host]}")
        sys.exit(0)
    print(f"** server can't find {host}: NXDOMAIN")
    sys.exit(1)
if name == "getent":  # getent hosts|ahosts NAME: the same names through the resolver
    dns = dict(e.split("=", 1) for e in env.get("FAKE_DNS", "").split() if "=" in e)
    host = args[-1] if len(args) > 1 else ""
    if host not in dns or args[0] not in ("hosts", "ahosts", "ahostsv4"):
        sys.exit(2)  # getent's "not found"
    if args[0] == "hosts":
        print(f"{dns[host]:<15} {host}")
    else:
        print(f"{dns[host]:<15} STREAM {host}\n{dns[host]:<15} DGRAM\n{dns[host]:<15} RAW")
    sys.exit(0)
if name == "srun":
    i = 0
    words = []
    while i < len(args) and args[i].startswith("-"):
        words.append(args[i])
        if "=" not in args[i] and args[i] in ("-n", "-N", "-c", "--ntasks", "--nodes",
                "--ntasks-per-node", "--cpus-per-task", "--gpus-per-task", "--gres",
                "--cpu-bind", "--cpu_bind", "--mpi", "-o", "-e", "--output", "--error",
                "--label", "--gpus", "-G", "--mem", "--distribution", "-m", "--het-group"):
            if args[i] != "--label":
                i += 1
                words.append(args[i] if i < len(args) else "")
        i += 1
    command = args[i:]
    n_nodes = int(str(option(["--nodes", "-N"], len(nodes), words)).split("-")[0])
    per_node = option(["--ntasks-per-node"], None, words)
    total = option(["--ntasks", "-n"], None, words)
    if per_node is None and total is None and "SLURM_NTASKS_PER_NODE" not in env:
        total = env.get("SLURM_NTASKS")  # the job's --ntasks alone: that many in all
    if per_node is None and total:  # (block distribution: the first nodes get the rest)
        tasks = [int(total) // n_nodes + (i < int(total) % n_nodes) for i in range(n_nodes)]
    else:
        per_node = per_node or env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0]
        tasks = [int(per_node)] * n_nodes
    log(options=words, tasks_per_node=tasks[0], nodes=n_nodes,
        srun_cpus_per_task=env.get("SRUN_CPUS_PER_TASK"))  # srun's own variable for -c
    status = 0
    for node in range(n_nodes):
        for local in range(tasks[node]):
            task_env = dict(env, SLURM_NODEID=str(node), SLURMD_NODENAME=nodes[node],
                            SLURM_LOCALID=str(local), SLURM_PROCID=str(sum(tasks[:node]) + local),
                            SLURM_STEP_NUM_TASKS=str(sum(tasks)),
                            SLURM_STEP_NUM_NODES=str(n_nodes))
            import subprocess
            status = subprocess.call(command, env=task_env) or status
    sys.exit(status)
if name == "torchrun":
    nproc = option(["--nproc_per_node", "--nproc-per-node"], "1")
    visible = [g for g in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    if nproc == "gpu":
        count = len(visible)
    elif nproc == "auto":
        count = len(visible) or 1
    else:
        count = int(nproc) if nproc.isdigit() else -1
    log(processes=count, visible_gpus=len(visible), env=dict(env))
    sys.exit(0)
if name == "nsys":
    out = option(["-o", "--output"], "report")
    force = option(["--force-overwrite", "-f"], "false")
    report = out if out.endswith(".nsys-rep") else out + ".nsys-rep"
    log(env=dict(env))
    if args and args[0] == "profile":
        if os.path.exists(report) and force != "true":
            print(f"Error: {report} already exists: use --force-overwrite=true", file=sys.stderr)
            sys.exit(1)
        # a report outside the job's folder is recorded, not written (never into the repository)
        if os.path.abspath(report).startswith(env["FAKE_JOB_DIR"] + os.sep):
            os.makedirs(os.path.dirname(os.path.abspath(report)), exist_ok=True)
            open(report, "w").close()
    sys.exit(0)
if name == "python":
    log(processes=1, visible_gpus=len([g for g in env.get("CUDA_VISIBLE_DEVICES", "").split(",")
                                        if g.strip()]), env=dict(env))
    sys.exit(0)
sys.exit(0)
'''
STANDINS = ("scontrol", "nslookup", "getent", "srun", "torchrun", "python", "nsys")


@dataclass
class Job:
    """What happened when a job file ran: bash's result and every recorded launch."""
    returncode: int
    stdout: str
    stderr: str
    launches: list = field(default_factory=list)
    directives: dict = field(default_factory=dict)
    nodes: tuple = ()
    out_dir: str = ""
    job_id: str = ""
    command: str = ""   # how it was submitted: "NSYS=1 sbatch FILE --max-steps 5"
    args: tuple = ()    # the arguments the check gave the job file (sbatch FILE ARGS)

    def of(self, cmd: str, node: int | None = None) -> list[dict]:
        return [e for e in self.launches if e["cmd"] == cmd and (node is None or e["node"] == node)]

    def workers(self) -> list[dict]:
        """The launches that start training processes: torchrun, or python started by srun."""
        return [e for e in self.launches if e["cmd"] in ("torchrun", "python")]

    def processes_per_node(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for e in self.workers():
            counts[e["node"]] = counts.get(e["node"], 0) + max(e.get("processes", 0), 0)
        return counts

    def bash_error(self) -> tuple[int | None, str]:
        """(line, message) of bash's own error ("line 12: X: unbound variable"), if any."""
        for l in self.stderr.splitlines()[::-1]:
            m = re.search(r"line (\d+): (.*)", l)
            if m:
                return int(m.group(1)), m.group(2).strip()
        last = (self.stderr.strip().splitlines() or [""])[-1]
        return None, last


def first_command(text: str) -> int:
    """The number of the job file's first line that is neither blank nor a comment: sbatch reads
    #SBATCH lines up to it only (later ones are comments to it)."""
    lines = text.splitlines()
    return next((i for i, l in enumerate(lines, 1) if l.strip() and not l.lstrip().startswith(
        "#")), len(lines) + 1)


def late_directives(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the #SBATCH lines after the first command, which sbatch ignores."""
    start = first_command(text)
    return [(i, l.strip()) for i, l in enumerate(text.splitlines(), 1)
            if i > start and l.startswith("#SBATCH")]


def sbatch_directives(text: str) -> dict:
    """The options of the #SBATCH lines before the first command, as sbatch reads them, as
    {option: value} ("--nodes": "2", ...)."""
    found = {}
    short = {"-N": "--nodes", "-n": "--ntasks", "-c": "--cpus-per-task", "-G": "--gpus",
             "-A": "--account", "-p": "--partition", "-t": "--time", "-J": "--job-name"}
    for line in text.splitlines()[:first_command(text) - 1]:
        if not line.startswith("#SBATCH"):
            continue
        words = shlex.split(line[len("#SBATCH"):].split(" #")[0])
        i = 0
        while i < len(words):
            w = words[i]
            if w.startswith("--") and "=" in w:
                k, v = w.split("=", 1)
            elif w in short or (w.startswith("--") and i + 1 < len(words)):
                k, v = short.get(w, w), words[i + 1]
                i += 1
            else:
                k, v = w, ""
            found[short.get(k, k)] = v
            i += 1
    return found


def gpus_of(directives: dict) -> int:
    """The GPUs a node of the job gets: --gres=gpu:N, --gpus-per-node, --gpus-per-task times
    the tasks of a node, or --gpus spread over the nodes."""
    gres = directives.get("--gres", "")
    m = re.search(r"gpu(?::[a-zA-Z]\w*)?:(\d+)", gres)
    if m:
        return int(m.group(1))

    def count(option):  # [type:]N
        return int(re.sub(r"\D", "", directives.get(option, "").split(":")[-1]) or 0)
    nodes = int(str(directives.get("--nodes", "1")).split("-")[0] or 1)
    if directives.get("--gpus-per-node"):
        return count("--gpus-per-node")
    if directives.get("--gpus-per-task"):
        tasks = directives.get("--ntasks-per-node") or (
            int(directives["--ntasks"]) // nodes if directives.get("--ntasks") else 1)
        return count("--gpus-per-task") * int(tasks)
    if directives.get("--gpus"):
        return count("--gpus") // nodes
    return 0


def node_names(n: int) -> tuple[str, ...]:
    return tuple(f"jrc{i:04d}" for i in range(1, n + 1))


def submit(script: Path, work: Path, args=("--epochs", "1"), job_id: str = "4242",
           nodes: int | None = None, dns: bool = True, env_extra: dict | None = None,
           out_dir: Path | None = None, timeout: float = 60) -> Job:
    """`sbatch [--nodes=N] script args` on a pretend cluster of jrc0001, jrc0002, ... whose
    InfiniBand names jrc0001i, ... resolve (dns=False: no such names, as at most sites)."""
    text = Path(script).read_text()
    directives = sbatch_directives(text)
    n_nodes = nodes or int(str(directives.get("--nodes", "1")).split("-")[0] or 1)
    names = node_names(n_nodes)
    d = Path(tempfile.mkdtemp(dir=work, prefix="job-"))
    bin_dir, venv = d / "bin", d / "venv"
    for x in (bin_dir, venv / "bin"):
        x.mkdir(parents=True)
    (venv / "bin" / "activate").write_text("")
    body = STANDIN.replace("#!PYTHON", f"#!{sys.executable}")
    for name in STANDINS:
        f = bin_dir / name
        f.write_text(body)
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    gpus = gpus_of(directives)
    per_node = directives.get("--ntasks-per-node")
    if per_node is None and directives.get("--ntasks"):  # tasks in all, not per node
        tasks = {"SLURM_NTASKS": directives["--ntasks"]}
    else:
        tasks = {"SLURM_NTASKS_PER_NODE": per_node or "1",
                 "SLURM_NTASKS": str(int(per_node or 1) * n_nodes)}
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "MASTER_", "CUDA_VISIBLE", "NPROC_PER_NODE",
                                "SCRIPT", "OUT_DIR", "NSYS", "TORCHELASTIC_", "VENV",
                                "SITE"))}  # (an exported SITE=lumi would load LUMI's modules)
    log = d / "launches.jsonl"
    log.write_text("")
    # bash reads BASH_ENV first: an ERR trap that names the line where the job file stopped
    # (set -e alone stops silently, e.g. on a pipeline killed by SIGPIPE)
    trap = d / "trap.sh"
    trap.write_text("set -E\ntrap 'echo \"$BASH_SOURCE: line $LINENO: a command failed with "
                    "exit status $?\" >&2' ERR\n")
    env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", VENV=str(venv), FAKE_LOG=str(log),
               FAKE_JOB_DIR=str(work),
               FAKE_NODES=" ".join(names),
               FAKE_DNS=" ".join(f"{n}i=10.10.0.{i + 1}" for i, n in enumerate(names)) if dns
               else "",
               SLURM_SUBMIT_DIR=str(d), SLURM_JOB_NAME=directives.get("--job-name", "job"),
               SLURM_JOB_ID=job_id, SLURM_JOBID=job_id, SLURM_JOB_NODELIST=",".join(names),
               SLURM_NODELIST=",".join(names), SLURM_JOB_NUM_NODES=str(n_nodes),
               SLURM_NNODES=str(n_nodes), **tasks,
               SLURM_CPUS_PER_TASK=directives.get("--cpus-per-task", "1"),
               SLURMD_NODENAME=names[0], SLURM_NODEID="0",
               OUT_DIR=str(out_dir or d / "out"), BASH_ENV=str(trap), **(env_extra or {}))
    if gpus:
        env.update(CUDA_VISIBLE_DEVICES=",".join(str(i) for i in range(gpus)),
                   SLURM_GPUS_ON_NODE=str(gpus), SLURM_JOB_GPUS=",".join(str(i) for i in range(gpus)))
    try:
        proc = subprocess.run(["bash", str(script), *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=timeout)
        result = (proc.returncode, proc.stdout, proc.stderr)
    except subprocess.TimeoutExpired as e:
        result = (124, e.stdout or "", (e.stderr or "") + f"\nno end after {timeout} s")
    launches = [json.loads(l) for l in log.read_text().splitlines() if l.strip()]
    command = shlex.join([*(f"{k}={v}" for k, v in (env_extra or {}).items()), "sbatch",
                          Path(script).name, *args])
    return Job(*result, launches=launches, directives=directives, nodes=names,
               out_dir=env["OUT_DIR"], job_id=job_id, command=command, args=tuple(args))


PROFILE_SOURCE = re.compile(r"^\s*(?:source|\.)\s+\S*sites/job\.sh\b")


def unbound_message(name: str, text: str, line: int | None) -> str:
    """What to change for a variable that set -u stopped at: a SITE_* value used before the
    line that sources the site profile (which sets it), or one never set at all."""
    sources = [i for i, l in enumerate(text.splitlines(), 1) if PROFILE_SOURCE.match(l)]
    if name.startswith("SITE_") and line and (not sources or min(sources) > line):
        return (f"{name} comes from the site profile: put this line after `source "
                f"sites/job.sh` (line {min(sources)})" if sources else
                f"{name} comes from the site profile: `source sites/job.sh` before this line")
    return (f"${name} is used but never set (set -u stops there): set it before this line, "
            f"or write ${{{name}:-default}}")


NPROC_OPTION = re.compile(r"--nproc[_-]per[_-]node[= ]\"?\$\{?(\w+)")


def launch_problems(job: Job, text: str) -> list[str]:
    """What any job file must get right, one line each, saying what to change: bash finishing
    (set -u, pipefail), every torchrun's process count against the GPUs of a node.
    `text`: the job file (which variables it hands torchrun)."""
    problems = [f"{l} (line {n}) comes after the first command, and sbatch reads no #SBATCH "
                "line after it: move it up with the other #SBATCH lines"
                for n, l in late_directives(text)][:1]
    if job.returncode != 0:
        line, message = job.bash_error()
        m = re.search(r"(\w+): unbound variable", message)
        if m:
            message = unbound_message(m.group(1), text, line)
        elif job.returncode == 141:
            message = ("a reader stopped a pipeline early (head -n 1, or awk's exit), and the "
                       "writer died of SIGPIPE, which set -o pipefail turns into a failed job: "
                       "read to the end (sed -n 1p, awk '... && !n++')")
        problems.append(f"the job stops at {f'line {line}: ' if line else ''}"
                        f"{message or f'exit code {job.returncode}'}")
    gpus = gpus_of(job.directives)
    for e in job.of("torchrun"):
        words = e["args"]
        nproc = next((w.split("=", 1)[1] if "=" in w else (words[i + 1] if i + 1 < len(words)
                                                            else "")
                      for i, w in enumerate(words)
                      if w.split("=", 1)[0] in ("--nproc_per_node", "--nproc-per-node")), None)
        node = job.nodes[e["node"]] if 0 <= e["node"] < len(job.nodes) else "?"
        if e.get("processes", 0) < 0 or nproc == "":
            unset = [v for v in NPROC_OPTION.findall(text)
                     if not e.get("env", {}).get(v)]
            why = (f": ${unset[0]} is not set in this job" + (
                " (Slurm sets $SLURM_GPUS_PER_NODE only for --gpus-per-node, not for --gres)"
                if unset[0] == "SLURM_GPUS_PER_NODE" else "") if unset else "")
            problems.append(f"torchrun on {node} gets --nproc_per_node={nproc}{why}, so it "
                            "cannot start its processes: --nproc_per_node=\"$NPROC_PER_NODE\" "
                            "(gpu, one process per GPU, unless set)")
            break
        if gpus and e.get("processes") not in (None, gpus):
            problems.append(f"torchrun on {node} would start {e['processes']} process(es) for "
                            f"the {gpus} GPUs a node has here (--nproc_per_node={nproc}): one "
                            "per GPU, --nproc_per_node=\"$NPROC_PER_NODE\"")
            break
    return problems


def judge_job_file(report, label: str, script: Path, work: Path, args=()) -> Job:
    """A job file without TODOs (collectives.sbatch, preflight.sbatch, ...), run with the
    stand-ins: one line under `label` in the report, ok or what to change."""
    job = submit(script, work, args=args, job_id="4246")
    problems = launch_problems(job, Path(script).read_text())
    if problems:
        for problem in problems:
            report.item(label, False, problem)
        return job
    runs = job.of("torchrun")
    nodes = sorted({e["node"] for e in runs})
    counts = sorted({e.get("processes") for e in runs})
    report.item(label, True, (
        f"{len(runs)} torchrun(s) on {len(nodes)} node(s), {', '.join(map(str, counts))} "
        f"process(es) each for {gpus_of(job.directives)} GPU(s) a node" if runs else
        f"runs to its end and starts {len(job.workers())} program(s) with srun"))
    return job


def describe(job: Job, text: str = "") -> list[str]:
    """Per node, what srun would start there and the variables that matter (the dry run)."""
    keys = ("MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "NPROC_PER_NODE",
            "SLURM_NODEID", "SLURM_PROCID", "SLURM_CPUS_PER_TASK", "OMP_NUM_THREADS",
            "HF_HUB_OFFLINE", "COURSE_DATA_CACHE")
    lines = [f"{job.command}: pretend job {job.job_id} on {len(job.nodes)} node(s), "
             f"{', '.join(job.nodes)}" + (f" ({' '.join(job.args)}: added by the check to keep "
                                          "the run short)" if job.args else ""),
             f"#SBATCH {' '.join(f'{k}={v}' if v else k for k, v in job.directives.items())}"]
    for e in job.of("srun"):
        lines.append(f"srun {' '.join(e['options'])}: {e['tasks_per_node']} task(s) on each "
                     f"of {e['nodes']} node(s)")
    for e in job.workers() + job.of("nsys"):
        node = job.nodes[e["node"]] if 0 <= e["node"] < len(job.nodes) else "?"
        what = (f"{e['processes']} process(es)" if "processes" in e else "")
        env = e.get("env", {})
        # srun's task number in the job step (SLURM_PROCID), or the batch script itself
        task = f"task {env['SLURM_PROCID']}" if "SLURM_PROCID" in env else "(no srun)"
        lines.append(f"  {node} {task}: {e['cmd']} {shlex.join(e['args'])}"
                     + (f"   -> {what}" if what else ""))
        shown = [f"{k}={env[k]}" for k in keys if k in env]
        if shown:
            lines.append("      " + " ".join(shown))
    for problem in launch_problems(job, text):
        lines.append(f"WARNING: {problem}")
    return lines
