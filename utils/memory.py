"""Where a rank's memory goes: measured exactly, and what the formula predicts.

A training step holds four kinds of tensors on every rank (docs/memory.md):

    parameters   the weights this rank holds (all of them under DDP, a shard under FSDP/ZeRO-3,
                 a slice under TP, a stage's layers under PP)
    gradients    one per parameter it holds (sharded too under FSDP, ZeRO-2 and ZeRO-3)
    optimizer    AdamW's two moments per parameter (sharded under ZeRO-1 and above)
    activations  what the forward pass saves for the backward pass: grows with the batch

`measure_state` counts the first three by the sizes of the tensors themselves (a DTensor's local
piece), and `ActivationCounter` counts what autograd saves, through
torch.autograd.graph.saved_tensors_hooks: every saved tensor passes through its pack hook, and
its storage is counted once (q, k and v all save the same normalised input) from the moment it is
saved until autograd lets it go (the peak is what a step needs). These are tensor sizes, not an
allocator's view, so the same numbers hold on a CPU and on a GPU; on a GPU the allocator's
`peak` and `reserved` come next to them (caching, fragmentation and temporaries are the rest).

`predict` is the formula (the planner tools/memory_plan.py uses the same one): bytes per
parameter for the precision and optimizer, times the parameters a rank holds for its layout;
activation bytes per token and layer for the model's shape. Every script prints both once,
after its first step (utils/monitor.py), writes them to TensorBoard (memory/*) and to
summary.json under "memory"; tests/test_memory.py holds the measurement to the formula.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import asdict, dataclass, replace

import torch
from torch import nn

MiB = 2**20
CATEGORIES = ("parameters", "gradients", "optimizer", "activations")


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's piece on this rank (FSDP shards, TP slices), else the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(t: torch.Tensor) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def optimizer_state(optimizer) -> dict:
    """The optimizer's per-parameter state on this rank. ZeroRedundancyOptimizer keeps it in
    the local optimizer it wraps (only for the parameters this rank owns)."""
    inner = getattr(optimizer, "optim", None)
    return (inner if isinstance(inner, torch.optim.Optimizer) else optimizer).state


def measure_state(model: nn.Module, optimizer=None) -> dict:
    """Bytes of this rank's parameters, gradients and optimizer state (step counters included),
    and the number of parameters it holds."""
    params = [p for p in model.parameters()]
    state = optimizer_state(optimizer) if optimizer is not None else {}
    return {
        "parameters": sum(_nbytes(p) for p in params),
        "gradients": sum(_nbytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(_nbytes(v) for s in state.values() for v in s.values()
                         if isinstance(v, torch.Tensor)),
        "params_held": sum(_local(p).numel() for p in params),
    }


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter, or a view of one (the transposed weight a matmul saves): not activations."""
    return isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)


def _is_weight_copy(t: torch.Tensor) -> bool:
    """A cast of a parameter (autocast's bf16 copy of a weight), possibly transposed or viewed."""
    node, cast = t.grad_fn, False
    while node is not None and type(node).__name__ in _CAST_OR_VIEW:
        cast = cast or "ToCopy" in type(node).__name__
        node = node.next_functions[0][0] if node.next_functions else None
    return cast and type(node).__name__ == "AccumulateGrad"


_CAST_OR_VIEW = {"ToCopyBackward0", "TBackward0", "ViewBackward0", "TransposeBackward0",
                 "PermuteBackward0", "ExpandBackward0"}


class _Saved:
    """What autograd keeps for a saved tensor while the counter runs: the tensor, and a
    finaliser that uncounts its storage when autograd drops it."""
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


