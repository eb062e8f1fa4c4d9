"""The capstone: pipeline x FSDP x tensor parallelism on one 3-D mesh of 8 processes trains like
one process with the same global batch, and so do its schedules with two stages per rank
(interleaved 1F1B, zero bubble)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from conftest import assert_same_weights, load_dcp_like, load_script, read_summary, run_script, \
    script_env
from model import TransformerLM, get_config
from utils.memory import CATEGORIES, relative_error

pytestmark = pytest.mark.warm_start  # runs forked warm: tests/warm_launch.py
SCRIPT = "train/nd_training.py"
COMMON = ("--dataset", "synthetic", "--preset", "tiny", "--max-steps", 3, "--dropout", 0,
          "--seed", 5, "--logger", "none", "--log-every", 1)
ND_LAYOUT = ("--batch-size", 8, "--pp", 2, "--dp", 2, "--tp", 2, "--microbatches", 2)


@pytest.fixture(scope="module")
def capstone_run(tmp_path_factory, data_cache):
    """The single-process reference and the capstone on 8 processes (pp 2 x dp 2 x tp 2), once
    for the tests below. The capstone runs under tests/record_collectives.py, which writes
    every rank's collectives of one training step and the shapes of its parameters."""
    root = tmp_path_factory.mktemp("nd")
    env = script_env(cache_dir=data_cache, RECORD_DIR=root)
    ref_dir, nd_dir = root / "reference", root / "nd"
    # global batch 16 = --batch-size 8 per data-parallel replica x dp 2
    run_script("solutions/train/to_distributed_training.py", *COMMON, "--batch-size", 16,
               "--out-dir", ref_dir, env=env, timeout=120)
    proc = run_script("tests/record_collectives.py", SCRIPT, *COMMON, *ND_LAYOUT,
                      "--out-dir", nd_dir, nproc=8, env=env, timeout=600)
    return ref_dir, nd_dir, proc, root


