"""WikiText data: vocabulary and its cap, windows, samplers, cache, and the offline errors."""

import hashlib
import math
import subprocess
import sys
import time
import types
from collections import Counter

import pytest
import torch

from conftest import ROOT, run_script, script_env
from utils import data
from utils.args import base_parser
from utils.data import (EOS, IGNORE_INDEX, UNK, DataUnavailableError, DistributedEvalSampler,
                        TokenWindows, hub_cache_file, load_corpus)


@pytest.fixture
def text_dir(tmp_path):
    d = tmp_path / "text"
    d.mkdir()
    (d / "train.txt").write_text(" = Title = \n\n the cat sat on the mat \n the dog sat \n")
    (d / "valid.txt").write_text(" the cat ate the fish \n")
    (d / "test.txt").write_text(" a dog sat \n")
    return d


def test_the_vocabulary_comes_from_the_training_split_and_other_words_become_unk(text_dir, tmp_path):
    corpus = load_corpus("wikitext-2", text_dir, tmp_path / "cache")
    assert corpus.vocab[:2] == [UNK, EOS]
    assert "fish" not in corpus.vocab and "ate" not in corpus.vocab  # valid-only words
    valid = [corpus.vocab[i] for i in corpus.valid]
    assert valid == ["the", "cat", UNK, "the", UNK, EOS]


def test_every_line_ends_with_eos_as_in_the_standard_wikitext2_form(text_dir, tmp_path):
    corpus = load_corpus("wikitext-2", text_dir, tmp_path / "cache")
    train = [corpus.vocab[i] for i in corpus.train]
    assert train.count(EOS) == 4  # heading, empty line, two sentences
    assert train[:4] == ["=", "Title", "=", EOS]


def test_the_official_wiki_tokens_file_names_are_read_too(text_dir, tmp_path):
    for split in ("train", "valid", "test"):
        (text_dir / f"{split}.txt").rename(text_dir / f"wiki.{split}.tokens")
    assert load_corpus("auto", text_dir, tmp_path / "cache").vocab_size == 10


def write_splits(folder, train, valid="", test=""):
    folder.mkdir()
    for split, text in (("train", train), ("valid", valid), ("test", test)):
        (folder / f"{split}.txt").write_text(text)
    return folder


def test_a_vocabulary_cap_keeps_the_most_frequent_training_words_and_the_rest_become_unk(tmp_path):
    text = write_splits(tmp_path / "text", train="a a a b b c \n a b d \n", valid="d b a \n")
    corpus = load_corpus("wikitext-2", text, tmp_path / "cache", max_vocab=4)
    assert corpus.vocab == [UNK, EOS, "a", "b"] and corpus.vocab_size == 4
    assert [corpus.vocab[i] for i in corpus.train] == ["a", "a", "a", "b", "b", UNK, EOS,
                                                       "a", "b", UNK, EOS]
    assert [corpus.vocab[i] for i in corpus.valid] == [UNK, "b", "a", EOS]


def test_wikitext103_is_capped_at_32768_words_by_default_and_wikitext2_is_not(tmp_path):
    words = " ".join(f"w{i}" for i in range(33_000))
    text = write_splits(tmp_path / "text", train=f"{words} \n{words} w0 \n", valid="w1 \n")
    assert load_corpus("wikitext-103", text, tmp_path / "cache").vocab_size == 32_768
    assert load_corpus("wikitext-2", text, tmp_path / "cache").vocab_size == 33_002


def test_each_vocabulary_cap_has_its_own_cache_file(text_dir, tmp_path):
    cache = tmp_path / "cache"
    for max_vocab in (None, 5, 5, 6):
        load_corpus("wikitext-2", text_dir, cache, max_vocab=max_vocab)
    assert len(list(cache.glob("*.pt"))) == 3
    assert hub_cache_file(cache, "wikitext-103", 50_000) != hub_cache_file(cache, "wikitext-103")


def test_the_wikitext2_cache_file_keeps_the_name_it_had_before_caps_existed(tmp_path):
    old_key = "1:hub:Salesforce/wikitext:wikitext-2-v1"  # CACHE_FORMAT:hub:HUB_NAME:HUB_CONFIG
    old_name = f"wikitext-2-{hashlib.sha256(old_key.encode()).hexdigest()[:16]}.pt"
    assert hub_cache_file(tmp_path) == hub_cache_file(tmp_path, "wikitext-2") == tmp_path / old_name
    assert hub_cache_file(tmp_path, "wikitext-103").name.startswith("wikitext-103-")