class ActivationCounter:
    """Counts the bytes autograd saves for the backward pass while it is active.

        counter = ActivationCounter(model)
        with counter:                 # the forward (and backward) passes of one step
            loss = ...; loss.backward()
        counter.peak["activations"]   # the most bytes alive at once

    Tensors are counted by storage, once however often they are saved. Parameters (and their
    views) are not activations. Casts of parameters (autocast's bf16 weight copies) are counted
    apart, as "weight_copies". Blocks wrapped for activation checkpointing save nothing inside:
    their input, which they keep for the recomputation, is what they hold, and is counted.
    """

    def __init__(self, model: nn.Module | None = None):
        self.live = {"activations": 0, "weight_copies": 0}
        self.peak = dict(self.live)
        self.peak["gathered"] = 0   # all-gathered (unsharded) parameters alive after a forward
        self.model = model
        self.storages = {}  # storage address -> [bytes, how many saved tensors use it, kind]
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self.handles = []
        if model is not None:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                CheckpointWrapper)
            for module in model.modules():
                if isinstance(module, CheckpointWrapper):
                    self.handles.append(module.register_forward_pre_hook(self._checkpoint_input))

    def __enter__(self):
        self.active = True
        if self.model is not None:
            self.handles.append(self.model.register_forward_hook(self._after_forward))
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.active = False
        self.hooks.__exit__(*exc)
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _after_forward(self, module, args, output):
        """FSDP all-gathers a layer's parameters for its forward and, resharding after forward,
        frees them again; without resharding they stay until backward (ZeRO-2-like): the bytes
        of gathered parameters still alive when the forward pass ends."""
        if module.training and torch.is_grad_enabled():
            self.peak["gathered"] = max(self.peak["gathered"], gathered_bytes(module))

    def _count(self, tensor: torch.Tensor, kind: str, owner) -> None:
        storage = _local(tensor).untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0:
            return
        entry = self.storages.get(key)
        if entry is None:
            entry = self.storages[key] = [storage.nbytes(), 0, kind]
            self.live[kind] += storage.nbytes()
            self.peak[kind] = max(self.peak[kind], self.live[kind])
        entry[1] += 1
        weakref.finalize(owner, self._release, key)

    def _release(self, key) -> None:
        entry = self.storages.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self.storages[key]
            self.live[entry[2]] -= entry[0]

    def _pack(self, tensor):
        if _is_parameter(tensor):
            return tensor
        holder = _Saved(tensor)
        self._count(tensor, "weight_copies" if _is_weight_copy(tensor) else "activations", holder)
        return holder

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _checkpoint_input(self, module, args):
        if not getattr(self, "active", False) or not torch.is_grad_enabled():
            return
        for a in args:
            if isinstance(a, torch.Tensor):
                self._count(a, "activations", a)


def gathered_bytes(model: nn.Module) -> int:
    """Bytes of FSDP2's all-gathered (unsharded) parameter buffers allocated now: FSDP frees
    them by shrinking their storage to nothing, so the storages' sizes say which are alive."""
    total = 0
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = getattr(state(), "_fsdp_param_group", None) if state else None
        for param in getattr(group, "fsdp_params", None) or ():
            total += sum(t.untyped_storage().nbytes() for t in param.all_gather_outputs)
    return total


# ---------------------------------------------------------------- the formula
@dataclass
class Layout:
    """How a rank's share of the model is cut (what the formula needs to know).

    dp: data-parallel ranks; zero: 0 (DDP: everything replicated), 1 (optimizer state sharded
    over dp), 2 (and gradients), 3 (and parameters: FSDP with resharding; FSDP without
    resharding keeps the same bytes after a step, so it is 3 too); tp: tensor-parallel degree;
    layers: the Transformer blocks this rank holds (a pipeline stage's share); first/last: it
    holds the embeddings / the final norm and output layer; microbatches: how many microbatches'
    activations are alive at once (a pipeline schedule's depth, pipeline_depth(): not always a
    whole number where one rank holds stages of different sizes), each of `tokens` tokens;
    checkpointing: blocks keep only their input; offload: parameters, gradients and optimizer
    state live in host memory (CPUOffloadPolicy); reshard: under FSDP (zero 3), the blocks free
    their gathered parameters after forward (True, ZeRO-3) or keep them until backward (False:
    between the two passes a rank holds the whole model again, ZeRO-2-like)."""
    dp: int = 1
    zero: int = 0
    tp: int = 1
    layers: int | None = None
    first: bool = True
    last: bool = True
    microbatches: float = 1
    checkpointing: bool = False
    offload: bool = False
    reshard: bool = True


def param_counts(cfg, layout: Layout | None = None) -> dict:
    """Parameters a rank holds before data-parallel sharding: {"sharded": count split by TP,
    "replicated": count every TP rank holds whole, "outside_blocks": of these, the embeddings,
    final norm and output layer (FSDP's root: gathered from forward to backward)}."""
    layout = layout or Layout()
    d, f, v, tp = cfg.d_model, cfg.d_ff, cfg.vocab_size, layout.tp
    layers = cfg.n_layers if layout.layers is None else layout.layers
    # per block: q, k, v (column-wise: weight and bias split), out (row-wise: weight split,
    # bias whole), MLP in (column-wise), MLP out (row-wise), two LayerNorms (whole)
    split = layers * (3 * (d * d + d) + d * d + (d * f + f) + f * d)
    whole = layers * (d + d + 2 * 2 * d)
    outside = 0
    if layout.first:
        split += v * d            # token embedding, row-wise over the vocabulary
        whole += cfg.max_seq_len * d
        outside += v * d / tp + cfg.max_seq_len * d
    if layout.last:
        split += v * d            # output layer, column-wise
        whole += 2 * d            # final LayerNorm
        outside += v * d / tp + 2 * d
    return {"sharded": split / tp, "replicated": whole, "outside_blocks": outside}


