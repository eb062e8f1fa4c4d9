"""Your trained model for the Hugging Face tools: a folder that `transformers` loads with no code
of ours.

    python tools/export_hf.py runs/to_distributed_training hf_model
    python -c 'from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("hf_model")
    tokenizer = AutoTokenizer.from_pretrained("hf_model")
    ids = tokenizer("The history of the", return_tensors="pt").input_ids
    print(tokenizer.decode(model.generate(ids, max_new_tokens=30, do_sample=True)[0]))'

The first argument is what tools/generate.py takes: a run's --out-dir or any model it saved, in
any step's format. The folder holds GPT-2's config.json and the weights as model.safetensors,
and the run's vocabulary as a `tokenizers` WordLevel tokenizer (tokenizer.json: the text split on
white space, <unk> for unknown words, <eos> the end of a line, as in utils/data.py).

The course's Transformer (model/transformer.py) is GPT-2's architecture in every detail that
computes something, so the weights map one to one:
- token and learned position embeddings, added            -> wte, wpe
- pre-norm blocks, x + attn(ln(x)), then x + mlp(ln(x)),  -> ln_1, attn, ln_2, mlp
  LayerNorm with biases and eps 1e-5, and a final LayerNorm -> ln_f
- q_proj, k_proj, v_proj (heads of d_model / n_heads,      -> c_attn: GPT-2 computes q, k and v
  causal, scaled by 1/sqrt(head_dim))                         in one matmul, side by side
- out_proj                                                 -> attn.c_proj
- MLP in_proj, GELU, out_proj                              -> mlp.c_fc, "gelu", mlp.c_proj
  (PyTorch's F.gelu is the exact GELU: "gelu", not GPT-2's own tanh approximation "gelu_new")
- the output layer, its own weights                        -> lm_head, tie_word_embeddings=False
GPT-2 stores its linear layers' weights as (in, out) (its Conv1D), ours as (out, in): transposed.

A model padded by the performance step (--pad-vocab) has more ids than words: the padding rows
of the embedding and the output layer are left out, so the export has exactly the tokenizer's
ids (our generate.py never draws a padding id either). Before writing anything the tool runs
both models on the same tokens and compares their logits: where they differ (a model changed
so that it no longer maps), it refuses, rather than export a model that computes something else.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from utils.args import OneLineParser  # noqa: E402
from utils.checkpointing import atomic_folder  # noqa: E402
from utils.data import EOS, UNK  # noqa: E402
from utils.saved_model import TrainedModel, load_trained_model  # noqa: E402

# Ours -> GPT-2's, per block; the linear layers are transposed (GPT-2's Conv1D)
BLOCK = {"attn_norm": "ln_1", "attn.out_proj": "attn.c_proj", "mlp_norm": "ln_2",
         "mlp.in_proj": "mlp.c_fc", "mlp.out_proj": "mlp.c_proj"}
LINEAR = {"attn.out_proj", "mlp.in_proj", "mlp.out_proj"}


class CannotExport(SystemExit):
    """Why this model cannot become a GPT-2 (one line; nothing is written)."""

    def __init__(self, message: str):
        super().__init__(f"error: {message}")


def parse_args(argv=None):
    p = OneLineParser(description="Export a trained model of the course to the Hugging Face "
                                  "format (GPT-2, safetensors, a WordLevel tokenizer).")
    p.add_argument("run", metavar="RUN_DIR_OR_CHECKPOINT",
                   help="a run's --out-dir, or one model it saved (a .pt or .ckpt file, a folder)")
    p.add_argument("out", metavar="OUT_DIR", help="the folder to write (it must not exist yet)")
    return p.parse_args(argv)


def gpt2_weights(state: dict, n_layers: int, words: int) -> dict:
    """GPT2LMHeadModel's state_dict from ours; the ids from `words` on (padding) left out."""
    state = dict(state)
    out = {"transformer.wte.weight": state.pop("tok_emb.weight")[:words],
           "transformer.wpe.weight": state.pop("pos_emb.weight"),
           "transformer.ln_f.weight": state.pop("norm.weight"),
           "transformer.ln_f.bias": state.pop("norm.bias"),
           "lm_head.weight": state.pop("output.weight")[:words]}
    for i in range(n_layers):
        ours, theirs = f"layers.{i}.", f"transformer.h.{i}."
        for name, gpt2 in BLOCK.items():
            weight = state.pop(f"{ours}{name}.weight")
            out[f"{theirs}{gpt2}.weight"] = weight.t() if name in LINEAR else weight
            out[f"{theirs}{gpt2}.bias"] = state.pop(f"{ours}{name}.bias")
        qkv = [f"{ours}attn.{x}_proj" for x in "qkv"]
        out[f"{theirs}attn.c_attn.weight"] = torch.cat([state.pop(f"{p}.weight").t() for p in qkv], 1)
        out[f"{theirs}attn.c_attn.bias"] = torch.cat([state.pop(f"{p}.bias") for p in qkv])
    if state:
        raise CannotExport(f"the model has weights GPT-2 has no place for ({', '.join(state)}): "
                           "model/transformer.py no longer maps onto GPT-2; nothing written")
    return {name: tensor.contiguous() for name, tensor in out.items()}


