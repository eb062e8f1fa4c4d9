"""A decoder-only (causal) Transformer language model.

The network knows nothing about distribution. Its shape is chosen so that every parallelism of
the course applies without touching this file:

- attention and MLP use separate named projections (q_proj, k_proj, v_proj, out_proj; in_proj,
  out_proj), so a tensor-parallel plan is a dict of names;
- attention derives the number of heads from the width of its local projections
  (`view(b, t, -1, head_dim)`), so it works unchanged when TP gives each rank a slice of the heads;
- blocks live in an `nn.ModuleDict` keyed "0".."L-1" and `forward` skips any part set to None,
  so a pipeline stage deletes what it does not own while checkpoint keys stay the same;
- `init_weights()` is separate from `__init__`, so the model can be built on the meta device,
  sharded, and initialised afterwards.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 33278
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 512
    max_seq_len: int = 64
    dropout: float = 0.1

    def __post_init__(self):
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}): "
                "choose a head count that divides the model width")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict:
        return asdict(self)


# Named presets. vocab_size and max_seq_len are filled in from the data and the command line.
PRESETS: dict[str, ModelConfig] = {
    # CI and unit tests: a training step takes milliseconds on a laptop CPU.
    "tiny": ModelConfig(d_model=64, n_heads=4, n_layers=2, d_ff=256, max_seq_len=32),
    # A quick CPU run that still learns real text in a couple of minutes.
    "small": ModelConfig(d_model=128, n_heads=4, n_layers=2, d_ff=512, max_seq_len=64),
    # The course default on one A100: about 20-25 minutes for 10 epochs of WikiText-2
    # (see README, "How long the workshop run takes").
    "workshop": ModelConfig(d_model=768, n_heads=12, n_layers=8, d_ff=3072, max_seq_len=256),
}


def get_config(preset: str, **overrides) -> ModelConfig:
    """The preset's configuration with the given fields replaced (None values are ignored)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}: choose one of {', '.join(PRESETS)}")
    return replace(PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None})


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.dropout = cfg.dropout
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.k_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.out_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only some of the heads.
        q, k, v = (proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        # is_causal masks future positions: a language model must not see the token it predicts.
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(b, t, -1)
        return self.resid_dropout(self.out_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.in_proj = nn.Linear(cfg.d_model, cfg.d_ff)
        self.out_proj = nn.Linear(cfg.d_ff, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.out_proj(F.gelu(self.in_proj(x))))


class Block(nn.Module):
    """Pre-norm Transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TransformerLM(nn.Module):
    """tokens (batch, seq) -> logits (batch, seq, vocab).

    A pipeline stage may set tok_emb/pos_emb (not the first stage) or norm/output (not the last
    stage) to None and delete blocks it does not own; forward then maps hidden states to hidden
    states for the parts that remain.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # Constructing the layers draws (discarded) default weights from the RNG; rewind it so
        # init_weights() draws exactly what it would draw for a model built on the meta device.
        rng_state = torch.random.get_rng_state()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.emb_dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm = nn.LayerNorm(cfg.d_model)
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if self.output.weight.device.type != "meta":
            torch.random.set_rng_state(rng_state)
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every parameter from the current torch RNG state.

        All randomness is drawn here, in module order, so a model built on the meta device,
        moved with `to_empty()` and initialised with the same seed gets identical weights.
        """
        std = 0.02
        # GPT-2: scale the projections that write into the residual stream by depth.
        resid_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                out_proj = name.endswith("out_proj")
                nn.init.normal_(module.weight, mean=0.0, std=resid_std if out_proj else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = tokens
        if self.tok_emb is not None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            h = self.emb_dropout(self.tok_emb(tokens) + self.pos_emb(positions))
        for block in self.layers.values():
            h = block(h)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Parameter count; with exclude_embeddings, the lookup tables are left out
        (they cost no FLOPs). The output projection is a real matmul and is counted."""
        skip = {"tok_emb.weight", "pos_emb.weight"} if exclude_embeddings else set()
        return sum(p.numel() for n, p in self.named_parameters() if n not in skip)
