"""`make demo`: position-independent composition of linear-attention states, family by family.

For each family a random sequence is cut into segments. Each segment is summarised on its own (as a cache would
store it), then the segments are stitched back together two ways:
  naive:    add the zero-start states (drop T), what earlier position-independent caches do;
  transfer: compose (T, S) pairs with one associative scan.
Both are compared with the full recomputation of the whole sequence, and the cost of building T_C is compared with
the plain chunked pass over the same tokens.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from hypic_jax import linear_attn as la

FAMILY_BUILDERS = {
    "linear": lambda q, k, v, r: la.linear_attention(q, k, v, scale=k.shape[-1] ** -0.5),
    "retnet": lambda q, k, v, r: la.retnet(q, k, v),
    "lightning": lambda q, k, v, r: la.lightning(q, k, v, layer_factor=0.5),
    "mamba2": lambda q, k, v, r: la.mamba2(
        v, r(v.shape[:2]), A_log=jnp.zeros(v.shape[1]), dt_bias=jnp.full(v.shape[1], -2.0), B=k[:, :1], C=q[:, :1]
    ),
    "gla": lambda q, k, v, r: la.gla(q, k, v, gk=jax.nn.log_sigmoid(r(k.shape) + 3.0) / 4),
    "delta_net": lambda q, k, v, r: la.delta_net(q, k, v, beta=jax.nn.sigmoid(r(v.shape[:2]))),
    "gated_delta_net": lambda q, k, v, r: la.gated_delta_net(
        q, k, v, a=r(v.shape[:2]), b=r(v.shape[:2]), A_log=jnp.zeros(v.shape[1]), dt_bias=jnp.full(v.shape[1], -3.0)
    ),
    "kda": lambda q, k, v, r: la.kda(
        q, k, v, g_raw=r(k.shape), A_log=jnp.zeros(k.shape[1]), dt_bias=jnp.full(k.shape[1:], -3.0), b=r(v.shape[:2])
    ),
}


def _timed(fn, *args, repeats: int = 5) -> float:
    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def run(segments: int, segment_len: int, heads: int, head_dim: int, chunk_size: int) -> list[dict]:
    length = segments * segment_len
    rows = []
    for index, (name, build) in enumerate(FAMILY_BUILDERS.items()):
        keys = iter(jax.random.split(jax.random.PRNGKey(index), 8))
        rand = lambda shape: jax.random.normal(next(keys), shape)  # noqa: E731
        inputs = build(rand((length, heads, head_dim)), rand((length, heads, head_dim)), rand((length, heads, head_dim)), rand)

        full = jax.jit(lambda inp: inp.chunked(chunk_size=chunk_size))
        _, state_full = full(inputs)
        pieces = jax.tree_util.tree_map(lambda x: x.reshape((segments, segment_len) + x.shape[1:]), inputs)
        summarize = jax.jit(jax.vmap(lambda seg: seg.summarize(chunk_size=chunk_size)))
        summaries = summarize(pieces)  # what a cache stores, one entry per segment
        composed = jax.jit(la.prefix_states)(summaries, None)[-1]
        naive = jnp.sum(summaries.state, axis=0)
        norm = float(jnp.linalg.norm(state_full))
        rows.append(
            dict(
                family=name,
                form=summaries.form,
                naive=float(jnp.linalg.norm(naive - state_full)) / norm,
                transfer=float(jnp.linalg.norm(composed - state_full)) / norm,
                build_cost=_timed(summarize, pieces) / _timed(full, inputs),
            )
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--segments", type=int, default=8)
    parser.add_argument("--segment-len", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--chunk-size", type=int, default=64)
    args = parser.parse_args(argv)
    print(
        f"hypic-jax demo on {jax.devices()[0].platform}: {args.segments} segments x {args.segment_len} tokens, "
        f"{args.heads} heads of {args.head_dim}, float32, chunk {args.chunk_size}\n"
        "errors are ||S_composed - S_full|| / ||S_full|| of the final state; build cost = summarising every "
        "segment (T_C, S(C|0)) / one plain chunked pass over the same tokens\n"
    )
    header = f"{'family':<16} {'T form':<9} {'naive addition':>15} {'transfer op':>12} {'T_C build cost':>15}"
    print(header)
    print("-" * len(header))
    for row in run(args.segments, args.segment_len, args.heads, args.head_dim, args.chunk_size):
        print(
            f"{row['family']:<16} {row['form']:<9} {row['naive']:>15.2e} {row['transfer']:>12.2e} "
            f"{row['build_cost']:>14.2f}x"
        )


if __name__ == "__main__":
    main()
