"""Tokens/s and MFU of the training step, the matmul peak MFU divides by, and whether the data
loader keeps up. Prints numbers; asserts nothing (timings belong in benchmarks, not tests).

    python benchmarks/bench_train_step.py [--presets tiny workshop] [--data-dir DIR]

Each measurement is the median of several timed steps after warm-up steps. Run it on an idle
machine: step times on shared CPUs vary by 20-30 %.
"""

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

# the course's packages where they are not installed (pip install -e .), as on a GPU node
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model import TransformerLM, get_config  # noqa: E402
from utils.data import TokenWindows, load_corpus  # noqa: E402
from utils.metrics import flops_per_token, measure_matmul_flops, synchronize  # noqa: E402

WIKITEXT2_VOCAB = 33278
BATCH = {"tiny": 32, "small": 32, "workshop": 8}  # the course's per-rank batch; 8 for CPU memory


def time_steps(fn, warmup: int, repeat: int, device) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_preset(preset: str, device, peak: float, repeat: int) -> dict:
    cfg = get_config(preset, vocab_size=WIKITEXT2_VOCAB, dropout=0.0)
    torch.manual_seed(0)
    model = TransformerLM(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = BATCH[preset]
    x = torch.randint(cfg.vocab_size, (batch, cfg.max_seq_len), device=device)
    y = torch.randint(cfg.vocab_size, (batch, cfg.max_seq_len), device=device)

    def step():
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    big = preset == "workshop"
    seconds = time_steps(step, warmup=1 if big else 3, repeat=3 if big else repeat, device=device)
    tokens_per_s = batch * cfg.max_seq_len / seconds
    fpt = flops_per_token(model.num_params(exclude_embeddings=True), cfg.n_layers, cfg.d_model,
                          cfg.max_seq_len)
    return dict(preset=preset, batch=batch, seq_len=cfg.max_seq_len, step_s=seconds,
                tokens_per_s=tokens_per_s, mfu=tokens_per_s * fpt / peak)


def bench_loader(tokens: torch.Tensor, seq_len: int, batch: int, workers: int) -> float:
    """Tokens/s the DataLoader delivers over one pass (capped at 200 batches)."""
    loader = DataLoader(TokenWindows(tokens, seq_len), batch_size=batch, shuffle=True,
                        drop_last=True, num_workers=workers)
    start, n = time.perf_counter(), 0
    for i, (x, _) in enumerate(loader):
        n += x.numel()
        if i == 200:
            break
    return n / (time.perf_counter() - start)


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=["tiny", "workshop"])
    p.add_argument("--data-dir", help="real text for the data-loader measurement "
                                      "(default: the synthetic corpus)")
    p.add_argument("--repeat", type=int, default=10)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    threads = torch.get_num_threads()
    peak = measure_matmul_flops(device, torch.float32, n=2048, seconds=2.0)
    peak_bf16 = measure_matmul_flops(device, torch.bfloat16, n=2048, seconds=2.0)
    print(f"{cpu_model() if device.type == 'cpu' else torch.cuda.get_device_name()}")
    print(f"device {device}, {threads} threads; measured matmul peak (2048x2048): "
          f"fp32 {peak / 1e9:.0f} GFLOP/s, bf16 {peak_bf16 / 1e9:.0f} GFLOP/s (MFU divides by fp32)")

    corpus = (load_corpus("wikitext-2", args.data_dir) if args.data_dir
              else load_corpus("synthetic"))
    print(f"{'preset':>9} {'batch':>5} {'seq':>4} {'step s':>8} {'tokens/s':>9} {'MFU':>6} "
          f"{'loader tokens/s':>16} {'loader/step':>11}")
    for preset in args.presets:
        r = bench_preset(preset, device, peak, args.repeat)
        loader = bench_loader(corpus.train, r["seq_len"], r["batch"], workers=0)
        print(f"{preset:>9} {r['batch']:>5} {r['seq_len']:>4} {r['step_s']:>8.3f} "
              f"{r['tokens_per_s']:>9.0f} {r['mfu']:>6.1%} {loader:>16.0f} "
              f"{loader / r['tokens_per_s']:>10.0f}x")


if __name__ == "__main__":
    main()
