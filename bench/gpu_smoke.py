"""Compile and check the PIC engine's GPU-only kernels at production shapes before a long benchmark (seconds).

    python bench/gpu_smoke.py

The positioned flash attention (Qwen3.5-35B-A3B full-attention shape: 16 query heads over 2 KV heads of 256, 576
fresh queries spread over 32k keys) against its pure-JAX reference, and the prefix fold of 64 dense (T, S) groups
x 32 heads against the associative scan. Exits non-zero on a mismatch.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from hypic_jax import linear_attn as la
from hypic_jax.pallas import attention as pattn
from hypic_jax.pallas import compose as cmp


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main() -> None:
    rng = np.random.default_rng(0)
    keys = 32832
    positions = np.sort(np.concatenate([512 * i + np.arange(8) for i in range(1, 64)] + [keys - 64 + np.arange(64)]))
    q = jnp.asarray(rng.standard_normal((len(positions), 16, 256)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((keys, 2, 256)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((keys, 2, 256)), jnp.bfloat16)
    pos = jnp.asarray(positions, jnp.int32)
    start = time.perf_counter()
    got = jax.block_until_ready(pattn.positioned_attention(q, k, v, pos, scale=256**-0.5))
    print(f"positioned_attention compiled and ran in {time.perf_counter() - start:.1f} s", flush=True)
    want = jax.jit(pattn.positioned_attention_reference, static_argnames="scale")(q, k, v, pos, scale=256**-0.5)
    err_att = rel(got, want)
    t = jnp.asarray(rng.standard_normal((64, 32, 128, 128)) / np.sqrt(128) * 0.9, jnp.float32)
    s = jnp.asarray(rng.standard_normal((64, 32, 128, 128)), jnp.float32)
    start = time.perf_counter()
    fold = jax.block_until_ready(cmp.prefix_fold_pallas(t, s))
    print(f"prefix_fold_pallas compiled and ran in {time.perf_counter() - start:.1f} s", flush=True)
    err_fold = rel(fold, la.prefix_states(la.Summary("dense", s, t)))
    print(f"relative error: attention {err_att:.2e} (bf16), prefix fold {err_fold:.2e} (bf16x3)", flush=True)
    if not (err_att < 1e-2 and err_fold < 1e-4):
        raise SystemExit("GPU kernel mismatch")


if __name__ == "__main__":
    main()
