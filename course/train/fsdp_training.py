"""Train the causal Transformer LM with FSDP2 and Distributed Checkpoint: step 2 of the course.

As shipped, this script is the solution of step 1: it trains with DistributedDataParallel (DDP),
where every rank holds the whole model, its gradients and its optimizer state. Do TODOs 17 to 22
in order to shard all three over the ranks with FSDP2 (`fully_shard`), to save and resume
sharded checkpoints with Distributed Checkpoint (DCP), and to export one ordinary weights file.
Check your work at any moment with
    python check.py fsdp    # runs your file: per TODO ok, not started, or what to fix
    diff -u train/fsdp_training.py solutions/train/fsdp_training.py

Run it (the same commands before and after the TODOs; compare the "memory per rank" lines):
    python train/fsdp_training.py --preset tiny --max-steps 50                           # 1 process
    torchrun --standalone --nproc_per_node=2 train/fsdp_training.py --preset tiny --max-steps 50 \\
        --overwrite                                   # 2 processes, in place of the first run
    sbatch fsdp_training.sbatch                                                  # 2 nodes x 4 GPUs
When the TODOs are done, continue a run from its last checkpoint (at any number of ranks):
    torchrun --standalone --nproc_per_node=2 train/fsdp_training.py --preset tiny --max-steps 100 \\
        --resume runs/fsdp_training/checkpoints/last
A run restarted by torchrun (a rank died, --max-restarts) or by Slurm (a requeued job) continues
from its newest checkpoint by itself (--resume auto); --checkpoint-every bounds the steps lost:
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1  # or restarted workers may hang (pytorch#135712)
    torchrun --standalone --nproc_per_node=2 --max-restarts 1 train/fsdp_training.py \\
        --preset tiny --max-steps 100 --checkpoint-every 10 --overwrite
"""

import itertools
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from model import TransformerLM, get_config
from utils.args import base_parser
from utils.checkpointing import checkpoint_blocking_seconds, use_async_checkpoint_saves
from utils.checks import claim_out_dir, stop_if_not_finite
from utils.data import IGNORE_INDEX, TokenWindows, check_splits, load_corpus_or_exit, pad_batch
from utils.metrics import (Throughput, flops_per_token, model_state_bytes, peak_memory_bytes,
                           perplexity, speed_text, training_summary, write_summary)
from utils.monitor import TrainingMonitor, planned_steps
from utils.precision import autocast, compile_blocks, set_precision
from torch.utils.data.distributed import DistributedSampler
from utils.data import DistributedEvalSampler
from utils.distributed_utils import (all_reduce_mean, all_reduce_sum, destroy_process_group,
                                     gather_per_rank, print0, setup)
# TODO 17: Import FSDP2's fully_shard, MixedPrecisionPolicy and FSDPModule (the class every
# sharded module becomes) from torch.distributed.fsdp, and from utils.checkpointing the
# checkpoint helpers save_sharded_model, load_sharded_model and save_full_model and the resume
# bookkeeping resume_checkpoint and resume_position. DDP and save0 go once TODOs 19 and 22
# replace their last uses (removed earlier, the run stops at a NameError before it gets there).
#| exercise
from torch.nn.parallel import DistributedDataParallel as DDP
from utils.distributed_utils import save0
#| solution
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from utils.checkpointing import (load_sharded_model, resume_checkpoint, resume_position,
                                 save_full_model, save_sharded_model)
#| end


# TODO 18: Shard the model with FSDP2: write apply_fsdp(model, precision="fp32",
# reshard_after_forward=True), returning the model, and its option --reshard-after-forward
# {true,false} (--precision is every script's flag). Call fully_shard on each Transformer block
# (the values of the ModuleDict model.layers) first, then on the whole model (the root: what is left, the embeddings, final
# norm and output layer). Each call makes one FSDP unit: its parameters become DTensors split
# over the ranks, gathered just before the unit's forward and backward and freed afterwards,
# and its gradients are reduce-scattered so each rank keeps only its shard. Sharding every block
# (not only the root) is what lets a rank hold one block's full weights at a time, and lets the
# gather of the next block overlap the compute of this one.
# The flag reshard_after_forward is for the blocks; leave the root at its default (it keeps its
# weights after forward: backward needs them at once). With bf16, give every unit a
# MixedPrecisionPolicy that computes in bf16 and reduces gradients in fp32, and let the root
# return fp32 logits (output_dtype), so the loss over the vocabulary is exact.
#| exercise
#| solution
def apply_fsdp(model, precision="fp32", reshard_after_forward=True):
    policy = {}
    if precision == "bf16":
        # Compute in bf16; the optimizer keeps fp32 weights; gradients are summed in fp32.
        policy = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers.values():
        fully_shard(block, reshard_after_forward=reshard_after_forward,
                    mp_policy=MixedPrecisionPolicy(**policy))
    # The root's output is the logits: fp32, so the loss over the vocabulary is exact. (The
    # root keeps its weights gathered after forward by default: backward needs them at once.)
    fully_shard(model, mp_policy=MixedPrecisionPolicy(**policy, output_dtype=torch.float32))
    return model
