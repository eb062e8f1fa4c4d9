"""The network: causal, deterministic, splittable, and free of torch.distributed."""

import subprocess
import sys

import pytest
import torch

from model import PRESETS, ModelConfig, TransformerLM, get_config

CFG = get_config("tiny", vocab_size=50, max_seq_len=16, dropout=0.0)


def build(seed=0, cfg=CFG):
    torch.manual_seed(seed)
    return TransformerLM(cfg)


def test_logits_have_one_row_per_position_and_one_column_per_word():
    logits = build()(torch.randint(50, (3, 16)))
    assert logits.shape == (3, 16, 50)


def test_changing_a_future_token_never_changes_earlier_logits():
    model = build().eval()
    tokens = torch.randint(50, (2, 16))
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 50
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=0)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_the_same_seed_builds_identical_weights_and_another_seed_does_not():
    a, b, c = build(1).state_dict(), build(1).state_dict(), build(2).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_a_model_built_on_the_meta_device_and_initialised_later_equals_a_directly_built_one():
    with torch.device("meta"):
        model = TransformerLM(CFG)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    direct = build(0).state_dict()
    assert all(torch.equal(direct[k], v) for k, v in model.state_dict().items())


def test_two_halves_with_the_other_half_deleted_compute_the_full_model():
    """What a pipeline stage does: delete the parts it does not own, keep checkpoint keys."""
    full = build().eval()
    first, second = build().eval(), build().eval()
    del first.layers["1"]
    first.norm = first.output = None
    del second.layers["0"]
    second.tok_emb = second.pos_emb = None
    tokens = torch.randint(50, (2, 16))
    torch.testing.assert_close(second(first(tokens)), full(tokens))
    assert set(first.state_dict()) | set(second.state_dict()) == set(full.state_dict())


def test_attention_takes_the_head_count_from_its_projection_width():
    """Under tensor parallelism a rank holds half the heads: the same code must still run."""
    attn = build().layers["0"].attn
    half = CFG.d_model // 2
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attn, name, torch.nn.Linear(CFG.d_model, half))
    attn.out_proj = torch.nn.Linear(half, CFG.d_model)
    assert attn(torch.randn(2, 16, CFG.d_model)).shape == (2, 16, CFG.d_model)


def test_counting_parameters_without_embeddings_leaves_out_only_the_lookup_tables():
    model = build()
    tables = model.tok_emb.weight.numel() + model.pos_emb.weight.numel()
    assert model.num_params() - model.num_params(exclude_embeddings=True) == tables


def test_a_head_count_that_does_not_divide_the_width_is_refused_with_a_clear_message():
    with pytest.raises(ValueError, match="divisible by n_heads"):
        ModelConfig(d_model=100, n_heads=3)


def test_an_unknown_preset_names_the_known_ones():
    with pytest.raises(ValueError, match="tiny, small, workshop"):
        get_config("huge")


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_builds_and_runs(preset):
    cfg = get_config(preset, vocab_size=100)
    with torch.device("meta"):
        model = TransformerLM(cfg)
    assert model(torch.zeros(1, cfg.max_seq_len, dtype=torch.long, device="meta")).shape == \
        (1, cfg.max_seq_len, 100)


def test_the_model_package_imports_nothing_from_torch_distributed():
    code = ("import sys, model, model.transformer; "
            "print(sorted(m for m in sys.modules if m.startswith('torch.distributed')))")
    before = subprocess.run([sys.executable, "-c", "import sys, torch; print(sorted(m for m in "
                             "sys.modules if m.startswith('torch.distributed')))"],
                            capture_output=True, text=True, check=True).stdout
    after = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True).stdout
    assert after == before  # nothing beyond what `import torch` itself loads
    source = (__import__("model").transformer.__file__)
    assert "torch.distributed" not in open(source).read()
