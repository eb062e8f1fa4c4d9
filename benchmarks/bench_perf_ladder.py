"""The performance step's ladder in one run: tokens/s, MFU against two ceilings and peak memory of
the training step, from plain fp32 to the last fix, each row adding one fix to the row above.
Prints a table; asserts nothing.

    python benchmarks/bench_perf_ladder.py                       # a GPU: the workshop preset
    python benchmarks/bench_perf_ladder.py --preset tiny --steps 6 --rows 1,3,4   # a CPU
    python benchmarks/bench_perf_ladder.py --rows 11,nodrop,model+nodrop --kernels 11
        # the last row against dropout 0 and, with it, the whole model compiled; where the
        # last row's GPU time goes, by kind of kernel (a GPU)
    python benchmarks/bench_perf_ladder.py --rows 11,model+nodrop+b256,model+nodrop+b256+tune
        # the best combination measured, and with compile's kernels tuned (modded-nanogpt)
    python benchmarks/bench_perf_ladder.py --rows 11,fusedhead,bf16params --kernels fusedhead
        # two things for the memory-bound half of the step, not in the lesson: llm.c's fused
        # classifier and torchtitan's bf16 parameters (below); on an H200 +3 % and 0.63x

The two ceilings: the data sheet's dense peak of the dtype the matmuls run in (what MFU
divides by in the scripts), and a large matmul measured on this device in that dtype (what the
device can actually do: about 80 % of the data sheet on Hopper). The step is the course's own
(the model, autocast, AdamW, compile_blocks and the performance step's fixes), without the
course loop around it (data loading, logging, evaluation). Each row is the median of --steps
timed steps after warm-up steps (compiling happens in the warm-up), timed with CUDA events
for the GPU's time and a host clock for the time Python took to queue the step: when the two
are close, the step is bound by launching kernels, not by the GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from torch.nn.parallel import DistributedDataParallel as DDP

# the course's packages where they are not installed (pip install -e .), as on a GPU node
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model import TransformerLM, get_config  # noqa: E402
from utils.metrics import flops_per_token, measure_matmul_flops, peak_flops  # noqa: E402
from utils.precision import autocast, compile_blocks, matmul_dtype, set_precision  # noqa: E402

WIKITEXT2_VOCAB = 33278


@dataclasses.dataclass(frozen=True)
class Setting:
    label: str
    todo: str = ""               # where the lesson makes this change
    precision: str = "fp32"
    fused: bool = False
    compile: str = "none"        # none | blocks | blocks+loss | model+loss
    mode: str | None = None      # torch.compile's mode (reduce-overhead: CUDA graphs)
    batch: int = 32
    pad_vocab: int = 1           # round the vocabulary up to a multiple of this
    ddp: bool = True             # wrapped in DDP although one process (as shipped)
    dropout: float | None = None  # None: the preset's (0.1)
    attention: str = "default"   # default | cudnn | flash | efficient
    vocab: int | None = None     # None: --vocab
    head: str = "logits"         # logits | fused (fused_classifier_loss: no logits kept)
    params: str = "fp32"         # fp32 (autocast) | bf16 (FSDP2's MixedPrecisionPolicy)
    tuning: bool = False         # inductor's coordinate-descent tuning of its own kernels


def ladder(batch: int, big: int) -> list[Setting]:
    """The performance step's fixes in the lesson's order, each row adding one."""
    rows = [Setting("fp32 (as shipped)", "")]
    for label, todo, change in (
            ("tf32", "45", dict(precision="tf32")),
            ("bf16 autocast", "45", dict(precision="bf16")),
            ("+ fused AdamW (the lessons' default)", "46", dict(fused=True)),
            ("+ compile the blocks", "47", dict(compile="blocks")),
            ("+ vocabulary padded to 64", "60", dict(pad_vocab=64)),
            ("+ compile the loss", "61", dict(compile="blocks+loss")),
            ("+ no DDP for one process", "62", dict(ddp=False)),
            ("+ CUDA graphs (reduce-overhead)", "63", dict(mode="reduce-overhead")),
            (f"+ batch {big}", "--batch-size", dict(batch=big)),
            (f"batch {big} without CUDA graphs", "", dict(mode=None))):
        rows.append(dataclasses.replace(rows[-1], label=label, todo=todo, **change))
    return [dataclasses.replace(r, batch=batch) if r.batch == 32 else r for r in rows]


EXTRA = {  # one change against the ladder's last row (what else the lesson mentions)
    "nodrop": dict(dropout=0.0),
    "b256": dict(batch=256),
    "vocab13777": dict(vocab=13777),
    "model": dict(compile="model+loss"),
    "cudnn": dict(attention="cudnn"),
    "b32": dict(batch=32),
    "fp32": dict(precision="fp32"),  # the last setting in fp32: what bf16's losses stay near
    "autotune": dict(mode="max-autotune-no-cudagraphs"),  # Triton's matmuls tried against cuBLAS
    # Candidates for the memory-bound half of the step (docs/performance.md, "Where the rest
    # of the step goes"), measured here before the lesson teaches them:
    "fusedhead": dict(head="fused"),    # llm.c's fused classifier: the loss's gradient at once
    "bf16params": dict(params="bf16"),  # torchtitan's bf16 compute: bf16 activations throughout
    # compile tries more block sizes for the kernels it writes (modded-nanogpt's setting)
    "tune": dict(tuning=True),
    "b512": dict(batch=512),
}


def compiler_settings(s: Setting):
    """torch.compile's settings for one row, undone after it (they are read as it compiles)."""
    if not s.tuning:
        return contextlib.nullcontext()
    import torch._inductor.config as inductor
    return inductor.patch(coordinate_descent_tuning=True)


