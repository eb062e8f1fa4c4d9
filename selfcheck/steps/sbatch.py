"""Step 1's job file, to_distributed_training.sbatch (TODOs 12-16): GPUs, master address,
port, one torchrun per node.

The file runs as sbatch would run it (its #SBATCH lines read like sbatch reads them), on a
pretend cluster whose nodes have 4 GPUs: as a two-node job whose nodes have InfiniBand names
(jrc0001i, as at JSC), and as a one-node job without them and with another job id. Stand-ins
for scontrol, nslookup, getent, srun and torchrun record what would start where: how many
processes per node, which GPUs each sees, how the nodes find each other.
"""

from __future__ import annotations

import re
from pathlib import Path

from selfcheck import slurm

FILE = "to_distributed_training.sbatch"
WHAT = "the DDP job file: GPUs, master address, port, torchrun"
NEEDS_TORCH = False  # bash and the stand-ins for Slurm only
TODOS = {12: "GPUs", 13: "master address", 14: "port", 15: "torchrun per node", 16: "two nodes"}
GPUS_PER_NODE = 4
SCRIPT = "train/to_distributed_training.py"
# Job ids as large as real ones (JSC's have 8 digits): a port computed from the id must stay
# within 1024-65535 for them too. The second is a multiple of 65536 whose remainder by 50,000
# is above 45,535: a port of id % 65536 (0) or 20000 + id % 50000 (67024) shows there
JOB_IDS = ("13377421", "13697024")
# What a CPU-only node's job sets (the TODO's "a number runs on CPU-only nodes"): the one-node
# run gets it, so a torchrun that ignores it shows
NPROC_SET = "2"
# A port set before the job (sbatch passes the environment on): the job must keep it
PRESET_PORT = "24680"


def show(script, work) -> list[str]:
    """The dry run: the job file as submitted without arguments, under the job id the check's
    two-node run has (so the port shown is the one its line names)."""
    return slurm.describe(slurm.submit(script, work, args=(), job_id=JOB_IDS[0]),
                          Path(script).read_text())


def what_of(text: str) -> str:
    return WHAT if has_todos(text) else "a job file without TODOs: what it starts, and that it can"


def has_todos(text: str) -> bool:
    """Whether a job file is the DDP exercise (its TODO comments, DONE in the solution), not
    another job file."""
    return any(re.search(rf"^\s*#\s*(TODO|DONE) {n}\b", text, re.M) for n in TODOS)


def source_line(text: str, n: int) -> str:
    lines = text.splitlines()
    return lines[n - 1] if 0 < n <= len(lines) else ""


def stopped(ctx, job, todo_default=None) -> bool:
    """Report a job file that bash stopped, under the TODO of the line it stopped at."""
    if job.returncode == 0:
        return False
    line, message = job.bash_error()
    todo = ctx.todo_of(line) if line else None
    m = re.search(r"(\w+): unbound variable", message)
    if m:
        message = slurm.unbound_message(m.group(1), ctx.text, line)
    elif job.returncode == 141:
        message = ("a reader stopped a pipeline early (head -n 1, or awk's exit), and the "
                   "writer died of SIGPIPE, which set -o pipefail turns into a failed job: "
                   "read to the end (sed -n 1p, awk '... && !n++')")
    elif line and "nslookup" in source_line(ctx.text, line) and "exit status" in message:
        message += (" (nslookup fails where a node has no InfiniBand name, and set -e stops "
                    "the job there): end the line with || true, an empty answer keeps the "
                    "plain name")
    elif not message:
        message = f"exit code {job.returncode}"
    where = f"line {line}: " if line else ""
    target = todo or todo_default or next((n for n, s in sorted(ctx.status.items())
                                           if s == "edited"), min(TODOS))
    ctx.report.fail(target, f"the job file stops at {where}{message}")
    ctx.report.attempt(target)
    return True


