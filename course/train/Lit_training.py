"""Train the course's Transformer LM with PyTorch Lightning: the DDP lesson, done by a Trainer.

This file has no TODOs: train/Lit_training.py and solutions/train/Lit_training.py are the same
file. Read it next to solutions/train/to_distributed_training.py to see which of the DDP lesson's
steps Lightning takes over (docs/lightning.md has the list). The network, loss and optimizer are
in utils/lit_model.py, the data loaders in utils/lit_data.py.

Run it:
    python train/Lit_training.py --preset tiny --max-steps 50      # laptop: 2 CPU processes, DDP
    python train/Lit_training.py --preset tiny --devices 1 --overwrite         # one process
    python train/Lit_training.py --preset tiny --strategy fsdp2 --overwrite    # FSDP2 (ModelParallelStrategy)
    sbatch Lit_training.sbatch                                     # nodes and GPUs from Slurm
Outside Slurm, Lightning starts the processes itself. Under srun it starts none: every Slurm task
is one training process, and the nodes and processes per node come from the job.
A requeued job continues from its newest complete checkpoint by itself (as --resume auto does);
--checkpoint-every bounds the steps lost when a job dies without warning:
    python train/Lit_training.py --preset tiny --max-steps 100 --checkpoint-every 10 --resume auto
"""

import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from functools import partial
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_only
from torch.distributed.fsdp import fully_shard

from model import get_config
from utils.args import base_parser, positive_int
from utils.checks import claim_out_dir, stop_if_a_loss_was_not_finite, stop_if_not_finite
from utils.data import check_splits, load_corpus_or_exit
from utils.distributed_utils import TIMEOUT, destroy_process_group, warn_if_slurm_gpus_are_unused
from utils.launch import check_launch_environment
from utils.lit_checkpoints import AtomicCheckpointIO, RandomStates, resume_path
from utils.lit_data import WikiText2DataModule
from utils.lit_model import LitTransformerLM
from utils.metrics import (FINAL_METRICS, Throughput, flops_per_token, perplexity, speed_text,
                           training_summary, write_summary)
from utils.monitor import TrainingMonitor
from utils.precision import compile_blocks, lightning_precision, set_precision

# Lightning's rank_zero_only is the DDP lesson's print0; it knows the rank before any process group.
print0 = rank_zero_only(partial(print, flush=True))
# Off the cluster --num-workers is 0 on purpose (the windows are in memory): no warning for that.
warnings.filterwarnings("ignore", ".*does not have many workers.*")
# Resuming in the middle of an epoch is exact here: the data module skips the batches trained.
warnings.filterwarnings("ignore", ".*resuming from a checkpoint that ended before the epoch.*")


def parse_args():
    parser = base_parser(__file__, __doc__)
    lit = parser.add_argument_group("Lightning")
    lit.add_argument("--strategy", choices=["ddp", "fsdp2"], default="ddp",
                     help="ddp, or fsdp2: fully_shard through Lightning's ModelParallelStrategy")
    lit.add_argument("--accelerator", choices=["auto", "cpu", "gpu"], default=None,
                     help="default from --device: GPUs when there are any, else the CPU")
    lit.add_argument("--devices", type=positive_int, default=None,
                     help="processes per node (default: Slurm's tasks per node, else every GPU, "
                          "else 2 CPU processes)")
    lit.add_argument("--num-nodes", type=positive_int, default=None,
                     help="nodes (default: the nodes of the Slurm job step, else 1)")
    lit.add_argument("--checkpoint-every", type=positive_int, default=None, metavar="STEPS",
                     help="also save OUT_DIR/checkpoints/step=N.ckpt every STEPS steps (the "
                          "newest only): what a job that dies without warning continues from")
    lit.add_argument("--resume", metavar="CKPT|auto",
                     help="continue from this .ckpt, or auto: from the newest complete one in "
                          "OUT_DIR. A requeued job always does auto")
    args = parser.parse_args()
    if args.max_steps == 0:  # Trainer(max_steps=0) fits nothing and then has no validation loss
        parser.error("argument --max-steps: 0 (only evaluate) works in the plain scripts, not "
                     "in the Lightning variant: give at least 1")
    return args


