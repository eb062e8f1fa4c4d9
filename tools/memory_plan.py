"""Will it fit? Bytes per GPU of a model for every way of splitting it, before you ask for nodes.

    python tools/memory_plan.py --params 7e9 --gpus 8 --gpu-memory 80
    python tools/memory_plan.py --preset workshop --gpus 4 --gpu-memory 40 --batch-size 32
    python tools/memory_plan.py --params 70e9 --gpus 64 --gpu-memory 80 --tp 8 --json plan.json

For each layout (DDP, ZeRO-1, ZeRO-2, ZeRO-3 = FSDP, FSDP without resharding, ZeRO-3 with CPU
offload, ZeRO-3 with activation checkpointing; all with the --tp and --pp degrees given) it
prints parameters, gradients, optimizer state, activations and FSDP's gathered weights per GPU,
and whether they fit. The numbers come from utils/memory.py's `predict`, the formula that every
training script prints next to its measured breakdown (and tests/test_memory.py holds to it):
16 bytes per parameter for AdamW with mixed precision (4 fp32 weights + 4 gradients + 8 for the
two moments; the classic bf16 layout, 2 + 2 + 12, is 16 too), divided by the ranks that shard
each part; activations per token and layer from the model's shape (docs/memory.md).

--params alone assumes a Llama-like shape (d_ff = 4 d_model, head size 128, d_model about 128
layers wide) for the activations; --preset uses the course's exact shape.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.transformer import PRESETS, ModelConfig  # noqa: E402
from utils.memory import CATEGORIES, Layout, param_counts, predict  # noqa: E402
from utils.files import atomic_write_json  # noqa: E402

GiB = 2**30
# the share of a GPU's memory the tensors may use: the CUDA context, the allocator's cache and
# fragmentation, NCCL's buffers and the temporaries of single kernels take the rest
USABLE = 0.9


def shape_for(params: float, vocab: int, seq_len: int) -> ModelConfig:
    """A Llama-like shape with about `params` parameters: 12 d^2 per layer, d = 128 x layers."""
    layers = max(1, round((params / (12 * 128**2)) ** (1 / 3)))
    d_model = max(128, round(128 * layers / 128) * 128)
    layers = max(1, round((params - 2 * vocab * d_model) / (12 * d_model**2)))
    return ModelConfig(vocab_size=vocab, d_model=d_model, n_heads=d_model // 128,
                       n_layers=layers, d_ff=4 * d_model, max_seq_len=seq_len, dropout=0.0)


# The rows by the memory step's --layout names where it has the layout (train/memory_training.py).
# Its zero2 is FSDP keeping the gathered weights until backward (ZeRO-2-like: after a step it
# holds what ZeRO-3 holds, between forward and backward the whole model); DeepSpeed's ZeRO-2
# (parameters whole, gradients and optimizer state sharded) has no layout in the course.
DDP, ZERO1, ZERO2_DEEPSPEED, ZERO3, ZERO2, OFFLOAD, CHECKPOINTING = (
    "ddp", "zero1 (ZeroRedundancyOptimizer)", "ZeRO-2 (DeepSpeed; no course layout)",
    "zero3 (FSDP)", "zero2 (FSDP, reshard_after_forward=False)", "offload (zero3 + CPU offload)",
    "zero3 --activation-checkpointing")


def layouts(gpus: int, tp: int, pp: int) -> dict[str, Layout]:
    common = dict(dp=gpus // (tp * pp), tp=tp)
    return {
        DDP: Layout(zero=0, **common),
        ZERO1: Layout(zero=1, **common),
        ZERO2_DEEPSPEED: Layout(zero=2, **common),
        ZERO3: Layout(zero=3, **common),
        ZERO2: Layout(zero=3, reshard=False, **common),
        OFFLOAD: Layout(zero=3, offload=True, **common),
        CHECKPOINTING: Layout(zero=3, checkpointing=True, **common),
    }


def plan(cfg: ModelConfig, *, gpus: int, gpu_memory_gib: float, batch_size: int, tp: int = 1,
         pp: int = 1, precision: str = "bf16", params: float | None = None,
         microbatches: int | None = None, schedule: str = "1f1b") -> dict:
    """Per layout: bytes per GPU by category, the total on the GPU, in host memory, and fits.

    With pipeline stages the first stage is the fullest: the embeddings, its blocks and the
    activations of the microbatches it has run forward but not yet backward. Under 1F1B that is
    at most one per stage (it starts a backward as soon as the last stage can); under GPipe all
    of them (every forward runs before the first backward)."""
    if gpus % (tp * pp):
        raise SystemExit(f"error: --gpus {gpus} must be a multiple of --tp {tp} x --pp {pp}")
    layers_per_stage = -(-cfg.n_layers // pp)
    counts = param_counts(cfg)
    counted = counts["sharded"] + counts["replicated"]
    scale = (params / counted) if params else 1.0  # --params: the given count, not the shape's
    microbatches = (microbatches or pp) if pp > 1 else 1
    tokens = batch_size * cfg.max_seq_len // microbatches  # of one microbatch
    rows = {}
    for name, layout in layouts(gpus, tp, pp).items():
        if pp > 1:  # the first stage (see above)
            alive = min(pp, microbatches) if schedule == "1f1b" else microbatches
            layout = replace(layout, layers=layers_per_stage, last=False, microbatches=alive)
        numbers = predict(cfg, tokens, layout, precision=precision)
        state = {k: numbers[k] * scale for k in ("parameters", "gradients", "optimizer")}
        row = {**state, "activations": numbers["activations"],
               "gathered": numbers["gathered"] * scale}
        on_host = sum(state.values()) if layout.offload else 0.0
        row["gpu_total"] = sum(row[k] for k in (*CATEGORIES, "gathered")) - on_host
        row["host_total"] = on_host
        row["fits"] = row["gpu_total"] <= USABLE * gpu_memory_gib * GiB
        rows[name] = row
    return {"model": cfg.to_dict(), "params": params or counted, "gpus": gpus, "tp": tp,
            "pp": pp, "microbatches": microbatches, "schedule": schedule, "dp": gpus // (tp * pp), "batch_size": batch_size,
            "precision": precision, "gpu_memory_gib": gpu_memory_gib, "usable_share": USABLE,
            "layouts": rows}


def unit_for(largest: float) -> tuple[str, float]:
    """GiB for real models, MiB or KiB for the course's small presets (0.00 GiB tells nothing)."""
    for name, size in (("GiB", GiB), ("MiB", 2**20)):
        if largest >= size:
            return name, size
    return "KiB", 2**10


