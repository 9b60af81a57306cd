"""What every path of the core shares: argument checks, the state dtype, grouped key heads and log decays.

Shapes are static under jit, so the checks run once, at trace time.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax.numpy as jnp
from jax import Array


def _state_dtype(*arrays: Array | None) -> jnp.dtype:
    """float32, or float64 when any input is float64 (x64 references)."""
    dtypes = [a.dtype for a in arrays if a is not None]
    return jnp.float64 if any(d == jnp.float64 for d in dtypes) else jnp.float32


def _check_chunk_size(chunk_size: Any) -> int:
    if not isinstance(chunk_size, numbers.Integral) or isinstance(chunk_size, bool) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    return int(chunk_size)


def _check_inputs(q, k, v, g, gk, beta, initial_state) -> tuple[int, int, int, int]:
    """Validate shapes; returns (L, H, K, V)."""
    if k is None or v is None:
        raise ValueError("k and v are required")
    if k.ndim != 3:
        raise ValueError(f"k must be [L, H, K], got shape {k.shape}")
    length, heads, key_dim = k.shape
    if v.ndim != 3 or v.shape[:2] != (length, heads):
        raise ValueError(f"v must be [L={length}, H={heads}, V], got shape {v.shape}")
    value_dim = v.shape[2]
    if q is not None and q.shape != k.shape:
        raise ValueError(f"q must have k's shape {k.shape}, got shape {q.shape}")
    if g is not None and g.shape != (length, heads):
        raise ValueError(f"g must be [L={length}, H={heads}], got shape {g.shape}")
    if gk is not None and gk.shape != k.shape:
        raise ValueError(f"gk must have k's shape {k.shape}, got shape {gk.shape}")
    if beta is not None and beta.shape != (length, heads):
        raise ValueError(f"beta must be [L={length}, H={heads}], got shape {beta.shape}")
    if initial_state is not None and initial_state.shape != (heads, key_dim, value_dim):
        raise ValueError(
            f"initial_state must be [H={heads}, K={key_dim}, V={value_dim}], got shape {initial_state.shape}"
        )
    return length, heads, key_dim, value_dim


def _ungrouped(q: Array | None, k: Array | None, v: Array | None) -> tuple[Array | None, Array | None]:
    """q, k repeated to v's heads when they hold fewer (grouped key heads); as they are otherwise (also when the
    shapes are wrong: `_check_inputs` names the problem)."""
    if k is None or v is None or k.ndim != 3 or v.ndim != 3 or k.shape[1] == v.shape[1] or v.shape[1] % k.shape[1]:
        return q, k
    heads = v.shape[1]
    return (None if q is None else _repeat_heads(q, heads, "q")), _repeat_heads(k, heads, "k")


def _repeat_heads(x: Array, heads: int, name: str) -> Array:
    """Repeat each of x's head groups [L, Hg, ...] to `heads` consecutive heads (repeat_interleave)."""
    groups = x.shape[1]
    if heads % groups:
        raise ValueError(f"{name} has {groups} heads, which does not divide the {heads} value heads")
    return jnp.repeat(x, heads // groups, axis=1) if groups != heads else x


def log_decay_of(g: Array | None, gk: Array | None, acc) -> Array | None:
    """Per-token log decay [L, H, D] from a scalar gate g [L, H] (D = 1) and/or per-key gates gk [L, H, K] (D = K)."""
    if gk is not None:
        return gk.astype(acc) + (0.0 if g is None else g.astype(acc)[..., None])
    return None if g is None else g.astype(acc)[..., None]
