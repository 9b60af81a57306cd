"""The recurrence one token at a time: the readable float reference every fast path is checked against."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array

from hypic_jax.core.linear_attn.common import _check_inputs, _state_dtype, _ungrouped
from hypic_jax.core.summary import einsum


def recurrent(
    q: Array,
    k: Array,
    v: Array,
    *,
    g: Array | None = None,
    gk: Array | None = None,
    beta: Array | None = None,
    initial_state: Array | None = None,
    scale: float = 1.0,
) -> tuple[Array, Array]:
    """The recurrence one token at a time (the readable reference every fast path is checked against).

    q, k may have fewer heads than v (grouped key heads, each serving H_v / H_k consecutive value heads; repeated
    here). Returns (o [L, H, V] in the inputs' dtype, final_state [H, K, V] in float32/float64).
    """
    q, k = _ungrouped(q, k, v)
    length, heads, key_dim, value_dim = _check_inputs(q, k, v, g, gk, beta, initial_state)
    acc = _state_dtype(q, k, v, g, gk, beta, initial_state)
    state = (
        jnp.zeros((heads, key_dim, value_dim), acc) if initial_state is None else initial_state.astype(acc)
    )
    xs = dict(
        q=q.astype(acc),
        k=k.astype(acc),
        v=v.astype(acc),
        g=None if g is None else g.astype(acc),
        gk=None if gk is None else gk.astype(acc),
        beta=None if beta is None else beta.astype(acc),
    )

    def step(state, x):
        if x["g"] is not None:
            state = state * jnp.exp(x["g"])[:, None, None]
        if x["gk"] is not None:
            state = state * jnp.exp(x["gk"])[:, :, None]
        k_t, v_t = x["k"], x["v"]
        if x["beta"] is not None:  # S <- (I - b k k^T) S + b k v^T, written as a correction of v
            predicted = einsum("hkv,hk->hv", state, k_t)
            v_t = x["beta"][:, None] * (v_t - predicted)
        state = state + k_t[:, :, None] * v_t[:, None, :]
        out = einsum("hkv,hk->hv", state, x["q"])
        return state, out

    state, out = jax.lax.scan(step, state, xs)
    return (scale * out).astype(v.dtype), state