def slurm_layout() -> tuple[int, int] | None:
    """(nodes, processes per node) when srun started this process, else None.

    Lightning's SLURM convention: srun starts one task per GPU (`--ntasks-per-node` = GPUs per
    node) and each task is one training process, so Lightning launches nothing itself. Lightning
    checks that devices and num_nodes agree with the job: we take them from the job.
    """
    if not SLURMEnvironment.detect():  # no srun (or an interactive job named bash/interactive)
        return None
    if "SLURM_STEP_NUM_TASKS" not in os.environ:  # srun sets it; the batch script has no step
        sys.exit(f"error: this process runs in Slurm job {os.environ.get('SLURM_JOB_ID')} but "
                 "srun did not start it, so it would wait for tasks that never come: start it "
                 "with srun (as Lit_training.sbatch does)")
    if "SLURM_NTASKS_PER_NODE" not in os.environ:
        sys.exit("error: start the training tasks with --ntasks-per-node=<GPUs per node> "
                 "(Lightning's SLURM convention), not --ntasks")
    return int(os.environ["SLURM_NNODES"]), int(os.environ["SLURM_NTASKS_PER_NODE"])


def trainer_settings(args) -> dict:
    """accelerator, devices, num_nodes, strategy, precision and cluster plugin for this run."""
    accelerator = args.accelerator or {"auto": "auto", "cpu": "cpu", "cuda": "gpu"}[args.device]
    use_gpu = accelerator == "gpu" or (accelerator == "auto" and torch.cuda.is_available())
    if accelerator == "auto" and not use_gpu and os.environ.get("SLURM_PROCID", "0") == "0":
        warn_if_slurm_gpus_are_unused()  # a CPU-only torch in a GPU job: say so once
    # auto: bf16 on a GPU that has it, else fp32; Lightning's "bf16-mixed" is autocast with fp32
    # weights, like the plain scripts (see utils/precision.py)
    args.precision = set_precision(args.precision, torch.device("cuda" if use_gpu else "cpu"))
    layout = slurm_layout()
    if layout is not None:
        num_nodes, devices = layout
        # SIGUSR1 (sbatch --signal=SIGUSR1@90) before the time limit: RequeueAtTimeLimit saves
        # a checkpoint in default_root_dir and requeues the job, which resumes from it.
        # (Not Lightning's own auto_requeue: see RequeueAtTimeLimit.)
        plugins = [SLURMEnvironment(auto_requeue=False)]
    else:
        num_nodes, devices, plugins = 1, (torch.cuda.device_count() if use_gpu else 2), []
    num_nodes, devices = args.num_nodes or num_nodes, args.devices or devices
    if args.strategy == "fsdp2":
        # Every process is one data-parallel rank: say so, or ModelParallelStrategy's default
        # makes the processes of a node a tensor-parallel group that all read the same batches.
        # save_distributed_checkpoint=False: one .ckpt file, written atomically like DDP's
        # (Lightning writes its sharded folders in place: a kill leaves half a folder).
        strategy = ModelParallelStrategy(data_parallel_size=num_nodes * devices,
                                         tensor_parallel_size=1, timeout=TIMEOUT,
                                         save_distributed_checkpoint=False)
    else:
        # timeout: a missing or stuck process fails the others after DIST_TIMEOUT_MINUTES
        strategy = DDPStrategy(timeout=TIMEOUT)
    # Checkpoints written atomically: a kill or a full disk never leaves a truncated .ckpt.
    plugins.append(AtomicCheckpointIO())
    return dict(accelerator=accelerator, devices=devices, num_nodes=num_nodes, strategy=strategy,
                precision=lightning_precision(args.precision), plugins=plugins)


def apply_fsdp(model, device_mesh) -> None:
    """FSDP2, as in the FSDP step: each block is one unit (its weights are gathered just before
    it runs and freed after), then the root takes the embeddings, final norm and output layer."""
    mesh = device_mesh["data_parallel"]
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


