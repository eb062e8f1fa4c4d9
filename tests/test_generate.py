"""What a trained model writes, from the files of every step (tools/generate.py, one loader for
every format in utils/saved_model.py), and its export to Hugging Face transformers
(tools/export_hf.py).

One tiny run, trained once by several steps' solutions with the same seed, data and global batch
(dropout 0): every format they save must give the same weights, the same logits and the same
sampled text. The steps not run here save in formats that are: TP and the memory step through
save_full_model like FSDP's final_model.pt, the capstone a folder like the pipeline's (their own
tests hold their weights to one process's).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import assert_same_weights, load_script, run_script, script_env
from model import transformer
from utils.saved_model import load_trained_model

pytestmark = pytest.mark.warm_start  # runs forked warm: tests/warm_launch.py
COMMON = ("--dataset", "synthetic", "--preset", "tiny", "--dropout", 0, "--seed", 3,
          "--logger", "none", "--max-steps", 4)
PROMPT = "w1 w2 w3 w4 w5"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache) -> Path:
    """The same run (global batch 8, 4 steps) by FSDP on 2 ranks and, in one process each, by
    DDP, the pipeline, Lightning, and the performance step (which pads 502 words to 512 ids)."""
    root = tmp_path_factory.mktemp("saved_models")
    env = script_env(cache_dir=data_cache)
    run_script("solutions/train/fsdp_training.py", *COMMON, "--batch-size", 4,
               "--out-dir", root / "fsdp", nproc=2, env=env, timeout=240)
    for step, extra in (("to_distributed_training", ()), ("pp_training", ()),
                        ("Lit_training", ("--devices", 1)), ("perf_training", ())):
        run_script(f"solutions/train/{step}.py", *COMMON, "--batch-size", 8, *extra,
                   "--out-dir", root / step, env=env, timeout=240)
    return root


@pytest.fixture(scope="module")
def generate():
    return load_script("tools/generate.py")


@torch.no_grad()
def logits_and_text(trained, generate) -> tuple[torch.Tensor, str]:
    ids, _ = generate.encode(PROMPT, trained.vocab)
    logits = trained.model(torch.tensor([ids]))[0]
    new = generate.generate(trained.model, ids, 20, trained.words, temperature=1.0, seed=7)
    return logits, generate.decode(new, trained.vocab)


def test_every_format_of_the_same_run_loads_to_the_same_weights_logits_and_text(runs, generate):
    reference = load_trained_model(runs / "to_distributed_training")  # one process, save0
    assert reference.checkpoint.name == "final_model.pt"
    ref_logits, ref_text = logits_and_text(reference, generate)
    assert len(ref_text.split()) == 20
    for path, expected in [
            (runs / "to_distributed_training" / "best_model.pt", "best_model.pt"),
            (runs / "fsdp", "final_model.pt"),                  # save_full_model
            (runs / "fsdp" / "checkpoints" / "last", "last"),   # DCP by 2 ranks, with optimizer
            (runs / "fsdp" / "checkpoints" / "best", "best"),
            (runs / "pp_training", "final_model"),               # DCP of the model alone
            (runs / "pp_training" / "best_model", "best_model"),
            (runs / "Lit_training", "last.ckpt"),                # Lightning
    ]:
        trained = load_trained_model(path)
        assert trained.checkpoint.name == expected
        assert trained.vocab == reference.vocab
        assert_same_weights(trained.model.state_dict(), reference.model.state_dict())
        logits, text = logits_and_text(trained, generate)
        torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-4, msg=str(path))
        assert text == ref_text, path


def test_a_dcp_checkpoint_written_by_two_ranks_loads_in_one_process(runs):
    checkpoint = runs / "fsdp" / "checkpoints" / "last"
    assert json.loads((checkpoint / "manifest.json").read_text())["world_size"] == 2
    assert {f.name for f in checkpoint.glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    # the same step as the run's final_model.pt, gathered from the same shards: bit for bit
    final = torch.load(runs / "fsdp" / "final_model.pt", weights_only=True)
    loaded = load_trained_model(checkpoint).model.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in final.items()) and loaded.keys() == final.keys()


def test_generate_writes_text_after_the_prompt_and_reads_unknown_words_as_unk(runs, generate,
                                                                               capsys):
    assert generate.main([str(runs / "pp_training"), "--prompt", "w1 notaword w2 notaword w3",
                          "--max-new-tokens", "40", "--seed", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    summary = json.loads((runs / "pp_training" / "summary.json").read_text())
    assert out[0] == f"model: {runs / 'pp_training' / 'final_model'} (0.2M parameters, 502 words)"
    assert out[1].startswith("trained by pp_training.py, preset tiny, 4 steps; perplexity")
    assert out[1].endswith(f"test {summary['test_ppl']:.1f}")
    assert [line for line in out if "<unk>" in line and "note" in line] == [
        "note: not in the run's vocabulary, read as <unk>: notaword"]
    lines = out[out.index("") + 1:]  # after an empty line; a line break for every <eos>
    words = " ".join(lines).split()
    assert words[:5] == ["w1", "<unk>", "w2", "<unk>", "w3"]
    assert len(words) + len(lines) - 1 == 5 + 40


def test_generation_slides_its_window_past_the_context_length(runs, generate):
    trained = load_trained_model(runs / "fsdp")
    window = trained.model.cfg.max_seq_len
    seen = []
    trained.model.register_forward_pre_hook(lambda _, args: seen.append(args[0][0].tolist()))
    ids = generate.generate(trained.model, [1], window + 10, trained.words, temperature=0)
    assert [len(s) for s in seen] == [*range(1, window + 1), *[window] * 10]
    assert seen[-1] == ([1] + ids)[-window - 1:-1]  # the newest words, the oldest dropped


def test_generation_never_draws_a_padding_id(runs, generate):
    trained = load_trained_model(runs / "perf_training")
    assert (trained.words, trained.model.cfg.vocab_size) == (502, 512)  # --pad-vocab 64
    # Nearly uniform over all 512 ids: without the cut, about 2 draws in 100 would be padding.
    ids = generate.generate(trained.model, [1], 300, trained.words, temperature=10, top_k=0)
    assert max(ids) < 502 and len(set(ids)) > 200


def damaged_copies(runs: Path, tmp_path: Path):
    """(run folder, what is broken in it, the line expected) for three kinds of damage."""
    for name, where, damage, expected in [
            ("flipped", "final_model.pt", "flip", "does not match its checksum"),
            ("missing_shard", "checkpoints/last", "__1_0.distcp", "__1_0.distcp is missing"),
            ("unsealed", "final_model", "manifest.json", "has no manifest.json")]:
        step = "pp_training" if where == "final_model" else "fsdp"
        run = tmp_path / name
        run.mkdir()
        for keep in ("summary.json", "vocab.txt"):
            shutil.copy(runs / step / keep, run)
        source = runs / step / where
        (run / where).parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if source.is_dir() else shutil.copy)(source, run / where)
        if damage == "flip":
            data = bytearray((run / where).read_bytes())
            data[len(data) // 2] ^= 0xFF
            (run / where).write_bytes(bytes(data))
        else:
            (run / where / damage).unlink()
        yield run / where, expected


def test_a_damaged_or_incomplete_checkpoint_is_refused_in_one_line(runs, generate, tmp_path,
                                                                   capsys):
    for checkpoint, expected in damaged_copies(runs, tmp_path):
        with pytest.raises(SystemExit) as stop:
            generate.main([str(checkpoint)])
        assert stop.value.code == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {checkpoint} cannot be loaded: ")
        assert expected in err[0], err[0]


def test_a_run_without_vocab_txt_takes_its_words_from_its_data(runs, tmp_path, data_cache,
                                                               monkeypatch):
    monkeypatch.setenv("COURSE_DATA_CACHE", str(data_cache))
    old_run = tmp_path / "old_run"
    shutil.copytree(runs / "perf_training", old_run)
    (old_run / "vocab.txt").unlink()
    assert load_trained_model(old_run).vocab == load_trained_model(runs / "perf_training").vocab


# ---------------------------------------------------------------------------------------------
# The export to Hugging Face transformers

@pytest.fixture(scope="module")
def export_hf():
    return load_script("tools/export_hf.py")


def test_the_hf_export_loads_in_transformers_with_our_logits_words_and_text(runs, generate,
                                                                            export_hf, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # the padded model: the export leaves the 10 padding ids out, as the tokenizer has 502 words
    assert export_hf.main([str(runs / "perf_training"), str(tmp_path / "hf")]) == 0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    ours = load_trained_model(runs / "perf_training")
    prompt = "w1 notaword w2 w3 w4 <eos> w5"
    ids, _ = generate.encode(prompt, ours.vocab)
    assert tokenizer(prompt).input_ids == ids
    assert tokenizer.decode(ids) == "w1 <unk> w2 w3 w4 <eos> w5"
    with torch.no_grad():  # in float64, where a tanh GELU for ours would show (1e-5)
        theirs = hf.double()(torch.tensor([ids])).logits[0]
        mine = ours.model.double()(torch.tensor([ids]))[0]
    assert theirs.shape == (len(ids), 502)
    torch.testing.assert_close(theirs, mine[:, :502], rtol=1e-9, atol=1e-9)
    # greedy text, until transformers stops at its <eos>
    written = hf.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)[0, len(ids):]
    assert written.tolist() == generate.generate(ours.model, ids, len(written), 502,
                                                 temperature=0)


def test_the_export_refuses_a_model_that_gpt2_would_compute_differently(runs, export_hf,
                                                                       tmp_path, monkeypatch):
    # GPT-2's own GELU (tanh) in our MLP: every weight still maps, the logits would not
    approximate = lambda self, x: self.out_proj(torch.nn.functional.gelu(self.in_proj(x),  # noqa: E731
                                                                          approximate="tanh"))
    monkeypatch.setattr(transformer.MLP, "forward", approximate)
    with pytest.raises(SystemExit, match="computes other logits .* nothing written"):
        export_hf.main([str(runs / "fsdp"), str(tmp_path / "hf")])
    assert not (tmp_path / "hf").exists()


def test_the_export_refuses_weights_gpt2_has_no_place_for(runs, export_hf):
    state = torch.load(runs / "fsdp" / "final_model.pt", weights_only=True)
    assert len(export_hf.gpt2_weights(state, 2, 502)) == 5 + 2 * 12
    state["layers.0.attn.rotary.freqs"] = torch.zeros(4)
    with pytest.raises(SystemExit, match=r"no place for \(layers.0.attn.rotary.freqs\)"):
        export_hf.gpt2_weights(state, 2, 502)
