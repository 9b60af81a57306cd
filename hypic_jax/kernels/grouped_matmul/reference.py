"""Pure-JAX reference of the grouped matmul, with the kernel's own signature."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array, lax

from hypic_jax.kernels.grouped_matmul.matmul import ChunkedWeights

__all__ = ["gmm_reference"]


def gmm_reference(x: Array, block_expert: Array, weights, *, rows: Array | None = None,
                  swiglu: bool = False, scales=None, scale_block: int = 128) -> Array:
    """`gmm` in float32 (HIGHEST): padded row r is x[r] (x[rows[r]] with `rows`) times the weights of its block's
    expert, block_expert[r // block_m]; with `swiglu` the result is silu(x W_gate) * (x W_up) of the fused [gate |
    up] weights. `weights` may be `ChunkedWeights` (the chunk `weights.index`). With `scales` (block-wise FP8, as
    `gmm` takes them) the weights are dequantized to float32 first. Rows of blocks past the last used one
    (block_expert -1) are zeros. Returns [padded rows, N] float32."""
    xr = (x if rows is None else x[rows]).astype(jnp.float32)
    num_blocks = block_expert.shape[0]
    xb = xr.reshape(num_blocks, xr.shape[0] // num_blocks, xr.shape[1])
    experts = jnp.maximum(block_expert, 0)

    def dequantized(w, s):
        w = w.astype(jnp.float32)
        if s is None:
            return w
        return w * jnp.repeat(s.astype(jnp.float32), scale_block, axis=1)[:, :w.shape[1]]

    def product(w, s=None):
        out = jnp.einsum("bmk,bkn->bmn", xb, dequantized(w, s)[experts], precision=lax.Precision.HIGHEST)
        if swiglu:
            gate, up = jnp.split(out, 2, axis=-1)
            out = jax.nn.silu(gate) * up
        return jnp.where((block_expert >= 0)[:, None, None], out, 0.0).reshape(xr.shape[0], -1)

    if isinstance(weights, ChunkedWeights):
        chunk_scales = (None,) * len(weights.chunks) if scales is None else scales.chunks
        return lax.switch(weights.index, [lambda w=w, s=s: product(w, s)
                                          for w, s in zip(weights.chunks, chunk_scales)])
    return product(weights, scales)
