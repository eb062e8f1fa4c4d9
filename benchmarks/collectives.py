"""How fast the network moves tensors: the collectives of the course, timed over message sizes,
in the layout of NCCL's own nccl-tests (the first thing HPC support staff run when a job is slow).

    torchrun --standalone --nproc_per_node=4 benchmarks/collectives.py            # one GPU node
    torchrun --standalone --nproc_per_node=3 benchmarks/collectives.py --json out.json   # CPUs
    sbatch collectives.sbatch          # one node, then two nodes, with the NCCL transport used
    python benchmarks/collectives.py --compare one_node.json two_nodes.json --plot compare.png

One process per GPU (NCCL), or per CPU slot (gloo). For every operation and every message size
(doubling from --min-bytes to --max-bytes) it runs --warmup untimed and --iters timed calls
back to back, with the GPU synchronised before the clock starts and after it stops, and takes
the slowest rank's mean. Then it runs the operation once more on known data and counts the
elements that came out wrong (nccl-tests' "#wrong"; it must be 0).

What the columns mean (nccl-tests' definitions, doc/PERFORMANCE.md there):
- size: bytes of the largest buffer of one rank: the tensor of all_reduce, broadcast and
  send/recv, the gathered output of all_gather, the input of reduce_scatter, the send buffer of
  all_to_all. Counts are rounded down to a multiple of the ranks where the data is split.
- algbw = size / time: what the application sees.
- busbw = algbw x factor: the bytes each rank's link carried per second, comparable with the
  link's data sheet and between world sizes. The factor is what a bandwidth-optimal algorithm
  must send per byte of `size`: 2(n-1)/n for all_reduce (a reduce-scatter, then an all-gather),
  (n-1)/n for all_gather, reduce_scatter and all_to_all (each rank keeps 1/n of the data),
  1 for broadcast and send/recv.

Operations (torch.distributed, torch 2.13 names; older releases fall back to the former ones):
all_reduce, all_gather (all_gather_single, formerly all_gather_into_tensor), reduce_scatter
(reduce_scatter_single, formerly reduce_scatter_tensor), all_to_all (all_to_all_single),
broadcast (from rank 0), sendrecv (every rank sends to rank + 1 and receives from rank - 1 at
once, batch_isend_irecv). gloo in torch 2.13 runs all six for float32/64, float16, bfloat16 and
the integer types; an operation a backend refuses for a dtype is skipped with its reason
instead of stopping the run. Summed values are small integers, exact in every dtype up to 50
ranks; bf16 and fp16 results are compared with a relative tolerance of 1 %.

Results: the nccl-tests table on stdout (rank 0), --json PATH (records with collective, bytes,
nominal_bytes (the size asked for), count, dtype, time_us, algbw_GBps, busbw_GBps, wrong, and
the run's meta data), --plot PNG (bus bandwidth against size). --compare A.json B.json draws
both runs per operation in one figure: the step from one node (NVLink, shared memory) to two
(InfiniBand) shows as a drop in busbw.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

# the course's packages where they are not installed (pip install -e .), as on a GPU node
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "sendrecv")
DTYPES = {"float32": "float32", "float": "float32", "fp32": "float32", "float64": "float64",
          "double": "float64", "float16": "float16", "half": "float16", "fp16": "float16",
          "bfloat16": "bfloat16", "bf16": "bfloat16", "int32": "int32", "int64": "int64",
          "int8": "int8", "uint8": "uint8"}


# ----------------------------------------------------------------------------- the definitions
def bus_factor(collective: str, n: int) -> float:
    """busbw / algbw for `collective` on `n` ranks (nccl-tests' doc/PERFORMANCE.md)."""
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if collective in ("broadcast", "sendrecv"):
        return 1.0
    raise ValueError(f"unknown collective {collective!r}: one of {', '.join(OPS)}")


def bandwidths(collective: str, nbytes: int, seconds: float, n: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (10^9 bytes per second, as nccl-tests prints)."""
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * bus_factor(collective, n)


def sizes_between(low: int, high: int, factor: int = 2) -> list[int]:
    sizes, size = [], low
    while size <= high:
        sizes.append(size)
        size *= factor
    return sizes


def human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.4g} {unit}"
        nbytes /= 1024
    return f"{nbytes}"


# ------------------------------------------------------------------------- one operation, timed
class Op:
    """Buffers and the call of one collective at one size on this rank, and its expected result.

    Rank r's input element i holds value(r, i) = (r % 4) + (i % 3) + 1: small integers, so every
    sum stays exact and every element says which rank and position it came from.
    """

    def __init__(self, name: str, nbytes: int, dtype, device, rank: int, n: int):
        import torch
        self.name, self.rank, self.n, self.dtype = name, rank, n, dtype
        size = torch.tensor([], dtype=dtype).element_size()
        count = max(nbytes // size, 1)
        if name in ("all_gather", "reduce_scatter", "all_to_all"):
            count = max(count // n, 1) * n  # the data is split into n equal parts
        self.count, self.nbytes = count, count * size
        part = count // n
        i = torch.arange(count, device=device)
        if name == "all_gather":
            self.input = self.value(rank, i[:part])
            self.output = torch.zeros(count, dtype=dtype, device=device)
        elif name == "reduce_scatter":
            self.input = self.value(rank, i)
            self.output = torch.zeros(part, dtype=dtype, device=device)
        elif name == "all_to_all":
            self.input = self.value(rank, i)
            self.output = torch.zeros(count, dtype=dtype, device=device)
        else:  # all_reduce, broadcast and sendrecv: one buffer of `count` elements
            self.input = self.value(rank, i)
            self.output = torch.zeros(count, dtype=dtype, device=device)
        self.i, self.part = i, part

    def value(self, rank, i):
        return ((rank % 4) + (i % 3) + 1).to(self.dtype)

    def run(self) -> None:
        import torch.distributed as dist
        name, n = self.name, self.n
        if name == "all_reduce":  # in place: the buffer is the result
            dist.all_reduce(self.output)
        elif name == "all_gather":
            all_gather_single()(self.output, self.input)
        elif name == "reduce_scatter":
            reduce_scatter_single()(self.output, self.input)
        elif name == "all_to_all":
            dist.all_to_all_single(self.output, self.input)
        elif name == "broadcast":
            dist.broadcast(self.output, src=0)
        elif name == "sendrecv":
            right, left = (self.rank + 1) % n, (self.rank - 1) % n
            ops = [dist.P2POp(dist.isend, self.input, right),
                   dist.P2POp(dist.irecv, self.output, left)]
            for request in dist.batch_isend_irecv(ops):
                request.wait()

    def reset(self) -> None:
        """The known data again (all_reduce and broadcast work in place)."""
        if self.name == "all_reduce":
            self.output.copy_(self.input)
        elif self.name == "broadcast":  # only rank 0 holds the data
            self.output.copy_(self.input) if self.rank == 0 else self.output.zero_()
        else:
            self.output.zero_()

    def expected(self):
        import torch
        n, r, i, part = self.n, self.rank, self.i, self.part
        if self.name == "all_reduce":
            return sum(self.value(q, i).double() for q in range(n))
        if self.name == "all_gather":  # part q comes from rank q
            return self.value(i // part, i % part).double()
        if self.name == "reduce_scatter":  # this rank's part of the sum
            mine = i[r * part:(r + 1) * part]
            return sum(self.value(q, mine).double() for q in range(n))
        if self.name == "all_to_all":  # part q comes from rank q's part r
            return self.value(i // part, r * part + i % part).double()
        if self.name == "broadcast":
            return self.value(0, i).double()
        if self.name == "sendrecv":
            return self.value((r - 1) % n, i).double()
        return torch.zeros(0)

    def wrong(self) -> int:
        """Elements of the result that differ from the expected ones (1 % tolerance in 16 bits)."""
        import torch
        got, want = self.output.double(), self.expected().to(self.output.device)
        tolerance = 0.01 if self.dtype in (torch.float16, torch.bfloat16) else 0.0
        return int((~torch.isclose(got, want, rtol=tolerance, atol=0.0)).sum())


def all_gather_single():
    import torch.distributed as dist
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_single():
    import torch.distributed as dist
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def time_op(op: Op, iters: int, warmup: int, device) -> float:
    """Mean seconds per call on the slowest rank: warm-up calls, then `iters` calls between two
    device synchronisations (a GPU runs the calls asynchronously: without them the clock would
    only measure the launches)."""
    import torch
    import torch.distributed as dist

    from utils.metrics import synchronize
    for _ in range(warmup):
        op.run()
    synchronize(device)
    dist.barrier()  # every rank starts the clock together
    start = time.perf_counter()
    for _ in range(iters):
        op.run()
    synchronize(device)
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64,
                           device=op.output.device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def measure(name: str, nbytes: int, dtype, device, iters: int, warmup: int, check: bool
            ) -> dict:
    import torch.distributed as dist
    rank, n = dist.get_rank(), dist.get_world_size()
    op = Op(name, nbytes, dtype, device, rank, n)
    op.reset()
    seconds = time_op(op, iters, warmup, device)
    wrong = -1
    if check:
        op.reset()
        op.run()
        from utils.metrics import synchronize
        synchronize(device)
        wrong = op.wrong()
    algbw, busbw = bandwidths(name, op.nbytes, seconds, n)
    return {"collective": name, "bytes": op.nbytes, "nominal_bytes": nbytes, "count": op.count,
            "dtype": str(dtype).replace("torch.", ""), "time_us": seconds * 1e6,
            "algbw_GBps": algbw, "busbw_GBps": busbw, "wrong": wrong}


def sum_wrong(records: list[dict], device) -> None:
    """The wrong elements of all ranks (each rank checked its own result)."""
    import torch
    import torch.distributed as dist
    counts = torch.tensor([max(r["wrong"], 0) for r in records], dtype=torch.int64, device=device)
    dist.all_reduce(counts)
    for record, count in zip(records, counts.tolist(), strict=True):
        if record["wrong"] >= 0:
            record["wrong"] = int(count)


# ------------------------------------------------------------------------------------ the table
def header(collective: str, meta: dict) -> list[str]:
    return [f"# {collective}: {meta['world_size']} ranks on {meta['nodes']} node(s), "
            f"{meta['backend']} on {meta['device_type']}, {meta['dtype']}, "
            f"{meta['iters']} timed calls after {meta['warmup']} warm-up, "
            f"busbw = algbw x {bus_factor(collective, meta['world_size']):.4g}",
            f"#{'size':>12} {'count':>12} {'type':>9} {'time':>10} {'algbw':>8} {'busbw':>8} "
            f"{'#wrong':>7}",
            f"#{'(B)':>12} {'(elements)':>12} {'':>9} {'(us)':>10} {'(GB/s)':>8} {'(GB/s)':>8} "
            f"{'':>7}"]


def row(r: dict) -> str:
    wrong = "N/A" if r["wrong"] < 0 else str(r["wrong"])
    return (f" {r['bytes']:>12} {r['count']:>12} {r['dtype']:>9} {r['time_us']:>10.1f} "
            f"{r['algbw_GBps']:>8.3f} {r['busbw_GBps']:>8.3f} {wrong:>7}")


def average_busbw(records: list[dict]) -> float:
    return sum(r["busbw_GBps"] for r in records) / len(records) if records else 0.0


# ------------------------------------------------------------------------------------ the plots
def plot(runs: list[tuple[str, list[dict]]], path: Path, title: str) -> Path:
    """Bus bandwidth against message size, one panel per collective, one line per run."""
    import matplotlib
    matplotlib.use("Agg")  # no display on a compute node
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    ops = [op for op in OPS if any(r["collective"] == op for _, recs in runs for r in recs)]
    cols = min(3, len(ops)) or 1
    rows = (len(ops) + cols - 1) // cols or 1
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False,
                             sharey=True)
    for ax, op in zip(axes.flat, ops, strict=False):
        for label, records in runs:
            mine = sorted((r for r in records if r["collective"] == op), key=lambda r: r["bytes"])
            if mine:
                ax.plot([r["bytes"] for r in mine], [r["busbw_GBps"] for r in mine], marker="o",
                        markersize=3, label=label)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(
            lambda x, _: human(x).replace(" ", "").replace("iB", "")))
        ax.set_title(op)
        ax.set_xlabel("message size (bytes)")
        ax.grid(True, alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("bus bandwidth (GB/s)")
    for ax in list(axes.flat)[len(ops):]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_label(meta: dict) -> str:
    per_node = meta["world_size"] // max(meta["nodes"], 1)
    return (f"{meta['nodes']} node{'s' if meta['nodes'] != 1 else ''} x {per_node} "
            f"({meta['backend']}, {meta['device_type']})")


def load_results(path: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        sys.exit(f"error: cannot read {path} ({type(e).__name__}): give the --json file of a "
                 "run of this benchmark")
    if not isinstance(data, dict) or "records" not in data or "meta" not in data:
        sys.exit(f"error: {path} is not a --json file of benchmarks/collectives.py")
    return data


def compare(paths: list[str], plot_path: str | None) -> int:
    """Two (or more) runs side by side: busbw of every collective at every size they share."""
    runs = [load_results(p) for p in paths]
    labels = [run_label(r["meta"]) for r in runs]
    if len(set(labels)) < len(labels):
        labels = [f"{label} [{Path(p).stem}]" for label, p in zip(labels, paths, strict=True)]
    print("# bus bandwidth (GB/s) of each run: " + "; ".join(
        f"{chr(65 + k)} = {label}" for k, label in enumerate(labels)))
    for op in OPS:
        # by the size asked for: split data is rounded to a multiple of each run's ranks
        by_run = [{r.get("nominal_bytes", r["bytes"]): r for r in run["records"]
                   if r["collective"] == op} for run in runs]
        if not all(by_run):
            continue
        sizes = sorted(set.intersection(*(set(b) for b in by_run)))
        print(f"# {op}")
        print(f"#{'size (B)':>12} " + " ".join(f"{chr(65 + k):>9}" for k in range(len(runs)))
              + (f" {'B / A':>7}" if len(runs) == 2 else ""))
        for size in sizes:
            values = [b[size]["busbw_GBps"] for b in by_run]
            ratio = f" {values[1] / values[0]:>7.2f}" if len(runs) == 2 and values[0] else ""
            print(f" {size:>12} " + " ".join(f"{v:>9.3f}" for v in values) + ratio)
    if plot_path:
        path = plot(list(zip(labels, [r["records"] for r in runs], strict=True)), Path(plot_path),
                    "bus bandwidth: " + " vs ".join(labels))
        print(f"# comparison plot: {path}")
    return 0


# ------------------------------------------------------------------------------------ the run
def parse_args(argv=None):
    from utils.args import OneLineParser, byte_size, positive_int
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--min-bytes", "-b", type=byte_size, default=byte_size("1K"),
                   help="smallest message (default 1K; suffixes K, M, G)")
    p.add_argument("--max-bytes", "-e", type=byte_size, default=None,
                   help="largest message (default 256M on GPUs, 4M on CPUs)")
    p.add_argument("--factor", "-f", type=positive_int, default=2,
                   help="each size is the previous one times this (default 2)")
    p.add_argument("--iters", "-n", type=positive_int, default=20,
                   help="timed calls per size (default 20)")
    p.add_argument("--warmup", "-w", type=int, default=5,
                   help="untimed calls before them (default 5)")
    p.add_argument("--ops", default=",".join(OPS),
                   help=f"comma-separated, from {', '.join(OPS)} (default all)")
    p.add_argument("--dtype", default="float32", help=f"one of {', '.join(sorted(set(DTYPES)))}")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip the correctness run (#wrong then shows N/A)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: one GPU per process with NCCL where CUDA is usable, else gloo")
    p.add_argument("--json", metavar="PATH", help="write the records and the run's meta data")
    p.add_argument("--plot", metavar="PNG", help="bus bandwidth against size (rank 0 draws it)")
    p.add_argument("--compare", nargs="+", metavar="JSON",
                   help="no benchmark: print and (with --plot) draw the runs of these --json "
                        "files side by side (e.g. one node and two nodes)")
    args = p.parse_args(argv)
    if args.compare is None:
        unknown = [o for o in args.ops.split(",") if o not in OPS]
        if unknown:
            p.error(f"argument --ops: unknown operation {unknown[0]!r}: choose from "
                    f"{', '.join(OPS)}")
        args.ops = [o for o in OPS if o in args.ops.split(",")]
        if args.dtype not in DTYPES:
            p.error(f"argument --dtype: {args.dtype!r} is not one of "
                    f"{', '.join(sorted(set(DTYPES)))}")
        if args.factor < 2:
            p.error("argument --factor: give 2 or more (the sizes must grow)")
        if args.warmup < 0:
            p.error("argument --warmup: give 0 or more")
        if args.max_bytes is not None and args.max_bytes < args.min_bytes:
            p.error(f"argument --max-bytes: {args.max_bytes} is below --min-bytes "
                    f"{args.min_bytes}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.compare:
        return compare(args.compare, args.plot)
    import torch
    import torch.distributed as dist

    from utils.distributed_utils import destroy_process_group, print0, setup
    _, rank, device, world_size = setup(device=args.device)
    dtype = getattr(torch, DTYPES[args.dtype])
    max_bytes = args.max_bytes or (256 * 2**20 if device.type == "cuda" else 4 * 2**20)
    sizes = sizes_between(args.min_bytes, max(max_bytes, args.min_bytes), args.factor)
    hosts = [None] * world_size
    dist.all_gather_object(hosts, socket.gethostname())
    meta = {"world_size": world_size, "nodes": len(set(hosts)), "hosts": sorted(set(hosts)),
            "backend": dist.get_backend(), "device_type": device.type,
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
            else "cpu", "dtype": str(dtype).replace("torch.", ""), "iters": args.iters,
            "warmup": args.warmup, "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda"
            else None, "command": " ".join(sys.argv), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    print0(f"# benchmarks/collectives.py: {world_size} ranks on {meta['nodes']} node(s) "
           f"({', '.join(meta['hosts'][:4])}{' ...' if len(meta['hosts']) > 4 else ''}), "
           f"{meta['backend']} on {meta['device_name']}, torch {meta['torch']}"
           + (f", NCCL {meta['nccl']}" if meta["nccl"] else ""))
    records, skipped = [], {}
    for name in args.ops:
        if name == "sendrecv" and world_size == 1:
            skipped[name] = "needs 2 or more ranks"
            continue
        mine = []
        for nbytes in sizes:
            try:
                mine.append(measure(name, nbytes, dtype, device, args.iters, args.warmup,
                                    args.check))
            except (RuntimeError, ValueError, TypeError) as e:
                # a backend that lacks an operation for this dtype refuses it on every rank
                skipped[name] = str(e).strip().splitlines()[0][:160]
                break
        if not mine:
            print0(f"# {name}: skipped: {skipped.get(name)}")
            continue
        if args.check:
            sum_wrong(mine, device)
        print0("\n".join(header(name, meta)))
        for record in mine:
            print0(row(record))
        print0(f"# {name}: average bus bandwidth {average_busbw(mine):.3f} GB/s"
               + (f" (skipped above {human(mine[-1]['bytes'])}: {skipped[name]})"
                  if name in skipped else ""))
        records += mine
    wrong = sum(max(r["wrong"], 0) for r in records)
    print0(f"# {len(records)} measurements, {wrong} wrong element(s)"
           + (f"; skipped: {', '.join(f'{k} ({v})' for k, v in skipped.items())}"
              if skipped else ""))
    if rank == 0:
        if args.json:
            path = Path(args.json)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_text(json.dumps({"meta": {**meta, "skipped": skipped},
                                       "records": records}, indent=1) + "\n")
            os.replace(tmp, path)
            print(f"# records: {path}", flush=True)
        if args.plot:
            label = run_label(meta)
            print(f"# plot: {plot([(label, records)], Path(args.plot), f'bus bandwidth, {label}')}",
                  flush=True)
    destroy_process_group()
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
