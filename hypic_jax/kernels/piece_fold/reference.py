"""Pure-JAX references of the piece folds, with the kernels' own arguments and results: the folds as host loops
over the pieces, every product in float32 (HIGHEST precision)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from hypic_jax.kernels.piece_fold.common import PIECE_CACHED, PIECE_FRESH

__all__ = ["piece_fold_reference", "chunk_fold_reference"]

_HI = lax.Precision.HIGHEST


def _apply(form: str, transfer, state):
    """T state for every head: T [H, K, K] (dense), log diag(T) [H, K] (diagonal), log T [H] (scalar)."""
    if form == "identity" or transfer is None:
        return state
    if form == "scalar":
        return jnp.exp(transfer)[:, None, None] * state
    if form == "diagonal":
        return jnp.exp(transfer)[..., None] * state
    return jnp.einsum("hij,hjv->hiv", transfer, state, precision=_HI)


def piece_fold_reference(form, kind, slot, reset, count, drop, pool_t, pool_s, fresh_t=None, fresh_s=None):
    """`piece_fold` as a loop: S <- 0 where a piece resets, the state entering it recorded, then S <- T S + S_p
    with a cached piece's pool row (its T the identity where `drop`) or a fresh piece's own summary (none: the
    state passes through). Returns (final [H, K, V], incoming [N, H, K, V]), zeros past `count`."""
    num, (heads, key_dim, value_dim) = kind.shape[0], pool_s.shape[1:]
    state = jnp.zeros((heads, key_dim, value_dim), jnp.float32)
    incoming = jnp.zeros((num, heads, key_dim, value_dim), jnp.float32)
    for p in range(int(count)):
        if reset[p]:
            state = jnp.zeros_like(state)
        incoming = incoming.at[p].set(state)
        if kind[p] == PIECE_CACHED:
            moved = state if (drop or pool_t is None) else _apply(form, pool_t[slot[p]], state)
            state = moved + pool_s[slot[p]]
        elif kind[p] == PIECE_FRESH and fresh_s is not None:
            state = _apply(form, None if fresh_t is None else fresh_t[p], state) + fresh_s[p]
    return state, incoming


def chunk_fold_reference(form, kind, slot, reset, count, drop, piece_chunks, pool_t, pool_s, w, u, k_to_end, decay,
                         q_decayed, scores):
    """`chunk_fold` as a loop (k_to_end as [C, H, c, K]): cached pieces as in `piece_fold_reference`, a fresh piece's
    chunks i in [piece_chunks[p], piece_chunks[p + 1]) each stepping

        o_i = q_decayed_i S + scores_i (U_i - W_i S),    S <- Diag(decay_i) S + k_to_end_i^T (U_i - W_i S).

    Returns (final [H, K, V], outputs [C, H, c, V], zeros for the chunks no piece steps)."""
    heads, key_dim, value_dim = pool_s.shape[1:]
    num_chunks, c = u.shape[0], u.shape[2]
    state = jnp.zeros((heads, key_dim, value_dim), jnp.float32)
    outputs = jnp.zeros((num_chunks, heads, c, value_dim), jnp.float32)
    mm = lambda spec, a, b: jnp.einsum(spec, a, b, precision=_HI)  # noqa: E731
    for p in range(int(count)):
        if reset[p]:
            state = jnp.zeros_like(state)
        if kind[p] == PIECE_CACHED:
            moved = state if (drop or pool_t is None) else _apply(form, pool_t[slot[p]], state)
            state = moved + pool_s[slot[p]]
        elif kind[p] == PIECE_FRESH:
            for i in range(int(piece_chunks[p]), int(piece_chunks[p + 1])):
                inner = u[i] if w is None else u[i] - mm("hck,hkv->hcv", w[i], state)
                outputs = outputs.at[i].set(mm("hck,hkv->hcv", q_decayed[i], state)
                                            + mm("hcj,hjv->hcv", scores[i], inner))
                state = decay[i][..., None] * state + mm("hck,hcv->hkv", k_to_end[i], inner)
    return state, outputs
