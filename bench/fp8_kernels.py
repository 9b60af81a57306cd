"""Block-wise FP8 weights against bfloat16, kernel by kernel, at the Qwen3.5-35B-A3B shape: the routed experts of
one MoE layer (`models.layers.grouped_swiglu_experts`, the Pallas grouped matmul reading FP8 tiles and their scales)
and a dense projection (`x @ w`, the FP8 weight dequantized into the product's operand by XLA), at decode and
prefill token counts.

Each row gives both times, their ratio, and the floor of each: the bytes the product must read once (the experts
that the tokens' uniform routing touches, E (1 - (1 - 1/E)^(T k)) of them, or the whole dense weight; activations
are small beside them) at `--bandwidth` GB/s. The error is the FP8 result's against the bfloat16 product of the same
dequantized weights rounded to bfloat16 (the quantization's own error is not in it: it measures the kernel, not the
format; the rounding of the reference's weights to bfloat16 is, about 2^-9 relative per weight).
The experts are also timed in FP8 with K tiles twice as deep as the launch's (`GMMConfig.block_k`): an FP8 tile of
that depth holds the bytes of the bfloat16 tile, and the loop over K runs half the steps.

    python bench/fp8_kernels.py                     # GPU
    python bench/fp8_kernels.py --small             # CPU smoke size (interpret mode)
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np

from common import full_config, write_json
from linear_kernels import rel, timeit

from hypic_jax.kernels import fp8
from hypic_jax.kernels import grouped_matmul as gm
from hypic_jax.models import layers


def _experts(config, tokens: int, dtype, key):
    h, e, i, k = config.hidden_size, config.num_experts, config.moe_intermediate_size, config.num_experts_per_tok
    keys = jax.random.split(key, 5)
    gate_up = (0.02 * jax.random.normal(keys[0], (e, h, 2 * i), jnp.float32)).astype(dtype)
    down = (0.02 * jax.random.normal(keys[1], (e, i, h), jnp.float32)).astype(dtype)
    x = jax.random.normal(keys[2], (tokens, h), dtype)
    logits = jax.random.normal(keys[3], (tokens, e), jnp.float32)
    weights, experts = jax.lax.top_k(jax.nn.softmax(logits), k)
    return x, weights / weights.sum(-1, keepdims=True), experts.astype(jnp.int32), gate_up, down


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--tokens", type=int, nargs="*", default=[1, 8, 32, 64, 576, 8192])
    parser.add_argument("--bandwidth", type=float, default=3350.0, help="GB/s of the floor (H100 SXM: 3.35 TB/s)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    config = full_config(1)
    if args.small:
        config = config.__class__(**{**config.__dict__, "hidden_size": 256, "num_experts": 8,
                                     "moe_intermediate_size": 128})
        args.tokens = [1, 8]
    dtype = jnp.bfloat16
    e, k = config.num_experts, config.num_experts_per_tok
    impl = "pallas"
    rows = []
    print(f"{'what':<8} {'tokens':>6} {'bf16 ms':>8} {'fp8 ms':>8} {'fp8/bf16':>8} {'floor bf16':>10} "
          f"{'floor fp8':>9} {'rel err':>8}")
    experts_fn = jax.jit(lambda x, w, ids, gu, d: layers.grouped_swiglu_experts(x, w, ids, gu, d, impl=impl))

    def wide_k(tokens):  # the FP8 experts with K tiles twice the default launch's: the bytes of a bf16 tile
        config = gm.default_config(tokens * k)
        layers.MOE_GMM_CONFIG = dataclasses.replace(config, block_k=2 * config.block_k)
        try:
            return jax.jit(lambda x, w, ids, gu, d: layers.grouped_swiglu_experts(x, w, ids, gu, d, impl=impl))
        finally:
            layers.MOE_GMM_CONFIG = None
    for t in args.tokens:
        x, weights, ids, gate_up, down = _experts(config, t, dtype, jax.random.key(t))
        q_gate_up, q_down = fp8.quantize(gate_up), fp8.quantize(down)
        dq_gate_up, dq_down = fp8.dequantize(q_gate_up, dtype), fp8.dequantize(q_down, dtype)
        want = experts_fn(x, weights, ids, dq_gate_up, dq_down)
        got = experts_fn(x, weights, ids, q_gate_up, q_down)
        bf16_ms, _ = timeit(experts_fn, x, weights, ids, dq_gate_up, dq_down)
        fp8_ms, _ = timeit(experts_fn, x, weights, ids, q_gate_up, q_down)
        wide = wide_k(t)
        wide_err = rel(wide(x, weights, ids, q_gate_up, q_down), want)  # traced here, with the wide launch
        wide_ms, _ = timeit(wide, x, weights, ids, q_gate_up, q_down)
        touched = e * (1 - (1 - 1 / e) ** (t * k)) / e
        bytes_bf16 = touched * (gate_up.size + down.size) * 2
        bytes_fp8 = touched * sum(fp8.weight_bytes(w) for w in (q_gate_up, q_down))
        rows.append(dict(what="experts", tokens=t, bf16_ms=bf16_ms, fp8_ms=fp8_ms, fp8_wide_k_ms=wide_ms,
                         wide_k_rel_err=wide_err,
                         floor_bf16_ms=1e3 * bytes_bf16 / (args.bandwidth * 1e9),
                         floor_fp8_ms=1e3 * bytes_fp8 / (args.bandwidth * 1e9), rel_err=rel(got, want)))
        del gate_up, down, q_gate_up, q_down, dq_gate_up, dq_down
    dense_fn = jax.jit(lambda x, w: x @ w)
    h, n = config.hidden_size, config.conv_dim
    w = (0.02 * jax.random.normal(jax.random.key(1), (h, n), jnp.float32)).astype(dtype)
    q = fp8.quantize(w)
    dq = fp8.dequantize(q, dtype)
    for t in args.tokens:
        x = jax.random.normal(jax.random.key(t), (t, h), dtype)
        bf16_ms, _ = timeit(dense_fn, x, dq)
        fp8_ms, _ = timeit(dense_fn, x, q)
        rows.append(dict(what="dense", tokens=t, bf16_ms=bf16_ms, fp8_ms=fp8_ms,
                         floor_bf16_ms=1e3 * w.size * 2 / (args.bandwidth * 1e9),
                         floor_fp8_ms=1e3 * fp8.weight_bytes(q) / (args.bandwidth * 1e9),
                         rel_err=rel(dense_fn(x, q), dense_fn(x, dq))))
    for r in rows:
        r.update({key: round(v, 4) for key, v in r.items() if isinstance(v, float)})
        print(f"{r['what']:<8} {r['tokens']:>6} {r['bf16_ms']:>8.3f} {r['fp8_ms']:>8.3f} "
              f"{r['fp8_ms'] / r['bf16_ms']:>8.2f} {r['floor_bf16_ms']:>10.3f} {r['floor_fp8_ms']:>9.3f} "
              f"{r['rel_err']:>8.1e}", flush=True)
    for r in rows:
        if "fp8_wide_k_ms" in r:
            print(f"experts, FP8 with K tiles of twice the launch's: {r['tokens']} tokens {r['fp8_wide_k_ms']:.3f} ms "
                  f"(error {r['wide_k_rel_err']:.1e})")
    report = dict(device=str(jax.devices()[0]), shape="35B-A3B" if not args.small else "small",
                  dense=f"[{h}, {n}]", experts=f"{e} x [{config.hidden_size}, 2 x {config.moe_intermediate_size}]",
                  rows=rows)
    print(json.dumps(report))
    write_json(args.json, report)


if __name__ == "__main__":
    main()
