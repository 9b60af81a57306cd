"""The pieces of a span forward that read a request's layout as data (`hypic_jax.stitch.layout.LayoutArrays`).

Every function here has shapes fixed by the layout's `Capacity`, and every loop runs to a bound held in the layout
(`num_chunks`, `num_pieces`, the key range of a query block), so requests of any lengths, orders and hit patterns
that fit one capacity share one compiled program, and padding costs buffer space, not loop steps.

* conv: each fresh token's W-1 predecessors are rows of one table [zero | fresh rows | cached tails], named by
  `conv_rows`; the depthwise conv is W shifted multiply-adds of gathered rows.
* linear core, three steps (all loops bounded by data):
    1. (programs that need it) every fresh piece's own summary (T, S(piece|0)): one chunk loop with the state
       widened by an identity block for dense transfers, restarted at each piece;
    2. a fold over the pieces in request order, each applying its summary (fresh: step 1; cached: its pool row,
       RoPE-moved and without T for `addition`); a piece flagged `piece_reset` starts from zero. It yields the
       state entering every piece;
    3. the output chunk loop: a chunk that starts a piece loads that piece's incoming state (`chunk_load`) or
       carries on from the chunk before; it also keeps every piece's end state (prefix-cache snapshots).
  Chunk-local work (the WY/UT solves) is shared by steps 1 and 3: the widened pass only appends zero value
  columns. On a GPU (`linear_kernel_fits`, `impl=`) steps 1 and 3 run the Pallas kernels instead
  (`pallas.gdn.gdn_varlen`): the pieces are its packed segments, their offsets `cu` built from the layout's chunk
  tables, and the padded tokens past the last piece belong to no segment. Step 1 is one zero-start launch that
  emits every piece's (T, S); step 3 one launch where each piece starts from its incoming state or carries on from
  the piece before (`continues`), returning every piece's end state. The kernels step only the chunks that hold
  tokens, so padding costs no sequential step there either.
  A stitched request that records nothing (every PIC request) runs the three steps as one where the fold is a
  kernel (`pallas.piece_fold.chunk_fold`): the chunk-local work of all its chunks, then one fold in which a fresh
  piece steps through its chunks and emits their outputs.
* attention: keys are gathered in absolute order from the fresh keys and the per-token pools (`key_index`), and
  each block of queries runs an online-softmax loop over only the key blocks it can see.
* a model axis: traced under a mesh with a "model" axis of M > 1 devices (`jax.set_mesh`; `Engine(tensor_parallel=M)`
  lowers its programs so), the linear core and attention run on each device's 1/M of the
  heads (`jax.shard_map`), where M divides them. Heads are independent in both, so the split changes no result;
  it is what lets the Pallas kernels, custom calls that XLA's partitioner cannot split, read only their device's
  share of the split pools instead of gathered whole operands.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import Array

from hypic_jax.core import linear_attn
from hypic_jax.stitch.layout import PIECE_CACHED, PIECE_FRESH, LayoutArrays
from hypic_jax.core.linear_attn import LinearInputs, Summary
from hypic_jax.core.summary import apply_transfer, einsum
from hypic_jax.kernels import gdn as pallas_gdn
from hypic_jax.kernels import piece_fold
from hypic_jax.kernels.attention import AttentionConfig, positioned_attention

MASK_VALUE = -1e30  # finite: a query with no visible key averages values instead of producing NaN
MODEL_AXIS = "model"  # the tensor-parallel mesh axis (`engine.placement.tensor_parallel_mesh`, the models' `param_specs`)

__all__ = ["conv_over_layout", "linear_over_layout", "linear_kernel_fits", "LINEAR_IMPLS", "gather_keys",
           "masked_attention", "row_writes", "apply_row_writes", "RowWrites", "LinearResult", "model_split",
           "MODEL_AXIS"]


# ----------------------------------------------------------------------------------------------------------------
# The model axis


def model_split(heads: int) -> int:
    """M, the size of the "model" axis of the mesh being traced under (`jax.set_mesh`), when M > 1 divides `heads`;
    else 1 (no mesh, no such axis, or heads it cannot split evenly: the caller runs on whole operands)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or MODEL_AXIS not in mesh.axis_names:
        return 1
    size = mesh.shape[MODEL_AXIS]
    return size if size > 1 and heads % size == 0 else 1