def attention_context(kind: str):
    if kind == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION}[kind]
    return sdpa_kernel([backend])


def attention_kernels(device) -> str:
    """The kernels scaled_dot_product_attention runs for the workshop's heads (12 x 64, causal,
    bf16): which of flash, cuDNN or memory-efficient attention PyTorch picked."""
    from torch.profiler import ProfilerActivity, profile
    q = torch.randn(32, 12, 256, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        F.scaled_dot_product_attention(q, q, q, is_causal=True, dropout_p=0.1).sum().backward()
        torch.cuda.synchronize(device)
    names = {e.name for e in prof.events() if e.device_type.name == "CUDA"}
    found = sorted(n[:60] for n in names if any(k in n.lower() for k in
                                                ("flash", "fmha", "cudnn", "attention", "sdpa")))
    return "; ".join(found) or "none named"


KERNEL_KINDS = (  # what a GPU kernel's name says it does, first match wins
    ("attention", ("flash", "fmha", "sdpa", "attention", "cudnn")),
    ("matmul", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas", "matmul")),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    ("fused by compile (Triton)", ("triton_",)),
)


def kernel_kind(name: str) -> str:
    name = name.lower()
    return next((kind for kind, words in KERNEL_KINDS if any(w in name for w in words)), "other")


def gpu_time_by_kernel(step, steps: int = 3) -> tuple[list, list]:
    """Where a step's GPU time goes, from the profiler (the view of the performance step's
    TODO 59, grouped by the kernels' names): per kind and for the largest kernels, the
    milliseconds and the launches per step."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(i)
        torch.cuda.synchronize()
    kinds: dict[str, list[float]] = {}
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        for table, key in ((kinds, kernel_kind(e.name)), (kernels, e.name[:70])):
            t = table.setdefault(key, [0.0, 0.0])
            t[0] += e.device_time / 1e3 / steps
            t[1] += 1 / steps

    def largest(table, n):
        return sorted(((k, ms, round(count)) for k, (ms, count) in table.items()),
                      key=lambda r: -r[1])[:n]
    return largest(kinds, len(kinds)), largest(kernels, 12)


def padded_vocab(vocab_size: int, multiple: int) -> int:
    return -(-vocab_size // multiple) * multiple


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def loss_and_logit_grad(logits, targets):
    """The mean cross-entropy of (N, V) logits and its gradient with respect to them,
    (softmax - one-hot) / N, in one pass over the logits once compiled."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    target_logit = x.gather(-1, targets[:, None])
    n = x.shape[0]
    probs = torch.exp(x - lse)
    is_target = torch.arange(x.shape[-1], device=x.device) == targets[:, None]
    grad = torch.where(is_target, probs - 1, probs) / n
    return (lse - target_logit).sum() / n, grad.to(logits.dtype)


class FusedClassifierLoss(torch.autograd.Function):
    """The output layer and the cross-entropy in one, as llm.c's fused classifier: the forward
    pass computes the loss and at once its gradient with respect to the logits, which takes
    the logits' place in memory; backward is the output layer's two matmuls. Against the
    compiled loss this saves one read of the logits (0.5 ms of a 44-ms step on an H200), not
    memory: the logits and their gradient exist together here, as in the compiled loss's
    backward (llm.c writes the gradient over the logits in its own kernel)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets):
        dtype = (torch.get_autocast_dtype(hidden.device.type)
                 if torch.is_autocast_enabled(hidden.device.type) else hidden.dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            h, w = hidden.to(dtype), weight.to(dtype)
            loss, grad = compiled_loss_and_logit_grad(h @ w.t(), targets)
        ctx.save_for_backward(h, w, grad)
        ctx.dtypes = hidden.dtype, weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        h, w, grad = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        # grad_loss is 1 unless the loss was scaled: applied to the matmuls' small results,
        # not to the (N, V) gradient, which would take one more pass over it
        return ((grad @ w).to(hidden_dtype) * grad_loss,
                (grad.t() @ h).to(weight_dtype) * grad_loss, None)


compiled_loss_and_logit_grad = torch.compile(loss_and_logit_grad)


def fused_classifier_loss(hidden, weight, targets):
    """lm_loss(hidden @ weight.T, targets) without keeping the logits (hidden: (B, T, D))."""
    return FusedClassifierLoss.apply(hidden.flatten(0, 1), weight, targets.flatten())


def lm_loss_fp32(logits, targets):
    """lm_loss of bf16 logits, computed in fp32 (as autocast computes it)."""
    return lm_loss(logits.float(), targets)


def shard_in_bf16(model):
    """torchtitan's bf16 training on one GPU: FSDP2 keeps fp32 weights for the optimizer and
    gives the forward and backward bf16 copies, so every activation is bf16 (under autocast
    the residual stream and the layer norms stay fp32); gradients come back in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers.values():
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


def run(s: Setting, preset: str, device, vocab: int, warmup: int, steps: int, ceilings,
        kernels: bool = False) -> dict:
    precision = set_precision(s.precision, device)
    if s.params == "bf16" and (precision != "bf16" or s.ddp or s.head != "logits"
                               or s.compile == "model+loss"):
        raise ValueError("bf16 parameters go with bf16, per-block compile, no DDP and the "
                         "model's own output layer")
    vocab = s.vocab or vocab
    padded = padded_vocab(vocab, s.pad_vocab)
    cfg = get_config(preset, vocab_size=padded, dropout=s.dropout)
    torch.manual_seed(0)
    model = TransformerLM(cfg).to(device)
    # FLOPs of the model as it is (a padded vocabulary's extra rows are counted: they are
    # computed) and, for the MFU, of the unpadded model (llm.c and nanoGPT count the padded one)
    fpt = flops_per_token(model.num_params(exclude_embeddings=True), cfg.n_layers, cfg.d_model,
                          cfg.max_seq_len)
    loss_fn = lm_loss if s.params == "fp32" else lm_loss_fp32
    head = None
    if s.head == "fused":
        if s.compile == "model+loss" or s.ddp:  # DDP would not see the head's weight
            raise ValueError("the fused classifier goes with per-block compile and no DDP, "
                             "as in the last setting")
        # the model stops at the final norm; the output layer's weight goes to the loss
        head, model.output = model.output, None
        params = list(model.parameters()) + [head.weight]

        def loss_fn(hidden, targets):
            return fused_classifier_loss(hidden, head.weight, targets)
    mode = dict(mode=s.mode) if s.mode else {}
    if s.compile in ("blocks", "blocks+loss"):
        compile_blocks(model, s.mode)  # the course's own helper, as the script calls it
    if s.compile == "blocks+loss" and s.head == "logits":
        loss_fn = torch.compile(loss_fn, **mode)
    if s.params == "bf16":
        shard_in_bf16(model)
    forward = DDP(model, device_ids=[device.index or 0] if device.type == "cuda" else None) \
        if s.ddp else model
    if s.compile == "model+loss":
        def forward_and_loss(x, y):
            return lm_loss(forward(x), y)
        step_fn = torch.compile(forward_and_loss, **mode)
    optimizer = torch.optim.AdamW(params if s.head == "fused" else model.parameters(), lr=1e-4,
                                  fused=s.fused and device.type == "cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    batches = [(torch.randint(vocab, (s.batch, cfg.max_seq_len), generator=g),
                torch.randint(vocab, (s.batch, cfg.max_seq_len), generator=g)) for _ in range(4)]
    batches = [(x.to(device), y.to(device)) for x, y in batches]

    def step(i):
        x, y = batches[i % len(batches)]
        # bf16 parameters compute in bf16 without autocast
        amp = autocast(precision, device) if s.params == "fp32" else contextlib.nullcontext()
        with amp, attention_context(s.attention):
            if s.compile == "model+loss":
                loss = step_fn(x, y)
            else:
                loss = loss_fn(forward(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss

    cuda = device.type == "cuda"
    compile_start = time.perf_counter()
    for i in range(warmup):
        step(i)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    warm_s = time.perf_counter() - compile_start
    host, gpu, losses = [], [], []
    for i in range(steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
        t0 = time.perf_counter()
        losses.append(step(i).detach())  # read after the timing: reading waits for the GPU
        host.append(time.perf_counter() - t0)  # queueing only, on a GPU
        if cuda:
            end.record()
            torch.cuda.synchronize(device)
            gpu.append(start.elapsed_time(end) / 1e3)
        else:
            gpu.append(host[-1])
    seconds = statistics.median(gpu)
    if kernels and cuda:
        by_kind, largest = gpu_time_by_kernel(step)
        print(f"GPU time per step of '{s.label}' by kind of kernel: " + "; ".join(
            f"{kind} {ms:.1f} ms ({n} launches)" for kind, ms, n in by_kind), flush=True)
        for name, ms, n in largest:
            print(f"    {ms:6.2f} ms {n:4d} x {name}", flush=True)
    tokens = s.batch * cfg.max_seq_len
    tokens_per_s = tokens / seconds
    kind = matmul_dtype(precision, device)
    sheet, sheet_source = ceilings["sheet"][precision]
    measured = ceilings["measured"][kind]
    peak_mem = torch.cuda.max_memory_allocated(device) if cuda else float("nan")
    model = forward = optimizer = batches = loss_fn = head = None  # free the GPU memory for the next setting
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    torch._dynamo.reset()
    return dict(setting=dataclasses.asdict(s), vocab=padded, tokens_per_s=tokens_per_s,
                step_ms=seconds * 1e3, host_ms=statistics.median(host) * 1e3,
                mfu_sheet=tokens_per_s * fpt / sheet, mfu_measured=tokens_per_s * fpt / measured,
                sheet=sheet, sheet_source=sheet_source, measured=measured,
                peak_memory_gib=peak_mem / 2**30, warmup_s=warm_s, flops_per_token=fpt,
                losses=[float(loss) for loss in losses])


# The goals of the issue that asked for this ladder, for one H100 or H200 (docs/performance.md):
# the best trainings of this size reach about 40 % MFU; 0.9M tokens/s is 40 % at the
# vocabulary of 13,777 words the goal was set with, 46.6 % at WikiText-2's 33,278.
GOAL_LAST_MFU = 0.40           # the step's last setting, against the data sheet
GOAL_LAST_TOKENS = 900_000     # the step's last setting, tokens/s
GOAL_DEFAULT_SPEEDUP = (4, 5)  # the lessons' default against fp32: at least, aiming for


def goal_lines(results: list[dict], full: list[Setting]) -> list[str]:
    """Each goal whose rows ran, with the figures and whether they reach it; then the other
    rows that reach the last setting's goal."""
    by_setting = {json.dumps(r["setting"], sort_keys=True): r for r in results}

    def row(s):
        return by_setting.get(json.dumps(dataclasses.asdict(s), sort_keys=True))

    fp32, default, last = row(full[0]), row(full[3]), row(full[-1])
    lines = []
    if fp32 and default:
        speedup = default["tokens_per_s"] / fp32["tokens_per_s"]
        low, aim = GOAL_DEFAULT_SPEEDUP
        verdict = "met, the aim too" if speedup >= aim else "met" if speedup >= low else "NOT met"
        lines.append(f"the lessons' default: {speedup:.2f}x fp32 (at least {low}x, aiming for "
                     f"{aim}x): {verdict}")

    def reaches(r):
        return r["mfu_sheet"] >= GOAL_LAST_MFU and r["tokens_per_s"] >= GOAL_LAST_TOKENS

    if last:
        needed = GOAL_LAST_TOKENS * last["flops_per_token"] / last["sheet"]
        lines.append(
            f"the step's last setting: {last['mfu_sheet']:.1%} MFU (at least "
            f"{GOAL_LAST_MFU:.0%}) and {last['tokens_per_s']:,.0f} tokens/s (at least "
            f"{GOAL_LAST_TOKENS:,}, which is {needed:.1%} MFU at this vocabulary): "
            + ("met" if reaches(last) else "NOT met"))
    others = [r for r in results if r is not last and reaches(r)]
    if others:
        lines.append("the last setting's goal reached by: " + "; ".join(
            f"{r['setting']['label']} ({r['mfu_sheet']:.1%}, {r['tokens_per_s']:,.0f} tokens/s)"
            for r in others))
    return lines


def chosen_rows(full: list[Setting], spec: str) -> list[Setting]:
    """Rows by number (1-based) or by extra name; names joined by "+" combine their changes
    (model+nodrop), each against the ladder's last row."""
    chosen = []
    for r in spec.split(","):
        names = r.split("+")
        if r.isdigit() and 1 <= int(r) <= len(full):
            chosen.append(full[int(r) - 1])
        elif not r.isdigit() and all(name in EXTRA for name in names):
            change = {k: v for name in names for k, v in EXTRA[name].items()}
            chosen.append(dataclasses.replace(full[-1], label=r, **change))
        else:
            raise SystemExit(f"--rows/--kernels: no row {r!r}; give row numbers 1-{len(full)} "
                             f"or names of {', '.join(EXTRA)}, joined by + to combine them")
    return chosen


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="workshop")
    p.add_argument("--vocab", type=int, default=WIKITEXT2_VOCAB)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--big-batch", type=int, default=128)
    p.add_argument("--rows", default="ladder",
                   help="ladder, or comma-separated row numbers (1-based) and extra names, "
                        "joined by + to combine them: " + ", ".join(EXTRA))
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json", help="write every row's numbers to this file")
    p.add_argument("--kernels", default="",
                   help="comma-separated rows (as in --rows) whose GPU time to break down by "
                        "kernel, from the profiler (a GPU only)")
    args = p.parse_args()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # one process, as the performance step's single-GPU runs: DDP needs a group even so
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(),
                            rank=0, world_size=1)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    print(f"{args.preset} preset, vocabulary {args.vocab}, torch {torch.__version__}, "
          f"{device.type} ({name or platform.machine()})", flush=True)
    full = ladder(args.batch_size, args.big_batch)
    rows = full if args.rows == "ladder" else chosen_rows(full, args.rows)
    kernel_rows = {r.label for r in chosen_rows(full, args.kernels)} if args.kernels else set()
    if kernel_rows and device.type != "cuda":
        print("--kernels: the breakdown reads a GPU's kernels from the profiler; none here",
              flush=True)
    # the two ceilings, once each: the data sheet's and a big matmul's on this device
    n = 8192 if device.type == "cuda" else None  # a CPU: its fastest size (measure_matmul_flops)
    ceilings = {"sheet": {pr: peak_flops(device, pr) for pr in ("fp32", "tf32", "bf16")},
                "measured": {}}
    for precision, dtype in (("fp32", torch.float32), ("tf32", torch.float32),
                             ("bf16", torch.bfloat16)):
        set_precision(precision, device)
        ceilings["measured"][matmul_dtype(precision, device)] = measure_matmul_flops(
            device, dtype, n=n)
    print("ceilings: " + ", ".join(f"{k} {v / 1e12:.3g} TFLOP/s measured"
                                   for k, v in ceilings["measured"].items()), flush=True)
    if device.type == "cuda":
        try:
            print(f"attention kernels under bf16: {attention_kernels(device)}", flush=True)
        except Exception as e:  # noqa: BLE001 - only informative
            print(f"attention kernels: not found ({type(e).__name__}: {e})", flush=True)
    print("| setting | TODO | tokens/s | vs fp32 | MFU (data sheet) | MFU (measured matmul) | "
          "step ms (host ms) | peak GiB | warm-up s |\n|---|---|---|---|---|---|---|---|---|",
          flush=True)
    results, base = [], None
    for s in rows:
        try:
            with compiler_settings(s):
                r = run(s, args.preset, device, args.vocab, args.warmup, args.steps, ceilings,
                        kernels=s.label in kernel_rows)
        except Exception as e:  # noqa: BLE001 - one failing setting must not lose the others
            traceback.print_exc(file=sys.stdout)
            print(f"| {s.label} | failed: {type(e).__name__}: {str(e).splitlines()[0][:120]} |",
                  flush=True)
            torch._dynamo.reset()
            continue
        base = base or r["tokens_per_s"]
        results.append(r)
        print(f"| {s.label} | {s.todo} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / base:.2f}x | "
              f"{r['mfu_sheet']:.1%} | {r['mfu_measured']:.1%} | {r['step_ms']:.1f} "
              f"({r['host_ms']:.1f}) | {r['peak_memory_gib']:.1f} | {r['warmup_s']:.0f} |",
              flush=True)
    goals = goal_lines(results, full)
    if goals:
        where = "" if device.type == "cuda" else " (set for a GPU: on a CPU only a rehearsal)"
        print(f"goals for one H100 or H200{where}:\n" + "\n".join(f"  {g}" for g in goals),
              flush=True)
    set_precision("fp32", device)
    dist.destroy_process_group()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=name, torch=torch.__version__, rows=results), f, indent=1)


if __name__ == "__main__":
    main()
