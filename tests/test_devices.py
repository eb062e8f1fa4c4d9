"""What GPU runs do differently, checked on the CPU: tensors that enter a collective or the
summary live on the run's device, and the fused AdamW takes the sharded parameters.

On a GPU the course runs NCCL, which has no CPU backend: a tensor built on the CPU (a parameter
count, a timing, a loss restored from a checkpoint) makes a collective fail ("No backend type
associated with device type cpu"), and a CPU tensor next to GPU tensors makes torch.stack fail.
Here, on CPU with gloo, every tensor is on the CPU and such mistakes pass unnoticed, so the GPU
path is tested by design in four ways; the first three fail on the mistakes the first GPU run
found (issue 10):
- the helpers move what they are given to the collective's device: tested with a stand-in
  for the GPU (the meta device) so that a helper that forgets the move fails here;
- every tensor the course's scripts create names its device (a static check of train/ and
  solutions/train/):
  with the rule kept, nothing created on the CPU reaches a GPU run's collectives;
- training_summary accepts losses that are not all on one device;
- the fused AdamW that GPU runs use (fused=device.type == "cuda") takes the parameters of TP
  and FSDP on two meshes: the CPU has a fused AdamW too, so that very call runs here.
tests/test_gpu.py (`pytest -m gpu`) runs the real scripts on GPUs where there are any.
A check inside the helpers that raises on a device mismatch was not chosen: on CPU the run's
device and the default device are the same, so it could never fire here.
"""

from __future__ import annotations

import ast
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from conftest import ROOT, load_script
from distributed import run_distributed
from model import TransformerLM, get_config
from utils import distributed_utils as du
from utils.metrics import Throughput, training_summary

FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "full", "empty", "arange", "randn", "rand",
             "randint", "linspace"}


def test_a_collective_of_an_nccl_group_takes_this_process_s_gpu_and_of_gloo_the_cpu(monkeypatch):
    assert du.collective_device() == torch.device("cpu")  # no process group
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert du.collective_device() == torch.device("cpu")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert du.collective_device() == torch.device("cuda", 3)


def test_all_reduce_helpers_send_a_cpu_tensor_on_the_collective_s_device(monkeypatch):
    # A stand-in for an NCCL group on a GPU: its collectives take tensors on the meta device.
    seen = []

    def all_reduce(tensor, op=None, group=None):
        seen.append(tensor.device)
        tensor.mul_(2)  # two ranks with equal values

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(du, "collective_device", lambda group=None: torch.device("meta"))
    counts = torch.tensor([1.0, 2.0])  # built on the CPU, like a parameter count or a timing
    total, mean = du.all_reduce_sum(counts), du.all_reduce_mean(counts)
    assert seen == [torch.device("meta")] * 2
    assert total.device == mean.device == torch.device("meta") and total.shape == (2,)
    assert torch.equal(counts, torch.tensor([1.0, 2.0]))  # the input is left alone


def test_all_reduce_sum_in_a_gloo_group_of_one_returns_a_copy_on_the_cpu():
    t = torch.tensor([1.0, 3.0])
    assert du.all_reduce_sum(t).device == torch.device("cpu")
    assert du.all_reduce_sum(t) is not t


def tensor_factories_without_device(path, root=ROOT) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in FACTORIES and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "torch"
                and not any(k.arg == "device" for k in node.keywords)):
            found.append(f"{path.relative_to(root)}:{node.lineno} torch.{node.func.attr}(...)")
    return found


def test_every_tensor_the_course_scripts_create_names_its_device():
    # Without device=, torch creates on the CPU: on a GPU run such a tensor in an NCCL
    # collective (all_reduce_sum, dist.broadcast) or next to the losses (torch.stack) fails.
    # The rule for the scripts is simple: every tensor they create says where. (The exercises
    # and solutions are generated from course/train/, whose mixed blocks are not Python.)
    scripts = sorted((ROOT / "train").glob("*.py")) + sorted((ROOT / "solutions" / "train").glob("*.py"))
    assert len(scripts) == 18  # seven steps, Lightning and the collectives lesson, both versions
    missing = [hit for path in scripts for hit in tensor_factories_without_device(path)]
    assert missing == [], "add device=device to:\n" + "\n".join(missing)


