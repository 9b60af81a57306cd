"""Pallas (Triton lowering) single-token decode step of every linear-attention family, all heads in one launch.

One token advances the state and reads it (`hypic_jax.linear_attn` conventions):

    S <- exp(g) Diag(exp(gk)) S;    S <- S + k (beta (v - S^T k))^T  (delta rule; else S + k v^T);
    o = scale S^T q.

Per head this is a matrix-vector product and a rank-one update of a [K, V] float32 state: about 4 K V flops
against 8 K V bytes of state read and written, so the step is bound by memory bandwidth and the only goal is to
touch the state once. Grid (heads, V / block_v): state columns are independent (the decay scales rows, the
correction S^T k and the read S^T q are per column), so each program owns a [K, block_v] column block, reads it
once, and writes the new block and its slice of the output. The products are row reductions over K, not dots:
one token gives [K] x [K, block_v] vector work, below Triton's 16-wide dot tiles. The state can be updated in
place (`donate=True` aliases the input and output buffers), so a decode loop does not copy it.

At batch 1 the launch dominates; at a serving batch (64 sequences of 32 heads of 128) the state moves at most of
the bandwidth a device copy reaches (bench/kernels.py times both; see bench/RESULTS.md).

Lowering: Triton. The same step written for Mosaic GPU (`bench/mosaic_decode.py`, `plgpu.kernel`) is slower at a
serving batch; at batch 1, where the launch dominates, the two are within this kernel's run-to-run spread.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import Array
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

__all__ = ["DecodeConfig", "decode_step"]


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """block_v: state columns per program (power of two >= 16; more programs for few heads, longer rows each);
    num_warps / num_stages: Triton launch parameters."""

    block_v: int = 32
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self):
        if self.block_v < 16 or self.block_v & (self.block_v - 1):
            raise ValueError(f"block_v must be a power of two >= 16, got {self.block_v}")


def _decode_kernel(*refs, has_g, has_gk, delta, scale):
    """One (head h, column block j). Refs: q, k [K]; v [BV]; g, beta [H] (whole, read at h); gk [K]; state
    [K, BV]; outputs o [BV], new state [K, BV]."""
    it = iter(refs)
    q_ref, k_ref, v_ref = next(it), next(it), next(it)
    g_ref = next(it) if has_g else None
    gk_ref = next(it) if has_gk else None
    beta_ref = next(it) if delta else None
    state_ref, o_ref, new_ref = next(it), next(it), next(it)
    h = pl.program_id(0)
    state = state_ref[...].astype(jnp.float32)
    if has_g:
        state = state * jnp.exp(g_ref[h])
    if has_gk:
        state = state * jnp.exp(gk_ref[...].astype(jnp.float32))[:, None]
    k = k_ref[...].astype(jnp.float32)
    v = v_ref[...].astype(jnp.float32)
    if delta:  # S <- (I - b k k^T) S + b k v^T as a corrected value
        v = beta_ref[h] * (v - jnp.sum(state * k[:, None], axis=0))
    state = state + k[:, None] * v[None, :]
    o = scale * jnp.sum(state * q_ref[...].astype(jnp.float32)[:, None], axis=0)
    o_ref[...] = o.astype(o_ref.dtype)
    new_ref[...] = state


@functools.partial(jax.jit, static_argnames=("scale", "config", "interpret", "donate"))
def _decode(q, k, v, state, g, gk, beta, *, scale, config, interpret, donate):
    key_heads, key_dim = k.shape
    heads, value_dim = v.shape
    group = heads // key_heads
    block_v = min(config.block_v, value_dim)
    vec = lambda n: pl.BlockSpec((None, n), lambda h, j: (h, 0))  # noqa: E731
    whole = pl.BlockSpec((heads,), lambda h, j: (0,))
    in_specs = [pl.BlockSpec((None, key_dim), lambda h, j: (h // group, 0))] * 2
    in_specs.append(pl.BlockSpec((None, block_v), lambda h, j: (h, j)))
    args = [q, k, v]
    for x, spec in ((g, whole), (gk, vec(key_dim)), (beta, whole)):
        if x is not None:
            in_specs.append(spec)
            args.append(x.astype(jnp.float32))
    state_spec = pl.BlockSpec((None, key_dim, block_v), lambda h, j: (h, 0, j))
    in_specs.append(state_spec)
    args.append(state.astype(jnp.float32))
    kernel = functools.partial(_decode_kernel, has_g=g is not None, has_gk=gk is not None, delta=beta is not None,
                               scale=scale)
    return pl.pallas_call(
        kernel,
        grid=(heads, value_dim // block_v),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, block_v), lambda h, j: (h, j)), state_spec],
        out_shape=[jax.ShapeDtypeStruct((heads, value_dim), jnp.result_type(q, v)),
                   jax.ShapeDtypeStruct((heads, key_dim, value_dim), jnp.float32)],
        input_output_aliases={len(args) - 1: 1} if donate else {},
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="linear_decode_step",
    )(*args)


def decode_step(
    q: Array,
    k: Array,
    v: Array,
    state: Array,
    *,
    g: Array | None = None,
    gk: Array | None = None,
    beta: Array | None = None,
    scale: float = 1.0,
    config: DecodeConfig = DecodeConfig(),
    donate: bool = False,
    interpret: bool | None = None,
) -> tuple[Array, Array]:
    """One token of any family: q, k [Hk, K] (Hk dividing H), v [H, V], state [H, K, V]; g, beta [H];
    gk [H, K]. Returns (o [H, V] in the inputs' dtype, new state [H, K, V] float32); batch with `jax.vmap`.

    donate: alias the new state onto the old one's buffer (pass a float32 state that is not used afterwards).
    """
    if k.ndim != 2 or q.shape != k.shape or v.ndim != 2:
        raise ValueError(f"expected q, k [Hk, K] and v [H, V], got {q.shape}, {k.shape}, {v.shape}")
    key_heads, key_dim = k.shape
    heads, value_dim = v.shape
    if heads % key_heads:
        raise ValueError(f"key heads {key_heads} must divide value heads {heads}")
    if state.shape != (heads, key_dim, value_dim):
        raise ValueError(f"state must be [{heads}, {key_dim}, {value_dim}], got {state.shape}")
    for name, x, shape in (("g", g, (heads,)), ("beta", beta, (heads,)), ("gk", gk, (heads, key_dim))):
        if x is not None and x.shape != shape:
            raise ValueError(f"{name} must be {list(shape)}, got {x.shape}")
    for dim in (key_dim, value_dim):
        if dim < 16 or dim & (dim - 1):
            raise ValueError(f"K and V must be powers of two >= 16 (Triton tiles), got K={key_dim}, V={value_dim}")
    if interpret is None:
        interpret = jax.default_backend() not in ("gpu", "cuda", "rocm")
    o, new = _decode(q, k, v, state, g, gk, beta, scale=float(scale), config=config, interpret=bool(interpret),
                     donate=donate)
    return o, new
