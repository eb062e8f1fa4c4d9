"""The tensor-parallel step: sharding every block over 2 ranks changes nothing but where the
work happens. Logits, loss, gradients and a whole training run match the single-process model."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT, assert_same_weights, read_summary, run_script, script_env
from distributed import run_distributed
from model import TransformerLM, get_config

pytestmark = pytest.mark.warm_start  # runs forked warm: tests/warm_launch.py
SOLUTION = ROOT / "solutions" / "train" / "tp_training.py"
# dropout 0 and one seed: the runs must agree to float tolerance
RUN_ARGS = ("--dataset", "synthetic", "--preset", "tiny", "--max-steps", 4, "--batch-size", 8,
            "--dropout", 0, "--seed", 3, "--logger", "none", "--log-every", 1)
CFG = dict(preset="tiny", vocab_size=101, max_seq_len=16, dropout=0.0)  # odd vocabulary: uneven shards


def load_script(path):
    """Import a training script as a module (its main() does not run)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def batch(seed=1, n=4, t=16, vocab=101):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(vocab, (n, t), generator=g), torch.randint(vocab, (n, t), generator=g)


def tp_forward_backward(rank, world_size):
    """On each rank: the same seeded model, sharded by apply_tp; one forward and backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    tp = load_script(SOLUTION)
    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = tp.apply_tp(TransformerLM(get_config(**CFG)), mesh["tp"])
    sharded = {n: isinstance(p, DTensor) for n, p in model.named_parameters()}
    x, y = batch()
    logits = model(x)
    with loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
    grads = {n: numpy(p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
             for n, p in model.named_parameters()}
    local_q = model.layers["0"].attn.q_proj.weight.to_local().shape
    return dict(logits=numpy(logits.full_tensor()), loss=numpy(loss.full_tensor()), grads=grads,
                sharded=sharded, local_q=tuple(local_q))


def numpy(t: torch.Tensor):
    """Results travel back as numpy arrays: torch tensors pickled by a process that has exited
    cannot be unpickled (their shared memory is passed by that process), nor can tensors that
    still need grad."""
    return t.detach().numpy()


def test_two_tp_ranks_give_the_single_process_logits_loss_and_gradients():
    torch.manual_seed(0)
    ref = TransformerLM(get_config(**CFG))
    x, y = batch()
    ref_logits = ref(x)
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), y.flatten())
    ref_loss.backward()

    results = run_distributed(tp_forward_backward, 2, timeout=120)
    d = ref.cfg.d_model
    for r in results:
        # the plan really shards: each rank holds half of q_proj's output rows
        assert r["local_q"] == (d // 2, d)
        assert r["sharded"]["layers.0.mlp.out_proj.weight"] and r["sharded"]["output.weight"]
        torch.testing.assert_close(torch.from_numpy(r["logits"]), ref_logits.detach(),
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.from_numpy(r["loss"]), ref_loss.detach(),
                                   rtol=1e-6, atol=1e-6)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(torch.from_numpy(r["grads"][name]), p.grad,
                                       rtol=1e-4, atol=1e-6,
                                       msg=lambda m, name=name: f"{name}: {m}")


@pytest.fixture(scope="module")
def single_process_run(tmp_path_factory, data_cache):
    """The finished DDP script in one process: the reference every TP run must match."""
    out = tmp_path_factory.mktemp("tp_reference")
    run_script("solutions/train/to_distributed_training.py", *RUN_ARGS, "--out-dir", out,
               env=script_env(cache_dir=data_cache), timeout=120)
    return out


def test_a_two_rank_tp_run_matches_the_single_process_run(tmp_path, data_cache,
                                                          single_process_run):
    proc = run_script(SOLUTION.relative_to(ROOT), *RUN_ARGS, "--tp", 2, "--out-dir", tmp_path,
                      nproc=2, env=script_env(cache_dir=data_cache), timeout=240)
    assert "mesh dp 1 x tp 2" in proc.stdout
    ref, tp = read_summary(single_process_run), read_summary(tmp_path)
    assert tp["tensor_parallel_size"] == 2 and tp["global_batch_size"] == ref["global_batch_size"]
    assert len(tp["loss_history"]) == 4
    assert tp["loss_history"] == pytest.approx(ref["loss_history"], rel=1e-5)
    assert tp["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-5)
    assert tp["test_loss"] == pytest.approx(ref["test_loss"], rel=1e-5)
    # The saved file holds the gathered, whole weights: it loads into the plain model.
    full = torch.load(tmp_path / "final_model.pt", weights_only=True)
    ref_weights = torch.load(single_process_run / "final_model.pt", weights_only=True)
    model = TransformerLM(get_config("tiny", vocab_size=ref_weights["tok_emb.weight"].shape[0]))
    model.load_state_dict(full)
    assert_same_weights(full, ref_weights)
    # Half of every block's matmul weights per rank (embeddings and output too).
    assert tp["params_per_rank"] < 0.6 * model.num_params()


def test_a_tp_degree_that_cannot_split_the_model_stops_with_one_clear_line(tmp_path, data_cache):
    proc = run_script(SOLUTION.relative_to(ROOT), *RUN_ARGS, "--tp", 3, "--out-dir", tmp_path,
                      env=script_env(cache_dir=data_cache), timeout=60, check=False)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and "--tp 3" in last and "n_heads 4" in last
    assert "Traceback" not in proc.stderr


def test_under_torchrun_that_line_comes_once_not_once_per_rank(tmp_path, data_cache):
    """Rank 0 prints it; torchrun's report of the failure, at the bottom, quotes it for each
    rank it lists ("traceback : error: ...", utils/launch.py tell_torchrun). A real torchrun:
    forked ranks have no report, and counting the message there once hid that it comes 3 x."""
    proc = run_script(SOLUTION.relative_to(ROOT), *RUN_ARGS, "--tp", 3, "--out-dir", tmp_path,
                      nproc=2, torchrun=True, env=script_env(cache_dir=data_cache), timeout=120,
                      check=False)
    assert proc.returncode != 0
    printed = [line for line in (proc.stdout + proc.stderr).splitlines()
               if line.startswith("error:")]
    assert len(printed) == 1 and "must be a multiple of --tp 3" in printed[0], proc.stderr
    assert "traceback : error: the world size 2 must be a multiple of --tp 3" in proc.stderr


def test_exporting_a_2d_model_hides_dtensors_gather_warning_and_no_other(caplog):
    """save_full_model of a TP x FSDP model gathers each weight in two all_gathers; DTensor
    warns that this "may give inconsistent results ... due to different reduction orders",
    which a gather (nothing is added up) cannot: that warning alone is left out."""
    import logging

    from utils.checkpointing import quiet_sequential_gathers
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    with caplog.at_level(logging.WARNING), quiet_sequential_gathers():
        log.warning("While redistributing from %s to %s, %d sequential %s operations will be "
                    "performed. ...", "(Shard(dim=0), Shard(dim=0))", "(Replicate(), Replicate())",
                    2, "all_gather")
        log.warning("While redistributing from %s to %s, %d sequential %s operations will be "
                    "performed. ...", "(Partial(sum), Partial(sum))", "(Replicate(), Replicate())",
                    2, "all_reduce")
    assert [r.getMessage().split(" sequential ")[1][:10] for r in caplog.records] == ["all_reduce"]
