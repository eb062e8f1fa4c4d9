"""Putting it together: pipeline, data (FSDP) and tensor parallelism on one 3-D device mesh.

A finished example, not an exercise: it has no TODOs. It lives in course/ like every script, so
tools/exercises.py copies it unchanged to train/ and solutions/ and the course has one mechanism.

The world is a (pp, dp, tp) mesh, in the order the large-scale trainers use:
- tp, innermost: consecutive ranks, inside a node, share every layer (an all-reduce per
  attention and per MLP, so they need the fastest links);
- dp, in the middle: FSDP replicas, each with its own batch (all-gathers and reduce-scatters
  of the weights, once per step and layer, which overlap with compute);
- pp, outermost: pipeline stages, usually on different nodes (only the activations at a stage
  boundary cross the slow links).
Every rank builds the whole model from the same seed, deletes the blocks of the other stages,
shards what remains with TP and then FSDP, and joins its stage of the pipeline. With dropout 0
the losses equal a single process's run with the global batch (--batch-size x dp).

Schedules (--schedule): gpipe, 1f1b, and two that shrink the bubble (docs/pp.md):
- interleaved-1f1b: every rank holds several stages (--stages-per-rank, default 2), rank r the
  stages r, r + pp, r + 2 pp, ...: each microbatch passes every rank v times, in v times
  shorter slots, so the ramp-up and ramp-down shrink by v, for v times the activation messages;
- zero-bubble: every backward split into the gradients of the inputs (which the previous stage
  waits for) and of the weights (which fill the idle time); one stage per rank, or several.
The model needs a multiple of pp x stages-per-rank blocks (--n-layers: the presets tiny and
small have 2). Every run draws the schedule it ran next to the theory's into
OUT_DIR/pipeline_schedule.html (and .png).

Run it:
    python train/nd_training.py --preset tiny --max-steps 20                   # 1 x 1 x 1
    torchrun --standalone --nproc_per_node=8 train/nd_training.py --preset tiny --max-steps 20 \\
        --pp 2 --dp 2 --tp 2 --microbatches 2 --overwrite                       # 8 CPU processes
    torchrun --standalone --nproc_per_node=2 train/nd_training.py --preset tiny --max-steps 20 \\
        --pp 2 --n-layers 4 --schedule interleaved-1f1b --microbatches 4 --overwrite  # 2 per rank
    sbatch nd_training.sbatch                 # 2 nodes x 4 GPUs: pp 2 (one per node) x dp 2 x tp 2
"""

import copy
import math
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                          ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble)
from torch.distributed.pipelining.schedules import PipelineScheduleMulti
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, loss_parallel,
                                               parallelize_module)
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from model import TransformerLM, get_config
from utils.args import base_parser, positive_int, positive_int_list
from utils.checkpointing import atomic_folder
from utils.checks import claim_out_dir, stop_if_not_finite, stop_on_every_rank
from utils.data import (IGNORE_INDEX, DistributedEvalSampler, TokenWindows, check_splits,
                        load_corpus_or_exit, pad_batch)
from utils.distributed_utils import (all_reduce_mean, all_reduce_sum, destroy_process_group,
                                     print0, setup)
from utils.metrics import (StageBusyTimer, Throughput, flops_per_token, perplexity, speed_text,
                           training_summary, write_summary)
from utils.monitor import TrainingMonitor, planned_steps
from utils.pipeline_timeline import bubble_formula, draw_run_schedule, stage_ids
from utils.precision import autocast, compile_blocks, set_precision

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
             "interleaved-1f1b": ScheduleInterleaved1F1B,
             "zero-bubble": ScheduleInterleavedZeroBubble}


# ---- how the model is split: the functions of the TP and PP steps, for a model that may be a
# pipeline stage (parts set to None are skipped) ----

