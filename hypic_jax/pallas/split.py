"""The split-operand format of the bf16x3 folds, shared by the Triton folds (`compose.fold_split_pallas`,
`compose.prefix_fold_split_pallas`) and their Mosaic GPU versions (`compose_mgpu`).

A float32 transfer T is stored as two bfloat16 planes, hi = T rounded to bfloat16 and lo = the rest rounded to
bfloat16, and a state S transposed, [..., V, K] float32: the operands a bf16x3 product reads, split once per cache
entry instead of in every step of every fold that composes it.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import Array, lax

__all__ = ["split_operands", "split_bf16", "check_split_operands"]


def split_operands(transfers: Array, states: Array) -> tuple[Array, Array, Array]:
    """Float32 pairs -> the operands of the split-operand folds: T [n, ..., K, K] as two bfloat16 planes (hi, lo;
    `split_bf16`) and S [n, ..., K, V] float32, transposed to [n, ..., V, K].

    The planes are what a bf16x3 product splits T into anyway, so the fold's arithmetic is unchanged, and they take
    the same 4 bytes per entry as float32. A cache converts each entry once when it stores it; every request that
    composes the entry then skips the split (bench/pic_kernels.py times the conversion; see bench/RESULTS.md).
    """
    hi, lo = split_bf16(transfers.astype(jnp.float32))
    return hi, lo, jnp.swapaxes(states.astype(jnp.float32), -1, -2)


def split_bf16(x: Array) -> tuple[Array, Array]:
    """float32 x -> bfloat16 (hi, lo) with x ~ hi + lo: hi is x rounded to bfloat16 (to nearest, ties away from
    zero; finite x below bfloat16's largest value), lo the exact rest rounded to bfloat16, as a bf16x3 product
    splits its operands. The rounding goes through the bits because a float32 -> bfloat16 -> float32 round trip may
    be simplified away by the compiler (XLA's excess-precision rewrite does so on GPUs, and lo then comes out 0),
    and truncating instead of rounding would lose one bit (about 4x the error of a 5-step fold in the
    interpret-mode check)."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    top = lax.bitcast_convert_type((bits + jnp.uint32(0x8000)) & jnp.uint32(0xFFFF0000), jnp.float32)
    return top.astype(jnp.bfloat16), (x - top).astype(jnp.bfloat16)


def check_split_operands(t_hi: Array, t_lo: Array, states_t: Array):
    """Checks split operands (see `split_operands`) and flattens their batch axes: (n, batch shape, T planes
    [n, B, K, K], S^T [n, B, V, K] float32). Raises ValueError naming the shapes that disagree."""
    n, key_dim, value_dim = t_hi.shape[0], t_hi.shape[-1], states_t.shape[-2]
    if (t_hi.shape != t_lo.shape or t_hi.shape[-2:] != (key_dim, key_dim) or t_hi.shape[:-2] != states_t.shape[:-2]
            or states_t.shape[-1] != key_dim or t_hi.dtype != jnp.bfloat16 or t_lo.dtype != jnp.bfloat16):
        raise ValueError(f"split operands disagree: t_hi {t_hi.shape} {t_hi.dtype}, t_lo {t_lo.shape} {t_lo.dtype}, "
                         f"states_t {states_t.shape} (expected [n, ..., V, K]; see split_operands)")
    if n < 1:
        raise ValueError("the split-operand fold needs at least one segment")
    flat = lambda x, rows: x.reshape((n, -1, rows, key_dim))  # noqa: E731
    return n, t_hi.shape[1:-2], flat(t_hi, key_dim), flat(t_lo, key_dim), flat(states_t, value_dim).astype(jnp.float32)
