"""Attention over a layout: keys gathered in absolute order from the fresh keys and the per-token pools, and
each block of queries running an online softmax over only the key blocks it can see (or the Pallas flash kernel
with the same mask)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array

from hypic_jax.kernels.attention import AttentionConfig, positioned_attention
from hypic_jax.stitch.layout import LayoutArrays

MASK_VALUE = -1e30  # finite: a query with no visible key averages values instead of producing NaN


def gather_keys(fresh, pool, layout: LayoutArrays):
    """Per-token trees of the whole request in key order [P, ...]: each key from the fresh tree [F, ...] or the
    per-token pool [rows, ...] (`key_fresh`, `key_index`)."""
    tokens = layout.tokens.shape[0]

    def one(f, p):
        from_fresh = f[jnp.clip(layout.key_index, 0, tokens - 1)]
        from_pool = p[jnp.clip(layout.key_index, 0, p.shape[0] - 1)].astype(f.dtype)
        mask = layout.key_fresh.reshape((-1,) + (1,) * (f.ndim - 1))
        return jnp.where(mask, from_fresh, from_pool)

    return jax.tree.map(one, fresh, pool)


def kernel_fits(q: Array, k: Array, v: Array) -> bool:
    """Whether `pallas.attention.positioned_attention` runs this attention: on a GPU, 16-bit inputs, and head
    widths that are powers of two from 16 to 256 (Triton tile shapes)."""
    widths_ok = all(16 <= w <= 256 and not w & (w - 1) for w in (q.shape[-1], v.shape[-1]))
    return (jax.default_backend() == "gpu" and widths_ok and q.shape[-1] == k.shape[-1]
            and q.dtype in (jnp.bfloat16, jnp.float16) and k.dtype == q.dtype and v.dtype == q.dtype)


def _masked_attention(q: Array, k: Array, v: Array, layout: LayoutArrays, *, isolated: bool, scale: float,
                      block_q: int, block_k: int, use_kernel: bool | None) -> Array:
    """`masked_attention` on the heads it is given."""
    tokens, heads_q, dim = q.shape
    keys_total, heads_kv, dim_v = k.shape[0], k.shape[1], v.shape[-1]
    group = heads_q // heads_kv
    index = jnp.arange(tokens, dtype=jnp.int32)
    if kernel_fits(q, k, v) if use_kernel is None else use_kernel:
        # the Pallas flash kernel: key j visible to query i iff first[i] <= j <= last[i] (padded queries: -1)
        last = jnp.where(layout.valid, index if isolated else layout.positions, -1)
        first = jnp.where(layout.valid, index - layout.positions, 0) if isolated else None
        config = AttentionConfig(target_programs=1024)
        if 1 < group <= 128 and not group & (group - 1):
            config = AttentionConfig(block_q=128, num_warps=8, pack_gqa=True, target_programs=1024)
        return positioned_attention(q, k, v, last, scale=scale, config=config, q_starts=first,
                                    interpret=jax.default_backend() != "gpu")
    block_q = min(block_q, tokens)
    block_k = min(block_k, keys_total)
    q_pad = -(-tokens // block_q) * block_q - tokens
    k_pad = -(-keys_total // block_k) * block_k - keys_total
    index = jnp.arange(tokens, dtype=jnp.int32)
    first = jnp.where(layout.valid, index - layout.positions if isolated else 0, keys_total)
    last = jnp.where(layout.valid, index if isolated else layout.positions, -1)
    pad_q = lambda a, value: jnp.pad(a, [(0, q_pad)] + [(0, 0)] * (a.ndim - 1), constant_values=value)  # noqa: E731
    qb = pad_q(q, 0).reshape(-1, block_q, heads_kv, group, dim)
    q_pos = pad_q(layout.positions, 0).reshape(-1, block_q)
    q_seg = pad_q(layout.token_segment, -1).reshape(-1, block_q)
    lo = pad_q(first, keys_total).reshape(-1, block_q).min(axis=1) // block_k
    hi = (pad_q(last, -1).reshape(-1, block_q).max(axis=1) + block_k) // block_k
    kb = jnp.pad(k, [(0, k_pad), (0, 0), (0, 0)])
    vb = jnp.pad(v, [(0, k_pad), (0, 0), (0, 0)])
    k_pos = jnp.pad(layout.key_positions, (0, k_pad), constant_values=jnp.iinfo(jnp.int32).max)
    k_seg = jnp.pad(layout.key_segment, (0, k_pad), constant_values=-3)
    k_ok = jnp.arange(keys_total + k_pad) < layout.num_keys

    def one_block(args):
        qi, pos, seg, start, stop = args
        qf = qi.astype(jnp.float32) * scale

        def step(j, carry):
            m, l, o = carry
            kj = jax.lax.dynamic_slice_in_dim(kb, j * block_k, block_k).astype(jnp.float32)
            vj = jax.lax.dynamic_slice_in_dim(vb, j * block_k, block_k).astype(jnp.float32)
            kp = jax.lax.dynamic_slice_in_dim(k_pos, j * block_k, block_k)
            ks = jax.lax.dynamic_slice_in_dim(k_seg, j * block_k, block_k)
            ok = jax.lax.dynamic_slice_in_dim(k_ok, j * block_k, block_k)
            visible = ok[None, :] & (kp[None, :] <= pos[:, None])
            if isolated:
                visible = visible & (ks[None, :] == seg[:, None])
            logits = jnp.einsum("qhgd,khd->hgqk", qf, kj, precision=jax.lax.Precision.HIGHEST)
            logits = jnp.where(visible[None, None], logits, MASK_VALUE)
            m_new = jnp.maximum(m, logits.max(axis=-1))
            p = jnp.exp(logits - m_new[..., None])
            correction = jnp.exp(m - m_new)
            l = l * correction + p.sum(axis=-1)
            o = o * correction[..., None] + jnp.einsum("hgqk,khd->hgqd", p, vj, precision=jax.lax.Precision.HIGHEST)
            return m_new, l, o

        init = (jnp.full((heads_kv, group, block_q), MASK_VALUE, jnp.float32),
                jnp.zeros((heads_kv, group, block_q), jnp.float32),
                jnp.zeros((heads_kv, group, block_q, dim_v), jnp.float32))
        m, l, o = jax.lax.fori_loop(start, jnp.maximum(start, stop), step, init)
        o = o / jnp.maximum(l, 1e-30)[..., None]
        return jnp.moveaxis(o, 2, 0).reshape(block_q, heads_q, dim_v)

    out = jax.lax.map(one_block, (qb, q_pos, q_seg, lo, hi))
    return out.reshape(-1, heads_q, dim_v)[:tokens].astype(v.dtype)
