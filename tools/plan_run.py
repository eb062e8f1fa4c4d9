"""Before you ask for 64 nodes: the capstone's real layout on a fake process group of the full
size, in one process on a laptop. What every rank holds, what it sends per step, and every reason
the job would fail, one line each.

    python tools/plan_run.py --preset workshop --nodes 2 --gpus-per-node 4 --tp 2 --pp 2 \\
        --global-batch 64 --microbatches 4
    python tools/plan_run.py --params 7e9 --d-model 4096 --layers 32 --seq-len 4096 \\
        --nodes 256 --gpus-per-node 4 --tp 4 --pp 4 --global-batch 512 --microbatches 8 \\
        --json plan.json
    python tools/plan_run.py --params 7e9 --d-model 4096 --layers 32 --nodes 256 \\
        --global-batch 512 --microbatches 8                                     # search

For the ranks that differ (the first rank of every pipeline stage and the last rank), the tool
joins torch.distributed's fake process group of nodes x GPUs ranks (every collective returns at
once and sends nothing) and builds that rank's part of the capstone with the capstone's own
functions (train/nd_training.py: build_mesh, then parallelize = split_pipeline_stage, apply_tp,
apply_fsdp, then its PipelineStage and schedule) on the meta device: shapes, no memory. Then:

- problems: the capstone's own degree_problems, a global batch that does not split over the
  data-parallel replicas, TP groups that leave a node, a rank that does not fit in memory. One
  line each with what to change, and the exit status is 1.
- memory per rank: parameters, gradients and AdamW state measured on the built shards (an
  optimizer step on the meta device creates AdamW's real state), activations and FSDP's gathered
  weights from the memory step's formula (utils/memory.py), for the layout utils/memory.py infers
  from the built model, as every training script does.
- collectives per step and mesh dimension: FSDP's all-gathers and reduce-scatters of every unit
  it built, TP's all-reduces of every module apply_tp split, the pipeline's sends and receives;
  their time with the collectives lesson's alpha-beta model: latency + bytes x bus factor / bus
  bandwidth, the bandwidth from the site profile (sites/<site>.env: the bus bandwidths preflight
  expects) or fitted to benchmarks/collectives.py's measurements with the lesson's fit_alpha_beta.
  tests/test_nd_training.py holds all of it to a real 8-process run of the capstone.

Without --tp and --pp it searches every layout with TP inside a node, ranks them with the same
formulas (and a rough step time: compute at 40 % of the GPU's peak, the pipeline bubble, and the
communication that cannot hide), and builds the best one that fits. docs/nd.md explains the
output ("Before you ask for 64 nodes").
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import os
import re
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.pipelining import PipelineStage  # noqa: E402

from model.transformer import PRESETS, ModelConfig, TransformerLM  # noqa: E402
from utils.files import atomic_write_json  # noqa: E402
from utils.memory import (CATEGORIES, Layout, infer_layout, measure_state,  # noqa: E402
                          param_counts, pipeline_depth, predict)
from utils.metrics import GPU_PEAK_FLOPS, flops_per_token, pipeline_bubble_fraction  # noqa: E402


def load(path: str):
    """A script of the course (a file, not a package) as a module: its functions, not its main()."""
    spec = importlib.util.spec_from_file_location(f"_plan_{Path(path).stem}", ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The lessons' own functions: a change there changes the plan. The solutions, so that an
# exercise in progress (train/collectives.py before TODO 52) cannot break the planner.
nd = load("solutions/train/nd_training.py")  # the capstone: mesh, split, TP, FSDP, schedules
lesson = load("solutions/train/collectives.py")  # fit_alpha_beta (TODO 52)
bench = load("benchmarks/collectives.py")  # bus_factor: nccl-tests' definitions
memory_plan = load("tools/memory_plan.py")  # shape_for (--params), USABLE

GiB, MiB = 2**30, 2**20
WIKITEXT2_VOCAB = 33278  # the presets' vocabulary (tools/memory_plan.py uses the same)
# Latencies the collectives lesson assumes where nothing was measured (docs/collectives.md)
ASSUMED_LATENCY_S = {"inside a node": 10e-6, "across nodes": 20e-6}
# The share of the GPU's peak a well-tuned training step reaches (docs/performance.md: GPT-2 size
# models reach about 40 % on H100s); only for the rough step time that ranks the search
ASSUMED_MFU = 0.4
DIMS = ("pp", "dp", "tp")


# ---------------------------------------------------------------------------- the model
def model_config(args) -> ModelConfig:
    """The preset or a Llama-like shape for --params (tools/memory_plan.py's), with the given
    dimensions replacing the preset's or the shape's; dropout off (it changes no size)."""
    if args.preset:
        preset = PRESETS[args.preset]
        cfg = replace(preset, vocab_size=args.vocab or WIKITEXT2_VOCAB, dropout=0.0,
                      max_seq_len=args.seq_len or preset.max_seq_len)
    else:
        cfg = memory_plan.shape_for(args.params, args.vocab or 32000, args.seq_len or 4096)
    changes = {}
    if args.d_model:
        changes.update(d_model=args.d_model, d_ff=4 * args.d_model)
        if args.params:  # the head size stays 128, and the layers keep about --params parameters
            changes["n_heads"] = max(1, args.d_model // 128)
            changes["n_layers"] = max(1, round((args.params - 2 * cfg.vocab_size * args.d_model)
                                               / (12 * args.d_model**2)))
    if args.layers:
        changes["n_layers"] = args.layers
    if args.heads:
        changes["n_heads"] = args.heads
    return replace(cfg, **changes)  # ValueError when the heads do not divide d_model


def capstone_args(args, cfg: ModelConfig, world: int, tp: int, pp: int) -> argparse.Namespace:
    """The capstone's flags for this layout: what train/nd_training.py will be given."""
    dp = max(world // (tp * pp), 1)
    return argparse.Namespace(pp=pp, dp=dp, tp=tp, batch_size=args.global_batch // dp,
                              microbatches=args.microbatches, schedule=args.schedule,
                              layers_per_stage=args.layers_per_stage, precision=args.precision,
                              seq_len=cfg.max_seq_len, stages_per_rank=1, compile=False)


def capstone_flags(a: argparse.Namespace) -> str:
    flags = (f"--pp {a.pp} --dp {a.dp} --tp {a.tp} --batch-size {a.batch_size} "
             f"--microbatches {a.microbatches} --schedule {a.schedule} --seq-len {a.seq_len}")
    if a.layers_per_stage:
        flags += " --layers-per-stage " + ",".join(map(str, a.layers_per_stage))
    return flags


# ------------------------------------------------------------------------- the problems
def layout_problems(cfg: ModelConfig, world: int, gpus_per_node: int, tp: int, pp: int, args
                    ) -> list[str]:
    """Every reason this layout cannot run that shows without building it, one line each."""
    if world % (tp * pp):
        return [f"the {world} ranks ({world // gpus_per_node} nodes x {gpus_per_node} GPUs) do "
                f"not split into --tp {tp} x --pp {pp}: choose degrees whose product divides "
                f"{world}"]
    dp = world // (tp * pp)
    problems = []
    if args.global_batch % dp:
        problems.append(f"--global-batch {args.global_batch} does not split over the {dp} data-"
                        f"parallel replicas: give a multiple of {dp} (e.g. "
                        f"{-(-args.global_batch // dp) * dp}), or other --tp / --pp")
    a = capstone_args(args, cfg, world, tp, pp)
    # the capstone's own checks, with the per-replica batch it would be given
    problems += nd.degree_problems(a, cfg, world)
    problems += mesh_order_problems(mesh_groups(0, pp, world // (tp * pp), tp), gpus_per_node)
    return problems


def mesh_groups(rank: int, pp: int, dp: int, tp: int) -> dict[str, list[int]]:
    """The ranks of `rank`'s group in every dimension of the (pp, dp, tp) mesh, as
    init_device_mesh lays them out (row-major: tp varies fastest)."""
    grid = torch.arange(pp * dp * tp).view(pp, dp, tp)
    p, d, t = (int(i) for i in (grid == rank).nonzero()[0])
    return {"pp": grid[:, d, t].tolist(), "dp": grid[p, :, t].tolist(),
            "tp": grid[p, d, :].tolist()}


def where(group: list[int], gpus_per_node: int) -> str:
    return "inside a node" if len({r // gpus_per_node for r in group}) == 1 else "across nodes"


def mesh_order_problems(groups: dict[str, list[int]], gpus_per_node: int) -> list[str]:
    tp = groups["tp"]
    if where(tp, gpus_per_node) == "inside a node":
        return []
    nodes = sorted({r // gpus_per_node for r in tp})
    return [f"the TP group of ranks {tp[0]}-{tp[-1]} spans nodes {nodes[0]}-{nodes[-1]}: TP "
            "all-reduces every layer's activations and needs the links inside a node; TP is the "
            f"innermost mesh dimension, so choose a --tp that divides --gpus-per-node "
            f"{gpus_per_node}"]


def memory_problem(row: dict, gpu_memory_gib: float) -> str | None:
    total = row["memory"]["total"]
    if total <= memory_plan.USABLE * gpu_memory_gib * GiB:
        return None
    m = row["memory"]
    state = sum(m[k] for k in ("parameters", "gradients", "optimizer"))
    advice = ("more --microbatches, a smaller --global-batch, or a larger --tp or --pp"
              if m["activations"] > state else "a larger --tp or --pp, or more nodes")
    return (f"rank {row['rank']} (stage {row['stage']}) needs {total / GiB:.1f} GiB, more than "
            f"{memory_plan.USABLE:.0%} of --gpu-memory {gpu_memory_gib:g} GiB (weights, gradients "
            f"and AdamW {state / GiB:.1f}, activations {m['activations'] / GiB:.1f}): {advice}")


# ------------------------------------------------------------------ one rank, really built
def build_rank(cfg: ModelConfig, a: argparse.Namespace, world: int, rank: int,
               gpus_per_node: int) -> dict:
    """Rank `rank`'s part of the capstone, built as train/nd_training.py builds it, on a fake
    process group of `world` ranks and the meta device; what it holds, as plain numbers."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        mesh = nd.build_mesh("cpu", a.pp, a.dp, a.tp)
        with torch.device("meta"):  # shapes only: no memory, no initialisation
            model = TransformerLM(cfg)
        model = nd.parallelize(model, mesh, a.layers_per_stage)
        stage_index = mesh["pp"].get_local_rank()
        stage = PipelineStage(model, stage_index, a.pp, torch.device("cpu"),
                              group=mesh["pp"].get_group())
        nd.build_schedule(a.schedule, [stage], a.microbatches, nd.lm_loss)
        groups = {dim: mesh[dim].mesh.flatten().tolist() for dim in DIMS}
        measured = measure_state(model)  # the parameters; no gradients, no optimizer yet
        measured["gradients"] = measured["parameters"]  # FSDP's: the shape of the shards
        measured["optimizer"] = adamw_state_bytes(model)
        parts = built_parts(model)
        # FSDP keeps the root's weights gathered from forward to backward (the blocks'
        # are freed after their forward): what the scripts measure as "gathered"
        measured["gathered"] = sum(u["bytes"] for u in parts["fsdp"]
                                   if not u["reshard_after_forward"])
        layout = infer_layout(model, a, world, a.precision)  # as every script's breakdown
        tokens = a.batch_size // a.microbatches * cfg.max_seq_len
        formula = predict(cfg, tokens, layout, precision=a.precision)
        row = {"rank": rank, "stage": stage_index,
               "coordinate": dict(zip(DIMS, mesh.get_coordinate(), strict=True)),
               "layers": sorted(int(k) for k in model.layers),
               "first": model.tok_emb is not None, "last": model.output is not None,
               "groups": groups,
               "where": {dim: where(groups[dim], gpus_per_node) for dim in DIMS},
               "params": sum(p.to_local().numel() for p in model.parameters()),
               "shapes": {n: list(p.to_local().shape) for n, p in model.named_parameters()},
               "parts": parts, "layout": asdict(layout), "tokens_per_microbatch": tokens}
        row["memory"] = memory_row(measured, formula)
        return row
    finally:
        dist.destroy_process_group()


def adamw_state_bytes(model: nn.Module) -> int:
    """Bytes of the course's optimizer's state for this rank's shards, as AdamW keeps it from its
    first step on. AdamW itself is asked what it keeps, with one step on a meta tensor (a step
    on every shard would cost a second per rank): per element of a parameter (the two moments)
    and per parameter tensor (its step counter)."""
    probe = torch.zeros(1000, device="meta", requires_grad=True)
    probe.grad = torch.zeros_like(probe)
    optimizer = torch.optim.AdamW([probe])
    optimizer.step()
    state = [t for t in optimizer.state[probe].values() if isinstance(t, torch.Tensor)]
    per_element = sum(t.element_size() for t in state if t.numel() == probe.numel())
    per_tensor = sum(t.numel() * t.element_size() for t in state if t.numel() != probe.numel())
    shards = [p.to_local() for p in model.parameters()]
    return sum(per_element * s.numel() + per_tensor for s in shards)


def memory_row(measured: dict, formula: dict) -> dict:
    """Bytes of one rank: measured where the built model tells (parameters, gradients, AdamW
    state, the gathered root), the formula where only running would (activations)."""
    row = {k: measured[k] for k in ("parameters", "gradients", "optimizer", "gathered")}
    row["activations"] = formula["activations"]
    row["total"] = sum(row[k] for k in (*CATEGORIES, "gathered"))
    row["formula"] = {k: formula[k] for k in (*CATEGORIES, "gathered")}
    return row


def built_parts(model: nn.Module) -> dict:
    """What communicates in a built stage: FSDP's units with the bytes of their all-gather, and
    the modules TP split with the collective each needs per microbatch."""
    fsdp = []
    for name, module in model.named_modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = getattr(state(), "_fsdp_param_group", None) if state else None
        if group is None:
            continue
        ranks = group.mesh_info.shard_mesh_size
        nbytes = sum(p.padded_sharded_param_size.numel() * ranks
                     * (group.mp_policy.param_dtype or p.sharded_param.dtype).itemsize
                     for p in group.fsdp_params)
        # apply_fsdp leaves every unit to free its weights after forward; the root (the stage's
        # model) keeps them, as FSDP2 does for the root (they are needed again at once)
        fsdp.append({"unit": name or "root", "bytes": nbytes,
                     "reshard_after_forward": module is not model})
    tp = []
    for name, module in model.named_modules():
        placement = tp_placement(getattr(module, "weight", None))
        if placement is None:
            continue
        if isinstance(module, nn.Embedding):  # row-wise: each rank looks up its vocabulary rows
            tp.append(("forward", name, "fp32", module.embedding_dim))
        elif isinstance(module, nn.Linear) and placement.dim == 1:  # row-wise: partial sums
            tp.append(("forward", name, "matmul", module.out_features))
        elif isinstance(module, nn.Linear) and placement.dim == 0:  # column-wise: the gradient
            tp.append(("backward", name, "fp32", module.in_features))
    if model.output is not None and tp_placement(model.output.weight) is not None:
        # loss_parallel on logits split over the vocabulary: the maximum, the sum of the
        # exponentials and the target's logit, one number per token each (torch's
        # distributed/tensor/parallel/loss.py); in fp32 under autocast too
        tp += [("forward", "loss_parallel", "fp32", 1)] * 3
    return {"fsdp": fsdp, "tp": tp}


def tp_placement(weight):
    """The placement of a DTensor weight on the mesh dimension named "tp", if it is split there."""
    mesh = getattr(weight, "device_mesh", None)
    if mesh is None or "tp" not in (mesh.mesh_dim_names or ()):
        return None
    placement = weight.placements[mesh.mesh_dim_names.index("tp")]
    return placement if placement.is_shard() else None


def formula_parts(cfg: ModelConfig, tp: int, layers: int, first: bool, last: bool) -> dict:
    """built_parts without building: the same units and modules from the model's shape, for
    ranking many layouts (tests/test_plan_run.py holds it to built_parts)."""
    def held(layout):
        counts = param_counts(cfg, layout)
        return 4 * (counts["sharded"] + counts["replicated"])  # fp32 weights
    root = held(Layout(tp=tp, layers=0, first=first, last=last))
    block = held(Layout(tp=tp, layers=1, first=False, last=False))
    fsdp = ([{"unit": "root", "bytes": root, "reshard_after_forward": False}] if root else [])
    fsdp += [{"unit": f"layers.{i}", "bytes": block, "reshard_after_forward": True}
             for i in range(layers)]
    d = cfg.d_model
    per_block = [("forward", "attn.out_proj", "matmul", d),
                 ("forward", "mlp.out_proj", "matmul", d),
                 *[("backward", f"attn.{p}_proj", "fp32", d) for p in "qkv"],
                 ("backward", "mlp.in_proj", "fp32", d)]
    tp_ops = [("forward", "tok_emb", "fp32", d)] if first else []
    tp_ops += per_block * layers
    if last:
        tp_ops += [("backward", "output", "fp32", d)]
        tp_ops += [("forward", "loss_parallel", "fp32", 1)] * 3
    return {"fsdp": fsdp, "tp": tp_ops}


# ------------------------------------------------------------------- the collectives of a step
def stage_order(schedule: str, stage: int, stages: int, microbatches: int) -> str:
    """The forward (F) and backward (B) passes of one stage in one step, in the order
    torch.distributed.pipelining's GPipe and 1F1B run them."""
    if schedule == "gpipe":
        return "F" * microbatches + "B" * microbatches
    warmup = min(microbatches, stages - stage)  # the last stage 1, the first `stages`
    return "F" * warmup + "BF" * (microbatches - warmup) + "B" * warmup


def fsdp_all_gathers(order: str, reshard_after_forward: bool) -> int:
    """All-gathers of one FSDP unit in a step: one before every pass that finds its weights
    sharded. A forward frees them again afterwards (reshard_after_forward); a backward keeps
    them, because the pipeline schedule turns resharding after backward off until the step's
    final gradient reduction."""
    gathers, sharded = 0, True
    for action in order:
        gathers += sharded
        sharded = action == "F" and reshard_after_forward
    return gathers


def step_collectives(parts: dict, a: argparse.Namespace, cfg: ModelConfig, stage: int,
                     first: bool, last: bool) -> list[dict]:
    """Every collective one rank takes part in during a training step, merged where the kind
    and size agree: mesh dimension, operation, what it carries, calls, bytes of one call (as
    nccl-tests counts them: the gathered output, the reduce-scatter's input)."""
    order = stage_order(a.schedule, stage, a.pp, a.microbatches)
    tokens = a.batch_size // a.microbatches * cfg.max_seq_len  # of one microbatch
    # autocast's matmuls give bf16; the residual stream, the embedding, the gradients that reach
    # the fp32 inputs and loss_parallel stay fp32 (as recorded in a bf16 run of the capstone)
    dtype_bytes = {"matmul": 2 if a.precision == "bf16" else 4, "fp32": 4}
    rows = {}

    def add(dim, op, what, calls, nbytes):
        key = (dim, op, what, nbytes)
        rows[key] = rows.get(key, 0) + calls

    if a.tp > 1:
        for direction, module, kind, per_token in parts["tp"]:
            what = (f"{generic(module)} output" if direction == "forward" else
                    f"{generic(module)} input's gradient")
            if module == "loss_parallel":
                what = "loss_parallel: a number per token"
            add("tp", "all_reduce", what,
                order.count("F" if direction == "forward" else "B"),
                tokens * per_token * dtype_bytes[kind])
    if a.dp > 1:
        for unit in parts["fsdp"]:
            what = "the root's weights" if unit["unit"] == "root" else "the blocks' weights"
            add("dp", "all_gather", what, fsdp_all_gathers(order, unit["reshard_after_forward"]),
                unit["bytes"])
            add("dp", "reduce_scatter", what.replace("weights", "gradients"), 1, unit["bytes"])
        if last:  # report_from_last_stage: the loss averaged over the replicas
            add("dp", "all_reduce", "the loss", 1, 4)
    if a.pp > 1:
        activation = tokens * cfg.d_model * 4  # the residual stream: fp32 under autocast too
        if not last:
            add("pp", "send", "activations (forward)", a.microbatches, activation)
            add("pp", "recv", "their gradients (backward)", a.microbatches, activation)
        if not first:
            add("pp", "recv", "activations (forward)", a.microbatches, activation)
            add("pp", "send", "their gradients (backward)", a.microbatches, activation)
        add("pp", "broadcast", "the loss", 1, 4)  # report_from_last_stage, to every stage
    return [{"dim": dim, "op": op, "what": what, "calls": calls, "bytes": nbytes}
            for (dim, op, what, nbytes), calls in rows.items()]


def generic(module: str) -> str:
    """A module's name without its block's number: the rows of all blocks merge."""
    return re.sub(r"^layers\.\d+\.", "", module)


def timed(collectives: list[dict], sizes: dict[str, int], places: dict[str, str],
          network: dict) -> tuple[list[dict], dict[str, float]]:
    """The alpha-beta time of every row: calls x (latency + bytes x bus factor / bus bandwidth),
    with the bus bandwidth of the links the group uses; the seconds per mesh dimension."""
    per_dim = dict.fromkeys(DIMS, 0.0)
    out = []
    for row in collectives:
        n, link = sizes[row["dim"]], network[places[row["dim"]]]
        op = "sendrecv" if row["op"] in ("send", "recv") else row["op"]
        seconds = row["calls"] * (link["latency_s"]
                                  + row["bytes"] * bench.bus_factor(op, n) / link["busbw_Bps"])
        out.append({**row, "seconds": seconds, "where": places[row["dim"]]})
        per_dim[row["dim"]] += seconds
    return out, per_dim


def rough_step_s(cfg: ModelConfig, a: argparse.Namespace, seconds: dict, peak: float) -> dict:
    """A rough step time to rank layouts by: the compute of a rank at ASSUMED_MFU of the peak,
    stretched by the pipeline bubble; TP's and PP's communication on top (TP's sits between a
    layer's matmuls; the schedule waits for every transfer); FSDP's only where it is longer
    than the compute it overlaps with."""
    per_token = flops_per_token(model_params(cfg, exclude_embeddings=True), cfg.n_layers,
                                cfg.d_model, cfg.max_seq_len)
    flops = per_token * a.batch_size * cfg.max_seq_len / (a.tp * a.pp)
    compute = flops / (peak * ASSUMED_MFU)
    bubble = pipeline_bubble_fraction(a.pp, a.microbatches)
    step = (compute / (1 - bubble) + seconds["tp"] + seconds["pp"]
            + max(0.0, seconds["dp"] - compute))
    return {"compute_s": compute, "bubble": bubble, "step_s": step}


# ------------------------------------------------------------------------------ the network
def read_site(site: str) -> dict[str, str]:
    """The SITE_ values of sites/<site>.env (a bash file of KEY=value lines)."""
    path = ROOT / "sites" / f"{site}.env"
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in (ROOT / "sites").glob("*.env")))
        raise SystemExit(f"error: --site {site}: no sites/{site}.env: one of {names}")
    found = {}
    for line in path.read_text().splitlines():
        match = re.match(r"\s*(SITE_\w+)=([^\s#]*)", line)
        if match:
            found[match[1]] = match[2]
    return found


def network_model(args, site: dict[str, str]) -> dict:
    """Latency and bus bandwidth inside a node and across nodes: fitted to the collectives
    benchmark's all-reduces where given, else the site profile's expected bus bandwidths."""
    out = {}
    for place, flag, key in (("inside a node", "bench_intra", "SITE_EXPECT_INTRA_BUSBW"),
                             ("across nodes", "bench_inter", "SITE_EXPECT_INTER_BUSBW")):
        path = getattr(args, flag)
        if path:
            out[place] = fitted_link(path, flag)
        else:
            if not site.get(key):
                raise SystemExit(f"error: sites/{args.site}.env has no {key}: add it (GB/s) or "
                                 f"give --{flag.replace('_', '-')} FILE")
            out[place] = {"latency_s": ASSUMED_LATENCY_S[place],
                          "busbw_Bps": float(site[key]) * 1e9,
                          "source": f"sites/{args.site}.env {key} (latency assumed)"}
    return out


def fitted_link(path: str, flag: str) -> dict:
    try:
        records = json.loads(Path(path).read_text())
        sizes = [r["bytes"] for r in records["records"] if r["collective"] == "all_reduce"]
        seconds = [r["time_us"] / 1e6 for r in records["records"]
                   if r["collective"] == "all_reduce"]
        world = records["meta"]["world_size"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"error: --{flag.replace('_', '-')} {path}: not a JSON file of "
                         f"benchmarks/collectives.py --json ({e}): give one") from None
    latency, busbw = (lesson.fit_alpha_beta(sizes, seconds, world) if len(sizes) > 1
                      else (math.nan, math.nan))
    if not busbw > 0:
        raise SystemExit(f"error: --{flag.replace('_', '-')} {path}: its all-reduce times do not "
                         "grow with the size: time larger messages (--max-bytes)")
    return {"latency_s": max(latency, 0.0), "busbw_Bps": busbw,
            "source": f"{path} (all-reduce on {world} ranks, fitted)"}


# -------------------------------------------------------------------------------- the plan
def plan_layout(cfg, args, world: int, gpus_per_node: int, tp: int, pp: int, network: dict
                ) -> dict:
    """The whole plan of one layout: its problems, and, where it can be built, every rank that
    differs, built."""
    started, cpu_started = time.perf_counter(), time.process_time()
    a = capstone_args(args, cfg, world, tp, pp)
    result = {"model": cfg.to_dict(), "nodes": world // gpus_per_node,
              "gpus_per_node": gpus_per_node, "world_size": world, "pp": pp, "dp": a.dp,
              "tp": tp, "global_batch": args.global_batch, "batch_per_replica": a.batch_size,
              "microbatches": a.microbatches, "schedule": a.schedule, "precision": a.precision,
              "capstone_flags": capstone_flags(a), "gpu_memory_gib": args.gpu_memory,
              "usable_share": memory_plan.USABLE, "network": network, "ranks": [],
              "params": model_params(cfg)}
    result["problems"] = layout_problems(cfg, world, gpus_per_node, tp, pp, args)
    if result["problems"]:  # nothing to build: the split itself is wrong
        return result
    stage_size = a.dp * tp
    for rank in sorted({*(s * stage_size for s in range(pp)), world - 1}):
        row = build_rank(cfg, a, world, rank, gpus_per_node)
        sizes = {dim: len(row["groups"][dim]) for dim in DIMS}
        collectives = step_collectives(row["parts"], a, cfg, row["stage"], row["first"],
                                       row["last"])
        row["collectives"], row["seconds"] = timed(collectives, sizes, row["where"], network)
        problem = memory_problem(row, args.gpu_memory)
        if problem:
            result["problems"].append(problem)
        result["ranks"].append(row)
    result["estimate"] = rough_step_s(cfg, a, max_seconds(result["ranks"]),
                                      GPU_PEAK_FLOPS[args.gpu][peak_kind(args)])
    result["build_s"] = time.perf_counter() - started
    result["build_cpu_s"] = time.process_time() - cpu_started
    return result


@functools.cache
def model_params(cfg: ModelConfig, exclude_embeddings: bool = False) -> int:
    with torch.device("meta"):
        return TransformerLM(cfg).num_params(exclude_embeddings=exclude_embeddings)


def max_seconds(ranks: list[dict]) -> dict[str, float]:
    return {dim: max(r["seconds"][dim] for r in ranks) for dim in DIMS}


def peak_kind(args) -> str:
    return "bfloat16" if args.precision == "bf16" else "float32"


def search(cfg, args, world: int, gpus_per_node: int, network: dict) -> dict:
    """Every layout with TP inside a node, from the formulas; the best that fits, built."""
    candidates, skipped = [], []
    tps = [t for t in range(1, gpus_per_node + 1) if gpus_per_node % t == 0]
    for tp in tps:
        for pp in (p for p in range(1, min(world // tp, cfg.n_layers) + 1)
                   if (world // tp) % p == 0):
            problems = layout_problems(cfg, world, gpus_per_node, tp, pp, args)
            if problems:
                skipped.append({"tp": tp, "pp": pp, "problems": problems})
                continue
            candidates.append(screen(cfg, args, world, gpus_per_node, tp, pp, network))
    candidates.sort(key=lambda c: (not c["fits"], c["estimate"]["step_s"]))
    result = {"candidates": candidates, "skipped": skipped}
    if candidates and candidates[0]["fits"]:
        best = candidates[0]
        result["plan"] = plan_layout(cfg, args, world, gpus_per_node, best["tp"], best["pp"],
                                     network)
    return result


def screen(cfg, args, world: int, gpus_per_node: int, tp: int, pp: int, network: dict) -> dict:
    """One layout from the formulas only: the memory of its heaviest stage, its step time."""
    a = capstone_args(args, cfg, world, tp, pp)
    layers = [len(r) for r in nd.stage_layers(cfg.n_layers, pp, a.layers_per_stage)]
    tokens = a.batch_size // a.microbatches * cfg.max_seq_len
    worst, seconds = None, dict.fromkeys(DIMS, 0.0)
    for stage in {0, pp - 1}:
        first, last = stage == 0, stage == pp - 1
        layout = Layout(dp=a.dp, zero=3, tp=tp, layers=layers[stage], first=first, last=last)
        if pp > 1:  # as utils/memory.py's infer_layout: torch's order of the schedule
            start = sum(layers[:stage])
            held = list(range(start, start + layers[stage]))
            layout = replace(layout, microbatches=pipeline_depth(
                cfg, layout, a.schedule, pp, a.microbatches, held, layers_per_stage=layers,
                precision=a.precision))
        formula = predict(cfg, tokens, layout, precision=a.precision)
        total = sum(formula[k] for k in (*CATEGORIES, "gathered"))
        worst = total if worst is None else max(worst, total)
        rank = stage * a.dp * tp
        groups = mesh_groups(rank, pp, a.dp, tp)
        parts = formula_parts(cfg, tp, layers[stage], first, last)
        _, per_dim = timed(step_collectives(parts, a, cfg, stage, first, last),
                           {dim: len(groups[dim]) for dim in DIMS},
                           {dim: where(groups[dim], gpus_per_node) for dim in DIMS}, network)
        seconds = {dim: max(seconds[dim], per_dim[dim]) for dim in DIMS}
    estimate = rough_step_s(cfg, a, seconds, GPU_PEAK_FLOPS[args.gpu][peak_kind(args)])
    return {"tp": tp, "pp": pp, "dp": a.dp, "gib_per_rank": worst / GiB,
            "fits": worst <= memory_plan.USABLE * args.gpu_memory * GiB, "seconds": seconds,
            "estimate": estimate}


# ----------------------------------------------------------------------------- the report
def render(result: dict, args) -> str:
    m = result["model"]
    lines = [
        f"model: {count(result['params'])} parameters (d_model {m['d_model']}, {m['n_layers']} "
        f"layers, {m['n_heads']} heads, d_ff {m['d_ff']}, vocabulary {m['vocab_size']}, sequence "
        f"{m['max_seq_len']}); {result['precision']}, AdamW",
        f"layout: {plural(result['nodes'], 'node')} x {plural(result['gpus_per_node'], 'GPU')} = "
        f"{result['world_size']} ranks = pp {result['pp']} x dp {result['dp']} x tp "
        f"{result['tp']}; global batch {result['global_batch']} = {result['batch_per_replica']} "
        f"per replica in {result['microbatches']} microbatches; {result['schedule']}",
        f"the capstone's flags: {result['capstone_flags']}",
    ]
    ranks = result["ranks"]
    if not ranks:
        return "\n".join(lines)
    lines.append(f"built ranks {', '.join(str(r['rank']) for r in ranks)} (the first of every "
                 f"stage, and the last) on a fake process group of {result['world_size']} ranks "
                 f"in {result['build_s']:.1f} s")
    limit = memory_plan.USABLE * result["gpu_memory_gib"] * GiB
    unit, name = (GiB, "GiB") if max(r["memory"]["total"] for r in ranks) >= GiB else (MiB, "MiB")
    lines += ["", f"memory per rank, {name}: weights, gradients and AdamW state measured on the "
              "built shards; activations and gathered weights from the formula (utils/memory.py)",
              f"{'rank':>6}{'stage':>6}{'layers':>8}{'params':>10}{'weights':>9}{'grads':>8}"
              f"{'adamw':>8}{'activ':>8}{'gathered':>9}{'total':>9}  fits in "
              f"{memory_plan.USABLE:.0%} of {result['gpu_memory_gib']:g} GiB?"]
    for r in ranks:
        mem = r["memory"]
        lines.append(f"{r['rank']:>6}{r['stage']:>6}{layer_span(r['layers']):>8}"
                     f"{count(r['params']):>10}" + "".join(
                         f"{mem[k] / unit:>{w}.2f}" for k, w in
                         (("parameters", 9), ("gradients", 8), ("optimizer", 8),
                          ("activations", 8), ("gathered", 9), ("total", 9)))
                     + f"  {'yes' if mem['total'] <= limit else 'NO'}")
    for r in (ranks[0], ranks[-1]) if len(ranks) > 1 else ranks:
        lines += ["", f"collectives of rank {r['rank']} per step (stage {r['stage']}; "
                  + ", ".join(f"{dim} group: {plural(len(r['groups'][dim]), 'rank')} "
                              f"{r['where'][dim]}" for dim in ("tp", "dp", "pp")) + ")",
                  f"{'dim':<4}{'collective':<16}{'what':<36}{'calls':>6}{'MiB each':>10}"
                  f"{'time':>10}"]
        for c in r["collectives"]:
            lines.append(f"{c['dim']:<4}{c['op']:<16}{c['what']:<36}{c['calls']:>6}"
                         f"{c['bytes'] / MiB:>10.3f}{duration(c['seconds']):>10}")
        if not r["collectives"]:
            lines.append("(none: every group of this rank is the rank alone)")
        lines.append("per step: " + ", ".join(f"{dim} {duration(r['seconds'][dim])}"
                                              for dim in ("tp", "dp", "pp")))
    e = result["estimate"]
    lines.append("")
    lines += [f"network {place}: bus bandwidth {link['busbw_Bps'] / 1e9:g} GB/s, latency "
              f"{link['latency_s'] * 1e6:.1f} us, from {link['source']}"
              for place, link in result["network"].items()]
    lines.append(f"rough step time: compute {duration(e['compute_s'])} at {ASSUMED_MFU:.0%} of "
                 f"the {args.gpu}'s {peak_kind(args)} peak, pipeline bubble {e['bubble']:.0%}, "
                 f"plus TP's and PP's transfers and FSDP's beyond the compute: about "
                 f"{duration(e['step_s'])}")
    return "\n".join(lines)


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def count(n: float) -> str:
    for size, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            return f"{n / size:.2f}{suffix}"
    return f"{n:.0f}"


def duration(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} us"


def layer_span(layers: list[int]) -> str:
    return f"{layers[0]}-{layers[-1]}" if layers else "-"


def render_search(result: dict, world: int) -> str:
    lines = [f"search: layouts of {world} ranks with TP inside a node; "
             f"{len(result['skipped'])} cannot run, {len(result['candidates'])} can "
             "(memory and times from the formulas):",
             f"{'tp':>4}{'pp':>5}{'dp':>6}{'GiB/rank':>10}{'fits':>6}{'tp ms':>9}{'dp ms':>9}"
             f"{'pp ms':>9}{'bubble':>8}{'step s':>9}"]
    for c in result["candidates"][:12]:
        s, e = c["seconds"], c["estimate"]
        lines.append(f"{c['tp']:>4}{c['pp']:>5}{c['dp']:>6}{c['gib_per_rank']:>10.1f}"
                     f"{'yes' if c['fits'] else 'NO':>6}{s['tp'] * 1e3:>9.1f}{s['dp'] * 1e3:>9.1f}"
                     f"{s['pp'] * 1e3:>9.1f}{e['bubble']:>8.0%}{e['step_s']:>9.3f}")
    for s in result["skipped"][:6]:
        lines.append(f"  tp {s['tp']} x pp {s['pp']}: {s['problems'][0]}")
    if len(result["skipped"]) > 6:
        lines.append(f"  ... and {len(result['skipped']) - 6} more (--json lists them)")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=float, help="parameter count, e.g. 7e9 (a Llama-like shape)")
    what.add_argument("--preset", choices=list(PRESETS), help="a course model")
    shape = p.add_argument_group("the model's dimensions (replace the preset's or the shape's)")
    shape.add_argument("--layers", type=int)
    shape.add_argument("--d-model", type=int)
    shape.add_argument("--heads", type=int)
    shape.add_argument("--vocab", type=int, help="vocabulary (presets: 33278, else 32000)")
    shape.add_argument("--seq-len", type=int, help="tokens per sequence (default: the preset's, "
                                                   "or 4096)")
    job = p.add_argument_group("the job")
    job.add_argument("--nodes", type=int, default=1)
    job.add_argument("--gpus-per-node", type=int, help="default: the site profile's")
    job.add_argument("--tp", type=int, help="tensor-parallel degree (innermost)")
    job.add_argument("--pp", type=int, help="pipeline stages (outermost); without --tp and --pp: "
                                            "search")
    job.add_argument("--global-batch", type=int, required=True,
                     help="sequences per optimizer step, all replicas together")
    job.add_argument("--microbatches", type=int, default=4, help="per step (the capstone's 4)")
    # one stage per rank: interleaved 1F1B (several per rank) is the capstone's alone here
    job.add_argument("--schedule", choices=[s for s in nd.SCHEDULES if s != "interleaved-1f1b"],
                     default="1f1b")
    job.add_argument("--layers-per-stage", type=str, help="blocks per stage, e.g. 3,5 (with --pp)")
    job.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    where_ = p.add_argument_group("the centre")
    where_.add_argument("--site", default=os.environ.get("SITE") or "jsc",
                        help="sites/<site>.env: GPUs per node and bus bandwidths ($SITE, or jsc)")
    where_.add_argument("--bench-intra", metavar="JSON",
                        help="benchmarks/collectives.py --json of one node (collectives.sbatch's "
                             "one_node.json): fit latency and bandwidth inside a node to it")
    where_.add_argument("--bench-inter", metavar="JSON",
                        help="the same across nodes (two_nodes.json)")
    where_.add_argument("--gpu-memory", type=float, default=80.0, metavar="GIB",
                        help="memory of one GPU in GiB (default 80)")
    where_.add_argument("--gpu", choices=list(GPU_PEAK_FLOPS), default="H100",
                        help="for the rough step time: the GPU's data-sheet peak")
    p.add_argument("--json", metavar="PATH", help="write the whole plan to PATH")
    args = p.parse_args(argv)
    for flag in ("nodes", "gpus_per_node", "tp", "pp", "global_batch", "microbatches", "layers",
                 "d_model", "heads", "vocab", "seq_len"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.layers_per_stage is not None:
        try:
            args.layers_per_stage = [int(x) for x in args.layers_per_stage.split(",")]
        except ValueError:
            p.error(f"--layers-per-stage {args.layers_per_stage}: give counts like 3,5")
        if args.pp is None:
            p.error("--layers-per-stage needs --pp")
    return p, args


def main(argv=None) -> int:
    p, args = parse_args(argv)
    site = read_site(args.site)
    gpus_per_node = args.gpus_per_node or int(site.get("SITE_GPUS_PER_NODE") or 4)
    try:
        cfg = model_config(args)
    except ValueError as e:  # heads that do not divide d_model
        print(f"error: {e}", file=sys.stderr)
        return 1
    world = args.nodes * gpus_per_node
    network = network_model(args, site)
    if args.tp is None and args.pp is None:
        found = search(cfg, args, world, gpus_per_node, network)
        print(render_search(found, world))
        result = found.get("plan")
        if result is None:
            write_json(p, args, found)
            print("error: no layout fits: more nodes, a larger --gpu-memory, or a smaller "
                  "--global-batch / more --microbatches", file=sys.stderr)
            return 1
        best = found["candidates"][0]
        print(f"\nbest: tp {best['tp']} x pp {best['pp']} x dp {best['dp']}, built:\n")
    else:
        found, result = None, plan_layout(cfg, args, world, gpus_per_node, args.tp or 1,
                                          args.pp or 1, network)
    print(render(result, args))
    write_json(p, args, {**found, "plan": result} if found else result)
    for problem in result["problems"]:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if result["problems"] else 0


def write_json(p, args, result: dict) -> None:
    if not args.json:
        return
    try:  # whole or not at all, and valid JSON (NaN as null)
        atomic_write_json(args.json, result)
    except OSError as e:
        p.error(f"--json {args.json}: cannot write it ({e.strerror}): give a writable path")


if __name__ == "__main__":
    sys.exit(main())