def stage_layers(n_layers: int, num_stages: int, layers_per_stage=None) -> list[range]:
    """The block indices of every stage: an equal split, or the given counts (e.g. [3, 5])."""
    counts = layers_per_stage or [n_layers // num_stages] * num_stages
    starts = [sum(counts[:i]) for i in range(num_stages + 1)]
    return [range(starts[i], starts[i + 1]) for i in range(num_stages)]


def split_pipeline_stage(model: TransformerLM, stage_index: int, num_stages: int,
                         layers_per_stage=None) -> TransformerLM:
    """Keep only what stage `stage_index` computes (the pipeline step's function)."""
    owned = stage_layers(len(model.layers), num_stages, layers_per_stage)[stage_index]
    for name in list(model.layers):
        if int(name) not in owned:
            del model.layers[name]
    if stage_index != 0:
        model.tok_emb = model.pos_emb = None
    if stage_index != num_stages - 1:
        model.norm = model.output = None
    return model


def module_view(model: TransformerLM) -> TransformerLM:
    """A second TransformerLM object over the same blocks and embeddings (so the same
    parameters), with its own lists of children and hooks: a stage can cut it down, and torch
    wrap it, without touching `model`."""
    view = copy.copy(model)
    view.__dict__.update({k: v.copy() for k, v in vars(model).items()
                          if isinstance(v, (dict, set))})
    view.layers = nn.ModuleDict(dict(model.layers))
    return view


def split_rank_stages(model: TransformerLM, stage_indices: list[int], num_stages: int,
                      layers_per_stage=None) -> tuple[TransformerLM, list[TransformerLM]]:
    """This rank's part of the model and one module per stage it holds.

    One stage: the model cut down to it (the pipeline step's split). Several (interleaved
    schedules): every stage is a view of the model cut down to that stage, and the model keeps
    what its stages use. The model, not the views, is what the optimizer steps and the
    checkpoint saves: one set of parameters, under the whole model's names."""
    if len(stage_indices) == 1:
        model = split_pipeline_stage(model, stage_indices[0], num_stages, layers_per_stage)
        return model, [model]
    parts = [split_pipeline_stage(module_view(model), i, num_stages, layers_per_stage)
             for i in stage_indices]
    used = {name for part in parts for name in part.layers}
    for name in list(model.layers):
        if name not in used:
            del model.layers[name]
    for name in ("tok_emb", "pos_emb", "norm", "output"):
        if all(getattr(part, name) is None for part in parts):
            setattr(model, name, None)
    return model, parts


def build_pipeline(model: TransformerLM, mesh, device, schedule: str, stages_per_rank: int = 1,
                   layers_per_stage=None) -> tuple[TransformerLM, list, list]:
    """(model, parts, stages) of this rank: its stages are pp_rank, pp_rank + pp, ... (one
    unless stages_per_rank > 1); the model keeps their parts, every stage gets its own module
    (`parts`: views of the model, the same parameters), split by TP, then sharded by FSDP, and
    its PipelineStage."""
    pp = mesh["pp"].size()
    num_stages = pp * stages_per_rank
    mine = stage_ids(mesh["pp"].get_local_rank(), pp, stages_per_rank)
    model, parts = split_rank_stages(model, mine, num_stages, layers_per_stage)
    reshard = schedule != "zero-bubble"  # (see apply_fsdp)
    parts = [shard_stage(part, mesh, reshard) for part in parts]
    stages = [PipelineStage(part, i, num_stages, device, group=mesh["pp"].get_group())
              for part, i in zip(parts, mine)]
    return model, parts, stages


def build_schedule(name: str, stages: list, microbatches: int, loss_fn):
    """The schedule over this rank's stages: a list for the schedules that take several stages
    per rank (interleaved, zero bubble), the one stage for GPipe and 1F1B."""
    cls = SCHEDULES[name]
    return cls(stages if issubclass(cls, PipelineScheduleMulti) else stages[0],
               n_microbatches=microbatches, loss_fn=loss_fn)


def apply_tp(model: TransformerLM, tp_mesh) -> TransformerLM:
    """The tensor-parallel step's plan: q/k/v and the MLP's in_proj column-wise, the two
    out_proj row-wise, the embedding split over the vocabulary, the logits left split for
    loss_parallel. Parts a pipeline stage does not hold are left out of the plan."""
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            "attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
            "attn.v_proj": ColwiseParallel(), "attn.out_proj": RowwiseParallel(),
            "mlp.in_proj": ColwiseParallel(), "mlp.out_proj": RowwiseParallel(),
        })
    plan = {}
    if model.tok_emb is not None:
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate())
    if model.output is not None:
        plan["output"] = ColwiseParallel(use_local_output=False)
    parallelize_module(model, tp_mesh, plan)
    return model


