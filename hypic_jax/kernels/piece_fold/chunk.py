"""`chunk_fold`: a stitched request's linear core after its chunk-local work, in one launch.

The fold over the pieces where a cached piece applies its pool row (T, S) and a fresh piece steps through its
chunks, each chunk's outputs taken from the state entering it on the way (`common.chunk_step`):

    o_i = q_decayed_i S + scores_i (U_i - W_i S),    S <- Diag(decay_i) S + k_to_end_i^T (U_i - W_i S).

Why: folding a fresh piece as its own dense summary (`piece_fold`) needs that summary first (a pass over the fresh
tokens with the state widened by an identity block), then a dense step per fresh piece, then a second pass over the
fresh tokens for the outputs from the incoming states. Here a fresh piece of c <= chunk tokens (a seam) costs a few
[c, K] x [K, Vb] products in the fold instead of a [K, K] x [K, Vb] one, and nothing is written but the outputs
([C, c, V] per head, a fraction of the incoming states [N, K, V] when the fresh pieces are short) and the final
state.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hypic_jax.kernels.piece_fold.common import FORMS, PIECE_CACHED, apply_transfer, chunk_step
from hypic_jax.kernels.utils import block_width, dot_precision

__all__ = ["chunk_fold"]


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
        moved = acc if t_ref is None else jnp.where(drop, acc, apply_transfer(form, t_ref[row], acc, prec))
        return moved + s_ref[row]

    def chunk(i, acc):
        out, acc = chunk_step(acc, None if w_ref is None else w_ref[i], u_ref[i], kt_ref[i], d_ref[i], q_ref[i],
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
    """A stitched request's linear core after its chunk-local work, in one launch (see the module docstring).

    kind, slot, reset, count, drop, pool_t, pool_s: as `piece_fold`. piece_chunks: int32 [N + 1], fresh piece p's
    chunks are [piece_chunks[p], piece_chunks[p + 1]) (cached pieces hold none). The chunks' locals
    (`hypic_jax.core.linear_attn.chunk_locals`, head-major): w [C, H, c, K] or None (no delta rule), u [C, H, c, V],
    k_to_end [C, H, c, K], decay [C, H, K] (each chunk's per-key decay over it), q_decayed [C, H, c, K], scores
    [C, H, c, c]; or instead of k_to_end its transpose k_to_end_t [C, H, K, c], the layout the kernel reads (as
    `hypic_jax.kernels.gdn.chunk_locals(head_major=True)` writes it: no transpose in between). algorithm /
    chunk_algorithm: dot algorithms of the cached pieces' dense products and of the chunk steps' small ones (None:
    float32; "same": as algorithm). Returns (the state after the last piece [H, K, V], every chunk's unscaled
    outputs [C, H, c, V], zeros past the last piece's chunks), float32. `reference.chunk_fold_reference` is the
    same fold as a loop.
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
    bw = block_width(block_w, value_dim)
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
                               prec=dot_precision(algorithm),
                               chunk_prec=dot_precision(chunk_algorithm))
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
