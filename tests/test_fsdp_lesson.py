"""The FSDP lesson (train/fsdp_training.py and the checkpoint helpers) does what it claims.

Real processes on CPU with gloo. A step is correct when it matches single-process training:
with dropout 0, the same seed and the same global batch, losses agree tightly; weights after
AdamW steps to about 1e-4 (AdamW magnifies 1e-8 differences in the gradients).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT, read_summary, run_script, script_env
from distributed import run_distributed
from model import ModelConfig, TransformerLM, get_config

SOLUTION = "solutions/train/fsdp_training.py"
BASELINE = "solutions/train/to_distributed_training.py"
COMMON = ["--dataset", "synthetic", "--preset", "tiny", "--dropout", "0", "--seed", "3",
          "--logger", "none", "--log-every", "1000"]
CFG = dict(vocab_size=97, dropout=0.0)
TIMEOUT = 120  # seconds, for every multi-process run

# real processes (forked warm: tests/warm_launch.py): about 1.5 minutes for the module on 2 cores
pytestmark = [pytest.mark.slow, pytest.mark.warm_start]


def load_solution():
    """The solution script as a module (for apply_fsdp); its main() does not run."""
    spec = importlib.util.spec_from_file_location("fsdp_training", ROOT / SOLUTION)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def batches(n, batch_size, cfg, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(cfg.vocab_size, (batch_size, cfg.max_seq_len + 1), generator=g)
            for _ in range(n)]


def sharded_model(seed=0, mixed_precision="none", reshard_after_forward=True, **overrides):
    torch.manual_seed(seed)
    cfg = get_config("tiny", **{**CFG, **overrides})
    return load_solution().apply_fsdp(TransformerLM(cfg), mixed_precision, reshard_after_forward)


def train_steps(model, optimizer, data, rank, world_size):
    """One optimizer step per global batch in `data`; this rank takes its slice of each."""
    losses = []
    for batch in data:
        local = batch.chunk(world_size)[rank]
        logits = model(local[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), local[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses


def full_state(model, optimizer=None):
    """Full (unsharded) model and optimizer state on every rank, as plain CPU tensors."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_state_dict)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
    if optimizer is None:
        return {"model": get_model_state_dict(model, options=options)}
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    return {"model": model_state, "optim": optim_state}


def flat(state, prefix=""):
    """{dotted key: tensor or value} of a nested state dict."""
    if isinstance(state, dict):
        out = {}
        for k, v in state.items():
            out.update(flat(v, f"{prefix}{k}."))
        return out
    if isinstance(state, list):
        return flat(dict(enumerate(state)), prefix)
    return {prefix.rstrip("."): state.clone() if isinstance(state, torch.Tensor) else state}


def assert_same(a: dict, b: dict, atol=0.0):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0,
                                       msg=lambda m, k=k: f"{k}: {m}")
        else:
            assert a[k] == b[k], k


# ---------------------------------------------------------------------------------------------
# What fully_shard does to the model


def inspect_sharding():
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    model = sharded_model()
    units = [name or "<root>" for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    params = {name: (isinstance(p, DTensor), p.placements if isinstance(p, DTensor) else None,
                     p.to_local().shape[0] if isinstance(p, DTensor) else None, p.shape[0])
              for name, p in model.named_parameters()}
    return units, params


def sharded_after_evaluation(rank, world_size, reshard_after_forward=True):
    """The parameters still gathered (not DTensor shards) after the script's evaluate()."""
    from torch.distributed.tensor import DTensor
    model = sharded_model(reshard_after_forward=reshard_after_forward)
    x = batches(1, 4, model.cfg)[0].chunk(world_size)[rank]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[:, :-1], x[:, 1:]),
                                         batch_size=len(x))
    load_solution().evaluate(model, loader, torch.device("cpu"))
    return [name for name, p in model.named_parameters() if not isinstance(p, DTensor)]