def _over_heads(fn: Callable, split: tuple, whole: tuple):
    """fn(*split, *whole) on each device of the traced mesh's model axis, with every array in `split` and in fn's
    results split along axis 1 (the heads) and `whole` replicated. fn must treat heads independently."""
    heads = jax.sharding.PartitionSpec(None, MODEL_AXIS)
    return jax.shard_map(fn, mesh=jax.sharding.get_abstract_mesh(),
                         in_specs=(heads,) * len(split) + (jax.sharding.PartitionSpec(),) * len(whole),
                         out_specs=heads, check_vma=False)(*split, *whole)


# ----------------------------------------------------------------------------------------------------------------
# Conv


def conv_over_layout(x: Array, weight: Array, pool_tails: Array, layout: LayoutArrays, *,
                     activation: str | None = "silu") -> tuple[Array, Array, Array]:
    """Depthwise causal conv of the fresh rows x [F, D] as if every span were laid out in order.

    weight [D, W]; pool_tails [S, W-1, D]: every pool slot's stored tail. Returns (y [F, D], the tail after the
    last span [W-1, D], per record the tail after its span [R, W-1, D]).
    """
    w1 = weight.shape[1] - 1
    pieces = layout.piece_slot.shape[0]
    tails = pool_tails[layout.piece_slot].astype(x.dtype).reshape(pieces * w1, x.shape[1])
    table = jnp.concatenate([jnp.zeros((1, x.shape[1]), x.dtype), x, tails], axis=0)
    w = weight.astype(jnp.float32)
    acc = x.astype(jnp.float32) * w[:, w1]
    for tap in range(w1):
        acc = acc + table[layout.conv_rows[:, tap]].astype(jnp.float32) * w[:, tap]
    act = {None: lambda a: a, "silu": jax.nn.silu}[activation]
    return act(acc).astype(x.dtype), table[layout.conv_final], table[layout.conv_records]


# ----------------------------------------------------------------------------------------------------------------
# Linear core


def _head_major_chunks(x: Array | None, layout: LayoutArrays, acc) -> Array | None:
    """x [F, H, ...] -> [C, H, c, ...] by the layout's chunk rows (padding rows are zero: A = I, nothing added)."""
    if x is None:
        return None
    padded = jnp.concatenate([x.astype(acc), jnp.zeros((1,) + x.shape[1:], acc)], axis=0)
    return jnp.moveaxis(padded[layout.chunk_rows], 1, 2)


def _put(buffer: Array, index, value: Array) -> Array:
    return jax.lax.dynamic_update_index_in_dim(buffer, value.astype(buffer.dtype), index, 0)


class LinearResult:
    """What `linear_over_layout` returns: outputs [F, H, V], the state after the whole request [H, K, V], the
    summary of every fresh piece [N, ...] (None unless computed; the rows of other pieces are undefined with the
    kernels) and every piece's end state [N, H, K, V] (both None from `_linear_over_layout_chunk_fold`)."""

    def __init__(self, outputs, final_state, piece_summaries, piece_ends):
        self.outputs, self.final_state = outputs, final_state
        self.piece_summaries, self.piece_ends = piece_summaries, piece_ends


LINEAR_IMPLS = ("xla", "pallas", "auto")


def _kernel_problem(inputs: LinearInputs) -> str | None:
    """Why `pallas.gdn.gdn_varlen` cannot take these inputs, or None when it can."""
    key_dim, value_dim = inputs.k.shape[-1], inputs.v.shape[-1]
    if inputs.q is None:
        return "the kernels need q"
    if not all(d >= 16 and not d & (d - 1) for d in (key_dim, value_dim)):
        return f"K and V must be powers of two >= 16 (Triton tiles), got K={key_dim}, V={value_dim}"
    if inputs.v.shape[1] % inputs.k.shape[1]:
        return f"key heads {inputs.k.shape[1]} do not divide value heads {inputs.v.shape[1]}"
    return None


def linear_kernel_fits(inputs: LinearInputs, impl: str = "auto") -> bool:
    """Whether `linear_over_layout` runs the linear core through the Pallas kernels (`pallas.gdn.gdn_varlen`):
    "pallas" always (the Pallas interpreter off a GPU; a ValueError naming the problem when the kernels cannot
    take the inputs), "auto" on a GPU for bfloat16 values when they can (the rule of the models' own forward,
    `base.KernelOptions.linear`), "xla" never."""
    if impl not in LINEAR_IMPLS:
        raise ValueError(f"impl must be one of {LINEAR_IMPLS}, got {impl!r}")
    if impl == "xla":
        return False
    problem = _kernel_problem(inputs)
    if impl == "pallas":
        if problem is not None:
            raise ValueError(f"impl='pallas' cannot take these inputs: {problem}")
        return True
    return problem is None and inputs.v.dtype == jnp.bfloat16 and not pallas_gdn.default_interpret()


