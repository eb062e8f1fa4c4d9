"""The random-number states a resumed run needs to continue exactly (dropout, anything random).

Python's `random`, NumPy's global generator, torch's CPU generator and every CUDA device's
generator: all of one process. Each rank saves its own (their states differ on GPUs, and a
rank's dropout masks must continue where that rank stopped).
"""

from __future__ import annotations

import random

import torch


def rng_states() -> dict:
    """This process's generator states, as plain values and tensors (they load with
    torch.load(weights_only=True))."""
    states = {"python": random.getstate(), "torch": torch.get_rng_state(),
              "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
    try:
        import numpy as np
    except ImportError:
        return states
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    states["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss)
    return states


def set_rng_states(states: dict) -> None:
    """Put back what rng_states() returned (the CUDA states only where there are as many GPUs)."""
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(states["torch"])
    if states["cuda"] and torch.cuda.is_available() and \
            len(states["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(states["cuda"])
    if "numpy" in states:
        import numpy as np
        kind, keys, pos, has_gauss, gauss = states["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))