def check(ctx) -> None:
    rep = ctx.report
    if not has_todos(ctx.text) and ctx.script.name != FILE:
        # another job file (collectives.sbatch, preflight.sbatch, ...): what every job file must
        # get right, not the TODOs of this one
        rep.verdicts.clear()
        rep.note(f"({ctx.script.name} has none of the TODOs 12-16 of {FILE}: checked as a job "
                 f"file of its own; python check.py sbatch {ctx.script.name} --show lists what "
                 "it starts on every node)")
        slurm.judge_job_file(rep, ctx.script.name, ctx.script, ctx.work)
        return
    two = slurm.submit(ctx.script, ctx.work, nodes=2, job_id=JOB_IDS[0])
    one = slurm.submit(ctx.script, ctx.work, nodes=1, job_id=JOB_IDS[1], dns=False,
                       env_extra={"NPROC_PER_NODE": NPROC_SET})
    directives = two.directives
    nodes = int(str(directives.get("--nodes", "1")).split("-")[0] or 1)
    gpus = slurm.gpus_of(directives)
    # #SBATCH lines after the first command: sbatch reads them as comments
    late = {}
    for line, text in slurm.late_directives(ctx.text):
        option = slurm.sbatch_directives(text)
        todo = (12 if slurm.gpus_of(option) or "--gres" in option else 16 if "--nodes" in option
                else ctx.todo_of(line) or 15)
        late.setdefault(todo, (line, text))
    for todo, (line, text) in late.items():
        rep.fail(todo, f"{text} (line {line}) comes after the first command, and sbatch reads "
                 "no #SBATCH line after it: move it up with the other #SBATCH lines")
    # TODO 16 and 12 (the #SBATCH lines)
    if 16 in late:
        pass
    elif nodes == 2:
        rep.ok(16, "two nodes")
    else:
        rep.fail(16, f"the job asks for {nodes} node(s): #SBATCH --nodes=2 (once one node works)")
    if 12 in late:
        pass
    elif gpus != GPUS_PER_NODE:
        rep.fail(12, f"the job asks for {gpus} GPU(s) per node: ask for all "
                 f"{GPUS_PER_NODE} of a node, #SBATCH --gres=gpu:{GPUS_PER_NODE}")
    if stopped(ctx, two) or stopped(ctx, one):
        return
    workers = two.workers()
    if not workers:
        rep.fail(15, "srun starts nothing that trains")
        return
    torchruns = two.of("torchrun")
    if not torchruns:
        rep.fail(15, "srun still starts python itself (one process per node, 1 of "
                 f"{GPUS_PER_NODE} GPUs busy): srun ... bash -c 'exec torchrun ...' (see the TODO)")
        # only TODO 15's torchrun reads their variables: a done TODO is not yet a wrong one
        for todo, name in ((13, "MASTER_ADDR"), (14, "MASTER_PORT")):
            if rep.status.get(todo) == "edited":
                rep.waits(todo, f"{name} is checked once TODO 15's torchrun uses it")
        check_visible(ctx, two)
        return
    rep.attempt(15)
    check_geometry(ctx, two, one)
    check_srun_cpus(ctx, two)
    check_rendezvous(ctx, two, one)
    check_preset_port(ctx)
    check_visible(ctx, two)


def check_preset_port(ctx) -> None:
    """A MASTER_PORT set before the job is kept (the TODO's "unless one is set already")."""
    rep = ctx.report
    if rep.failed(14) or not rep.judged(14):
        return
    job = slurm.submit(ctx.script, ctx.work, nodes=1, job_id=JOB_IDS[1], dns=False,
                       env_extra={"NPROC_PER_NODE": NPROC_SET, "MASTER_PORT": PRESET_PORT})
    runs = job.of("torchrun")
    port = split_endpoint(endpoint_of(runs[0]["args"]) or "")[1] if runs else None
    if job.returncode == 0 and port is not None and port != PRESET_PORT:
        rep.fail(14, f"with MASTER_PORT={PRESET_PORT} set before the job, the job uses port "
                 f"{port}: keep a port that is set already, export MASTER_PORT="
                 "${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 10000))}")


def check_srun_cpus(ctx, job) -> None:
    """srun hands the job's CPUs on to its tasks: since Slurm 22.05 it no longer takes
    --cpus-per-task from sbatch, so without it every task (a torchrun and all its processes,
    their data-loader workers too) gets one core."""
    cpus = job.directives.get("--cpus-per-task")
    if not cpus or cpus == "1" or ctx.report.failed(15):
        return
    for e in job.of("srun"):
        words = e.get("options", [])
        given = any(w in ("-c", "--cpus-per-task") or w.startswith("--cpus-per-task=")
                    for w in words) or e.get("srun_cpus_per_task")
        if not given:
            ctx.report.fail(15, f"srun gets no --cpus-per-task: Slurm 22.05 and later do not "
                            f"pass the job's {cpus} CPUs per task on to srun, so torchrun and "
                            "all its processes share one core: srun --kill-on-bad-exit=1 "
                            "--cpus-per-task=\"$SLURM_CPUS_PER_TASK\" bash -c ...")
            return