def _repeat_key_heads(inputs: LinearInputs) -> LinearInputs:
    """q and k repeated from Hk key heads to the H value heads (head h reads key head h // (H / Hk))."""
    group = inputs.v.shape[1] // inputs.k.shape[1]
    if group == 1:
        return inputs
    rep = lambda x: None if x is None else jnp.repeat(x, group, axis=1)  # noqa: E731
    return dataclasses.replace(inputs, q=rep(inputs.q), k=rep(inputs.k))


def linear_over_layout(
    inputs: LinearInputs,
    pool: Summary,
    layout: LayoutArrays,
    *,
    summaries: bool,
    rotate: Callable[[Summary, Array], Summary] | None = None,
    algorithm: str | None = None,
    impl: str = "xla",
    kernel_config: pallas_gdn.GDNConfig | None = None,
    fold_impl: str = "auto",
) -> LinearResult:
    """A linear layer's core over the pieces of `layout`.

    inputs: the family's LinearInputs of the fresh tokens ([F, H, ...]; q and k may have fewer key heads Hk
    dividing H, each serving H / Hk consecutive value heads). pool: every slot's cached summary
    ([S, H, K, V] states, transfers in the family's form). summaries: compute every fresh piece's own summary
    (needed when a fresh piece precedes a cached one, and for the records of a cold prefill). The layout's
    `drop_transfer` drops cached transfers (HYPIC's `addition`). rotate(summary, offset): moves a cached summary by `offset`
    positions (RoPE'd linear layers), applied when given.
    impl: "xla" (the chunk loops below), "pallas" or "auto" (`linear_kernel_fits`): steps 1 and 3 through
    `pallas.gdn.gdn_varlen` (its `kernel_config`; None: `default_varlen_config`). Both give the same outputs,
    states and summaries up to rounding, except in rows that nothing reads: padded tokens' outputs (zeros from the
    kernels), and the summaries and end states of pieces that are not fresh.
    fold_impl: step 2, the fold over the pieces: "auto" the Pallas kernel `pallas.piece_fold` on a GPU where it
    fits (`piece_fold_fits`; always when impl is "pallas"), else "blocked" on a GPU and "xla" elsewhere; "pallas"
    always (interpreted off a GPU), "xla" the loop, "blocked" batched products in blocks without a loop bound by
    data (`_blocked_fold`).
    Where the fold runs as a kernel and the layout computes summaries but records none (a stitched PIC request),
    steps 1 to 3 become one: `_linear_over_layout_chunk_fold`. It returns no summaries and no piece end states.
    Under a model axis (`model_split` of the value heads) each device runs all of this on its own heads; key heads
    that the axis does not divide are first repeated to the value heads.
    """
    run = functools.partial(_linear_over_layout, summaries=summaries, rotate=rotate, algorithm=algorithm, impl=impl,
                            kernel_config=kernel_config, fold_impl=fold_impl)
    split = model_split(inputs.v.shape[1])
    if split == 1:
        return run(inputs, pool, layout)
    if inputs.k.shape[1] % split:
        inputs = _repeat_key_heads(inputs)

    def local(inputs, pool, layout):
        result = run(inputs, pool, layout)  # the final state [H, K, V] with a leading axis, so heads are axis 1
        return result.outputs, result.final_state[None], result.piece_summaries, result.piece_ends

    outputs, final, piece_summaries, piece_ends = _over_heads(local, (inputs, pool), (layout,))
    return LinearResult(outputs, final[0], piece_summaries, piece_ends)


