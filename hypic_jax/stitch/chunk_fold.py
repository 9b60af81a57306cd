"""The linear core over a layout that records nothing (a stitched PIC request) in one fold: the chunk-local
work of every fresh chunk at once, then `pallas.piece_fold.chunk_fold`, in which a fresh piece steps through its
chunks and emits their outputs."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import Array

from hypic_jax.core import linear_attn
from hypic_jax.core.linear_attn import LinearInputs, Summary
from hypic_jax.kernels import gdn as pallas_gdn
from hypic_jax.kernels import piece_fold
from hypic_jax.stitch.layout import LayoutArrays
from hypic_jax.stitch.linear_common import LinearResult, _head_major_chunks, _repeat_key_heads


def _piece_chunks(layout: LayoutArrays) -> Array:
    """int32 [N + 1]: piece p's chunks are [out[p], out[p + 1]) (the layout lays every fresh piece's chunks out in
    piece order; cached pieces and padding hold none)."""
    used = (jnp.arange(layout.chunk_piece.shape[0]) < layout.num_chunks).astype(jnp.int32)
    counts = jnp.zeros(layout.piece_kind.shape, jnp.int32).at[layout.chunk_piece].add(used)
    return jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(counts, dtype=jnp.int32)])


def _xla_chunk_locals(inputs: LinearInputs, layout: LayoutArrays) -> tuple[dict, float, str]:
    """`chunk_fold`'s chunk operands [C, H, ...] by `linear_attn.chunk_locals` (float32, every chunk at once),
    the scale its outputs still need, and the chunk steps' dot algorithm ("same": the fold's)."""
    inputs = _repeat_key_heads(inputs)
    acc = jnp.float32
    log_decay = linear_attn.log_decay_of(inputs.g, inputs.gk, acc)
    chunks = [_head_major_chunks(a, layout, acc) for a in (inputs.q, inputs.k, inputs.v, log_decay, inputs.beta)]
    loc = jax.vmap(lambda *xs: linear_attn.chunk_locals(*xs, acc))(*chunks)  # [C, H, c, ...]
    decay = jnp.broadcast_to(loc["chunk_decay"], loc["chunk_decay"].shape[:2] + (inputs.k.shape[-1],))
    return dict(w=loc["w"], u=loc["u"], k_to_end=loc["k_to_end"], decay=decay, q_decayed=loc["q_decayed"],
                scores=loc["scores"]), inputs.scale, "same"


def _kernel_chunk_locals(inputs: LinearInputs, layout: LayoutArrays, config) -> tuple[dict, float, str]:
    """`chunk_fold`'s chunk operands from `pallas.gdn`'s chunk-local kernel (one launch over the layout's chunks,
    in its intermediate dtype: bfloat16 for bfloat16 inputs, as in the prefill), the scale its outputs still need
    (1: the kernel's scores and decayed queries carry it) and the chunk steps' dot algorithm: the state pass's
    (`GDNConfig.state_precision`: bf16 products for bfloat16 inputs, as the prefill and flash-linear-attention
    step their states). The gates are gathered chunk-aligned by the layout's chunk rows (padding rows: a zero
    token, which decays nothing and adds nothing); q, k and v are read where they lie."""
    c = layout.chunk_rows.shape[1]
    rows = layout.chunk_rows.reshape(-1)
    num_chunks = layout.chunk_rows.shape[0]
    def aligned(x):
        return None if x is None else jnp.concatenate([x, jnp.zeros((1,) + x.shape[1:], x.dtype)])[rows]

    g, gk, beta = (aligned(x) for x in (inputs.g, inputs.gk, inputs.beta))
    base = config or pallas_gdn.default_varlen_config(per_key=gk is not None)
    config = dataclasses.replace(base, chunk=c, sub=min(base.sub, c))
    # chunk n holds fresh rows src[n] .. src[n] + cnt[n] (a piece's tokens are consecutive): the kernel reads q, k,
    # v where they lie and skips the chunks that hold none (most of the capacity), whose operands stay unset; the
    # fold reads only the chunks of its pieces
    cnt = jnp.sum(layout.chunk_rows < inputs.v.shape[0], axis=1).astype(jnp.int32)
    packed = (jnp.where(cnt > 0, layout.chunk_rows[:, 0], 0).astype(jnp.int32), cnt)
    # the kernel writes every output chunk by chunk and head by head ([C, H, c, D], the decayed keys as [C, H, K, c]:
    # the fold's layouts), the keys and queries already decayed: no transpose or decay runs in between
    b, scores, w, u, k_to_end, q_decayed = pallas_gdn._locals(
        inputs.q, inputs.k, inputs.v, g, gk, beta, scale=inputs.scale, config=config,
        interpret=pallas_gdn.default_interpret(), packed=packed, skip_empty=True, head_major=True)
    heads, key_dim = inputs.v.shape[1], inputs.k.shape[-1]
    if gk is not None:  # b [L, H, K]
        b_last = b.reshape(num_chunks, c, heads, key_dim)[:, -1]  # [C, H, K]
    else:  # b [H, L]
        b_last = jnp.moveaxis(b.reshape(heads, num_chunks, c)[..., -1], 0, 1)[..., None]  # [C, H, 1]
    decay = jnp.broadcast_to(jnp.exp(b_last), (num_chunks, heads, key_dim))
    chunk_algorithm = "bf16" if config.resolved(inputs.v.dtype).state_precision == "bf16" else "same"
    return dict(w=w, u=u, k_to_end_t=k_to_end, decay=decay, q_decayed=q_decayed, scores=scores), 1.0, chunk_algorithm


def _linear_over_layout_chunk_fold(inputs: LinearInputs, pool: Summary, layout: LayoutArrays, *, rotate,
                                   algorithm, kernel_locals: bool = False, config=None) -> LinearResult:
    """`linear_over_layout` for a layout that records nothing, through `pallas.piece_fold.chunk_fold`: the
    chunk-local work of every fresh chunk at once (no state: `linear_attn.chunk_locals`, or with `kernel_locals`
    the chunk-local kernel of `pallas.gdn`), then one launch that folds the pieces in order, a fresh piece chunk by
    chunk, and emits the fresh tokens' outputs on the way.

    What it saves over steps 1 to 3 (a stitched request is mostly short seams between cached pieces): no fresh
    piece's summary is formed (no pass with the widened state), no dense step per fresh piece, no incoming state
    is written and no second pass reads them back. The fold's sequential depth is one dense step per cached piece
    plus one small step per fresh chunk."""
    heads = inputs.v.shape[1]
    if kernel_locals:
        loc, scale, chunk_algorithm = _kernel_chunk_locals(inputs, layout, config)
    else:
        loc, scale, chunk_algorithm = _xla_chunk_locals(inputs, layout)
    slots = layout.piece_slot
    cached = pool
    if rotate is not None:  # rotated rows are gathered first, piece by piece
        cached = jax.vmap(rotate)(Summary(pool.form, pool.state[slots],
                                          None if pool.transfer is None else pool.transfer[slots]),
                                  layout.piece_offset)
        slots = jnp.arange(slots.shape[0], dtype=jnp.int32)
    final, outs = piece_fold.chunk_fold(
        cached.form, layout.piece_kind, slots, layout.piece_reset, layout.num_pieces, layout.drop_transfer,
        _piece_chunks(layout), cached.transfer, cached.state, **loc, algorithm=algorithm,
        chunk_algorithm=chunk_algorithm, interpret=jax.default_backend() != "gpu")
    num_chunk_rows, chunk_len = layout.chunk_rows.shape
    flat = jnp.moveaxis(outs, 1, 2).reshape(num_chunk_rows * chunk_len, heads, outs.shape[-1])
    outputs = jnp.where(layout.valid[:, None, None], scale * flat[layout.token_chunk_row], 0)
    return LinearResult(outputs.astype(inputs.v.dtype), final, None, None)
