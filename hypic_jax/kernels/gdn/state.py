"""The state pass of the chunked forward: the chunk-to-chunk recurrence, with each chunk's outputs read on the way,
and the transfer pass that multiplies a sequence's chunk transfers into its T_C.

Per chunk n, from the chunk-local operands (`chunk_local`: W, U, P, the decays b) and the incoming state S:

    o_n = scale (Q_n * e^{b}) S + P_n (U_n - W_n S)              the chunk's outputs
    S  <- Diag(e^{b_c}) S + Khat_n^T (U_n - W_n S)               Khat_n = K_n * e^{b_c - b}

Columns of the state are independent (every operation left-multiplies S), so programs own column blocks of
`GDNConfig.block_v`: the grid is (state column blocks, heads, pieces), heads x V / block_v programs at batch 1. The
output read is fused into the step, so the per-chunk states ([L/c, H, K, V] float32) never leave registers. A
scalar gate's decays scale the [c, block_v] tiles (the new values before the Khat^T product, the outputs after the
query product) rather than the [c, K] keys and queries: less elementwise work on the sequential chain.

Widened states. Identity columns with zero values step through the same recurrence as S <- A_n S with
A_n = Diag(e^{b_c}) - Khat_n^T W_n, the chunk's transfer: a state widened by K identity columns, [S | I], ends as
[S(C|0) | T_C] (its summary, `hypic_jax.core.summary.Summary`), and a pass of identity columns alone (no values, no
outputs) as T_C. `transfer_pass` cuts the chunks into groups stepped in parallel from the identity and multiplies
the groups' products by a log-depth tree (matrix products are associative); `GDNConfig.pieces` does the same for
the whole forward (`chunk`). Packed segments run the same kernel with int32 per-chunk tables (reset the state at a
segment's first chunk, store it to the segment's slot after its last; `varlen`).

Under Mosaic GPU on Hopper: `mosaic_state` (`GDNConfig.state_lowering`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hypic_jax.kernels import platform
from hypic_jax.kernels.compose.tree import compose_all
from hypic_jax.kernels.gdn import mosaic_state
from hypic_jax.kernels.gdn.common import PackedChunk, compiler_params, dot, last_row
from hypic_jax.kernels.gdn.config import choose_mosaic

__all__ = ["state_pass", "transfer_pass", "pad_to_groups", "use_mosaic_state", "use_mosaic_transfer",
           "mosaic_state_config"]


def _state_kernel(*refs, chunk, num_chunks, delta, per_key, outputs, segments, value_blocks, scale, prec,
                  values=True, tails=False, prefetch=False, packed=False, seg_init=False, bounded=False,
                  fill=False, split=False, by_segment=False):
    """One (column block j, head, piece): S <- Diag(e^{b_c}) S + Khat^T (U - W S) over the piece's chunks.

    Refs: w, k, q [Lp, K]; u [Lp, BV]; p [Lp, c]; b [Lp] or [Lp, K] (per-key gates: k and q come decayed from the
    chunk-local kernel, and only b's last row per chunk is read); with `segments` the int32 tables start
    [Nc] (1: reset the state to init before this chunk) and slot [Nc] (segment whose state is final after this
    chunk, else -1); init [K, BV]; outputs o [Lp, BV], final [K, BV] (or [N, K, BV] slots with segments). Column
    blocks j >= value_blocks are identity-widened columns (their values are zero) and write no outputs.
    The output read o = (scale Q e^b) S + P (U - W S) is fused into the same step, so per-chunk states never
    leave registers. Without `values` (no u ref; delta rule only) every column is a transfer column: S starts from
    identity columns and the pass returns the product of the chunks' transfer operators. With `tails` (segments
    over several pieces) a last output [K, BV] also takes each piece's final state: the product since its last
    reset (`varlen_transfer`). With `packed` two more int32 tables src, cnt [Nc] follow the segment tables, and
    o (and u, which is v, without the delta rule; k and q with scalar gates) are whole packed sequences [L, D]
    read and written in place, chunk n being rows src[n] .. src[n] + cnt[n] (`PackedChunk`).
    With `seg_init` (segments, one piece) init is [n, K, BV], one state per segment, and the start table says
    which: 1 + the row to load before this chunk, 0 to carry the state on (so a segment may continue the one
    before it); the state before the first chunk is zero. With `bounded` an int32 [1] table follows the segment
    tables: the number of chunks to step (the chunks that hold tokens); the chunks after it are never read.
    With `fill` (segments) an int32 [N] table follows the init: segment rows to set to init before the pass (empty
    segments own no chunk, so the pass never stores their rows). With `split` (segments, identity-widened) the
    final states go to two outputs, the value columns [N, K, BV] and the transfer columns [N, K, BV], so that no
    slice of a widened [N, K, V + K] array is copied out afterwards. With `by_segment` (segments that each start
    from their own state) two int32 [N] tables follow the live table's place, each segment's first chunk and one
    past its last, and program (j, h, s) steps segment s alone (its row of fill too).
    """
    it = iter(refs)
    w_ref = next(it) if delta else None
    u_ref = next(it) if values else None
    k_ref, b_ref = next(it), next(it)
    q_ref, p_ref = (next(it), next(it)) if outputs else (None, None)
    start_ref, slot_ref = (next(it), next(it)) if segments else (None, None)
    live_ref = next(it) if bounded else None
    begin_ref, end_ref = (next(it), next(it)) if by_segment else (None, None)
    src_ref, cnt_ref = (next(it), next(it)) if packed else (None, None)
    init_ref = next(it)
    fill_ref = next(it) if fill else None
    o_ref = next(it) if outputs else None
    final_ref = next(it)
    transfer_ref = next(it) if split else None
    tail_ref = next(it) if tails else None
    c = chunk
    is_value = None if value_blocks is None else pl.program_id(0) < value_blocks
    if seg_init:
        init = jnp.zeros(init_ref.shape[1:], jnp.float32)
    else:
        init = init_ref[...].astype(jnp.float32)
    if by_segment:
        segment = pl.program_id(2)
        first_chunk, steps = begin_ref[segment], end_ref[segment]
    else:
        first_chunk, steps = 0, (live_ref[0] if bounded else num_chunks)

    def store_final(row, state):
        if not split:
            final_ref[row] = state
            return

        @pl.when(is_value)
        def _():
            final_ref[row] = state

        @pl.when(jnp.logical_not(is_value))
        def _():
            transfer_ref[row] = state

    if fill and by_segment:
        @pl.when(fill_ref[segment] != 0)
        def _():
            store_final(segment, init)
    elif fill:
        def fill_row(row, carry):
            @pl.when(fill_ref[row] != 0)
            def _():
                store_final(row, init)

            return carry

        lax.fori_loop(0, fill_ref.shape[0], fill_row, 0)

    def small_loads(n):  # the step's loads that feed no dot directly: decays and segment tables
        first = n * c if isinstance(n, int) else pl.multiple_of(n * c, c)
        decays = b_ref[pl.ds(first + c - 1, 1), :] if per_key else b_ref[pl.ds(first, c)]
        return ((decays,) + ((start_ref[n], slot_ref[n]) if segments else ())
                + ((src_ref[n], cnt_ref[n]) if packed else ()))

    def body(n, carry):
        if prefetch:  # this step's small loads were issued one step earlier; issue the next step's now
            state, small = carry
            ahead = small_loads(jnp.minimum(n + 1, steps - 1))
        else:
            state, small, ahead = carry, small_loads(n), None
        rows = pl.ds(pl.multiple_of(n * c, c), c)
        if seg_init:  # load the segment's own initial state (a masked load: no memory read when carrying on)
            reset = small[1]
            loaded = pltriton.load(init_ref.at[jnp.maximum(reset - 1, 0)], mask=jnp.full(state.shape, reset != 0),
                                   other=0.0)
            state = jnp.where(reset != 0, loaded.astype(jnp.float32), state)
        elif segments:
            state = jnp.where(small[1] != 0, init, state)
        if packed:  # this chunk's rows of the packed arrays: src .. src + cnt
            in_place = functools.partial(PackedChunk, src=small[-2], cnt=small[-1], chunk=c)
        if packed and not per_key:  # per-key gates read the chunk-local kernel's decayed k, q (chunk-aligned)
            k = in_place(k_ref)[...]
            q_rows = lambda: in_place(q_ref)[...]  # noqa: E731
        else:
            k = k_ref[rows, :]  # per-key gates: already decayed to the chunk's end (k e^{b_c - b})
            q_rows = lambda: q_ref[rows, :]  # noqa: E731
        if per_key:
            b_last = jnp.sum(small[0], axis=0)  # [K]
        else:
            b = small[0]  # [c]
            b_last = last_row(b)
        if values:
            if packed and not delta:  # decay families: the values are v itself, packed like k and q
                u = in_place(u_ref)[...]
            else:
                u = u_ref[rows, :]
            u = u.astype(jnp.float32)
            if value_blocks is not None:
                u = jnp.where(is_value, u, 0.0)
            if delta:
                u = u - dot(w_ref[rows, :], state, prec)
        else:  # transfer columns only: zero values
            u = -dot(w_ref[rows, :], state, prec)
        if outputs:

            def write():
                if per_key:  # queries already scaled and decayed (scale q e^b)
                    o = dot(q_rows(), state, prec)
                else:  # a row scale commutes with the product: scale the [c, BV] result, not the [c, K] queries
                    o = dot(q_rows(), state, prec) * (scale * jnp.exp(b))[:, None]
                o = (o + dot(p_ref[rows, :], u, prec)).astype(o_ref.dtype)
                if packed:
                    in_place(o_ref).store(o)
                else:
                    o_ref[rows, :] = o

            if value_blocks is None:
                write()
            else:
                pl.when(is_value)(write)
        if per_key:
            state = jnp.exp(b_last)[:, None] * state + dot(k, u, prec, trans_a=True)
        else:  # Khat^T U = K^T (Diag(e^{b_c - b}) U): the decay scales the [c, BV] values, not the [c, K] keys
            state = jnp.exp(b_last) * state + dot(k, u * jnp.exp(b_last - b)[:, None], prec, trans_a=True)
        if segments:
            slot = small[2]

            @pl.when(slot >= 0)
            def _():
                store_final(slot, state)

        return (state, ahead) if prefetch else state

    if prefetch:  # (an empty last segment starts past the last chunk: its first loads read the last chunk's)
        ahead = small_loads(jnp.minimum(first_chunk, num_chunks - 1)) if by_segment else small_loads(0)
        state, _ = lax.fori_loop(first_chunk, steps, body, (init, ahead))
    else:
        state = lax.fori_loop(first_chunk, steps, body, init)
    if not segments:
        final_ref[...] = state
    if tails:
        tail_ref[...] = state


def state_pass(w, u, k, b, q, p, init, *, chunk, pieces, value_dim, out_dtype, scale, config, interpret,
               segments=None, tails=False, packed=None, packed_length=None, segment_init=False, live=None,
               fill=None, split=False, by_segment=None):
    """Run the state recurrence over `pieces` equal pieces from init [pieces, H, K, Wd] (Wd = V or V + K).

    Returns (o [L, H, V] or None, final [pieces, H, K, Wd]). q, p None -> no outputs. `segments` = (start, slot,
    n) runs packed segments: the int32 per-chunk tables of `_state_kernel`; final is then [n, H, K, Wd], and with
    `tails` a third result holds each piece's final state [pieces, H, K, Wd]. u None (delta rule, no outputs):
    transfer columns only (`transfer_pass`, `varlen_transfer`). packed: None, or the int32 tables (src, cnt)
    [Nc] of a chunk-aligned layout whose outputs stay packed (and k, q with scalar gates: per-key gates pass the
    chunk-local kernel's decayed k, q, chunk-aligned); L is then b's length, the layout's, and o is
    [packed_length, H, V].
    segment_init (segments, pieces = 1): init is [n, H, K, Wd], one initial state per segment, and the start
    table holds 1 + the row to load (0: carry on; `_state_kernel`). live: None, or an int32 [1] array, the number
    of chunks to step (the rest are never read).
    fill (segments, one init for all): None, or an int32 [n] table: rows of final set to init before the pass
    (empty segments; rows that neither a chunk nor fill writes are left undefined). split (segments, widened): final
    is two arrays, the value columns [n, H, K, V] and the transfer columns [n, H, K, Wd - V]. by_segment (segments,
    one piece, every segment starting from its own state: the start table is nonzero at each one's first chunk):
    None, or int32 [n] tables (first chunk, one past the last) of the segments, which then run as parallel
    programs (`GDNConfig.segment_grid`).
    """
    key_heads, key_dim = k.shape[1:]
    per_key = b.ndim == 3
    length = b.shape[0] if per_key else b.shape[1]
    heads, width = init.shape[1], init.shape[-1]
    group = heads // key_heads
    piece_len = length // pieces
    block_v = min(config.block_v, value_dim)
    if value_dim % block_v or width % block_v:
        raise ValueError(f"block_v={block_v} must divide V={value_dim} and the state width {width}")
    value_blocks = value_dim // block_v
    col_blocks = width // block_v
    widened = col_blocks > value_blocks
    outputs = q is not None
    delta = w is not None
    values = u is not None
    if not values and (outputs or not delta):
        raise ValueError("a pass without values runs transfer columns only: delta rule, no outputs")

    def vcol(j):  # value column block of program j (identity-widened programs read block 0 and mask it)
        return jnp.minimum(j, value_blocks - 1) if widened else j

    in_specs, args = [], []
    if delta:
        in_specs.append(pl.BlockSpec((piece_len, None, key_dim), lambda j, h, s: (s, h, 0)))
        args.append(w)
    if values and packed is not None and not delta:  # v itself, packed
        in_specs.append(pl.BlockSpec((u.shape[0], None, block_v), lambda j, h, s: (0, h, vcol(j))))
        args.append(u)
    elif values:
        in_specs.append(pl.BlockSpec((piece_len, None, block_v), lambda j, h, s: (s, h, vcol(j))))
        args.append(u)
    # keys and queries: the piece's rows, or with packed reads the whole packed sequence
    qk_spec = (pl.BlockSpec((k.shape[0], None, key_dim), lambda j, h, s: (0, h // group, 0))
               if packed is not None and not per_key
               else pl.BlockSpec((piece_len, None, key_dim), lambda j, h, s: (s, h // group, 0)))
    in_specs += [
        qk_spec,
        pl.BlockSpec((piece_len, None, key_dim), lambda j, h, s: (s, h, 0)) if per_key
        else pl.BlockSpec((None, piece_len), lambda j, h, s: (h, s)),
    ]
    args += [k, b]
    if outputs:
        in_specs += [qk_spec, pl.BlockSpec((None, piece_len, chunk), lambda j, h, s: (h, s, 0))]
        args += [q, p]
    if segments is not None:
        start, slot, n_seg = segments
        table = pl.BlockSpec((start.shape[0] // pieces,), lambda j, h, s: (s,))
        in_specs += [table, table]
        args += [start, slot]
    elif tails or segment_init:
        raise ValueError("tails and per-segment initial states belong to packed segments: segments needed")
    if segment_init and pieces != 1:
        raise ValueError("per-segment initial states run one piece")
    if (fill is not None or split) and (segments is None or segment_init):
        raise ValueError("fill and split belong to packed segments from one init")
    if by_segment is not None and (segments is None or pieces != 1 or tails):
        raise ValueError("a pass by segment runs packed segments in one piece, without tails")
    if split and (not widened or tails):
        raise ValueError("split needs an identity-widened state and no tails")
    if live is not None:
        if pieces != 1:
            raise ValueError("a bounded pass runs one piece")
        in_specs.append(pl.BlockSpec((1,), lambda j, h, s: (0,)))
        args.append(live)
    if by_segment is not None:
        in_specs += [pl.BlockSpec((n_seg,), lambda j, h, s: (0,))] * 2
        args += [a.astype(jnp.int32) for a in by_segment]
    if packed is not None:
        table = pl.BlockSpec((packed[0].shape[0] // pieces,), lambda j, h, s: (s,))
        in_specs += [table, table]
        args += list(packed)
    state_spec = pl.BlockSpec((None, None, key_dim, block_v), lambda j, h, s: (s, h, 0, j))
    if segment_init:
        in_specs.append(pl.BlockSpec((init.shape[0], None, key_dim, block_v), lambda j, h, s: (0, h, 0, j)))
    else:
        in_specs.append(state_spec)
    args.append(init)
    if fill is not None:
        in_specs.append(pl.BlockSpec((fill.shape[0],), lambda j, h, s: (0,)))
        args.append(fill.astype(jnp.int32))
    out_specs, out_shape = [], []
    if outputs and packed is not None:
        out_specs.append(pl.BlockSpec((packed_length, None, block_v), lambda j, h, s: (0, h, vcol(j))))
        out_shape.append(jax.ShapeDtypeStruct((packed_length, heads, value_dim), out_dtype))
    elif outputs:
        out_specs.append(pl.BlockSpec((piece_len, None, block_v), lambda j, h, s: (s, h, vcol(j))))
        out_shape.append(jax.ShapeDtypeStruct((length, heads, value_dim), out_dtype))
    if segments is None:
        out_specs.append(state_spec)
        out_shape.append(jax.ShapeDtypeStruct(init.shape, jnp.float32))
    elif split:  # programs of value columns store into the first, those of transfer columns into the second
        out_specs.append(pl.BlockSpec((n_seg, None, key_dim, block_v),
                                      lambda j, h, s: (0, h, 0, jnp.minimum(j, value_blocks - 1))))
        out_shape.append(jax.ShapeDtypeStruct((n_seg, heads, key_dim, value_dim), jnp.float32))
        out_specs.append(pl.BlockSpec((n_seg, None, key_dim, block_v),
                                      lambda j, h, s: (0, h, 0, jnp.maximum(j - value_blocks, 0))))
        out_shape.append(jax.ShapeDtypeStruct((n_seg, heads, key_dim, width - value_dim), jnp.float32))
    else:
        out_specs.append(pl.BlockSpec((n_seg, None, key_dim, block_v), lambda j, h, s: (0, h, 0, j)))
        out_shape.append(jax.ShapeDtypeStruct((n_seg, heads, key_dim, width), jnp.float32))
        if tails:
            out_specs.append(state_spec)
            out_shape.append(jax.ShapeDtypeStruct((pieces,) + init.shape[1:], jnp.float32))
    kernel = functools.partial(
        _state_kernel,
        chunk=chunk,
        num_chunks=piece_len // chunk,
        delta=delta,
        per_key=per_key,
        outputs=outputs,
        segments=segments is not None,
        value_blocks=value_blocks if widened else None,
        scale=scale,
        prec=config.state_precision,
        values=values,
        tails=tails,
        prefetch=config.state_prefetch,
        packed=packed is not None,
        seg_init=segment_init,
        bounded=live is not None,
        fill=fill is not None,
        split=split,
        by_segment=by_segment is not None,
    )
    grid_last = pieces
    if by_segment is not None:  # program s steps segment s; every block is the whole one-piece array
        pin = lambda spec: dataclasses.replace(spec, index_map=lambda j, h, s, f=spec.index_map: f(j, h, 0))  # noqa
        in_specs, out_specs = [pin(x) for x in in_specs], [pin(x) for x in out_specs]
        grid_last = n_seg
    res = pl.pallas_call(
        kernel,
        grid=(col_blocks, heads, grid_last),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params(config.state_warps, config.state_stages),
        interpret=interpret,
        name="gdn_state_pass",
    )(*args)
    res = list(res) if outputs else [None] + list(res)
    return tuple(res)


def pad_to_groups(w, k, b, chunk, group):
    """Chunk-aligned W, K, b padded with zero tokens (A = I) to whole groups of `group` chunks; a sequence shorter
    than one group is one group, not one padded to `group` chunks. Returns (w, k, b, group, groups, padded
    chunks); k None (keys read in place) stays None."""
    num_chunks = w.shape[0] // chunk
    group = min(group, num_chunks)
    groups = -(-num_chunks // group)
    pad = groups * group - num_chunks
    if pad:
        w = jnp.pad(w, [(0, pad * chunk), (0, 0), (0, 0)])
        k = None if k is None else jnp.pad(k, [(0, pad * chunk), (0, 0), (0, 0)])
        b = jnp.pad(b, [(0, 0), (0, pad * chunk)] if b.ndim == 2 else [(0, pad * chunk), (0, 0), (0, 0)])
    return w, k, b, group, groups, pad


def transfer_pass(w, k, b, *, chunk, group, config, interpret, packed=None):
    """T_C = A_N ... A_1 of a whole (chunk-aligned) sequence, A_c = Diag(e^{b_c}) - Khat_c^T W_c, as [H, K, K].

    Why not widen the forward's own state by K identity columns: that doubles the programs of a pass whose time is
    set by its sequential depth and its per-SM work, so T would cost about as much as the forward's state pass
    again (`bench/kernels.py --all --sections steps` times both: the "+TS widened" and "+TS group" rows). Here the
    product splits at `group`-chunk boundaries instead: one launch steps every group's identity columns through its
    chunks (zero values: S <- A S), all groups in parallel (depth `group` instead of L / c), and
    `hypic_jax.kernels.compose.compose_all`'s log-depth tree multiplies the groups' [K, K] products in order
    (associativity of the matrix product; float32-level "bf16x3" dots unless the state dots are exact "ieee").
    Zero tokens pad the sequence to whole groups: they have A = I. packed: the (src, cnt) tables of keys read in
    place (`state_pass`); the padded chunks get empty entries.
    """
    key_dim, heads = k.shape[-1], w.shape[1]
    w, k_padded, b, group, groups, pad = pad_to_groups(w, None if packed is not None else k, b, chunk, group)
    if packed is None:
        k = k_padded
    elif pad:
        packed = tuple(jnp.pad(t, (0, pad)) for t in packed)
    if use_mosaic_transfer(config, chunk, key_dim, b, packed, interpret):
        ts = mosaic_state.transfer_pass_mgpu(w, k, b, chunk=chunk, group_chunks=group,
                                             config=mosaic_state_config(config))
    else:
        eye = jnp.broadcast_to(jnp.eye(key_dim, dtype=jnp.float32), (groups, heads, key_dim, key_dim))
        _, ts = state_pass(w, None, k, b, None, None, eye, chunk=chunk, pieces=groups, value_dim=key_dim,
                           out_dtype=jnp.float32, scale=1.0, config=config, interpret=interpret, packed=packed)
    transfer, _ = compose_all(ts, None, "f32" if config.state_precision == "ieee" else "bf16x3")
    return transfer


def use_mosaic_transfer(config, chunk, key_dim, b, packed, interpret) -> bool:
    """Whether the transfer pass's group products run under Mosaic GPU (`mosaic_state.transfer_pass_mgpu`): as the
    state pass does (`GDNConfig.state_lowering`: "auto" on a Hopper GPU, "mosaic" always) wherever the kernel takes
    the launch (scalar gates, keys chunk-aligned, bf16 state dots, chunk 64, K = 128); Triton's pass otherwise (a
    launch the state pass refuses under "mosaic" has been refused before this is asked)."""
    if config.state_lowering == "triton" or interpret:
        return False
    return (b.ndim == 2 and packed is None and config.state_precision == "bf16"
            and mosaic_state.supported(chunk, key_dim, key_dim, config.block_v)
            and (config.state_lowering == "mosaic" or platform.is_hopper()))


def mosaic_state_config(config):
    """The Mosaic GPU state pass's launch (`mosaic_state.MosaicStateConfig`) that a GDNConfig asks for."""
    return mosaic_state.MosaicStateConfig(block_v=config.block_v, cluster=config.state_cluster)


def use_mosaic_state(config, chunk, key_dim, value_dim, w, gk, packed, widen, out_dtype, interpret) -> bool:
    """Whether a direct launch's state pass runs under Mosaic GPU (`GDNConfig.state_lowering`, config resolved;
    `choose_mosaic`). The kernel's products are bf16, so it takes bf16 state dots and outputs only (float32 inputs
    keep Triton's float32 dots)."""
    if config.state_lowering == "triton":
        return False
    fits = (w is not None and gk is None and packed is None and not widen and config.state_precision == "bf16"
            and jnp.dtype(out_dtype) == jnp.bfloat16
            and mosaic_state.supported(chunk, key_dim, value_dim, config.block_v))
    return choose_mosaic(
        "state_lowering", config.state_lowering, fits, interpret, "mosaic_state.state_pass_mgpu",
        takes="a direct launch with scalar gates, the delta rule, bf16 state dots and outputs, chunk 64, K 128, "
              "block_v 32 or 64 dividing V, whole chunks and (T, S) from the transfer pass",
        got=f"chunk {chunk}, K {key_dim}, V {value_dim}, block_v {config.block_v}, state dots "
            f"{config.state_precision}, outputs {jnp.dtype(out_dtype).name}")
