"""Every prefix state of n ordered segments, S_i = T_i S_{i-1} + S(C_i|0), in Pallas (Triton): `prefix_fold_pallas`.

This is what a request reusing cached segments needs per linear layer (the state entering every fresh span): n
state products, half the work of an associative scan over pairs (which also multiplies transfers together), in
one launch. Program (column block, batch entry) holds a [K, block_w] block of the state in registers and writes it
after every step; the T_i loads do not depend on the running state, so the next one can be issued while the current
product runs.

The fold's depth is its cost (each step waits for the previous product). `block` cuts the segments into blocks of
b: (1) each block's pair is composed by a balanced tree of batched products (`tree.compose_all`, all blocks at
once), (2) one fold over the block pairs gives every block's incoming state, (3) one fold inside every block, all
blocks in parallel, gives the states: depth n/b + b instead of n, for about n extra transfer products and two
launches instead of one. This is exact by associativity: a block's pair maps its incoming state to its outgoing
one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hypic_jax.kernels.compose.config import FoldConfig
from hypic_jax.kernels.compose.tree import compose_all
from hypic_jax.kernels.utils import block_width, dot_precision

__all__ = ["prefix_fold_pallas"]


def _prefix_fold_kernel(t_ref, s_ref, *rest, num_segments, prec, has_initial):
    """One (column block, batch entry, outer entry): acc <- T_i acc + S_i[:, cols], and every acc is written out;
    the state block never leaves registers between steps."""
    init_ref, o_ref = rest if has_initial else (None, rest[0])
    key_dim = t_ref.shape[-1]

    def body(i, acc):
        t = t_ref[i].astype(jnp.float32)
        acc = lax.dot_general(t, acc, (((1,), (0,)), ((), ())), precision=prec,
                              preferred_element_type=jnp.float32) + s_ref[i].astype(jnp.float32)
        o_ref[i] = acc
        return acc

    acc0 = init_ref[...].astype(jnp.float32) if has_initial else jnp.zeros((key_dim, o_ref.shape[-1]), jnp.float32)
    lax.fori_loop(0, num_segments, body, acc0)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def _fold_call(t, s, initial, *, config, interpret):
    """t [outer, n, B, K, K], s [outer, n, B, K, V], initial [outer, B, K, V] or None -> states like s."""
    outer, n, b, key_dim, _ = t.shape
    value_dim = s.shape[-1]
    bw = block_width(config.block_w, value_dim)
    in_specs = [
        pl.BlockSpec((None, n, None, key_dim, key_dim), lambda j, i, o: (o, 0, i, 0, 0)),
        pl.BlockSpec((None, n, None, key_dim, bw), lambda j, i, o: (o, 0, i, 0, j)),
    ]
    args = [t, s]
    if initial is not None:
        in_specs.append(pl.BlockSpec((None, None, key_dim, bw), lambda j, i, o: (o, i, 0, j)))
        args.append(initial)
    kernel = functools.partial(_prefix_fold_kernel, num_segments=n, prec=dot_precision(config.algorithm),
                               has_initial=initial is not None)
    return pl.pallas_call(
        kernel,
        grid=(value_dim // bw, b, outer),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, n, None, key_dim, bw), lambda j, i, o: (o, 0, i, 0, j)),
        out_shape=jax.ShapeDtypeStruct(s.shape, jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="prefix_fold",
    )(*args)


def prefix_fold_pallas(transfers: Array, states: Array, initial_state: Array | None = None, *,
                       config: FoldConfig = FoldConfig(), block: int | None = None, interpret: bool = False) -> Array:
    """The state after each of n ordered segments, S_i = T_i S_{i-1} + S(C_i|0) from `initial_state` (zeros if
    None).

    transfers [n, ..., K, K], states [n, ..., K, V], initial_state [..., K, V]; returns [n, ..., K, V] float32.
    block: None (default) runs one fold of depth n; b cuts it into blocks of b segments (0: about sqrt(n); see the
    module docstring). `reference.prefix_fold_reference` is the same fold as a loop.
    """
    n = transfers.shape[0]
    batch = transfers.shape[1:-2]
    key_dim, value_dim = states.shape[-2], states.shape[-1]
    if transfers.shape[-2:] != (key_dim, key_dim) or states.shape[:-2] != transfers.shape[:-2]:
        raise ValueError(f"transfers [n, ..., K, K] and states [n, ..., K, V] disagree: {transfers.shape} vs "
                         f"{states.shape}")
    t = transfers.reshape((n, -1, key_dim, key_dim)).astype(jnp.float32)
    s = states.reshape((n, -1, key_dim, value_dim)).astype(jnp.float32)
    init = None if initial_state is None else jnp.broadcast_to(
        initial_state, batch + (key_dim, value_dim)).reshape((1, -1, key_dim, value_dim)).astype(jnp.float32)
    if block == 0:
        block = max(2, int(round(n**0.5)))
    if block is None or n <= 2 * block:
        out = _fold_call(t[None], s[None], init, config=config, interpret=interpret)[0]
        return out.reshape((n,) + batch + (key_dim, value_dim))
    blocks = -(-n // block)
    pad = blocks * block - n
    if pad:  # identity pairs at the end: their states are dropped
        eye = jnp.broadcast_to(jnp.eye(key_dim, dtype=jnp.float32), (pad,) + t.shape[1:])
        t = jnp.concatenate([t, eye])
        s = jnp.concatenate([s, jnp.zeros((pad,) + s.shape[1:], jnp.float32)])
    tb = t.reshape((blocks, block) + t.shape[1:])
    sb = s.reshape((blocks, block) + s.shape[1:])
    # (1) every block's pair: compose_all along the in-block axis (moved first), all blocks at once
    pair_t, pair_s = compose_all(jnp.moveaxis(tb, 1, 0), jnp.moveaxis(sb, 1, 0), config.algorithm)
    # (2) the state after every block, then each block's incoming state
    after = _fold_call(pair_t[None], pair_s[None], init, config=config, interpret=interpret)[0]
    first = jnp.zeros_like(after[:1]) if init is None else init
    incoming = jnp.concatenate([first, after[:-1]])
    # (3) inside every block from its incoming state
    out = _fold_call(tb, sb, incoming, config=config, interpret=interpret).reshape(t.shape[:1] + s.shape[1:])
    return out[:n].reshape((n,) + batch + (key_dim, value_dim))
