"""Flash attention for queries at arbitrary absolute positions over keys in order (Pallas, Triton lowering).

A PIC request attends from a few hundred fresh tokens (seams spread over the whole prompt, then the query) to every
key of the prompt: key j sits at position j and is visible to query i iff q_starts[i] <= j <= pos[i]. Neither of the
library kernels covers that mask (cuDNN's causal mask assumes the queries are the last rows of the keys; JAX's
Pallas `mha` derives positions from block indices), and the XLA fallback materialises [heads, block, keys] float32
logits.

Grid (query blocks, query heads, key ranges); each program keeps its [block_q, D] output in registers and streams
key/value tiles of its range with an online softmax (running max m and sum l, float32):

    m' = max(m, max_j s_j),   l' = l e^{m - m'} + sum_j e^{s_j - m'},   acc' = acc e^{m - m'} + sum_j e^{s_j - m'} v_j,

visiting only the key tiles up to its last query's position, so the work follows the mask: a seam early in the
prompt reads few keys. The ranges' partial results are combined afterwards, each rescaled to the common row
maximum (the same identity across ranges). Queries are expected in increasing position order (the packed fresh
tokens of a layout are), which keeps a block's reach tight; any order is still correct. GQA: query head h reads
key/value head h // (Hq / Hkv). A query row with position -1 (padding) sees nothing and returns zeros.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import Array
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

__all__ = ["AttentionConfig", "positioned_attention"]


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """block_q / block_k: query rows and key rows per tile (powers of two >= 16); num_warps / num_stages: Triton
    launch parameters. target_programs: the keys are split into ranges processed by separate programs
    (flash-decoding style, partial softmax results combined afterwards) until about this many programs run: a few
    hundred fresh queries make only (queries / block_q) x heads programs, and the one holding the query at the end
    of the prompt walks all the keys alone. The defaults are one launch of the variants `bench/pic_kernels.py
    --sections attention` times (the warps and the split; bench/RESULTS.md, "pic_kernels.py"); the engine passes
    its own (`hypic_jax.stitch`).

    pack_gqa: one program per key/value head instead of per query head; its block_q rows are block_q / G queries
    times the G query heads that share the key/value head (block_q must be a multiple of G). Each key/value tile is
    then loaded once for all G heads, with G-times taller products; the kernel is the same, only the rows are
    arranged differently. Off in this class; the engine turns it on where the heads allow it (`bench/pic_kernels.py
    --sections attention` times both arrangements at the PIC request's shape; bench/RESULTS.md, "pic_kernels.py")."""

    block_q: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2
    target_programs: int = 1
    pack_gqa: bool = False


def _kernel(pos_ref, start_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, scale, block_k, num_keys,
            tiles_per_split):
    """One (query block, query head, key range): online softmax over the key tiles of its range that its queries
    can reach; writes the unnormalised output, the row maxima and the row sums for the combine."""
    pos = pos_ref[...]  # [bq] int32
    lower = start_ref[...]  # [bq] int32: the first key each row may see
    q = q_ref[...]  # [bq, D]
    block_q = q.shape[0]
    reach = jnp.minimum(jnp.max(pos) + 1, num_keys)  # keys [0, reach) are all any row can see
    low_tile = jnp.min(jnp.where(pos >= 0, lower, num_keys)) // block_k  # tiles below every row's start: skipped
    first = jnp.maximum(pl.program_id(2) * tiles_per_split, low_tile)
    first = jnp.minimum(first, pl.program_id(2) * tiles_per_split + tiles_per_split)
    stop = jnp.maximum(first, jnp.minimum((reach + block_k - 1) // block_k, first + tiles_per_split))

    def body(t, carry):
        acc, row_max, row_sum = carry
        start = t * block_k
        k = k_ref[pl.ds(start, block_k), :]
        v = v_ref[pl.ds(start, block_k), :]
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        key_pos = start + jax.lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
        s = jnp.where((key_pos <= pos[:, None]) & (key_pos >= lower[:, None]), s, -jnp.inf)
        new_max = jnp.maximum(row_max, jnp.max(s, axis=1))
        safe_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)  # rows that have seen nothing yet
        p = jnp.exp(s - safe_max[:, None])
        correction = jnp.exp(jnp.where(row_max == -jnp.inf, 0.0, row_max) - safe_max)
        row_sum = row_sum * correction + jnp.sum(p, axis=1)
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        acc = acc * correction[:, None] + pv
        return acc, new_max, row_sum

    init = (jnp.zeros((block_q, v_ref.shape[-1]), jnp.float32), jnp.full((block_q,), -jnp.inf, jnp.float32),
            jnp.zeros((block_q,), jnp.float32))
    acc, row_max, row_sum = jax.lax.fori_loop(first, stop, body, init)
    o_ref[...] = acc
    m_ref[...] = row_max
    l_ref[...] = row_sum


@functools.partial(jax.jit, static_argnames=("scale", "config", "interpret"))
def positioned_attention(q: Array, k: Array, v: Array, q_positions: Array, *, scale: float,
                         config: AttentionConfig = AttentionConfig(), interpret: bool = False,
                         q_starts: Array | None = None) -> Array:
    """q [Lq, Hq, D], k [Lk, Hkv, D], v [Lk, Hkv, Dv], q_positions [Lq] int -> [Lq, Hq, Dv] (q's dtype).

    Key j is at position j; query i sees keys j <= q_positions[i], and j >= q_starts[i] when given (packed
    isolated spans: each query sees only its own span; tiles below a block's first start are never read). Lq and
    Lk are padded to the tile sizes here (padded queries get position -1, padded keys lie beyond every query's
    reach). `reference.positioned_attention_reference` is the same attention in float32."""
    lq, hq, d = q.shape
    lk, hkv, dv = v.shape
    if k.shape[:2] != (lk, hkv) or k.shape[2] != d:
        raise ValueError(f"k must be [Lk, Hkv, D] = {(lk, hkv, d)}, got {k.shape}")
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} key/value heads")
    if q_positions.shape != (lq,):
        raise ValueError(f"q_positions must be [Lq] = [{lq}], got {q_positions.shape}")
    bq, bk = config.block_q, config.block_k
    group = hq // hkv
    if config.pack_gqa:
        if bq % group:
            raise ValueError(f"pack_gqa: block_q {bq} must be a multiple of the {group} query heads per kv head")
        queries_per_block = bq // group
    else:
        queries_per_block = bq
    lq_pad, lk_pad = -(-lq // queries_per_block) * queries_per_block, -(-lk // bk) * bk
    pos = jnp.pad(q_positions.astype(jnp.int32), (0, lq_pad - lq), constant_values=-1)
    starts = jnp.zeros((lq,), jnp.int32) if q_starts is None else q_starts.astype(jnp.int32)
    starts = jnp.pad(starts, (0, lq_pad - lq))
    qh = jnp.pad(jnp.moveaxis(q, 1, 0), ((0, 0), (0, lq_pad - lq), (0, 0)))  # [Hq, Lq, D]
    heads = hq
    if config.pack_gqa:  # rows (query i, head g of the group) of kv head h: [Hkv, Lq * G, D], positions repeated
        qh = qh.reshape(hkv, group, lq_pad, d).swapaxes(1, 2).reshape(hkv, lq_pad * group, d)
        pos = jnp.repeat(pos, group)
        starts = jnp.repeat(starts, group)
        heads, group, lq_pad = hkv, 1, lq_pad * group
    kh = jnp.pad(jnp.moveaxis(k, 1, 0), ((0, 0), (0, lk_pad - lk), (0, 0))).astype(q.dtype)
    vh = jnp.pad(jnp.moveaxis(v, 1, 0), ((0, 0), (0, lk_pad - lk), (0, 0))).astype(q.dtype)
    q_blocks, tiles = lq_pad // bq, lk_pad // bk
    splits = max(1, min(tiles, -(-config.target_programs // (q_blocks * heads))))
    per_split = -(-tiles // splits)
    splits = -(-tiles // per_split)
    kernel = functools.partial(_kernel, scale=scale, block_k=bk, num_keys=lk, tiles_per_split=per_split)
    acc, row_max, row_sum = pl.pallas_call(
        kernel,
        grid=(q_blocks, heads, splits),
        in_specs=[
            pl.BlockSpec((bq,), lambda i, h, r: (i,)),
            pl.BlockSpec((bq,), lambda i, h, r: (i,)),
            pl.BlockSpec((None, bq, d), lambda i, h, r: (h, i, 0)),
            pl.BlockSpec((None, lk_pad, d), lambda i, h, r: (h // group, 0, 0)),
            pl.BlockSpec((None, lk_pad, dv), lambda i, h, r: (h // group, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, bq, dv), lambda i, h, r: (h, r, i, 0)),
            pl.BlockSpec((None, None, bq), lambda i, h, r: (h, r, i)),
            pl.BlockSpec((None, None, bq), lambda i, h, r: (h, r, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((heads, splits, lq_pad, dv), jnp.float32),
            jax.ShapeDtypeStruct((heads, splits, lq_pad), jnp.float32),
            jax.ShapeDtypeStruct((heads, splits, lq_pad), jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="positioned_attention",
    )(pos, starts, qh, kh, vh)
    # combine the key ranges: rescale each range's partial sums to the common row maximum
    top = jnp.max(row_max, axis=1, keepdims=True)
    weight = jnp.where(row_max == -jnp.inf, 0.0, jnp.exp(row_max - jnp.where(top == -jnp.inf, 0.0, top)))
    total = jnp.sum(weight * row_sum, axis=1)  # [heads, rows]
    out = jnp.sum(weight[..., None] * acc, axis=1) / jnp.where(total == 0.0, 1.0, total)[..., None]
    if config.pack_gqa:  # [Hkv, Lq * G, Dv] -> [Hq, Lq, Dv]
        out = out.reshape(hkv, lq_pad // (hq // hkv), hq // hkv, dv).swapaxes(1, 2).reshape(hq, -1, dv)
    return jnp.moveaxis(out[:, :lq], 0, 1).astype(q.dtype)
