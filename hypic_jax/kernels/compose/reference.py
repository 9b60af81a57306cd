"""Pure-JAX references of the folds, with the kernels' own signatures: sequential loops of dense products with a
named dot algorithm (`hypic_jax.core.summary.ALGORITHMS`; "f32", float32 HIGHEST, by default)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import Array, lax

from hypic_jax.core.summary import matmul

__all__ = ["fold_reference", "prefix_fold_reference"]


def prefix_fold_reference(transfers: Array, states: Array, initial_state: Array | None = None, *,
                          algorithm: str = "f32") -> Array:
    """`prefix_fold_pallas`: the state after each segment, S_i = T_i S_{i-1} + S(C_i|0) from `initial_state` (zeros
    if None), by a `lax.scan` of one batched product per segment. transfers [n, ..., K, K], states [n, ..., K, V];
    returns [n, ..., K, V] float32."""
    init = jnp.zeros(states.shape[1:], jnp.float32) if initial_state is None else jnp.broadcast_to(
        initial_state.astype(jnp.float32), states.shape[1:])

    def step(state, pair):
        t, s = pair
        state = matmul(t.astype(jnp.float32), state, algorithm) + s.astype(jnp.float32)
        return state, state

    return lax.scan(step, init, (transfers, states))[1]


def fold_reference(transfers: Array, states: Array, *, with_transfer: bool = True,
                   algorithm: str = "f32") -> tuple[Array | None, Array]:
    """`fold_pallas`: (T_n ... T_1 or None, the state after segment n from zero), by the same loop."""
    state = prefix_fold_reference(transfers, states, algorithm=algorithm)[-1]
    if not with_transfer:
        return None, state
    key_dim = transfers.shape[-1]

    def step(product, t):
        return matmul(t.astype(jnp.float32), product, algorithm), None

    eye = jnp.broadcast_to(jnp.eye(key_dim, dtype=jnp.float32), transfers.shape[1:])
    return lax.scan(step, eye, transfers)[0], state