def activation_bytes_per_token(cfg, layout: Layout | None = None, compute_bytes: int = 4) -> dict:
    """Bytes one token's forward pass saves for backward: {"per_layer", "other"}.

    Per Transformer block (d = d_model, f = d_ff, h = heads, c = bytes of the matmuls' dtype,
    4 for fp32, 2 under bf16 autocast; norms and their inputs stay fp32):
      2 x 4d      the inputs of the two LayerNorms (the residual stream)
      2 x 8       their mean and 1/std per token
      2 x c d     their outputs (the projections' input)
      3 x c d/tp  q, k, v               c d/tp   the attention output
      4 h/tp      attention's log-sum-exp per head
      2 x c f/tp  the MLP's hidden units before and after GELU
    With activation checkpointing a block keeps its input only (4d). Outside the blocks: the
    token ids (8) on the first stage; on the last the final norm (4d + 8 + c d), the
    log-softmax of the logits (4 V/tp) and the targets (8). With dropout on, each dropout keeps
    its mask too (not counted here: the course's checks and tests train with dropout off).
    """
    layout = layout or Layout()
    d, f, h, v, tp, c = cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.vocab_size, layout.tp, compute_bytes
    if layout.checkpointing:
        per_layer = 4 * d
    else:
        per_layer = 2 * 4 * d + 2 * 8 + 2 * c * d + 4 * c * d / tp + 4 * h / tp + 2 * c * f / tp
    other = 0
    if layout.first:
        other += 8
    if layout.last:
        other += 4 * d + 8 + c * d + 4 * v / tp + 8
    return {"per_layer": per_layer, "other": other}


def predict(cfg, tokens: int, layout: Layout | None = None, *, precision: str = "fp32",
            optimizer: str = "adamw") -> dict:
    """Bytes per rank the formula predicts, by category, for `tokens` tokens per microbatch.

    Per parameter held: 4 bytes of fp32 weights (bf16 autocast keeps fp32 master weights: the
    course's mixed precision), 4 of gradients, 8 of AdamW moments (4 for SGD with momentum, 0
    for plain SGD). ZeRO-1 divides the optimizer state by the data-parallel ranks, ZeRO-2 the
    gradients too, ZeRO-3 the parameters too. Published figure for comparison: 16 bytes per
    parameter for mixed-precision AdamW with bf16 weight copies (2 + 4 master + 2 grads + 8),
    see bytes_per_param().
    """
    layout = layout or Layout()
    counts = param_counts(cfg, layout)
    held = counts["sharded"] + counts["replicated"]
    per_param = bytes_per_param(precision, optimizer, course=True)
    shard = {k: (layout.dp if layout.zero >= level else 1)
             for k, level in (("parameters", 3), ("gradients", 2), ("optimizer", 1))}
    compute = 2 if precision == "bf16" else 4
    per_token = activation_bytes_per_token(cfg, layout, compute)
    layers = cfg.n_layers if layout.layers is None else layout.layers
    activations = tokens * layout.microbatches * (per_token["per_layer"] * layers
                                                  + per_token["other"])
    out = {k: per_param[k] * held / shard[k] for k in ("parameters", "gradients", "optimizer")}
    out["activations"] = activations
    # FSDP all-gathers each layer's whole parameters for its compute: after the forward pass
    # the root's (embeddings, output layer) are still gathered, and without resharding the
    # blocks' too
    gathered = 0
    if layout.zero >= 3:  # (also for one rank: FSDP gathers into buffers of its own)
        gathered = (held if not layout.reshard else counts["outside_blocks"]) * per_param["parameters"]
    out["gathered"] = gathered
    out["params_held"] = held / shard["parameters"]
    return out


