"""Tensor parallelism (TP): several GPUs share every layer of one model.

As shipped, this script is the finished DDP step: every rank holds the whole model and its own
batch. Do the TODOs in order (23 to 33) to split every Transformer block over the GPUs of a
node, Megatron style: the ranks of a tensor-parallel group hold a slice of the attention heads
and of the MLP, compute on the same batch, and combine their partial results with one
all-reduce per attention and one per MLP. With more ranks than the TP degree, the groups are
data-parallel replicas of each other (FSDP over the other mesh dimension).
Check your work at any moment with
    python check.py tp    # runs your file: per TODO ok, not started, or what to fix
    diff -u train/tp_training.py solutions/train/tp_training.py

Run it (the TP degree defaults to the processes per node, so TP stays inside a node):
    python train/tp_training.py --preset tiny --max-steps 50                    # laptop CPU, 1 rank
    torchrun --standalone --nproc_per_node=2 train/tp_training.py --preset tiny --max-steps 50 \\
        --overwrite                      # 2 ranks as TP 2, in place of the run before
    sbatch tp_training.sbatch                      # 2 nodes x 4 GPUs: TP 4 in a node, DP 2 across
When the TODOs are done, `--tp N` chooses the degree (it must divide the world size, the
number of heads and the MLP width), e.g.
    torchrun --standalone --nproc_per_node=4 train/tp_training.py --preset tiny --tp 2 \\
        --max-steps 50 --overwrite                                             # DP 2 x TP 2
"""

import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from model import TransformerLM, get_config
from utils.args import base_parser, positive_int
from utils.checks import claim_out_dir, stop_if_not_finite, stop_on_every_rank
from utils.data import IGNORE_INDEX, TokenWindows, check_splits, load_corpus_or_exit, pad_batch
from utils.metrics import (Throughput, flops_per_token, perplexity, speed_text, training_summary,
                           write_summary)
from utils.monitor import TrainingMonitor, planned_steps
from utils.precision import autocast, compile_blocks, set_precision
from torch.distributed.tensor import DTensor
from torch.utils.data.distributed import DistributedSampler
from utils.data import DistributedEvalSampler
from utils.distributed_utils import (all_reduce_mean, all_reduce_sum, destroy_process_group,
                                     print0, setup)
# DONE 23: Import os (for DONE 25), init_device_mesh from torch.distributed.device_mesh,
# Replicate from torch.distributed.tensor, the tensor-parallel tools from
# torch.distributed.tensor.parallel (parallelize_module, ColwiseParallel, RowwiseParallel,
# loss_parallel), fully_shard from torch.distributed.fsdp in place of DDP (DONE 29 says why),
# and save_full_model from utils.checkpointing in place of save0 (DONE 32). DDP and save0 are
# still used until TODOs 29 and 32 replace them: their imports go there, or the run stops at
# a NameError before it reaches the TODOs in between.
import os

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, loss_parallel,
                                               parallelize_module)
from utils.checkpointing import save_full_model


# DONE 24: The tensor-parallel plan, as a function of its own (the model file knows nothing of
# it): apply_tp(model, tp_mesh), returning the model. parallelize_module takes a module, the
# mesh and a plan {submodule name: style}. In every block (model.layers): the projections that
# fan out, attention's q, k and v and the MLP's first, are column-wise (each rank computes some
# heads or hidden units from the whole input); the two that come back, attention's output and
# the MLP's second, are row-wise (each rank multiplies its slice; an all-reduce adds the
# partial results). Then on the model itself, the two layers that hold most of a small model's
# weights: the token embedding split over the vocabulary (row-wise; its input, the token ids,
# is the same on every rank: Replicate) and the output layer column-wise, its logits left as a
# split DTensor (no local output) for loss_parallel.
def apply_tp(model: TransformerLM, tp_mesh) -> TransformerLM:
    """Shard the model over the ranks of `tp_mesh` in place; returns it.

    In a block, column-wise then row-wise means the activations between q/k/v and out_proj,
    and between the MLP's two projections, never leave the rank: one all-reduce per attention
    and one per MLP in the forward pass, as many in the backward pass.
    """
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            "attn.q_proj": ColwiseParallel(),   # each rank: n_heads / tp whole heads
            "attn.k_proj": ColwiseParallel(),   # (the model's view(b, t, -1, head_dim)
            "attn.v_proj": ColwiseParallel(),   #  finds the local head count by itself)
            "attn.out_proj": RowwiseParallel(),
            "mlp.in_proj": ColwiseParallel(),   # each rank: d_ff / tp hidden units
            "mlp.out_proj": RowwiseParallel(),
        })
    parallelize_module(model, tp_mesh, {
        # Each rank holds a slice of the vocabulary; a token outside it looks up zeros, and the
        # all-reduce of the row-wise style puts the whole embedding on every rank.
        "tok_emb": RowwiseParallel(input_layouts=Replicate()),
        # The logits (batch x seq x vocab) are the largest activation: keep them split over the
        # vocabulary (a DTensor) and let loss_parallel compute the cross-entropy on the pieces.
        "output": ColwiseParallel(use_local_output=False),
    })
    # pos_emb and the LayerNorms stay ordinary, replicated tensors: they are small, every rank
    # computes the same result, and the gradients DTensor hands back to them are already whole.
    return model


