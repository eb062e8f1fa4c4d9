"""Make one GPU fast: measure, profile, then fix. The performance step of the course.

As shipped, this script is the finished DDP step with every speed-up taken out: plain fp32, as
PyTorch computes by default. On an H100 that is about 80,000 tokens/s for the workshop model,
4 % of what the GPU's bf16 tensor cores could do. Do the TODOs in order (41 to 47 here, 48 in
perf_training.sbatch, then 59 to 63): first measure (tokens/s and MFU while training), then look
(a torch.profiler trace, NVTX ranges for Nsight Systems), then apply the fixes one at a time and
watch each in the numbers: TF32 and bf16 (TODO 45), the fused AdamW (TODO 46), torch.compile
(TODO 47), and a bigger batch (--batch-size, no code). Then the fixes the fastest trainings of
models this size use (llm.c, torchtitan): read from the profile whether the GPU waits for Python
(TODO 59), a vocabulary padded to a multiple of 64 (TODO 60), the loss compiled too (TODO 61),
no DDP for one process (TODO 62), and CUDA graphs (TODO 63). docs/performance.md has the
numbers to expect; benchmarks/bench_perf_ladder.py measures every fix in one run. Check your
work at any moment with
    python check.py perf    # runs your file: per TODO ok, not started, or what to fix
    diff -u train/perf_training.py solutions/train/perf_training.py

Run it (one GPU is enough; a laptop CPU runs it too, slowly, and has no TF32):
    python train/perf_training.py --preset tiny --max-steps 30                   # laptop CPU
    sbatch perf_training.sbatch --precision fp32 --max-steps 200                 # one GPU
    sbatch perf_training.sbatch --precision fp32 --max-steps 200 --profile       # after TODO 43
    sbatch perf_training.sbatch --precision bf16 --max-steps 200                 # after TODO 45
    sbatch perf_training.sbatch --precision bf16 --compile --batch-size 128 --max-steps 200
    sbatch perf_training.sbatch --compile --compile-mode reduce-overhead --max-steps 200  # TODO 63
    sbatch perf_training.sbatch --compile --batch-size 128 --dropout 0 --max-steps 200  # see below
    NSYS=1 sbatch perf_training.sbatch --max-steps 50                   # after the TODO in the sbatch: nsys
Open OUT_DIR/profile/*.pt.trace.json in https://ui.perfetto.dev (or TensorBoard's profiler).
At batch 128 the matmuls run almost as fast as the GPU can; about half of the step is then
kernels that read and write memory (layer norms, GELU, dropout, softmax). --dropout 0, as the
record runs of GPT-2 train, drops the dropout kernels: +4 to 8 % on an H200, but WikiText-2
is small, so watch the validation loss (docs/performance.md, "Where the rest of the step
goes").
"""

import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from model import TransformerLM, get_config
from utils.args import base_parser, positive_int
from utils.checks import claim_out_dir, stop_if_not_finite
from utils.data import (IGNORE_INDEX, DistributedEvalSampler, TokenWindows, check_splits,
                        load_corpus_or_exit, pad_batch)
from utils.distributed_utils import (all_reduce_mean, all_reduce_sum, destroy_process_group,
                                     print0, save0, setup)
from utils.metrics import (Throughput, flops_per_token, peak_memory_text, perplexity, speed_text,
                           training_summary, write_summary)
from utils.monitor import TrainingMonitor, planned_steps
from utils.precision import set_precision
# TODO 41: Import what measuring, profiling and the fixes need: from utils/metrics.py,
# synchronize (time the GPU honestly) and peak_flops (what MFU divides by); torch.profiler;
# contextlib (for ranges made of several context managers); DeviceType from torch.autograd
# (which device a profiled event ran on, TODO 59); and from utils/precision.py, autocast and
# compile_blocks. (Adding names to the import lines already there is as good.)


# TODO 43: A bounded profiling window. The profiler skips `wait` steps (the first steps
# allocate memory and, with --compile, compile), runs `warmup` steps without recording (its own
# start-up cost), then records `active` steps and writes one trace per rank into
# OUT_DIR/profile (one file per rank: the profiler's trace handler takes a worker name). A run
# shorter than the window records a partial step plus the evaluation, or nothing if it ends
# while warming up: shrink the window to fit the run's steps, or say that nothing can be
# profiled (a run too short for anything to be worth looking at).


# TODO 44: Named ranges for the phases of a step. record_function puts them into the
# profiler's trace; on a GPU, NVTX ranges put them into an Nsight Systems timeline (nsys), next
# to the kernels and NCCL calls they launched. (On an AMD GPU the ROCm build of PyTorch sends
# the same torch.cuda.nvtx calls to ROCTX, which rocprofv3 --marker-trace records.) On a CPU
# there is no NVTX: only the first.


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# TODO 59: Is the GPU waiting for Python? In the profiled steps, compare the time the GPU's
# kernels took with the time each step took on the CPU (the ProfilerStep ranges). When the
# kernels fill only part of a step, the GPU waits for Python to launch the next ones: the step
# is bound by launches, and making kernels faster (compile) gains little, fewer launches
# (bigger batches, CUDA graphs, TODOs 62-63) a lot. In key_averages() every kernel has a row of
# its own, on the GPU (device_type CUDA), and its time is added again to the row of the CPU
# operator that launched it; ranges (ProfilerStep, record_function) get a row on the GPU too
# (is_user_annotation). So sum the device time of the rows that ran on the GPU and are no
# range: the kernels, once (as the table's "Self CUDA time total" does).
# Write gpu_busy(profiler): (kernel ms per step, step ms); the kernel time is 0 on a CPU.