class RequeueAtTimeLimit(Callback):
    """SIGUSR1 before the Slurm time limit: save OUT_DIR/hpc_ckpt_N.ckpt and requeue the job,
    which starts again with the same job id and OUT_DIR, and Lightning resumes from that file.

    Lightning's SLURMEnvironment(auto_requeue=True) does the same from inside the signal
    handler, which each rank runs at another point of its step: with two or more ranks the
    checkpoint's collectives meet the step's and the job hangs until its time limit (measured
    on a real Slurm, see docs/reliability.md; Lightning-AI/pytorch-lightning#21406). Here the
    handler only notes the signal; after every step the ranks agree whether any got it, then
    all save together, and rank 0 runs `scontrol requeue` (Slurm then ends this run).
    """

    def __init__(self):
        self.signalled = False

    def on_fit_start(self, trainer, pl_module):
        signal.signal(signal.SIGUSR1, self._note)

    def _note(self, signum, frame):
        self.signalled = True  # (DataLoader workers inherit this handler: harmless)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not trainer.strategy.reduce_boolean_decision(self.signalled, all=False):
            return
        self.signalled = False
        path = trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)
        trainer.save_checkpoint(path)
        if trainer.is_global_zero:
            job = os.environ["SLURM_JOB_ID"]
            print(f"SIGUSR1 before the time limit: saved {path} at step {trainer.global_step}, "
                  f"requeueing job {job}", flush=True)
            subprocess.run(["scontrol", "requeue", job], check=False)


class LightningLogs:
    """The monitor's metrics (utils/monitor.py) through the Trainer's logger, under the plain
    scripts' names. Lightning logs the training and validation loss itself (LitTransformerLM),
    one step earlier on its x-axis (it counts the steps before the current one): so do we."""

    OWN = {"train/loss", "val/loss", "val/ppl"}

    def __init__(self, trainer, args):
        self.trainer = trainer
        if trainer.logger:  # the flags into the HParams view (TensorBoard) or config (wandb)
            trainer.logger.log_hyperparams(vars(args), {k: float("nan") for k in FINAL_METRICS}
                                           if isinstance(trainer.logger, TensorBoardLogger) else None)

    def log(self, metrics: dict, step: int) -> None:
        if self.trainer.logger:
            self.trainer.logger.log_metrics({k: v for k, v in metrics.items() if k not in self.OWN},
                                            step=step - 1)

    def finish(self, results: dict, step: int) -> None:
        self.log(results, step)
        if isinstance(self.trainer.logger, WandbLogger) and self.trainer.is_global_zero:
            self.trainer.logger.experiment.summary.update(results)

    def close(self) -> None:
        pass  # Lightning closes its logger


class CourseLog(Callback):
    """What the plain scripts print and report: one `setup:` line per process, every --log-every
    steps the monitor's line and metrics (utils/monitor.py: tokens/s, MFU, memory, gradient norm,
    ...), validation results, and the loss history and tokens/s for summary.json.

    Its state is saved in Lightning's checkpoints, so a requeued job continues the loss history.
    (Lightning's ThroughputMonitor would synchronize the GPU after every batch: docs/lightning.md.)
    """

    def __init__(self, args, flops_per_token: float):
        self.args, self.flops_per_token = args, flops_per_token
        self.log_every, self.loss_history, self.throughput = args.log_every, [], None
        self.monitor, self.batch_end = None, None

    def setup(self, trainer, pl_module, stage):
        if stage == "fit" and trainer.world_size > 1:
            # One line per process, so a log shows at once which ranks started where.
            print(f"setup: rank {trainer.global_rank}/{trainer.world_size} local_rank "
                  f"{trainer.local_rank} host {socket.gethostname()} device {pl_module.device} "
                  f"backend {trainer.strategy.process_group_backend} "
                  f"MASTER_ADDR={os.environ.get('MASTER_ADDR')} "
                  f"MASTER_PORT={os.environ.get('MASTER_PORT')}", flush=True)

    def on_train_start(self, trainer, pl_module):
        self.throughput = Throughput(pl_module.device)
        self.monitor = TrainingMonitor(self.args, trainer.default_root_dir, pl_module.model,
                                       trainer.optimizers[0], self.throughput,
                                       self.flops_per_token, trainer.estimated_stepping_batches,
                                       logger=LightningLogs(trainer, self.args))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.batch_end is not None:  # the time since the last step: fetching this batch
            self.monitor.waited(time.perf_counter() - self.batch_end)
        self.monitor.watch_memory(batch)  # the memory breakdown of the first step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = trainer.callback_metrics["train/loss"]  # logged with sync_dist: the mean over ranks
        self.loss_history.append(loss.detach().clone())
        self.throughput.step(batch[0].numel() * trainer.world_size)
        step = trainer.global_step
        stop_if_not_finite(loss, step)  # (on a GPU read at log steps: reading waits for it)
        if self.args.checkpoint_every and step % self.args.checkpoint_every == 0:
            stop_if_a_loss_was_not_finite()  # before Lightning saves this step's checkpoint
        if step % self.log_every == 0:
            print0(f"epoch {trainer.current_epoch} {self.monitor.report(step, loss)}")
        self.batch_end = time.perf_counter()
        if step == trainer.max_steps:
            # Stop here and validate the final weights, as the plain scripts do (without this,
            # Lightning would end at max_steps without validating).
            trainer.should_stop = True

    def on_validation_start(self, trainer, pl_module):
        if self.throughput is not None:
            self.throughput.pause()  # evaluation time is not training time
        self.batch_end = None

    def on_validation_end(self, trainer, pl_module):
        loss = trainer.callback_metrics["val/loss"].item()
        stop_if_not_finite(loss, trainer.global_step, "validation loss")  # ModelCheckpoint runs after
        print0(f"epoch {trainer.current_epoch} validation loss {loss:.4f} "
               f"perplexity {perplexity(loss):.1f}")
        if self.monitor is not None:
            self.monitor.log_epoch(trainer.global_step, loss)

    def state_dict(self):
        return {"loss_history": [float(v) for v in self.loss_history]}

    def load_state_dict(self, state_dict):
        self.loss_history = [float(v) for v in state_dict["loss_history"]]


