"""The memory step (train/memory_training.py) changes where the bytes go, not what is learnt.

Every layout and gradient accumulation train exactly what one process trains on the same global
batch (dropout off, same seed): 2 ranks x 2 micro-batches of 4 = 1 process x 16. The breakdown
each run prints matches the formula of its layout, and gradient accumulation all-reduces once
per optimizer step (counted with a DDP communication hook).
"""

from __future__ import annotations

import pytest
import torch

from conftest import read_summary, run_script, script_env
from model import get_config
from utils.memory import Layout, predict, relative_error

SOLUTION = "solutions/train/memory_training.py"
COMMON = ["--dataset", "synthetic", "--preset", "tiny", "--dropout", "0", "--seed", "2",
          "--logger", "none", "--log-every", "1000", "--epochs", "1", "--max-steps", "3"]
STEPS, MICRO = 3, 4
TIMEOUT = 180
LAYOUTS = {  # name: (extra arguments, the formula's layout for 2 ranks)
    "zero1": (["--layout", "zero1"], Layout(dp=2, zero=1)),
    "zero2": (["--layout", "zero2"], Layout(dp=2, zero=3, reshard=False)),
    "zero3_checkpointing": (["--layout", "zero3", "--activation-checkpointing"],
                            Layout(dp=2, zero=3, checkpointing=True)),
    "offload": (["--layout", "offload"], Layout(dp=2, zero=3, offload=True)),
}

# 7 runs of real processes (forked warm: tests/warm_launch.py): about 20 s on 2 idle cores
pytestmark = [pytest.mark.slow, pytest.mark.warm_start]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    root = tmp_path_factory.mktemp("memory_lesson")
    env = script_env(data_cache, COUNT_DIR=root)

    def run(name, *extra, nproc=2, count=False):
        out = root / name
        (out / "counts").mkdir(parents=True)
        script = ["tests/count_allreduces.py", SOLUTION] if count else [SOLUTION]
        proc = run_script(script[0], *script[1:], *COMMON, *extra, "--out-dir", out,
                          nproc=nproc, env={**env, "COUNT_DIR": str(out / "counts")},
                          timeout=TIMEOUT)
        counts = [int(p.read_text()) for p in sorted((out / "counts").glob("*.txt"))]
        return {"summary": read_summary(out), "weights": torch.load(out / "final_model.pt"),
                "allreduces": counts, "stdout": proc.stdout}

    results = {"reference": run("reference", "--batch-size", str(4 * MICRO), nproc=1),
               "accumulated": run("accumulated", "--batch-size", str(MICRO), "--grad-accum",
                                  "2", "--log-every", str(STEPS), count=True),
               "one_micro_batch": run("one_micro_batch", "--batch-size", str(2 * MICRO),
                                      count=True)}
    for name, (extra, _) in LAYOUTS.items():
        results[name] = run(name, "--batch-size", str(MICRO), "--grad-accum", "2", *extra)
    return results


def assert_trains_like_the_reference(run, reference):
    losses, expected = run["summary"]["loss_history"], reference["summary"]["loss_history"]
    assert len(losses) == STEPS
    assert losses == pytest.approx(expected, rel=1e-5)
    for key, value in reference["weights"].items():
        torch.testing.assert_close(run["weights"][key], value, rtol=1e-4, atol=1e-4, msg=key)


def test_gradient_accumulation_equals_one_process_with_the_whole_batch(runs):
    assert_trains_like_the_reference(runs["accumulated"], runs["reference"])
    assert runs["accumulated"]["summary"]["global_batch_size"] == 4 * MICRO


def test_the_progress_line_counts_optimizer_steps_under_accumulation(runs):
    # --max-steps counts optimizer steps: 3 of 3, not 3 of 3 // 2 (it read "step 20/5 (400%)")
    assert f"step {STEPS}/{STEPS} (100%)" in runs["accumulated"]["stdout"]


