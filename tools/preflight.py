"""The checks of preflight.sbatch, the instructors' job for the day before the course.

    python tools/preflight.py node RESULTS            # on every node: versions, GPUs, data, output
    torchrun ... tools/preflight.py collective RESULTS --expect-intra GBPS --expect-inter GBPS
    python tools/preflight.py torchrun-failed RESULTS LOG ADDRESS PORT NODES
    python tools/preflight.py table RESULTS NODE...   # the PASS / WARN / FAIL / N/A table

Every check writes lines "STATUS<TAB>CHECK<TAB>WHERE<TAB>DETAIL" into a file of its own in the
folder RESULTS (a node's checks into node-<host>.tsv: the nodes never write one file together);
`table` prints them all in one table, in the order of CHECKS, and exits 1 on any FAIL. A FAIL
says what to do. N/A marks what does not apply: the GPU lines on a CPU node, the bus bandwidth
measured with gloo on CPUs (the expected figures are NCCL's on GPUs).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

PASS, WARN, FAIL, NA = "PASS", "WARN", "FAIL", "N/A"
CHECKS = ("report", "torch", "CUDA, driver, NCCL", "GPUs visible", "InfiniBand name",
          "c10d rendezvous", "all-reduce inside a node", "all-reduce across nodes",
          "data cache", "output folder", "GPU test suite")
# Bus bandwidth against the site's figure: PASS from 80 %, WARN from 50 %, FAIL below
GOOD, POOR = 0.8, 0.5


def write(results: Path, name: str, lines: list[tuple[str, str, str, str]]) -> None:
    results.mkdir(parents=True, exist_ok=True)
    with open(results / f"{name}.tsv", "a") as f:
        for line in lines:
            f.write("\t".join(str(x).replace("\t", " ").replace("\n", " ") for x in line) + "\n")


# ------------------------------------------------------------------------------ on every node
def nvidia_driver() -> str | None:
    """The NVIDIA driver's version, or None on a node without one (a CPU node)."""
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    versions = proc.stdout.split()
    return versions[0] if proc.returncode == 0 and versions else None


def amd_driver() -> str | None:
    """The AMD GPU driver's version as rocm-smi shows it ("Driver version: 6.8.5"), or None on a
    node without AMD GPUs."""
    try:
        proc = subprocess.run(["rocm-smi", "--showdriverversion"], capture_output=True, text=True,
                              timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"[Dd]river version:\s*(\S+)", proc.stdout)
    return found.group(1) if proc.returncode == 0 and found else None


def gpu_driver() -> tuple[str, str] | None:
    """("NVIDIA" or "AMD", the driver's version) of this node's GPUs, or None (a CPU node)."""
    for vendor, read in (("NVIDIA", nvidia_driver), ("AMD", amd_driver)):
        version = read()
        if version:
            return vendor, version
    return None


