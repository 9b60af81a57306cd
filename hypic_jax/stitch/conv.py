"""The depthwise causal conv over a layout: each fresh token's W-1 predecessors are rows of one table
[zero | fresh rows | cached tails], named by `conv_rows`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array

from hypic_jax.stitch.layout import LayoutArrays


def conv_over_layout(x: Array, weight: Array, pool_tails: Array, layout: LayoutArrays, *,
                     activation: str | None = "silu") -> tuple[Array, Array, Array]:
    """Depthwise causal conv of the fresh rows x [F, D] as if every span were laid out in order.

    weight [D, W]; pool_tails [S, W-1, D]: every pool slot's stored tail. Returns (y [F, D], the tail after the
    last span [W-1, D], per record the tail after its span [R, W-1, D]).
    """
    w1 = weight.shape[1] - 1
    pieces = layout.piece_slot.shape[0]
    tails = pool_tails[layout.piece_slot].astype(x.dtype).reshape(pieces * w1, x.shape[1])
    table = jnp.concatenate([jnp.zeros((1, x.shape[1]), x.dtype), x, tails], axis=0)
    w = weight.astype(jnp.float32)
    acc = x.astype(jnp.float32) * w[:, w1]
    for tap in range(w1):
        acc = acc + table[layout.conv_rows[:, tap]].astype(jnp.float32) * w[:, tap]
    act = {None: lambda a: a, "silu": jax.nn.silu}[activation]
    return act(acc).astype(x.dtype), table[layout.conv_final], table[layout.conv_records]
