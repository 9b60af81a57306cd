"""The linear core over a layout with steps 1 and 3 through `pallas.gdn.gdn_varlen`: the pieces are its
packed segments."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import Array

from hypic_jax.core.linear_attn import LinearInputs, Summary
from hypic_jax.kernels import gdn as pallas_gdn
from hypic_jax.stitch.fold import _fold_pieces
from hypic_jax.stitch.layout import PIECE_FRESH, LayoutArrays
from hypic_jax.stitch.linear_common import LinearResult


def _piece_loads(layout: LayoutArrays) -> Array:
    """bool [N]: the piece's first chunk loads the piece's incoming state (`chunk_load`); a fresh piece that does
    not carries on from the piece before it (pieces without chunks: False)."""
    first = (layout.chunk_first & layout.chunk_load).astype(jnp.int32)
    return jnp.zeros(layout.piece_kind.shape, jnp.int32).at[layout.chunk_piece].max(first) > 0


def _linear_over_layout_kernels(inputs: LinearInputs, pool: Summary, layout: LayoutArrays, *, summaries: bool,
                                rotate, algorithm, config, fold_impl: str = "auto") -> LinearResult:
    """`linear_over_layout` with steps 1 and 3 through `pallas.gdn.gdn_varlen`, the pieces as its segments."""
    heads, key_dim, value_dim = inputs.v.shape[1], inputs.k.shape[2], inputs.v.shape[2]
    # the pieces as the kernels' segments: their token offsets come with the layout from the host (the padded
    # tokens after cu[N] belong to no segment), not from a segment sum that the layer scan would run per layer
    cu = layout.piece_starts
    run = functools.partial(pallas_gdn.gdn_varlen, inputs.q, inputs.k, inputs.v, cu, g=inputs.g, gk=inputs.gk,
                            beta=inputs.beta, scale=inputs.scale, config=config)
    fresh_summary = None
    if summaries:  # 1. every fresh piece's own (T, S) from zero: one launch, its outputs unused; only fresh
        # pieces' rows are read (`_fold_pieces`, `record_summaries`), so the empty rows of the others stay unset
        _, fresh_summary = run(emit_summary=True, summary_rows=layout.piece_kind == PIECE_FRESH)
    folded, incoming = _fold_pieces(pool, layout, inputs.form, fresh_summary, rotate, algorithm,
                                    (heads, key_dim, value_dim), fold_impl)
    # 3. outputs and every piece's end state: a piece loads its incoming state or carries on from the one before.
    # With every fresh piece's summary folded, a piece's incoming state is the end state of a fresh piece before
    # it, so every piece may load it: the pieces are then independent, and the kernel runs them side by side
    outputs, ends = run(emit_summary=False, initial_state=incoming,
                        continues=None if summaries else ~_piece_loads(layout))
    outputs = jnp.where(layout.valid[:, None, None], outputs, 0).astype(inputs.v.dtype)  # padding: never written
    last = layout.num_pieces - 1
    final = jnp.where(layout.piece_kind[last] == PIECE_FRESH, ends[last], folded)
    return LinearResult(outputs, final, fresh_summary, ends)