def bytes_per_param(precision: str = "fp32", optimizer: str = "adamw", course: bool = True) -> dict:
    """Bytes per parameter by category. course=True: what the course's scripts do (fp32 weights
    and gradients, bf16 only inside autocast). course=False with precision bf16: the classic
    mixed-precision layout (bf16 weights and gradients, fp32 master weights in the optimizer):
    2 + 2 + (4 + 8) = 16 bytes per parameter with AdamW."""
    moments = {"adamw": 8, "adam": 8, "sgd-momentum": 4, "sgd": 0}[optimizer]
    if precision == "bf16" and not course:
        return {"parameters": 2, "gradients": 2, "optimizer": 4 + moments}
    return {"parameters": 4, "gradients": 4, "optimizer": moments}


# ---------------------------------------------------------------- what a script reports
def infer_layout(model: nn.Module, args, world_size: int, precision: str = "fp32") -> Layout:
    """The layout of a running script's model, for the formula next to the measurement."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    inner = getattr(model, "module", model)  # DDP's wrapped model
    tp = getattr(args, "tp", 1) or 1
    pp = getattr(args, "pp", None) or (world_size if hasattr(args, "microbatches")
                                       and not hasattr(args, "dp") else 1)
    dp = max(world_size // (tp * pp), 1)
    sharded = any(hasattr(p, "device_mesh") and any(pl.is_shard() for pl in p.placements)
                  and p.device_mesh.ndim >= 1 for p in model.parameters())
    fsdp = sharded and any(type(m).__name__.startswith("FSDP") for m in model.modules())
    named = getattr(args, "layout", None)  # the memory step's --layout
    zero = 3 if fsdp else 1 if named == "zero1" else 0
    layers = len(inner.layers) if hasattr(inner, "layers") else None
    layout = Layout(dp=dp, zero=zero, tp=tp, layers=layers,
                    first=getattr(inner, "tok_emb", None) is not None,
                    last=getattr(inner, "output", None) is not None,
                    checkpointing=any(isinstance(m, CheckpointWrapper) for m in model.modules()),
                    offload=is_offloaded(model),
                    reshard=named != "zero2" and str(getattr(args, "reshard_after_forward",
                                                             "true")).lower() != "false")
    if hasattr(args, "microbatches") and pp > 1 and getattr(inner, "cfg", None) is not None:
        layout = replace(layout, microbatches=pipeline_depth(
            inner.cfg, layout, getattr(args, "schedule", "1f1b"), pp, args.microbatches,
            sorted(int(k) for k in inner.layers), getattr(args, "stages_per_rank", None) or 1,
            getattr(args, "layers_per_stage", None), precision))
    return layout


def pipeline_depth(cfg, layout: Layout, schedule: str, pp: int, microbatches: int,
                   held_layers: list[int], stages_per_rank: int = 1, layers_per_stage=None,
                   precision: str = "fp32") -> float:
    """How many microbatches' activations (of all this rank's layers) a pipeline schedule keeps
    alive at its peak, from torch's own order of the rank's passes (utils/pipeline_timeline.py):
    a microbatch's activations live from its forward (F) to the backward that frees them (B; in
    the split schedules its W, the weight gradients, which need the same inputs).

    GPipe keeps all m, 1F1B min(p - stage, m), the interleaved and zero-bubble orders what they
    run. Stages of one rank differ in size (the first holds the embeddings, the last the output
    layer), so the depth counts whole-rank microbatches and need not be a whole number.

    One more thing torch 2.x does, measured: a split schedule's W frees only what the weight
    gradients read. On the last stage the loss of every microbatch stays referenced until the
    step ends, and with it the rest of its graph: attention's q, k, v, output and log-sum-exp,
    the GELU input, the log-softmax (kept_after_w()). Other stages drop their graph at W."""
    from utils.pipeline_timeline import SCHEDULE_CLASSES, schedule_order
    num_stages = pp * stages_per_rank
    counts = layers_per_stage or [cfg.n_layers // num_stages] * num_stages
    starts = [sum(counts[:i]) for i in range(num_stages)]
    held = [s for s in range(num_stages) if starts[s] in held_layers]
    if not held:
        return 1.0
    compute = 2 if precision == "bf16" else 4

    def per_token(stage: int, part=activation_bytes_per_token) -> float:
        one = replace(layout, first=stage == 0, last=stage == num_stages - 1)
        bytes_ = part(cfg, one, compute)
        return bytes_["per_layer"] * counts[stage] + bytes_["other"]

    order, = schedule_order(SCHEDULE_CLASSES.get(schedule, schedule), pp, microbatches,
                            stages_per_rank, only=held[0] % pp)
    alive = peak = 0.0
    for stage, kind, _ in order:
        if kind == "F":
            alive += per_token(stage)
            peak = max(peak, alive)
        elif kind == "B":
            alive -= per_token(stage)
        elif kind == "W":
            kept = per_token(stage, kept_after_w) if stage == num_stages - 1 else 0.0
            alive -= per_token(stage) - kept
    return peak / sum(per_token(stage) for stage in held)


def kept_after_w(cfg, layout: Layout, compute_bytes: int = 4) -> dict:
    """Bytes per token of what a split backward's W does not free (saved by operations without
    weights, which only the input gradients (I) read), in activation_bytes_per_token's terms:
    per block q, k, v and attention's output and log-sum-exp, the GELU input; on the last stage
    the log-softmax of the logits."""
    d, f, h, v, tp, c = (cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.vocab_size, layout.tp,
                         compute_bytes)
    return {"per_layer": 4 * c * d / tp + 4 * h / tp + c * f / tp,
            "other": 4 * v / tp if layout.last else 0}


def is_offloaded(model: nn.Module) -> bool:
    """FSDP2 with CPUOffloadPolicy: parameters, gradients and optimizer state in host memory."""
    from torch.distributed.fsdp import CPUOffloadPolicy
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = getattr(state(), "_fsdp_param_group", None) if state else None
        if group is not None and isinstance(group.offload_policy, CPUOffloadPolicy):
            return True
    return False


def breakdown(model, optimizer, counter: ActivationCounter, cfg, tokens: int, layout: Layout,
              device: torch.device, precision: str = "fp32") -> dict:
    """This rank's measured bytes by category next to the formula's prediction (bytes)."""
    measured = measure_state(model, optimizer)
    measured["activations"] = counter.peak["activations"]
    measured["weight_copies"] = counter.peak["weight_copies"]
    measured["gathered"] = counter.peak["gathered"]
    # (a model that is not the course's TransformerLM has no shape for the formula)
    formula = predict(cfg, tokens, layout, precision=precision) if cfg is not None else None
    out = {"measured": measured, "formula": formula,
           "layout": asdict(layout), "tokens_per_microbatch": tokens,
           "where": "host" if layout.offload and device.type == "cuda" else device.type,
           "dropout": cfg.dropout if cfg is not None else 0.0}
    if device.type == "cuda":
        out["measured"]["peak"] = torch.cuda.max_memory_allocated(device)
        out["measured"]["reserved"] = torch.cuda.memory_reserved(device)
    return out


def total(numbers: dict) -> float:
    """The breakdown's total: the sum of its categories and FSDP's gathered parameters, as if
    all were alive at once. The same meaning in every script's line, summary.json, the docs and
    tools/memory_plan.py. It is not the step's peak: gradients and activations are alive
    together only while a previous step's gradients are kept through the forward pass
    (zero_grad after the forward), and the allocator's peak adds temporaries (the logits'
    gradient, autocast's weight copies) and its own rounding."""
    return sum(numbers[k] for k in (*CATEGORIES, "gathered"))