def gpu_lines(host: str) -> list[tuple]:
    import torch
    found = gpu_driver()
    slurm_gpus = os.environ.get("SLURM_JOB_GPUS") or os.environ.get("CUDA_VISIBLE_DEVICES") or ""
    asked = int(os.environ.get("SLURM_GPUS_ON_NODE") or 0)
    if found is None:
        given = f"; Slurm gave it GPU devices {slurm_gpus}" if slurm_gpus else ""
        why = f"no GPU driver on this node (nvidia-smi, rocm-smi): a CPU node{given}"
        return [(NA, "CUDA, driver, NCCL", host, why), (NA, "GPUs visible", host, why)]
    vendor, driver = found
    # The GPU build torch has: CUDA for NVIDIA GPUs, ROCm (HIP) for AMD ones; both behind torch.cuda.
    hip = getattr(torch.version, "hip", None)
    built_for = torch.version.cuda if vendor == "NVIDIA" else hip
    toolkit, variant = ("CUDA", "cuda") if vendor == "NVIDIA" else ("ROCm", "rocm")
    lines = []
    if built_for is None:
        kind = "a CPU-only build" if not (torch.version.cuda or hip) else (
            f"built for {'ROCm ' + hip if hip else 'CUDA ' + torch.version.cuda}")
        lines.append((FAIL, "CUDA, driver, NCCL", host,
                      f"torch {torch.__version__} is {kind}, on a node with {vendor} "
                      f"driver {driver}: make the environment with TORCH_VARIANT={variant} bash "
                      "setup_env.sh"))
    else:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "?"
        lines.append((PASS, "CUDA, driver, NCCL", host,
                      f"{toolkit} {built_for}, driver {driver}, {'NCCL' if hip is None else 'RCCL'} "
                      f"{nccl}"))
    n = torch.cuda.device_count() if built_for else 0
    if n == 0:
        lines.append((FAIL, "GPUs visible", host,
                      f"torch sees no GPU (driver {driver}, {toolkit} {built_for}, "
                      f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): "
                      "a driver older than torch's CUDA needs another build (setup_env.sh with "
                      "TORCH_INDEX_URL, README 'Environment'); without --gres=gpu:N Slurm hides "
                      "the GPUs"))
        return lines
    try:  # each GPU computes, not only shows up
        for i in range(n):
            torch.ones(8, device=f"cuda:{i}").sum().item()
    except RuntimeError as e:
        lines.append((FAIL, "GPUs visible", host, f"GPU {i} of {n} fails to compute "
                      f"({str(e).splitlines()[0][:120]}): tell the centre's support"))
        return lines
    name = torch.cuda.get_device_name(0)
    if asked and n < asked:
        lines.append((FAIL, "GPUs visible", host, f"torch sees {n} of the {asked} GPUs Slurm "
                      f"gave (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}): "
                      "do not set CUDA_VISIBLE_DEVICES by hand in the job"))
    else:
        lines.append((PASS, "GPUs visible", host, f"{n} x {name}, each computes"))
    return lines


def data_line(host: str, dataset: str, data_dir: str | None, cache_dir: str) -> tuple:
    from utils.data import DataUnavailableError, load_corpus
    where = data_dir or cache_dir
    try:
        start = time.perf_counter()
        corpus = load_corpus(dataset, data_dir=data_dir, cache_dir=cache_dir)
        seconds = time.perf_counter() - start
    except DataUnavailableError as e:
        return (FAIL, "data cache", host, f"{e}")
    except OSError as e:
        return (FAIL, "data cache", host, f"{where} cannot be read ({e.strerror or e}): make it "
                "readable for the participants' accounts (chmod -R a+rX) or set COURSE_DATA_CACHE")
    return (PASS, "data cache", host, f"{corpus.source}: {corpus.vocab_size:,} words, "
            f"{len(corpus.train) / 1e6:.2f}M training tokens, read in {seconds:.2f} s from {where}")


def output_line(host: str, out_dir: Path, results: Path) -> tuple:
    """A file written into the output folder: the table then looks for every node's file from
    the batch node, which shows whether the folder is shared (checkpoints need that)."""
    probe = out_dir / f".preflight-{os.environ.get('SLURM_JOB_ID', 'x')}" / host
    try:
        probe.parent.mkdir(parents=True, exist_ok=True)
        probe.write_text(f"{host}\n")
    except OSError as e:
        return (FAIL, "output folder", host, f"cannot write into {out_dir} ({e.strerror or e}): "
                "point OUT_DIR at project or scratch storage that the course accounts can write")
    (results / "shared").mkdir(exist_ok=True)
    (results / "shared" / host).write_text(str(probe))
    return (PASS, "output folder", host, f"{out_dir} is writable")


def node(args) -> int:
    import torch
    host = socket.gethostname()
    lines = [(PASS, "torch", host,
              f"torch {torch.__version__}, Python {platform.python_version()}")]
    lines += gpu_lines(host)
    lines.append(data_line(host, args.dataset, args.data_dir, args.cache_dir))
    lines.append(output_line(host, Path(args.out_dir), Path(args.results)))
    write(Path(args.results), f"node-{host}", lines)
    return 0


# ------------------------------------------------------------------------ under torchrun
def busbw(tensor, group, iters: int, device) -> float:
    """Bus bandwidth (GB/s) of an all-reduce of `tensor` over `group`: algbw x 2(n-1)/n."""
    import torch
    import torch.distributed as dist

    from utils.metrics import synchronize
    n = dist.get_world_size(group)
    for _ in range(2):
        dist.all_reduce(tensor, group=group)
    synchronize(device)
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(tensor, group=group)
    synchronize(device)
    seconds = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64,
                           device=tensor.device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=group)
    return tensor.numel() * tensor.element_size() / seconds.item() / 1e9 * 2 * (n - 1) / n


