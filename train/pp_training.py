"""Pipeline parallelism (PP): each GPU holds a few consecutive layers, a stage of the model.

As shipped, this script is the finished DDP step: every rank holds the whole model and its own
batch. Do the TODOs in order (34 to 40) to cut the model into one stage per rank: the first
stage embeds the tokens, each stage sends its activations to the next, the last stage computes
the loss, and the gradients flow back the same way. A batch is split into microbatches so the
stages can work at the same time; the script reports how much of each step every stage spent
waiting (the pipeline "bubble") next to the schedule's theoretical share. The plumbing (options,
checks, loss functions, the bubble report) is written already; the TODOs are the ideas.
Check your work at any moment with
    python check.py pp    # runs your file: per TODO ok, not started, or what to fix
    diff -u train/pp_training.py solutions/train/pp_training.py

Run it:
    python train/pp_training.py --preset tiny --max-steps 50                    # laptop CPU, 1 rank
    torchrun --standalone --nproc_per_node=2 train/pp_training.py --preset tiny --max-steps 50 \\
        --overwrite                                         # 2 stages, in place of the run before
    sbatch pp_training.sbatch                      # 2 nodes x 4 GPUs: 8 stages of 1 layer each
When the TODOs are done, choose the schedule and the microbatches, e.g.
    torchrun --standalone --nproc_per_node=2 train/pp_training.py --preset tiny --schedule gpipe \\
        --microbatches 8 --overwrite
and watch the idle share fall as the microbatches grow; --schedule zero-bubble splits every
backward in two and fills the bubble with the half that nothing waits for. Every run draws the
schedule it ran next to the theory's: OUT_DIR/pipeline_schedule.html (and .png).
"""

import math
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                          ScheduleInterleavedZeroBubble)
from torch.distributed.pipelining.schedules import PipelineScheduleMulti
# TODO 36: The pipeline replaces DDP (its stages are not replicas): this import goes.
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from model import TransformerLM, get_config
from utils.args import base_parser, positive_int, positive_int_list
from utils.checkpointing import atomic_folder
from utils.checks import claim_out_dir, stop_if_not_finite, stop_on_every_rank
from utils.data import (IGNORE_INDEX, DistributedEvalSampler, TokenWindows, check_splits,
                        load_corpus_or_exit, pad_batch)
# TODO 39: save0 goes (Distributed Checkpoint saves), and with TODO 38 all_reduce_mean (the last
# stage broadcasts the loss).
from utils.distributed_utils import (all_reduce_mean, all_reduce_sum, destroy_process_group,
                                     print0, save0, setup)
from utils.metrics import (StageBusyTimer, Throughput, flops_per_token, perplexity, speed_text,
                           training_summary, write_summary)
from utils.monitor import TrainingMonitor, planned_steps
from utils.pipeline_timeline import bubble_formula, draw_run_schedule
from utils.precision import autocast, compile_blocks, set_precision

# GPipe: all forward passes, then all backward passes (keeps every microbatch's activations).
# 1F1B: after a warm-up, one forward then one backward: the same bubble, but at most
# `stages` microbatches' activations alive at once.
# Zero bubble (torch's ScheduleInterleavedZeroBubble, here with one stage per rank): 1F1B with
# every backward split into the gradients of the inputs, which the previous stage waits for,
# and of the weights, which fill the idle time at the end: a third of 1F1B's bubble in theory.
# (Several stages per rank, interleaved 1F1B: the capstone, train/nd_training.py.)
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
             "zero-bubble": ScheduleInterleavedZeroBubble}