def check_tp_degree(tp: int, world_size: int, cfg) -> None:
    """Stop with one line saying what to change when the model or the world cannot be split."""
    problems = []
    if tp < 1 or world_size % tp:
        problems.append(f"the world size {world_size} must be a multiple of --tp {tp}")
    if cfg.n_heads % tp:
        problems.append(f"n_heads {cfg.n_heads} must be divisible by --tp {tp} (whole heads per rank)")
    if cfg.d_ff % tp:
        problems.append(f"d_ff {cfg.d_ff} must be divisible by --tp {tp}")
    if problems:
        stop_on_every_rank("; ".join(problems) + ": choose another --tp or --preset")


def main():
    parser = base_parser(__file__, __doc__)
    # DONE 25: A --tp option, the tensor-parallel degree, a positive whole number (the parser
    # type positive_int from utils.args says so in one line for 0 or -2). Default: the processes
    # on this node (torchrun's LOCAL_WORLD_SIZE, 1 without torchrun), since TP communicates in
    # every layer and needs the fast links inside a node.
    parser.add_argument("--tp", type=positive_int,
                        default=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                        help="tensor-parallel degree (default: processes per node)")
    args = parser.parse_args()
    out_dir = Path(args.out_dir)
    start_time = time.time()

    # setup() joins the process group and picks this rank's device; it seeds every rank alike,
    # which TP needs: each rank cuts its shard out of the same initial weights.
    local_rank, rank, device, world_size = setup(args.seed, args.device)
    claim_out_dir(args)  # writable, this run's alone, no earlier results overwritten unasked
    # auto: bf16 autocast on a GPU that has it, else fp32 (see utils/precision.py)
    args.precision = set_precision(args.precision, device)

    # ---- data ----
    corpus = load_corpus_or_exit(args.dataset, args.data_dir, args.cache_dir, warn=print0,
                                 max_vocab=args.max_vocab)
    cfg = get_config(args.preset, vocab_size=corpus.vocab_size, max_seq_len=args.seq_len,
                     dropout=args.dropout, n_layers=args.n_layers)
    # DONE 26: Check that the model and the world can be split (check_tp_degree), then arrange
    # the ranks in a 2-D device mesh (init_device_mesh) with dimensions named "dp" and "tp":
    # world_size // tp replicas of tp ranks each. TP is the inner (last) dimension: ranks r and
    # r+1 share layers, so a TP group sits inside a node. Ask the mesh's "dp" dimension for this
    # rank's data-parallel index (dp_rank: its rank within that dimension, get_local_rank();
    # get_rank() is the global rank), their number (dp_size) and its process group (dp_group):
    # the next TODOs need them.
    check_tp_degree(args.tp, world_size, cfg)
    mesh = init_device_mesh(device.type, (world_size // args.tp, args.tp),
                            mesh_dim_names=("dp", "tp"))
    dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    dp_group = mesh["dp"].get_group()
    train_ds, val_ds, test_ds = (TokenWindows(tokens, cfg.max_seq_len)
                                 for tokens in (corpus.train, corpus.valid, corpus.test))
    # Give every data-parallel replica its own shard of the data: a DistributedSampler for
    # training, DistributedEvalSampler for validation and test (it counts no sample twice).
    # DONE 27: Under TP a replica is a whole TP group: its ranks compute on the same batch, so
    # the samplers count data-parallel ranks (dp_rank of dp_size), not processes.
    train_sampler = DistributedSampler(train_ds, num_replicas=dp_size, rank=dp_rank,
                                       shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedEvalSampler(val_ds, num_replicas=dp_size, rank=dp_rank)
    test_sampler = DistributedEvalSampler(test_ds, num_replicas=dp_size, rank=dp_rank)
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
    # DONE 28: Shard the model over the TP dimension of the mesh with your apply_tp, then
    # count the parameters this rank holds (local_params: a DTensor's local shard counts, a
    # plain tensor whole) and report them: that is what TP saves in memory.
    model = apply_tp(model, mesh["tp"])
    local_params = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel()
                       for p in model.parameters())
    print0(f"mesh dp {dp_size} x tp {args.tp}: {local_params / 1e6:.2f}M parameters per rank")
    # Data parallelism keeps the replicas identical by averaging their gradients in backward().
    # DONE 29: Average only over the mesh's dp dimension: the ranks of a TP group hold
    # different shards and must not be averaged with each other. DDP expects plain tensors;
    # FSDP2 is built on DTensor like TP, so use it: fully_shard every block, then the root, on
    # the dp sub-mesh (with dp 1 it shards nothing and costs nothing). This is the usual 2-D
    # layout: TP inside a node, FSDP across nodes (fully_shard takes the sub-mesh as mesh=).
    for block in model.layers.values():
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
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
            with autocast(args.precision, device):  # bf16 matmuls; the weights stay fp32
                logits = model(x)
            logits = logits.float()  # the loss over the vocabulary in fp32 (no-op in fp32)
            # DONE 30: The logits are split over the vocabulary: compute the loss and run the
            # backward pass inside loss_parallel(), which combines the pieces of the softmax
            # with small all-reduces instead of gathering the logits. The loss is the same on
            # every rank of a TP group: take it as a plain tensor (full_tensor()).
            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
            loss = loss.full_tensor()
            optimizer.step()
            step += 1
            # Each rank's loss covers only its own batch: log the mean over the replicas.
            # DONE 31: Tokens and losses are counted per data-parallel replica, not per
            # process: a TP group shares one batch. The tokens of a step are the batch times the
            # replicas, the loss is averaged over the dp group only, and at the end the summary
            # is told the data- and tensor-parallel sizes and this rank's parameter count
            # (training_summary's data_parallel_size, tensor_parallel_size, params_per_rank).
            throughput.step(x.numel() * dp_size)
            step_loss = all_reduce_mean(loss.detach(), group=dp_group)
            stop_if_not_finite(step_loss, step)  # before anything is saved over a good file
            loss_history.append(step_loss)
            if step % args.log_every == 0:
                print0(f"epoch {epoch} {monitor.report(step, step_loss)}")

        throughput.pause()  # evaluation time is not training time
        # DONE 33: evaluate on the data-parallel group
        val_loss = evaluate(model, val_loader, device, dp_group)
        stop_if_not_finite(val_loss, step, "validation loss")
        print0(f"epoch {epoch} validation loss {val_loss:.4f} perplexity {perplexity(val_loss):.1f}")
        monitor.log_epoch(step, val_loss)
        if val_loss < best_val:
            best_val = val_loss
            # Save on rank 0 only, the plain model's weights, so the file loads without DDP.
            # DONE 32: The weights are DTensors, each rank holding a shard, and save0 refuses
            # them: save_full_model (from the FSDP step; call it on every rank) gathers them
            # into rank 0's CPU memory and writes the plain model's state dict.
            save_full_model(model, out_dir / "best_model.pt")
        if step == args.max_steps:
            break

    # ---- evaluation, saving, summary ----
    # DONE 31: the global batch is per replica; tell training_summary the data- and
    # tensor-parallel sizes and this rank's parameter count. DONE 33: evaluate on the
    # data-parallel group.
    test_loss = evaluate(model, test_loader, device, dp_group)
    summary = training_summary(
        args, cfg, corpus, world_size=world_size, steps=step, loss_history=loss_history,
        val_loss=val_loss, test_loss=test_loss, throughput=throughput,
        flops_per_token=flops_per_tok, device=device, start_time=start_time,
        data_parallel_size=dp_size, tensor_parallel_size=args.tp,
        params_per_rank=local_params, memory=monitor.memory)
    print0(f"test loss {test_loss:.4f} perplexity {summary['test_ppl']:.1f}; "
           f"{speed_text(summary)}")
    # DONE 32: save_full_model
    save_full_model(model, out_dir / "final_model.pt")
    write_summary(out_dir, summary, vocab=corpus.vocab)  # and vocab.txt (tools/generate.py)
    monitor.close(summary)
    # Delete the model first, so its communication buffers go while the group still exists.
    del model, optimizer
    destroy_process_group()


# DONE 33: Evaluate like training: evaluate(model, loader, device, dp_group). The loss inside
# loss_parallel (its sum comes back as a DTensor: take full_tensor()), and add up sums and token
# counts over the data-parallel group only, all_reduce_sum(t, dp_group), since the ranks of a TP
# group evaluated the same samples. Then model.reshard(), as in the FSDP step.
@torch.no_grad()
def evaluate(model, loader, device, dp_group):
    """Token-weighted mean loss over a whole split."""
    model.eval()
    # float64 sums: adding many partial sums in another order changes nothing visible
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    tokens = torch.zeros((), device=device, dtype=torch.float64)
    for x, y in loader:
        # one shape for every batch: compiled blocks (--compile) compile evaluation once
        x, y = pad_batch(x.to(device), y.to(device), loader.batch_size)
        logits = model(x)
        # DONE 33: loss_parallel, full_tensor()
        with loss_parallel():
            loss_sum += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum",
                                        ignore_index=IGNORE_INDEX).full_tensor()
        tokens += (y != IGNORE_INDEX).sum()  # padding samples have no targets
    # Each replica saw only its share of the split: add up the loss sums and token counts of
    # all replicas before dividing, so the result equals the single-GPU loss exactly.
    # DONE 33: over the data-parallel group
    loss_sum, tokens = all_reduce_sum(loss_sum, dp_group), all_reduce_sum(tokens, dp_group)
    model.reshard()  # FSDP frees the root's gathered weights after backward; evaluation has none
    model.train()
    return (loss_sum / tokens).item()


if __name__ == "__main__":
    main()
