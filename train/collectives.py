"""Collectives by hand: a ring all-reduce written with point-to-point messages, the alpha-beta
cost model fitted to measured times, and what DDP's gradient all-reduce should cost per training
step, next to what the profiler recorded. The lesson after the collectives slides
(slides/00c2-collective-costs.md, docs/collectives.md); TODOs 49 to 54.

Top to bottom, main() checks your ring_all_reduce against dist.all_reduce, times both over
message sizes, fits latency and bus bandwidth to dist.all_reduce's times (or to the --bench-json
of benchmarks/collectives.py), predicts DDP's all-reduce time per step for --preset on this
many ranks, and with --trace reads the all-reduce time per step from a profiler trace of the
performance step. Check your work at any moment with
    python check.py collectives     # runs your file on 3 CPU processes: per TODO ok or what to fix
    diff -u train/collectives.py solutions/train/collectives.py

Run it (the ring needs 2 or more ranks; 3 show mistakes that 2 hide, where left and right are
the same neighbour):
    torchrun --standalone --nproc_per_node=3 train/collectives.py --preset tiny           # laptop
    torchrun --standalone --nproc_per_node=2 train/perf_training.py --preset tiny --max-steps 12 \\
        --profile --out-dir runs/perf    # the performance step's trace (after its --profile TODO)
    torchrun --standalone --nproc_per_node=2 train/collectives.py --preset tiny --trace runs/perf
    sbatch collectives.sbatch   # the benchmark on 1 and 2 nodes, the trace, then this, on 2 nodes
The trace is compared with a prediction for this run's ranks and model: run both with the same
--nproc_per_node (2 here), --preset and data (a trace of another run is named as such). Without
the performance step done, solutions/train/perf_training.py writes the same trace.
"""

import glob
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from model import TransformerLM, get_config
from utils.args import base_parser, byte_size, positive_int
from utils.checks import claim_lesson_out_dir
from utils.data import load_corpus_or_exit
from utils.distributed_utils import destroy_process_group, print0, setup
from utils.metrics import synchronize, write_summary

# DDP sends the gradients in buckets, each all-reduced as soon as backward has filled it: the
# first holds about 1 MiB (so that communication starts early), the others up to
# bucket_cap_mb = 25 MiB (DistributedDataParallel's defaults).
FIRST_BUCKET_BYTES = 2**20
BUCKET_BYTES = 25 * 2**20


# ---- the ring all-reduce ----
def send_right_receive_left(send: torch.Tensor, recv: torch.Tensor) -> None:
    """One step of the ring: send `send` to the next rank, (rank + 1) % n, and receive `recv`
    from the previous one, (rank - 1) % n, both at once."""
    rank, n = dist.get_rank(), dist.get_world_size()
    # TODO 49: Post both messages before waiting for either: every rank sends at the same moment,
    # and a blocking dist.send waits until its receiver has posted the matching receive, which
    # here nobody would ever do (a deadlock, on gloo and NCCL alike). Either
    #   requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, right),
    #                                      dist.P2POp(dist.irecv, recv, left)])
    # or request = dist.isend(...) and dist.irecv(...); then wait() for every request. right and
    # left are yours to define first: the neighbours' ranks, (rank + 1) % n and (rank - 1) % n.


def ring_reduce_scatter(chunks: list[torch.Tensor]) -> None:
    """Phase 1, in place: afterwards rank r holds the sum over all ranks of chunk (r + 1) % n."""
    rank, n = dist.get_rank(), dist.get_world_size()
    # TODO 50: n - 1 steps, s = 0, 1, ..., n - 2. In step s every rank sends chunk (rank - s) % n
    # to the right and adds the chunk it receives from the left (the left neighbour's chunk
    # (rank - s - 1) % n) to its own copy of that chunk. Receive into a new buffer
    # (torch.empty_like), then add in place (chunks[i] += received): the chunks are views into
    # the tensor being reduced, and chunks[i] = chunks[i] + received would only change the list.


