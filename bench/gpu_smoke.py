"""Compile and check the PIC engine's GPU-only kernels at production shapes before a long benchmark (seconds).

    python bench/gpu_smoke.py

The positioned flash attention (Qwen3.5-35B-A3B full-attention shape: 16 query heads over 2 KV heads of 256, 576
fresh queries spread over 32k keys) against its pure-JAX reference, and the prefix fold of 64 dense (T, S) groups
x 32 heads against the associative scan, and the packed GDN pass of a stitched request (`gdn_varlen` with
`summary_rows`: 33 fresh pieces among 68 segments, 32 value heads of 128 x 128, T and S as two outputs) against the
vmapped core. Exits non-zero on a mismatch.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from hypic_jax.core import linear_attn as la
from hypic_jax.kernels import attention as pattn
from hypic_jax.kernels import compose as cmp
from hypic_jax.kernels import gdn


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
    # a stitched request's fresh pieces: seams of 8 tokens and a query, between empty (cached or padded) segments
    lengths = np.zeros(68, np.int64)
    lengths[0:65:2] = 8
    lengths[64] = 64
    cu = np.concatenate([[0], np.cumsum(lengths)])
    fresh = jnp.asarray(lengths > 0)
    n = int(cu[-1])
    qv = la.l2_normalize(jnp.asarray(rng.standard_normal((n, 16, 128)), jnp.float32)).astype(jnp.bfloat16)
    kv = la.l2_normalize(jnp.asarray(rng.standard_normal((n, 16, 128)), jnp.float32)).astype(jnp.bfloat16)
    vv = jnp.asarray(rng.standard_normal((n, 32, 128)), jnp.bfloat16)
    g = -jnp.asarray(np.abs(rng.standard_normal((n, 32))) * 0.1, jnp.float32)
    beta = jax.nn.sigmoid(jnp.asarray(rng.standard_normal((n, 32)), jnp.float32))
    start = time.perf_counter()
    _, summary = jax.block_until_ready(gdn.gdn_varlen(qv, kv, vv, jnp.asarray(cu, jnp.int32), g=g, beta=beta,
                                                      summary_rows=fresh))
    print(f"gdn_varlen (summary_rows) compiled and ran in {time.perf_counter() - start:.1f} s", flush=True)
    _, ref = la.varlen_reference(qv, kv, vv, cu, g=g, beta=beta)
    read = np.flatnonzero(lengths > 0)
    err_var = max(rel(summary.state[read], ref.state[read]), rel(summary.transfer[read], ref.transfer[read]))
    print(f"relative error: attention {err_att:.2e} (bf16), prefix fold {err_fold:.2e} (bf16x3), packed GDN "
          f"summaries {err_var:.2e} (bf16 inputs)", flush=True)
    if not (err_att < 1e-2 and err_fold < 1e-4 and err_var < 2e-2):
        raise SystemExit("GPU kernel mismatch")


if __name__ == "__main__":
    main()