def fit_or_exit(trainer, lit_model, data, ckpt_path) -> None:
    """trainer.fit, but processes that do not find each other (a task that never started, a
    wrong MASTER_ADDR) end with one line instead of a traceback."""
    try:
        trainer.fit(lit_model, datamodule=data, ckpt_path=ckpt_path)
    except (torch.distributed.DistStoreError, torch.distributed.DistNetworkError) as e:
        reason = str(e).strip().splitlines()[0][:200]
        sys.exit(f"error: process {trainer.global_rank} of {trainer.world_size} could not reach "
                 f"the other processes at MASTER_ADDR:MASTER_PORT {os.environ.get('MASTER_ADDR')}:"
                 f"{os.environ.get('MASTER_PORT')} within DIST_TIMEOUT_MINUTES ({reason}): start "
                 "every task with srun (as Lit_training.sbatch does), or raise DIST_TIMEOUT_MINUTES")


def main():
    args = parse_args()
    out_dir = Path(args.out_dir)
    check_launch_environment(rank_variables=False)  # DIST_TIMEOUT_MINUTES not a number: one line
    claim_out_dir(args)  # writable, this run's alone, no earlier results overwritten unasked
    start_time = time.time()
    L.seed_everything(args.seed, verbose=False)  # the same weights on every rank (and as plain)

    # ---- data ----
    corpus = load_corpus_or_exit(args.dataset, args.data_dir, args.cache_dir, warn=print0,
                                 max_vocab=args.max_vocab)
    cfg = get_config(args.preset, vocab_size=corpus.vocab_size, max_seq_len=args.seq_len,
                     dropout=args.dropout, n_layers=args.n_layers)
    data = WikiText2DataModule(corpus, cfg.max_seq_len, args.batch_size, args.num_workers, args.seed)

    # ---- model (and, inside it, loss and optimizer) ----
    lit_model = LitTransformerLM(cfg, args.lr, args.weight_decay,
                                 parallelize=apply_fsdp if args.strategy == "fsdp2" else None)
    flops_per_tok = flops_per_token(lit_model.model.num_params(exclude_embeddings=True),
                                    cfg.n_layers, cfg.d_model, cfg.max_seq_len)
    if args.compile:
        compile_blocks(lit_model.model)

    # ---- trainer: processes, process group, DDP/FSDP2, devices, logging, checkpoints ----
    settings = trainer_settings(args)
    check_splits(corpus, cfg.max_seq_len, args.batch_size,
                 settings["num_nodes"] * settings["devices"])
    print0(f"data: {corpus.source}, vocabulary {corpus.vocab_size}, {len(data.train_ds)} training "
           f"windows of {cfg.max_seq_len} tokens; model: {args.preset}, "
           f"{lit_model.model.num_params() / 1e6:.1f}M parameters; world size "
           f"{settings['num_nodes'] * settings['devices']}; strategy {args.strategy}")
    if args.logger == "tensorboard":  # the plain scripts' layout: OUT_DIR/tensorboard
        logger = TensorBoardLogger(out_dir, name="tensorboard", version="", default_hp_metric=False)
    elif args.logger == "wandb":  # offline: compute nodes have no internet (`wandb sync` later)
        os.environ.setdefault("WANDB_CACHE_DIR", str(out_dir / "wandb-cache"))
        logger = WandbLogger(project="distributed-training-course", name=out_dir.name,
                             save_dir=str(out_dir), offline=True)
    else:
        logger = False
    course_log = CourseLog(args, flops_per_tok)
    under_srun = any(isinstance(p, SLURMEnvironment) for p in settings["plugins"])
    requeue = [RequeueAtTimeLimit()] if under_srun else []
    # Checkpoints by Lightning: the best validation loss and the last state (with the optimizer).
    checkpoints = ModelCheckpoint(dirpath=out_dir / "checkpoints", monitor="val/loss", mode="min",
                                  save_last=True)
    # With --checkpoint-every: the newest of them, every that many steps (it replaces the last).
    periodic = [ModelCheckpoint(dirpath=out_dir / "checkpoints", filename="{step}",
                                every_n_train_steps=args.checkpoint_every, save_top_k=1)
                ] if args.checkpoint_every else []
    trainer = L.Trainer(
        **settings, max_epochs=args.epochs,
        max_steps=-1 if args.max_steps is None else args.max_steps,
        default_root_dir=out_dir,  # where a requeued job finds its checkpoint (hpc_ckpt_*.ckpt)
        logger=logger, log_every_n_steps=args.log_every,
        # RandomStates: every rank's random-number states in each checkpoint (exact resume)
        callbacks=[course_log, checkpoints, *periodic, RandomStates(), *requeue],
        use_distributed_sampler=False,  # the data module shards (see utils/lit_data.py)
        # the progress bar in a terminal only: in a batch job's log it is a line per refresh
        num_sanity_val_steps=0, enable_progress_bar=sys.stdout.isatty())

    # ---- training, evaluation ----
    # A requeued job (or --resume) continues from the newest complete, undamaged checkpoint.
    ckpt_path = resume_path(args.resume, out_dir, say=print0, rank_0=rank_zero_only.rank == 0)
    fit_or_exit(trainer, lit_model, data, ckpt_path)
    if "val/loss" not in trainer.callback_metrics:  # resumed at --max-steps: fit trained nothing
        trainer.validate(lit_model, datamodule=data, ckpt_path=ckpt_path, verbose=False)
    val_loss = trainer.callback_metrics["val/loss"].item()
    loss_history = list(course_log.loss_history)
    # Test the final weights: Lightning's last checkpoint (saved after the final validation).
    # Without a ckpt_path, test() under Slurm would reload the requeue checkpoint, if there is one.
    last = checkpoints.last_model_path
    if not last:  # resumed at --max-steps: fit saved nothing; a finished run still has its last
        last = str(out_dir / "checkpoints" / "last.ckpt")
        trainer.save_checkpoint(last)
    trainer.test(lit_model, datamodule=data, ckpt_path=last, verbose=False)
    test_loss = trainer.callback_metrics["test/loss"].item()

    # ---- summary (root process only, once, at the very end) ----
    summary = training_summary(
        args, cfg, corpus, world_size=trainer.world_size, steps=trainer.global_step,
        loss_history=loss_history, val_loss=val_loss, test_loss=test_loss,
        # (no Throughput if fit trained nothing: resumed at --max-steps)
        throughput=course_log.throughput or Throughput(trainer.strategy.root_device),
        flops_per_token=flops_per_tok,
        # the device it trained on: after test() Lightning has moved lit_model back to the CPU
        device=trainer.strategy.root_device,
        start_time=start_time, strategy=args.strategy, num_nodes=trainer.num_nodes,
        devices=trainer.num_devices, best_checkpoint=checkpoints.best_model_path,
        memory=course_log.monitor.memory)  # the breakdown after the first step (utils/memory.py)
    print0(f"test loss {test_loss:.4f} perplexity {summary['test_ppl']:.1f}; "
           f"{speed_text(summary)}")
    write_summary(out_dir, summary, vocab=corpus.vocab)  # and vocab.txt (tools/generate.py)
    course_log.monitor.close(summary)
    # Lightning would destroy the process group at exit; doing it here, after freeing the wrapped
    # model and a barrier (see utils/distributed_utils.py), avoids rare aborts at teardown.
    del trainer, lit_model
    destroy_process_group()


if __name__ == "__main__":
    main()
