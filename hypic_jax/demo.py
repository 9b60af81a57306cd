"""`make demo`: the PIC engine on a tiny in-memory model, then (with --families) the composition table.

Engine part: a tiny random Qwen3.5-style hybrid (Gated DeltaNet + gated full attention, built in memory, no
download) serves a RAG-shaped request (a few documents and a query, as token ids) twice: cold, then with the documents
shuffled. For every mode it prints the cache hits, the recomputed tokens, the time to first token and how far the
last logits are from full recompute. Compilation is done beforehand on other documents of the same lengths, so the
times are serving times.

Family part (--families): for each linear-attention family a random sequence is cut into segments. Each segment is
summarised on its own (as a cache would store it), then the segments are stitched back together two ways:
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
from hypic_jax.engine import MODES, Engine
from hypic_jax.models import qwen3_5
from hypic_jax.models.base import Model

FAMILY_BUILDERS = {
    "linear": lambda q, k, v, r: la.linear_attention(q, k, v, scale=k.shape[-1] ** -0.5),
    "retnet": lambda q, k, v, r: la.retnet(q, k, v),
    "lightning": lambda q, k, v, r: la.lightning(q, k, v, layer_factor=0.5),
    "mamba2": lambda q, k, v, r: la.mamba2(
        v, r(v.shape[:2]), A_log=jnp.zeros(v.shape[1]), dt_bias=jnp.full(v.shape[1], -4.0), B=k[:, :1], C=q[:, :1]
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


def median_time(fn, *args, repeats: int = 5) -> float:
    """Median wall time of a jitted call after one compiling call (seconds)."""
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
                build_cost=median_time(summarize, pieces) / median_time(full, inputs),
            )
        )
    return rows


def tiny_model() -> Model:
    """The demo's model: a tiny random Qwen3.5-style hybrid (3 Gated DeltaNet + 1 full-attention layers, vocabulary
    512, float32), built in memory."""
    config = qwen3_5.Config(
        vocab_size=512, hidden_size=64, layer_types=qwen3_5.default_layer_types(4), mlp_types=("dense",) * 4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rotary_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, intermediate_size=128,
        chunk_size=16,
    )
    params = qwen3_5.init_params(config, jax.random.key(0), jnp.float32)
    # random-init gates forget within a few tokens; slow them down so that the modes differ visibly
    for layer in params["layers"]:
        if "A_log" in layer["mixer"]:
            layer["mixer"]["A_log"] = jnp.full_like(layer["mixer"]["A_log"], np.log(0.03))
    return Model(qwen3_5, config, params)


def engine_demo(docs: int = 4, doc_len: int = 48, query_len: int = 12, seam: float = 8) -> list[dict]:
    """Run every mode on a cold request, then on the same documents shuffled; returns one row per (mode, request)."""
    model = tiny_model()
    config = model.config
    rng = np.random.default_rng(0)

    def request(seed_docs):
        return [rng.integers(0, config.vocab_size, doc_len).tolist() for _ in range(seed_docs)]

    warmup = Engine(model, seam=seam)  # compiles every layout the measured requests will use
    measured = Engine(model, seam=seam)
    documents, query = request(docs), rng.integers(0, config.vocab_size, query_len).tolist()
    shuffled = [documents[i] for i in rng.permutation(docs)]
    rows = []
    for mode in MODES:
        other = request(docs)
        warmup.prefill(other + [query], mode=mode)
        warmup.prefill(other[::-1] + [query], mode=mode)
        measured.cache.clear()  # every mode starts cold
        for label, segs in (("cold", documents + [query]), ("shuffled", shuffled + [query])):
            reference = measured.prefill(segs, mode="full_recompute").logits
            result = measured.prefill(segs, mode=mode)
            deviation = float(np.linalg.norm(result.logits - reference) / np.linalg.norm(reference))
            rows.append(dict(result.stats.as_dict(), request=label, deviation=deviation))
    return rows


def print_engine_demo(rows: list[dict]) -> None:
    print(f"hypic-jax engine demo on {jax.devices()[0].platform}: tiny random Qwen3.5-style model (3 GDN + 1 full "
          "attention layers), float32\nrequest: 4 documents x 48 tokens + a 12-token query; run cold, then with the "
          "documents shuffled; seam = 8 tokens\n")
    header = (f"{'mode':<26} {'request':<9} {'hits':>4} {'miss':>4} {'cached':>6} {'recomp':>6} {'cold':>5} "
              f"{'TTFT ms':>8} {'dev vs full':>11}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['mode']:<26} {r['request']:<9} {r['hits']:>4} {r['misses']:>4} {r['cached_tokens']:>6} "
              f"{r['recomputed_tokens']:>6} {r['cold_tokens']:>5} {1e3 * r['ttft_s']:>8.1f} {r['deviation']:>11.2e}")
    print("\ncached = tokens served from existing entries, recomp = fresh tokens of the final forward, cold = tokens "
          "prefilled in isolation to create entries; dev = ||logits - full recompute|| / ||full recompute||\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", action="store_true", help="also print the per-family composition table")
    parser.add_argument("--no-engine", action="store_true", help="skip the engine demo")
    parser.add_argument("--segments", type=int, default=8)
    parser.add_argument("--segment-len", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--chunk-size", type=int, default=64)
    args = parser.parse_args(argv)
    if not args.no_engine:
        print_engine_demo(engine_demo())
    if not args.families:
        return
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
