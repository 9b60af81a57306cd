"""Step 2 of the linear core over a layout: the fold over the pieces in request order, which yields the state
entering every piece. As a loop, as batched products in blocks (no loop bound by data), or as the Pallas kernel
`pallas.piece_fold`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array

from hypic_jax.core import linear_attn
from hypic_jax.core.linear_attn import Summary
from hypic_jax.core.summary import apply_transfer
from hypic_jax.kernels import piece_fold
from hypic_jax.stitch.layout import PIECE_CACHED, PIECE_FRESH, LayoutArrays
from hypic_jax.stitch.linear_common import _put


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
    This costs about 3N transfer-sized products against the loop's N, in large batched matmuls
    (`bench/investigations/piece_fold.py` times it beside the loop and the Pallas kernel; bench/RESULTS.md). A reset
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
