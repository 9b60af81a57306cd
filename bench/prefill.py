"""Full-prefill benchmark of the Qwen3.5-35B-A3B shape with random bf16 weights (no checkpoint needed).

Times `qwen3_5.prefill` (fresh prompt -> caches + first token) at each length and reports time to first token,
tokens/s and model FLOP utilisation against a given peak. Shape numbers are the Qwen/Qwen3.5-35B-A3B config
(transformers' Qwen3_5MoeTextConfig defaults): hidden 2048, 40 layers (every 4th full attention), 256 experts
top-8 of width 512 plus a 512-wide shared expert, vocab 248320, GDN 16 key / 32 value heads of 128, attention 16 q /
2 kv heads of 256 with 64 rotary dims.

    python bench/prefill.py --lengths 8192 32768 --peak-tflops 793      # on the GPU
    python bench/prefill.py --small                                      # toy size, CPU smoke test

Model FLOPs count matmul work only: 2 x active weights per token (projections, the 8 routed + shared experts,
router; the LM head for the last position), causal attention 4 * Hq * D * L^2 / 2 per full layer, and the chunked
GDN core 2 * (3 K V + c (3 K + 2 V)) per token and value head (chunk c).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

from common import active_weights_per_token, count_params, full_config, small_config

from hypic_jax.models import mixing, qwen3_5
from hypic_jax.models.base import KernelOptions


def prefill_flops(config: qwen3_5.Config, length: int, batch: int = 1, chunk: int = 64) -> dict[str, float]:
    weights = 2.0 * active_weights_per_token(config) * length + 2.0 * config.hidden_size * config.vocab_size
    num_full = sum(t == qwen3_5.FULL for t in config.layer_types)
    attention = num_full * 4.0 * config.num_attention_heads * config.head_dim * length * length / 2
    k, v, c = config.linear_key_head_dim, config.linear_value_head_dim, chunk
    num_linear = len(config.layer_types) - num_full
    gdn = num_linear * config.linear_num_value_heads * length * 2.0 * (3 * k * v + c * (3 * k + 2 * v))
    parts = dict(weights=weights, attention=attention, gdn=gdn)
    return {name: batch * value for name, value in parts.items()}


def _best_ms(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return round(1e3 * min(times), 3)


def layer_breakdown(params, config: qwen3_5.Config, tokens, repeats: int) -> dict[str, float]:
    """Milliseconds of one layer's pieces on random activations of the prompt's length, jitted one by one: where
    the full prefill's time goes (multiply by the layer counts; the sum misses only norms, residuals, embedding)."""
    batch, length = tokens.shape
    x = params["embed"][tokens]
    linear = config.layer_types.index(qwen3_5.LINEAR)
    full = config.layer_types.index(qwen3_5.FULL)
    positions = jnp.arange(length, dtype=jnp.int32)
    causal = lambda: mixing.CausalMixing(None, positions, None)  # noqa: E731  (a plain forward from position 0)
    gdn = jax.jit(lambda x, p: qwen3_5.gdn_mixer(x, p, config, causal()))
    attn = jax.jit(lambda x, p: qwen3_5.attention_mixer(x, p, config, causal()))
    mlp = jax.jit(lambda x, p: qwen3_5.feed_forward(x, p, config, config.mlp_types[0]))
    layers_ = params["layers"]
    return dict(
        gdn_mixer=_best_ms(gdn, x, layers_[linear]["mixer"], repeats=repeats),
        attention_mixer=_best_ms(attn, x, layers_[full]["mixer"], repeats=repeats),
        moe_block=_best_ms(mlp, x, layers_[0]["mlp"], repeats=repeats),
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=None)
    parser.add_argument("--peak-tflops", type=float, default=793.0, help="bf16 dense matmul peak (H200: 793)")
    parser.add_argument("--small", action="store_true", help="toy shape (CPU smoke test)")
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--gdn-kernel", choices=("auto", "xla", "pallas"), default="auto",
                        help="GDN prefill core (auto: Pallas for bf16 on a GPU, linear_attn.chunked elsewhere)")
    parser.add_argument("--moe-kernel", choices=("auto", "ragged", "pallas"), default="auto",
                        help="expert grouped matmul (auto: Pallas on a GPU, lax.ragged_dot elsewhere)")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time one layer's pieces (GDN mixer, attention mixer, MoE block) at each length")
    args = parser.parse_args(argv)

    config = small_config() if args.small else full_config(args.layers)
    kernels = KernelOptions(linear=args.gdn_kernel, moe=args.moe_kernel)
    lengths = args.lengths or ([256, 1024] if args.small else [8192, 32768])
    dtype = jnp.dtype(args.dtype)
    print(f"devices: {jax.devices()}", flush=True)
    start = time.perf_counter()
    params = qwen3_5.init_params(config, jax.random.key(0), dtype)  # eager: one small program per distinct shape
    jax.block_until_ready(params)
    print(f"built {count_params(params) / 1e9:.2f}B params ({dtype}) in {time.perf_counter() - start:.1f} s", flush=True)

    prefill = jax.jit(qwen3_5.prefill, static_argnames=("config", "max_len", "kernels"))
    results = []
    for length in lengths:
        tokens = jax.random.randint(jax.random.key(length), (args.batch, length), 0, config.vocab_size, jnp.int32)
        start = time.perf_counter()
        try:
            compiled = prefill.lower(params, config, tokens, length + 1, kernels=kernels).compile()
        except jax.errors.JaxRuntimeError as error:  # a kernel that does not fit this GPU: say so, use pure JAX
            if kernels.linear == "xla":
                raise
            print(f"compile failed with the linear kernel {kernels.linear!r} ({str(error)[:200]}); retrying with "
                  f"'xla'", flush=True)
            kernels = kernels.replace(linear="xla")
            compiled = prefill.lower(params, config, tokens, length + 1, kernels=kernels).compile()
        compile_s = time.perf_counter() - start
        times = []
        for _ in range(args.repeats + 1):  # the first run warms up allocators / autotuning
            start = time.perf_counter()
            logits, cache = compiled(params, tokens)
            first = jnp.argmax(logits, axis=-1)
            jax.block_until_ready((first, cache))
            times.append(time.perf_counter() - start)
            del cache
        ttft = min(times[1:]) if len(times) > 1 else times[0]
        flops = prefill_flops(config, length, args.batch, kernels.chunk_size)
        total = sum(flops.values())
        row = dict(
            length=length,
            batch=args.batch,
            ttft_s=round(ttft, 4),
            tokens_per_s=round(args.batch * length / ttft, 1),
            model_tflop=float(f"{total / 1e12:.4g}"),
            tflop_breakdown={k: float(f"{v / 1e12:.4g}") for k, v in flops.items()},
            achieved_tflops=float(f"{total / ttft / 1e12:.4g}"),
            mfu=float(f"{total / ttft / (args.peak_tflops * 1e12):.4g}"),
            gdn_kernel=kernels.linear,
            compile_s=round(compile_s, 1),
            runs_s=[round(t, 4) for t in times],
        )
        if args.breakdown:
            row["per_layer_ms"] = layer_breakdown(params, config, tokens, args.repeats)
        results.append(row)
        print(json.dumps(row), flush=True)
    name = "small" if args.small else f"qwen3.5-35b-a3b/{args.layers}L"
    print(json.dumps(dict(config=name, gdn_kernel=args.gdn_kernel, moe_kernel=args.moe_kernel, results=results)))


if __name__ == "__main__":
    main()
