"""Tokens/s and MFU of the training step for each speed-up of the performance step, one after
the other, on this machine's device. Prints a table; asserts nothing.

    python benchmarks/bench_precision.py --preset workshop              # a GPU: the issue's table
    python benchmarks/bench_precision.py --preset tiny --big-batch 128  # a laptop CPU, ~2 minutes

Rows: fp32 (PyTorch's default), tf32 (the global TF32 switch), bf16 (autocast, fp32 weights),
bf16 + fused AdamW, bf16 + fused + torch.compile of the blocks, and with --big-batch the last
at a bigger batch. MFU divides by the peak of the precision the matmuls run in (the data sheet
of a known GPU, else a measured matmul), as the training scripts do. Each row is the median of
--repeat timed steps after warm-up steps (compiling happens in the warm-up). On a CPU there is
no TF32 (the row repeats fp32) and the fused AdamW is not used, as in the scripts.
"""

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# the course's packages where they are not installed (pip install -e .), as on a GPU node
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model import TransformerLM, get_config  # noqa: E402
from utils.metrics import flops_per_token, peak_flops, synchronize  # noqa: E402
from utils.precision import autocast, compile_blocks, set_precision  # noqa: E402

WIKITEXT2_VOCAB = 33278


def bench(preset, device, precision, fused, compile, batch, warmup, repeat, peaks) -> dict:
    precision = set_precision(precision, device)
    cfg = get_config(preset, vocab_size=WIKITEXT2_VOCAB, dropout=0.0)
    torch.manual_seed(0)
    model = TransformerLM(cfg).to(device)
    if compile:
        compile_blocks(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4,
                                  fused=fused and device.type == "cuda")
    x = torch.randint(cfg.vocab_size, (batch, cfg.max_seq_len), device=device)
    y = torch.randint(cfg.vocab_size, (batch, cfg.max_seq_len), device=device)

    def step():
        with autocast(precision, device):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeat):
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - start)
    tokens_per_s = batch * cfg.max_seq_len / statistics.median(times)
    fpt = flops_per_token(model.num_params(exclude_embeddings=True), cfg.n_layers, cfg.d_model,
                          cfg.max_seq_len)
    peak, source = peaks[precision]
    model = optimizer = None  # free the GPU memory before the next setting
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dict(tokens_per_s=tokens_per_s, mfu=tokens_per_s * fpt / peak, peak=peak,
                source=source)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--big-batch", type=int, default=None,
                   help="also the fastest setting at this batch size (e.g. 128)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--no-compile", action="store_true", help="leave out the torch.compile rows")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeat", type=int, default=10)
    args = p.parse_args()
    device = torch.device("cuda" if args.device == "cuda" or
                          (args.device == "auto" and torch.cuda.is_available()) else "cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    print(f"{args.preset} preset, batch {args.batch_size}, torch {torch.__version__}, "
          f"{device.type} ({name or platform.machine()}), {torch.get_num_threads()} threads")

    rows = [("fp32", "fp32", False, False, args.batch_size),
            ("tf32", "tf32", False, False, args.batch_size),
            ("bf16 autocast", "bf16", False, False, args.batch_size),
            ("bf16 + fused AdamW", "bf16", True, False, args.batch_size)]
    if not args.no_compile:
        rows.append(("bf16 + fused + compile", "bf16", True, True, args.batch_size))
    if args.big_batch:
        rows.append((f"same, batch {args.big_batch}", "bf16", True, not args.no_compile,
                     args.big_batch))
    # Each peak once, before the rows: on a CPU it is measured, and measuring takes a moment.
    peaks = {p: peak_flops(device, set_precision(p, device)) for p in ("fp32", "tf32", "bf16")}
    print("| setting | tokens/s | vs fp32 | MFU | peak (source) |\n|---|---|---|---|---|")
    base = None
    for label, precision, fused, compile, batch in rows:
        # compiled steps: more warm-up (the first ones compile, the next may recompile)
        r = bench(args.preset, device, precision, fused, compile, batch,
                  args.warmup + (2 if compile else 0), args.repeat, peaks)
        base = base or r["tokens_per_s"]
        print(f"| {label} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / base:.2f}x | "
              f"{r['mfu']:.1%} | {r['peak'] / 1e12:.3g} TFLOP/s ({r['source']}) |", flush=True)
    set_precision("fp32", device)


if __name__ == "__main__":
    main()