# TODO 60: A vocabulary padded to a multiple of 64. The output layer is a matmul of width
# vocab_size; tensor cores read their operands in aligned tiles, and a width like WikiText-2's
# 33,278 (not a multiple of 8) sends the largest matmul of the model to slower kernels. The
# extra rows are never a target: training pushes their logits down, and they cost 2 of every
# 33,280 columns. Write padded_vocab(vocab_size, multiple) (llm.c and nanoGPT pad to 64 and 128).


def parse_args():
    parser = base_parser(__file__, __doc__)
    # TODO 43: An option to profile.
    # TODO 60: --pad-vocab N (default 64; 1 turns padding off).
    # TODO 63: --compile-mode, torch.compile's mode (reduce-overhead: CUDA graphs).
    return parser.parse_args()


def main():
    args = parse_args()
    out_dir = Path(args.out_dir)
    start_time = time.time()

    local_rank, rank, device, world_size = setup(args.seed, args.device)
    claim_out_dir(args)  # writable, this run's alone, no earlier results overwritten unasked
    # TODO 45: Honour --precision (auto: bf16 on a GPU that has it). set_precision also turns
    # the TF32 switch on for tf32: fp32 tensors, but matmuls on the tensor cores with 10-bit
    # mantissas. bf16 needs more: autocast around the forward pass and the loss (below).
    args.precision = set_precision("fp32", device)

    # ---- data ----
    corpus = load_corpus_or_exit(args.dataset, args.data_dir, args.cache_dir, warn=print0,
                                 max_vocab=args.max_vocab)
    # TODO 60: the model's vocabulary: padded_vocab(corpus.vocab_size, args.pad_vocab)
    cfg = get_config(args.preset, vocab_size=corpus.vocab_size, max_seq_len=args.seq_len,
                     dropout=args.dropout, n_layers=args.n_layers)
    check_splits(corpus, cfg.max_seq_len, args.batch_size, world_size)
    train_ds, val_ds, test_ds = (TokenWindows(tokens, cfg.max_seq_len)
                                 for tokens in (corpus.train, corpus.valid, corpus.test))
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
    flops_per_tok = flops_per_token(model.num_params(exclude_embeddings=True), cfg.n_layers,
                                    cfg.d_model, cfg.max_seq_len)
    print0(f"data: {corpus.source}, vocabulary {corpus.vocab_size}, {len(train_ds)} training "
           f"windows of {cfg.max_seq_len} tokens; model: {args.preset}, "
           f"{model.num_params() / 1e6:.1f}M parameters; world size {world_size}; "
           f"precision {args.precision}")
    # TODO 47: With --compile, compile the Transformer blocks (compile_blocks): the first steps
    # get slower (compilation), the later ones faster (fused kernels, less memory traffic).
    # TODO 61: The loss too: the output layer's logits are the largest activation of the
    # model (batch x sequence x vocabulary), and cross_entropy reads and writes them several
    # times (float32 copy, log-softmax, its gradient). Compiled, these fuse into fewer passes
    # (torchtitan compiles its loss the same way). With --compile, loss_fn is
    # torch.compile(lm_loss).
    loss_fn = lm_loss
    # TODO 62: One process has no one to average gradients with, but DDP would still copy
    # every gradient into its buckets and launch an all-reduce per bucket: time the GPU then
    # waits for, when the step is bound by launches (TODO 59). Wrap only when world_size > 1.
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    # TODO 63: CUDA graphs. A step bound by launches (TODO 59) waits for Python to launch
    # hundreds of kernels; torch.compile's mode "reduce-overhead" records each compiled piece's
    # kernels once as a CUDA graph and then replays it with one launch. With --compile and a
    # --compile-mode other than default, compile the blocks and the loss again in that mode
    # (compile_blocks(model, mode) takes DDP's wrapper too; torch.compile(..., mode=...)):
    # compiling happens at the first step, so the last call before it counts.
    # TODO 46: The fused AdamW updates all parameters in one GPU kernel instead of several
    # kernels per parameter; for a small model, the default spends much of a step launching them.
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    # with --compile the first steps compile (and, in reduce-overhead mode, record CUDA graphs):
    # not timed
    throughput = Throughput(device, warmup_steps=3 if args.compile else 1)
    # Live metrics to TensorBoard or wandb and the log line (utils/monitor.py, docs/monitoring.md)
    monitor = TrainingMonitor(args, out_dir, model, optimizer, throughput, flops_per_tok,
                              planned_steps(args, train_loader))

    # TODO 42: Measure while training: the peak FLOP/s of this device in the dtype the matmuls
    # run in (the data sheet of a known GPU, else a measured matmul), to turn tokens/s into MFU.
    # peak_flops returns a tuple, (peak, where it comes from): print both once, the peak with 3
    # significant digits, so that the log says what MFU divides by.
    # TODO 43: Start the profiler with a window that fits into the steps this run will take.

    # ---- training ----
    loss_history, step, best_val, val_loss = [], 0, math.inf, math.nan
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        first_step = step
        # TODO 42: tokens since the last report, and when that interval started
        for x, y in monitor.batches(train_loader):  # (times the wait for each batch)
            if step == args.max_steps:
                break
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            # TODO 44: Name the phases: forward (with the loss), backward, optimizer step, and
            # the communication of the loss. (DDP's gradient all-reduce runs inside backward,
            # overlapped with it: the trace shows it on its own stream.)
            # TODO 45: For bf16, run the forward pass and the loss under autocast(args.precision,
            # device): the weights stay fp32, the matmuls run in bf16.
            logits = model(x)
            loss = loss_fn(logits, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            throughput.step(x.numel() * world_size)
            # TODO 44: communication
            step_loss = all_reduce_mean(loss.detach())
            loss_history.append(step_loss)
            # TODO 43: Tell the profiler that a step is done.
            # TODO 42: Report tokens/s and MFU of the last interval with the loss. A GPU runs
            # behind the Python code: synchronize before reading the clock, or the time is only
            # how long it took to queue the work. (The monitor's line below measures the same
            # way, in utils/monitor.py: your numbers should agree with it.)
            if step % args.log_every == 0:
                # The loss is read here anyway: checking it every step would wait for the GPU
                # every step. Validation checks it again before any save.
                stop_if_not_finite(step_loss, step)
                # TODO 42: the report
                print0(f"epoch {epoch} {monitor.report(step, step_loss)}")

        throughput.pause()  # evaluation time is not training time
        val_loss = evaluate(model, val_loader, device)
        stop_if_not_finite(val_loss, step, "validation loss")  # before the saves below
        train_loss = torch.stack(loss_history[first_step:]).mean().item() if step > first_step \
            else math.nan
        print0(f"epoch {epoch} train loss {train_loss:.4f} validation loss {val_loss:.4f} "
               f"perplexity {perplexity(val_loss):.1f}")
        monitor.log_epoch(step, val_loss, train_loss)
        if val_loss < best_val:
            best_val = val_loss
            save0(model, out_dir / "best_model.pt")
        if step == args.max_steps:
            break
    # TODO 43: Stop the profiler (a run that ends early still writes what it has recorded) and
    # print the operators that took the most time: the first place to look. Sort the table by
    # the time each operator itself took on the device that ran it: on a GPU its kernels' time
    # (the CPU side only launches them), on a CPU its CPU time.
    # TODO 59: print how busy the GPU was in the profiled steps (gpu_busy, for the profiler's
    # active steps); on a CPU say that there is no GPU to compare with.

    # ---- evaluation, saving, summary ----
    test_loss = evaluate(model, test_loader, device)
    summary = training_summary(
        args, cfg, corpus, world_size=world_size, steps=step, loss_history=loss_history,
        val_loss=val_loss, test_loss=test_loss, throughput=throughput,
        flops_per_token=flops_per_tok, device=device, start_time=start_time,
        compile=args.compile, memory=monitor.memory)
    print0(f"test loss {test_loss:.4f} perplexity {summary['test_ppl']:.1f}; in "
           f"{summary['precision']}: {speed_text(summary)}, {peak_memory_text(summary, device)}")
    save0(model, out_dir / "final_model.pt")
    write_summary(out_dir, summary, vocab=corpus.vocab)  # and vocab.txt (tools/generate.py)
    monitor.close(summary)
    del model, optimizer
    destroy_process_group()


@torch.no_grad()
def evaluate(model, loader, device):
    """Token-weighted mean loss over a whole split."""
    # No autocast here: the loss of the fp32 weights, comparable between --precision settings.
    # And no compiled code: evaluation is not timed, and CUDA graphs (TODO 63) keep a block's
    # output in memory that the next block's replay overwrites when no backward runs between.
    with torch.compiler.set_stance("force_eager"):
        return evaluate_eagerly(model, loader, device)


def evaluate_eagerly(model, loader, device):
    model.eval()
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    tokens = torch.zeros((), device=device, dtype=torch.float64)
    for x, y in loader:
        # one shape for every batch: compiled blocks (--compile) compile evaluation once
        x, y = pad_batch(x.to(device), y.to(device), loader.batch_size)
        logits = model(x)
        loss_sum += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum",
                                    ignore_index=IGNORE_INDEX)
        tokens += (y != IGNORE_INDEX).sum()
    loss_sum, tokens = all_reduce_sum(loss_sum), all_reduce_sum(tokens)
    model.train()
    return (loss_sum / tokens).item()


if __name__ == "__main__":
    main()
