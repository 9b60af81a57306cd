"""The pair of a whole ordered sequence of (T, S) pairs by a balanced tree of batched products, in XLA: log2 n
levels of one large batched matmul each, n - 1 compositions in all. The transfer pass of `hypic_jax.kernels.gdn`
multiplies its groups' transfers this way, and the blocked `prefix_fold_pallas` composes its blocks' pairs."""

from __future__ import annotations

import jax.numpy as jnp
from jax import Array

from hypic_jax.core.summary import matmul

__all__ = ["compose_pair", "compose_all"]


def compose_pair(first: tuple[Array, Array], second: tuple[Array, Array], algorithm: str = "bf16x3"):
    """(T2, S2) o (T1, S1) = (T2 T1, T2 S1 + S2), both products in one matmul of T2 against [T1 | S1]."""
    t1, s1 = first
    t2, s2 = second
    key_dim = t1.shape[-1]
    both = matmul(t2, jnp.concatenate([t1, s1], axis=-1), algorithm)
    return both[..., :key_dim], both[..., key_dim:] + s2


def compose_all(transfers: Array, states: Array | None, algorithm: str = "bf16x3") -> tuple[Array, Array | None]:
    """The pair of the whole ordered sequence (segment axis 0): (T_n ... T_1, the state after segment n from
    zero). states None: the transfers' ordered product alone (returned with None)."""
    t, s = transfers, states
    while t.shape[0] > 1:
        n = t.shape[0]
        if n % 2:  # carry the last pair up unchanged
            t_last, t = t[-1:], t[:-1]
            if s is not None:
                s_last, s = s[-1:], s[:-1]
        if s is None:
            t_new, s_new = matmul(t[1::2], t[0::2], algorithm), None
        else:
            t_new, s_new = compose_pair((t[0::2], s[0::2]), (t[1::2], s[1::2]), algorithm)
        if n % 2:
            t_new = jnp.concatenate([t_new, t_last])
            s_new = None if s is None else jnp.concatenate([s_new, s_last])
        t, s = t_new, s_new
    return t[0], None if s is None else s[0]
