"""Causal depthwise convolution with an explicit conv state (the "conv tail").

GDN, KDA and Mamba2 run a short causal conv over projected q/k/v. The first W-1 outputs of a segment depend on
the previous segment's last W-1 inputs, so the state is passed in and out explicitly: running two halves with the
carried tail equals running the whole, which is what lets a cache store a segment's tail and feed it forward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array

_ACTIVATIONS = {None: lambda x: x, "silu": jax.nn.silu, "swish": jax.nn.silu, "identity": lambda x: x}


def causal_conv1d(
    x: Array,
    weight: Array,
    bias: Array | None = None,
    *,
    conv_state: Array | None = None,
    activation: str | None = "silu",
) -> tuple[Array, Array]:
    """Depthwise causal conv: y_t = act(sum_i weight[:, i] * x_{t-W+1+i} + bias).

    Args:
      x: [L, D] inputs of this piece (L may be 0 or shorter than the kernel).
      weight: [D, W] depthwise taps (a Hugging Face Conv1d weight [D, 1, W] squeezed).
      bias: optional [D].
      conv_state: [W-1, D] the last W-1 inputs before x (zeros = start of sequence).
      activation: "silu" (default) or None.
    Returns:
      (y [L, D] in x's dtype, new conv_state [W-1, D]: the last W-1 inputs including x).
    """
    if x.ndim != 2:
        raise ValueError(f"x must be [L, D], got shape {x.shape}")
    if weight.ndim != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"weight must be [D={x.shape[1]}, W], got shape {weight.shape}")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(k for k in _ACTIVATIONS if k)} or None, got {activation!r}")
    width = weight.shape[1]
    if conv_state is None:
        conv_state = jnp.zeros((width - 1, x.shape[1]), x.dtype)
    if conv_state.shape != (width - 1, x.shape[1]):
        raise ValueError(f"conv_state must be [W-1={width - 1}, D={x.shape[1]}], got shape {conv_state.shape}")
    length = x.shape[0]
    padded = jnp.concatenate([conv_state.astype(x.dtype), x], axis=0)  # [W-1+L, D]
    w = weight.astype(jnp.float32)
    acc = jnp.zeros((length, x.shape[1]), jnp.float32)
    for tap in range(width):  # W is tiny (4): W shifted multiply-adds beat a general conv on every backend
        acc = acc + padded[tap : tap + length].astype(jnp.float32) * w[:, tap]
    if bias is not None:
        acc = acc + bias.astype(jnp.float32)
    y = _ACTIVATIONS[activation](acc).astype(x.dtype)
    new_state = padded[padded.shape[0] - (width - 1) :] if width > 1 else padded[:0]
    return y, new_state