def ring_all_gather(chunks: list[torch.Tensor]) -> None:
    """Phase 2, in place: each rank starts with the complete chunk (rank + 1) % n and ends with
    all n of them."""
    rank, n = dist.get_rank(), dist.get_world_size()
    # TODO 51: n - 1 steps again, s = 0, 1, ..., n - 2. In step s every rank sends the complete
    # chunk it got last, (rank + 1 - s) % n, to the right and receives the left neighbour's,
    # (rank - s) % n, straight into place: nothing to add any more.


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum a contiguous `tensor` over all ranks in place, as dist.all_reduce(tensor) does, with
    point-to-point messages only. Every rank sends 2 (n - 1) chunks of 1/n of the tensor: 2 (n - 1)
    / n times its size, almost independent of n. That is why a ring is bandwidth-optimal, and why
    nccl-tests multiplies by 2 (n - 1) / n to get the bus bandwidth."""
    n = dist.get_world_size()
    chunks = list(tensor.view(-1).tensor_split(n))  # n views; their sizes differ by 1 at most
    ring_reduce_scatter(chunks)
    ring_all_gather(chunks)
    return tensor


# ---- the alpha-beta model ----
def fit_alpha_beta(sizes: list[int], seconds: list[float], world_size: int
                   ) -> tuple[float, float]:
    """(latency in s, bus bandwidth in bytes/s) of an all-reduce that took `seconds` for messages
    of `sizes` bytes on `world_size` ranks, from the model time = latency + size / algbw."""
    # TODO 52: Fit the straight line seconds = latency + slope x size by least squares (the
    # slope is sum((x - mean x)(y - mean y)) / sum((x - mean x)^2), the latency mean y - slope x
    # mean x). 1 / slope is the algorithm bandwidth of large messages; the bus bandwidth, what
    # each link carried and what to compare with its data sheet, is that times 2 (n - 1) / n.
    return math.nan, math.nan


def ddp_bucket_bytes(model: torch.nn.Module) -> list[int]:
    """The bytes of each gradient bucket DDP all-reduces in a training step, as its Reducer
    forms them after the first step: the gradients in the order backward produces them (about
    the reverse of the parameters), a bucket closed once it holds FIRST_BUCKET_BYTES (the first)
    or BUCKET_BYTES (the others). A parameter is never split: a big one (the output layer) fills
    a bucket on its own. Gradients have their parameter's dtype: fp32, also under bf16 autocast."""
    buckets, size, limit = [], 0, FIRST_BUCKET_BYTES
    for p in reversed([p for p in model.parameters() if p.requires_grad]):
        size += p.numel() * p.element_size()
        if size >= limit:
            buckets.append(size)
            size, limit = 0, BUCKET_BYTES
    return buckets + ([size] if size else [])


def predict_ddp_allreduce_s(model: torch.nn.Module, world_size: int, latency: float,
                            busbw: float) -> float:
    """Seconds per training step that DDP's gradient all-reduce takes on `world_size` ranks."""
    buckets = ddp_bucket_bytes(model)
    # TODO 53: One all-reduce per bucket, each costing the latency once plus its bytes moved over
    # each link at the bus bandwidth: a ring all-reduce sends 2 (n - 1) / n times the bucket.
    return math.nan


# ---- what the profiler recorded ----
def allreduce_seconds_per_step(trace: dict) -> float:
    """All-reduce time per training step in a torch.profiler trace (a Chrome trace: events with
    "name", "cat" and "dur" in microseconds, and metadata events without "cat" and "dur"), as
    the performance step's --profile writes it."""
    events = trace["traceEvents"]
    # TODO 54: Add up the durations of the all-reduces and divide by the profiled steps (the
    # "ProfilerStep#N" events of category "user_annotation"; a GPU trace repeats them as
    # "gpu_user_annotation"). On a GPU the all-reduces are NCCL kernels (category "kernel",
    # "AllReduce" in the name); count only those: the CPU-side "nccl:all_reduce" and
    # "c10d::allreduce_" events only launch them. On a CPU, gloo runs them on its own thread as
    # "gloo:all_reduce" ranges (category "user_annotation").
    return math.nan


