"""Pipeline parallelism (PP): each GPU holds a few consecutive layers, a stage of the model.

As shipped, this script is the finished DDP step: every rank holds the whole model and its own
batch. Do the TODOs in order (34 to 44) to cut the model into one stage per rank: the first
stage embeds the tokens, each stage sends its activations to the next, the last stage computes
the loss, and the gradients flow back the same way. A batch is split into microbatches so the
stages can work at the same time; the script reports how much of each step every stage spent
waiting (the pipeline "bubble") next to the schedule's theoretical share.
Check your work with
    diff -u train/pp_training.py solutions/train/pp_training.py

Run it:
    python train/pp_training.py --preset small --max-steps 300                  # laptop CPU, 1 rank
    torchrun --standalone --nproc_per_node=2 train/pp_training.py --preset tiny --max-steps 50
    sbatch pp_training.sbatch                      # 2 nodes x 4 GPUs: 8 stages of 1 layer each
When the TODOs are done, choose the schedule and the microbatches, e.g.
    torchrun --standalone --nproc_per_node=2 train/pp_training.py --preset tiny --schedule gpipe --microbatches 8
and watch the idle share fall as the microbatches grow.
"""

import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from model import TransformerLM, get_config
from utils.args import base_parser
from utils.data import IGNORE_INDEX, TokenWindows, load_corpus_or_exit
from utils.metrics import (MetricLogger, Throughput, flops_per_token, perplexity,
                           training_summary, write_summary)
from utils.precision import autocast, compile_blocks, set_precision
from torch.utils.data.distributed import DistributedSampler
from utils.data import DistributedEvalSampler
from utils.distributed_utils import (all_reduce_mean, all_reduce_sum, destroy_process_group,
                                     print0, save0, setup)
# TODO 34: Import the pipelining tools (PipelineStage, the ScheduleGPipe and Schedule1F1B
# schedules), Distributed Checkpoint, torch.distributed for the loss broadcast, and the bubble
# helpers from utils/metrics.py. DDP goes: a stage has nothing to average with.
from torch.nn.parallel import DistributedDataParallel as DDP


# TODO 35: Cut the model into stages. A stage keeps its own blocks and deletes the others from
# the ModuleDict (the remaining keys keep their names, so checkpoints match the whole model);
# only the first stage keeps the embeddings, only the last keeps the final norm and the output
# layer (set the others to None: the model's forward skips them).


