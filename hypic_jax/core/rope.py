"""Rotary position embeddings (NeoX / rotate-half layout, partial rotary dims).

RoPE is a rotation R(p) per pair of channels, and R(p + i) = R(p) R(i). That identity is what lets a cache store
keys (or a linear state built from keys) at canonical position 0 and move them to any offset p later with one more
rotation: `rotate_keys(x, p)` for cached K, `rotate_state_keys(state, p)` for the key axis of a linear state.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import Array


def _check_rotary_dim(head_dim: int, rotary_dim: int) -> None:
    if rotary_dim <= 0 or rotary_dim > head_dim or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even and in (0, head_dim={head_dim}], got {rotary_dim}")


def rope_angles(positions: Array, rotary_dim: int, base: float = 10000.0) -> Array:
    """Angles [..., rotary_dim // 2] for integer or fractional positions [...] (computed in float32)."""
    inv_freq = 1.0 / (base ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    return jnp.asarray(positions, jnp.float32)[..., None] * inv_freq


def apply_rope(x: Array, positions: Array, *, rotary_dim: int | None = None, base: float = 10000.0) -> Array:
    """Rotate the first `rotary_dim` channels of `x [L, H, D]` by `positions [L]` (NeoX layout).

    Channels i and i + rotary_dim/2 form a pair. Channels past rotary_dim pass through. Math in float32, result in
    x's dtype. Leading batch axes are allowed as long as `positions` broadcasts against x[..., :, 0, 0].
    """
    head_dim = x.shape[-1]
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    _check_rotary_dim(head_dim, rotary_dim)
    angles = rope_angles(positions, rotary_dim, base)[..., None, :]  # [..., L, 1, rd/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    half = rotary_dim // 2
    xf = x.astype(jnp.float32)
    x1, x2, rest = xf[..., :half], xf[..., half:rotary_dim], xf[..., rotary_dim:]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)
    return rotated.astype(x.dtype)


def rotate_keys(x: Array, offset, *, rotary_dim: int | None = None, base: float = 10000.0) -> Array:
    """Move keys `x [L, H, D]` by `offset` positions: a scalar (one cached segment) or one offset per key [L]
    (many cached segments concatenated, each with its own shift: one rotation for all of them)."""
    positions = jnp.broadcast_to(jnp.asarray(offset, jnp.float32), x.shape[:-2])
    return apply_rope(x, positions, rotary_dim=rotary_dim, base=base)


def rotate_state_keys(state: Array, offset, *, rotary_dim: int | None = None, base: float = 10000.0) -> Array:
    """R(offset) S for a linear state `S [..., H, K, V]` whose keys were rotated from position 0.

    A state is a sum of (decayed) outer products k_j v_j^T; shifting every key by `offset` positions multiplies
    the key axis by R(offset) on the left. Implemented by rotating each value column as if it were a key.
    """
    columns = jnp.swapaxes(state, -1, -2)  # [..., H, V, K]: rotate along K
    positions = jnp.full(columns.shape[:-2], offset, jnp.float32)
    return jnp.swapaxes(apply_rope(columns, positions, rotary_dim=rotary_dim, base=base), -1, -2)


def rotation_matrix(offset, head_dim: int, *, rotary_dim: int | None = None, base: float = 10000.0) -> Array:
    """The dense orthogonal R(offset) [head_dim, head_dim] (identity past rotary_dim), for dense transfers."""
    eye = jnp.eye(head_dim, dtype=jnp.float32)[None]  # [1, D(rows as 'H'), D]
    return rotate_state_keys(eye, offset, rotary_dim=rotary_dim, base=base)[0]
