"""The chunk-local kernel under Mosaic GPU (`gdn.mosaic_chunk_local.chunk_locals_mgpu`) against Triton's on the H200
(Qwen3.5 shapes, 32k unless LENGTH says otherwise): per variant of `MosaicLocalsConfig`, its compile time, the
relative difference of P, W and U from Triton's, and its time beside Triton's; then `gdn_forward` with each
lowering. Each variant runs in its own process under a timeout (TIMEOUT_S, default 60) and prints each stage as it
completes: under JAX 0.11's default warpgroup semantics the kernel's layout inference never finished (H200,
2026-11-30, bench/RESULTS.md), and a variant that hangs must not take the others with it.

    python3 -m bench.investigations.locals_mgpu                 # every variant, then the forward
    python3 -m bench.investigations.locals_mgpu --quick         # the default and three variants, then the forward
    python3 -m bench.investigations.locals_mgpu --variant NAME  # one variant in this process
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

# name -> MosaicLocalsConfig fields; the later ones take the interpreter's forms one at a time, to bisect a hang
VARIANTS = {
    "default": {},
    "4 slots": dict(stages=4),
    "1 compute warpgroup": dict(warpgroups=1),
    "compiler's registers": dict(set_registers=False),
    "K^T input": dict(transposed_keys=True),
    "left operands in smem": dict(smem_operands=True),
    "interpreter forms": dict(smem_operands=True, transposed_keys=True, set_registers=False, warpgroups=1),
    "warpgroup semantics": dict(semantics="warpgroup"),
}
QUICK = ("default", "4 slots", "1 compute warpgroup", "compiler's registers")  # --quick: these, then the forward


def _inputs():
    import jax.numpy as jnp

    from hypic_jax.kernels.gdn.common import chunk_cumsum
    from bench.linear_kernels import HEADS, gdn_inputs

    length = int(os.environ.get("LENGTH", 32768))
    q, k, v, g, beta = gdn_inputs(length)
    return (q, k, v, chunk_cumsum(g, length, HEADS, 64), beta.T), (q, k, v, g, beta), jnp


def run_variant(name):
    import jax
    import numpy as np

    from hypic_jax.kernels import gdn
    from hypic_jax.kernels.gdn import mosaic_chunk_local as glm
    from bench.linear_kernels import DIM, timeit

    args, _, jnp = _inputs()
    scale = DIM**-0.5
    cfg = gdn.GDNConfig().resolved(jnp.bfloat16)
    triton = jax.jit(lambda q, k, v, b, bt: gdn.chunk_locals(q, k, v, b, bt, chunk=64, scale=scale,
                                                             inter_dtype=jnp.bfloat16, config=cfg, interpret=False))
    ref = [np.asarray(x, np.float32) for x in triton(*args)]
    config = glm.MosaicLocalsConfig(**VARIANTS[name])
    fn = jax.jit(lambda *a: glm.chunk_locals_mgpu(*a, chunk=64, scale=scale, config=config))
    t0 = time.perf_counter()
    compiled = fn.lower(*args).compile()
    print(f"{name}: compiled in {time.perf_counter() - t0:.1f} s", flush=True)
    out = jax.block_until_ready(compiled(*args))
    diffs = [float(np.linalg.norm(np.asarray(x, np.float32) - r) / np.linalg.norm(r)) for x, r in zip(out, ref)]
    print(f"{name}: ran; relative difference from Triton p {diffs[0]:.2e} w {diffs[1]:.2e} u {diffs[2]:.2e}",
          flush=True)
    print(f"{name}: {timeit(fn, *args)[0]:.4f} ms beside Triton's {timeit(triton, *args)[0]:.4f}", flush=True)


def run_forward():
    import jax

    from hypic_jax.kernels import gdn
    from bench.linear_kernels import DIM, timeit

    _, (q, k, v, g, beta), _ = _inputs()
    for name, c in (("locals triton", gdn.GDNConfig(locals_lowering="triton")),
                    ("locals mosaic", gdn.GDNConfig(locals_lowering="mosaic")), ("GDNConfig()", gdn.GDNConfig())):
        fn = jax.jit(lambda q, k, v, g, bb, c=c: gdn.gdn_forward(q, k, v, g=g, beta=bb, scale=DIM**-0.5, config=c))
        print(f"gdn_forward, {name}: {timeit(fn, q, k, v, g, beta)[0]:.4f} ms", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", choices=sorted(VARIANTS) + ["forward"])
    ap.add_argument("--quick", action="store_true", help="only the variants most likely to be fastest")
    opts = ap.parse_args()
    name = opts.variant
    if name == "forward":
        return run_forward()
    if name:
        return run_variant(name)
    timeout = float(os.environ.get("TIMEOUT_S", 60))
    for name in list(QUICK if opts.quick else VARIANTS) + ["forward"]:
        try:
            subprocess.run([sys.executable, "-m", __spec__.name, "--variant", name], timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            print(f"{name}: did not finish within {timeout:.0f} s", flush=True)


if __name__ == "__main__":
    main()
