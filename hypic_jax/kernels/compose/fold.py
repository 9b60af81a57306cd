"""The composed pair of n ordered segments for every batch entry in one Pallas (Triton) launch: `fold_pallas`.

Program (column block j, batch entry) runs acc <- T_i acc + S_i[:, cols] for i = 1 .. n. Columns of the state are
independent (T_i multiplies from the left), which is what splits one head's fold over programs. With the transfer
the state is widened by K identity columns: those programs start from the identity's columns and add nothing, so the
same loop yields T_n ... T_1. The fold is sequential (n steps of one [K, K] x [K, block_w] product per program) but
every batch entry and column block runs in parallel, and each T_i is read once per column block (L2 serves the
repeats). The pairs are bound by the dependent products rather than by reading T, so state and transfer columns run
in separate programs (`bench/pic_kernels.py --sections bar` times the launches; bench/RESULTS.md, "The
composition").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hypic_jax.kernels.compose.config import FoldConfig
from hypic_jax.kernels.utils import dot_precision

__all__ = ["fold_pallas"]


def _fold_kernel(t_ref, s_ref, o_ref, *, num_segments, value_blocks, block_w, prec, with_transfer):
    """One (column block j, batch entry): acc <- T_i acc + S_i[:, cols] for i = 0 .. n-1.

    Column blocks j < value_blocks are state columns (start at zero, add S_i); the others are identity-widened
    transfer columns (start at the identity's columns, add nothing). Without the transfer every program is a state
    block: no selects in the loop.
    """
    if not with_transfer:
        def plain(i, acc):
            return lax.dot_general(t_ref[i].astype(jnp.float32), acc, (((1,), (0,)), ((), ())), precision=prec,
                                   preferred_element_type=jnp.float32) + s_ref[i].astype(jnp.float32)

        o_ref[...] = lax.fori_loop(0, num_segments, plain, jnp.zeros(o_ref.shape, jnp.float32))
        return
    j = pl.program_id(0)
    is_state = j < value_blocks
    key_dim = t_ref.shape[-1]
    rows = lax.broadcasted_iota(jnp.int32, (key_dim, block_w), 0)
    cols = lax.broadcasted_iota(jnp.int32, (key_dim, block_w), 1)
    offset = (j - value_blocks) * block_w
    acc0 = jnp.where(jnp.logical_and(jnp.logical_not(is_state), rows == cols + offset), 1.0, 0.0)

    def body(i, acc):
        s = jnp.where(is_state, s_ref[i].astype(jnp.float32), 0.0)
        t = t_ref[i].astype(jnp.float32)
        return lax.dot_general(t, acc, (((1,), (0,)), ((), ())), precision=prec,
                               preferred_element_type=jnp.float32) + s

    o_ref[...] = lax.fori_loop(0, num_segments, body, acc0.astype(jnp.float32))


@functools.partial(jax.jit, static_argnames=("with_transfer", "config", "interpret"))
def fold_pallas(transfers: Array, states: Array, *, with_transfer: bool = True, config: FoldConfig = FoldConfig(),
                interpret: bool = False):
    """The composed pair of n ordered segments for every batch entry, in one Pallas launch.

    transfers [n, ..., K, K], states [n, ..., K, V] (batch axes: layers, heads). Returns (T [..., K, K] or None,
    S [..., K, V]) float32: T = T_n ... T_1 (with_transfer) and S the state after segment n from a zero start.
    `reference.fold_reference` is the same fold as a loop.
    """
    n = transfers.shape[0]
    batch = transfers.shape[1:-2]
    key_dim, value_dim = states.shape[-2], states.shape[-1]
    t = transfers.reshape((n, -1, key_dim, key_dim))
    s = states.reshape((n, -1, key_dim, value_dim))
    b = t.shape[1]
    bw = min(config.block_w, value_dim)
    value_blocks = value_dim // bw
    width = value_dim + (key_dim if with_transfer else 0)
    kernel = functools.partial(_fold_kernel, num_segments=n, value_blocks=value_blocks, block_w=bw,
                               prec=dot_precision(config.algorithm), with_transfer=with_transfer)
    out = pl.pallas_call(
        kernel,
        grid=(width // bw, b),
        in_specs=[
            pl.BlockSpec((n, None, key_dim, key_dim), lambda j, i: (0, i, 0, 0)),
            pl.BlockSpec((n, None, key_dim, bw), lambda j, i: (0, i, 0, jnp.minimum(j, value_blocks - 1))),
        ],
        out_specs=pl.BlockSpec((None, key_dim, bw), lambda j, i: (i, 0, j)),
        out_shape=jax.ShapeDtypeStruct((b, key_dim, width), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="compose_fold",
    )(t, s)
    state = out[..., :value_dim].reshape(batch + (key_dim, value_dim))
    transfer = out[..., value_dim:].reshape(batch + (key_dim, key_dim)) if with_transfer else None
    return transfer, state