def verdict(check: str, measured: float, expected: float, what: str, gpu: bool) -> tuple:
    detail = f"{measured:.3g} GB/s bus bandwidth, {what}"
    if not gpu:
        return (NA, check, "job", f"{detail}, gloo on CPUs: the expected {expected:g} GB/s is "
                "NCCL's on GPUs")
    ratio = measured / expected if expected else 1.0
    detail += f": {ratio:.0%} of the expected {expected:g} GB/s"
    if ratio >= GOOD:
        return (PASS, check, "job", detail)
    advice = ("compare with nccl-tests and collectives.sbatch's NCCL transports (NET/IB between "
              "nodes, P2P/NVLink inside): NET/Socket means NCCL found no InfiniBand (NCCL_IB_HCA, "
              "NCCL_SOCKET_IFNAME); otherwise tell the centre's support")
    return (WARN if ratio >= POOR else FAIL, check, "job", f"{detail}: {advice}")


def collective(args) -> int:
    import torch
    import torch.distributed as dist

    from utils.distributed_utils import destroy_process_group, setup
    _, rank, device, world = setup()
    hosts = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    nodes = sorted(set(hosts))
    expected_nodes = int(os.environ.get("SLURM_JOB_NUM_NODES") or len(nodes))
    lines = []
    where = os.environ.get("RDZV_ENDPOINT") or (f"{os.environ.get('MASTER_ADDR')}:"
                                                f"{os.environ.get('MASTER_PORT')}")
    if len(nodes) == expected_nodes:
        lines.append((PASS, "c10d rendezvous", "job", f"{world} ranks on {len(nodes)} nodes "
                      f"({', '.join(nodes)}) joined through {where}"))
    else:
        lines.append((FAIL, "c10d rendezvous", "job", f"only {len(nodes)} of {expected_nodes} "
                      f"nodes joined ({', '.join(nodes)}): start one torchrun per node (srun)"))
    gpu = device.type == "cuda"
    size = args.bytes or (256 * 2**20 if gpu else 4 * 2**20)
    tensor = torch.ones(size // 4, device=device)
    # inside each node: one group per node (every rank creates every group, in the same order)
    groups = {h: dist.new_group([r for r, x in enumerate(hosts) if x == h]) for h in nodes}
    per_node = hosts.count(hosts[rank])
    if per_node > 1:
        inside = torch.tensor([busbw(tensor, groups[hosts[rank]], args.iters, device)],
                              dtype=torch.float64, device=tensor.device)
        dist.all_reduce(inside, op=dist.ReduceOp.MIN)  # the slowest node counts
        lines.append(verdict("all-reduce inside a node", inside.item(), args.expect_intra,
                             f"{size / 2**20:g} MiB on {per_node} ranks, the slowest node", gpu))
    else:
        lines.append((NA, "all-reduce inside a node", "job", "one process per node"))
    if len(nodes) > 1:
        tensor.fill_(1.0)
        across = busbw(tensor, None, args.iters, device)
        tensor.fill_(1.0)
        dist.all_reduce(tensor)
        wrong = int((tensor != world).sum())
        what = f"{size / 2**20:g} MiB on {world} ranks, {len(nodes)} nodes"
        line = verdict("all-reduce across nodes", across, args.expect_inter, what, gpu)
        if wrong:
            line = (FAIL, line[1], "job", f"{wrong} wrong elements in an all-reduce across "
                    "nodes: tell the centre's support (a broken link or NCCL setting)")
        lines.append(line)
    else:
        lines.append((NA, "all-reduce across nodes", "job", "one node"))
    if rank == 0:
        write(Path(args.results), "rendezvous", lines)
    destroy_process_group()
    return 0


def torchrun_failed(args) -> int:
    """torchrun ended with an error: a rendezvous that never formed, or a collective that broke."""
    results = Path(args.results)
    log = Path(args.log).read_text(errors="replace") if Path(args.log).is_file() else ""
    # Python's exception lines (the first is the innermost cause), without the module path
    errors = [re.sub(r"^(\w+\.)+(?=\w+(Error|Exception): )", "", l.strip())
              for l in log.splitlines() if re.match(r"^\s*(\w+\.)*\w+(Error|Exception): ", l)]
    why = (errors[0] if errors else "no Python error in the log: see above the table")[:220]
    if "Name or service not known" in log:
        why += f"; {args.address} does not resolve"
    joined = any(l.split("\t")[1:2] == ["c10d rendezvous"] for l in
                 (results / "rendezvous.tsv").read_text().splitlines()) if (
        results / "rendezvous.tsv").is_file() else False
    if joined:
        line = (FAIL, "all-reduce across nodes", "job", f"the ranks joined, then torchrun failed "
                f"({why}): see the job log above the table")
    else:
        line = (FAIL, "c10d rendezvous", f"{args.address}:{args.port}",
                f"torchrun on {args.nodes} nodes could not join ({why}): check that "
                f"{args.address} resolves and answers from every node (nslookup, ping; the "
                f"InfiniBand name rule), that port {args.port} is free and open between the "
                "nodes, or set MASTER_ADDR / MASTER_PORT")
    write(results, "rendezvous", [line])
    return 0


# ---------------------------------------------------------------------------------- the table
def table(args) -> int:
    results = Path(args.results)
    lines = []
    for f in sorted(results.glob("*.tsv")):
        for raw in f.read_text().splitlines():
            parts = raw.split("\t")
            if len(parts) == 4:
                lines.append(tuple(parts))
    reported = {where for _, check, where, _ in lines if check == "torch"}
    for host in args.nodes:
        if host not in reported:
            lines.append((FAIL, "report", host, "this node wrote no report: its step failed "
                          "(see the log above the table) or the results folder is not shared"))
    shared = results / "shared"
    for note in sorted(shared.iterdir()) if shared.is_dir() else []:
        if not Path(note.read_text().strip()).is_file():
            lines = [(FAIL, "output folder", where, f"written on {note.name} but not visible on "
                      f"{socket.gethostname()}: the output folder must be on a file system "
                      "every node shares (checkpoints are written by all ranks into one folder)")
                     if (check, where) == ("output folder", note.name) else (s, check, where, d)
                     for s, check, where, d in lines]
    order = {c: i for i, c in enumerate(CHECKS)}
    lines.sort(key=lambda l: (order.get(l[1], len(order)), l[2]))
    width = max([len(l[1]) for l in lines] + [5])
    where_width = max([len(l[2]) for l in lines] + [5])
    print(f"{'STATUS':<6}  {'CHECK':<{width}}  {'WHERE':<{where_width}}  DETAIL")
    for status, check, where, detail in lines:
        print(f"{status:<6}  {check:<{width}}  {where:<{where_width}}  {detail}")
    counts = {s: sum(l[0] == s for l in lines) for s in (PASS, WARN, FAIL, NA)}
    print("preflight: " + ", ".join(f"{n} {s}" for s, n in counts.items())
          + (": fix the FAIL lines before the course" if counts[FAIL] else
             ": ready" + (" (read the WARN lines)" if counts[WARN] else "")))
    return 1 if counts[FAIL] else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    n = sub.add_parser("node")
    n.add_argument("results")
    n.add_argument("--dataset", default="wikitext-2")
    n.add_argument("--data-dir", default=None)
    n.add_argument("--cache-dir", default=os.environ.get("COURSE_DATA_CACHE", "data_cache"))
    n.add_argument("--out-dir", default="runs")
    c = sub.add_parser("collective")
    c.add_argument("results")
    c.add_argument("--expect-intra", type=float, required=True, help="GB/s inside a node")
    c.add_argument("--expect-inter", type=float, required=True, help="GB/s across nodes")
    c.add_argument("--bytes", type=int, default=None)
    c.add_argument("--iters", type=int, default=10)
    f = sub.add_parser("torchrun-failed")
    for name in ("results", "log", "address", "port", "nodes"):
        f.add_argument(name)
    t = sub.add_parser("table")
    t.add_argument("results")
    t.add_argument("nodes", nargs="*")
    args = p.parse_args(argv)
    return {"node": node, "collective": collective, "torchrun-failed": torchrun_failed,
            "table": table}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
