"""The Gated DeltaNet decode step written for Pallas's Mosaic GPU lowering, timed beside the Triton kernel
(`hypic_jax.pallas.decode`): the measurement behind the lowering choice for that kernel (bench/RESULTS.md).

    python bench/investigations/mosaic_decode.py --out DIR       # on the H200; appends to DIR/mosaic.jsonl

The step per (value head, column block) is the Triton kernel's: S <- e^g S, U = beta (v - S^T k),
S <- S + k U^T, o = scale S^T q, on a [K, block_v] float32 block. Mosaic GPU takes it as warpgroup arrays in the
WGMMA register layout (the layout whose axis reductions and row/column broadcasts it lowers); the per-head scalars
(e^g, beta) arrive as [V] rows so that every operand is a tileable vector. `--lower-only` exports it for CUDA on
any machine (a check that needs no GPU). Key heads are repeated to value heads in
XLA first and a batch is folded into the head axis (GDN only: a measurement, not a library path). Shapes: batch 1
and 64, 32 heads of 128.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/: kernels.py's shapes and timing
sys.path.insert(0, os.path.dirname(BENCH))  # the repository root: hypic_jax
sys.path.insert(0, BENCH)


def mosaic_decode(q, k, v, state, g, beta, *, scale, block_v=64):
    """q, k [H, K] (per value head), v [H, V], state [H, K, V] float32, g, beta [H] -> (o [H, V], state).

    `plgpu.kernel` over (head, column block); inside, `plgpu.emit_pipeline` with one step moves the blocks between
    global and shared memory. (JAX 0.10 still lowers Mosaic GPU kernels written as `pl.pallas_call` with
    `plgpu.CompilerParams`, with a deprecation warning; that form found no GPU lowering rule on the H200's 0.11.2.)
    """
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    heads, key_dim = k.shape
    value_dim = v.shape[1]
    wgmma = plgpu.Layout.WGMMA

    def step(_, q_ref, k_ref, v_ref, decay_ref, beta_ref, s_ref, o_ref, new_ref):
        load = lambda ref, layout: plgpu.load(ref, (), layout=layout, optimized=False)  # noqa: E731
        rows = lambda x: lax.broadcast_in_dim(x, (key_dim, block_v), (0,))  # noqa: E731
        cols = lambda x: lax.broadcast_in_dim(x, (key_dim, block_v), (1,))  # noqa: E731
        s = load(s_ref, wgmma) * cols(load(decay_ref, wgmma.reduce(0)))
        kb = rows(load(k_ref, wgmma.reduce(1)).astype(jnp.float32))
        u = load(beta_ref, wgmma.reduce(0)) * (load(v_ref, wgmma.reduce(0)).astype(jnp.float32)
                                               - jnp.sum(s * kb, axis=0))
        s = s + kb * cols(u)
        qb = rows(load(q_ref, wgmma.reduce(1)).astype(jnp.float32))
        o_ref[...] = (scale * jnp.sum(s * qb, axis=0)).astype(o_ref.dtype)
        new_ref[...] = s

    def body(q_g, k_g, v_g, decay_g, beta_g, s_g, o_g, new_g):
        h, j = lax.axis_index("h"), lax.axis_index("j")
        vec_k = pl.BlockSpec((None, key_dim), lambda i: (h, 0))
        vec_v = pl.BlockSpec((None, block_v), lambda i: (h, j))
        block = pl.BlockSpec((None, key_dim, block_v), lambda i: (h, 0, j))
        plgpu.emit_pipeline(step, grid=(1,), in_specs=[vec_k, vec_k, vec_v, vec_v, vec_v, block],
                            out_specs=[vec_v, block])(q_g, k_g, v_g, decay_g, beta_g, s_g, o_g, new_g)

    decay = jnp.broadcast_to(jnp.exp(g.astype(jnp.float32))[:, None], (heads, value_dim))
    beta_v = jnp.broadcast_to(beta.astype(jnp.float32)[:, None], (heads, value_dim))
    out_type = (jax.ShapeDtypeStruct((heads, value_dim), v.dtype),
                jax.ShapeDtypeStruct((heads, key_dim, value_dim), jnp.float32))
    return plgpu.kernel(body, out_type=out_type, grid=(heads, value_dim // block_v), grid_names=("h", "j"),
                        compiler_params=plgpu.CompilerParams())(q, k, v, decay, beta_v, state)


def main():
    import jax
    import jax.numpy as jnp

    from hypic_jax import linear_attn as la
    from hypic_jax.pallas import decode as dec
    from kernels import DIM, HEADS, KEY_HEADS, log, rel, timeit

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    ap.add_argument("--lower-only", action="store_true", help="export for CUDA at both block widths, run nothing")
    args = ap.parse_args()
    if args.lower_only:
        sd = jax.ShapeDtypeStruct
        heads = 64 * HEADS
        shapes = [sd((heads, DIM), jnp.bfloat16)] * 3 + [sd((heads, DIM, DIM), jnp.float32)] + [sd((heads,),
                                                                                                  jnp.float32)] * 2
        for bv in (64, 128):
            fn = jax.jit(functools.partial(mosaic_decode, scale=DIM**-0.5, block_v=bv))
            text = jax.export.export(fn, platforms=["cuda"])(*shapes).mlir_module()
            print(f"block_v {bv}: lowered for CUDA ({len(text)} characters of StableHLO)")
        return
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
        ref_o, ref_s = jax.jit(jax.vmap(lambda q, k, v, s, g, b: la.decode_reference(
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