def test_wikitext103_is_downloaded_as_its_own_hub_configuration_and_cached(tmp_path, monkeypatch):
    calls = []

    def load_dataset(*args, **kwargs):  # stands in for datasets.load_dataset: no network
        calls.append((args, kwargs))
        return {s: {"text": [" the cat sat \n", " the dog \n"]} for s in ("train", "validation", "test")}

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    monkeypatch.setattr(data, "hub_reachable", lambda: True)
    cache = tmp_path / "cache"
    corpus = load_corpus("wikitext-103", cache_dir=cache)
    assert [args for args, _ in calls] == [("Salesforce/wikitext", "wikitext-103-v1")]
    assert corpus.source == "hub:Salesforce/wikitext:wikitext-103-v1" and corpus.vocab_size == 6
    assert hub_cache_file(cache, "wikitext-103").is_file()
    monkeypatch.setattr(data, "hub_reachable", lambda: False)
    assert torch.equal(load_corpus("wikitext-103", cache_dir=cache).train, corpus.train)
    assert len(calls) == 1  # the second load read the cache


def test_a_max_vocab_below_two_stops_the_script_with_one_argparse_line(capsys):
    with pytest.raises(SystemExit) as stop:
        base_parser("train.py", None).parse_args(["--max-vocab", "0"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1
    assert ": error: argument --max-vocab: 0 is not allowed" in err


def test_a_folder_without_the_split_files_is_refused_with_the_names_it_needs(tmp_path):
    with pytest.raises(DataUnavailableError, match="train.txt, valid.txt and test.txt"):
        load_corpus("wikitext-2", tmp_path, tmp_path / "cache")


def test_windows_are_disjoint_and_predict_every_token_exactly_once():
    tokens = torch.arange(103)
    ds = TokenWindows(tokens, seq_len=10)
    assert len(ds) == 10
    inputs = torch.cat([ds[i][0] for i in range(len(ds))])
    targets = torch.cat([ds[i][1] for i in range(len(ds))])
    assert torch.equal(inputs, tokens[:100])
    assert torch.equal(targets, tokens[1:101])
    x, y = ds[3]
    assert torch.equal(y[:-1], x[1:])  # targets are the inputs shifted by one


def test_a_padding_sample_has_no_targets():
    x, y = TokenWindows(torch.arange(50), seq_len=10)[99]
    assert x.shape == y.shape == (10,) and (y == IGNORE_INDEX).all()


def test_a_split_shorter_than_one_window_has_no_samples():
    assert len(TokenWindows(torch.arange(5), seq_len=10)) == 0  # check_splits says what to do


@pytest.mark.parametrize("n, world", [(10, 1), (10, 3), (7, 2), (2, 4)])
def test_the_eval_sampler_gives_ranks_equal_counts_and_every_sample_exactly_once(n, world):
    shards = [list(DistributedEvalSampler(range(n), world, r)) for r in range(world)]
    assert len({len(s) for s in shards}) == 1
    real = [i for s in shards for i in s if i < n]
    assert sorted(real) == list(range(n))


def test_the_synthetic_corpus_is_learnable_and_deterministic(tmp_path):
    a = load_corpus("synthetic", cache_dir=tmp_path / "a")
    b = load_corpus("synthetic", cache_dir=tmp_path / "b")
    assert torch.equal(a.train, b.train) and a.vocab == b.vocab
    # each word has a few likely successors: the bigram entropy is far below the unigram one
    pairs = Counter(zip(a.train[:-1].tolist(), a.train[1:].tolist()))
    firsts = Counter(a.train[:-1].tolist())
    n = len(a.train) - 1
    bigram = -sum(c / n * math.log(c / firsts[p]) for (p, _), c in pairs.items())
    unigram = -sum(c / n * math.log(c / n) for c in firsts.values())
    assert bigram < unigram - 2


def test_the_cache_is_built_once_and_then_read_without_tokenising(text_dir, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = load_corpus("wikitext-2", text_dir, cache)
    assert len(list(cache.glob("*.pt"))) == 1
    monkeypatch.setattr(data, "build_corpus", lambda *a: pytest.fail("the cache was not used"))
    again = load_corpus("wikitext-2", text_dir, cache)
    assert torch.equal(first.train, again.train) and first.vocab == again.vocab


def test_changed_text_files_get_a_new_cache_entry(text_dir, tmp_path):
    cache = tmp_path / "cache"
    load_corpus("wikitext-2", text_dir, cache)
    (text_dir / "train.txt").write_text(" new words here \n")
    assert "new" in load_corpus("wikitext-2", text_dir, cache).vocab
    assert len(list(cache.glob("*.pt"))) == 2


def test_several_processes_building_the_cache_at_once_leave_one_good_file(tmp_path, wikitext2_dir):
    cache = tmp_path / "cache"
    code = ("import sys; from utils.data import load_corpus; "
            "c = load_corpus('wikitext-2', sys.argv[1], sys.argv[2]); print(len(c.train))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(wikitext2_dir), str(cache)],
                              stdout=subprocess.PIPE, text=True, cwd=ROOT) for _ in range(4)]
    outputs = {p.communicate(timeout=120)[0] for p in procs}
    assert all(p.returncode == 0 for p in procs) and len(outputs) == 1
    assert [f.suffix for f in cache.iterdir()] == [".pt"]  # no temporary files left
    start = time.perf_counter()
    corpus = load_corpus("wikitext-2", wikitext2_dir, cache)
    assert time.perf_counter() - start < 1.0
    assert str(len(corpus.train)) == outputs.pop().strip()


@pytest.mark.parametrize("dataset, prepare", [
    ("wikitext-2", "python prepare_data.py"),
    ("wikitext-103", "python prepare_data.py --dataset wikitext-103"),
])
def test_without_cache_and_hub_a_hub_dataset_is_refused_with_the_prepare_step(
        tmp_path, monkeypatch, dataset, prepare):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "cache"
    with pytest.raises(DataUnavailableError, match=f"run `{prepare}` on a login node"):
        load_corpus(dataset, cache_dir=cache)
    assert not cache.exists() or not any(cache.iterdir())


def test_without_cache_and_hub_auto_falls_back_to_synthetic_with_one_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    warnings = []
    corpus = load_corpus("auto", cache_dir=tmp_path / "cache", warn=warnings.append)
    assert corpus.source == "synthetic"
    assert len(warnings) == 1 and "SYNTHETIC" in warnings[0]


def test_the_hub_check_answers_at_once_when_offline_variables_are_set(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    start = time.perf_counter()
    assert data.hub_reachable() is False
    assert time.perf_counter() - start < 0.1


@pytest.mark.parametrize("dataset, title, prepare", [
    ("wikitext-2", "WikiText-2", "`python prepare_data.py`"),
    ("wikitext-103", "WikiText-103", "`python prepare_data.py --dataset wikitext-103`"),
])
def test_a_training_run_without_data_stops_at_once_with_one_line(tmp_path, dataset, title, prepare):
    proc = run_script("train/to_distributed_training.py", "--dataset", dataset,
                      "--out-dir", tmp_path / "run", env=script_env(cache_dir=tmp_path / "cache"),
                      check=False, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]  # exactly one line
    assert proc.stderr.startswith(f"error: {title} is not cached") and prepare in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("dataset, title", [("wikitext-2", "WikiText-2"),
                                            ("wikitext-103", "WikiText-103")])
def test_prepare_data_offline_says_in_one_line_that_it_downloaded_nothing(tmp_path, dataset, title):
    proc = subprocess.run([sys.executable, "prepare_data.py", "--dataset", dataset,
                           "--cache-dir", str(tmp_path / "cache")], cwd=ROOT, env=script_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1
    assert f"hub is not reachable from here, so {title} was not downloaded" in proc.stderr


@pytest.mark.parametrize("args, words", [(["--dataset", "wikitext-3"], "invalid choice: 'wikitext-3'"),
                                         (["--max-vocab", "ten"], "--max-vocab"),
                                         (["--epochs", "2"], "unrecognized arguments: --epochs")])
def test_prepare_data_refuses_a_bad_flag_in_one_line(tmp_path, args, words):
    proc = subprocess.run([sys.executable, "prepare_data.py", *args, "--cache-dir",
                           str(tmp_path / "cache")], cwd=ROOT, env=script_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("prepare_data.py: error:")
    assert words in proc.stderr
    assert not (tmp_path / "cache").exists()


def test_prepare_data_tokenises_local_files_into_the_cache_training_then_uses(tmp_path, text_dir):
    cache = tmp_path / "cache"
    proc = subprocess.run([sys.executable, "prepare_data.py", "--data-dir", str(text_dir),
                           "--cache-dir", str(cache)], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "vocabulary 10" in proc.stdout and len(list(cache.glob("*.pt"))) == 1
