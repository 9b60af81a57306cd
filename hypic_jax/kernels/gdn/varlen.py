"""Many segments packed in one sequence, `gdn_varlen`: each runs from a zero state, from its own initial state, or
on from the segment before it, with outputs and each segment's summary from the same kernels as `gdn_forward`.

Every segment is padded to whole chunks in the index space only (`varlen_layout`), so that no chunk straddles a
boundary: the chunk-local kernel needs no segment masks, and the state pass resets at a segment's first chunk and
stores the state to the segment's slot after its last, from two int32 per-chunk tables. Two more tables (each
chunk's first packed token and its count of real tokens) let both kernels read q, k, v and write o in place in the
packed arrays with masked loads and stores (`GDNConfig.packed_reads`); only the gates are gathered into the layout.

A segment's dense T comes from the packed pass widened by K identity columns (`default_varlen_config`), or with
`GDNConfig.transfer_group` > 0 from the transfer pass over groups of chunks, resetting its identity columns at
segment starts, and a segmented product scan over the groups for the segments that span several
(`varlen_transfer`).
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax

from hypic_jax.core.summary import Summary
from hypic_jax.kernels.gdn.chunk import log_transfer
from hypic_jax.kernels.gdn.chunk_local import chunk_local_pass
from hypic_jax.kernels.gdn.config import (GDNConfig, check_inputs, check_per_key_launch, common_dtype,
                                          default_interpret, default_varlen_config)
from hypic_jax.kernels.gdn.state import pad_to_groups, state_pass

__all__ = ["gdn_varlen", "varlen_layout", "varlen_transfer"]


def varlen_layout(cu: Array, length: int, n_seg: int, chunk: int, loads: Array | None = None):
    """Chunk-aligned layout of packed segments (all int32, traced-friendly; only the sizes are static).

    Every segment is padded to whole chunks so that a chunk never straddles a boundary: the chunk-local kernel
    then needs no segment masks, and the state pass only resets at a segment's first chunk and stores at its
    last. The padded length is bounded statically by sum_i ceil(len_i / c) <= floor((L + n (c - 1)) / c) chunks.
    Tokens from cu[n] to L (when cu[n] < L) belong to no segment and to no chunk.

    loads: None (every segment resets: start is 1 at its first chunk), or int32 [n], the start-table entry of each
    segment's first chunk (1 + the initial state it loads, or 0: it carries on from the chunk before; the
    state pass's `seg_init`).

    Returns (src [Lp]: packed token of each padded position, `length` for padding; pos [L]: padded position of
    each packed token; start [Nc], slot [Nc]: the state-pass tables; seg_of_token [L] (n past cu[n]); lens [n];
    chunk_begin, chunk_end [n]: each segment's first chunk and one past its last).
    """
    num_chunks = (length + n_seg * (chunk - 1)) // chunk
    lens = cu[1:] - cu[:-1]
    seg_chunks = (lens + chunk - 1) // chunk
    chunk_end = jnp.cumsum(seg_chunks)
    chunk_begin = chunk_end - seg_chunks
    ids = jnp.arange(num_chunks, dtype=jnp.int32)
    seg = jnp.searchsorted(chunk_end, ids, side="right").astype(jnp.int32)  # n_seg past the last segment
    seg_c = jnp.minimum(seg, n_seg - 1)
    live = seg < n_seg
    if loads is None:
        start = jnp.where(live, ids == chunk_begin[seg_c], True).astype(jnp.int32)
    else:
        start = jnp.where(live & (ids == chunk_begin[seg_c]), loads[seg_c], 0).astype(jnp.int32)
    slot = jnp.where(live & (ids == chunk_end[seg_c] - 1), seg, -1).astype(jnp.int32)
    padded = jnp.arange(num_chunks * chunk, dtype=jnp.int32)
    pseg = jnp.minimum(seg[padded // chunk], n_seg - 1)
    offset = padded - chunk_begin[pseg] * chunk
    valid = live[padded // chunk] & (offset < lens[pseg])
    src = jnp.where(valid, cu[pseg] + offset, length).astype(jnp.int32)
    tokens = jnp.arange(length, dtype=jnp.int32)
    seg_of_token = jnp.searchsorted(cu[1:], tokens, side="right").astype(jnp.int32)
    owner = jnp.minimum(seg_of_token, n_seg - 1)
    pos = jnp.where(tokens < cu[n_seg], chunk_begin[owner] * chunk + tokens - cu[owner], 0).astype(jnp.int32)
    return src, pos, start, slot, seg_of_token, lens, chunk_begin, chunk_end


def varlen_transfer(w, k, b, start, slot, chunk_begin, chunk_end, *, n_seg, chunk, group, config, interpret):
    """Each packed segment's dense T = A_last ... A_first ([n, H, K, K]) through `group`-chunk groups, as
    `transfer_pass` does for one sequence, instead of K identity columns widening the packed state pass.

    One launch steps identity columns through every group in parallel, resetting them at each segment's first
    chunk: a segment that ends in group e stores Q (its product since the later of its start and e's start) in its
    slot, and every group g leaves its tail P_g (the product since its last reset). A segment that started in an
    earlier group s then has T = Q P_{e-1} ... P_s: the groups strictly between hold no reset (the segment covers
    them), and s's tail starts at the segment's first chunk (no later segment starts in s). A segmented product
    scan over the groups (reset where a group holds a segment start) gives every such product at once.
    Only this launch's inputs are padded to whole groups (empty chunks: zero tokens, a reset, no slot), not the
    packed pass's. Empty segments (chunk_begin = chunk_end) get no slot; the caller replaces their T.
    """
    key_dim, heads = k.shape[-1], w.shape[1]
    w, k, b, group, groups, pad = pad_to_groups(w, k, b, chunk, group)
    if pad:  # the padded chunks reset and store nothing
        start = jnp.pad(start, (0, pad), constant_values=1)
        slot = jnp.pad(slot, (0, pad), constant_values=-1)
    eye = jnp.broadcast_to(jnp.eye(key_dim, dtype=jnp.float32), (groups, heads, key_dim, key_dim))
    _, ends, tails = state_pass(w, None, k, b, None, None, eye, chunk=chunk, pieces=groups, value_dim=key_dim,
                                out_dtype=jnp.float32, scale=1.0, config=config, interpret=interpret,
                                segments=(start, slot, n_seg), tails=True)
    resets = jnp.any(start.reshape(groups, group) != 0, axis=1)
    mm = functools.partial(jnp.einsum, "...ij,...jk->...ik", precision=lax.Precision.HIGHEST)

    def later_after(a, b):  # segmented product, b after a: restart at b when b holds a reset
        (reset_a, prod_a), (reset_b, prod_b) = a, b
        return reset_a | reset_b, jnp.where(reset_b[:, None, None, None], prod_b, mm(prod_b, prod_a))

    _, running = lax.associative_scan(later_after, (resets, tails))
    first_group, last_group = chunk_begin // group, jnp.maximum(chunk_end - 1, 0) // group
    before = running[jnp.maximum(last_group - 1, 0)]
    return jnp.where((last_group > first_group)[:, None, None, None], mm(ends, before), ends)


def cu_array(cu_seqlens, length: int) -> Array:
    if isinstance(cu_seqlens, (list, tuple, np.ndarray)):
        cu = np.asarray(cu_seqlens, np.int64)
        if cu.ndim != 1 or cu.shape[0] < 2 or cu[0] != 0 or cu[-1] != length or np.any(np.diff(cu) < 0):
            raise ValueError(f"cu_seqlens must rise from 0 to L={length} (N + 1 offsets), got {list(cu)}")
    elif getattr(cu_seqlens, "ndim", None) != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError("cu_seqlens must be a 1-D array of N + 1 offsets")
    return jnp.asarray(cu_seqlens, jnp.int32)


@functools.partial(jax.jit, static_argnames=("scale", "config", "emit_summary", "interpret"))
def _varlen(q, k, v, cu, g, gk, beta, initial_state=None, continues=None, summary_rows=None, *, scale, config,
            emit_summary, interpret):
    """`gdn_varlen` on checked inputs (cu an int32 array, config given)."""
    length, key_heads, key_dim = k.shape
    heads, value_dim = v.shape[1:]
    n_seg = cu.shape[0] - 1
    config = config.resolved(k.dtype)
    chunk = config.chunk
    dense = emit_summary and beta is not None
    group = config.transfer_group if dense else 0  # 0: T from the widened state
    seeded = initial_state is not None or continues is not None
    loads = None
    if seeded:  # start-table entries: 1 + the segment's own initial state, or 0 where it carries on
        rows = jnp.arange(1, n_seg + 1, dtype=jnp.int32)
        loads = rows if continues is None else jnp.where(continues, 0, rows)
    src, pos, start, slot, seg_of_token, lens, chunk_begin, chunk_end = varlen_layout(cu, length, n_seg, chunk,
                                                                                      loads)
    live = chunk_end[n_seg - 1:]  # [1]: the chunks that hold tokens; the state pass steps no others

    def gather(x):  # padded positions read a zero row: A = I, nothing added
        if x is None:
            return None
        return jnp.concatenate([x, jnp.zeros((1,) + x.shape[1:], x.dtype)])[src]

    packed = None
    if config.packed_reads:
        # q, k, v and o stay packed: the kernels read chunk n as rows src .. src + cnt of the packed arrays
        first = src.reshape(-1, chunk)
        cnt = jnp.sum(first < length, axis=1).astype(jnp.int32)
        packed = (jnp.where(cnt > 0, first[:, 0], 0).astype(jnp.int32), cnt)
        qp, kp, vp = q, k, v
    else:
        qp, kp, vp = map(gather, (q, k, v))
    gp, gkp, betap = map(gather, (g, gk, beta))
    # the group transfer pass below reads every chunk, so empty chunks are skipped only without it
    b, p, w, u, ks, qs = chunk_local_pass(qp, kp, vp, gp, gkp, betap, scale=scale, config=config,
                                          interpret=interpret, packed=packed, skip_empty=not (dense and group))
    if config.state_lowering == "mosaic":
        raise ValueError("gdn_varlen runs the Triton state pass only (GDNConfig.state_lowering 'auto' or 'triton')")
    out_dtype = jnp.result_type(q, v)
    # every segment from its own state (none continues another): one program per segment (`segment_grid`)
    by_segment = (chunk_begin, chunk_end) if config.segment_grid and continues is None else None
    live = None if by_segment is not None else live
    if seeded:
        init = (jnp.zeros((n_seg, heads, key_dim, value_dim), jnp.float32) if initial_state is None
                else initial_state.astype(jnp.float32))
        o, finals = state_pass(w, u, ks, b, qs, p, init, chunk=chunk, pieces=1, value_dim=value_dim,
                               out_dtype=out_dtype, scale=scale, config=config, interpret=interpret,
                               segments=(start, slot, n_seg), packed=packed, packed_length=length,
                               segment_init=True, live=live, by_segment=by_segment)
        finals = jnp.where((lens > 0)[:, None, None, None], finals, init)  # empty segments: their own init
    else:
        init = jnp.zeros((heads, key_dim, value_dim), jnp.float32)
        widened = dense and not group
        if widened:
            init = jnp.concatenate([init, jnp.broadcast_to(jnp.eye(key_dim, dtype=jnp.float32),
                                                           (heads, key_dim, key_dim))], axis=-1)
        # empty segments own no chunk, so the pass never stores their rows: it sets those that are read to init
        # ((I, 0)) first, instead of a select over every row afterwards (a copy of [N, H, K, V + K] per call)
        fill = lens == 0 if summary_rows is None else (lens == 0) & summary_rows
        res = state_pass(w, u, ks, b, qs, p, init[None], chunk=chunk, pieces=1, value_dim=value_dim,
                         out_dtype=out_dtype, scale=scale, config=config, interpret=interpret,
                         segments=(start, slot, n_seg), packed=packed, packed_length=length, live=live,
                         fill=fill, split=widened, by_segment=by_segment)
        if widened:  # states and transfers as two outputs: no slices of a widened array copied out
            o, finals, widened_transfer = res
        else:
            o, finals = res
    if packed is None:
        o = o[pos]
    elif gk is None:  # scalar gates read k in place; the transfer pass below takes chunk-aligned keys
        ks = gather(k) if dense and group else None
    states = finals[..., :value_dim]
    if not emit_summary:
        return o, states
    if dense and group:
        transfer = varlen_transfer(w, ks, b, start, slot, chunk_begin, chunk_end, n_seg=n_seg, chunk=chunk,
                                   group=group, config=config, interpret=interpret)
        eye = jnp.eye(key_dim, dtype=jnp.float32)
        return o, Summary("dense", states, jnp.where((lens > 0)[:, None, None, None], transfer, eye))
    if dense:
        return o, Summary("dense", states, widened_transfer)
    form, log = log_transfer(g, gk, seg_of_token, n_seg)
    return o, Summary(form, states, log)


def gdn_varlen(
    q: Array,
    k: Array,
    v: Array,
    cu_seqlens: Sequence[int] | Array,
    *,
    g: Array | None = None,
    gk: Array | None = None,
    beta: Array | None = None,
    scale: float = 1.0,
    config: GDNConfig | None = None,
    emit_summary: bool = True,
    interpret: bool | None = None,
    initial_state: Array | None = None,
    continues: Array | None = None,
    summary_rows: Array | None = None,
):
    """Many segments packed in one sequence, each run from a zero state (reset at every boundary), or from its
    own initial state, or carrying on from the segment before it.

    Args:
      q, k: [L, Hk, K]; v: [L, H, V]; g, beta: [L, H]; gk: [L, H, K] (as `gdn_forward`).
      cu_seqlens: N + 1 segment offsets rising from 0 to L, static (a list) or an int32 array (traced: only N is
        static, so one compilation serves every split of L tokens into N segments); empty segments are allowed.
        A traced array may also end short of L: tokens from cu[N] on then belong to no segment and cost no step
        of the kernels; their outputs are undefined (a fixed-capacity buffer's padding: mask them).
      config: `GDNConfig` (None: `default_varlen_config`, which takes T from the widened state).
      emit_summary: return each segment's `hypic_jax.core.summary.Summary` (leading axis N): dense T for delta
        rules (through the state widened by an identity block when `config.transfer_group` is 0, or the transfer
        pass over groups of that many chunks), log sums of the gates otherwise.
      initial_state: [N, H, K, V] float32, the state each segment starts from (default zeros).
      continues: bool [N] (traced): segment i carries on from the state the previous non-empty segment ended with
        (its initial state unused); a first segment that continues starts from zero. Segments that continue one
        another run as one sequence, and the states returned are still each one's own end.
      With initial_state or continues, emit_summary must be False: the states returned are then each segment's
      end state from where it started (an empty segment returns its initial state).
      summary_rows: bool [N] or None (from a zero start only): the segments whose summaries or end states are
        read. An empty segment's row (zero state, identity transfer) is set only where this is True (None: every
        empty segment); the rows of other empty segments are undefined. A caller that reads only some rows saves
        writing the others (a stitched request's cached pieces are empty segments of its varlen call).

    Returns (o [L, H, V], summary) with emit_summary, else (o, states [N, H, K, V]); the states are S(C_i|0)
    (or the end states from initial_state / continues). `reference.gdn_varlen_reference` computes the same
    segment by segment in float32.

    Memory: the kernels step a chunk-aligned layout (each segment padded to whole chunks; at most N (c - 1) extra
    zero tokens) through per-chunk int32 tables, reading q, k, v and writing o in place in the packed arrays
    (`GDNConfig.packed_reads`); only the gates are gathered into the layout. With `packed_reads=False` q, k, v
    are gathered in and o out in XLA instead (one extra read and write of each).
    """
    length, _, key_dim, heads, value_dim = check_inputs(q, k, v, g, gk, beta)
    config = default_varlen_config(gk is not None) if config is None else config
    q, k = common_dtype(q, k, v)
    cu = cu_array(cu_seqlens, length)
    n_seg = cu.shape[0] - 1
    if interpret is None:
        interpret = default_interpret()
    if gk is not None:
        check_per_key_launch(config, key_dim, bool(interpret))
    if initial_state is not None or continues is not None:
        if emit_summary:
            raise ValueError("gdn_varlen's summaries are of zero-start segments: emit_summary=False with "
                             "initial_state or continues")
        if initial_state is not None and initial_state.shape != (n_seg, heads, key_dim, value_dim):
            raise ValueError(f"initial_state must be [N, H, K, V] = {(n_seg, heads, key_dim, value_dim)}, got "
                             f"{initial_state.shape}")
        if continues is not None:
            continues = jnp.asarray(continues, bool)
            if continues.shape != (n_seg,):
                raise ValueError(f"continues must be [N={n_seg}], got shape {continues.shape}")
    if summary_rows is not None:
        if initial_state is not None or continues is not None:
            raise ValueError("summary_rows selects rows of zero-start segments: not with initial_state or continues")
        summary_rows = jnp.asarray(summary_rows, bool)
        if summary_rows.shape != (n_seg,):
            raise ValueError(f"summary_rows must be [N={n_seg}], got shape {summary_rows.shape}")
    return _varlen(q, k, v, cu, g, gk, beta, initial_state, continues, summary_rows, scale=float(scale),
                   config=config, emit_summary=emit_summary, interpret=bool(interpret))
