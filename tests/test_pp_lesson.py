"""The pipeline-parallel step: two stages on two ranks train exactly like one process, with
every schedule, their Distributed Checkpoint loads into the unsplit model, and every run draws
the schedule it ran next to the theory's. (The capstone's schedules with several stages per
rank: tests/test_nd_training.py; every schedule's gradients: tests/test_pipeline_gradients.py.)"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import sys

import pytest
import torch

from conftest import ROOT, assert_same_weights, load_dcp_like, read_summary, run_script, script_env
from model import TransformerLM, get_config

pytestmark = pytest.mark.warm_start  # runs forked warm: tests/warm_launch.py
SOLUTION = ROOT / "solutions" / "train" / "pp_training.py"
RUN_ARGS = ("--dataset", "synthetic", "--preset", "tiny", "--max-steps", 4, "--batch-size", 8,
            "--dropout", 0, "--seed", 3, "--logger", "none", "--log-every", 1)


def load_script(path):
    """Import a training script as a module (its main() does not run)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def single_process_run(tmp_path_factory, data_cache):
    """The finished DDP script in one process: the reference every pipeline run must match."""
    out = tmp_path_factory.mktemp("pp_reference")
    run_script("solutions/train/to_distributed_training.py", *RUN_ARGS, "--out-dir", out,
               env=script_env(cache_dir=data_cache), timeout=120)
    return out


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory, data_cache):
    """pipeline_run(schedule) -> (output folder, stdout) of a 2-stage run on 2 ranks, run once."""
    runs = {}

    def run(schedule):
        if schedule not in runs:
            out = tmp_path_factory.mktemp(f"pp_{schedule}")
            proc = run_script(SOLUTION.relative_to(ROOT), *RUN_ARGS, "--schedule", schedule,
                              "--microbatches", 4, "--out-dir", out, nproc=2,
                              env=script_env(cache_dir=data_cache), timeout=240)
            runs[schedule] = out, proc.stdout
        return runs[schedule]
    return run


@pytest.mark.parametrize("schedule, theory", [("gpipe", 1 / 5), ("1f1b", 1 / 5),
                                              ("zero-bubble", 1 / 13)])
