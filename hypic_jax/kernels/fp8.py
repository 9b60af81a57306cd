"""Block-wise FP8 weights: float8_e4m3fn values with one float32 scale per block of rows and column.

The checkpoints Qwen publishes beside its bf16 ones (and that `hypic-jax convert --quantize fp8` writes) store each
quantized `nn.Linear` weight [out, in] as float8_e4m3fn with `weight_scale_inv` [ceil(out/B), ceil(in/B)], one
float32 per B x B block (B = 128), and W = q * s[o // B, i // B]. Here a weight is stored as `x @ w` reads it,
[..., K, N] (K = in, N = out), with its scale expanded along N to one per (block of B rows of K, column):

    w[..., k, n] = value[..., k, n] * scale[..., k // B, n]          value: float8_e4m3fn, scale: float32

Why per column rather than per B x B block: the converters fuse, split and permute output columns (gate | up, the
heads of a qkv projection); a per-column scale moves with its column, so any such rearrangement stays exact
whatever the widths (a tiny model's 32-wide gate and up share no 128 block). It costs 4 / B bytes per weight
(3% of the FP8 bytes at B = 128). Scales along K stay per block, so a kernel that walks K in tiles dividing B
multiplies each tile's partial product by one scale row: `partial[m, n] * scale[k // B, n]`.

`BlockFP8` reads like the bf16 weight it replaces: `x @ w` dequantizes into x's dtype (XLA fuses the scaling into
the product's operand), `.shape` is the weight's, `.dtype` the dtype it dequantizes to, and tree maps over a
parameter tree (stacking layers, slicing one out, sharding) act on value and scale alike, which share every axis
but the last two. The grouped expert matmul reads value and scale in its kernel
(`grouped_matmul.gmm(..., scales=)`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

__all__ = ["BlockFP8", "FP8_DTYPE", "FP8_MAX", "BLOCK", "quantize", "dequantize", "block_scales",
           "is_fp8", "weight_bytes"]

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
BLOCK = 128  # the checkpoints' weight_block_size


@jax.tree_util.register_pytree_with_keys_class
class BlockFP8:
    """A weight [..., K, N] as FP8 `value` [..., K, N] and float32 `scale` [..., ceil(K / block), N]; `dtype` is
    the dtype it dequantizes to (the model's activation dtype)."""

    def __init__(self, value, scale, block: int = BLOCK, dtype: Any = jnp.bfloat16):
        self.value, self.scale, self.block, self._dtype = value, scale, int(block), jnp.dtype(dtype)

    # --- reads like an array -------------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape)

    @property
    def ndim(self) -> int:
        return len(self.value.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.value.shape))

    @property
    def dtype(self):
        return self._dtype

    @property
    def nbytes(self) -> int:
        return weight_bytes(self)

    def astype(self, dtype) -> Array:
        return dequantize(self, dtype)

    def __rmatmul__(self, x) -> Array:
        return jnp.matmul(x, dequantize(self, x.dtype))

    def __repr__(self) -> str:
        return f"BlockFP8(shape={self.shape}, block={self.block}, dtype={self._dtype.name})"

    # --- pytree --------------------------------------------------------------------------------------------------
    def tree_flatten_with_keys(self):  # keyed: a path names the value or the scale (`parallel.tensor` splits them)
        keys = jax.tree_util.GetAttrKey
        return ((keys("value"), self.value), (keys("scale"), self.scale)), (self.block, self._dtype.name)

    def tree_flatten(self):
        return (self.value, self.scale), (self.block, self._dtype.name)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)


def is_fp8(x) -> bool:
    return isinstance(x, BlockFP8)


def weight_bytes(w) -> int:
    """Bytes a weight holds on its device (value and scale for FP8)."""
    if isinstance(w, BlockFP8):
        return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in (w.value, w.scale))
    return int(np.prod(w.shape)) * jnp.dtype(w.dtype).itemsize


def _expand_rows(scale: Array, block: int, rows: int) -> Array:
    """[..., Kb, N] -> [..., K, N]: each block's scale on each of its rows."""
    return jnp.repeat(scale, block, axis=-2)[..., :rows, :]


def dequantize(w: BlockFP8, dtype: Any = None) -> Array:
    """The weight in `dtype` (default: its own): value * scale, taken in float32 and cast once."""
    dtype = w.dtype if dtype is None else jnp.dtype(dtype)
    rows = w.value.shape[-2]
    full = w.value.astype(jnp.float32) * _expand_rows(w.scale.astype(jnp.float32), w.block, rows)
    return full.astype(dtype)


def block_scales(w: Array, block: int = BLOCK) -> Array:
    """float32 [..., ceil(K/B), ceil(N/B)]: the checkpoint format's scale of each B x B block of w [..., K, N],
    amax / FP8_MAX (1 for an all-zero block, so that zeros stay zeros and nothing divides by zero)."""
    w = jnp.asarray(w, jnp.float32)
    *lead, k, n = w.shape
    kb, nb = -(-k // block), -(-n // block)
    padded = jnp.pad(jnp.abs(w), [(0, 0)] * len(lead) + [(0, kb * block - k), (0, nb * block - n)])
    amax = padded.reshape(*lead, kb, block, nb, block).max(axis=(-3, -1))
    return jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)


def quantize(w: Array, block: int = BLOCK, dtype: Any = None) -> BlockFP8:
    """w [..., K, N] in block-wise FP8: one scale per B x B block (the checkpoint format's), values rounded to
    float8_e4m3fn after dividing by their block's scale. `dtype`: what it dequantizes to (default: w's dtype)."""
    dtype = jnp.dtype(w.dtype if dtype is None else dtype)
    blocks = block_scales(w, block)
    n = w.shape[-1]
    scale = jnp.repeat(blocks, block, axis=-1)[..., :n]
    value = (jnp.asarray(w, jnp.float32) / _expand_rows(scale, block, w.shape[-2]))
    value = jnp.clip(value, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    return BlockFP8(value, scale, block, dtype)