def fsdp_facts(rank, world_size):
    """What apply_fsdp builds, and how its options train (one spawn for several tests)."""
    return dict(sharding=inspect_sharding(), precision=mixed_precision_and_resharding(rank, world_size),
                gathered_after_eval=sharded_after_evaluation(rank, world_size),
                gathered_after_eval_kept=sharded_after_evaluation(rank, world_size, False))


@pytest.fixture(scope="module")
def facts():
    return run_distributed(fsdp_facts, 2, timeout=TIMEOUT)[0]


def test_every_block_and_the_root_are_fsdp_units_with_parameters_sharded_over_the_ranks(facts):
    from torch.distributed.tensor import Shard
    units, params = facts["sharding"]
    n_layers = get_config("tiny").n_layers
    assert sorted(units) == sorted(["<root>"] + [f"layers.{i}" for i in range(n_layers)])
    for name, (is_dtensor, placements, local_rows, full_rows) in params.items():
        assert is_dtensor, f"{name} is not sharded"
        assert placements == (Shard(0),), name
        assert local_rows == -(-full_rows // 2), f"{name}: rank 0 holds {local_rows} of {full_rows} rows"


def mixed_precision_and_resharding(rank, world_size):
    from torch.distributed.tensor import DTensor
    cfg = get_config("tiny", **CFG)
    data = batches(3, 4, cfg)
    result = {}
    for mp, reshard in [("none", True), ("bf16", False)]:
        model = sharded_model(mixed_precision=mp, reshard_after_forward=reshard)
        seen = []
        hook = model.layers["0"].mlp.in_proj.register_forward_hook(
            lambda m, inputs, out, seen=seen: seen.append((inputs[0].dtype, m.weight.dtype)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = train_steps(model, optimizer, data, rank, world_size)
        hook.remove()
        # after a forward: is the block's weight back to its shard, or still gathered?
        logits = model(data[0][:, :-1].chunk(world_size)[rank])
        block_sharded = isinstance(model.layers["0"].mlp.in_proj.weight, DTensor)
        logits.sum().backward()  # finish the iteration, so FSDP reshards
        result[mp] = dict(losses=torch.stack(losses), compute=seen[0], logits=logits.dtype,
                          master=model.layers["0"].mlp.in_proj.weight.dtype,
                          block_sharded_after_forward=block_sharded)
    return result


def test_evaluation_leaves_every_parameter_sharded(facts):
    assert facts["gathered_after_eval"] == []


def test_evaluation_reshards_the_blocks_too_when_they_keep_their_weights_after_forward(facts):
    # (reshard() is per FSDP unit: the root's alone left every block gathered, and the memory
    # line then counted bf16 block weights without their gradients: 14.0 MiB against 14.2)
    assert facts["gathered_after_eval_kept"] == []


def test_bf16_computes_in_bfloat16_keeps_fp32_weights_and_tracks_fp32_losses(facts):
    r = facts["precision"]
    assert r["none"]["compute"] == (torch.float32, torch.float32)
    assert r["bf16"]["compute"] == (torch.bfloat16, torch.bfloat16)
    assert r["bf16"]["master"] == torch.float32 and r["bf16"]["logits"] == torch.float32
    torch.testing.assert_close(r["bf16"]["losses"], r["none"]["losses"], atol=3e-2, rtol=0)


def test_reshard_after_forward_false_keeps_block_weights_gathered_until_backward(facts):
    r = facts["precision"]
    assert r["none"]["block_sharded_after_forward"]      # true (default): freed after forward
    assert not r["bf16"]["block_sharded_after_forward"]  # false: kept for backward


# ---------------------------------------------------------------------------------------------
# Distributed Checkpoint: save at 2 ranks, load at 1 and 3; atomic; export


def train_and_save(rank, world_size, ckpt, export):
    from utils.checkpointing import save_full_model, save_sharded_model
    cfg = get_config("tiny", **CFG)
    model = sharded_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(model, optimizer, batches(2, 6, cfg), rank, world_size)
    save_sharded_model(model, optimizer, ckpt, {"step": 2, "model_config": cfg.to_dict()})
    save_full_model(model, export)
    return flat(full_state(model, optimizer))


def load_and_continue(rank, world_size, ckpt):
    from utils.checkpointing import load_sharded_model
    cfg = get_config("tiny", **CFG)
    model = sharded_model(seed=123)  # other initial weights: everything must come from the file
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_state = load_sharded_model(model, optimizer, ckpt, cfg.to_dict())
    loaded = flat(full_state(model, optimizer))
    # one more step: the loaded optimizer state (moments, step count) drives it
    loss = train_steps(model, optimizer, batches(1, 6, cfg, seed=9), rank, world_size)[0]
    return loaded, train_state, all_mean(loss), flat(full_state(model))


def all_mean(t):
    import torch.distributed as dist
    t = t.clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()


@pytest.fixture(scope="module")
def saved_at_2_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp_ckpt")
    ckpt, export = tmp / "checkpoints" / "last", tmp / "final_model.pt"
    state = run_distributed(train_and_save, 2, str(ckpt), str(export), timeout=TIMEOUT)[0]
    return ckpt, export, state


@pytest.fixture(scope="module")
def loaded_at_1_and_3_ranks(saved_at_2_ranks):
    ckpt = str(saved_at_2_ranks[0])
    return {n: run_distributed(load_and_continue, n, ckpt, timeout=TIMEOUT)[0] for n in (1, 3)}


@pytest.mark.parametrize("world_size", [1, 3])
def test_a_checkpoint_saved_by_2_ranks_loads_at_other_world_sizes_with_identical_state(
        saved_at_2_ranks, loaded_at_1_and_3_ranks, world_size):
    saved = saved_at_2_ranks[2]
    loaded, train_state, _, _ = loaded_at_1_and_3_ranks[world_size]
    assert any(k.startswith("optim.state.") for k in saved), "no optimizer state was saved"
    assert_same(loaded, saved)  # bit for bit, optimizer moments and step counts included
    assert train_state["step"] == 2


def test_training_continues_identically_after_loading_at_1_and_at_3_ranks(
        loaded_at_1_and_3_ranks):
    _, _, loss1, model1 = loaded_at_1_and_3_ranks[1]
    _, _, loss3, model3 = loaded_at_1_and_3_ranks[3]
    torch.testing.assert_close(loss3, loss1, atol=1e-6, rtol=0)
    # 1e-4 as for every AdamW step (module docstring): k_proj.bias has a true gradient of zero
    # (softmax ignores a constant added to every key), so AdamW divides summation noise by
    # noise and moves it by up to 2e-5 differently at 1 and at 3 ranks.
    assert_same(model3, model1, atol=1e-4)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP: loading in one process
def test_a_checkpoint_loads_into_a_plain_model_without_a_process_group(saved_at_2_ranks):
    from utils.checkpointing import load_sharded_model
    ckpt, _, saved = saved_at_2_ranks
    model = TransformerLM(get_config("tiny", **CFG))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    load_sharded_model(model, optimizer, ckpt)
    assert_same(flat({"model": model.state_dict()}),
                {k: v for k, v in saved.items() if k.startswith("model.")})


def test_loading_a_checkpoint_of_another_model_fails_with_one_line_naming_the_difference(
        saved_at_2_ranks):
    from utils.checkpointing import CheckpointError, load_sharded_model
    cfg = get_config("tiny", **CFG, d_ff=128)
    with pytest.raises(CheckpointError,
                       match=r"another model: d_ff 256 \(checkpoint\) vs 128 \(now\)"):
        load_sharded_model(TransformerLM(cfg), None, saved_at_2_ranks[0], cfg.to_dict())


def test_the_exported_model_equals_the_gathered_weights_and_loads_into_a_plain_model(
        saved_at_2_ranks):
    _, export, saved = saved_at_2_ranks
    weights = torch.load(export, weights_only=True)
    model = TransformerLM(get_config("tiny", **CFG))
    model.load_state_dict(weights)  # strict: same keys, no FSDP prefixes, no DTensors
    assert_same(flat({"model": model.state_dict()}),
                {k: v for k, v in saved.items() if k.startswith("model.")})


def interrupted_save(rank, world_size, ckpt):
    """Save a good checkpoint, then one that fails half-way on rank 1; then save again."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from utils.checkpointing import CheckpointError, load_sharded_model, save_sharded_model
    cfg = get_config("tiny", **CFG)
    model = sharded_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = batches(3, 4, cfg)
    train_steps(model, optimizer, data[:1], rank, world_size)
    save_sharded_model(model, optimizer, ckpt, {"step": 1})
    good = flat(full_state(model))
    train_steps(model, optimizer, data[1:2], rank, world_size)

    write_data = FileSystemWriter.write_data

    def fail_on_rank_1(self, plan, planner):
        if rank == 1:  # this rank's shard file is written, then the job "dies"
            write_data(self, plan, planner).wait()
            raise OSError("stale file handle")
        return write_data(self, plan, planner)

    FileSystemWriter.write_data = fail_on_rank_1
    try:
        save_sharded_model(model, optimizer, ckpt, {"step": 2})
        failed = False
    except CheckpointError as e:  # every rank stops, with one line naming rank 1's error
        failed = str(e) == f"rank 1 could not save {ckpt}: OSError: stale file handle"
    finally:
        FileSystemWriter.write_data = write_data

    fresh = sharded_model(seed=7)
    after_failure = load_sharded_model(fresh, None, ckpt)["step"]
    still_good = flat(full_state(fresh))
    save_sharded_model(model, optimizer, ckpt, {"step": 2})  # a later save replaces it
    final_step = load_sharded_model(sharded_model(seed=7), None, ckpt)["step"]
    return failed, after_failure, still_good, good, final_step


def test_an_interrupted_save_never_replaces_the_previous_good_checkpoint(tmp_path):
    ckpt = tmp_path / "checkpoints" / "last"
    failed, after_failure, still_good, good, final_step = run_distributed(
        interrupted_save, 2, str(ckpt), timeout=TIMEOUT)[0]
    assert failed, "the interrupted save did not raise the rank's error"
    assert after_failure == 1
    assert_same(still_good, good)
    assert final_step == 2
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["last"]  # no leftovers


# ---------------------------------------------------------------------------------------------
# The script: matches single-process training, resumes exactly


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    """The FSDP script at 2 ranks x batch 4, and the single-process baseline at batch 8."""
    tmp = tmp_path_factory.mktemp("fsdp_runs")
    env = script_env(cache_dir=data_cache)
    run_script(SOLUTION, *COMMON, "--max-steps", 6, "--batch-size", 4, "--out-dir", tmp / "fsdp",
               nproc=2, env=env, timeout=TIMEOUT)
    run_script(BASELINE, *COMMON, "--max-steps", 6, "--batch-size", 8, "--out-dir", tmp / "single",
               env=env, timeout=TIMEOUT)
    return tmp, env


def test_fsdp_on_2_ranks_matches_single_process_training(runs):
    tmp, _ = runs
    fsdp, single = read_summary(tmp / "fsdp"), read_summary(tmp / "single")
    assert fsdp["global_batch_size"] == single["global_batch_size"] == 8
    torch.testing.assert_close(torch.tensor(fsdp["loss_history"]),
                               torch.tensor(single["loss_history"]), atol=1e-5, rtol=0)
    assert fsdp["val_loss"] == pytest.approx(single["val_loss"], abs=1e-4)
    # the exported model loads into a plain TransformerLM and equals the single-process weights
    assert_same(torch.load(tmp / "fsdp" / "final_model.pt", weights_only=True),
                torch.load(tmp / "single" / "final_model.pt", weights_only=True), atol=1e-4)
    # each rank holds half the model, gradients and optimizer state (a bit more: padding)
    per_rank = fsdp["model_state_bytes_per_rank"]
    assert len(per_rank) == 2 and len(fsdp["peak_mem_bytes_per_rank"]) == 2
    # fp32 weights (4 bytes), gradients (4) and AdamW's two moments (8) of every parameter
    full_bytes = 16 * TransformerLM(ModelConfig(**fsdp["model_config"])).num_params()
    assert 0.5 <= per_rank[0] / full_bytes < 0.52


def test_stopping_and_resuming_gives_the_losses_and_weights_of_an_uninterrupted_run(runs):
    tmp, env = runs
    stopped = tmp / "stopped"
    run_script(SOLUTION, *COMMON, "--max-steps", 3, "--batch-size", 4, "--out-dir", stopped,
               nproc=2, env=env, timeout=TIMEOUT)
    # resume on one process with the same global batch: DCP reshards, the data order continues
    run_script(SOLUTION, *COMMON, "--max-steps", 6, "--batch-size", 8, "--out-dir", stopped,
               "--resume", stopped / "checkpoints" / "last", env=env, timeout=TIMEOUT)
    resumed, whole = read_summary(stopped), read_summary(tmp / "fsdp")
    assert resumed["steps"] == 6
    torch.testing.assert_close(torch.tensor(resumed["loss_history"]),
                               torch.tensor(whole["loss_history"]), atol=1e-5, rtol=0)
    assert_same(torch.load(stopped / "final_model.pt", weights_only=True),
                torch.load(tmp / "fsdp" / "final_model.pt", weights_only=True), atol=1e-4)


@pytest.mark.parametrize("batch_size", [5, 16])  # 16 divides the 48 samples trained on: refused too
def test_resuming_with_another_global_batch_fails_with_one_line_saying_what_to_change(
        runs, batch_size):
    tmp, env = runs
    proc = run_script(SOLUTION, *COMMON, "--max-steps", 6, "--batch-size", batch_size,
                      "--out-dir", tmp / "bad", "--resume", tmp / "fsdp" / "checkpoints" / "last",
                      env=env, timeout=TIMEOUT, check=False)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: --resume: the checkpoint was trained with a global batch of 8 sequences, this "
        f"run has {batch_size}: use --batch-size x ranks = 8 (or start a new run without --resume)")
    assert not (tmp / "bad" / "summary.json").exists()


def test_the_exercise_as_shipped_trains_with_ddp_and_holds_twice_the_state_per_rank(runs):
    tmp, env = runs
    run_script("train/fsdp_training.py", *COMMON, "--max-steps", 6, "--batch-size", 4,
               "--out-dir", tmp / "exercise", nproc=2, env=env, timeout=TIMEOUT)
    ddp, fsdp = read_summary(tmp / "exercise"), read_summary(tmp / "fsdp")
    torch.testing.assert_close(torch.tensor(ddp["loss_history"]),
                               torch.tensor(fsdp["loss_history"]), atol=1e-5, rtol=0)
    for ddp_bytes, fsdp_bytes in zip(ddp["model_state_bytes_per_rank"],
                                     fsdp["model_state_bytes_per_rank"]):
        assert ddp_bytes / fsdp_bytes == pytest.approx(2, rel=0.02)


def test_resuming_at_the_checkpoints_own_step_trains_nothing_and_exports_its_weights(runs):
    tmp, env = runs
    run_script(SOLUTION, *COMMON, "--max-steps", 6, "--batch-size", 8, "--out-dir", tmp / "export",
               "--resume", tmp / "fsdp" / "checkpoints" / "last", env=env, timeout=TIMEOUT)
    exported, trained = read_summary(tmp / "export"), read_summary(tmp / "fsdp")
    assert exported["loss_history"] == trained["loss_history"]  # restored, none added
    assert exported["test_loss"] == pytest.approx(trained["test_loss"], abs=1e-5)
    assert_same(torch.load(tmp / "export" / "final_model.pt", weights_only=True),
                torch.load(tmp / "fsdp" / "final_model.pt", weights_only=True))
