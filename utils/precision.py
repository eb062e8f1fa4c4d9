"""The number formats a training step computes in, and the switches that choose them.

`--precision` (every script) takes one of
    fp32  true float32 everywhere (PyTorch's default for matmuls);
    tf32  float32 tensors, but the GPU's matmuls round their inputs to TensorFloat-32
          (10 mantissa bits) and run on tensor cores: one global switch, nothing else changes;
    bf16  mixed precision: the weights, gradients and optimizer state stay float32 (the
          "master weights"), the forward pass runs its matmuls in bfloat16 under autocast
          (FSDP2: a MixedPrecisionPolicy), and the loss is computed in float32;
    auto  (the default) bf16 on a GPU that has it, fp32 elsewhere.
bf16 keeps float32's exponent range, so unlike float16 it needs no loss scaling.

On a CPU there is no TF32: tf32 runs as fp32. bf16 works on a CPU too (that is how the tests
check it), usually slower than fp32 unless the CPU has bf16 matmul instructions.
"""

from __future__ import annotations

import contextlib

import torch

PRECISIONS = ("fp32", "tf32", "bf16")


def resolve_precision(precision: str, device: torch.device) -> str:
    """`auto` becomes bf16 where the device computes it natively (a CUDA GPU since Ampere),
    else fp32; any other value is returned as it is."""
    if precision == "auto":
        # including_emulation=False: a V100 "supports" bf16 too, emulated: no faster than fp32
        native = device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
        return "bf16" if native else "fp32"
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}: use auto, {', '.join(PRECISIONS)}")
    return precision


def set_precision(precision: str, device: torch.device) -> str:
    """Resolve `auto` and flip the global TF32 switch to match; returns the precision in force.

    The switch is set either way, so a process that ran tf32 before does not leak it into fp32.
    (PyTorch 2.9 replaced `torch.backends.cuda.matmul.allow_tf32` by `fp32_precision`; do not
    mix the two: reading the old flag after setting the new one raises.)
    """
    precision = resolve_precision(precision, device)
    torch.backends.cuda.matmul.fp32_precision = "tf32" if precision == "tf32" else "ieee"
    return precision


def matmul_dtype(precision: str, device: torch.device | None = None) -> str:
    """What the matmuls actually run in: "float32", "tf32" or "bfloat16" (the key of a peak
    FLOP/s table). tf32 on a CPU is float32: there is nothing else there."""
    if precision == "bf16":
        return "bfloat16"
    if precision == "tf32" and (device is None or device.type == "cuda"):
        return "tf32"
    return "float32"


def autocast(precision: str, device: torch.device):
    """The context to run a forward pass and its loss in: bf16 autocast for bf16, else nothing.

    Under autocast the weights stay float32; each matmul casts its inputs to bfloat16, while
    the operations that need range or accuracy (softmax, layer norm, the cross-entropy) run in
    float32. Gradients come back in the weights' dtype, float32.
    """
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def lightning_precision(precision: str) -> str:
    """Lightning's name for it: bf16 autocast with fp32 weights is "bf16-mixed"; tf32 is
    "32-true" plus the global switch (set_precision)."""
    return "bf16-mixed" if precision == "bf16" else "32-true"


def compile_blocks(model, mode: str | None = None) -> None:
    """torch.compile every Transformer block in place (the module keeps its name and its
    state-dict keys, unlike `model = torch.compile(model)`, which prefixes `_orig_mod.`).

    Blocks rather than the whole model, as torchtitan does: all blocks share one compiled
    graph (compiled once, on the first step), and FSDP's and DDP's hooks between blocks stay
    outside the compiled code. The first steps are slow (compilation); then the fused kernels
    save memory traffic. `mode`: torch.compile's (None: its default; "reduce-overhead" adds
    CUDA graphs, which replay a block's kernels with one launch: see the performance step).
    """
    for block in getattr(model, "module", model).layers.values():  # DDP's wrapper: its module
        block.compile(**({"mode": mode} if mode else {}))
