"""`piece_fold`: the state entering every piece of a request and the state after the last, in one launch.

Program (block of state columns, head) runs, for p = 0 .. count - 1 (`count` read from memory),

    S <- 0 where reset[p];   incoming[p] = S;   S <- T_p S + S_p,

with (T_p, S_p) the pool row slot[p] for a cached piece (T_p = I where `drop`), the piece's own summary for a fresh
one (T_p = I, S_p = 0 without fresh summaries). T_p S takes the summary's form: a K x K product (dense, at the named
dot algorithm), a row scale e^{log T} (diagonal) or a scalar one (scalar), nothing (identity). Pieces past `count`
get zero incoming states.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hypic_jax.kernels.piece_fold.common import FORMS, PIECE_CACHED, apply_transfer
from hypic_jax.kernels.utils import block_width, dot_precision

__all__ = ["piece_fold"]


def _kernel(kind_ref, slot_ref, reset_ref, count_ref, drop_ref, *refs, form, has_fresh, prec, num):
    """One (column block, head): the fold over pieces [0, count), then zeros for the pieces past it."""
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
        moved = acc if t_ref is None else jnp.where(drop, acc, apply_transfer(form, t_ref[row], acc, prec))
        return moved + s_ref[row]

    def fresh(p, acc):
        if not has_fresh:
            return acc
        moved = acc if ft_ref is None else apply_transfer(form, ft_ref[p], acc, prec)
        return moved + fs_ref[p]

    def step(p, acc):
        acc = jnp.where(reset_ref[p] != 0, jnp.zeros_like(acc), acc)
        o_ref[p] = acc
        return lax.cond(kind_ref[p] == PIECE_CACHED, functools.partial(cached, p), functools.partial(fresh, p), acc)

    acc = lax.fori_loop(0, count, step, jnp.zeros(o_ref.shape[1:], jnp.float32))
    final_ref[...] = acc

    def clear(p, carry):
        o_ref[p] = jnp.zeros(o_ref.shape[1:], jnp.float32)
        return carry

    lax.fori_loop(count, num, clear, 0)


def piece_fold(form: str, kind: Array, slot: Array, reset: Array, count: Array, drop: Array, pool_t: Array | None,
               pool_s: Array, fresh_t: Array | None = None, fresh_s: Array | None = None, *,
               algorithm: str | None = "bf16x3", block_w: int = 32, num_warps: int = 8, num_stages: int = 1,
               interpret: bool = False) -> tuple[Array, Array]:
    """The state after the last of `count` pieces and the state entering every piece, in one launch.

    kind, slot, reset: int32/bool [N] per piece (`layout` piece kinds; a cached piece's pool row; the state before
    it is zero). count: int32 [] pieces in use (the rest get zero incoming states). drop: bool [] cached pieces'
    transfers are the identity (`addition`). pool_t [P, H, ...] / pool_s [P, H, K, V]: the cached summaries' rows,
    transfers in `form` (dense [K, K], diagonal log [K], scalar log [], identity None). fresh_t [N, H, ...] /
    fresh_s [N, H, K, V]: every fresh piece's own summary, or None (fresh pieces pass the state through).
    algorithm: dot algorithm of the dense products (None: float32). Returns (final [H, K, V], incoming
    [N, H, K, V]), float32. `reference.piece_fold_reference` is the same fold as a loop.
    """
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    num = kind.shape[0]
    pool_rows, heads, key_dim, value_dim = pool_s.shape
    if (form == "identity") != (pool_t is None) or (fresh_s is not None and fresh_s.shape != (num,) + pool_s.shape[1:]):
        raise ValueError(f"piece fold operands disagree: form {form}, pool_t "
                         f"{None if pool_t is None else pool_t.shape}, pool_s {pool_s.shape}, fresh_s "
                         f"{None if fresh_s is None else fresh_s.shape}, {num} pieces")
    bw = block_width(block_w, value_dim)
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
    kernel = functools.partial(_kernel, form=form, has_fresh=has_fresh, num=num,
                               prec=dot_precision(algorithm))
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