#| end


def parse_args():
    parser = base_parser(__file__, __doc__)
    # TODO 18: The options of apply_fsdp.
    #| exercise
    #| solution
    parser.add_argument("--reshard-after-forward", choices=["true", "false"], default="true",
                        help="true: free each block's gathered weights after its forward and "
                             "gather again for backward (ZeRO-3, least memory); false: keep them "
                             "until backward (ZeRO-2-like, one all-gather less per block)")
    #| end
    # TODO 20: How often to save checkpoints.
    #| exercise
    #| solution
    parser.add_argument("--checkpoint-every", type=int, default=0, metavar="STEPS",
                        help="also save checkpoints/last every STEPS steps (0: only at the end of "
                             "each epoch and at --max-steps)")
    #| end
    # TODO 21: Resuming. --resume takes a checkpoint folder that this script wrote, or "auto".
    #| exercise
    #| solution
    parser.add_argument("--resume", metavar="DIR|auto",
                        help="continue from this checkpoint folder (e.g. "
                             "OUT_DIR/checkpoints/last), or auto: from the newest complete "
                             "checkpoint in OUT_DIR/checkpoints if there is one. A run restarted "
                             "by torchrun or Slurm always does auto")
    #| end
    parser.add_argument("--async-save", action="store_true",
                        help="dcp.async_save: a checkpoint blocks training only while the "
                             "shards are copied to host memory; the files are written meanwhile")
    return parser.parse_args()