def count_text(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n:,.0f}"


def render(result: dict) -> str:
    m = result["model"]
    unit, size = unit_for(max(row["gpu_total"] for row in result["layouts"].values()))
    lines = [f"{count_text(result['params'])} parameters (d_model {m['d_model']}, "
             f"{m['n_layers']} layers, vocabulary {m['vocab_size']}, sequence {m['max_seq_len']}); "
             f"{result['gpus']} GPUs of {result['gpu_memory_gib']:g} GiB = dp {result['dp']} x "
             f"tp {result['tp']} x pp {result['pp']}"
             + (f" ({result['microbatches']} microbatches, {result['schedule']}; the first "
                f"stage)" if result["pp"] > 1 else "")
             + f"; batch {result['batch_size']} sequences "
             f"per GPU, {result['precision']}; activations with dropout off (dropout adds its "
             f"masks); total = the sum of the columns, as in the scripts' memory line",
             f"{unit + ' per GPU':<42}{'params':>9}{'grads':>9}{'optim':>9}{'activ':>9}"
             f"{'gathered':>9}{'total':>9}  fits in {USABLE:.0%}?"]
    for name, row in result["layouts"].items():
        host = f" (+{row['host_total'] / size:.1f} {unit} host)" if row["host_total"] else ""
        lines.append(f"{name:<42}" + "".join(
            f"{row[k] / size:>9.2f}" for k in (*CATEGORIES, "gathered", "gpu_total"))
            + f"  {'yes' if row['fits'] else 'NO'}{host}")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=float, help="parameter count, e.g. 7e9")
    what.add_argument("--preset", choices=list(PRESETS), help="a course model")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--gpu-memory", type=float, default=80.0, metavar="GIB",
                   help="memory of one GPU in GiB (default 80)")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per GPU and step")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per sequence (default: the preset's, or 4096)")
    p.add_argument("--vocab", type=int, default=None,
                   help="vocabulary (default: WikiText-2's 33278 for presets, else 32000)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages")
    p.add_argument("--microbatches", type=int, default=None,
                   help="pieces each batch is cut into with --pp (default: one per stage; "
                        "train/pp_training.py's default is 4)")
    p.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b",
                   help="the pipeline schedule with --pp: under gpipe every microbatch's "
                        "activations are kept until the backward (default 1f1b, as the scripts)")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    p.add_argument("--json", metavar="PATH", help="write the numbers to PATH")
    args = p.parse_args(argv)
    for flag in ("gpus", "batch_size", "tp", "pp", "microbatches"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.preset:
        cfg = replace(PRESETS[args.preset], vocab_size=args.vocab or 33278, dropout=0.0,
                      max_seq_len=args.seq_len or PRESETS[args.preset].max_seq_len)
    else:
        cfg = shape_for(args.params, args.vocab or 32000, args.seq_len or 4096)
    result = plan(cfg, gpus=args.gpus, gpu_memory_gib=args.gpu_memory,
                  batch_size=args.batch_size, tp=args.tp, pp=args.pp, precision=args.precision,
                  params=args.params, microbatches=args.microbatches, schedule=args.schedule)
    print(render(result))
    if args.json:
        try:  # whole or not at all, and valid JSON (NaN as null)
            atomic_write_json(args.json, result)
        except OSError as e:
            p.error(f"--json {args.json}: cannot write it ({e.strerror}): give a writable path")


if __name__ == "__main__":
    main()
