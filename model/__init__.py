"""The network: a causal Transformer language model and its configuration presets."""

from model.transformer import PRESETS, ModelConfig, TransformerLM, get_config

__all__ = ["PRESETS", "ModelConfig", "TransformerLM", "get_config"]
