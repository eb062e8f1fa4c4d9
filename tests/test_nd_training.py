"""The capstone: pipeline x FSDP x tensor parallelism on one 3-D mesh of 8 processes trains like
one process with the same global batch."""

from __future__ import annotations

import warnings

import pytest
import torch

from conftest import read_summary, run_script, script_env
from model import TransformerLM, get_config

SCRIPT = "train/nd_training.py"
COMMON = ("--dataset", "synthetic", "--preset", "tiny", "--max-steps", 3, "--dropout", 0,
          "--seed", 5, "--logger", "none", "--log-every", 1)


@pytest.mark.slow
def test_pp2_x_dp2_x_tp2_on_eight_processes_matches_the_single_process_run(tmp_path, data_cache):
    env = script_env(cache_dir=data_cache)
    ref_dir, nd_dir = tmp_path / "reference", tmp_path / "nd"
    # global batch 16 = --batch-size 8 per data-parallel replica x dp 2
    run_script("solutions/train/to_distributed_training.py", *COMMON, "--batch-size", 16,
               "--out-dir", ref_dir, env=env, timeout=120)
    proc = run_script(SCRIPT, *COMMON, "--batch-size", 8, "--pp", 2, "--dp", 2, "--tp", 2,
                      "--microbatches", 2, "--out-dir", nd_dir, nproc=8, env=env, timeout=600)
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
    import torch.distributed.checkpoint as dcp

    ref_weights = torch.load(ref_dir / "final_model.pt", weights_only=True)
    state = {k: torch.full_like(v, float("nan")) for k, v in ref_weights.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that no process group exists here
        dcp.load(state, checkpoint_id=nd_dir / "final_model")
    for k, v in ref_weights.items():  # AdamW magnifies 1e-8 gradient differences
        torch.testing.assert_close(state[k], v, rtol=0, atol=3e-4, msg=lambda m: f"{k}: {m}")


def test_degrees_that_do_not_multiply_to_the_world_size_stop_with_one_clear_line(tmp_path,
                                                                                 data_cache):
    proc = run_script(SCRIPT, *COMMON, "--tp", 2, "--out-dir", tmp_path,
                      env=script_env(cache_dir=data_cache), timeout=60, check=False)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and "must equal the world size 1" in last
    assert "Traceback" not in proc.stderr
