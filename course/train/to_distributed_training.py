"""Train a causal Transformer language model on WikiText-2: step 1 of the course.

As shipped, this script trains on one device: a GPU if there is one, else the CPU. Do the TODOs
in order (TODOs 1 to 11 here, then 12 to 16 in to_distributed_training.sbatch) to make it train
on several GPUs and nodes with DistributedDataParallel (DDP). Check your work at any moment with
    python check.py ddp    # runs your file: per TODO ok, not started, or what to fix
    diff -u train/to_distributed_training.py solutions/train/to_distributed_training.py

Run it:
    python train/to_distributed_training.py --preset small --max-steps 300      # laptop CPU
    sbatch to_distributed_training.sbatch                                        # one GPU
When the TODOs are done (--overwrite: in place of the results of the run before):
    torchrun --standalone --nproc_per_node=2 train/to_distributed_training.py --preset tiny \\
        --max-steps 50 --overwrite
    sbatch to_distributed_training.sbatch                                        # 2 nodes x 4 GPUs
"""

import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from model import TransformerLM, get_config
from utils.args import base_parser
from utils.checks import claim_out_dir, stop_if_not_finite
from utils.data import IGNORE_INDEX, TokenWindows, check_splits, load_corpus_or_exit, pad_batch
from utils.metrics import (Throughput, flops_per_token, peak_memory_text, perplexity, speed_text,
                           training_summary, write_summary)
from utils.monitor import TrainingMonitor, planned_steps
from utils.precision import autocast, compile_blocks, set_precision
# TODO 1: Import what DDP needs: DistributedDataParallel (as DDP) from torch.nn.parallel,
# DistributedSampler from torch.utils.data.distributed, our DistributedEvalSampler from
# utils.data, and from utils.distributed_utils the helpers setup, print0, save0,
# all_reduce_mean, all_reduce_sum and destroy_process_group.
#| exercise
#| solution
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler
from utils.data import DistributedEvalSampler
from utils.distributed_utils import (all_reduce_mean, all_reduce_sum, destroy_process_group,
                                     print0, save0, setup)
#| end