def format_breakdown(result: dict) -> str:
    """One line: measured MiB per category, the formula's in brackets, their total, and on a GPU
    the allocator's peak next to it."""
    m, f = result["measured"], result["formula"]
    if f is None:
        f = {k: math.nan for k in (*CATEGORIES, "gathered")}
    shown = [*CATEGORIES, "gathered"] if m.get("gathered") or f.get("gathered") else CATEGORIES
    parts = [f"{k} {m[k] / MiB:.2f} ({f[k] / MiB:.2f})" for k in shown]
    line = (f"memory per rank, MiB measured (formula): {', '.join(parts)}; "
            f"total {total(m) / MiB:.2f} ({total(f) / MiB:.2f})")
    if m.get("weight_copies"):
        line += f"; autocast weight copies {m['weight_copies'] / MiB:.2f}"
    if "peak" in m:
        line += f"; allocator peak {m['peak'] / MiB:.0f}, reserved {m['reserved'] / MiB:.0f}"
    if result.get("dropout"):
        # flash attention keeps a random seed, the CPU's attention its masks and probabilities
        line += (f"; dropout {result['dropout']:g} saves its masks too, which the formula "
                 "leaves out (--dropout 0 to compare)")
    if result["layout"]["offload"]:
        line += " (parameters, gradients, optimizer state offloaded to host memory)"
    return line


def relative_error(measured: float, formula: float) -> float:
    return abs(measured - formula) / formula if formula else (0.0 if not measured else math.inf)
