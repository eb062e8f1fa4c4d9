"""The DDP lesson: the solution on 2 ranks matches one process with the same global batch."""

import pytest
import torch
from torch.utils.data.distributed import DistributedSampler

from conftest import assert_same_weights, read_summary, run_script, script_env
from test_baseline_training import evaluate_file
from utils.data import TokenWindows, load_corpus

pytestmark = pytest.mark.warm_start  # runs forked warm: tests/warm_launch.py
SOLUTION = "solutions/train/to_distributed_training.py"
COMMON = ("--dataset", "synthetic", "--preset", "tiny", "--dropout", 0, "--logger", "none",
          "--seed", 3)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    """The solution with 2 ranks x batch 8 and with 1 process x batch 16, 25 steps each."""
    tmp = tmp_path_factory.mktemp("ddp")
    env = script_env(cache_dir=data_cache)
    two = run_script(SOLUTION, *COMMON, "--max-steps", 25, "--batch-size", 8, "--out-dir",
                     tmp / "two", nproc=2, env=env,
                     torchrun_args=("--log-dir", tmp / "logs", "--redirects", "3"))
    run_script(SOLUTION, *COMMON, "--max-steps", 25, "--batch-size", 16, "--out-dir", tmp / "one",
               env=env)
    return tmp, two


def test_two_ranks_with_batch_b_match_one_process_with_batch_2b_step_by_step(runs):
    tmp, _ = runs
    two, one = read_summary(tmp / "two"), read_summary(tmp / "one")
    assert two["world_size"] == 2 and one["world_size"] == 1
    assert two["global_batch_size"] == one["global_batch_size"] == 16
    assert len(two["loss_history"]) == 25
    torch.testing.assert_close(two["loss_history"], one["loss_history"], rtol=0, atol=1e-5)


def test_two_ranks_end_with_the_same_weights_as_one_process(runs):
    tmp, _ = runs
    a = torch.load(tmp / "two" / "final_model.pt", weights_only=True)
    b = torch.load(tmp / "one" / "final_model.pt", weights_only=True)
    assert_same_weights(a, b)


def test_the_ddp_checkpoint_loads_into_a_plain_model_and_reproduces_the_test_loss(runs, data_cache):
    tmp, _ = runs
    summary = read_summary(tmp / "two")
    corpus = load_corpus("synthetic", cache_dir=data_cache)
    loss = evaluate_file(tmp / "two" / "final_model.pt", corpus, "tiny", summary["seq_len"])
    assert loss == pytest.approx(summary["test_loss"], rel=1e-5)


def test_only_rank_0_prints_training_output(runs):
    tmp, two = runs
    logs = {int(p.parent.name): p.read_text() for p in (tmp / "logs").rglob("stdout.log")}
    assert set(logs) == {0, 1}
    assert "validation loss" in logs[0] and "test loss" in logs[0]
    assert [line for line in logs[1].splitlines() if not line.startswith("setup: rank 1/2")] == []


def test_validation_and_test_losses_on_two_ranks_equal_the_single_process_values(tmp_path, data_cache):
    """No training (--max-steps 0): identical weights, so only the evaluation is compared. The
    split sizes are odd, so the samplers must pad; padding must count nowhere."""
    corpus = load_corpus("synthetic", cache_dir=data_cache)
    seq_len = 31
    assert len(TokenWindows(corpus.valid, seq_len)) % 2 == 1
    env = script_env(cache_dir=data_cache)
    args = (*COMMON, "--max-steps", 0, "--seq-len", seq_len, "--batch-size", 5)
    run_script(SOLUTION, *args, "--out-dir", tmp_path / "two", nproc=2, env=env)
    run_script(SOLUTION, *args, "--out-dir", tmp_path / "one", env=env)
    two, one = read_summary(tmp_path / "two"), read_summary(tmp_path / "one")
    assert two["steps"] == one["steps"] == 0
    assert two["val_loss"] == pytest.approx(one["val_loss"], rel=1e-7, abs=0)
    assert two["test_loss"] == pytest.approx(one["test_loss"], rel=1e-7, abs=0)


def training_shards(n, world_size, epoch, seed=3):
    """The training indices of every rank, with the sampler arguments the solution uses."""
    shards = []
    for rank in range(world_size):
        s = DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=True,
                               seed=seed, drop_last=True)
        s.set_epoch(epoch)
        shards.append(list(s))
    return shards


@pytest.mark.parametrize("n, world_size", [(100, 2), (101, 4), (7, 3)])
def test_training_shards_are_disjoint_equal_and_cover_all_but_the_remainder(n, world_size):
    shards = training_shards(n, world_size, epoch=0)
    flat = [i for s in shards for i in s]
    assert len(set(flat)) == len(flat)  # disjoint
    assert len({len(s) for s in shards}) == 1  # every rank takes the same number of steps
    assert len(flat) == n - n % world_size  # only the remainder is left out


def test_set_epoch_gives_every_epoch_a_new_order_on_every_rank():
    assert training_shards(100, 2, epoch=0) != training_shards(100, 2, epoch=1)
    assert training_shards(100, 2, epoch=1) == training_shards(100, 2, epoch=1)
