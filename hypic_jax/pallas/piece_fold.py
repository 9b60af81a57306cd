"""The fold over a request's pieces, one Pallas launch per linear layer: the state entering every piece.

`stitch.linear_over_layout` needs, per linear layer and value head, the state entering each piece of a request:
S <- 0 where a piece resets, then S <- T_p S + S_p, where a cached piece's (T_p, S_p) is its entry's row of the
pools and a fresh piece's is its own zero-start summary (or the identity, in programs without summaries).

Why a kernel. The number of pieces is data (`LayoutArrays.num_pieces`), so as an XLA loop each step is a handful of
small kernels plus a device-to-host copy of the loop predicate, and the host waits on every step: an all-cached
request of 32 documents runs 65 steps in each of 30 layers, about 2,000 synchronised steps (`bench/rag_trace.py
--profile-dir` shows them). Here one program per (head, block of state columns) runs the whole fold with its state
block in registers, reads a cached piece's T and S where they lie in the pool (a gathered copy of every piece's T
would be 2 MB per piece and layer at 32 heads of 128 x 128), and stops at the piece count read from memory.
Columns of the state are independent (T acts on rows), so they split across programs without any exchange.

`piece_fold_reference` is the same fold as a plain loop, beside it for tests.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hypic_jax.pallas.compose import _KERNEL_PRECISION, _block_width

__all__ = ["piece_fold", "piece_fold_reference", "piece_fold_fits", "FORMS"]

FORMS = ("identity", "scalar", "diagonal", "dense")
PIECE_FRESH, PIECE_CACHED = 1, 2  # `layout.PIECE_FRESH`, `layout.PIECE_CACHED` (the kernels sit below the layout)


def piece_fold_fits(key_dim: int, value_dim: int) -> bool:
    """Whether the Triton kernel takes these state widths (tile sides are powers of two >= 16)."""
    return all(w >= 16 and not w & (w - 1) for w in (key_dim, value_dim))


def _apply(form: str, transfer, state, prec):
    """T state for one head: transfer is T [K, K] (dense), log diag(T) [K] (diagonal), log T [] (scalar)."""
    if form == "identity":
        return state
    if form == "scalar":
        return jnp.exp(transfer) * state
    if form == "diagonal":
        return jnp.exp(transfer)[:, None] * state
    return lax.dot_general(transfer, state, (((1,), (0,)), ((), ())), precision=prec,
                           preferred_element_type=jnp.float32)


def piece_fold_reference(form: str, kind, slot, reset, count, drop, pool_t, pool_s, fresh_t=None, fresh_s=None):
    """The fold as a loop (arguments and results of `piece_fold`), for tests."""
    num, heads, key_dim, value_dim = kind.shape[0], pool_s.shape[1], pool_s.shape[2], pool_s.shape[3]
    state = jnp.zeros((heads, key_dim, value_dim), jnp.float32)
    incoming = jnp.zeros((num, heads, key_dim, value_dim), jnp.float32)
    apply = jax.vmap(functools.partial(_apply, form, prec=lax.Precision.HIGHEST)) if form != "identity" else None
    for p in range(int(count)):
        if reset[p]:
            state = jnp.zeros_like(state)
        incoming = incoming.at[p].set(state)
        if kind[p] == PIECE_CACHED:
            moved = state if (drop or apply is None) else apply(pool_t[slot[p]], state)
            state = moved + pool_s[slot[p]]
        elif kind[p] == PIECE_FRESH and fresh_s is not None:
            state = (state if apply is None else apply(fresh_t[p], state)) + fresh_s[p]
    return state, incoming


def _kernel(kind_ref, slot_ref, reset_ref, count_ref, drop_ref, *refs, form, has_fresh, prec, num, prefetch=False):
    """One (column block, head): the fold over pieces [0, count), then zeros for the pieces past it. With
    `prefetch` each step issues the loads of the next piece's (T, S) before its own products (`_prefetched`)."""
    refs = list(refs)
    t_ref = refs.pop(0) if form != "identity" else None
    s_ref = refs.pop(0)
    if has_fresh:
        ft_ref = refs.pop(0) if form != "identity" else None
        fs_ref = refs.pop(0)
    o_ref, final_ref = refs
    count = count_ref[0]
    drop = drop_ref[0] != 0

    def cached(p, acc):
        row = slot_ref[p]
        moved = acc if t_ref is None else jnp.where(drop, acc, _apply(form, t_ref[row], acc, prec))
        return moved + s_ref[row]

    def fresh(p, acc):
        if not has_fresh:
            return acc
        moved = acc if ft_ref is None else _apply(form, ft_ref[p], acc, prec)
        return moved + fs_ref[p]

    def step(p, acc):
        acc = jnp.where(reset_ref[p] != 0, jnp.zeros_like(acc), acc)
        o_ref[p] = acc
        return lax.cond(kind_ref[p] == PIECE_CACHED, functools.partial(cached, p), functools.partial(fresh, p), acc)

    if prefetch:
        acc = _prefetched(kind_ref, slot_ref, reset_ref, count, drop, t_ref, s_ref, ft_ref if has_fresh else None,
                          fs_ref if has_fresh else None, o_ref, form=form, prec=prec, num=num)
    else:
        acc = lax.fori_loop(0, count, step, jnp.zeros(o_ref.shape[1:], jnp.float32))
    final_ref[...] = acc

    def clear(p, carry):
        o_ref[p] = jnp.zeros(o_ref.shape[1:], jnp.float32)
        return carry

    lax.fori_loop(count, num, clear, 0)