def _linear_over_layout(inputs: LinearInputs, pool: Summary, layout: LayoutArrays, *, summaries: bool, rotate,
                        algorithm, impl: str, kernel_config, fold_impl: str) -> LinearResult:
    """`linear_over_layout` on the heads it is given."""
    fold_impl = "pallas" if impl == "pallas" and fold_impl == "auto" else fold_impl
    if (summaries and layout.record_piece.shape[0] == 0 and inputs.q is not None
            and _use_fold_kernel(fold_impl, inputs.k.shape[-1], inputs.v.shape[-1])):
        return _linear_over_layout_chunk_fold(inputs, pool, layout, rotate=rotate, algorithm=algorithm,
                                              kernel_locals=linear_kernel_fits(inputs, impl), config=kernel_config)
    if linear_kernel_fits(inputs, impl):
        return _linear_over_layout_kernels(inputs, pool, layout, summaries=summaries, rotate=rotate,
                                           algorithm=algorithm, config=kernel_config, fold_impl=fold_impl)
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


FOLD_IMPLS = ("xla", "blocked", "pallas", "auto")


def _use_fold_kernel(fold_impl: str, key_dim: int, value_dim: int) -> bool:
    if fold_impl not in FOLD_IMPLS:
        raise ValueError(f"fold_impl must be one of {FOLD_IMPLS}, got {fold_impl!r}")
    fits = piece_fold.piece_fold_fits(key_dim, value_dim)
    if fold_impl == "pallas" and not fits:
        raise ValueError(f"fold_impl='pallas' needs state widths that are powers of two >= 16, got K={key_dim}, "
                         f"V={value_dim}")
    return fold_impl == "pallas" or (fold_impl == "auto" and fits and jax.default_backend() == "gpu")


