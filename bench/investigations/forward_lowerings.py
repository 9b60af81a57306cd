"""`gdn_forward` at 32k (Qwen3.5 shapes: 16 key -> 32 value heads of 128, bf16) per state-pass lowering, in one
process: the default `GDNConfig()` (on Hopper: both kernels under Mosaic GPU, the state pass in clusters of two),
Triton's chunk-local kernel, the Mosaic GPU pass without clusters, Triton's pass, and both in Triton
(bench/RESULTS.md, H200, 2026-11-30).

    python3 -m bench.investigations.forward_lowerings          # on the H200; LENGTH=... for another length
"""

from __future__ import annotations

import os


def main():
    import jax

    from hypic_jax.kernels import gdn
    from bench.linear_kernels import DIM, gdn_inputs, timeit

    q, k, v, g, beta = gdn_inputs(int(os.environ.get("LENGTH", 32768)))
    for name, cfg in (("GDNConfig()", gdn.GDNConfig()), ("locals triton", gdn.GDNConfig(locals_lowering="triton")),
                      ("state_cluster=1", gdn.GDNConfig(state_cluster=1)),
                      ("state triton", gdn.GDNConfig(state_lowering="triton")),
                      ("both triton", gdn.GDNConfig(state_lowering="triton", locals_lowering="triton"))):
        fn = jax.jit(lambda q, k, v, g, b, c=cfg: gdn.gdn_forward(q, k, v, g=g, beta=b, scale=DIM**-0.5, config=c))
        ms, _ = timeit(fn, q, k, v, g, beta)
        print(f"gdn_forward {name}: {ms:.4f} ms", flush=True)


if __name__ == "__main__":
    main()
