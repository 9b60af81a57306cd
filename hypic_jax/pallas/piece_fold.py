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

`chunk_fold` is the same fold for a request that records nothing (a stitched PIC request): a fresh piece enters it
as its chunks' steps instead of a dense summary, and each chunk's outputs are emitted from the state entering it,
so neither the fresh pieces' summaries nor the incoming states are ever formed (its docstring says what that
saves; `bench/investigations/piece_fold.py` and `bench/rag_trace.py --profile-dir` time it).

`piece_fold_reference` and `chunk_fold_reference` are the same folds as plain loops, beside them for tests.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hypic_jax.pallas.compose import _KERNEL_PRECISION, _block_width

__all__ = ["piece_fold", "piece_fold_reference", "piece_fold_fits", "chunk_fold", "chunk_fold_reference", "FORMS"]

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
    [N, H, K, V]), float32.
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
    kernel = functools.partial(_kernel, form=form, has_fresh=has_fresh, num=num,
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


# ----------------------------------------------------------------------------------------------------------------
# The fold with fresh pieces as chunk steps: a stitched request's whole linear core but its chunk-local work.


def _chunk_step(acc, w, u, k_to_end, decay, q_decayed, scores, dot):
    """One chunk from the state acc [K, Vb]: (its unscaled outputs [c, Vb], the state after it). The chunk's
    `linear_attn.chunk_locals` are inputs: U - W acc is what its tokens write, q_decayed acc what its queries read
    of the state before it, scores the chunk's causal scores."""
    inner = u if w is None else u - dot(w, acc)
    out = dot(q_decayed, acc) + dot(scores, inner)
    return out, decay[:, None] * acc + dot(k_to_end, inner)


def chunk_fold_reference(form, kind, slot, reset, count, drop, piece_chunks, pool_t, pool_s, w, u, k_to_end, decay,
                         q_decayed, scores):
    """`chunk_fold` as a loop in float32 (HIGHEST products), with k_to_end as [C, H, c, K]; for tests."""
    hi = lax.Precision.HIGHEST
    heads, key_dim, value_dim = pool_s.shape[1:]
    num_chunks, c = u.shape[0], u.shape[2]
    state = jnp.zeros((heads, key_dim, value_dim), jnp.float32)
    outputs = jnp.zeros((num_chunks, heads, c, value_dim), jnp.float32)
    apply = jax.vmap(functools.partial(_apply, form, prec=hi)) if form != "identity" else None
    step = jax.vmap(functools.partial(_chunk_step, dot=functools.partial(jnp.dot, precision=hi)))
    for p in range(int(count)):
        if reset[p]:
            state = jnp.zeros_like(state)
        if kind[p] == PIECE_CACHED:
            moved = state if (drop or apply is None) else apply(pool_t[slot[p]], state)
            state = moved + pool_s[slot[p]]
        elif kind[p] == PIECE_FRESH:
            for i in range(int(piece_chunks[p]), int(piece_chunks[p + 1])):
                out, state = step(state, None if w is None else w[i], u[i], jnp.swapaxes(k_to_end[i], -1, -2),
                                  decay[i], q_decayed[i], scores[i])
                outputs = outputs.at[i].set(out)
    return state, outputs


def _chunk_fold_kernel(kind_ref, slot_ref, reset_ref, count_ref, drop_ref, chunks_ref, *refs, form, has_w, prec,
                       chunk_prec, num_chunks):
    """One (column block, head): the fold over pieces [0, count), a fresh piece stepping through its chunks and
    writing their outputs; zeros for the chunks past the last piece's."""
    refs = list(refs)
    t_ref = refs.pop(0) if form != "identity" else None
    s_ref = refs.pop(0)
    w_ref = refs.pop(0) if has_w else None
    u_ref, kt_ref, d_ref, q_ref, sc_ref, o_ref, final_ref = refs
    count = count_ref[0]
    drop = drop_ref[0] != 0
    dot = functools.partial(lax.dot_general, dimension_numbers=(((1,), (0,)), ((), ())), precision=chunk_prec,
                            preferred_element_type=jnp.float32)

    def cached(p, acc):
        row = slot_ref[p]
        moved = acc if t_ref is None else jnp.where(drop, acc, _apply(form, t_ref[row], acc, prec))
        return moved + s_ref[row]

    def chunk(i, acc):
        out, acc = _chunk_step(acc, None if w_ref is None else w_ref[i], u_ref[i], kt_ref[i], d_ref[i], q_ref[i],
                               sc_ref[i], dot)
        o_ref[i] = out
        return acc

    def fresh(p, acc):
        return lax.fori_loop(chunks_ref[p], chunks_ref[p + 1], chunk, acc)

    def step(p, acc):
        acc = jnp.where(reset_ref[p] != 0, jnp.zeros_like(acc), acc)
        return lax.cond(kind_ref[p] == PIECE_CACHED, functools.partial(cached, p), functools.partial(fresh, p), acc)

    final_ref[...] = lax.fori_loop(0, count, step, jnp.zeros(final_ref.shape, jnp.float32))

    def clear(i, carry):
        o_ref[i] = jnp.zeros(o_ref.shape[1:], jnp.float32)
        return carry

    lax.fori_loop(chunks_ref[count], num_chunks, clear, 0)


def chunk_fold(form: str, kind: Array, slot: Array, reset: Array, count: Array, drop: Array, piece_chunks: Array,
               pool_t: Array | None, pool_s: Array, w: Array | None, u: Array, k_to_end: Array | None = None,
               decay: Array | None = None, q_decayed: Array | None = None, scores: Array | None = None, *,
               k_to_end_t: Array | None = None, algorithm: str | None = "bf16x3",
               chunk_algorithm: str | None = "same", block_w: int = 32, num_warps: int = 8, num_stages: int = 1,
               interpret: bool = False) -> tuple[Array, Array]:
    """A stitched request's linear core after its chunk-local work, in one launch: the fold over the pieces where
    a cached piece applies its pool row (T, S) and a fresh piece steps through its chunks, each chunk's outputs
    taken from the state entering it on the way.

    Why: folding a fresh piece as its own dense summary (`piece_fold`) needs that summary first (a pass over the
    fresh tokens with the state widened by an identity block), then a dense step per fresh piece, then a second
    pass over the fresh tokens for the outputs from the incoming states. Here a fresh piece of c <= chunk tokens
    (a seam) costs a few [c, K] x [K, Vb] products in the fold instead of a [K, K] x [K, Vb] one, and nothing is
    written but the outputs ([C, c, V] per head: at 64 seams of 8 tokens, 1/8 of the incoming states that
    `piece_fold` writes) and the final state.

    kind, slot, reset, count, drop, pool_t, pool_s: as `piece_fold`. piece_chunks: int32 [N + 1], fresh piece p's
    chunks are [piece_chunks[p], piece_chunks[p + 1]) (cached pieces hold none). The chunks' locals
    (`linear_attn.chunk_locals`, head-major): w [C, H, c, K] or None (no delta rule), u [C, H, c, V], k_to_end
    [C, H, c, K], decay [C, H, K] (each chunk's per-key decay over it), q_decayed [C, H, c, K], scores
    [C, H, c, c]; or instead of k_to_end its transpose k_to_end_t [C, H, K, c], the layout the kernel reads (as
    `pallas.gdn.chunk_locals(head_major=True)` writes it: no transpose in between). algorithm / chunk_algorithm: dot algorithms of the cached pieces' dense products and of the
    chunk steps' small ones (None: float32; "same": as algorithm). Returns (the state after the last piece
    [H, K, V], every chunk's unscaled outputs [C, H, c, V], zeros past the last piece's chunks), float32.
    """
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    num_chunks, heads, c, value_dim = u.shape
    pool_rows, key_dim = pool_s.shape[0], pool_s.shape[2]
    if (k_to_end is None) == (k_to_end_t is None) or decay is None or q_decayed is None or scores is None:
        raise ValueError("chunk_fold takes one of k_to_end and k_to_end_t, and decay, q_decayed and scores")
    keys = tuple(k_to_end.shape) if k_to_end is not None else tuple(k_to_end_t.shape[i] for i in (0, 1, 3, 2))
    num = kind.shape[0]
    shapes_ok = (pool_s.shape[1:] == (heads, key_dim, value_dim) and keys == (num_chunks, heads, c, key_dim)
                 and q_decayed.shape == keys and (w is None or w.shape == keys)
                 and decay.shape == (num_chunks, heads, key_dim) and scores.shape == (num_chunks, heads, c, c)
                 and piece_chunks.shape == (num + 1,) and (form == "identity") == (pool_t is None))
    if not shapes_ok:
        raise ValueError(f"chunk fold operands disagree: form {form}, pool_s {pool_s.shape}, u {u.shape}, k_to_end "
                         f"{keys}, q_decayed {q_decayed.shape}, w {None if w is None else w.shape}, "
                         f"decay {decay.shape}, scores {scores.shape}, piece_chunks {piece_chunks.shape}, {num} pieces")
    rows = max(16, -(-c // 16) * 16)  # Triton dots take 16 rows at least; zero rows add nothing
    pad = lambda x: jnp.pad(x.astype(jnp.float32), [(0, 0), (0, 0), (0, rows - c), (0, 0)])  # noqa: E731
    bw = _block_width(block_w, value_dim)
    t_tail = {"scalar": (), "diagonal": (key_dim,), "dense": (key_dim, key_dim)}.get(form)
    per_head = lambda n, *tail: pl.BlockSpec((n, None) + tail, lambda j, h: (0, h) + (0,) * len(tail))  # noqa
    columns = lambda n, r: pl.BlockSpec((n, None, r, bw), lambda j, h: (0, h, 0, j))  # noqa: E731
    vector = lambda n: pl.BlockSpec((n,), lambda j, h: (0,))  # noqa: E731
    in_specs = [vector(num), vector(num), vector(num), vector(1), vector(1), vector(num + 1)]
    args = [kind.astype(jnp.int32), slot.astype(jnp.int32), reset.astype(jnp.int32),
            jnp.reshape(count, (1,)).astype(jnp.int32), jnp.reshape(drop, (1,)).astype(jnp.int32),
            piece_chunks.astype(jnp.int32)]
    if pool_t is not None:
        in_specs.append(per_head(pool_rows, *t_tail))
        args.append(pool_t.astype(jnp.float32))
    in_specs.append(columns(pool_rows, key_dim))
    args.append(pool_s.astype(jnp.float32))
    if w is not None:
        in_specs.append(per_head(num_chunks, rows, key_dim))
        args.append(pad(w))
    in_specs += [columns(num_chunks, rows), per_head(num_chunks, key_dim, rows), per_head(num_chunks, key_dim),
                 per_head(num_chunks, rows, key_dim), per_head(num_chunks, rows, rows)]
    keys = (jnp.swapaxes(pad(k_to_end), -1, -2) if k_to_end_t is None
            else jnp.pad(k_to_end_t.astype(jnp.float32), [(0, 0), (0, 0), (0, 0), (0, rows - c)]))
    args += [pad(u), keys, decay.astype(jnp.float32), pad(q_decayed),
             jnp.pad(scores.astype(jnp.float32), [(0, 0), (0, 0), (0, rows - c), (0, rows - c)])]
    chunk_algorithm = algorithm if chunk_algorithm == "same" else chunk_algorithm
    kernel = functools.partial(_chunk_fold_kernel, form=form, has_w=w is not None, num_chunks=num_chunks,
                               prec=_KERNEL_PRECISION["f32" if algorithm is None else algorithm],
                               chunk_prec=_KERNEL_PRECISION["f32" if chunk_algorithm is None else chunk_algorithm])
    outputs, final = pl.pallas_call(
        kernel,
        grid=(value_dim // bw, heads),
        in_specs=in_specs,
        out_specs=[columns(num_chunks, rows), pl.BlockSpec((None, key_dim, bw), lambda j, h: (h, 0, j))],
        out_shape=[jax.ShapeDtypeStruct((num_chunks, heads, rows, value_dim), jnp.float32),
                   jax.ShapeDtypeStruct((heads, key_dim, value_dim), jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="chunk_fold",
    )(*args)
    return final, outputs[:, :, :c]
