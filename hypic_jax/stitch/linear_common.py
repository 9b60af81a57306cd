"""What the linear core's implementations over a layout share: the result type, the kernel fit test, the
repeat of grouped key heads and the gather of fresh rows into chunks."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import Array

from hypic_jax.core.linear_attn import LinearInputs
from hypic_jax.kernels import gdn as pallas_gdn
from hypic_jax.stitch.layout import LayoutArrays


def _head_major_chunks(x: Array | None, layout: LayoutArrays, acc) -> Array | None:
    """x [F, H, ...] -> [C, H, c, ...] by the layout's chunk rows (padding rows are zero: A = I, nothing added)."""
    if x is None:
        return None
    padded = jnp.concatenate([x.astype(acc), jnp.zeros((1,) + x.shape[1:], acc)], axis=0)
    return jnp.moveaxis(padded[layout.chunk_rows], 1, 2)


def _put(buffer: Array, index, value: Array) -> Array:
    return jax.lax.dynamic_update_index_in_dim(buffer, value.astype(buffer.dtype), index, 0)


class LinearResult:
    """What `linear_over_layout` returns: outputs [F, H, V], the state after the whole request [H, K, V], the
    summary of every fresh piece [N, ...] (None unless computed; the rows of other pieces are undefined with the
    kernels) and every piece's end state [N, H, K, V] (both None from `_linear_over_layout_chunk_fold`)."""

    def __init__(self, outputs, final_state, piece_summaries, piece_ends):
        self.outputs, self.final_state = outputs, final_state
        self.piece_summaries, self.piece_ends = piece_summaries, piece_ends


LINEAR_IMPLS = ("xla", "pallas", "auto")


def _kernel_problem(inputs: LinearInputs) -> str | None:
    """Why `pallas.gdn.gdn_varlen` cannot take these inputs, or None when it can."""
    key_dim, value_dim = inputs.k.shape[-1], inputs.v.shape[-1]
    if inputs.q is None:
        return "the kernels need q"
    if not all(d >= 16 and not d & (d - 1) for d in (key_dim, value_dim)):
        return f"K and V must be powers of two >= 16 (Triton tiles), got K={key_dim}, V={value_dim}"
    if inputs.v.shape[1] % inputs.k.shape[1]:
        return f"key heads {inputs.k.shape[1]} do not divide value heads {inputs.v.shape[1]}"
    return None


def linear_kernel_fits(inputs: LinearInputs, impl: str = "auto") -> bool:
    """Whether `linear_over_layout` runs the linear core through the Pallas kernels (`pallas.gdn.gdn_varlen`):
    "pallas" always (the Pallas interpreter off a GPU; a ValueError naming the problem when the kernels cannot
    take the inputs), "auto" on a GPU for bfloat16 values when they can (the rule of the models' own forward,
    `base.KernelOptions.linear`), "xla" never."""
    if impl not in LINEAR_IMPLS:
        raise ValueError(f"impl must be one of {LINEAR_IMPLS}, got {impl!r}")
    if impl == "xla":
        return False
    problem = _kernel_problem(inputs)
    if impl == "pallas":
        if problem is not None:
            raise ValueError(f"impl='pallas' cannot take these inputs: {problem}")
        return True
    return problem is None and inputs.v.dtype == jnp.bfloat16 and not pallas_gdn.default_interpret()


def _repeat_key_heads(inputs: LinearInputs) -> LinearInputs:
    """q and k repeated from Hk key heads to the H value heads (head h reads key head h // (H / Hk))."""
    group = inputs.v.shape[1] // inputs.k.shape[1]
    if group == 1:
        return inputs
    rep = lambda x: None if x is None else jnp.repeat(x, group, axis=1)  # noqa: E731
    return dataclasses.replace(inputs, q=rep(inputs.q), k=rep(inputs.k))