def _masked(ref, index, pred):
    """ref[index] where pred holds, else zeros; a masked load, so nothing is read where pred is false (a 0-d row
    is read and selected)."""
    shape = ref.shape[1:]
    if not shape:
        return jnp.where(pred, ref[index], 0.0)
    return pltriton.load(ref.at[index], mask=jnp.full(shape, pred), other=0.0)


def _prefetched(kind_ref, slot_ref, reset_ref, count, drop, t_ref, s_ref, ft_ref, fs_ref, o_ref, *, form, prec, num):
    """The fold of `_kernel` with the loads of piece p + 1 issued before the products of piece p: the loop carries
    the next piece's (T, S), read from the pool row (a cached piece) or the fresh summary (a fresh piece) by masked
    loads, so a step no longer waits on its own loads (each step is otherwise a chain: the slot, then T and S,
    then the products). Holds two transfer tiles at a time, so it wants the wider launches (8 warps)."""
    has_fresh = fs_ref is not None

    def operands(p):
        p = jnp.minimum(p, num - 1)
        kind, row = kind_ref[p], slot_ref[p]
        cached, fresh = kind == PIECE_CACHED, (kind == PIECE_FRESH) & has_fresh
        state = _masked(s_ref, row, cached)
        if has_fresh:
            state = state + _masked(fs_ref, p, fresh)
        if t_ref is None:
            return None, state
        transfer = _masked(t_ref, row, cached)
        if has_fresh:
            transfer = transfer + _masked(ft_ref, p, fresh)
        return transfer, state

    def step(p, carry):
        acc, transfer, state = carry
        ahead = operands(p + 1)
        acc = jnp.where(reset_ref[p] != 0, jnp.zeros_like(acc), acc)
        o_ref[p] = acc
        if transfer is not None:
            kind = kind_ref[p]
            moves = ((kind == PIECE_CACHED) & jnp.logical_not(drop)) | ((kind == PIECE_FRESH) & has_fresh)
            acc = jnp.where(moves, _apply(form, transfer, acc, prec), acc)
        return (acc + state,) + ahead

    zero = jnp.zeros(o_ref.shape[1:], jnp.float32)
    acc, _, _ = lax.fori_loop(0, count, step, (zero,) + operands(0))  # (the identity form carries T as None)
    return acc


