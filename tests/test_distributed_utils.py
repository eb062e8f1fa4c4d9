"""The helpers of utils/distributed_utils.py, with and without a process group."""

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from conftest import ROOT, host_gpu_count
from distributed import run_distributed
from model import TransformerLM, get_config
from utils import distributed_utils as du
from utils.args import default_num_workers

TINY = get_config("tiny", vocab_size=30, max_seq_len=8, dropout=0.0)


def in_fresh_python(code: str, **env) -> str:
    """Run `code` in a new interpreter (setup() changes process-wide state)."""
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    full_env.update(env)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_helpers_work_in_a_plain_process_without_a_process_group(tmp_path, capsys):
    assert not dist.is_initialized()
    assert du.is_root_process() and du.get_rank() == 0 and du.get_world_size() == 1
    du.print0("hello")
    assert capsys.readouterr().out == "hello\n"
    t = torch.tensor([1.0, 3.0])
    assert torch.equal(du.all_reduce_mean(t), t) and torch.equal(du.all_reduce_sum(t), t)
    du.barrier()
    du.destroy_process_group()  # nothing to destroy: no error
    model = TransformerLM(TINY)
    du.save0(model, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=True)
    assert loaded.keys() == model.state_dict().keys()


def test_setup_without_torchrun_gives_rank_0_of_1_on_the_cpu_with_a_group_of_one():
    out = in_fresh_python(
        "import torch, torch.distributed as dist; from utils.distributed_utils import setup; "
        "print(setup(7), dist.get_world_size(), dist.get_backend(), torch.rand(1).item())")
    assert out.startswith("(0, 0, device(type='cpu'), 1) 1 gloo")
    torch.manual_seed(7)
    assert out.split()[-1] == str(torch.rand(1).item())  # seeded with the given seed


def test_setup_falls_back_to_the_cpu_when_slurm_sets_visible_gpus_but_there_is_no_cuda():
    if host_gpu_count():
        pytest.skip("this machine has GPUs 0-3: they would be usable (tests/test_gpu.py covers them)")
    out = in_fresh_python("from utils.distributed_utils import setup; print(setup()[2])",
                          CUDA_VISIBLE_DEVICES="0,1,2,3")
    assert out.strip() == "cpu"


def test_asking_for_cuda_where_there_is_none_fails_with_one_clear_message(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="^error: --device cuda .* no usable GPU here: run on a"):
        du.pick_device("cuda")


@pytest.mark.parametrize("cuda, hip, why, variant", [
    (None, None, "a CPU-only build", "cuda"),
    ("13.0", None, "built for CUDA 13.0: is the driver older?", "cuda"),
    (None, "7.1.25424", "built for ROCm 7.1.25424: is the driver older?", "rocm")])
def test_a_slurm_job_with_gpus_that_torch_cannot_use_warns_once_that_it_trains_on_the_cpu(
        monkeypatch, capsys, cuda, hip, why, variant):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.version, "hip", hip, raising=False)
    monkeypatch.setenv("SLURM_JOB_GPUS", "0,1,2,3")
    monkeypatch.setenv("RANK", "0")
    assert du.pick_device("auto") == torch.device("cpu")
    line = capsys.readouterr().err.strip()
    assert line == (f"WARNING: Slurm gave this job GPUs (0,1,2,3), but torch {torch.__version__} "
                    f"cannot use them ({why}): training on the CPU. For the GPUs, make the "
                    f"environment with TORCH_VARIANT={variant} bash setup_env.sh; to train on "
                    "the CPU on purpose, pass --device cpu")
    for rank, device in (("1", "auto"), ("0", "cpu")):  # other ranks, and the CPU on purpose
        monkeypatch.setenv("RANK", rank)
        du.pick_device(device)
        assert capsys.readouterr().err == ""
    monkeypatch.delenv("SLURM_JOB_GPUS")  # a job without GPUs (a CPU node, a laptop)
    monkeypatch.setenv("RANK", "0")
    du.pick_device("auto")
    assert capsys.readouterr().err == ""


