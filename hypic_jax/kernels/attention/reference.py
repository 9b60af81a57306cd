"""Pure-JAX reference of the positioned attention, with the kernel's own signature."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array

__all__ = ["positioned_attention_reference"]


def positioned_attention_reference(q: Array, k: Array, v: Array, q_positions: Array, *, scale: float,
                                   q_starts: Array | None = None) -> Array:
    """`positioned_attention` in float32 (HIGHEST): q [Lq, Hq, D], k/v [Lk, Hkv, D(v)], q_positions [Lq] ->
    [Lq, Hq, Dv] in q's dtype; softmax(scale q k^T) v over the keys j visible to query i, j <= q_positions[i] (and
    j >= q_starts[i] when given); a query that sees no key returns zeros."""
    lq, hq, _ = q.shape
    hkv = k.shape[1]
    qg = q.reshape(lq, hkv, hq // hkv, -1).astype(jnp.float32)
    logits = jnp.einsum("qhgd,khd->hgqk", qg, k.astype(jnp.float32), precision="highest") * scale
    visible = jnp.arange(k.shape[0])[None, :] <= q_positions[:, None]
    if q_starts is not None:
        visible = visible & (jnp.arange(k.shape[0])[None, :] >= q_starts[:, None])
    logits = jnp.where(visible, logits, -jnp.inf)
    weights = jax.nn.softmax(logits, axis=-1)
    weights = jnp.where(visible.any(-1)[:, None], weights, 0.0)
    out = jnp.einsum("hgqk,khd->qhgd", weights, v.astype(jnp.float32), precision="highest")
    return out.reshape(lq, hq, -1).astype(q.dtype)