def check_visible(ctx, job) -> None:
    rep = ctx.report
    env = (job.workers() or [{}])[0].get("env", {})
    visible = [g for g in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    if rep.failed(12):
        return
    if len(visible) == GPUS_PER_NODE:
        rep.ok(12, f"{GPUS_PER_NODE} GPUs per node, all visible to the processes "
               f"(CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')})")
    else:
        rep.fail(12, f"the processes see {len(visible)} GPU(s) (CUDA_VISIBLE_DEVICES="
                 f"{env.get('CUDA_VISIBLE_DEVICES', 'unset')}): export "
                 "CUDA_VISIBLE_DEVICES=$SITE_GPU_IDS (the site's list of a node's GPUs, 0,1,2,3 "
                 "here)")


def arg(words, name):
    """--name=value or --name value (torchrun takes both, and - or _ in names)."""
    names = {name, name.replace("_", "-")}
    for i, w in enumerate(words):
        key = w.split("=", 1)[0]
        if key in names:
            return w.split("=", 1)[1] if "=" in w else (words[i + 1] if i + 1 < len(words) else "")
    return None


def check_geometry(ctx, job, one) -> None:
    """One torchrun per node, as many processes per node as GPUs, every node in the job; the
    one-node job, which sets NPROC_PER_NODE, gets that many."""
    rep = ctx.report
    per_node: dict[int, list] = {}
    for e in job.of("torchrun"):
        per_node.setdefault(e["node"], []).append(e)
    n_nodes = len(job.nodes)
    counts = job.processes_per_node()
    problems = []
    tasks = job.directives.get("--ntasks")
    if sorted(per_node) != list(range(n_nodes)) and tasks and not job.directives.get(
            "--ntasks-per-node"):
        problems.append(f"#SBATCH --ntasks={tasks} counts the tasks of the whole job, not of "
                        f"a node: of {n_nodes} nodes torchrun runs on node(s) "
                        f"{sorted(per_node)} only; one task on every node, "
                        "#SBATCH --ntasks-per-node=1")
    elif sorted(per_node) != list(range(n_nodes)):
        problems.append(f"torchrun runs on node(s) {sorted(per_node)} of {n_nodes}: srun starts "
                        "one task on every node of the job")
    elif any(len(v) > 1 for v in per_node.values()):
        k = max(len(v) for v in per_node.values())
        problems.append(f"srun starts {k} torchruns on each node, each starting its own "
                        f"processes ({counts.get(0)} per node for {GPUS_PER_NODE} GPUs): one task "
                        "per node (#SBATCH --ntasks-per-node=1), torchrun starts one process "
                        "per GPU")
    else:
        first = per_node[0][0]
        nproc = arg(first["args"], "--nproc_per_node")
        too_few_visible = nproc in ("gpu", "auto") and first.get("visible_gpus", 0) < GPUS_PER_NODE
        if counts.get(0) != GPUS_PER_NODE and not too_few_visible:  # (that one is TODO 12's)
            problems.append(f"torchrun starts {counts.get(0)} process(es) per node "
                            f"(--nproc_per_node={nproc}) for {GPUS_PER_NODE} GPUs: "
                            "--nproc_per_node=\"$NPROC_PER_NODE\", which is gpu (one per GPU) "
                            "unless set")
        nnodes = arg(first["args"], "--nnodes")
        if nnodes not in (str(n_nodes), f"{n_nodes}:{n_nodes}"):
            problems.append(f"torchrun has --nnodes={nnodes} in a job of {n_nodes} nodes: "
                            "--nnodes=\"$SLURM_JOB_NUM_NODES\"")
        script_args = first["args"]
        if not any(a.endswith(SCRIPT) or a == "$SCRIPT" for a in script_args) and \
                "--out-dir" in script_args:  # the script's arguments came, the script did not
            problems.append("torchrun gets the script's arguments but not the script: bash -c "
                            "takes the first word after its command as $0, not as part of "
                            "\"$@\"; put a name there, bash -c '...' torchrun \"$SCRIPT\" "
                            "\"${ARGS[@]}\"")
        elif not any(a.endswith(SCRIPT) or a == "$SCRIPT" for a in script_args) and re.search(
                r'"\$\{?SCRIPT\}?"[^\'\n]*\'', ctx.text):  # "$SCRIPT" before a closing quote
            problems.append("torchrun does not get the training script: \"$SCRIPT\" "
                            "\"${ARGS[@]}\" stand inside bash -c's single quotes, where these "
                            "variables of the job script are not set: after the closing quote, "
                            "bash -c '... \"$@\"' torchrun \"$SCRIPT\" \"${ARGS[@]}\"")
        elif not any(a.endswith(SCRIPT) or a == "$SCRIPT" for a in script_args):
            problems.append("torchrun does not get the training script: end with "
                            "\"$SCRIPT\" \"${ARGS[@]}\"")
        elif script_args[-2:] != ["--epochs", "1"]:
            problems.append("the job's own arguments (sbatch FILE --epochs 1) do not reach the "
                            "script: end with \"$SCRIPT\" \"${ARGS[@]}\"")
    one_runs = one.of("torchrun")
    one_nnodes = arg(one_runs[0]["args"], "--nnodes") if one_runs else None
    if not problems and one_runs and one_nnodes not in (None, "1", "1:1"):
        problems.append(f"on one node torchrun has --nnodes={one_nnodes} and waits for the "
                        "other node(s) to join, which never come: --nnodes="
                        "\"$SLURM_JOB_NUM_NODES\"")
    if not problems and one_runs and one_runs[0].get("processes") != int(NPROC_SET):
        problems.append(f"with NPROC_PER_NODE={NPROC_SET} set (a CPU-only node) torchrun still "
                        f"starts {one_runs[0].get('processes')} process(es) (--nproc_per_node="
                        f"{arg(one_runs[0]['args'], '--nproc_per_node')}): export NPROC_PER_NODE="
                        "${NPROC_PER_NODE:-gpu}, then --nproc_per_node=\"$NPROC_PER_NODE\"")
    if problems:
        rep.fail(15, problems[0])
    else:
        rep.ok(15, f"one torchrun on each of the {n_nodes} nodes, {GPUS_PER_NODE} processes each")


def endpoint_of(words) -> str | None:
    """Where torchrun's nodes meet: --rdzv_endpoint, or a static rendezvous's --master_addr and
    --master_port."""
    endpoint = arg(words, "--rdzv_endpoint")
    if endpoint is None and arg(words, "--master_addr") is not None:
        port = arg(words, "--master_port")
        endpoint = arg(words, "--master_addr") + (f":{port}" if port else "")
    return endpoint


def split_endpoint(endpoint: str) -> tuple[str, str]:
    """(host, port) of host:port; a host alone has no port (not an empty host)."""
    host, colon, port = endpoint.rpartition(":")
    return (host, port) if colon else (endpoint, "")


def check_rendezvous(ctx, two, one) -> None:
    rep = ctx.report
    runs = sorted(two.of("torchrun"), key=lambda e: e["node"])
    args0 = runs[0]["args"]
    backend = arg(args0, "--rdzv_backend")
    rdzv_id = {arg(e["args"], "--rdzv_id") for e in runs}
    endpoints = {endpoint_of(e["args"]) for e in runs}
    hosts = [arg(e["args"], "--rdzv_conf") or "" for e in runs]
    if backend is None and arg(args0, "--master_addr") is not None:
        rep.fail(15, "the nodes meet through a static rendezvous (--node_rank, --master_addr): "
                 "the TODO's c10d rendezvous needs no node rank, --rdzv_backend=c10d "
                 "--rdzv_id=\"$SLURM_JOB_ID\" --rdzv_endpoint=\"$MASTER_ADDR:$MASTER_PORT\"")
    elif backend != "c10d":
        rep.fail(15, f"--rdzv_backend={backend}: the nodes meet through --rdzv_backend=c10d")
    elif rdzv_id != {JOB_IDS[0]}:
        rep.fail(15, f"--rdzv_id is {', '.join(sorted(map(str, rdzv_id)))} for job {JOB_IDS[0]}: "
                 "--rdzv_id=\"$SLURM_JOB_ID\", the same on every node and new for every job")
    elif len(endpoints) > 1:
        rep.fail(13, f"the nodes look for the rendezvous at different addresses "
                 f"({', '.join(sorted(map(str, endpoints)))}): every node must use the first "
                 "node's")
    elif "is_host=1" not in hosts[0] or any("is_host=1" in h for h in hosts[1:]):
        rep.fail(15, "only node 0 hosts the rendezvous: "
                 "--rdzv_conf=is_host=$(( SLURM_NODEID == 0 ? 1 : 0 )) (single quotes around "
                 "the bash -c command, so each node computes its own)")
    endpoint = next(iter(endpoints)) or ""
    env0 = runs[0].get("env", {})
    host, port = split_endpoint(endpoint)
    if len(endpoints) == 1:
        lines = host.split("\n")
        if len(lines) > 1:
            dns = [l for l in lines if "#" in l]  # (address#port: the DNS server's)
            rep.fail(13, f"MASTER_ADDR holds {len(lines)} lines, {' and '.join(lines)}"
                     + (f" ({dns[0]} is the DNS server's: nslookup prints an Address line for "
                        "it too)" if dns else "")
                     + ": take only the first line that starts with 'Address: ', "
                     "awk '/^Address: / && !n++ {print $2}'")
        elif host == "10.10.0.1":
            rep.ok(13, "the rendezvous is the InfiniBand address of the first node")
        elif host == "10.10.0.2":
            rep.fail(13, "the rendezvous is the LAST node's address: take the first line, "
                     "scontrol show hostnames \"$SLURM_JOB_NODELIST\" | sed -n 1p")
        elif host in two.nodes:
            rep.fail(13, f"the rendezvous is {host}, its ethernet name: on JSC systems use the "
                     f"address of its InfiniBand name ({host}i), nslookup \"${{MASTER_ADDR}}i\"")
        else:
            rep.fail(13, f"rendezvous endpoint {endpoint or '(none)'}, expected the address of "
                     "jrc0001i: MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" "
                     "| sed -n 1p), then nslookup \"${MASTER_ADDR}i\"")
    one_runs = one.of("torchrun")
    one_end = endpoint_of(one_runs[0]["args"]) if one_runs else None
    if one_end and split_endpoint(one_end)[0] == one.nodes[0]:
        if not rep.failed(13):
            rep.ok(13, "without an InfiniBand name the plain host name is used")
    elif one_runs:
        rep.fail(13, f"on a node without an <node>i name the endpoint is {one_end}: keep the "
                 "plain host name then, if [ -n \"$IB_ADDR\" ]; then MASTER_ADDR=$IB_ADDR; fi")
    port1 = split_endpoint(one_end or "")[1]
    if not port.isdigit():
        rep.fail(14, f"no port in the rendezvous endpoint ({endpoint or 'none'}): "
                 "--rdzv_endpoint=\"$MASTER_ADDR:$MASTER_PORT\"")
    elif outside := [(job, p) for job, p in zip(JOB_IDS, (port, port1))
                     if p.isdigit() and not 1024 <= int(p) < 65536]:
        job, bad = outside[0]
        why = "only root may listen below 1024" if int(bad) < 1024 else "the last port is 65535"
        rep.fail(14, f"port {bad} for job {job} is outside 1024-65535 ({why}; job ids have 8 "
                 "digits): keep it in a free range, MASTER_PORT=$((20000 + SLURM_JOB_ID % 10000))")
    elif env0.get("MASTER_PORT") not in (None, port):
        rep.fail(14, f"MASTER_PORT={env0.get('MASTER_PORT')} but the endpoint uses port {port}: "
                 "--rdzv_endpoint=\"$MASTER_ADDR:$MASTER_PORT\"")
    elif port == port1:
        rep.fail(14, f"jobs {JOB_IDS[0]} and {JOB_IDS[1]} both use port {port}: two jobs on one node would "
                 "collide; derive it from the job id, MASTER_PORT=$((20000 + SLURM_JOB_ID % 10000))")
    else:
        rep.ok(14, f"the port ({port}) comes from the job id")


HINTS = {
    12: ("DDP needs every GPU of a node: ask Slurm for all of them, and let every process see "
         "them all (torchrun gives each process one by its local rank).",
         "#SBATCH --gres=gpu:4 in the header; export CUDA_VISIBLE_DEVICES=$SITE_GPU_IDS in the "
         "body (the site profile's list of all of a node's GPUs: 0,1,2,3 with 4)."),
    13: ("All nodes must meet at one address: the first node of the job. On JSC systems its "
         "InfiniBand interface has its own name, the node name with an i at the end; elsewhere "
         "there is none and the plain name is the address.",
         "scontrol show hostnames \"$SLURM_JOB_NODELIST\" lists the nodes (take the first line "
         "without stopping the reader early: sed -n 1p); nslookup \"<name>${SITE_IB_SUFFIX}\" "
         "gives the address if the name exists (awk takes the first Address: line); export "
         "MASTER_ADDR."),
    14: ("Two jobs on one node must not use the same port, so derive it from the job id.",
         "export MASTER_PORT with a number between 1024 and 65535 computed from $SLURM_JOB_ID, "
         "and echo both variables for the job's log."),
    15: ("One torchrun per node: srun starts it on every node, and torchrun starts one process "
         "per GPU and joins the nodes at the rendezvous on the first node. bash -c takes the "
         "first word after its quoted command as $0, not as an argument.",
         "srun ... bash -c 'exec torchrun --nnodes=... --nproc_per_node=... --rdzv_backend=c10d "
         "--rdzv_id=... --rdzv_endpoint=... --rdzv_conf=is_host=...' torchrun \"$SCRIPT\" "
         "\"${ARGS[@]}\": the single quotes make each node expand $SLURM_NODEID itself."),
    16: ("Once one node works, the same file runs on two: only the number of nodes changes.",
         "#SBATCH --nodes=2."),
}
