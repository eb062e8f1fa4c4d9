"""The Lightning variant (train/Lit_training.py) computes what the plain-PyTorch course computes.

Real processes on CPU with gloo: Lightning's own launcher starts the 2 DDP/FSDP2 processes, as on a
laptop. Runs are tiny (tiny preset, synthetic corpus, 4 steps): Lightning's start-up dominates.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from conftest import ROOT, read_summary, run_script, script_env
from distributed import free_port
from model import ModelConfig, TransformerLM
from utils.data import IGNORE_INDEX, TokenWindows, load_corpus

pytest.importorskip("lightning")
from utils.lit_checkpoints import AtomicCheckpointIO  # noqa: E402 (needs lightning)

pytestmark = pytest.mark.warm_start  # runs forked warm: tests/warm_launch.py
LIT_SCRIPT = "train/Lit_training.py"
# --seq-len 31 gives the synthetic validation split 87 windows: odd, so with 2 ranks one rank
# evaluates a padding sample, and with --batch-size 8 the last batch is partial.
TINY = ("--dataset", "synthetic", "--preset", "tiny", "--seq-len", "31", "--dropout", "0",
        "--batch-size", "8", "--seed", "3")
RUN = (*TINY, "--max-steps", "4", "--log-every", "1")
STEPS = 4


def run_lightning(out_dir: Path, data_cache: Path, *args) -> dict:
    # No --devices: on a machine without GPUs the script's default is 2 CPU processes with DDP.
    run_script(LIT_SCRIPT, *RUN, "--accelerator", "cpu", "--out-dir", out_dir, *args,
               env=script_env(cache_dir=data_cache), timeout=240)
    return read_summary(out_dir)


@pytest.fixture(scope="module")
def lit_ddp(tmp_path_factory, data_cache):
    """One 2-process DDP run of the Lightning script, shared by the tests below."""
    out = tmp_path_factory.mktemp("lit_ddp")
    return out, run_lightning(out, data_cache)


def checkpoint_model(path: Path) -> TransformerLM:
    """A plain TransformerLM with the weights of a Lightning checkpoint."""
    ckpt = torch.load(path, weights_only=True)
    model = TransformerLM(ModelConfig(**ckpt["hyper_parameters"]["model_config"]))
    model.load_state_dict({k.removeprefix("model."): v for k, v in ckpt["state_dict"].items()})
    return model


@torch.no_grad()
def plain_loss(model: TransformerLM, tokens: torch.Tensor) -> float:
    """Token-weighted mean loss of a split, in one process, with no sampler at all."""
    model.eval()
    loss_sum, count = 0.0, 0
    for x, y in DataLoader(TokenWindows(tokens, model.cfg.max_seq_len), batch_size=64):
        loss_sum += F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum",
                                    ignore_index=IGNORE_INDEX).double().item()
        count += (y != IGNORE_INDEX).sum().item()
    return loss_sum / count


def tensorboard_scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


# ------------------------------------------------------------------------------ training runs
@pytest.mark.slow
def test_ddp_validation_loss_logged_by_lightning_equals_a_plain_evaluation_of_the_same_weights(
        lit_ddp, data_cache):
    out, summary = lit_ddp
    assert summary["world_size"] == 2 and summary["steps"] == STEPS
    assert len(summary["loss_history"]) == STEPS

    corpus = load_corpus("synthetic", cache_dir=data_cache)
    model = checkpoint_model(out / "checkpoints" / "last.ckpt")
    assert len(TokenWindows(corpus.valid, model.cfg.max_seq_len)) % 2 == 1  # padding is exercised
    val_loss, test_loss = plain_loss(model, corpus.valid), plain_loss(model, corpus.test)
    assert summary["val_loss"] == pytest.approx(val_loss, rel=1e-6, abs=0)
    assert summary["test_loss"] == pytest.approx(test_loss, rel=1e-6, abs=0)
    # TensorBoard, in the plain scripts' folder, got the same numbers. Lightning's x-axis counts
    # the steps before the current one: the last training loss and validation are at STEPS - 1.
    train_logged = tensorboard_scalars(out / "tensorboard", "train/loss")
    assert [step for step, _ in train_logged] == list(range(STEPS))
    assert [v for _, v in train_logged] == pytest.approx(summary["loss_history"], rel=1e-6)
    (step, logged), = tensorboard_scalars(out / "tensorboard", "val/loss")
    assert step == STEPS - 1
    assert logged == pytest.approx(val_loss, rel=1e-6, abs=0)
    (_, ppl), = tensorboard_scalars(out / "tensorboard", "val/ppl")
    assert ppl == pytest.approx(torch.tensor(val_loss).exp().item(), rel=1e-5)


@pytest.mark.slow
def test_lightning_ddp_trains_exactly_like_the_ddp_lesson_solution(lit_ddp, data_cache, tmp_path):
    _, lit = lit_ddp
    run_script("solutions/train/to_distributed_training.py", *RUN, "--logger", "none",
               "--out-dir", tmp_path, nproc=2, env=script_env(cache_dir=data_cache), timeout=180)
    plain = read_summary(tmp_path)
    # Same seed, same samplers, same AdamW: the same global batches and the same losses.
    assert lit["loss_history"] == pytest.approx(plain["loss_history"], rel=1e-5, abs=0)
    assert lit["val_loss"] == pytest.approx(plain["val_loss"], rel=1e-4, abs=0)
    assert lit["test_loss"] == pytest.approx(plain["test_loss"], rel=1e-4, abs=0)
    common = set(plain) - {"args"}
    assert common <= set(lit), f"summary.json lacks {common - set(lit)}"


@pytest.mark.slow
def test_fsdp2_through_model_parallel_strategy_trains_like_ddp(lit_ddp, data_cache, tmp_path):
    _, ddp = lit_ddp
    fsdp = run_lightning(tmp_path, data_cache, "--strategy", "fsdp2", "--logger", "none")
    assert fsdp["world_size"] == 2 and fsdp["strategy"] == "fsdp2"
    # Both ranks read different batches (data_parallel_size=2): otherwise the losses would differ.
    assert fsdp["loss_history"] == pytest.approx(ddp["loss_history"], rel=1e-5, abs=0)
    assert fsdp["val_loss"] == pytest.approx(ddp["val_loss"], rel=1e-4, abs=0)
    # One .ckpt file (gathered on rank 0), written atomically like DDP's: Lightning writes its
    # sharded folders in place, so a kill would leave half of one.
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
    torch.testing.assert_close(checkpoint_model(tmp_path / "checkpoints" / "last.ckpt")
                               .state_dict()["output.weight"],
                               checkpoint_model(lit_ddp[0] / "checkpoints" / "last.ckpt")
                               .state_dict()["output.weight"], rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------ no launching
def load_lit_script():
    spec = importlib.util.spec_from_file_location("lit_training", ROOT / LIT_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# What srun sets for task 5 of `sbatch --nodes=2 --ntasks-per-node=4` (node 1, local task 1).
SLURM_TASK_5_OF_2x4 = dict(
    SLURM_JOB_ID="4242", SLURM_JOB_NAME="Lit_training", SLURM_NNODES="2",
    SLURM_JOB_NUM_NODES="2", SLURM_NODELIST="node[1-2]", SLURM_JOB_NODELIST="node[1-2]",
    SLURM_NTASKS="8", SLURM_NPROCS="8", SLURM_NTASKS_PER_NODE="4", SLURM_TASKS_PER_NODE="4(x2)",
    SLURM_PROCID="5", SLURM_LOCALID="1", SLURM_NODEID="1", SLURM_CPUS_PER_TASK="8",
    SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS="8")


@pytest.fixture
def no_slurm(monkeypatch):
    for key in list(os.environ):
        if key.startswith(("SLURM_", "SBATCH_")):
            monkeypatch.delenv(key)
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def settings_for(monkeypatch, *argv):
    script = load_lit_script()
    monkeypatch.setattr(sys, "argv", [LIT_SCRIPT, *argv])
    return script, script.trainer_settings(script.parse_args())


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_a_task_of_a_two_node_four_task_per_node_job_derives_num_nodes_2_and_devices_4(
        no_slurm, strategy):
    import lightning as L
    from lightning.pytorch.plugins.environments import SLURMEnvironment
    for key, value in SLURM_TASK_5_OF_2x4.items():
        no_slurm.setenv(key, value)
    _, settings = settings_for(no_slurm, "--accelerator", "cpu", "--strategy", strategy)
    assert (settings["num_nodes"], settings["devices"]) == (2, 4)
    env, checkpoint_io = settings["plugins"]
    assert isinstance(checkpoint_io, AtomicCheckpointIO)
    # requeue by the script's RequeueAtTimeLimit, not by Lightning's signal handler
    assert isinstance(env, SLURMEnvironment) and not env.auto_requeue
    if strategy == "fsdp2":  # every process is a data-parallel rank
        assert settings["strategy"]._data_parallel_size == 8
        assert settings["strategy"]._tensor_parallel_size == 1

    # Lightning accepts the layout (it checks it against the job) and places this task in it;
    # building the Trainer starts no process and no process group.
    trainer = L.Trainer(**settings, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    assert (trainer.num_nodes, trainer.num_devices, trainer.world_size) == (2, 4, 8)
    assert (trainer.global_rank, trainer.local_rank, trainer.node_rank) == (5, 1, 1)
    assert trainer.strategy.cluster_environment is env
    assert not torch.distributed.is_initialized()


def test_without_slurm_the_script_runs_two_cpu_processes_on_one_node(no_slurm):
    _, settings = settings_for(no_slurm, "--accelerator", "cpu")
    assert (settings["num_nodes"], settings["devices"]) == (1, 2)
    assert [type(p) for p in settings["plugins"]] == [AtomicCheckpointIO]  # no cluster plugin
    _, settings = settings_for(no_slurm, "--accelerator", "cpu", "--devices", "1")
    assert settings["devices"] == 1


def test_a_job_started_with_ntasks_instead_of_ntasks_per_node_stops_with_one_clear_line(no_slurm):
    for key, value in SLURM_TASK_5_OF_2x4.items():
        if key != "SLURM_NTASKS_PER_NODE":
            no_slurm.setenv(key, value)
    with pytest.raises(SystemExit, match="--ntasks-per-node=<GPUs per node>"):
        settings_for(no_slurm, "--accelerator", "cpu")


def test_plain_pytorch_scripts_run_without_lightning_installed():
    # Make `import lightning` fail, as where it is not installed; the plain DDP script's imports
    # (model, utils) must all succeed: --help exits right after them.
    blocker = ("import sys, runpy; sys.modules['lightning'] = None; "
               "sys.modules['pytorch_lightning'] = None; "
               "sys.argv = ['train/to_distributed_training.py', '--help']; "
               "runpy.run_path('solutions/train/to_distributed_training.py', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", blocker], cwd=ROOT, env=script_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--max-steps" in proc.stdout
    # ...and the Lightning files are the only ones that import it.
    importers = {p.relative_to(ROOT).as_posix()
                 for folder in ("model", "utils", "course")
                 for p in (ROOT / folder).rglob("*.py")
                 if "import lightning" in p.read_text() or "from lightning" in p.read_text()}
    assert importers == {"utils/lit_model.py", "utils/lit_data.py",
                         "utils/lit_checkpoints.py", "course/train/Lit_training.py"}


# ------------------------------------------------------------------------------ auto-requeue
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigusr1_before_the_time_limit_saves_requeues_and_the_requeued_job_resumes(
        tmp_path, data_cache):
    """What `#SBATCH --signal=SIGUSR1@90` triggers, in a one-task 'job' (one process, so no
    other rank to wait for) with a stand-in `scontrol` that records the call and then kills the
    process, as Slurm's requeue does."""
    bin_dir, out = tmp_path / "bin", tmp_path / "run"
    bin_dir.mkdir()
    scontrol_log = tmp_path / "scontrol.log"
    (bin_dir / "scontrol").write_text('#!/bin/sh\necho "$@" >> "$SCONTROL_LOG"\nkill -KILL $PPID\n')
    (bin_dir / "scontrol").chmod(0o755)
    one_task_job = dict(
        SLURM_JOB_ID="4242", SLURM_JOB_NAME="Lit_training", SLURM_NNODES="1",
        SLURM_JOB_NUM_NODES="1", SLURM_NODELIST="localhost", SLURM_NTASKS="1",
        SLURM_NTASKS_PER_NODE="1", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0",
        SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
        PATH=f"{bin_dir}:{script_env()['PATH']}", SCONTROL_LOG=scontrol_log)
    env = script_env(cache_dir=data_cache, **one_task_job)
    cmd = [sys.executable, LIT_SCRIPT, *TINY, "--logger", "none", "--log-every", "1",
           "--accelerator", "cpu", "--out-dir", out]
    # A run far too long to finish: it is interrupted once it has trained two steps.
    first = subprocess.Popen([*map(str, cmd), "--max-steps", "100000"], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in first.stdout:
        lines.append(line)
        if line.startswith("epoch 0 step 2/"):
            first.send_signal(signal.SIGUSR1)
            break
    lines += first.stdout.readlines()
    assert first.wait(timeout=120) == -signal.SIGKILL, "".join(lines[-30:])
    assert scontrol_log.read_text().split() == ["requeue", "4242"]
    saved = torch.load(out / "hpc_ckpt_1.ckpt", weights_only=True)
    interrupted_at = saved["global_step"]
    assert interrupted_at >= 2

    # The requeued job: the same command, job id and OUT_DIR, and SLURM_RESTART_COUNT=1. It
    # resumes from the checkpoint (and this time stops 3 steps later).
    second = subprocess.run([*map(str, cmd), "--max-steps", str(interrupted_at + 3)], cwd=ROOT,
                            env={**env, "SLURM_RESTART_COUNT": "1"}, capture_output=True,
                            text=True, timeout=180)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert (f"Slurm restart 1: continuing from the newest complete checkpoint "
            f"{out / 'hpc_ckpt_1.ckpt'} (step {interrupted_at})") in second.stdout
    assert "Restored all states from the checkpoint" in second.stdout + second.stderr
    summary = read_summary(out)
    assert summary["steps"] == interrupted_at + 3
    # The loss history survived the requeue (CourseLog's state is in the checkpoint).
    history = summary["loss_history"]
    assert len(history) == interrupted_at + 3
    first_losses = [float(l.split(" loss ")[1].split()[0]) for l in lines
                    if l.startswith("epoch 0 step ")]
    assert history[:2] == pytest.approx(first_losses[:2], abs=1e-4)
    # The test split was evaluated on the final weights, not on those of the requeue checkpoint.
    final = checkpoint_model(out / "checkpoints" / "last.ckpt")
    assert torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == \
        interrupted_at + 3
    corpus = load_corpus("synthetic", cache_dir=data_cache)
    assert summary["test_loss"] == pytest.approx(plain_loss(final, corpus.test), rel=1e-6, abs=0)


# ------------------------------------------------------------------------------ the sbatch file
@pytest.fixture
def lit_sbatch(tmp_path):
    """Lit_training.sbatch run by bash, with stand-ins for scontrol, nslookup and srun (which
    records its arguments instead of starting anything)."""
    from test_sbatch import STUBS
    bin_dir, log, venv = tmp_path / "bin", tmp_path / "log", tmp_path / "venv"
    for d in (bin_dir, log, venv / "bin"):
        d.mkdir(parents=True)
    (venv / "bin" / "activate").write_text("")
    stubs = {**STUBS, "srun": 'printf "%s\\n" "$@" > "$FAKE_LOG/srun"'}
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)

    def submit(*args, nodes=("jrc0001", "jrc0002"), **env):
        full_env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("SLURM_", "MASTER_", "OMP_", "NPROC_"))}
        full_env.update(
            PATH=f"{bin_dir}:{os.environ['PATH']}", VENV=str(venv), FAKE_LOG=str(log),
            FAKE_NODES=" ".join(nodes), FAKE_DNS="jrc0001i=10.10.0.1",
            # what sbatch sets from the file's #SBATCH lines
            SLURM_SUBMIT_DIR=str(tmp_path), SLURM_JOB_NAME="Lit_training", SLURM_JOB_ID="4242",
            SLURM_JOB_NODELIST=",".join(nodes), SLURM_JOB_NUM_NODES=str(len(nodes)),
            SLURM_NTASKS_PER_NODE="4", SLURM_CPUS_PER_TASK="8", **env)
        proc = subprocess.run(["bash", str(ROOT / "Lit_training.sbatch"), *args], cwd=ROOT,
                              env=full_env, capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout, (log / "srun").read_text().splitlines()

    return submit


def test_the_sbatch_file_starts_one_python_task_per_gpu_with_srun(lit_sbatch):
    out, srun = lit_sbatch("--epochs", "1")
    assert "MASTER_ADDR=10.10.0.1 MASTER_PORT=24242" in out
    assert srun[:4] == ["--kill-on-bad-exit=1", "--ntasks-per-node=4", "--ntasks=8",
                        "--cpus-per-task=8"]
    assert srun[4:7] == ["python", "-u", "train/Lit_training.py"]  # no torchrun
    assert srun[-2:] == ["--epochs", "1"]


def test_on_cpu_only_nodes_the_task_count_comes_from_nproc_per_node(lit_sbatch):
    _, srun = lit_sbatch(NPROC_PER_NODE="2")
    assert srun[1:3] == ["--ntasks-per-node=2", "--ntasks=4"]


def test_the_sbatch_file_asks_for_sigusr1_before_the_time_limit_and_may_be_requeued():
    lines = [l for l in (ROOT / "Lit_training.sbatch").read_text().splitlines()
             if l.startswith("#SBATCH")]
    assert "#SBATCH --signal=SIGUSR1@90" in lines and "#SBATCH --requeue" in lines
    assert "#SBATCH --ntasks-per-node=4" in lines and "#SBATCH --gres=gpu:4" in lines
