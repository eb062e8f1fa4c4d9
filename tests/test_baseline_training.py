"""The baseline participants start from: train/to_distributed_training.py before any TODO."""

import math
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from conftest import read_summary, run_script, script_env
from model import TransformerLM, get_config
from utils.data import TokenWindows, load_corpus

pytestmark = pytest.mark.warm_start  # runs forked warm: tests/warm_launch.py
EXERCISE = "train/to_distributed_training.py"
SUMMARY_FIELDS = {"world_size", "steps", "loss_history", "val_loss", "val_ppl", "test_loss",
                  "test_ppl", "tokens_per_s", "mfu", "peak_mem_bytes"}


def evaluate_file(checkpoint, corpus, preset, seq_len, split="test"):
    """Token-weighted loss of a saved state dict, computed here without the training script."""
    model = TransformerLM(get_config(preset, vocab_size=corpus.vocab_size, max_seq_len=seq_len))
    model.load_state_dict(torch.load(checkpoint, weights_only=True))
    model.eval()
    windows = TokenWindows(getattr(corpus, split), seq_len)
    x = torch.stack([windows[i][0] for i in range(len(windows))])
    y = torch.stack([windows[i][1] for i in range(len(windows))])
    with torch.no_grad():
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()


def unigram_cross_entropy(corpus) -> float:
    """Loss of the best context-free model: training-split word frequencies (add-one smoothed)."""
    counts = Counter(corpus.train.tolist())
    total = len(corpus.train) + corpus.vocab_size
    return -sum(math.log((counts[t] + 1) / total) for t in corpus.valid.tolist()) / len(corpus.valid)


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory, data_cache):
    out = tmp_path_factory.mktemp("baseline")
    proc = run_script(EXERCISE, "--dataset", "synthetic", "--preset", "tiny", "--max-steps", 60,
                      "--batch-size", 16, "--out-dir", out, env=script_env(cache_dir=data_cache))
    return out, proc


def test_the_exercise_trains_as_a_plain_single_process_run_and_the_loss_falls(synthetic_run):
    out, proc = synthetic_run
    summary = read_summary(out)
    assert SUMMARY_FIELDS <= summary.keys()
    assert summary["world_size"] == 1 and summary["steps"] == 60
    history = summary["loss_history"]
    assert len(history) == 60
    assert sum(history[-10:]) / 10 < sum(history[:10]) / 10 - 0.5
    assert summary["tokens_per_s"] > 0 and 0 < summary["mfu"] < 1
    assert "test loss" in proc.stdout and "Traceback" not in proc.stderr


def test_saved_models_load_with_weights_only_and_reproduce_the_reported_test_loss(synthetic_run, data_cache):
    out, _ = synthetic_run
    corpus = load_corpus("synthetic", cache_dir=data_cache)
    summary = read_summary(out)
    loss = evaluate_file(out / "final_model.pt", corpus, "tiny", summary["seq_len"])
    assert loss == pytest.approx(summary["test_loss"], rel=1e-5)
    assert (out / "best_model.pt").is_file()


def test_tensorboard_logs_land_under_the_output_folder(synthetic_run):
    out, _ = synthetic_run
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))


def test_on_real_wikitext2_a_short_run_beats_the_unigram_model_clearly(tmp_path, data_cache, wikitext2_dir):
    out = tmp_path / "run"
    run_script(EXERCISE, "--data-dir", wikitext2_dir, "--preset", "tiny", "--max-steps", 150,
               "--batch-size", 32, "--lr", 3e-3, "--logger", "none", "--out-dir", out,
               env=script_env(cache_dir=data_cache))
    corpus = load_corpus("wikitext-2", wikitext2_dir, data_cache)
    summary = read_summary(out)
    unigram = unigram_cross_entropy(corpus)
    assert summary["val_loss"] < unigram - 0.25, (summary["val_loss"], unigram)


def test_wandb_logs_offline_under_the_output_folder(tmp_path, data_cache):
    out = tmp_path / "run"
    run_script(EXERCISE, "--dataset", "synthetic", "--preset", "tiny", "--max-steps", 3,
               "--logger", "wandb", "--out-dir", out,
               env=script_env(cache_dir=data_cache, WANDB_SILENT="true"))
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
