"""The dispatch of `chunked` and `summarize` to the Pallas kernels (`hypic_jax.kernels.gdn`), at any K and V."""

from __future__ import annotations

import jax.numpy as jnp

from hypic_jax.core.summary import Summary
from hypic_jax.kernels import gdn as pallas_gdn


def _kernel_width(dim: int) -> int:
    """The smallest power of two >= 16 holding `dim`: the tile width the Pallas kernels need."""
    return max(16, 1 << max(0, dim - 1).bit_length())


def _kernel_problem(q, k, v, gk) -> str | None:
    """Why the Pallas kernels cannot take these inputs even after padding K and V, or None when they can."""
    if q is None:
        return "the kernels need q"
    if k.shape[0] == 0:
        return "the sequence is empty"
    if v.shape[1] % k.shape[1]:
        return f"key heads {k.shape[1]} do not divide value heads {v.shape[1]}"
    if gk is not None and gk.shape != (k.shape[0], v.shape[1], k.shape[2]):
        return f"gk must be [L, H, K] = {(k.shape[0], v.shape[1], k.shape[2])}, got shape {gk.shape}"
    return None


def _use_kernel(impl: str, q, k, v, gk) -> bool:
    """The dispatch of `chunked` and `summarize`: "pallas" always (a ValueError naming the problem when the
    kernels cannot take the inputs), "auto" for bfloat16 inputs on a GPU when they can, "xla" never."""
    if impl not in ("xla", "pallas", "auto"):
        raise ValueError(f"impl must be 'xla', 'pallas' or 'auto', got {impl!r}")
    if impl == "xla":
        return False
    problem = _kernel_problem(q, k, v, gk)
    if impl == "pallas":
        if problem is not None:
            raise ValueError(f"impl='pallas' cannot take these inputs: {problem}")
        return True
    return problem is None and k.dtype == jnp.bfloat16 and not pallas_gdn.default_interpret()


def _kernel_forward(q, k, v, g, gk, beta, initial_state, scale, emit_summary):
    """`pallas.gdn.gdn_forward` at any K and V: zero-padded to the kernels' tile widths, sliced back.

    Padding is exact for every family. Padded key channels have zero q and k entries and log gate gk = 0, so their
    state rows start at zero and stay there, the delta rule's k k^T is block-diagonal (the real block unchanged)
    and the transfer's real block is the unpadded T. Padded value channels have zero values, so their output and
    state columns stay zero. The initial state is padded with zeros.
    """
    key_dim, value_dim = k.shape[-1], v.shape[-1]
    pad_k, pad_v = _kernel_width(key_dim) - key_dim, _kernel_width(value_dim) - value_dim
    if pad_k or pad_v:
        def widen(x, n):  # zeros at the end of the last axis
            return x if x is None or not n else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, n)])

        q, k, gk, v = widen(q, pad_k), widen(k, pad_k), widen(gk, pad_k), widen(v, pad_v)
        if initial_state is not None:
            initial_state = jnp.pad(initial_state, [(0, 0), (0, pad_k), (0, pad_v)])
    result = pallas_gdn.gdn_forward(q, k, v, g=g, gk=gk, beta=beta, initial_state=initial_state, scale=scale,
                                    emit_summary=emit_summary)
    if not (pad_k or pad_v):
        return result
    o, state = result[0][..., :value_dim], result[1][:, :key_dim, :value_dim]
    if not emit_summary:
        return o, state
    summary = result[2]
    transfer = summary.transfer
    if summary.form == "dense":
        transfer = transfer[:, :key_dim, :key_dim]
    elif summary.form == "diagonal":
        transfer = transfer[:, :key_dim]
    return o, state, Summary(summary.form, summary.state[:, :key_dim, :value_dim], transfer)