def apply_fsdp(model: TransformerLM, dp_mesh, reshard_after_forward: bool = True) -> TransformerLM:
    """FSDP2 over the data-parallel ranks: every block is a unit (its weights are gathered just
    before it runs), the root holds the rest. It shards the TP shards again: 2-D DTensors.
    reshard_after_forward=False keeps a block's gathered weights from its forward to its
    backward, which the zero-bubble schedules need: their weight-gradient pass looks for the
    weights the forward used (with resharding, the blocks would get no gradients at all)."""
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh)
    return model


def lm_loss(logits, targets):
    # logits are split over the vocabulary (a DTensor): the caller runs this under loss_parallel
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def lm_loss_sum(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum",
                           ignore_index=IGNORE_INDEX)


def degree_problems(args, cfg, world_size: int) -> list[str]:
    """Every reason the mesh, model or batch cannot be split, one line each saying what to change
    (tools/plan_run.py asks the same questions before a job is submitted)."""
    problems = []
    if args.pp * args.dp * args.tp != world_size:
        problems.append(f"--pp {args.pp} x --dp {args.dp} x --tp {args.tp} must equal the "
                        f"world size {world_size}")
    if cfg.n_heads % args.tp or cfg.d_ff % args.tp:
        problems.append(f"n_heads {cfg.n_heads} and d_ff {cfg.d_ff} must be divisible by --tp {args.tp}")
    per_rank, stages = args.stages_per_rank, args.pp * args.stages_per_rank
    if per_rank > 1 and not issubclass(SCHEDULES[args.schedule], PipelineScheduleMulti):
        problems.append(f"--schedule {args.schedule} runs one stage per rank: --stages-per-rank "
                        f"{per_rank} needs --schedule interleaved-1f1b or zero-bubble")
    if per_rank > 1 and args.pp == 1:  # (torch's evaluation of two stages on one rank fails)
        problems.append(f"--stages-per-rank {per_rank} interleaves stages over the ranks of a "
                        "pipeline: use --pp 2 or more")
    split = (f"--pp {args.pp} x --stages-per-rank {per_rank} = {stages} stages" if per_rank > 1
             else f"--pp {args.pp} stages")
    if args.layers_per_stage is None and cfg.n_layers % stages:
        problems.append(f"the {cfg.n_layers} layers do not split evenly into {split}: give "
                        f"--n-layers {stages * max(1, cfg.n_layers // stages)} or "
                        "--layers-per-stage (e.g. 3,5)")
    if args.layers_per_stage is not None and (
            len(args.layers_per_stage) != stages or sum(args.layers_per_stage) != cfg.n_layers
            or min(args.layers_per_stage) < 1):
        problems.append(f"--layers-per-stage must give {stages} counts ({split}) of at least 1 "
                        f"that add up to the {cfg.n_layers} layers")
    if args.microbatches < args.pp or args.batch_size % args.microbatches:
        problems.append(f"--microbatches {args.microbatches} must be at least --pp {args.pp} "
                        f"and divide --batch-size {args.batch_size}")
    elif issubclass(SCHEDULES[args.schedule], PipelineScheduleMulti):
        rounds = max(1, args.microbatches // args.pp)  # torch runs them in rounds of pp
        if args.microbatches % rounds:
            problems.append(f"--schedule {args.schedule} runs the microbatches in rounds of "
                            f"--pp {args.pp}: --microbatches {args.microbatches} must be a "
                            f"multiple of {rounds} (e.g. {args.pp * rounds})")
    if args.schedule == "zero-bubble" and args.compile:
        problems.append("--schedule zero-bubble splits every backward in two, which torch "
                        "cannot do for compiled blocks: leave out --compile")
    return problems


def check_degrees(args, cfg, world_size: int) -> None:
    """Stop with one line saying what to change when the mesh, model or batch cannot be split."""
    problems = degree_problems(args, cfg, world_size)
    if problems:
        stop_on_every_rank("; ".join(problems))  # one line, from rank 0


def build_mesh(device_type: str, pp: int, dp: int, tp: int):
    """The (pp, dp, tp) mesh: tp innermost (consecutive ranks, inside a node), pp outermost."""
    return init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))


