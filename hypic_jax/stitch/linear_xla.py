"""The linear core over a layout in XLA: step 1 (every fresh piece's own summary, one chunk loop with the
state widened by an identity block for dense transfers, restarted at each piece) and step 3 (the output chunk
loop, each piece loading its incoming state or carrying on), around the fold of step 2 (`fold`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array

from hypic_jax.core import linear_attn
from hypic_jax.core.linear_attn import LinearInputs, Summary
from hypic_jax.core.summary import einsum
from hypic_jax.stitch.fold import _fold_pieces
from hypic_jax.stitch.layout import PIECE_FRESH, LayoutArrays
from hypic_jax.stitch.linear_common import LinearResult, _head_major_chunks, _put, _repeat_key_heads


def _linear_over_layout_xla(inputs: LinearInputs, pool: Summary, layout: LayoutArrays, *, summaries: bool, rotate,
                            algorithm, fold_impl: str) -> LinearResult:
    """`linear_over_layout` through the chunk loops, on the heads it is given."""
    inputs = _repeat_key_heads(inputs)
    acc = jnp.float32
    form = inputs.form
    heads, key_dim, value_dim = inputs.k.shape[1], inputs.k.shape[2], inputs.v.shape[2]
    num_pieces = layout.piece_kind.shape[0]
    log_decay = linear_attn.log_decay_of(inputs.g, inputs.gk, acc)
    chunks = [_head_major_chunks(a, layout, acc) for a in (inputs.q, inputs.k, inputs.v, log_decay, inputs.beta)]
    loc = jax.vmap(lambda *xs: linear_attn.chunk_locals(*xs, acc))(*chunks)
    chunk_len = layout.chunk_rows.shape[1]

    def chunk_state_step(state, i, u_extra: int = 0):
        u = loc["u"][i]
        if u_extra:
            u = jnp.pad(u, [(0, 0), (0, 0), (0, u_extra)])
        if loc["w"] is not None:
            u = u - einsum("hck,hkv->hcv", loc["w"][i], state)
        new = loc["chunk_decay"][i][:, :, None] * state + einsum("hck,hcv->hkv", loc["k_to_end"][i], u)
        return new, u

    # 1. each fresh piece's own summary, from a zero start (dense: with the identity block that becomes T)
    fresh_summary = None
    if summaries:
        width = value_dim + (key_dim if form == "dense" else 0)
        start = jnp.zeros((heads, key_dim, width), acc)
        if form == "dense":
            start = start.at[..., value_dim:].set(jnp.broadcast_to(jnp.eye(key_dim, dtype=acc), (heads, key_dim, key_dim)))

        def widened(i, carry):
            state, ends = carry
            state = jnp.where(layout.chunk_first[i], start, state)
            state, _ = chunk_state_step(state, i, width - value_dim)
            ends = _put(ends, jnp.where(layout.chunk_last[i], layout.chunk_piece[i], num_pieces), state)
            return state, ends

        ends = jnp.zeros((num_pieces + 1, heads, key_dim, width), acc)
        _, ends = jax.lax.fori_loop(0, layout.num_chunks, widened, (start, ends))
        ends = ends[:num_pieces]
        fresh_summary = _fresh_summaries(ends, inputs, layout, form, value_dim, acc)

    # 2. the fold over pieces: the state entering each one
    folded, incoming = _fold_pieces(pool, layout, form, fresh_summary, rotate, algorithm, (heads, key_dim, value_dim),
                                    fold_impl)

    # 3. outputs, chunk by chunk, and each piece's end state
    def output(i, carry):
        state, outs, ends = carry
        state = jnp.where(layout.chunk_load[i], incoming[layout.chunk_piece[i]], state)
        before = state
        state, u = chunk_state_step(state, i)
        if "q_decayed" in loc:
            o = einsum("hck,hkv->hcv", loc["q_decayed"][i], before) + einsum(
                "hcj,hjv->hcv", loc["scores"][i], u)
            outs = _put(outs, i, o)
        ends = _put(ends, jnp.where(layout.chunk_last[i], layout.chunk_piece[i], num_pieces), state)
        return state, outs, ends

    zero = jnp.zeros((heads, key_dim, value_dim), acc)
    num_chunk_rows = layout.chunk_rows.shape[0]
    outs = jnp.zeros((num_chunk_rows, heads, chunk_len, value_dim), acc)
    ends = jnp.zeros((num_pieces + 1, heads, key_dim, value_dim), acc)
    _, outs, ends = jax.lax.fori_loop(0, layout.num_chunks, output, (zero, outs, ends))
    ends = ends[:num_pieces]
    flat = jnp.moveaxis(outs, 1, 2).reshape(num_chunk_rows * chunk_len, heads, value_dim)
    outputs = (inputs.scale * flat[layout.token_chunk_row]).astype(inputs.v.dtype)
    last = layout.num_pieces - 1
    final = jnp.where(layout.piece_kind[last] == PIECE_FRESH, ends[last], folded)
    return LinearResult(outputs, final, fresh_summary, ends)


def _fresh_summaries(ends: Array, inputs: LinearInputs, layout: LayoutArrays, form: str, value_dim: int,
                     acc) -> Summary:
    """Every piece's zero-start summary from the widened pass's end states [N, H, K, V(+K)]; scalar and diagonal
    transfers are sums of the pieces' log gates (a segment sum over the chunk rows)."""
    state = ends[..., :value_dim]
    if form == "dense":
        return Summary("dense", state, ends[..., value_dim:])
    if form == "identity":
        return Summary("identity", state, None)
    num_pieces = ends.shape[0]
    rows = layout.chunk_rows  # [C, c]
    piece_of_row = jnp.broadcast_to(layout.chunk_piece[:, None], rows.shape).reshape(-1)
    g = None if inputs.g is None else jnp.concatenate([inputs.g.astype(acc), jnp.zeros((1,) + inputs.g.shape[1:],
                                                                                      acc)])[rows.reshape(-1)]
    if form == "scalar":
        return Summary("scalar", state, jax.ops.segment_sum(g, piece_of_row, num_pieces))
    gk = jnp.concatenate([inputs.gk.astype(acc), jnp.zeros((1,) + inputs.gk.shape[1:], acc)])[rows.reshape(-1)]
    log_diag = jax.ops.segment_sum(gk, piece_of_row, num_pieces)
    if g is not None:
        log_diag = log_diag + jax.ops.segment_sum(g, piece_of_row, num_pieces)[..., None]
    return Summary("diagonal", state, log_diag)
