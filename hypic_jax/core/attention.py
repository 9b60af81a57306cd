"""Causal GQA attention with a flash kernel where one exists (cuDNN on a GPU) and bounded memory elsewhere.

Shared by the architectures (`hypic_jax.models.layers` re-exports it) and by the span machinery of the PIC engine
(`hypic_jax.spans`), which sits below the models and must not import them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array

# Query rows per block when a mask is materialised: bounds the [B, H, block, Lk] logits of long masked prefills.
MASKED_QUERY_BLOCK = 512
# At most this many query rows (a decode step) attend through `_few_query_attention`, which reads the keys and
# values in their cache layout instead of as a batched matrix product. 0 (off) by default, batched decode steps
# taking the matrix products (`python bench/decode_step.py --few-query-rows 4 0` compares the two paths;
# bench/RESULTS.md, "decode_step.py"). An int turns it on up to that many rows.
FEW_QUERY_ROWS: int = 0


def few_query_rows() -> int:
    """The query rows up to which attention takes `_few_query_attention` (`FEW_QUERY_ROWS`)."""
    return FEW_QUERY_ROWS


def _cudnn_eligible(q: Array) -> bool:
    return jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)


def dot_product_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    scale: float,
    q_positions: Array | None = None,
    k_positions: Array | None = None,
) -> Array:
    """Causal GQA attention, q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D] -> [B, Lq, Hq, D].

    Without positions this is plain causal self-attention over one contiguous block (Lq == Lk). On a GPU with
    bfloat16/float16 inputs it goes to cuDNN flash attention (`implementation="cudnn"`; jax's default
    implementation=None currently means XLA, which materialises the [B, H, L, L] logits). With positions, key j is
    visible to query i iff k_positions[..., j] <= q_positions[..., i] (absolute positions; a negative key position
    marks an empty slot), which covers KV caches, decode steps and spans cached elsewhere. Masked and long
    non-flash attention runs in blocks of MASKED_QUERY_BLOCK query rows so the logits never hold Lq x Lk.
    """
    if q_positions is None:
        if _cudnn_eligible(q):
            try:
                return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation="cudnn")
            except (NotImplementedError, RuntimeError, ValueError):  # unsupported shape / cuDNN: XLA below
                pass
        if q.shape[1] <= MASKED_QUERY_BLOCK:
            return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation="xla")
        q_positions = k_positions = jnp.arange(q.shape[1], dtype=jnp.int32)
    batch, q_len = q.shape[:2]
    q_pos = jnp.broadcast_to(q_positions, (batch, q_len))
    k_pos = jnp.broadcast_to(k_positions, (batch, k.shape[1]))
    if q_len <= few_query_rows():
        return _few_query_attention(q, k, v, scale, q_pos, k_pos)

    def block(q_block, q_pos_block):
        visible = (k_pos[:, None, :] <= q_pos_block[:, :, None]) & (k_pos[:, None, :] >= 0)  # [B, Lq, Lk]
        return jax.nn.dot_product_attention(q_block, k, v, scale=scale, mask=visible[:, None], implementation="xla")

    if q_len <= MASKED_QUERY_BLOCK:
        return block(q, q_pos)
    num_blocks = -(-q_len // MASKED_QUERY_BLOCK)
    pad = num_blocks * MASKED_QUERY_BLOCK - q_len
    q_blocks = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(
        batch, num_blocks, MASKED_QUERY_BLOCK, *q.shape[2:]
    )
    pos_blocks = jnp.pad(q_pos, ((0, 0), (0, pad)), constant_values=-1).reshape(batch, num_blocks, -1)
    out = jax.lax.map(lambda xs: block(*xs), (jnp.moveaxis(q_blocks, 1, 0), jnp.moveaxis(pos_blocks, 1, 0)))
    return jnp.moveaxis(out, 0, 1).reshape(batch, num_blocks * MASKED_QUERY_BLOCK, *q.shape[2:])[:, :q_len]


def _few_query_attention(q: Array, k: Array, v: Array, scale: float, q_pos: Array, k_pos: Array) -> Array:
    """Masked GQA attention for a few query rows (a decode step) as products and sums over the cache layout.

    A decode step reads each row's whole cache [B, Lk, Hkv, D] for one query token per head. As a batched matrix
    product the batch axes (row, KV head) must lead each operand, so XLA transposes the whole cache first: a read
    and a write of every key and value per layer and step, more than the attention itself reads. Written as an
    elementwise product reduced over D (scores) and over Lk (outputs), each reduction fuses with its product and
    reads the cache once, in place; the arithmetic (2 G flops per cached element, G query heads per KV head) is
    negligible beside those bytes. Scores, softmax and the weighted sum are float32; key j is visible to query i
    iff k_pos[b, j] <= q_pos[b, i] and k_pos[b, j] >= 0 (a query that sees no key gets a uniform average instead
    of NaN)."""
    batch, q_len, heads, dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    qg = q.reshape(batch, q_len, 1, kv_heads, group, dim).astype(jnp.float32)
    scores = jnp.sum(qg * k[:, None, :, :, None, :].astype(jnp.float32), axis=-1) * scale  # [B, Lq, Lk, Hkv, G]
    visible = (k_pos[:, None, :] <= q_pos[:, :, None]) & (k_pos[:, None, :] >= 0)  # [B, Lq, Lk]
    scores = jnp.where(visible[..., None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=2)
    out = jnp.sum(probs[..., None] * v[:, None, :, :, None, :].astype(jnp.float32), axis=2)  # [B, Lq, Hkv, G, D]
    return out.reshape(batch, q_len, heads, dim).astype(q.dtype)
