"""Where a rank's memory goes, and four ways to fit a bigger model or batch: the memory step.

After the first step every script prints what one rank holds (utils/memory.py): parameters,
gradients, optimizer state and the activations saved for backward, measured, next to the
formula. This step changes each of them on purpose (docs/memory.md, slides/02b-memory.md):

  --activation-checkpointing    each Transformer block keeps only its input and recomputes the
                                rest in backward: fewer activations, more compute (TODO 55)
  --layout zero2 | zero3        FSDP2, keeping the gathered weights until backward or not
  --layout offload              FSDP2 with parameters, gradients and optimizer state in host
                                memory, CPUOffloadPolicy (TODO 56)
  --layout zero1                AdamW's state sharded over the ranks, ZeroRedundancyOptimizer
                                (TODO 57)
  --grad-accum N                N micro-batches per optimizer step: the batch of N steps with
                                the activations of one (TODO 58)

Check your work:  python check.py memory
Run it (each run in a folder of its own: --out-dir, or --overwrite to replace the last one):
    python train/memory_training.py --preset tiny --max-steps 20 --out-dir runs/memory/one
    torchrun --standalone --nproc_per_node=2 train/memory_training.py --preset tiny \\
        --max-steps 20 --grad-accum 4 --activation-checkpointing --layout zero3 \\
        --out-dir runs/memory/zero3
    sbatch memory_training.sbatch --layout zero1
Compare the "memory per rank" lines of the layouts; tools/memory_plan.py predicts them for any
model and GPU count before you ask for nodes.
"""

import contextlib
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from model import TransformerLM, get_config
from utils.args import base_parser, positive_int
from utils.checkpointing import save_full_model
from utils.checks import claim_out_dir, stop_if_not_finite
from utils.data import (IGNORE_INDEX, DistributedEvalSampler, TokenWindows, check_splits,
                        load_corpus_or_exit, pad_batch)
from utils.distributed_utils import (all_reduce_mean, all_reduce_sum, destroy_process_group,
                                     print0, setup)
from utils.metrics import Throughput, flops_per_token, perplexity, training_summary, write_summary
from utils.monitor import TrainingMonitor, planned_steps
from utils.precision import autocast, set_precision

LAYOUTS = ("ddp", "zero1", "zero2", "zero3", "offload")


# TODO 55: Activation checkpointing per Transformer block: write
# apply_activation_checkpointing(model), returning the model, that replaces every block in
# model.layers by the block wrapped with checkpoint_wrapper. A wrapped block saves nothing for
# backward but its input, and runs its forward again during backward to get the rest back:
# the activations of a block cost one tensor instead of about a dozen, for one more forward.


# TODO 56: Shard with FSDP2 for the layouts zero2, zero3 and offload: fully_shard each block,
# then the root, as in the FSDP step. zero3 frees each block's gathered weights after its
# forward (reshard_after_forward=True) and gathers them again in backward; zero2 keeps them
# until backward (False: more memory, one all-gather less per block); offload is zero3 with
# offload_policy=CPUOffloadPolicy() on every unit, blocks and root (pin_memory only where
# torch.cuda.is_available(): pinning needs a GPU), which keeps the shards (and so the gradients
# and AdamW's state) in host memory and copies each block's to the GPU when it is needed.
def apply_fsdp(model: TransformerLM, layout: str) -> TransformerLM:
    raise NotImplementedError(f"--layout {layout}: TODO 56")


@contextlib.contextmanager
def no_gradient_sync(model):
    """A micro-batch's forward and backward inside add this rank's gradients to .grad and talk
    to no other rank: DDP's no_sync(), FSDP2's set_requires_gradient_sync(False). The forward
    pass must be inside too: DDP decides in forward whether the next backward all-reduces."""
    if isinstance(model, DDP):
        with model.no_sync():
            yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def parse_args():
    parser = base_parser(__file__, __doc__)
    parser.add_argument("--layout", choices=LAYOUTS, default="ddp",
                        help="ddp: everything on every rank; zero1: optimizer state sharded; "
                             "zero2/zero3: FSDP2 keeping/freeing gathered weights after forward; "
                             "offload: zero3 in host memory")
    parser.add_argument("--grad-accum", type=positive_int, default=1, metavar="N",
                        help="micro-batches of --batch-size per optimizer step")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="recompute each block's activations in backward")
    return parser.parse_args()


