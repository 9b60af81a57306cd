"""Pure-JAX reference of the grouped matmul, with the kernel's own signature."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array, lax

from hypic_jax.kernels.grouped_matmul.matmul import ChunkedWeights

__all__ = ["gmm_reference"]


def gmm_reference(x: Array, block_expert: Array, weights, *, rows: Array | None = None,
                  swiglu: bool = False) -> Array:
    """`gmm` in float32 (HIGHEST): padded row r is x[r] (x[rows[r]] with `rows`) times the weights of its block's
    expert, block_expert[r // block_m]; with `swiglu` the result is silu(x W_gate) * (x W_up) of the fused [gate |
    up] weights. `weights` may be `ChunkedWeights` (the chunk `weights.index`). Rows of blocks past the last used
    one (block_expert -1) are zeros. Returns [padded rows, N] float32."""
    xr = (x if rows is None else x[rows]).astype(jnp.float32)
    num_blocks = block_expert.shape[0]
    xb = xr.reshape(num_blocks, xr.shape[0] // num_blocks, xr.shape[1])
    experts = jnp.maximum(block_expert, 0)

    def product(w):
        out = jnp.einsum("bmk,bkn->bmn", xb, w.astype(jnp.float32)[experts], precision=lax.Precision.HIGHEST)
        if swiglu:
            gate, up = jnp.split(out, 2, axis=-1)
            out = jax.nn.silu(gate) * up
        return jnp.where((block_expert >= 0)[:, None, None], out, 0.0).reshape(xr.shape[0], -1)

    if isinstance(weights, ChunkedWeights):
        return lax.switch(weights.index, [lambda w=w: product(w) for w in weights.chunks])
    return product(weights)