def shard_stage(part: TransformerLM, mesh, reshard_after_forward: bool = True) -> TransformerLM:
    """A pipeline stage's module split with TP inside the stage, then sharded with FSDP across
    the replicas."""
    return apply_fsdp(apply_tp(part, mesh["tp"]), mesh["dp"], reshard_after_forward)


def parallelize(model: TransformerLM, mesh, layers_per_stage=None) -> TransformerLM:
    """This rank's part of the model with one stage per rank (what tools/plan_run.py builds):
    its pipeline stage, sharded as build_pipeline shards every stage."""
    model = split_pipeline_stage(model, mesh["pp"].get_local_rank(), mesh["pp"].size(),
                                 layers_per_stage)
    return shard_stage(model, mesh)


def main():
    parser = base_parser(__file__, __doc__)
    par = parser.add_argument_group("parallelism (pp x dp x tp = world size)")
    par.add_argument("--pp", type=positive_int, default=1, help="pipeline stages (outermost)")
    par.add_argument("--dp", type=positive_int, default=None,
                     help="data-parallel (FSDP) replicas (default: world size / (pp x tp))")
    par.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel degree (innermost)")
    par.add_argument("--schedule", choices=list(SCHEDULES), default="1f1b")
    par.add_argument("--stages-per-rank", type=positive_int, default=None,
                     help="pipeline stages on every rank (default: 2 for interleaved-1f1b, else 1)")
    par.add_argument("--microbatches", type=positive_int, default=4)
    par.add_argument("--layers-per-stage", type=positive_int_list,
                     help="blocks per stage, comma-separated (default: an equal split)")
    args = parser.parse_args()
    out_dir = Path(args.out_dir)
    start_time = time.time()

    local_rank, rank, device, world_size = setup(args.seed, args.device)
    claim_out_dir(args)  # writable, this run's alone, no earlier results overwritten unasked
    args.precision = set_precision(args.precision, device)  # auto: bf16 on GPUs, fp32 on CPUs
    if args.dp is None:
        args.dp = max(1, world_size // (args.pp * args.tp))
    if args.stages_per_rank is None:
        args.stages_per_rank = 2 if args.schedule == "interleaved-1f1b" else 1

    # ---- data ----
    corpus = load_corpus_or_exit(args.dataset, args.data_dir, args.cache_dir, warn=print0,
                                 max_vocab=args.max_vocab)
    cfg = get_config(args.preset, vocab_size=corpus.vocab_size, max_seq_len=args.seq_len,
                     dropout=args.dropout, n_layers=args.n_layers)
    check_degrees(args, cfg, world_size)
    check_splits(corpus, cfg.max_seq_len, args.batch_size, args.dp)
    mesh = build_mesh(device.type, args.pp, args.dp, args.tp)
    dp_rank = mesh["dp"].get_local_rank()
    pp_group, dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
    last_stage = args.pp - 1

    train_ds, val_ds, test_ds = (TokenWindows(tokens, cfg.max_seq_len)
                                 for tokens in (corpus.train, corpus.valid, corpus.test))
    # One shard of the data per dp replica; the stages and TP ranks of a replica share it.
    train_sampler = DistributedSampler(train_ds, num_replicas=args.dp, rank=dp_rank,
                                       shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedEvalSampler(val_ds, num_replicas=args.dp, rank=dp_rank)
    test_sampler = DistributedEvalSampler(test_ds, num_replicas=args.dp, rank=dp_rank)
    loader_args = dict(batch_size=args.batch_size, num_workers=args.num_workers,
                       pin_memory=device.type == "cuda")
    train_loader = DataLoader(train_ds, sampler=train_sampler, drop_last=True, **loader_args)
    val_loader = DataLoader(val_ds, sampler=val_sampler, **loader_args)
    test_loader = DataLoader(test_ds, sampler=test_sampler, **loader_args)

    # ---- model: split into stages, then TP inside a stage, then FSDP across replicas ----
    model = TransformerLM(cfg).to(device)
    if args.compile:
        compile_blocks(model)
    flops_per_tok = flops_per_token(model.num_params(exclude_embeddings=True), cfg.n_layers,
                                    cfg.d_model, cfg.max_seq_len)
    print0(f"data: {corpus.source}, vocabulary {corpus.vocab_size}, {len(train_ds)} training "
           f"windows of {cfg.max_seq_len} tokens; model: {args.preset}, "
           f"{model.num_params() / 1e6:.1f}M parameters; world size {world_size}")
    model, parts, stages = build_pipeline(model, mesh, device, args.schedule,
                                          args.stages_per_rank, args.layers_per_stage)
    has_first, has_last = stages[0].is_first, stages[-1].is_last  # the tokens; the targets
    schedule = build_schedule(args.schedule, stages, args.microbatches, lm_loss)
    # Evaluation gets PipelineStages of its own around the same parts (the same weights): a
    # schedule prepares its stages at its first call, for training or for forward only, and
    # remembers that it did, not what they were last prepared for. On shared stages the first
    # evaluation prepared them again without gradients, and from then on every stage but the
    # last trained on zero gradients.
    eval_stages = [PipelineStage(s.submod, s.stage_index, s.num_stages, device, group=pp_group)
                   for s in stages]
    # forward only, summing the losses: GPipe, or with several stages per rank the interleaved
    # order (a schedule built on the same stage indices must place them on the same ranks)
    eval_schedule = build_schedule("gpipe" if len(stages) == 1 else "interleaved-1f1b",
                                   eval_stages, args.microbatches, lm_loss_sum)
    timer = StageBusyTimer(stages, device)
    held = sum(p.to_local().numel() for p in model.parameters())
    params_per_rank = all_reduce_sum(torch.tensor(
        [held if r == rank else 0 for r in range(world_size)], device=device)).tolist()
    per_rank = f", {args.stages_per_rank} stages per rank" if args.stages_per_rank > 1 else ""
    print0(f"mesh pp {args.pp} x dp {args.dp} x tp {args.tp}; schedule {args.schedule}"
           f"{per_rank}, {args.microbatches} microbatches; parameters per rank {params_per_rank}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                                  fused=device.type == "cuda")  # one kernel for all parameters
    throughput = Throughput(device)
    # Live metrics to TensorBoard or wandb and the log line (utils/monitor.py, docs/monitoring.md)
    monitor = TrainingMonitor(args, out_dir, model, optimizer, throughput, flops_per_tok,
                              planned_steps(args, train_loader))

    # ---- training ----
    loss_history, idle_history, step, val_loss = [], [], 0, math.nan
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for x, y in monitor.batches(train_loader):  # (times the wait for each batch)
            if step == args.max_steps:
                break
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            timer.start_step()
            losses = []
            # loss_parallel around the whole step: the last stage's loss and its backward run
            # inside the schedule
            with loss_parallel(), autocast(args.precision, device):  # bf16: fp32 master weights
                schedule.step(*((x,) if has_first else ()),
                              target=y if has_last else None, losses=losses)
            idle_history.append(timer.idle_fraction())
            optimizer.step()
            step += 1
            throughput.step(x.numel() * args.dp)
            step_loss = report_from_last_stage(
                torch.stack([l.full_tensor() for l in losses]).mean() if has_last else None,
                device, dp_group, pp_group, last_stage)
            stop_if_not_finite(step_loss, step)  # before anything is saved over a good file
            loss_history.append(step_loss)
            if step % args.log_every == 0:
                print0(f"epoch {epoch} {monitor.report(step, step_loss, idle_history)}")
        throughput.pause()  # evaluation time is not training time
        val_loss = evaluate(model, parts, val_loader, device, eval_schedule, has_first,
                            has_last, dp_group, pp_group, last_stage, args.precision)
        stop_if_not_finite(val_loss, step, "validation loss")
        print0(f"epoch {epoch} validation loss {val_loss:.4f} perplexity {perplexity(val_loss):.1f}")
        monitor.log_epoch(step, val_loss)
        if step == args.max_steps:
            break

    # ---- evaluation, saving, summary ----
    test_loss = evaluate(model, parts, test_loader, device, eval_schedule, has_first, has_last,
                         dp_group, pp_group, last_stage, args.precision)
    # (on a GPU each step's idle share is read now, not during training)
    idle = statistics.median(float(f) for f in idle_history[1:] or idle_history)
    idle = all_reduce_sum(torch.tensor([idle if r == rank else 0.0 for r in range(world_size)],
                                       device=device))
    bubble, formula = bubble_formula(args.schedule, args.pp, args.microbatches,
                                     args.stages_per_rank)
    print0(f"idle share of a step per rank (measured): {' '.join(f'{f:.0%}' for f in idle.tolist())}; "
           f"bubble of {args.schedule} for {args.pp} ranks{per_rank} and {args.microbatches} "
           f"microbatches in theory: {bubble:.0%} ({formula})")
    # The schedule as it ran (a typical step of the pipeline of dp and tp rank 0) next to the
    # theory's: out_dir/pipeline_schedule.html and .png (utils/pipeline_timeline.py)
    drawn = draw_run_schedule(out_dir, timer, args.schedule, args.microbatches, group=pp_group)
    summary = training_summary(
        args, cfg, corpus, world_size=world_size, steps=step, loss_history=loss_history,
        val_loss=val_loss, test_loss=test_loss, throughput=throughput,
        flops_per_token=flops_per_tok, device=device, start_time=start_time,
        data_parallel_size=args.dp, tensor_parallel_size=args.tp, pipeline_stages=args.pp,
        schedule=args.schedule, stages_per_rank=args.stages_per_rank,
        microbatches=args.microbatches, params_per_rank=params_per_rank,
        idle_fraction_per_rank=idle.tolist(), bubble_fraction_theory=bubble,
        pipeline_schedule=drawn,
        memory=monitor.memory)  # the breakdown after the first step (utils/memory.py)
    print0(f"test loss {test_loss:.4f} perplexity {summary['test_ppl']:.1f}; "
           f"{speed_text(summary)}")
    # Every rank writes its shards of its stage; the folder loads into the unsplit model, or into
    # any other layout (DCP reshards when loading). It appears only once every rank is done.
    with atomic_folder(out_dir / "final_model") as folder:
        dcp.save(model.state_dict(), checkpoint_id=folder)
    write_summary(out_dir, summary, vocab=corpus.vocab)  # and vocab.txt (tools/generate.py)
    monitor.close(summary)
    del model, optimizer, parts, stages, eval_stages, schedule, eval_schedule
    destroy_process_group()


def report_from_last_stage(value, device, dp_group, pp_group, last_stage):
    """A number only the last stage has, averaged over its dp replicas and sent to every
    stage, so that all ranks hold the same value (the TP ranks of a replica already agree)."""
    t = torch.zeros((), device=device) if value is None else all_reduce_mean(value.detach(), dp_group)
    dist.broadcast(t, group=pp_group, group_src=last_stage)
    return t


@torch.no_grad()
def evaluate(model, parts, loader, device, schedule, has_first, has_last, dp_group, pp_group,
             last_stage, precision):
    """Token-weighted mean loss over a whole split, through the pipeline (forward only), under
    the training's autocast: every stage fixed the dtypes it sends at its first training step."""
    model.eval()
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    tokens = torch.zeros((), device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        x, y = pad_batch(x, y, loader.batch_size)  # a pipeline's buffers have a fixed shape
        losses = []
        with loss_parallel(), autocast(precision, device):
            schedule.eval(*((x,) if has_first else ()),
                          target=y if has_last else None, losses=losses)
        if losses:
            loss_sum += torch.stack([l.full_tensor() for l in losses]).sum()
        tokens += (y != IGNORE_INDEX).sum()
    # sums over the replicas' shares of the split (on the last stage), then to every stage
    loss_sum, tokens = all_reduce_sum(loss_sum, dp_group), all_reduce_sum(tokens, dp_group)
    dist.broadcast(loss_sum, group=pp_group, group_src=last_stage)
    for part in parts:  # FSDP frees the gathered weights after backward; evaluation has none
        part.reshard()
    model.train()
    return (loss_sum / tokens).item()


if __name__ == "__main__":
    main()
