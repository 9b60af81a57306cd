"""The GDN state pass alone at 32k (Qwen3.5 shapes: 16 key -> 32 value heads of 128, bf16), per lowering, block
width and slot count, on the chunk-local kernel's own operands: what bounds the pass (bench/RESULTS.md, H200,
2026-11-30).

    python3 -m bench.investigations.state_pass            # on the H200; prints one line per launch
    python3 -m bench.investigations.state_pass --quick    # the default launch under both semantics, one Triton

Mosaic GPU (`gdn.mosaic_state.state_pass_mgpu`) at 32 and 64 value columns a block, 1 to 3 slots, with and without
clusters of column blocks sharing multicast operands, then Triton (`gdn.state.state_pass`) at 32 columns with 2 and 3
stages; outputs are compared with the first launch.
"""

from __future__ import annotations

import os
import sys


def main():
    quick = "--quick" in sys.argv[1:]  # the default launch under both lowering semantics, and one Triton launch
    import jax
    import jax.numpy as jnp

    from hypic_jax.kernels import gdn
    from hypic_jax.kernels.gdn import mosaic_state
    from hypic_jax.kernels.gdn.state import state_pass
    from bench.linear_kernels import DIM, HEADS, locals_operands, timeit

    _, (b, p, w, u, ks, qs) = locals_operands(int(os.environ.get("LENGTH", 32768)))
    scale = DIM**-0.5
    init = jnp.zeros((HEADS, DIM, DIM), jnp.float32)
    ref = None

    def report(name, fn, *args):
        nonlocal ref
        try:
            ms, _ = timeit(fn, *args)
        except Exception as error:  # noqa: BLE001 (a launch that does not fit is a result too)
            print(f"{name}: {repr(error)[:200]}", flush=True)
            return
        o, final = fn(*args)
        final = final.reshape(init.shape)
        if ref is None:
            ref = (o.astype(jnp.float32), final)
        diff = max(float(jnp.abs(o.astype(jnp.float32) - ref[0]).max()), float(jnp.abs(final - ref[1]).max()))
        print(f"{name}: {ms:.4f} ms (max difference from the first launch {diff:.2e})", flush=True)

    launches = [(32, 2, cluster, semantics) for cluster in (2, 1) for semantics in ("warpgroup", "lane")]
    if not quick:
        launches += [(bv, stages, cluster, "warpgroup") for cluster in (2, 1) for bv, stages in ((32, 3), (64, 2))]
        launches += [(32, 1, 1, "warpgroup"), (32, 2, 4, "warpgroup")]
    for bv, stages, cluster, semantics in launches:
        config = mosaic_state.MosaicStateConfig(block_v=bv, stages=stages, cluster=cluster, semantics=semantics)
        report(f"mosaic gpu, {bv} columns, {stages} slots, clusters of {cluster}, {semantics} semantics", jax.jit(
            lambda *a, c=config: mosaic_state.state_pass_mgpu(*a, chunk=64, out_dtype=jnp.bfloat16, scale=scale,
                                                              config=c)), w, u, ks, b, qs, p, init)
    for bv, stages, warps in ((32, 3, 4), (32, 2, 4))[:1 if quick else 2]:
        config = gdn.GDNConfig(block_v=bv, state_stages=stages, state_warps=warps).resolved(jnp.bfloat16)
        report(f"triton, {bv} columns, {stages} stages, {warps} warps", jax.jit(
            lambda *a, c=config: state_pass(*a, chunk=64, pieces=1, value_dim=DIM, out_dtype=jnp.bfloat16,
                                            scale=scale, config=c, interpret=False)),
               w, u, ks, b, qs, p, init[None])


if __name__ == "__main__":
    main()