def test_gradient_accumulation_all_reduces_once_per_optimizer_step(runs):
    """2 micro-batches per step, no_sync on the first: as many all-reduces as one micro-batch
    per step (the gradient buckets of STEPS backward passes), not twice as many."""
    once = runs["one_micro_batch"]["allreduces"]
    assert len(once) == 2 and once[0] >= STEPS and once[0] % STEPS == 0
    assert runs["accumulated"]["allreduces"] == once


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_trains_exactly_like_one_process(runs, name):
    assert_trains_like_the_reference(runs[name], runs["reference"])


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_measures_what_the_formula_predicts(runs, name):
    summary = runs[name]["summary"]
    cfg = get_config("tiny", vocab_size=summary["model_config"]["vocab_size"], dropout=0.0)
    formula = predict(cfg, MICRO * cfg.max_seq_len, LAYOUTS[name][1])
    for rank, breakdown in enumerate(summary["memory"]["per_rank"]):
        for key in ("parameters", "gradients", "optimizer", "activations", "gathered"):
            assert relative_error(breakdown["measured"][key], formula[key]) <= 0.01, \
                f"{name} rank {rank} {key}: {breakdown['measured'][key]} vs {formula[key]:.0f}"


def test_sharding_and_checkpointing_shrink_what_they_claim(runs):
    ddp = runs["accumulated"]["summary"]["memory"]
    mem = {name: runs[name]["summary"]["memory"] for name in LAYOUTS}
    assert mem["zero1"]["optimizer"][0] < 0.51 * ddp["optimizer"][0]        # ZeRO-1: the moments
    assert mem["zero1"]["parameters"] == ddp["parameters"]
    assert mem["zero2"]["parameters"][0] < 0.51 * ddp["parameters"][0]      # FSDP: everything
    assert mem["zero2"]["gathered"][0] > 2 * mem["zero3_checkpointing"]["gathered"][0]
    assert mem["zero3_checkpointing"]["activations"][0] < 0.3 * ddp["activations"][0]


# ---- the FSDP step's --async-save -----------------------------------------------------------
@pytest.fixture(scope="module")
def saves(tmp_path_factory, data_cache):
    """The FSDP solution on 2 ranks with a checkpoint every 2 steps, saved with dcp.save and
    with dcp.async_save."""
    root = tmp_path_factory.mktemp("async_save")
    env = script_env(data_cache)
    out = {}
    for name, extra in (("blocking", []), ("async", ["--async-save"])):
        run_script("solutions/train/fsdp_training.py", *COMMON[:-4], "--max-steps", "6",
                   "--epochs", "1", "--batch-size", "4", "--checkpoint-every", "2", *extra,
                   "--out-dir", root / name, nproc=2, env=env, timeout=TIMEOUT)
        out[name] = root / name
    return out


def checkpoint_tensors(folder):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    path = folder.parent / (folder.name + ".pt")
    dcp_to_torch_save(folder, path)
    return torch.load(path, weights_only=False)


def flat(state, prefix=""):
    if isinstance(state, dict):
        return {k2: v2 for k, v in state.items() for k2, v2 in flat(v, f"{prefix}{k}.").items()}
    return {prefix: state}


def test_an_asynchronous_save_writes_the_same_complete_checkpoint(saves):
    import json
    for name in ("last", "best"):
        a, b = (saves[run] / "checkpoints" / name for run in ("blocking", "async"))
        assert (b / "manifest.json").is_file(), list(b.iterdir())  # sealed: complete
        assert json.loads((a / "train_state.json").read_text()) == \
            json.loads((b / "train_state.json").read_text())
        mine, theirs = flat(checkpoint_tensors(b)), flat(checkpoint_tensors(a))
        assert mine.keys() == theirs.keys()
        for key, value in theirs.items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(mine[key], value, rtol=0, atol=0, msg=key)
    # nothing half-written left beside them
    assert not list((saves["async"] / "checkpoints").glob(".*partial*"))


def test_every_save_reports_how_long_it_blocked_training(saves):
    blocking, asynchronous = (read_summary(saves[run]) for run in ("blocking", "async"))
    assert asynchronous["async_save"] and not blocking["async_save"]
    # 3 saves of "last" (steps 2, 4, 6), the end-of-epoch "best" and "last"
    assert len(asynchronous["checkpoint_save_blocking_s"]) == \
        len(blocking["checkpoint_save_blocking_s"]) >= 4
    assert all(t > 0 for t in asynchronous["checkpoint_save_blocking_s"])