def main():
    args = parse_args()
    out_dir = Path(args.out_dir)
    start_time = time.time()
    local_rank, rank, device, world_size = setup(args.seed, args.device)
    claim_out_dir(args)
    args.precision = set_precision(args.precision, device)

    # ---- data: each rank reads its share; a step is grad_accum micro-batches of each rank ----
    corpus = load_corpus_or_exit(args.dataset, args.data_dir, args.cache_dir, warn=print0,
                                 max_vocab=args.max_vocab)
    cfg = get_config(args.preset, vocab_size=corpus.vocab_size, max_seq_len=args.seq_len,
                     dropout=args.dropout, n_layers=args.n_layers)
    check_splits(corpus, cfg.max_seq_len, args.batch_size * args.grad_accum, world_size)
    train_ds, val_ds, test_ds = (TokenWindows(tokens, cfg.max_seq_len)
                                 for tokens in (corpus.train, corpus.valid, corpus.test))
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank,
                                       shuffle=True, seed=args.seed, drop_last=True)
    loader_args = dict(batch_size=args.batch_size, num_workers=args.num_workers,
                       pin_memory=device.type == "cuda")
    train_loader = DataLoader(train_ds, sampler=train_sampler, drop_last=True, **loader_args)
    val_loader = DataLoader(val_ds, sampler=DistributedEvalSampler(val_ds, world_size, rank),
                            **loader_args)
    test_loader = DataLoader(test_ds, sampler=DistributedEvalSampler(test_ds, world_size, rank),
                             **loader_args)

    # ---- model and optimizer ----
    model = TransformerLM(cfg).to(device)
    flops_per_tok = flops_per_token(model.num_params(exclude_embeddings=True), cfg.n_layers,
                                    cfg.d_model, cfg.max_seq_len)
    print0(f"data: {corpus.source}, vocabulary {corpus.vocab_size}, {len(train_ds)} training "
           f"windows of {cfg.max_seq_len} tokens; model: {args.preset}, "
           f"{model.num_params() / 1e6:.1f}M parameters; world size {world_size}; layout "
           f"{args.layout}, {args.grad_accum} micro-batch(es) of {args.batch_size} per step"
           f"{', activation checkpointing' if args.activation_checkpointing else ''}")
    if args.activation_checkpointing:
        model = apply_activation_checkpointing(model)
    if args.layout in ("ddp", "zero1"):
        model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    else:
        model = apply_fsdp(model, args.layout)
    adamw = dict(lr=args.lr, weight_decay=args.weight_decay)
    # TODO 57: ZeRO-1 for --layout zero1: every rank keeps AdamW's state (8 bytes per
    # parameter, the largest part of a replica) for its share of the parameters only. Make the
    # optimizer a ZeroRedundancyOptimizer of the model's parameters with
    # optimizer_class=torch.optim.AdamW and AdamW's arguments; after each step it broadcasts
    # the parameters each rank updated to the others.
    optimizer = torch.optim.AdamW(model.parameters(), **adamw)
    throughput = Throughput(device)
    monitor = TrainingMonitor(args, out_dir, model, optimizer, throughput, flops_per_tok,
                              planned_steps(args, train_loader, args.grad_accum))

    # ---- training ----
    loss_history, step, micro, val_loss = [], 0, 0, math.nan
    micro_losses = []
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for x, y in monitor.batches(train_loader):
            if step == args.max_steps:
                break
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if micro % args.grad_accum == 0:  # a new optimizer step begins
                optimizer.zero_grad(set_to_none=True)
            micro += 1
            last = micro % args.grad_accum == 0  # the micro-batch that ends an optimizer step
            # TODO 58: Gradient accumulation. backward() adds to .grad, so N backward passes
            # before one optimizer step add up N micro-batches' gradients: divide each loss by
            # args.grad_accum, so the sum is the gradient of the mean loss of the whole batch
            # (as if it were one batch). And all-reduce once per step, not once per
            # micro-batch: run all but the last micro-batch inside no_gradient_sync(model),
            # its forward pass and its backward both (DDP decides in forward whether the
            # backward that follows all-reduces), so the ranks' gradients are averaged only in
            # the last one.
            with autocast(args.precision, device):
                logits = model(x)
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
            micro_losses.append(loss.detach())
            if not last:
                continue
            optimizer.step()
            step += 1
            throughput.step(x.numel() * world_size * args.grad_accum)
            # the batch's loss: the micro-batches' (scaled) losses add up to their mean
            step_loss = all_reduce_mean(torch.stack(micro_losses).sum())
            micro_losses = []
            stop_if_not_finite(step_loss, step)
            loss_history.append(step_loss)
            if step % args.log_every == 0:
                print0(f"epoch {epoch} {monitor.report(step, step_loss)}")

        throughput.pause()
        val_loss = evaluate(model, val_loader, device)
        stop_if_not_finite(val_loss, step, "validation loss")
        print0(f"epoch {epoch} validation loss {val_loss:.4f} perplexity {perplexity(val_loss):.1f}")
        monitor.log_epoch(step, val_loss)
        if step == args.max_steps:
            break

    # ---- evaluation, saving, summary ----
    test_loss = evaluate(model, test_loader, device)
    summary = training_summary(
        args, cfg, corpus, world_size=world_size, steps=step, loss_history=loss_history,
        val_loss=val_loss, test_loss=test_loss, throughput=throughput,
        flops_per_token=flops_per_tok, device=device, start_time=start_time,
        # one optimizer step sees grad_accum micro-batches of every rank
        data_parallel_size=world_size * args.grad_accum, layout=args.layout,
        grad_accum=args.grad_accum, activation_checkpointing=args.activation_checkpointing,
        memory=monitor.memory)
    print0(f"test loss {test_loss:.4f} perplexity {summary['test_ppl']:.1f}; "
           f"{summary['tokens_per_s']:.0f} tokens/s, MFU {summary['mfu']:.1%}")
    save_full_model(model, out_dir / "final_model.pt")  # every layout: one ordinary state_dict
    write_summary(out_dir, summary, vocab=corpus.vocab)  # and vocab.txt (tools/generate.py)
    monitor.close(summary)
    del model, optimizer
    destroy_process_group()


@torch.no_grad()
def evaluate(model, loader, device):
    """Token-weighted mean loss over a whole split, added up over the ranks."""
    model.eval()
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    tokens = torch.zeros((), device=device, dtype=torch.float64)
    for x, y in loader:
        # one shape for every batch: compiled blocks (--compile) compile evaluation once
        x, y = pad_batch(x.to(device), y.to(device), loader.batch_size)
        loss_sum += F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum",
                                    ignore_index=IGNORE_INDEX)
        tokens += (y != IGNORE_INDEX).sum()
    loss_sum, tokens = all_reduce_sum(loss_sum), all_reduce_sum(tokens)
    model.train()
    # FSDP: free the gathered weights (evaluation has no backward), every unit's: reshard() is
    # per unit, and zero2 keeps the blocks' weights after forward too
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()
    return (loss_sum / tokens).item()


if __name__ == "__main__":
    main()