def main():
    args = parse_args()
    out_dir = Path(args.out_dir)
    start_time = time.time()

    # Under torchrun, join the process group and pick this rank's GPU (or the CPU with gloo).
    # Every rank is seeded alike, so every rank builds the same initial weights.
    local_rank, rank, device, world_size = setup(args.seed, args.device)
    claim_out_dir(args)  # writable, this run's alone, no earlier results overwritten unasked
    use_async_checkpoint_saves(args.async_save)  # --async-save: dcp.async_save (docs/memory.md)
    # auto: bf16 on a GPU that has it, else fp32 (see utils/precision.py)
    args.precision = set_precision(args.precision, device)

    # ---- data ----
    corpus = load_corpus_or_exit(args.dataset, args.data_dir, args.cache_dir, warn=print0,
                                 max_vocab=args.max_vocab)
    cfg = get_config(args.preset, vocab_size=corpus.vocab_size, max_seq_len=args.seq_len,
                     dropout=args.dropout, n_layers=args.n_layers)
    check_splits(corpus, cfg.max_seq_len, args.batch_size, world_size)
    train_ds, val_ds, test_ds = (TokenWindows(tokens, cfg.max_seq_len)
                                 for tokens in (corpus.train, corpus.valid, corpus.test))
    # Every rank gets its own shard of the data, in the same shuffled order on every rank;
    # evaluation pads with samples that count nowhere, so all ranks run the same number of
    # batches (under FSDP every forward is a collective: a rank with one batch more would hang).
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank,
                                       shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedEvalSampler(val_ds, num_replicas=world_size, rank=rank)
    test_sampler = DistributedEvalSampler(test_ds, num_replicas=world_size, rank=rank)
    # generator: every DataLoader iterator draws a seed for its workers; from a generator of its
    # own, not from the global one that dropout draws from, so a resumed run continues exactly.
    loader_args = dict(batch_size=args.batch_size, num_workers=args.num_workers,
                       pin_memory=device.type == "cuda", generator=torch.Generator())
    train_loader = DataLoader(train_ds, sampler=train_sampler, drop_last=True, **loader_args)
    val_loader = DataLoader(val_ds, sampler=val_sampler, **loader_args)
    test_loader = DataLoader(test_ds, sampler=test_sampler, **loader_args)
    global_batch = args.batch_size * world_size

    # ---- model and optimizer ----
    model = TransformerLM(cfg).to(device)
    if args.compile:
        compile_blocks(model)
    flops_per_tok = flops_per_token(model.num_params(exclude_embeddings=True), cfg.n_layers,
                                    cfg.d_model, cfg.max_seq_len)
    print0(f"data: {corpus.source}, vocabulary {corpus.vocab_size}, {len(train_ds)} training "
           f"windows of {cfg.max_seq_len} tokens; model: {args.preset}, "
           f"{model.num_params() / 1e6:.1f}M parameters; world size {world_size}")
    # TODO 19: Replace DDP by your apply_fsdp, with the run's precision and its
    # --reshard-after-forward choice (a string: "true" or "false"). The optimizer is made
    # afterwards on purpose: it must hold the sharded parameters, so each rank keeps optimizer
    # state for its shard only.
    #| exercise
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    #| solution
    model = apply_fsdp(model, args.precision, args.reshard_after_forward == "true")
    #| end
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                                  fused=device.type == "cuda")  # one kernel for all parameters
    throughput = Throughput(device)
    # Live metrics to TensorBoard or wandb and the log line (utils/monitor.py, docs/monitoring.md)
    monitor = TrainingMonitor(args, out_dir, model, optimizer, throughput, flops_per_tok,
                              planned_steps(args, train_loader))

    # ---- training ----
    loss_history, step, best_val, val_loss = [], 0, math.inf, math.nan
    start_epoch, start_batch = 0, 0
    # TODO 20: Save sharded checkpoints: define save_checkpoint(name, epoch, batches_done) that
    # saves into out_dir / "checkpoints" / name with save_sharded_model, called on every rank
    # (each writes its own shards into that one folder). Its train_state is a dict of what
    # resuming needs besides the weights and the optimizer, written as JSON, under these keys:
    # step, epoch, batches_done (in this epoch) and global_batch (resume_position reads them),
    # best_val (the best validation loss), loss_history (as floats) and model_config
    # (cfg.to_dict(): load_sharded_model refuses a checkpoint of another model).
    # save_sharded_model also keeps every rank's random-number states: what dropout draws next.
    #| exercise
    #| solution
    def save_checkpoint(name, epoch, batches_done):
        train_state = dict(step=step, epoch=epoch, batches_done=batches_done,
                           global_batch=global_batch, best_val=best_val,
                           loss_history=[loss.item() for loss in loss_history],
                           model_config=cfg.to_dict())
        save_sharded_model(model, optimizer, out_dir / "checkpoints" / name, train_state)
    #| end

    # TODO 21: Resume. resume_checkpoint (utils.checkpointing) turns --resume and the
    # checkpoints folder into the folder to load, or None (it turns "auto", and any torchrun or
    # Slurm restart, into the newest complete checkpoint). If there is one, on every rank, after
    # wrapping the model and making the optimizer: load_sharded_model loads this rank's shards
    # (a checkpoint of another world size is resharded at load time), puts back this rank's
    # random-number states (so dropout continues exactly) and returns the train_state you
    # saved; resume_position turns it into the step, epoch and batch to continue from. Everything
    # else you saved comes back too: a run that forgets the best validation loss or the loss
    # history goes on, but not as the uninterrupted run would. Say on rank 0 where the run
    # resumed from and at which step (the job's log is all an instructor sees of a restart).
    #| exercise
    #| solution
    resume = resume_checkpoint(args.resume, out_dir / "checkpoints")
    if resume:
        train_state = load_sharded_model(model, optimizer, resume, cfg.to_dict())
        step, start_epoch, start_batch = resume_position(train_state, global_batch,
                                                         len(train_loader), args.max_steps)
        best_val = train_state["best_val"]
        loss_history = [torch.tensor(loss, device=device) for loss in train_state["loss_history"]]
        print0(f"resumed from {resume} at step {step}, epoch {start_epoch}, batch {start_batch}")
    #| end

    for epoch in range(start_epoch, args.epochs):
        # Tell the sampler the epoch, or every epoch repeats the first epoch's order.
        train_sampler.set_epoch(epoch)
        # A resumed run skips the batches its checkpoint had already trained on in this epoch
        # (cheap here: a batch is a slice of a tensor in memory).
        batches_done = start_batch if epoch == start_epoch else 0
        for x, y in monitor.batches(itertools.islice(train_loader, batches_done, None)):
            if step == args.max_steps:
                break
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            # bf16 takes both: FSDP's policy gathers bf16 weights (half the traffic), and
            # autocast, as in the DDP version, picks per operation (matmuls in bf16; softmax,
            # norms and the loss in fp32)
            with autocast(args.precision, device):
                logits = model(x)
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            batches_done += 1
            throughput.step(x.numel() * world_size)
            # Each rank's loss covers only its own batch: log the mean over all ranks.
            step_loss = all_reduce_mean(loss.detach())
            stop_if_not_finite(step_loss, step)  # before anything is saved over a good file
            loss_history.append(step_loss)
            if step % args.log_every == 0:
                print0(f"epoch {epoch} {monitor.report(step, step_loss)}")
            # TODO 20: With --checkpoint-every, also save "last" during the epoch (a job that
            # hits its time limit loses at most that many steps).
            #| exercise
            #| solution
            if args.checkpoint_every and step % args.checkpoint_every == 0:
                save_checkpoint("last", epoch, batches_done)
            #| end

        throughput.pause()  # evaluation time is not training time
        val_loss = evaluate(model, val_loader, device)
        stop_if_not_finite(val_loss, step, "validation loss")
        print0(f"epoch {epoch} validation loss {val_loss:.4f} perplexity {perplexity(val_loss):.1f}")
        monitor.log_epoch(step, val_loss)
        if val_loss < best_val:
            best_val = val_loss
            # TODO 20: Save the best checkpoint with save_sharded_model instead of save0 (save0
            # refuses sharded weights: no rank holds them all).
            #| exercise
            save0(model, out_dir / "best_model.pt")
            #| solution
            save_checkpoint("best", epoch, batches_done)
            #| end
        # TODO 20: Save the last checkpoint at the end of every epoch, and before stopping at
        # --max-steps.
        #| exercise
        #| solution
        save_checkpoint("last", epoch, batches_done)
        #| end
        if step == args.max_steps:
            break

    # ---- evaluation, saving, summary ----
    test_loss = evaluate(model, test_loader, device)
    # Memory per rank: all of the model, gradients and optimizer state under DDP, a shard of
    # them under FSDP. The peak also holds activations (and on the CPU the whole process).
    state_bytes = gather_per_rank(model_state_bytes(model, optimizer), device)
    peak_bytes = gather_per_rank(peak_memory_bytes(device), device)
    summary = training_summary(
        args, cfg, corpus, world_size=world_size, steps=step, loss_history=loss_history,
        val_loss=val_loss, test_loss=test_loss, throughput=throughput,
        flops_per_token=flops_per_tok, device=device, start_time=start_time,
        model_state_bytes_per_rank=state_bytes, peak_mem_bytes_per_rank=peak_bytes,
        memory=monitor.memory,  # the breakdown after the first step (utils/memory.py)
        checkpoint_save_blocking_s=checkpoint_blocking_seconds(), async_save=args.async_save)
    print0(f"test loss {test_loss:.4f} perplexity {summary['test_ppl']:.1f}; "
           f"{speed_text(summary)}")
    print0("memory per rank (MiB): weights+gradients+optimizer "
           f"{' '.join(f'{b / 2**20:.1f}' for b in state_bytes)}; "
           f"peak {' '.join(f'{b / 2**20:.0f}' for b in peak_bytes)}")
    # TODO 22: Export the trained weights as one ordinary file, final_model.pt, with
    # save_full_model, called on every rank: it gathers the full weights on rank 0 (into CPU
    # memory), and the file loads into a plain TransformerLM.
    #| exercise
    save0(model, out_dir / "final_model.pt")
    #| solution
    save_full_model(model, out_dir / "final_model.pt")
    #| end
    write_summary(out_dir, summary, vocab=corpus.vocab)  # and vocab.txt (tools/generate.py)
    monitor.close(summary)
    # Drop the model first, so its communication buffers are freed while the group still exists.
    # (Assigned None rather than deleted: save_checkpoint above still names them.)
    model = optimizer = None
    destroy_process_group()


@torch.no_grad()
def evaluate(model, loader, device):
    """Token-weighted mean loss over a whole split."""
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
    # Each rank saw only its share of the split: sum loss and token counts before dividing.
    loss_sum, tokens = all_reduce_sum(loss_sum), all_reduce_sum(tokens)
    # TODO 19: FSDP frees a unit's gathered weights after backward (the root's, and with
    # --reshard-after-forward false every block's), and evaluation has none: reshard them here,
    # or the full weights stay on every rank. reshard() is a method of each unit (an FSDPModule)
    # and does not reach the units inside it.
    #| exercise
    #| solution
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()
    #| end
    model.train()
    return (loss_sum / tokens).item()


if __name__ == "__main__":
    main()