def _blocked_fold(sequence: Summary, reset: Array, count: Array, algorithm, block: int | None = None
                  ) -> tuple[Array, Array]:
    """The fold S <- T_p (0 if reset_p else S) + S_p over the N pieces of `sequence`, without a loop whose trip
    count is data: (the state after piece count-1, the state entering every piece [N, H, K, V]).

    A loop over `count` pieces is sequential in the pieces and, in XLA on a GPU, waits on the host for its
    predicate every step. Here the pieces are cut into B blocks of L (L about sqrt(N)) and three passes of
    batched products, all unrolled at trace time, give every state at depth L + B:
      1. inside every block at once, the running pair (prod of T, local S) from the block's start (`compose`);
      2. across blocks, the state at each block's end: C_b = T_b C_{b-1} + S_b with block b's whole pair;
      3. every piece's end state, its in-block pair applied to the state before the block, in one product.
    This costs about 3N transfer-sized products against the loop's N, in large batched matmuls; on the H200 the
    Pallas kernel's sequential steps still win (`bench/investigations/piece_fold.py`, bench/RESULTS.md). A reset
    is the zero map folded into the piece's transfer (a zero matrix, or a log decay of -inf), so resets cost
    nothing.
    Pieces past `count` come after every piece that matters: the fold never carries them backwards, and their
    incoming states are zeroed."""
    num, shape = reset.shape[0], sequence.state.shape[1:]
    if sequence.form == "identity":
        sequence = linear_attn.promote(sequence, "scalar")
    expand = lambda m, a: m.reshape(m.shape + (1,) * (a.ndim - 1))  # noqa: E731
    if sequence.form == "dense":
        transfer = jnp.where(expand(reset, sequence.transfer), 0.0, sequence.transfer)
    else:
        transfer = jnp.where(expand(reset, sequence.transfer), -jnp.inf, sequence.transfer)
    sequence = Summary(sequence.form, sequence.state, transfer)
    length = block or max(1, int(round(num ** 0.5)))
    blocks = -(-num // length)
    pad = blocks * length - num
    if pad:  # identity pieces at the end (zero state, transfer of the neutral element)
        unit = linear_attn.promote(Summary("identity", jnp.zeros((pad,) + shape, jnp.float32), None), sequence.form)
        sequence = jax.tree.map(lambda a, u: jnp.concatenate([a, u.astype(a.dtype)]), sequence, unit)
    grid = jax.tree.map(lambda a: a.reshape((blocks, length) + a.shape[1:]), sequence)
    # 1. running pairs inside the blocks, all blocks at once
    running = [jax.tree.map(lambda a: a[:, 0], grid)]
    for i in range(1, length):
        step = jax.tree.map(lambda a, i=i: a[:, i], grid)
        running.append(linear_attn.compose(running[-1], step, algorithm=algorithm))
    # 2. the state at every block's end, block after block
    ends = [running[-1].state[0]]
    for b in range(1, blocks):
        whole = jax.tree.map(lambda a, b=b: a[b], running[-1])
        ends.append(apply_transfer(whole, ends[-1], algorithm) + whole.state)
    before = jnp.stack([jnp.zeros(shape, jnp.float32)] + ends[:-1])  # [B, H, K, V]: entering each block
    # 3. every piece's end state: its running pair applied to the state entering its block
    pairs = jax.tree.map(lambda *a: jnp.stack(a, axis=1), *running)  # [B, L, ...]
    moved = jnp.broadcast_to(before[:, None], (blocks, length) + shape)
    after = (apply_transfer(pairs, moved, algorithm) + pairs.state).reshape((blocks * length,) + shape)[:num]
    incoming = jnp.concatenate([jnp.zeros((1,) + shape, jnp.float32), after[:-1]])
    live = (jnp.arange(num) < count) & ~reset
    incoming = jnp.where(expand(live, incoming), incoming, 0.0)
    final = jnp.where(count > 0, after[jnp.maximum(count - 1, 0)], 0.0)
    return final, incoming


def _fold_pieces(pool: Summary, layout: LayoutArrays, form: str, fresh_summary: Summary | None, rotate, algorithm,
                 dims: tuple[int, int, int], fold_impl: str = "xla", block: int | None = None
                 ) -> tuple[Array, Array]:
    """Step 2 of `linear_over_layout`: the fold over the pieces in request order. Returns (the state after the
    last piece, the state entering every piece [N, H, K, V]). block: the blocked fold's block size (None: about
    sqrt(N); `_blocked_fold`)."""
    acc = jnp.float32
    heads, key_dim, value_dim = dims
    num_pieces = layout.piece_kind.shape[0]
    fold_form = linear_attn.FORMS[max(linear_attn.FORMS.index(pool.form), linear_attn.FORMS.index(form))]
    kernel = _use_fold_kernel(fold_impl, key_dim, value_dim)
    if kernel and rotate is None and pool.form == fold_form:  # the kernel reads the cached rows in the pools
        fresh = None if fresh_summary is None else linear_attn.promote(fresh_summary, fold_form)
        return piece_fold.piece_fold(
            fold_form, layout.piece_kind, layout.piece_slot, layout.piece_reset, layout.num_pieces,
            layout.drop_transfer, pool.transfer, pool.state, None if fresh is None else fresh.transfer,
            None if fresh is None else fresh.state, algorithm=algorithm, interpret=jax.default_backend() != "gpu")
    cached = Summary(pool.form, pool.state[layout.piece_slot].astype(acc),
                     None if pool.transfer is None else pool.transfer[layout.piece_slot].astype(acc))
    if rotate is not None:
        cached = jax.vmap(rotate)(cached, layout.piece_offset)
    cached = linear_attn.promote(cached, fold_form)
    if kernel:  # rotated or promoted rows: the kernel reads them gathered, piece by piece
        fresh = None if fresh_summary is None else linear_attn.promote(fresh_summary, fold_form)
        return piece_fold.piece_fold(
            fold_form, layout.piece_kind, jnp.arange(num_pieces, dtype=jnp.int32), layout.piece_reset,
            layout.num_pieces, layout.drop_transfer, cached.transfer, cached.state,
            None if fresh is None else fresh.transfer, None if fresh is None else fresh.state, algorithm=algorithm,
            interpret=jax.default_backend() != "gpu")
    if cached.transfer is not None:  # `addition`: the transfer of every cached piece becomes the identity
        unit = linear_attn.promote(Summary("identity", cached.state, None), fold_form).transfer
        cached = Summary(fold_form, cached.state, jnp.where(layout.drop_transfer, unit, cached.transfer))
    if fresh_summary is not None:
        fresh_summary = linear_attn.promote(fresh_summary, fold_form)
        is_fresh = layout.piece_kind == PIECE_FRESH
        pick = lambda f, c: jnp.where(is_fresh.reshape((-1,) + (1,) * (f.ndim - 1)), f, c)  # noqa: E731
        sequence = jax.tree.map(pick, fresh_summary, cached)
    else:  # fresh pieces pass the state through; only pieces after cached ones load it (see layout.build)
        identity = linear_attn.promote(Summary("identity", jnp.zeros_like(cached.state), None), fold_form)
        is_cached = layout.piece_kind == PIECE_CACHED
        pick = lambda c, z: jnp.where(is_cached.reshape((-1,) + (1,) * (c.ndim - 1)), c, z)  # noqa: E731
        sequence = jax.tree.map(pick, cached, identity)

    if fold_impl == "blocked" or (fold_impl == "auto" and jax.default_backend() == "gpu"):
        # on a GPU without the kernel (widths it cannot tile) the loop would wait on the host every step
        return _blocked_fold(sequence, layout.piece_reset, layout.num_pieces, algorithm, block)

    def fold(p, carry):
        state, incoming = carry
        state = jnp.where(layout.piece_reset[p], jnp.zeros_like(state), state)
        incoming = _put(incoming, p, state)
        row = jax.tree.map(lambda a: a[p], sequence)
        state = apply_transfer(row, state, algorithm) + row.state
        return state, incoming

    zero = jnp.zeros((heads, key_dim, value_dim), acc)
    return jax.lax.fori_loop(0, layout.num_pieces, fold,
                             (zero, jnp.zeros((num_pieces, heads, key_dim, value_dim), acc)))


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


def record_summaries(result: LinearResult, layout: LayoutArrays, *, isolated: bool, pool: Summary) -> Summary:
    """The summaries to store for the layout's records, in the pool's form: a cold prefill stores each recorded
    interior's own summary; a stitched request stores each recorded span's end state (a prefix-cache snapshot,
    which a later request loads with `piece_reset`, so its transfer is never read and is stored as zeros)."""
    if not layout.record_piece.shape[0]:  # records nothing (the result may hold no summaries nor end states)
        return jax.tree.map(lambda a: jnp.zeros((0,) + a.shape[1:], a.dtype), pool)
    if isolated:
        rows = jax.tree.map(lambda a: a[layout.record_piece], result.piece_summaries)
        return linear_attn.promote(rows, pool.form)
    state = result.piece_ends[layout.record_piece]
    transfer = None if pool.transfer is None else jnp.zeros((state.shape[0],) + pool.transfer.shape[1:],
                                                            pool.transfer.dtype)
    return Summary(pool.form, state, transfer)


class RowWrites(NamedTuple):
    """Rows to write into one layer's pool: `rows` [n] (past the pool, `layout.DROP`, for none: unused records,
    unrecorded and padded tokens) and `values`, a tree like the pool's with leading axis n, in its dtypes."""

    rows: Array
    values: Any


def row_writes(pool, rows: Array, values) -> RowWrites:
    """What a span forward returns instead of writing its pool: the write runs as its own program
    (`apply_row_writes`), because a program that both reads a donated pool (the fold, the key gather) and writes it
    in place makes XLA copy the whole pool on every call, a cost proportional to the cache's size."""
    return RowWrites(rows, jax.tree.map(lambda a, v: v.astype(a.dtype), pool, values))


def apply_row_writes(pool, writes: RowWrites):
    """pool (a PyTree of [S, ...] arrays) with rows `writes.rows` set to `writes.values`; rows past the pool are
    dropped. Write-only, so a donated pool is updated in place."""
    return jax.tree.map(lambda a, v: a.at[writes.rows].set(v, mode="drop"), pool, writes.values)


# ----------------------------------------------------------------------------------------------------------------
# Attention


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


def masked_attention(q: Array, k: Array, v: Array, layout: LayoutArrays, *, isolated: bool, scale: float,
                     block_q: int = 64, block_k: int = 128, use_kernel: bool | None = None) -> Array:
    """GQA attention of the fresh queries q [F, Hq, D] over the keys k, v [P, Hkv, D(v)] in key order.

    Key j is visible to query i iff j < num_keys, key_positions[j] <= positions[i] and, when isolated, both belong
    to the same span. Each block of `block_q` queries loops over the key blocks between its first and last
    visible key (from the layout: stitched keys are in absolute order, isolated keys are the packed fresh
    tokens), with an online softmax, so neither the logits [F, P] nor padded keys are ever computed in full.
    On a GPU (`kernel_fits`; `use_kernel` forces either path) the same mask runs in the Pallas flash kernel
    `pallas.attention.positioned_attention`, with each query's first and last visible key. Under a model axis that
    divides the key heads (`model_split`) each device attends with its own heads (query heads follow their key
    head).
    """
    run = functools.partial(_masked_attention, isolated=isolated, scale=scale, block_q=block_q, block_k=block_k,
                            use_kernel=use_kernel)
    if model_split(k.shape[1]) == 1:
        return run(q, k, v, layout)
    return _over_heads(run, (q, k, v), (layout,))


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
