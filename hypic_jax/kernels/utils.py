"""Helpers shared by the Triton kernels of several families: the in-kernel dot algorithm of a named algorithm,
and the width of a program's block of state columns."""

from __future__ import annotations

from jax import lax

__all__ = ["KERNEL_PRECISION", "dot_precision", "block_width"]

# The `precision` argument of an in-kernel `lax.dot_general` for each dot algorithm name: "bf16" one bfloat16 pass,
# "f32" float32 FMA, "tf32" one TF32 pass, and the split-operand algorithms ("tf32x3", "bf16x3", "bf16x6",
# "bf16x9": the operands split into a high and a low part, the cross products summed in float32).
KERNEL_PRECISION = {
    "bf16": lax.DotAlgorithmPreset.BF16_BF16_F32,
    "f32": lax.Precision.HIGHEST,
    "tf32": lax.Precision.DEFAULT,
    "tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
    "bf16x3": lax.DotAlgorithmPreset.BF16_BF16_F32_X3,
    "bf16x6": lax.DotAlgorithmPreset.BF16_BF16_F32_X6,
    "bf16x9": lax.DotAlgorithmPreset.BF16_BF16_F32_X9,
}


def dot_precision(algorithm: str | None):
    """The in-kernel `precision` of a dot algorithm name (None: "f32"); a ValueError names the known ones."""
    name = "f32" if algorithm is None else algorithm
    if name not in KERNEL_PRECISION:
        raise ValueError(f"algorithm must be one of {tuple(KERNEL_PRECISION)}, got {algorithm!r}")
    return KERNEL_PRECISION[name]


def block_width(block_w: int, width: int) -> int:
    """State columns per program: block_w, halved until it divides the state width (any width works)."""
    bw = min(block_w, width)
    while width % bw:
        bw //= 2
    return bw