def main():
    parser = base_parser(__file__, __doc__)
    # TODO 36: Options for the pipeline: --schedule (gpipe or 1f1b), --microbatches (pieces of a
    # batch), and --layers-per-stage for an uneven split (e.g. 3,5).
    args = parser.parse_args()
    out_dir = Path(args.out_dir)
    start_time = time.time()

    # setup() joins the process group and picks this rank's device; it seeds every rank alike,
    # so every stage cuts its layers out of the same initial model.
    local_rank, rank, device, world_size = setup(args.seed, args.device)
    # auto: bf16 autocast on a GPU that has it, else fp32 (see utils/precision.py)
    args.precision = set_precision(args.precision, device)

    # ---- data ----
    corpus = load_corpus_or_exit(args.dataset, args.data_dir, args.cache_dir, warn=print0)
    cfg = get_config(args.preset, vocab_size=corpus.vocab_size, max_seq_len=args.seq_len,
                     dropout=args.dropout)
    # TODO 37: One stage per rank, in rank order. Check that the model and the batch split.
    train_ds, val_ds, test_ds = (TokenWindows(tokens, cfg.max_seq_len)
                                 for tokens in (corpus.train, corpus.valid, corpus.test))
    # Give every data-parallel replica its own shard of the data: a DistributedSampler for
    # training, DistributedEvalSampler for validation and test (it counts no sample twice).
    # TODO 38: The stages of a pipeline are one replica: they all read the same batches (the
    # first uses the tokens, the last the targets). One replica, replica 0.
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank,
                                       shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedEvalSampler(val_ds, num_replicas=world_size, rank=rank)
    test_sampler = DistributedEvalSampler(test_ds, num_replicas=world_size, rank=rank)
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
    # TODO 39: Instead of DDP: keep only this rank's stage (split_pipeline_stage), wrap it in a
    # PipelineStage (it sends and receives the activations), and build the training schedule
    # (mean loss) and an evaluation schedule (summed loss). A StageBusyTimer on the stage
    # measures how long it computes.
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                                  fused=device.type == "cuda")  # one kernel for all parameters
    logger = MetricLogger(args.logger, out_dir, vars(args), name=out_dir.name)

    # ---- training ----
    throughput = Throughput(device)
    loss_history, step, best_val, val_loss = [], 0, math.inf, math.nan
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)  # else every epoch repeats the first epoch's order
        for x, y in train_loader:
            if step == args.max_steps:
                break
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            # TODO 40: The schedule runs forward, loss and backward for all microbatches: the
            # first stage passes the tokens, the last the targets and a list for the
            # microbatch losses, a stage in the middle neither. Time the step for the bubble.
            with autocast(args.precision, device):  # bf16 matmuls; the weights stay fp32
                logits = model(x)
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            # TODO 41: Only the last stage knows the loss: the mean of its microbatch losses.
            # Broadcast it from there, so every rank logs (and rank 0 reports) the same value.
            # One pipeline processes one batch per step: count its tokens once.
            throughput.step(x.numel() * world_size)
            # Each rank's loss covers only its own batch: log the mean over all ranks.
            step_loss = all_reduce_mean(loss.detach())
            loss_history.append(step_loss)
            if step % args.log_every == 0:
                print0(f"epoch {epoch} step {step} loss {step_loss.item():.4f}")
                logger.log({"train/loss": step_loss.item()}, step)

        throughput.pause()  # evaluation time is not training time
        # TODO 43: evaluate through the pipeline
        val_loss = evaluate(model, val_loader, device)
        print0(f"epoch {epoch} validation loss {val_loss:.4f} perplexity {perplexity(val_loss):.1f}")
        logger.log({"val/loss": val_loss, "val/ppl": perplexity(val_loss)}, step)
        if val_loss < best_val:
            best_val = val_loss
            # TODO 42: No rank holds the whole model: save with Distributed Checkpoint, every
            # stage writing its own part into one folder. The keys are the whole model's
            # ("layers.5..." stays "layers.5..."), so the folder loads into the unsplit model.
            save0(model, out_dir / "best_model.pt")
        if step == args.max_steps:
            break

    # ---- evaluation, saving, summary ----
    # TODO 43: evaluate through the pipeline. TODO 44: report the bubble.
    test_loss = evaluate(model, test_loader, device)
    summary = training_summary(
        args, cfg, corpus, world_size=world_size, steps=step, loss_history=loss_history,
        val_loss=val_loss, test_loss=test_loss, throughput=throughput,
        flops_per_token=flops_per_tok, device=device, start_time=start_time)
    print0(f"test loss {test_loss:.4f} perplexity {summary['test_ppl']:.1f}; "
           f"{summary['tokens_per_s']:.0f} tokens/s, MFU {summary['mfu']:.1%}")
    # TODO 42: Distributed Checkpoint
    save0(model, out_dir / "final_model.pt")
    write_summary(out_dir, summary)
    logger.close()
    # Delete the model first, so its communication buffers go while the group still exists.
    del model, optimizer
    destroy_process_group()


# TODO 43: Evaluate through the pipeline with the evaluation schedule's forward-only eval():
# the last stage sums the losses of the microbatches. A pipeline's buffers have a fixed shape:
# fill a short last batch with padding samples, whose IGNORE_INDEX targets count nowhere.
# The sums exist on the last stage only: broadcast them.
@torch.no_grad()
def evaluate(model, loader, device):
    """Token-weighted mean loss over a whole split."""
    model.eval()
    # float64 sums: adding many partial sums in another order changes nothing visible
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    tokens = torch.zeros((), device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        # TODO 43: pad, then eval() through the pipeline
        logits = model(x)
        loss_sum += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum",
                                    ignore_index=IGNORE_INDEX)
        tokens += (y != IGNORE_INDEX).sum()  # padding samples have no targets
    # Each rank saw only its share of the split: add up the loss sums and token counts of
    # all ranks before dividing, so the result equals the single-GPU loss exactly.
    # TODO 43: broadcast from the last stage instead
    loss_sum, tokens = all_reduce_sum(loss_sum), all_reduce_sum(tokens)
    model.train()
    return (loss_sum / tokens).item()


if __name__ == "__main__":
    main()