def piece_fold(form: str, kind: Array, slot: Array, reset: Array, count: Array, drop: Array, pool_t: Array | None,
               pool_s: Array, fresh_t: Array | None = None, fresh_s: Array | None = None, *,
               algorithm: str | None = "bf16x3", block_w: int = 32, num_warps: int = 8, num_stages: int = 1,
               prefetch: bool = False, interpret: bool = False) -> tuple[Array, Array]:
    """The state after the last of `count` pieces and the state entering every piece, in one launch.

    kind, slot, reset: int32/bool [N] per piece (`layout` piece kinds; a cached piece's pool row; the state before
    it is zero). count: int32 [] pieces in use (the rest get zero incoming states). drop: bool [] cached pieces'
    transfers are the identity (`addition`). pool_t [P, H, ...] / pool_s [P, H, K, V]: the cached summaries' rows,
    transfers in `form` (dense [K, K], diagonal log [K], scalar log [], identity None). fresh_t [N, H, ...] /
    fresh_s [N, H, K, V]: every fresh piece's own summary, or None (fresh pieces pass the state through).
    algorithm: dot algorithm of the dense products (None: float32). prefetch: issue each piece's loads one step
    ahead (`_prefetched`; not timed on a GPU yet: `bench/investigations/piece_fold.py`). Returns (final [H, K, V],
    incoming [N, H, K, V]), float32.
    """
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    num = kind.shape[0]
    pool_rows, heads, key_dim, value_dim = pool_s.shape
    if (form == "identity") != (pool_t is None) or (fresh_s is not None and fresh_s.shape != (num,) + pool_s.shape[1:]):
        raise ValueError(f"piece fold operands disagree: form {form}, pool_t "
                         f"{None if pool_t is None else pool_t.shape}, pool_s {pool_s.shape}, fresh_s "
                         f"{None if fresh_s is None else fresh_s.shape}, {num} pieces")
    bw = _block_width(block_w, value_dim)
    t_tail = {"scalar": (), "diagonal": (key_dim,), "dense": (key_dim, key_dim)}.get(form)
    t_block = lambda rows: pl.BlockSpec((rows, None) + t_tail, lambda j, h: (0, h) + (0,) * len(t_tail))  # noqa
    s_block = lambda rows: pl.BlockSpec((rows, None, key_dim, bw), lambda j, h: (0, h, 0, j))  # noqa: E731
    vector = lambda n: pl.BlockSpec((n,), lambda j, h: (0,))  # noqa: E731
    in_specs = [vector(num), vector(num), vector(num), vector(1), vector(1)]
    args = [kind.astype(jnp.int32), slot.astype(jnp.int32), reset.astype(jnp.int32),
            jnp.reshape(count, (1,)).astype(jnp.int32), jnp.reshape(drop, (1,)).astype(jnp.int32)]
    if pool_t is not None:
        in_specs.append(t_block(pool_rows))
        args.append(pool_t.astype(jnp.float32))
    in_specs.append(s_block(pool_rows))
    args.append(pool_s.astype(jnp.float32))
    has_fresh = fresh_s is not None
    if has_fresh:
        if pool_t is not None:
            in_specs.append(t_block(num))
            args.append(fresh_t.astype(jnp.float32))
        in_specs.append(s_block(num))
        args.append(fresh_s.astype(jnp.float32))
    kernel = functools.partial(_kernel, form=form, has_fresh=has_fresh, num=num, prefetch=prefetch,
                               prec=_KERNEL_PRECISION["f32" if algorithm is None else algorithm])
    incoming, final = pl.pallas_call(
        kernel,
        grid=(value_dim // bw, heads),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((num, None, key_dim, bw), lambda j, h: (0, h, 0, j)),
                   pl.BlockSpec((None, key_dim, bw), lambda j, h: (h, 0, j))],
        out_shape=[jax.ShapeDtypeStruct((num, heads, key_dim, value_dim), jnp.float32),
                   jax.ShapeDtypeStruct((heads, key_dim, value_dim), jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="piece_fold",
    )(*args)
    return final, incoming
