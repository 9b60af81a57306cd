"""References of the Pallas entry points that have no single-sequence counterpart in the core: tests and benchmarks
check the kernels against them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hypic_jax.core.linear_attn.chunk import chunked, summarize


def varlen_reference(q, k, v, cu_seqlens, *, g=None, gk=None, beta=None, scale=1.0, max_len: int | None = None,
                     chunk_size: int = 16):
    """`pallas.gdn.gdn_varlen` through the core: segments gathered into [N, max_len] rows (zero padded at the end,
    which adds nothing), `chunked` and `summarize` vmapped over them, outputs scattered back. Key heads are
    repeated to the value heads. Returns (o [L, H, V] float32, Summary over N)."""
    length, heads = v.shape[:2]
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    n_seg = cu.shape[0] - 1
    if max_len is None:
        max_len = int(np.max(np.diff(np.asarray(cu_seqlens)))) if n_seg else 1
    max_len = max(max_len, 1)
    group = heads // k.shape[1]
    up = lambda x: None if x is None else x.astype(jnp.float32)  # noqa: E731
    q, k = jnp.repeat(up(q), group, 1), jnp.repeat(up(k), group, 1)
    v, g, gk, beta = up(v), up(g), up(gk), up(beta)
    lens = cu[1:] - cu[:-1]
    offs = jnp.arange(max_len, dtype=jnp.int32)
    idx = jnp.where(offs[None, :] < lens[:, None], cu[:-1, None] + offs[None, :], length)  # [N, max_len]

    def rows(x):
        if x is None:
            return None
        return jnp.concatenate([x, jnp.zeros((1,) + x.shape[1:], x.dtype)])[idx]

    def one(q, k, v, g, gk, beta):
        o, _ = chunked(q, k, v, g=g, gk=gk, beta=beta, scale=scale, chunk_size=chunk_size)
        return o, summarize(k, v, g=g, gk=gk, beta=beta, chunk_size=chunk_size)

    o_rows, summary = jax.vmap(one)(*map(rows, (q, k, v, g, gk, beta)))
    tokens = jnp.arange(length, dtype=jnp.int32)
    seg = jnp.minimum(jnp.searchsorted(cu[1:], tokens, side="right"), n_seg - 1)
    return o_rows[seg, tokens - cu[seg]], summary