def gpt2_model(trained: TrainedModel):
    """The same model as a transformers GPT2LMHeadModel."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg, eos = trained.model.cfg, trained.vocab.index(EOS)
    config = GPT2Config(
        vocab_size=trained.words, n_positions=cfg.max_seq_len, n_embd=cfg.d_model,
        n_layer=cfg.n_layers, n_head=cfg.n_heads, n_inner=cfg.d_ff,
        activation_function="gelu", layer_norm_epsilon=trained.model.norm.eps,
        resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
        tie_word_embeddings=False, bos_token_id=eos, eos_token_id=eos,
        architectures=["GPT2LMHeadModel"])
    model = GPT2LMHeadModel(config)
    model.load_state_dict(gpt2_weights(trained.model.state_dict(), cfg.n_layers, trained.words))
    return model.eval()


def word_tokenizer(vocab: list[str]):
    """The run's vocabulary as a transformers tokenizer: WordLevel, split on white space."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token=UNK))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # str.split(), as utils/data.py
    return PreTrainedTokenizerFast(tokenizer_object=words, unk_token=UNK, eos_token=EOS)


@torch.no_grad()
def compare_logits(trained: TrainedModel, gpt2) -> tuple[bool, float]:
    """Both models on the same random tokens (two full windows), in float64: whether their
    logits for the words agree (the padding ids are not in the export), and by how much they
    differ at most. In float64 the two implementations differ only by rounding (about 1e-15),
    so even a small change of what is computed shows: GPT-2's tanh GELU in place of ours moves
    the logits of a barely trained tiny model by 1e-5, below float32's own noise."""
    tokens = torch.randint(trained.words, (2, trained.model.cfg.max_seq_len),
                           generator=torch.Generator().manual_seed(0))
    ours = trained.model.double()(tokens)[..., :trained.words]
    theirs = gpt2.double()(tokens).logits
    trained.model.float(), gpt2.float()  # float64 -> float32 gives the same weights back
    return torch.allclose(theirs, ours, rtol=1e-9, atol=1e-9), float((theirs - ours).abs().max())


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if out.exists():
        raise CannotExport(f"{out} exists already: give a new folder (or delete it first)")
    trained = load_trained_model(args.run, "cpu")
    from transformers.utils import logging
    logging.disable_progress_bar()
    gpt2 = gpt2_model(trained)
    equal, difference = compare_logits(trained, gpt2)
    if not equal:
        raise CannotExport(f"the GPT-2 version of {trained.checkpoint} computes other logits "
                           f"(they differ by up to {difference:.3g}): model/transformer.py no "
                           "longer maps onto GPT-2; nothing written")
    with atomic_folder(out) as folder:  # complete or absent, with a manifest of its files
        gpt2.save_pretrained(folder)
        word_tokenizer(trained.vocab).save_pretrained(folder)
    padding = trained.model.cfg.vocab_size - trained.words
    params = sum(p.numel() for p in gpt2.parameters())
    print(f"wrote {out}: GPT-2 of {params / 1e6:.1f}M parameters, {trained.words} words"
          + (f" (the {padding} padding ids of --pad-vocab left out)" if padding else "")
          + f"; its logits equal ours (largest difference {difference:.1g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
