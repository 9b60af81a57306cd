"""The chunk-local kernel under Mosaic GPU (`gdn_locals_mgpu.chunk_locals_mgpu`, opt-in) against Triton's on the
H200 at 32k (Qwen3.5 shapes): the relative difference of P, W and U, both kernels' times, and `gdn_forward` with
each. In its only run so far (bench/RESULTS.md, twelfth session) nothing printed within 90 s: the Mosaic GPU
kernel's compile or launch did not finish. Each stage prints as it completes, so a hang shows where it sits.

    timeout 300 python3 bench/locals_mgpu.py
"""

from __future__ import annotations

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def main():
    import jax
    import jax.numpy as jnp
    import numpy as np

    from hypic_jax.pallas import gdn
    from hypic_jax.pallas import gdn_locals_mgpu as glm
    from kernels import DIM, HEADS, gdn_inputs, timeit

    length = int(os.environ.get("LENGTH", 32768))
    q, k, v, g, beta = gdn_inputs(length)
    scale = DIM**-0.5
    cfg = gdn.GDNConfig().resolved(jnp.bfloat16)
    b, beta_t = gdn._chunk_cumsum(g, length, HEADS, 64), beta.T
    args = (q, k, v, b, beta_t)
    triton = jax.jit(lambda q, k, v, b, bt: gdn._chunk_locals(q, k, v, b, bt, chunk=64, scale=scale,
                                                              inter_dtype=jnp.bfloat16, config=cfg, interpret=False))
    ref = [np.asarray(x, np.float32) for x in triton(*args)]
    for stages in (4, 2):
        config = glm.MosaicLocalsConfig(stages=stages)
        fn = jax.jit(lambda *a, c=config: glm.chunk_locals_mgpu(*a, chunk=64, scale=scale, config=c))
        t0 = time.perf_counter()
        compiled = fn.lower(*args).compile()
        print(f"mosaic gpu, {stages} slots: compiled in {time.perf_counter() - t0:.1f} s", flush=True)
        out = jax.block_until_ready(compiled(*args))
        diffs = [float(np.linalg.norm(np.asarray(x, np.float32) - r) / np.linalg.norm(r)) for x, r in zip(out, ref)]
        print(f"mosaic gpu, {stages} slots: ran; relative difference from Triton p {diffs[0]:.2e} w {diffs[1]:.2e} "
              f"u {diffs[2]:.2e}", flush=True)
        print(f"mosaic gpu, {stages} slots: {timeit(fn, *args)[0]:.4f} ms", flush=True)
    print(f"triton: {timeit(triton, *args)[0]:.4f} ms", flush=True)
    for name, c in (("locals triton", gdn.GDNConfig()), ("locals mosaic", gdn.GDNConfig(locals_lowering="mosaic"))):
        fn = jax.jit(lambda q, k, v, g, bb, c=c: gdn.gdn_forward(q, k, v, g=g, beta=bb, scale=scale, config=c))
        print(f"gdn_forward, {name}: {timeit(fn, q, k, v, g, beta)[0]:.4f} ms", flush=True)


if __name__ == "__main__":
    main()