# ---- measuring ----
def time_per_call(fn, tensor: torch.Tensor, device: torch.device, iters: int, warmup: int
                  ) -> float:
    """Mean seconds per fn(tensor) on the slowest rank. A GPU runs the calls asynchronously:
    synchronize before each clock read, or the time is only how long queueing them took."""
    for _ in range(warmup):
        fn(tensor)
    synchronize(device)
    dist.barrier()  # every rank starts the clock together
    start = time.perf_counter()
    for _ in range(iters):
        fn(tensor)
    synchronize(device)
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64,
                           device=tensor.device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def ring_differences(device: torch.device, world_size: int) -> tuple[int, int]:
    """(wrong elements, elements) of ring_all_reduce against dist.all_reduce on a few tensors:
    smaller than the ring (empty chunks), not divisible by it, 2-D, float64."""
    wrong = total = 0
    generator = torch.Generator().manual_seed(dist.get_rank())
    for shape, dtype in (((max(world_size - 1, 1),), torch.float32), ((1001,), torch.float32),
                         ((7, 33), torch.float64), ((2**16 + 3,), torch.float32)):
        # drawn on the CPU (its generator gives the same numbers for every device), then moved
        data = torch.randint(-8, 8, shape, generator=generator, device="cpu").to(device, dtype)
        expected = data.clone()
        dist.all_reduce(expected)
        mine = ring_all_reduce(data.clone())
        wrong += int((mine != expected).sum())
        total += expected.numel()
    return wrong, total


def find_trace(path: str) -> Path | None:
    """Rank 0's trace in a run folder (OUT_DIR/profile), a profile folder, or the file itself."""
    p = Path(path)
    if p.is_file():
        return p
    for folder in (p / "profile", p):
        found = sorted(glob.glob(str(folder / "rank0.*.pt.trace.json")))
        if found:
            return Path(found[-1])
    return None