def test_each_local_rank_gets_its_own_gpu_and_a_rank_beyond_the_gpus_stops_with_one_line(
        monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert [du.pick_device("auto", r) for r in range(4)] == [torch.device("cuda", r)
                                                              for r in range(4)]
    assert du.pick_device("cpu", 7) == torch.device("cpu")  # refused GPUs are not counted
    with pytest.raises(SystemExit) as stop:
        du.pick_device("auto", 4)
    line = str(stop.value)
    assert "\n" not in line and line.startswith("error: local rank 4 on ")
    assert "4 are visible (CUDA_VISIBLE_DEVICES=0,1,2,3): start at most 4 processes" in line


def test_save0_stores_the_plain_models_weights_even_from_a_ddp_wrapper(tmp_path):
    code = (f"import torch; from torch.nn.parallel import DistributedDataParallel as DDP; "
            f"from model import TransformerLM, get_config; from utils.distributed_utils import setup, save0; "
            f"setup(); m = DDP(TransformerLM(get_config('tiny', vocab_size=30))); "
            f"save0(m, r'{tmp_path / 'ddp.pt'}')")
    in_fresh_python(code)
    state = torch.load(tmp_path / "ddp.pt", weights_only=True)
    assert not any(k.startswith("module.") for k in state)
    TransformerLM(get_config("tiny", vocab_size=30)).load_state_dict(state)


def _two_rank_helpers(rank, world_size, tmp):
    results = {
        "mean": du.all_reduce_mean(torch.tensor([float(rank)])).item(),
        "sum": du.all_reduce_sum(torch.tensor([rank + 1.0])).item(),
        "root": du.is_root_process(),
    }
    du.save0(torch.nn.Linear(2, 2), f"{tmp}/saved-by-rank-{rank}.pt")
    return results


def test_on_two_ranks_reductions_agree_and_only_rank_0_is_root_and_writes(tmp_path):
    r0, r1 = run_distributed(_two_rank_helpers, 2, str(tmp_path))
    assert r0 == {"mean": 0.5, "sum": 3.0, "root": True}
    assert r1 == {"mean": 0.5, "sum": 3.0, "root": False}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["saved-by-rank-0.pt"]


def test_save0_refuses_sharded_weights_and_names_the_helpers_to_use_instead():
    out = in_fresh_python(
        "import torch; from torch.distributed.device_mesh import init_device_mesh; "
        "from torch.distributed.tensor import distribute_tensor; "
        "from utils.distributed_utils import setup, save0; setup(); "
        "w = distribute_tensor(torch.zeros(4), init_device_mesh('cpu', (1,)))\n"
        "try: save0({'w': w}, 'unused.pt')\nexcept TypeError as e: print(e)")
    assert "use save_full_model or save_sharded_model" in out


@pytest.mark.parametrize("line, name", [
    ("from utils.distributed_utils import load_sharded_model, save_full_model, save_sharded_model",
     "load_sharded_model"),
    ("from utils.distributed_utils import (all_reduce_sum, atomic_folder, print0)",
     "atomic_folder"),
    ("import utils.distributed_utils as du; du.checkpoint_blocking_seconds()",
     "checkpoint_blocking_seconds"),
])
def test_a_file_importing_a_checkpoint_helper_from_here_stops_with_one_line_naming_its_module(
        line, name):
    """A participant's half-done file written before checkpoints got their own module."""
    proc = subprocess.run([sys.executable, "-c", line], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr == (f"error: cannot import name '{name}' from utils.distributed_utils: "
                           f"it is in utils.checkpointing now: from utils.checkpointing import "
                           f"{name}\n")


def test_every_name_said_to_have_moved_is_in_utils_checkpointing_and_no_longer_here():
    import utils.checkpointing
    for name in du.MOVED_TO_CHECKPOINTING:
        assert name not in vars(du) and name in vars(utils.checkpointing), name
    assert not hasattr(du, "no_such_helper")  # other names: an ordinary AttributeError


@pytest.mark.parametrize("env, expected", [
    ({}, 0),
    ({"SLURM_CPUS_PER_TASK": "32", "LOCAL_WORLD_SIZE": "4"}, 4),
    ({"SLURM_CPUS_PER_TASK": "8", "LOCAL_WORLD_SIZE": "4"}, 1),
    ({"SLURM_CPUS_PER_TASK": "1"}, 0),
])
def test_data_loader_workers_follow_the_cpus_slurm_gives_each_rank(monkeypatch, env, expected):
    for k in ("SLURM_CPUS_PER_TASK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert default_num_workers() == expected