def main():
    args = base_parser(__file__, __doc__).parse_args()
    out_dir = Path(args.out_dir)
    start_time = time.time()

    # TODO 2: Replace the three lines below (the hand-made device, world_size = 1 and the seed)
    # with one call to utils.distributed_utils.setup (it takes the seed and the --device
    # choice). Under torchrun it joins the process group, picks this rank's GPU (or the CPU with
    # gloo) and seeds every rank alike; it returns this process's local rank, global rank,
    # device and the world size, which the later TODOs need.
    #| exercise
    device = torch.device("cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu")
    world_size = 1
    torch.manual_seed(args.seed)
    #| solution
    local_rank, rank, device, world_size = setup(args.seed, args.device)
    #| end
    claim_out_dir(args)  # writable, this run's alone, no earlier results overwritten unasked
    # auto: bf16 autocast on a GPU that has it, else fp32 (see utils/precision.py)
    args.precision = set_precision(args.precision, device)

    # ---- data ----
    # TODO 9: Print on rank 0 only, with print0 in place of print: in the lines marked TODO 9
    # below, and here too, where print is passed as the data loading's warn= function (every
    # rank would print the same warning about the data).
    #| exercise
    corpus = load_corpus_or_exit(args.dataset, args.data_dir, args.cache_dir, warn=print,
                                 max_vocab=args.max_vocab)
    #| solution
    corpus = load_corpus_or_exit(args.dataset, args.data_dir, args.cache_dir, warn=print0,
                                 max_vocab=args.max_vocab)
    #| end
    cfg = get_config(args.preset, vocab_size=corpus.vocab_size, max_seq_len=args.seq_len,
                     dropout=args.dropout, n_layers=args.n_layers)
    check_splits(corpus, cfg.max_seq_len, args.batch_size, world_size)
    train_ds, val_ds, test_ds = (TokenWindows(tokens, cfg.max_seq_len)
                                 for tokens in (corpus.train, corpus.valid, corpus.test))
    # TODO 3: Give every rank its own shard of the data, with a sampler per split (train_sampler,
    # val_sampler, test_sampler). Training: a DistributedSampler told the number of replicas and
    # this rank, shuffling with the run's seed (so every rank shuffles alike and the shards do
    # not overlap) and dropping the remainder (so every rank takes the same number of steps).
    # Validation and test: utils.data's DistributedEvalSampler, which counts no sample twice
    # (DistributedSampler would pad the last shard with repeated samples).
    #| exercise
    #| solution
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank,
                                       shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedEvalSampler(val_ds, num_replicas=world_size, rank=rank)
    test_sampler = DistributedEvalSampler(test_ds, num_replicas=world_size, rank=rank)
    #| end
    loader_args = dict(batch_size=args.batch_size, num_workers=args.num_workers,
                       pin_memory=device.type == "cuda")
    # TODO 4: Pass the samplers to the DataLoaders (sampler=train_sampler, ...). The sampler
    # shuffles now: drop shuffle=True.
    #| exercise
    train_loader = DataLoader(train_ds, shuffle=True, drop_last=True, **loader_args)
    val_loader = DataLoader(val_ds, **loader_args)
    test_loader = DataLoader(test_ds, **loader_args)
    #| solution
    train_loader = DataLoader(train_ds, sampler=train_sampler, drop_last=True, **loader_args)
    val_loader = DataLoader(val_ds, sampler=val_sampler, **loader_args)
    test_loader = DataLoader(test_ds, sampler=test_sampler, **loader_args)
    #| end

    # ---- model and optimizer ----
    model = TransformerLM(cfg).to(device)
    if args.compile:
        compile_blocks(model)
    flops_per_tok = flops_per_token(model.num_params(exclude_embeddings=True), cfg.n_layers,
                                    cfg.d_model, cfg.max_seq_len)
    # TODO 9: print0
    #| exercise
    print(f"data: {corpus.source}, vocabulary {corpus.vocab_size}, {len(train_ds)} training "
          f"windows of {cfg.max_seq_len} tokens; model: {args.preset}, "
          f"{model.num_params() / 1e6:.1f}M parameters; world size {world_size}")
    #| solution
    print0(f"data: {corpus.source}, vocabulary {corpus.vocab_size}, {len(train_ds)} training "
           f"windows of {cfg.max_seq_len} tokens; model: {args.preset}, "
           f"{model.num_params() / 1e6:.1f}M parameters; world size {world_size}")
    #| end
    # TODO 5: Wrap the model in DistributedDataParallel (DDP). It keeps the replicas identical
    # by averaging the gradients of all ranks during backward(). On a GPU it needs to know
    # which one holds this replica (device_ids, a list with this rank's local GPU); on a CPU,
    # no device ids.
    #| exercise
    #| solution
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    #| end
    # fused: one kernel updates all parameters on a GPU (instead of several per parameter)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                                  fused=device.type == "cuda")
    throughput = Throughput(device)
    # Live metrics to TensorBoard or wandb and the log line (utils/monitor.py, docs/monitoring.md)
    monitor = TrainingMonitor(args, out_dir, model, optimizer, throughput, flops_per_tok,
                              planned_steps(args, train_loader))

    # ---- training ----
    loss_history, step, best_val, val_loss = [], 0, math.inf, math.nan
    for epoch in range(args.epochs):
        # TODO 6: Tell the training sampler which epoch starts (its set_epoch), or every epoch
        # repeats the first epoch's order.
        #| exercise
        #| solution
        train_sampler.set_epoch(epoch)
        #| end
        first_step = step
        for x, y in monitor.batches(train_loader):  # (times the wait for each batch)
            if step == args.max_steps:
                break
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast(args.precision, device):  # bf16 matmuls; the weights stay fp32
                logits = model(x)
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            throughput.step(x.numel() * world_size)
            # TODO 7: Each rank's loss covers only its own batch: log the mean over all ranks
            # (all_reduce_mean from utils.distributed_utils, on the detached loss; it returns a
            # new tensor, so it replaces the clone below).
            #| exercise
            # detach: keeping the graph alive would hold its memory; clone: loss_history keeps
            # it for the whole run, and the loss's own few bytes lie among the step's freed
            # activations (on a CPU, kept they stopped their reuse: 1.6 MB more every step)
            step_loss = loss.detach().clone()
            #| solution
            step_loss = all_reduce_mean(loss.detach())
            #| end
            stop_if_not_finite(step_loss, step)  # before anything is saved over a good file
            loss_history.append(step_loss)
            if step % args.log_every == 0:
                # TODO 9: print0
                #| exercise
                print(f"epoch {epoch} {monitor.report(step, step_loss)}")
                #| solution
                print0(f"epoch {epoch} {monitor.report(step, step_loss)}")
                #| end

        throughput.pause()  # evaluation time is not training time
        val_loss = evaluate(model, val_loader, device)
        stop_if_not_finite(val_loss, step, "validation loss")
        train_loss = torch.stack(loss_history[first_step:]).mean().item() if step > first_step \
            else math.nan
        # TODO 9: print0
        #| exercise
        print(f"epoch {epoch} train loss {train_loss:.4f} validation loss {val_loss:.4f} "
              f"perplexity {perplexity(val_loss):.1f}")
        #| solution
        print0(f"epoch {epoch} train loss {train_loss:.4f} validation loss {val_loss:.4f} "
               f"perplexity {perplexity(val_loss):.1f}")
        #| end
        monitor.log_epoch(step, val_loss, train_loss)
        if val_loss < best_val:
            best_val = val_loss
            # TODO 10: Save on rank 0 only, and save the plain model's weights, so the file
            # loads into a model without DDP: save0 from utils.distributed_utils does both (it
            # unwraps DDP).
            #| exercise
            out_dir.mkdir(parents=True, exist_ok=True)
            torch.save(model.state_dict(), out_dir / "best_model.pt")
            #| solution
            save0(model, out_dir / "best_model.pt")
            #| end
        if step == args.max_steps:
            break

    # ---- evaluation, saving, summary ----
    test_loss = evaluate(model, test_loader, device)
    summary = training_summary(
        args, cfg, corpus, world_size=world_size, steps=step, loss_history=loss_history,
        val_loss=val_loss, test_loss=test_loss, throughput=throughput,
        flops_per_token=flops_per_tok, device=device, start_time=start_time,
        memory=monitor.memory)  # the breakdown after the first step (utils/memory.py)
    # TODO 9: print0
    #| exercise
    print(f"test loss {test_loss:.4f} perplexity {summary['test_ppl']:.1f}; "
          f"{speed_text(summary)}, "
          f"{peak_memory_text(summary, device)}")
    #| solution
    print0(f"test loss {test_loss:.4f} perplexity {summary['test_ppl']:.1f}; "
           f"{speed_text(summary)}, "
           f"{peak_memory_text(summary, device)}")
    #| end
    # TODO 10: save0
    #| exercise
    torch.save(model.state_dict(), out_dir / "final_model.pt")
    #| solution
    save0(model, out_dir / "final_model.pt")
    #| end
    write_summary(out_dir, summary, vocab=corpus.vocab)  # and vocab.txt (tools/generate.py)
    monitor.close(summary)
    # TODO 11: Leave the process group when done (destroy_process_group). Delete the DDP model
    # and the optimizer first, so its communication buffers are freed while the group still
    # exists.
    #| exercise
    #| solution
    del model, optimizer
    destroy_process_group()
    #| end


@torch.no_grad()
def evaluate(model, loader, device):
    """Token-weighted mean loss over a whole split."""
    # No autocast here: the loss of the fp32 weights, comparable between --precision settings.
    model.eval()
    # float64 sums: adding many partial sums in another order changes nothing visible
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    tokens = torch.zeros((), device=device, dtype=torch.float64)
    for x, y in loader:
        # one shape for every batch: compiled blocks (--compile) compile evaluation once
        x, y = pad_batch(x.to(device), y.to(device), loader.batch_size)
        logits = model(x)
        loss_sum += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum",
                                    ignore_index=IGNORE_INDEX)
        tokens += (y != IGNORE_INDEX).sum()  # padding samples have no targets
    # TODO 8: Each rank saw only its share of the split: add up the loss sums and the token
    # counts of all ranks (all_reduce_sum) before dividing, so the result equals the single-GPU
    # loss exactly. (The mean of the ranks' means would not: their shards differ in size.)
    #| exercise
    #| solution
    loss_sum, tokens = all_reduce_sum(loss_sum), all_reduce_sum(tokens)
    #| end
    model.train()
    return (loss_sum / tokens).item()


if __name__ == "__main__":
    main()