def test_two_stages_on_two_ranks_match_the_single_process_losses(schedule, theory, pipeline_run,
                                                                 single_process_run):
    out, stdout = pipeline_run(schedule)
    ref, pp = read_summary(single_process_run), read_summary(out)
    assert pp["pipeline_stages"] == 2 and pp["schedule"] == schedule
    assert len(pp["loss_history"]) == 4
    assert pp["loss_history"] == pytest.approx(ref["loss_history"], rel=1e-5)
    assert pp["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-5)
    assert pp["test_loss"] == pytest.approx(ref["test_loss"], rel=1e-5)
    # The bubble is reported per stage, next to the schedule's theory: (p-1)/(m+p-1) = 1/5 for
    # GPipe and 1F1B, (p-1)/(3m+p-1) = 1/13 for zero bubble.
    assert len(pp["idle_fraction_per_stage"]) == 2
    assert all(0 <= f < 1 for f in pp["idle_fraction_per_stage"])
    assert pp["bubble_fraction_theory"] == pytest.approx(theory)
    assert "idle share of a step per stage (measured)" in stdout
    # Each stage holds only its part of the model.
    assert sum(pp["params_per_rank"]) == pytest.approx(
        TransformerLM(get_config("tiny", vocab_size=502)).num_params(), rel=0.01)


def test_a_pipelined_run_s_checkpoint_loads_into_the_unsplit_model(pipeline_run,
                                                                   single_process_run):
    out, _ = pipeline_run("1f1b")
    ref_weights = torch.load(single_process_run / "final_model.pt", weights_only=True)
    vocab = ref_weights["tok_emb.weight"].shape[0]
    model = TransformerLM(get_config("tiny", vocab_size=vocab))
    state = load_dcp_like(out / "final_model", model.state_dict())
    model.load_state_dict(state)  # every key of the whole model was in the checkpoint
    assert_same_weights(state, ref_weights)


@pytest.fixture(scope="module")
def two_epoch_reference(tmp_path_factory):
    """The DDP solution in one process for two epochs of 5 steps on a tiny corpus, 4 blocks (two
    stages of 2, or two stages per rank of 1): (arguments, output folder)."""
    from selfcheck.runs import SEQ_LEN, write_tiny_text
    root = tmp_path_factory.mktemp("pp_two_epochs")
    text = write_tiny_text(root / "text")  # 40 training windows: 5 batches of 8
    args = ("--data-dir", text, "--cache-dir", root / "cache", "--seq-len", SEQ_LEN, "--epochs", 2,
            "--preset", "tiny", "--n-layers", 4, "--batch-size", 8, "--dropout", 0, "--seed", 3,
            "--logger", "none", "--log-every", 1)
    run_script("solutions/train/to_distributed_training.py", *args, "--out-dir", root / "ref",
               env=script_env(), timeout=120)
    return args, root / "ref"


@pytest.mark.parametrize("script, layout", [
    ("solutions/train/pp_training.py", ("--schedule", "1f1b")),
    ("solutions/train/nd_training.py", ("--pp", 2, "--schedule", "interleaved-1f1b")),
])
def test_a_pipelined_run_that_evaluates_between_epochs_keeps_matching_the_single_process_run(
        script, layout, two_epoch_reference, tmp_path):
    # The evaluation schedule once prepared the training's own stages for forward only: every
    # stage but the last trained on zero gradients from the first validation on.
    args, ref_dir = two_epoch_reference
    proc = run_script(script, *args, *layout, "--microbatches", 2, "--out-dir", tmp_path,
                      nproc=2, env=script_env(), timeout=240)
    log = proc.stdout
    assert log.index("epoch 0 validation loss") < log.index("epoch 1 step 6/10")
    ref, pp = read_summary(ref_dir), read_summary(tmp_path)
    assert len(pp["loss_history"]) == 10
    assert pp["loss_history"] == pytest.approx(ref["loss_history"], rel=1e-5)
    assert pp["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-5)
    assert pp["test_loss"] == pytest.approx(ref["test_loss"], rel=1e-5)
    ref_weights = torch.load(ref_dir / "final_model.pt", weights_only=True)
    state = load_dcp_like(tmp_path / "final_model", ref_weights)
    assert_same_weights(state, ref_weights)


def test_stages_split_the_layers_and_together_hold_the_whole_model_under_its_own_names():
    pp = load_script(SOLUTION)
    cfg = get_config("tiny", vocab_size=50, n_layers=4)
    whole = TransformerLM(cfg).state_dict()
    stages = [pp.split_pipeline_stage(TransformerLM(cfg), i, 2, [1, 3]) for i in range(2)]
    assert list(stages[0].layers) == ["0"] and list(stages[1].layers) == ["1", "2", "3"]
    assert stages[0].output is None and stages[1].tok_emb is None
    keys = [set(s.state_dict()) for s in stages]
    assert not keys[0] & keys[1] and keys[0] | keys[1] == set(whole)
    # a middle stage maps hidden states to hidden states
    middle = pp.split_pipeline_stage(TransformerLM(cfg), 1, 4)
    assert middle(torch.randn(2, 8, cfg.d_model)).shape == (2, 8, cfg.d_model)


def test_microbatches_that_do_not_divide_the_batch_stop_with_one_clear_line(tmp_path, data_cache):
    proc = run_script(SOLUTION.relative_to(ROOT), *RUN_ARGS, "--microbatches", 3,
                      "--out-dir", tmp_path, env=script_env(cache_dir=data_cache), timeout=60,
                      check=False)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and "--microbatches 3" in last
    assert "Traceback" not in proc.stderr


REHEARSAL = ROOT / "tests" / "rehearsal"


@pytest.mark.parametrize("script, layout", [
    ("solutions/train/pp_training.py", ()),
    ("solutions/train/nd_training.py", ("--pp", 2, "--microbatches", 2)),
    # two stages per rank: their evaluation runs the interleaved schedule forward only
    ("solutions/train/nd_training.py", ("--pp", 2, "--n-layers", 4, "--schedule",
                                        "interleaved-1f1b", "--microbatches", 2)),
    ("solutions/train/nd_training.py", ("--pp", 2, "--n-layers", 4, "--schedule", "zero-bubble",
                                        "--stages-per-rank", 2, "--microbatches", 2)),
])
def test_under_bf16_every_stage_evaluates_in_the_dtypes_it_trained_in(script, layout, tmp_path,
                                                                      data_cache):
    # torch 2.11 (on the GPU nodes) checks at every step that a stage sends the shapes and
    # dtypes of its first step; evaluating outside the training's autocast sent float32 logits
    # where training sent bfloat16, and the first validation crashed. tests/rehearsal makes the
    # CPU run check the same.
    env = script_env(cache_dir=data_cache, REHEARSE_STRICT_STAGES=1,
                     PYTHONPATH=os.pathsep.join([str(REHEARSAL), str(ROOT)]))
    proc = run_script(script, *RUN_ARGS[:-4], "--max-steps", 2, "--precision", "bf16",
                      *layout, "--out-dir", tmp_path, nproc=2, env=env, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_summary(tmp_path)
    assert summary["precision"] == "bf16" and summary["pipeline_stages"] == 2
    assert all(math.isfinite(v) for v in (summary["val_loss"], summary["test_loss"]))
    # the losses it keeps are detached: no graph per step held, no warning in the summary
    assert "requires_grad=True to a scalar" not in proc.stderr


def test_the_rehearsal_stops_a_stage_whose_outputs_change_dtype_as_torch_2_11_does():
    """The check above can fail: a stage that trained in bf16 and evaluates in fp32 is stopped."""
    spec = importlib.util.spec_from_file_location("rehearsal", REHEARSAL / "sitecustomize.py")
    rehearsal = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rehearsal)  # its switches are off here: it only defines things
    module = torch.nn.Linear(4, 4)
    seen = {}

    def stage_init(self, submodule, stage_index, *args, **kwargs):
        seen["stage"] = stage_index

    init = rehearsal._check_stage_outputs(stage_init)
    init(object(), module, 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        module(torch.randn(2, 4))
    with pytest.raises(rehearsal.PipeliningShapeError,
                       match="Stage 1 forward outputs: value 0 has a dtype mismatch: "
                             "expected torch.bfloat16 actual torch.float32"):
        module(torch.randn(2, 4))


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_every_run_draws_the_schedule_it_ran_next_to_the_theory(schedule, pipeline_run):
    out, _ = pipeline_run(schedule)
    for name in ("pipeline_schedule.json", "pipeline_schedule.png", "pipeline_schedule.html"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "pipeline_schedule.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    record = json.loads((out / "pipeline_schedule.json").read_text())
    # A typical step (not the first, which also builds the pipeline) of both stages: every
    # microbatch's forward and backward once, in torch's order of that schedule, each inside
    # the step and none overlapping another on its rank.
    assert record["step"] >= 1 and len(record["measured"]) == 2
    kinds = {"1f1b": ["F", "B"], "zero-bubble": ["F", "I", "W"]}[schedule]
    from utils.pipeline_timeline import SCHEDULE_CLASSES, schedule_order
    order = schedule_order(SCHEDULE_CLASSES[schedule], 2, 4)
    for rank, row in enumerate(record["measured"]):
        actions = row["actions"]
        assert sorted((a[1], a[2]) for a in actions) == sorted(
            (k, mb) for k in kinds for mb in range(4))
        assert [tuple(a[:3]) for a in actions] == [tuple(a) for a in order[rank]]
        assert all(row["start"] <= a[3] <= a[4] <= row["end"] for a in actions)
        assert all(b[3] >= a[4] for a, b in zip(actions, actions[1:]))
    # The second stage cannot start a microbatch before the first has finished it (one host:
    # every process reads the same clock, so the rows line up).
    first_f = {a[2]: a[4] for a in record["measured"][0]["actions"] if a[1] == "F"}
    assert all(a[3] >= first_f[a[2]] for a in record["measured"][1]["actions"] if a[1] == "F")
    # the numbers: measured from the drawn step, predicted from torch's order with this run's
    # own compute times, and the formula; the page shows them next to the picture
    summary = read_summary(out)["pipeline_schedule"]
    assert summary["bubble_formula"] == pytest.approx(read_summary(out)["bubble_fraction_theory"])
    assert 0 < summary["bubble_predicted"] <= summary["bubble_measured"] < 1
    assert summary["step_s_predicted"] <= summary["step_s_measured"]
    page = (out / "pipeline_schedule.html").read_text()
    assert "<svg" in page and f"{summary['bubble_measured']:.0%}" in page
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", page)  # offline


def test_tools_pipeline_timeline_redraws_a_finished_run(pipeline_run, tmp_path, capsys):
    import shutil
    tool = load_script(ROOT / "tools" / "pipeline_timeline.py")
    out, _ = pipeline_run("1f1b")
    copy = tmp_path / "run"
    copy.mkdir()
    shutil.copy(out / "pipeline_schedule.json", copy)  # e.g. copied home without the pictures
    assert tool.main([str(copy)]) == 0
    assert (copy / "pipeline_schedule.html").read_text() == \
        (out / "pipeline_schedule.html").read_text()
    with pytest.raises(SystemExit) as stop:
        tool.main([str(tmp_path / "none")])
    assert stop.value.code == 2
    assert "does not exist" in capsys.readouterr().err.strip().splitlines()[-1]


def test_zero_bubble_with_microbatches_that_do_not_fill_its_rounds_stops_with_one_line(capsys):
    import argparse
    pp = load_script(SOLUTION)
    cfg = get_config("tiny", vocab_size=50)

    def problem(**given):
        args = argparse.Namespace(**{"microbatches": 4, "batch_size": 8, "layers_per_stage": None,
                                     "schedule": "zero-bubble", "compile": False, **given})
        with pytest.raises(SystemExit) as stop:
            pp.check_pipeline(args, cfg, 2)
        assert stop.value.code == 1
        return capsys.readouterr().err.strip()  # one line (from rank 0 only, under torchrun)

    # torch runs them in rounds of 2 (the stages): 6 microbatches are 3 rounds, 5 are not
    assert problem(microbatches=5, batch_size=10) == (
        "error: --schedule zero-bubble runs the microbatches in rounds of 2: --microbatches 5 "
        "must be a multiple of 2 (e.g. 4)")
    assert "leave out --compile" in problem(compile=True)
    args = argparse.Namespace(microbatches=6, batch_size=12, layers_per_stage=None,
                              schedule="zero-bubble", compile=False)
    assert pp.check_pipeline(args, cfg, 2) is None
