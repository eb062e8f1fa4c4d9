"""What watching a run costs: the training step with and without the monitor (utils/monitor.py).

    python benchmarks/bench_monitoring.py [--preset tiny] [--rounds 40] [--steps 10]

Both loops are the scripts' loop on one process (DataLoader, forward, loss, backward, AdamW,
Throughput): "with" adds what every script adds, monitor.batches() around the loader, the forward
hooks, report() every --log-every steps (gradient norm, one collective, TensorBoard events
written to a temporary folder) and the system sampler's thread. The two alternate round by
round, so a neighbour's load hits both alike; a round's time per step is its whole time over
its steps (a report step included), and the overhead is the median of the ratios of
neighbouring rounds. On a busy shared machine that ratio is noisy, so the monitor's own parts
are also timed alone (the best of a few timings) and added up per step, and the rounds are
compared by the CPU time of the training thread too (with --threads 1 it does all the work),
which other processes' load changes far less than the wall time. Prints numbers; asserts nothing.
"""

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

# the course's packages where they are not installed (pip install -e .), as on a GPU node
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model import TransformerLM, get_config  # noqa: E402
from utils.data import TokenWindows  # noqa: E402
from utils.metrics import Throughput, synchronize  # noqa: E402
from utils.monitor import TrainingMonitor  # noqa: E402

VOCAB = 33278  # WikiText-2's


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--rounds", type=int, default=40, help="rounds of each, alternating")
    p.add_argument("--steps", type=int, default=10, help="timed steps per round")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads (1: all the work in the thread whose CPU time is measured)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    cfg = get_config(args.preset, vocab_size=VOCAB, dropout=0.0)
    torch.manual_seed(0)
    model = TransformerLM(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    tokens = torch.randint(VOCAB, (args.batch_size * (args.steps + 2) * cfg.max_seq_len,))
    loader = DataLoader(TokenWindows(tokens, cfg.max_seq_len), batch_size=args.batch_size,
                        drop_last=True)
    flags = SimpleNamespace(logger="tensorboard", precision="fp32", log_every=args.log_every,
                            preset=args.preset, batch_size=args.batch_size)
    out = tempfile.mkdtemp(prefix="bench_monitoring.")
    throughput = Throughput(device)
    monitor = TrainingMonitor(flags, out, model, optimizer, throughput, 1e6,
                              total_steps=args.rounds * args.steps)

    done = [0]  # steps over all rounds: a report every --log-every of them, as in a run

    def one_round(monitored: bool) -> tuple[float, float]:
        steps, cpu = 0, time.thread_time()
        batches = monitor.batches(loader) if monitored else loader
        synchronize(device)
        start = time.perf_counter()
        for x, y in batches:
            if steps == args.steps:
                break
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            steps += 1
            throughput.step(x.numel())
            step_loss = loss.detach()
            if monitored:
                done[0] += 1
                if done[0] % args.log_every == 0:
                    monitor.report(done[0], step_loss)
        synchronize(device)
        seconds, cpu = time.perf_counter() - start, time.thread_time() - cpu
        throughput.pause()
        return seconds / steps, cpu / steps

    one_round(True), one_round(False)  # warm-up
    rounds = {True: [], False: []}
    for i in range(args.rounds):
        for monitored in ((True, False) if i % 2 else (False, True)):
            rounds[monitored].append(one_round(monitored))
    # each pair of neighbouring rounds ran under about the same load from other processes
    ratios = [w[0] / wo[0] for w, wo in zip(rounds[True], rounds[False])]
    # the training thread's own CPU time: what other processes' load changes least
    cpu_ratios = [w[1] / wo[1] for w, wo in zip(rounds[True], rounds[False])]
    cpu_without = statistics.median(wo[1] for wo in rounds[False])
    rounds = {k: [wall for wall, _ in v] for k, v in rounds.items()}
    report_s = []
    for _ in range(20):
        synchronize(device)
        start = time.perf_counter()
        monitor.report(1, loss=torch.ones((), device=device))
        report_s.append(time.perf_counter() - start)
    sample_s = []
    for _ in range(50):
        start = time.perf_counter()
        monitor.sampler.sample()
        sample_s.append(time.perf_counter() - start)
    # what the monitor adds to every step, timed alone: the batches() wrapper and the two
    # forward hooks (on an empty module: only their own cost)
    items = list(range(10000))
    plain, wrapped = best_of(lambda: [i for i in items]), best_of(
        lambda: [i for i in monitor.batches(items)])
    per_batch = (wrapped - plain) / len(items)
    identity, hooked = torch.nn.Identity(), torch.nn.Identity()
    from utils.monitor import ForwardTimer
    ForwardTimer(hooked, device)
    x = torch.zeros(1, device=device)
    bare = best_of(lambda: [identity(x) for _ in range(1000)])
    per_forward = (best_of(lambda: [hooked(x) for _ in range(1000)]) - bare) / 1000
    monitor.close()

    without, with_ = statistics.median(rounds[False]), statistics.median(rounds[True])
    accounted = per_batch + per_forward + statistics.median(report_s) / args.log_every
    print(f"{cpu_model()} ({torch.get_num_threads()} threads), torch {torch.__version__}, "
          f"{device}, preset {args.preset}, batch {args.batch_size}, --log-every {args.log_every}")
    print(f"step without monitoring: {without * 1e3:.2f} ms (median of {args.rounds} rounds of "
          f"{args.steps} steps; rounds {min(rounds[False]) * 1e3:.2f}-{max(rounds[False]) * 1e3:.2f})")
    print(f"step with monitoring:    {with_ * 1e3:.2f} ms (rounds "
          f"{min(rounds[True]) * 1e3:.2f}-{max(rounds[True]) * 1e3:.2f})")
    print(f"overhead, interleaved, wall time: {100 * (statistics.median(ratios) - 1):+.2f} % "
          f"of the step (median of {len(ratios)} neighbouring pairs; medians of all rounds: "
          f"{100 * (with_ / without - 1):+.2f} %)")
    print(f"overhead, interleaved, the training thread's CPU time: "
          f"{100 * (statistics.median(cpu_ratios) - 1):+.2f} % of {cpu_without * 1e3:.2f} ms "
          f"(median of the pairs' ratios)")
    print(f"overhead, its parts timed alone: {accounted * 1e6:.0f} us per step = "
          f"{100 * accounted / without:.3f} % of the step without monitoring: batches() "
          f"{per_batch * 1e6:.1f} us, forward hooks {per_forward * 1e6:.1f} us, report() "
          f"{statistics.median(report_s) * 1e3:.2f} ms every {args.log_every} steps; a system "
          f"sample (background thread) {statistics.median(sample_s) * 1e6:.0f} us every 5 s")


def best_of(fn, repeat: int = 5) -> float:
    """The fastest of `repeat` timings of fn(): the cost itself, without the neighbours' load."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


if __name__ == "__main__":
    main()