def test_the_static_check_finds_a_tensor_made_without_a_device(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("import torch\nx = torch.tensor([1.0])\ny = torch.zeros(2, device=d)\n")
    assert tensor_factories_without_device(script, tmp_path) == ["script.py:2 torch.tensor(...)"]


def test_the_summary_takes_losses_that_are_not_all_on_one_device(monkeypatch):
    # A resumed run restores its earlier losses as numbers; new ones are tensors on the run's
    # device. torch.stack of such a list fails on a GPU ("Expected all tensors to be on the
    # same device"); here a plain number stands for "not on the same device".
    monkeypatch.setenv("PEAK_FLOPS", "1e12")
    cfg = get_config("tiny", vocab_size=30)
    summary = training_summary(
        SimpleNamespace(batch_size=2, preset="tiny"), cfg, SimpleNamespace(source="test"),
        world_size=1, steps=3, loss_history=[2.5, torch.tensor(2.25), torch.tensor(2.0)],
        val_loss=2.0, test_loss=2.0, throughput=Throughput(torch.device("cpu")),
        flops_per_token=1.0, device=torch.device("cpu"), start_time=0.0)
    assert summary["loss_history"] == [2.5, 2.25, 2.0]
    assert summary["device"] == "cpu" and summary["peak_flops_source"] == "PEAK_FLOPS"


# ---- the fused AdamW of GPU runs, on the parameters of tensor parallelism ----------------

def sharded_as_in(script: str, mesh):
    """The tiny model, sharded as `script` shards it on a GPU run: TP, then FSDP over dp."""
    module = load_script(script)
    torch.manual_seed(0)
    model = module.apply_tp(TransformerLM(get_config("tiny", vocab_size=96)), mesh["tp"])
    if hasattr(module, "apply_fsdp"):  # the capstone has it as a function
        return module.apply_fsdp(model, mesh["dp"])
    for block in model.layers.values():  # the TP step does it inline in main()
        fully_shard(block, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


def fused_and_plain_adamw_steps(rank, world_size, script):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel
    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "tp"))
    result = {}
    for fused in (True, False):
        model = sharded_as_in(script, mesh)
        start = {k: v.to_local().clone() for k, v in model.state_dict().items()}
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            x, y = (torch.randint(96, (4, 16), generator=g) for _ in range(2))
            with loss_parallel():
                torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            optimizer.step()
            optimizer.zero_grad()
        result[fused] = {k: v.to_local().clone() for k, v in model.state_dict().items()}
        result["moved"] = max((result[fused][k] - start[k]).abs().max().item() for k in start)
        result["meshes"] = {p.device_mesh.ndim for p in model.parameters()}
    return result


@pytest.mark.parametrize("script", ["solutions/train/tp_training.py",
                                    "solutions/train/nd_training.py"])
def test_the_fused_adamw_of_gpu_runs_steps_tp_and_fsdp_parameters_of_two_meshes_like_adamw(
        script):
    # On a GPU the scripts make AdamW with fused=True. After TP and FSDP some parameters are
    # DTensors on the (dp, tp) mesh and the rest (LayerNorms, pos_emb) on dp alone, and the
    # fused kernel takes them all in one call: older PyTorch refused that ("cross-mesh"). The
    # CPU has a fused AdamW too, so the GPU's call is run here, against the unfused update.
    for r in run_distributed(fused_and_plain_adamw_steps, 2, script, timeout=300):
        assert r["meshes"] == {1, 2}  # the case in question: parameters on two meshes
        assert r["moved"] > 1e-3
        for name, fused in r[True].items():
            torch.testing.assert_close(fused, r[False][name], rtol=0, atol=1e-5, msg=name)
