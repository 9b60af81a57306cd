"""What both piece folds share: the pieces' kinds, the transfer forms and their product with a state block, one
chunk step, and the widths the Triton tiles take."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

__all__ = ["FORMS", "PIECE_FRESH", "PIECE_CACHED", "piece_fold_fits", "apply_transfer", "chunk_step"]

FORMS = ("identity", "scalar", "diagonal", "dense")
PIECE_FRESH, PIECE_CACHED = 1, 2  # `stitch.layout.PIECE_FRESH`, `PIECE_CACHED` (the kernels sit below the layout)


def piece_fold_fits(key_dim: int, value_dim: int) -> bool:
    """Whether the Triton kernels take these state widths (tile sides are powers of two >= 16)."""
    return all(w >= 16 and not w & (w - 1) for w in (key_dim, value_dim))


def apply_transfer(form: str, transfer, state, prec):
    """T state for one head: transfer is T [K, K] (dense), log diag(T) [K] (diagonal), log T [] (scalar)."""
    if form == "identity":
        return state
    if form == "scalar":
        return jnp.exp(transfer) * state
    if form == "diagonal":
        return jnp.exp(transfer)[:, None] * state
    return lax.dot_general(transfer, state, (((1,), (0,)), ((), ())), precision=prec,
                           preferred_element_type=jnp.float32)


def chunk_step(acc, w, u, k_to_end, decay, q_decayed, scores, dot):
    """One chunk from the state acc [K, Vb]: (its unscaled outputs [c, Vb], the state after it).

    The chunk's locals (`hypic_jax.core.linear_attn.chunk_locals`) are inputs: U - W acc is what its tokens write,
    q_decayed acc what its queries read of the state before it, scores its causal scores, so

        o = q_decayed acc + scores (U - W acc),    acc <- Diag(decay) acc + k_to_end^T (U - W acc)

    (k_to_end given transposed, [K, c]; no W without the delta rule)."""
    inner = u if w is None else u - dot(w, acc)
    out = dot(q_decayed, acc) + dot(scores, inner)
    return out, decay[:, None] * acc + dot(k_to_end, inner)
