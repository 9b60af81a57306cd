"""A short span taken as one chunk: the operands of its state map, and its outputs from any incoming state.

This is how the PIC engine treats a fresh seam between cached pieces: one chunk-local pass serves both the fold
over the pieces (`hypic_jax.kernels.piece_fold`) and the seam's outputs.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax import Array

from hypic_jax.core.linear_attn.chunk import chunk_locals
from hypic_jax.core.linear_attn.common import _state_dtype, log_decay_of
from hypic_jax.core.summary import einsum


def chunk_step(k: Array, v: Array, *, g: Array | None = None, gk: Array | None = None,
               beta: Array | None = None) -> tuple[Array, Array, Array, Array]:
    """A span of L tokens taken as one chunk: the operands of its state map
    state -> Diag(decay) state + k_to_end^T (u - w state), the step `chunked` takes per chunk.

    k [L, H, K], v [L, H, V] and the family's gates. Returns float32 (w [H, L, K] (zeros without a delta rule),
    u [H, L, V], k_to_end [H, L, K], decay [H, K]). This is how the PIC engine feeds a short fresh seam into the
    fold over cached interiors (`hypic_jax.kernels.piece_fold`) without forming its dense transfer.
    """
    return span_chunk(None, k, v, g=g, gk=gk, beta=beta)[:4]


class SpanChunk(NamedTuple):
    """One span taken as one chunk (`span_chunk`): the state map's operands (as `chunk_step`) and, when the
    queries were given, what the span's outputs need: q_decayed [H, L, K] and the causal scores [H, L, L]."""

    w: Array
    u: Array
    k_to_end: Array
    decay: Array
    q_decayed: Array | None = None
    scores: Array | None = None


def span_chunk(q: Array | None, k: Array, v: Array, *, g: Array | None = None, gk: Array | None = None,
               beta: Array | None = None) -> SpanChunk:
    """`chunk_step`, plus the output operands when q [L, H, K] is given: one chunk-local pass (the unit-lower
    solve included) serves both the span's state map and, through `span_chunk_outputs`, its outputs from any
    incoming state. The PIC engine computes each short seam this way once, feeds the state map to the fold and
    then reads the seam's outputs from the state the fold gives it (instead of a second `chunked` pass)."""
    length, heads, key_dim = k.shape
    acc = _state_dtype(q, k, v, g, gk, beta)
    log_decay = log_decay_of(g, gk, acc)
    head_major = lambda x: None if x is None else jnp.moveaxis(x.astype(acc), 0, 1)  # noqa: E731
    loc = chunk_locals(head_major(q), head_major(k), head_major(v), head_major(log_decay), head_major(beta), acc)
    w = loc["w"] if loc["w"] is not None else jnp.zeros((heads, length, key_dim), acc)
    decay = jnp.broadcast_to(loc["chunk_decay"], (heads, key_dim))
    return SpanChunk(w, loc["u"], loc["k_to_end"], decay, loc.get("q_decayed"), loc.get("scores"))


def span_chunk_outputs(chunk: SpanChunk, state: Array, scale: float = 1.0,
                       out_dtype=None) -> tuple[Array, Array]:
    """The span's outputs [L, H, V] (scaled, in `out_dtype`) and its final state [H, K, V] from `state`: the
    per-chunk step of `chunked` for a span that is one chunk."""
    if chunk.q_decayed is None:
        raise ValueError("span_chunk_outputs needs a SpanChunk built with the queries (span_chunk(q, ...))")
    state = state.astype(chunk.u.dtype)
    u = chunk.u - einsum("hck,hkv->hcv", chunk.w, state)
    out = einsum("hck,hkv->hcv", chunk.q_decayed, state) + einsum("hcj,hjv->hcv", chunk.scores, u)
    final = chunk.decay[:, :, None] * state + einsum("hck,hcv->hkv", chunk.k_to_end, u)
    out = scale * jnp.moveaxis(out, 0, 1)
    return (out if out_dtype is None else out.astype(out_dtype)), final