@pytest.mark.slow
def test_pp2_x_dp2_x_tp2_on_eight_processes_matches_the_single_process_run(capstone_run):
    ref_dir, nd_dir, proc, _ = capstone_run
    assert "mesh pp 2 x dp 2 x tp 2" in proc.stdout
    ref, nd = read_summary(ref_dir), read_summary(nd_dir)
    assert nd["global_batch_size"] == ref["global_batch_size"] == 16
    assert len(nd["loss_history"]) == 3
    assert nd["loss_history"] == pytest.approx(ref["loss_history"], rel=1e-5)
    assert nd["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-5)
    assert nd["test_loss"] == pytest.approx(ref["test_loss"], rel=1e-5)
    # Every rank holds about an eighth of the model (the LayerNorms, the position table and
    # the row-wise biases are small and kept whole on both ranks of a TP pair).
    whole = TransformerLM(get_config("tiny", vocab_size=502)).num_params()
    assert whole <= sum(nd["params_per_rank"]) < 1.05 * whole
    assert max(nd["params_per_rank"]) < whole / 8 * 1.1

    # The 3-D sharded checkpoint loads into the unsplit model and holds the trained weights.
    ref_weights = torch.load(ref_dir / "final_model.pt", weights_only=True)
    state = load_dcp_like(nd_dir / "final_model", ref_weights)
    assert_same_weights(state, ref_weights, atol=3e-4)


@pytest.mark.slow
def test_the_plan_of_this_layout_agrees_with_the_eight_process_run(capstone_run, tmp_path):
    """tools/plan_run.py builds the same layout in one process, on a fake process group of 8
    ranks: what it says the first rank of each stage and the last rank hold and send in a step
    is what the real run held and sent."""
    _, nd_dir, _, record_dir = capstone_run
    nd = read_summary(nd_dir)
    plan_file = tmp_path / "plan.json"
    run_script("tools/plan_run.py", "--preset", "tiny", "--vocab", nd["model_config"]["vocab_size"],
               "--nodes", 2, "--gpus-per-node", 4, "--tp", 2, "--pp", 2, "--global-batch", 16,
               "--microbatches", 2, "--precision", "fp32", "--site", "jsc", "--json", plan_file,
               env=script_env(), timeout=300)
    plan = json.loads(plan_file.read_text())
    assert [row["rank"] for row in plan["ranks"]] == [0, 4, 7]
    memory = nd["memory"]
    for row in plan["ranks"]:
        rank = row["rank"]
        ran = json.loads((record_dir / f"rank{rank}.json").read_text())
        assert row["shapes"] == ran["shapes"]
        assert row["params"] == nd["params_per_rank"][rank]
        # measured on the built shards = measured in the run; the formula is the run's formula
        for key in ("parameters", "gradients", "optimizer", "gathered"):
            assert row["memory"][key] == memory[key][rank], f"rank {rank} {key}"
        for key in (*CATEGORIES, "gathered"):
            assert row["memory"]["formula"][key] == memory["formula"][key][rank], f"{rank} {key}"
        assert relative_error(memory["activations"][rank], row["memory"]["activations"]) < 0.01
        # every collective of a step on the mesh's groups: dimension, operation, bytes, calls
        dims = {tuple(group): dim for dim, group in row["groups"].items()}
        on_mesh = [c for c in ran["collectives"] if tuple(c["group"]) in dims]
        recorded = Counter((dims[tuple(c["group"])], c["op"], c["bytes"]) for c in on_mesh)
        planned = Counter()
        for c in row["collectives"]:
            planned[(c["dim"], c["op"], c["bytes"])] += c["calls"]
        assert planned == recorded, f"rank {rank}"
        # the others are the log line's, on all 8 ranks, at --log-every steps only
        assert all(len(c["group"]) == 8 for c in ran["collectives"] if c not in on_mesh)


def test_degrees_that_do_not_multiply_to_the_world_size_stop_with_one_clear_line(tmp_path,
                                                                                 data_cache):
    proc = run_script(SCRIPT, *COMMON, "--tp", 2, "--out-dir", tmp_path,
                      env=script_env(cache_dir=data_cache), timeout=60, check=False)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and "must equal the world size 1" in last
    assert "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def four_layer_reference(tmp_path_factory, data_cache):
    """The DDP solution in one process, with 4 blocks: two stages on each of two ranks."""
    out = tmp_path_factory.mktemp("nd_reference_4_layers")
    run_script("solutions/train/to_distributed_training.py", *COMMON, "--n-layers", 4,
               "--batch-size", 8, "--out-dir", out, env=script_env(cache_dir=data_cache),
               timeout=120)
    return out


@pytest.mark.parametrize("schedule, theory", [("interleaved-1f1b", 1 / 9), ("zero-bubble", 1 / 25)])
def test_two_stages_per_rank_train_like_one_process(schedule, theory, four_layer_reference,
                                                    tmp_path, data_cache):
    proc = run_script(SCRIPT, *COMMON, "--n-layers", 4, "--batch-size", 8, "--pp", 2,
                      "--schedule", schedule, "--stages-per-rank", 2, "--microbatches", 4,
                      "--out-dir", tmp_path, nproc=2, env=script_env(cache_dir=data_cache),
                      timeout=300)
    assert f"schedule {schedule}, 2 stages per rank, 4 microbatches" in proc.stdout
    ref, nd = read_summary(four_layer_reference), read_summary(tmp_path)
    assert nd["stages_per_rank"] == 2 and nd["bubble_fraction_theory"] == pytest.approx(theory)
    assert nd["loss_history"] == pytest.approx(ref["loss_history"], rel=1e-5)
    assert nd["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-5)
    assert nd["test_loss"] == pytest.approx(ref["test_loss"], rel=1e-5)
    # rank 0 holds stages 0 and 2 (blocks 0 and 2), rank 1 stages 1 and 3: the drawing says so
    record = json.loads((tmp_path / "pipeline_schedule.json").read_text())
    assert record["stages"] == [[0, 2], [1, 3]]
    assert {a[0] for a in record["measured"][1]["actions"]} == {1, 3}
    assert (tmp_path / "pipeline_schedule.png").is_file()
    # The checkpoint holds every block once, under the whole model's names.
    ref_weights = torch.load(four_layer_reference / "final_model.pt", weights_only=True)
    state = load_dcp_like(tmp_path / "final_model", ref_weights)
    assert_same_weights(state, ref_weights)


def test_stages_per_rank_that_do_not_fit_the_schedule_or_the_model_stop_with_one_line(capsys):
    import argparse
    nd = load_script(SCRIPT)

    def problem(cfg_layers=2, **given):
        args = argparse.Namespace(**{"pp": 2, "dp": 1, "tp": 1, "microbatches": 4, "batch_size": 8,
                                     "layers_per_stage": None, "schedule": "interleaved-1f1b",
                                     "stages_per_rank": 2, "compile": False, **given})
        with pytest.raises(SystemExit) as stop:
            nd.check_degrees(args, get_config("tiny", vocab_size=50, n_layers=cfg_layers), 2)
        assert stop.value.code == 1
        return capsys.readouterr().err.strip()  # one line (from rank 0 only, under torchrun)

    assert problem() == ("error: the 2 layers do not split evenly into --pp 2 x "
                         "--stages-per-rank 2 = 4 stages: give --n-layers 4 or "
                         "--layers-per-stage (e.g. 3,5)")
    assert "--schedule 1f1b runs one stage per rank" in problem(4, schedule="1f1b")
    assert "--microbatches 5 must be a multiple of 2" in problem(4, microbatches=5,
                                                                 batch_size=10)
    assert "--layers-per-stage must give 4 counts" in problem(4, layers_per_stage=[2, 2])
    assert "use --pp 2 or more" in problem(2, pp=1)