def stage_layers(n_layers: int, num_stages: int, layers_per_stage=None) -> list[range]:
    """The block indices of every stage: an equal split, or the given counts (e.g. [3, 5])."""
    counts = layers_per_stage or [n_layers // num_stages] * num_stages
    starts = [sum(counts[:i]) for i in range(num_stages + 1)]
    return [range(starts[i], starts[i + 1]) for i in range(num_stages)]


# TODO 34: Cut the model into stages: write split_pipeline_stage(model, stage_index, num_stages,
# layers_per_stage=None), returning the model cut down to this stage. stage_layers (above)
# says which blocks each stage keeps; delete the others from the ModuleDict model.layers, so the
# remaining keys keep their names and checkpoints match the whole model. Only the first stage
# keeps the embeddings (token and position), only the last the final norm and the output layer:
# set them to None elsewhere, the model's forward skips what is None.


def build_schedule(name: str, stage, microbatches: int, loss_fn):
    """The schedule runs the stage on `microbatches` pieces of each batch. loss_fn averages over
    a microbatch; the schedule divides the gradients by the number of microbatches, so they
    equal the gradients of the whole batch's mean loss."""
    cls = SCHEDULES[name]
    if issubclass(cls, PipelineScheduleMulti):  # schedules for several stages per rank: a list
        stage = [stage]
    return cls(stage, n_microbatches=microbatches, loss_fn=loss_fn)


def check_pipeline(args, cfg, num_stages: int) -> None:
    """Stop with one line saying what to change when the model or the batch cannot be split."""
    problems = []
    if args.microbatches < num_stages:
        problems.append(f"--microbatches {args.microbatches} must be at least the number of "
                        f"stages ({num_stages}), or some stages would never work at the same time")
    if args.batch_size % args.microbatches:
        problems.append(f"--batch-size {args.batch_size} must be divisible by "
                        f"--microbatches {args.microbatches}")
    if args.schedule == "zero-bubble":
        rounds = max(1, args.microbatches // num_stages)  # torch runs them in rounds of `stages`
        if args.microbatches % rounds:
            problems.append(f"--schedule zero-bubble runs the microbatches in rounds of "
                            f"{num_stages}: --microbatches {args.microbatches} must be a multiple "
                            f"of {rounds} (e.g. {num_stages * rounds})")
        if args.compile:
            problems.append("--schedule zero-bubble splits every backward in two, which torch "
                            "cannot do for compiled blocks: leave out --compile")
    counts = args.layers_per_stage
    if counts is None and cfg.n_layers % num_stages:
        problems.append(f"the {cfg.n_layers} layers do not split evenly into {num_stages} stages: "
                        "give --layers-per-stage (e.g. 3,5) or use another number of ranks")
    if counts is not None and (len(counts) != num_stages or sum(counts) != cfg.n_layers
                               or min(counts) < 1):
        problems.append(f"--layers-per-stage must give {num_stages} counts of at least 1 "
                        f"that add up to the {cfg.n_layers} layers")
    if problems:
        stop_on_every_rank("; ".join(problems))  # one line, from rank 0


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def lm_loss_sum(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum",
                           ignore_index=IGNORE_INDEX)


def main():
    parser = base_parser(__file__, __doc__)
    # Options for the pipeline: the schedule, the microbatches, an uneven split of the layers.
    parser.add_argument("--schedule", choices=list(SCHEDULES), default="1f1b")
    parser.add_argument("--microbatches", type=positive_int, default=4,
                        help="pieces each batch is cut into (at least the number of stages)")
    parser.add_argument("--layers-per-stage", type=positive_int_list,
                        help="blocks per stage, comma-separated (default: an equal split)")
    args = parser.parse_args()
    out_dir = Path(args.out_dir)
    start_time = time.time()

    # setup() joins the process group and picks this rank's device; it seeds every rank alike,
    # so every stage cuts its layers out of the same initial model.
    local_rank, rank, device, world_size = setup(args.seed, args.device)
    claim_out_dir(args)  # writable, this run's alone, no earlier results overwritten unasked
    # auto: bf16 autocast on a GPU that has it, else fp32 (see utils/precision.py)
    args.precision = set_precision(args.precision, device)

    # ---- data ----
    corpus = load_corpus_or_exit(args.dataset, args.data_dir, args.cache_dir, warn=print0,
                                 max_vocab=args.max_vocab)
    cfg = get_config(args.preset, vocab_size=corpus.vocab_size, max_seq_len=args.seq_len,
                     dropout=args.dropout, n_layers=args.n_layers)
    # One stage per rank, in rank order. Check that the model and the batch split.
    num_stages, stage_index = world_size, rank
    check_pipeline(args, cfg, num_stages)
    train_ds, val_ds, test_ds = (TokenWindows(tokens, cfg.max_seq_len)
                                 for tokens in (corpus.train, corpus.valid, corpus.test))
    # Give every data-parallel replica its own shard of the data: a DistributedSampler for
    # training, DistributedEvalSampler for validation and test (it counts no sample twice).
    # TODO 35: The stages of a pipeline are one replica: they all read the same batches (the
    # first uses the tokens, the last the targets). So all three samplers see one replica, and
    # this process is that replica (not its own rank's share of the data).
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank,
                                       shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedEvalSampler(val_ds, num_replicas=world_size, rank=rank)
    test_sampler = DistributedEvalSampler(test_ds, num_replicas=world_size, rank=rank)
    check_splits(corpus, cfg.max_seq_len, args.batch_size, train_sampler.num_replicas)
    loader_args = dict(batch_size=args.batch_size, num_workers=args.num_workers,
                       pin_memory=device.type == "cuda")
    train_loader = DataLoader(train_ds, sampler=train_sampler, drop_last=True, **loader_args)
    val_loader = DataLoader(val_ds, sampler=val_sampler, **loader_args)
    test_loader = DataLoader(test_ds, sampler=test_sampler, **loader_args)

    # ---- model and optimizer ----
    model = TransformerLM(cfg).to(device)
    if args.compile:
        compile_blocks(model)
    flops_per_tok = flops_per_token(model.num_params(exclude_embeddings=True), cfg.n_layers,
                                    cfg.d_model, cfg.max_seq_len)
    print0(f"data: {corpus.source}, vocabulary {corpus.vocab_size}, {len(train_ds)} training "
           f"windows of {cfg.max_seq_len} tokens; model: {args.preset}, "
           f"{model.num_params() / 1e6:.1f}M parameters; world size {world_size}")
    # TODO 36: Instead of DDP: keep only this rank's stage (your split_pipeline_stage, with
    # --layers-per-stage), wrap it in a PipelineStage (it sends and receives the activations),
    # and build two schedules with build_schedule: `schedule` for training (--schedule, with
    # lm_loss: the mean) and `eval_schedule` for evaluation (GPipe, with lm_loss_sum: the sum),
    # each on a PipelineStage of its own, `stage` and `eval_stage`, both around the same model.
    # A StageBusyTimer on the training stage, `timer`, measures how long it computes (the
    # bubble report at the end reads it).
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    # What every rank holds now (with a pipeline: only its stage).
    params = sum(p.numel() for p in model.parameters())
    local_params = all_reduce_sum(torch.tensor([params if r == rank else 0
                                                for r in range(world_size)], device=device)).tolist()
    layers = [list(r) for r in stage_layers(cfg.n_layers, num_stages, args.layers_per_stage)]
    print0(f"{num_stages} stages, layers {layers}, parameters per rank {local_params}; "
           f"schedule {args.schedule}, {args.microbatches} microbatches of "
           f"{args.batch_size // args.microbatches}")
    idle_history = []  # per step: the share of the step this stage waited (timer.idle_fraction())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                                  fused=device.type == "cuda")  # one kernel for all parameters
    throughput = Throughput(device)
    # Live metrics to TensorBoard or wandb and the log line (utils/monitor.py, docs/monitoring.md)
    monitor = TrainingMonitor(args, out_dir, model, optimizer, throughput, flops_per_tok,
                              planned_steps(args, train_loader))

    # ---- training ----
    loss_history, step, best_val, val_loss = [], 0, math.inf, math.nan
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)  # else every epoch repeats the first epoch's order
        for x, y in monitor.batches(train_loader):  # (times the wait for each batch)
            if step == args.max_steps:
                break
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            # TODO 37: The schedule runs forward, loss and backward for all microbatches in one
            # call, schedule.step: the first stage passes the tokens (as its positional
            # argument), the last the targets (target=) and an empty list (losses=) that receives
            # the microbatch losses, a stage in the middle neither. It runs the backward passes
            # too: zero the gradients before it (not between it and optimizer.step), and keep it
            # inside the autocast block. Start the timer's step before it and append its idle
            # fraction to idle_history after.
            with autocast(args.precision, device):  # bf16 matmuls; the weights stay fp32
                logits = model(x)
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            # TODO 38: Only the last stage knows the loss: the mean of its microbatch losses (a
            # zero tensor of the same shape elsewhere). Broadcast it from the last stage, so
            # every rank logs (and rank 0 reports) the same value. One pipeline processes one
            # batch per step: count its tokens once, not once per stage.
            throughput.step(x.numel() * world_size)
            # Each rank's loss covers only its own batch: log the mean over all ranks.
            step_loss = all_reduce_mean(loss.detach())
            stop_if_not_finite(step_loss, step)  # before anything is saved over a good file
            loss_history.append(step_loss)
            if step % args.log_every == 0:
                print0(f"epoch {epoch} {monitor.report(step, step_loss, idle_history)}")

        throughput.pause()  # evaluation time is not training time
        # TODO 40: evaluate through the pipeline
        val_loss = evaluate(model, val_loader, device)
        stop_if_not_finite(val_loss, step, "validation loss")
        print0(f"epoch {epoch} validation loss {val_loss:.4f} perplexity {perplexity(val_loss):.1f}")
        monitor.log_epoch(step, val_loss)
        if val_loss < best_val:
            best_val = val_loss
            # TODO 39: No rank holds the whole model: save with Distributed Checkpoint, every
            # stage writing its own part into one folder. atomic_folder (the FSDP step's
            # checkpoints use it too) lets the folder appear only once every stage has written
            # its part, so a kill or a full disk never leaves half a model under that name: it
            # gives the folder to write into (dcp.save's checkpoint_id), out_dir / "best_model"
            # once sealed. The keys are the whole model's ("layers.5..." stays "layers.5..."),
            # so the folder loads into the unsplit model.
            save0(model, out_dir / "best_model.pt")
        if step == args.max_steps:
            break

    # ---- evaluation, saving, summary ----
    # TODO 40: evaluate through the pipeline
    test_loss = evaluate(model, test_loader, device)
    pipeline = {}
    if idle_history:  # the bubble: the measured idle share of every stage next to the theory
        # The median idle share of this stage's steps (the first one also sets the pipeline up),
        # gathered from every stage. (On a GPU each share is read now, not during training.)
        idle = statistics.median(float(f) for f in idle_history[1:] or idle_history)
        idle = all_reduce_sum(torch.tensor([idle if r == rank else 0.0 for r in range(world_size)],
                                           device=device))
        bubble, formula = bubble_formula(args.schedule, num_stages, args.microbatches)
        print0(f"idle share of a step per stage (measured): "
               f"{' '.join(f'{f:.0%}' for f in idle.tolist())}; "
               f"bubble of {args.schedule} with {num_stages} stages and {args.microbatches} "
               f"microbatches, for equal stages and free communication: {bubble:.0%} ({formula})")
        # The schedule as it ran (a typical step, every stage) next to the theory's, drawn into
        # out_dir/pipeline_schedule.html and .png (utils/pipeline_timeline.py)
        drawn = draw_run_schedule(out_dir, timer, args.schedule, args.microbatches)
        pipeline = dict(data_parallel_size=1, pipeline_stages=num_stages, schedule=args.schedule,
                        microbatches=args.microbatches, idle_fraction_per_stage=idle.tolist(),
                        bubble_fraction_theory=bubble, pipeline_schedule=drawn)
    summary = training_summary(
        args, cfg, corpus, world_size=world_size, steps=step, loss_history=loss_history,
        val_loss=val_loss, test_loss=test_loss, throughput=throughput,
        flops_per_token=flops_per_tok, device=device, start_time=start_time,
        params_per_rank=local_params, memory=monitor.memory, **pipeline)
    print0(f"test loss {test_loss:.4f} perplexity {summary['test_ppl']:.1f}; "
           f"{speed_text(summary)}")
    # TODO 39: Distributed Checkpoint, into out_dir / "final_model"
    save0(model, out_dir / "final_model.pt")
    write_summary(out_dir, summary, vocab=corpus.vocab)  # and vocab.txt (tools/generate.py)
    monitor.close(summary)
    # Delete the model first, so its communication buffers go while the group still exists.
    del model, optimizer
    # TODO 36: ... and the stages and schedules, which hold the model too.
    destroy_process_group()


# TODO 40: Evaluate through the pipeline: evaluate(model, loader, device, stage, schedule,
# precision), called with the training stage (it only asks it whether it is the first or the
# last), eval_schedule and args.precision. Its forward-only schedule.eval(...)
# takes the same arguments as schedule.step and runs under the same autocast, so that every
# stage computes and sends the dtypes it trains in (bfloat16 on a GPU, where bf16 is the default).
# The last stage sums the losses of the microbatches. A pipeline's buffers have a fixed shape:
# fill a short last batch up to loader.batch_size with padding samples that count nowhere
# (pad_batch from utils.data). The sums exist on the last stage only: broadcast the loss sum
# from the last rank (the token count is the same on every stage).
@torch.no_grad()
def evaluate(model, loader, device):
    """Token-weighted mean loss over a whole split."""
    model.eval()
    # float64 sums: adding many partial sums in another order changes nothing visible
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    tokens = torch.zeros((), device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        # TODO 40: pad, then eval() through the pipeline
        logits = model(x)
        loss_sum += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum",
                                    ignore_index=IGNORE_INDEX)
        tokens += (y != IGNORE_INDEX).sum()  # padding samples have no targets
    # Each rank saw only its share of the split: add up the loss sums and token counts of
    # all ranks before dividing, so the result equals the single-GPU loss exactly.
    # TODO 40: broadcast from the last stage instead
    loss_sum, tokens = all_reduce_sum(loss_sum), all_reduce_sum(tokens)
    model.train()
    return (loss_sum / tokens).item()


if __name__ == "__main__":
    main()
