"""Numbers, weights and optimizer states of a run against the reference run."""

from __future__ import annotations

import warnings
from pathlib import Path


def near(a, b, rel=1e-4, abs_=1e-5) -> bool:
    return a is not None and b is not None and abs(a - b) <= abs_ + rel * abs(b)


def lists_close(a, b, rel=1e-4) -> bool:
    return a is not None and b is not None and len(a) == len(b) and all(
        near(x, y, rel) for x, y in zip(a, b, strict=True))


def first_difference(mine, theirs, rel=1e-4) -> int | None:
    """Index of the first entry that differs (or where one list ends), None if equal."""
    for i, (x, y) in enumerate(zip(mine, theirs, strict=False)):
        if not near(x, y, rel):
            return i
    return None if len(mine) == len(theirs) else min(len(mine), len(theirs))


def plain_model(model_config: dict):
    from model import TransformerLM
    from model.transformer import ModelConfig
    return TransformerLM(ModelConfig(**model_config))


def load_weights(path: Path, model_config: dict) -> dict:
    """The state dict in a .pt file or a DCP folder, read as a plain model's (or an error)."""
    import torch
    model = plain_model(model_config)
    if path.is_dir():
        import torch.distributed.checkpoint as dcp
        state = model.state_dict()
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore")
            dcp.load(state, checkpoint_id=str(path))
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state)  # strict: raises on any missing or extra key
    return {k: v.float() for k, v in model.state_dict().items()}


def load_checkpoint_state(path: Path, model_config: dict) -> dict:
    """Model and optimizer state of a checkpoint written by save_sharded_model, as plain
    tensors keyed by parameter name ("model.<name>", "optim.<name>.<exp_avg|exp_avg_sq|step>")."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model = plain_model(model_config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # materialise the optimizer's state, so DCP has tensors to load into
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"app": {"model": model_state, "optim": optim_state}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(path))
    flat = {f"model.{k}": v.float() for k, v in state["app"]["model"].items()}
    for name, entry in state["app"]["optim"]["state"].items():
        for key, value in entry.items():
            flat[f"optim.{name}.{key}"] = torch.as_tensor(value).float()
    return flat


def first_different_tensor(a: dict, b: dict, rel=1e-3, abs_=1e-4) -> str | None:
    """The first key whose tensors differ (or that only one side has), None if all agree."""
    import torch
    for k in sorted(set(a) | set(b)):
        if k not in a or k not in b:
            return k
        if a[k].shape != b[k].shape or not torch.allclose(a[k], b[k], rtol=rel, atol=abs_):
            return k
    return None


def weights_close(a, b, rel=1e-3, abs_=1e-4) -> bool:
    return first_different_tensor(a, b, rel, abs_) is None
