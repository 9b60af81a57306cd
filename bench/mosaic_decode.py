"""The Gated DeltaNet decode step written for Pallas's Mosaic GPU lowering, timed beside the Triton kernel
(`hypic_jax.pallas.decode`): the measurement behind the lowering choice for that kernel (bench/RESULTS.md).

    python bench/mosaic_decode.py --out DIR       # on the H200; appends to DIR/mosaic.jsonl and prints a table

The step per (value head, column block) is the Triton kernel's: S <- e^g S, U = beta (v - S^T k),
S <- S + k U^T, o = scale S^T q, on a [K, block_v] float32 block. Mosaic GPU takes it as warpgroup arrays in the
WGMMA register layout (the layout whose axis reductions and row/column broadcasts it lowers); the per-head scalars
(e^g, beta) arrive as [V] rows so that every operand is a tileable vector. Key heads are repeated to value heads in
XLA first and a batch is folded into the head axis (GDN only: a measurement, not a library path). Shapes: batch 1
and 64, 32 heads of 128.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def mosaic_decode(q, k, v, state, g, beta, *, scale, block_v=64):
    """q, k [H, K] (per value head), v [H, V], state [H, K, V] float32, g, beta [H] -> (o [H, V], state)."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    heads, key_dim = k.shape
    value_dim = v.shape[1]
    wgmma = plgpu.Layout.WGMMA

    def kernel(q_ref, k_ref, v_ref, decay_ref, beta_ref, s_ref, o_ref, new_ref):
        s = plgpu.load(s_ref, (), layout=wgmma, optimized=False)
        rows = lambda x: lax.broadcast_in_dim(x, (key_dim, block_v), (0,))  # noqa: E731
        cols = lambda x: lax.broadcast_in_dim(x, (key_dim, block_v), (1,))  # noqa: E731
        kv = plgpu.load(k_ref, (), layout=wgmma.reduce(1), optimized=False).astype(jnp.float32)
        qv = plgpu.load(q_ref, (), layout=wgmma.reduce(1), optimized=False).astype(jnp.float32)
        vv = plgpu.load(v_ref, (), layout=wgmma.reduce(0), optimized=False).astype(jnp.float32)
        decay = plgpu.load(decay_ref, (), layout=wgmma.reduce(0), optimized=False)
        bv = plgpu.load(beta_ref, (), layout=wgmma.reduce(0), optimized=False)
        s = s * cols(decay)
        kb = rows(kv)
        u = bv * (vv - jnp.sum(s * kb, axis=0))
        s = s + kb * cols(u)
        o_ref[...] = (scale * jnp.sum(s * rows(qv), axis=0)).astype(o_ref.dtype)
        new_ref[...] = s

    vec_k = pl.BlockSpec((None, key_dim), lambda h, j: (h, 0))
    vec_v = pl.BlockSpec((None, block_v), lambda h, j: (h, j))
    state_spec = pl.BlockSpec((None, key_dim, block_v), lambda h, j: (h, 0, j))
    decay = jnp.broadcast_to(jnp.exp(g.astype(jnp.float32))[:, None], (heads, value_dim))
    beta_v = jnp.broadcast_to(beta.astype(jnp.float32)[:, None], (heads, value_dim))
    return pl.pallas_call(
        kernel,
        grid=(heads, value_dim // block_v),
        in_specs=[vec_k, vec_k, vec_v, vec_v, vec_v, state_spec],
        out_specs=[vec_v, state_spec],
        out_shape=[jax.ShapeDtypeStruct((heads, value_dim), v.dtype),
                   jax.ShapeDtypeStruct((heads, key_dim, value_dim), jnp.float32)],
        compiler_params=plgpu.CompilerParams(),
        name="mosaic_decode_step",
    )(q, k, v, decay, beta_v, state)


def main():
    import jax
    import jax.numpy as jnp

    from hypic_jax import linear_attn as la
    from hypic_jax.pallas import decode as dec
    from kernels import DIM, HEADS, KEY_HEADS, log, rel, timeit

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "mosaic.jsonl")
    scale = DIM**-0.5
    group = HEADS // KEY_HEADS
    for batch in (1, 64):
        kb = jax.random.split(jax.random.PRNGKey(9), 6)
        q = la.l2_normalize(jax.random.normal(kb[0], (batch, KEY_HEADS, DIM))).astype(jnp.bfloat16)
        k = la.l2_normalize(jax.random.normal(kb[1], (batch, KEY_HEADS, DIM))).astype(jnp.bfloat16)
        v = jax.random.normal(kb[2], (batch, HEADS, DIM)).astype(jnp.bfloat16)
        state = jax.random.normal(kb[3], (batch, HEADS, DIM, DIM), jnp.float32)
        g = -jax.random.uniform(kb[4], (batch, HEADS)) * 0.1
        beta = jax.nn.sigmoid(jax.random.normal(kb[5], (batch, HEADS)))
        nbytes = 2 * state.size * 4
        ref_o, ref_s = jax.jit(jax.vmap(lambda q, k, v, s, g, b: dec.decode_reference(
            q, k, v, s, g=g, beta=b, scale=scale)))(q, k, v, state, g, beta)
        cases = {"triton (hypic_jax.pallas.decode) bv32": jax.jit(jax.vmap(lambda q, k, v, s, g, b: dec.decode_step(
            q, k, v, s, g=g, beta=b, scale=scale)))}
        def flat(q, k, v, s, g, b, bv):  # batch folded into the head axis (Mosaic GPU kernels do not vmap)
            rep = lambda x: jnp.repeat(x, group, 1).reshape(batch * HEADS, DIM)  # noqa: E731
            o, s = mosaic_decode(rep(q), rep(k), v.reshape(batch * HEADS, DIM), s.reshape(batch * HEADS, DIM, DIM),
                                 g.reshape(-1), b.reshape(-1), scale=scale, block_v=bv)
            return o.reshape(batch, HEADS, DIM), s.reshape(batch, HEADS, DIM, DIM)

        for bv in (64, 128):  # 32 bf16 values are 64 bytes, under the 128-byte warpgroup copy Mosaic GPU takes
            cases[f"mosaic gpu bv{bv}"] = jax.jit(functools.partial(flat, bv=bv))
        for name, fn in cases.items():
            try:
                ms, comp = timeit(fn, q, k, v, state, g, beta)
                o, s = fn(q, k, v, state, g, beta)
                log(path, dict(impl=name, batch=batch, ms=ms, compile_s=comp, TBs=nbytes / ms / 1e9,
                               o=rel(o, ref_o), state=rel(s, ref_s)))
            except Exception as e:  # noqa: BLE001
                import traceback

                log(path, dict(impl=name, batch=batch, error=repr(e)[:800],
                               where=traceback.format_exc()[-1500:]))


if __name__ == "__main__":
    main()