def usable_cores() -> int:
    """The CPU cores this process may run on (Slurm and taskset can give it fewer than the
    machine has; macOS has no sched_getaffinity)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def profiled_run(trace_file: Path) -> dict | None:
    """summary.json of the run that wrote the trace (OUT_DIR/profile/rank0.*.json: OUT_DIR's)."""
    for folder in (trace_file.parent.parent, trace_file.parent):
        if (folder / "summary.json").is_file():
            try:
                return json.loads((folder / "summary.json").read_text())
            except ValueError:
                return None
    return None


def other_run(profiled: dict, world_size: int, cfg, vocab_size: int) -> str | None:
    """One line saying how the profiled run differs from the one predicted here (ranks, words of
    the data, model shape) and what to run alike; None where they match."""
    theirs, ours, flags = [], [], []
    if profiled.get("world_size") not in (None, world_size):
        theirs.append(f"{profiled['world_size']} ranks")
        ours.append(f"{world_size} ranks")
        flags.append("--nproc_per_node")
    config = profiled.get("model_config") or {}
    # the words of the data: the performance step may pad the model's vocabulary beyond them
    words = profiled.get("data_vocab_size", config.get("vocab_size"))
    if words not in (None, vocab_size):
        theirs.append(f"a model of {words} words")
        ours.append(f"{vocab_size} words")
        flags.append("--data-dir")
    # the fields that size the parameters (dropout does not; vocab_size is the words above)
    shape = [k for k in ("d_model", "n_heads", "n_layers", "d_ff", "max_seq_len")
             if config.get(k, getattr(cfg, k)) != getattr(cfg, k)]
    if shape:
        theirs.append(", ".join(f"{k} {config[k]}" for k in shape))
        ours.append(", ".join(f"{k} {getattr(cfg, k)}" for k in shape))
        flags.append("--preset")
    if not theirs:
        return None
    return (f"WARNING: the trace is from {' and '.join(theirs)}, this run has "
            f"{' and '.join(ours)}: the prediction is for another run; run with the same "
            f"{' and '.join(flags)} as the profiled run")


def what_the_ratio_says(ratio: float, of_another_run: bool) -> str:
    """How to read the trace's all-reduce time against the prediction (docs/collectives.md)."""
    if of_another_run:
        return "a prediction for another run (the WARNING above)"
    if ratio > 1.5:
        return ("far above 1 is time spent waiting inside the all-reduce (for a slower rank, or "
                "for a core that backward holds: docs/collectives.md)")
    if ratio > 0.67:
        return "near 1: the model accounts for the time"
    return "below 1: faster than the fitted line (fitted to another run's times)"


def parse_args():
    parser = base_parser(__file__, __doc__, trains=False)
    lesson = parser.add_argument_group("the collectives lesson")
    lesson.add_argument("--max-bytes", type=byte_size, default=None,
                        help="largest message timed (default 64M on GPUs, 4M on CPUs)")
    lesson.add_argument("--iters", type=positive_int, default=10, help="timed calls per size")
    lesson.add_argument("--warmup", type=positive_int, default=3, help="untimed calls before")
    lesson.add_argument("--bench-json", metavar="PATH",
                        help="fit to the all_reduce records of benchmarks/collectives.py --json "
                             "instead of this run's own timings")
    lesson.add_argument("--trace", metavar="PATH",
                        help="the performance step's --out-dir (or its profile/ folder, or a "
                             "trace file): compare the prediction with its all-reduce time")
    return parser.parse_args()


def main():
    args = parse_args()
    out_dir = Path(args.out_dir)
    local_rank, rank, device, world_size = setup(args.seed, args.device)
    if world_size < 2:
        sys.exit("error: a ring needs 2 or more ranks: torchrun --standalone "
                 "--nproc_per_node=3 train/collectives.py ...")
    claim_lesson_out_dir(args, own_key="ring_elements")  # another run's folder keeps its results
    # ranks that outnumber the cores take turns on them: a rank waits for a core, and every
    # collective waits for the last rank (times of a few runs can differ by a factor)
    local_ranks, cores = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)), usable_cores()
    if local_ranks > cores:
        print0(f"note: {local_ranks} ranks share {cores} CPU core{'s' if cores > 1 else ''}: "
               "timings include waiting for a core (raise --iters, or fewer ranks)")

    # ---- 1. your ring against dist.all_reduce ----
    wrong, total = ring_differences(device, world_size)
    ring_ok = wrong == 0
    if ring_ok:
        print0(f"ring_all_reduce equals dist.all_reduce on {world_size} ranks ({total} elements "
               "in 4 tensors)")
    else:
        print0(f"ring_all_reduce differs from dist.all_reduce in {wrong} of {total} elements: "
               "finish TODOs 49-51 (python check.py collectives says which)")

    # ---- 2. both timed over message sizes ----
    max_bytes = args.max_bytes or (64 * 2**20 if device.type == "cuda" else 4 * 2**20)
    sizes = [2**k for k in range(10, 63) if 2**k <= max(max_bytes, 1024)]
    factor = 2 * (world_size - 1) / world_size  # bus bandwidth / algorithm bandwidth
    print0(f"{'size (B)':>12} {'dist.all_reduce (us)':>21} {'busbw (GB/s)':>13} "
           f"{'your ring (us)':>15} {'busbw (GB/s)':>13}")  # 3 significant digits
    measured = []
    for size in sizes:
        tensor = torch.ones(size // 4, device=device)
        native = time_per_call(dist.all_reduce, tensor, device, args.iters, args.warmup)
        ring = (time_per_call(ring_all_reduce, tensor, device, args.iters, args.warmup)
                if ring_ok else math.nan)
        measured.append((size, native))
        print0(f"{size:>12} {native * 1e6:>21.1f} {size / native * factor / 1e9:>13.3g} "
               f"{ring * 1e6:>15.1f} {size / ring * factor / 1e9:>13.3g}")

    # ---- 3. latency and bandwidth: the alpha-beta model ----
    fit_to, fit_world = measured, world_size
    if args.bench_json:
        bench = json.loads(Path(args.bench_json).read_text())
        fit_to = [(r["bytes"], r["time_us"] / 1e6) for r in bench["records"]
                  if r["collective"] == "all_reduce"]
        fit_world = bench["meta"]["world_size"]
    latency, busbw = fit_alpha_beta([s for s, _ in fit_to], [t for _, t in fit_to], fit_world)
    source = (f"{args.bench_json} ({fit_world} ranks)" if args.bench_json
              else "this run's dist.all_reduce")
    if math.isnan(busbw):
        print0(f"alpha-beta fit to {source}: not done yet (TODO 52)")
    elif busbw <= 0:  # times that do not grow with the size say nothing about bandwidth
        print0(f"alpha-beta fit to {source}: the times do not grow with the message size (noise, "
               "or messages too small to see the bandwidth): no prediction; time bigger ones "
               "(--max-bytes, or the benchmark's with --bench-json)")
        busbw = math.nan
    else:
        print0(f"alpha-beta fit to {source}: latency {latency * 1e6:.1f} us, bus bandwidth "
               f"{busbw / 1e9:.3g} GB/s")
        # The fit's bus bandwidth is the slope's, the limit that ever larger messages approach.
        # Each measured point pays the latency on top, so its own busbw lies below the fit's;
        # where the points do not lie on a line (a busy CPU, caches) the two differ more.
        size, seconds = max(fit_to)
        factor_fit = 2 * (fit_world - 1) / fit_world
        line = latency + size / busbw * factor_fit
        print0(f"  check of the fit at {size} B: measured {seconds * 1e3:.2f} ms "
               f"({size / seconds * factor_fit / 1e9:.3g} GB/s busbw, latency included), the line "
               f"says {line * 1e3:.2f} ms; the fitted busbw ({busbw / 1e9:.3g} GB/s) is the "
               "large-message limit, above every measured point's")

    # ---- 4. what DDP's gradient all-reduce should cost per step ----
    corpus = load_corpus_or_exit(args.dataset, args.data_dir, args.cache_dir, warn=print0,
                                 max_vocab=args.max_vocab)
    if corpus.source == "synthetic" and args.dataset != "synthetic":
        # nothing trains here, but the vocabulary sizes the embedding and the output layer
        print0(f"note: here the synthetic corpus's vocabulary ({corpus.vocab_size} words) sizes "
               "the gradients and DDP's buckets; WikiText-2's gives other numbers")
    cfg = get_config(args.preset, vocab_size=corpus.vocab_size, max_seq_len=args.seq_len,
                     n_layers=args.n_layers)
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        model = TransformerLM(cfg)
    predicted = (predict_ddp_allreduce_s(model, world_size, latency, busbw)
                 if not math.isnan(busbw) else math.nan)
    buckets = ddp_bucket_bytes(model)
    print0(f"model: {args.preset}, {model.num_params() / 1e6:.1f}M parameters, "
           f"{sum(buckets) / 1e6:.1f} MB of gradients in {len(buckets)} DDP "
           f"bucket{'s' if len(buckets) != 1 else ''}; all-reduce "
           f"on {world_size} ranks, "
           + ("predicted: needs a bus bandwidth (above)" if math.isnan(busbw)
              else "predicted: not done yet (TODO 53)" if math.isnan(predicted)
              else f"predicted: {predicted * 1e3:.2f} ms per step"))

    # ---- 5. against the profiler's trace of the performance step ----
    from_trace, trace_file = math.nan, None
    if args.trace:
        trace_file = find_trace(args.trace)
        if trace_file is None:
            print0(f"--trace {args.trace}: no rank0.*.pt.trace.json there: run the performance "
                   "step with --profile and give its --out-dir")
        else:
            profiled = profiled_run(trace_file)
            differs = profiled and other_run(profiled, world_size, cfg, corpus.vocab_size)
            if differs:
                print0(differs)
            from_trace = allreduce_seconds_per_step(json.loads(trace_file.read_text()))
            print0(f"profiler trace {trace_file}: "
                   + ("not read yet (TODO 54)" if math.isnan(from_trace)
                      else f"{from_trace * 1e3:.2f} ms of all-reduce per step"))
            if not math.isnan(from_trace) and predicted and not math.isnan(predicted):
                # the trace holds every all-reduce of a step: the gradient buckets' and the
                # loss's (all_reduce_mean: one tiny message, about one latency)
                with_loss = predicted + latency
                ratio = from_trace / with_loss
                print0(f"  predicted {with_loss * 1e3:.2f} ms (the gradients {predicted * 1e3:.2f} "
                       f"+ the loss's all-reduce {latency * 1e3:.2f}): the trace shows "
                       f"{ratio:.2f} x the prediction; {what_the_ratio_says(ratio, bool(differs))}")

    write_summary(out_dir, {
        "world_size": world_size, "ring_wrong": wrong, "ring_elements": total,
        "sizes": [s for s, _ in measured], "allreduce_s": [t for _, t in measured],
        "fit_source": source, "latency_s": latency, "busbw_Bps": busbw,
        "preset": args.preset, "model_config": cfg.to_dict(), "parameters": model.num_params(),
        "buckets": buckets,
        "predicted_s": predicted, "trace": str(trace_file) if trace_file else None,
        "trace_s": from_trace})
    destroy_process_group()


if __name__ == "__main__":
    main()
