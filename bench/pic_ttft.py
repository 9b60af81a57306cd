"""Time to first token of every PIC mode, side by side, on the Qwen3.5-35B-A3B shape with random bf16 weights.

A RAG-shaped prompt of `--segments` documents of `--segment-len` tokens plus a `--query-len` query (default 64 x
512 + 64 = 32832 tokens), served by `hypic_jax.Engine` with a ladder of token rungs whose top rung is the prompt's
own length (`--rungs` to choose others). For each mode the cache is first warmed with the documents in one order
(this also compiles the programs the mode uses), then each timed request uses a fresh random order of the same
documents, so `prefix_cache` faces reordered documents as in a RAG workload and the PIC modes are served from their
entries. TTFT is the engine's wall time from request to first-token logits on the host (hashing, lookups, layout,
the forward, the device-to-host copy). Kernel choices: `--compose`, `--linear-impl`, `--fold-impl`
(`KernelOptions`).

    python bench/pic_ttft.py                     # on the GPU (needs ~90 GB: weights + cache entries)
    python bench/pic_ttft.py --small             # toy shape, CPU smoke test

Also reported: cache bytes per segment and per token of each entry kind, and the floor of a warm request: all
weight bytes over the measured bandwidth (a few hundred fresh tokens already touch every expert) plus the fresh
tokens' FLOPs (weight matmuls, and attention to every earlier key in the full-attention layers) over the measured
peak.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from common import active_weights_per_token, count_params, full_config, small_config

from hypic_jax.stitch import layout as lay
from hypic_jax.engine import Engine, KernelOptions, seam_tokens
from hypic_jax.models import qwen3_5
from hypic_jax.models.base import COMPOSE_ALGORITHMS, FOLD_IMPLS, LINEAR_IMPLS, Model

MODES = ("full_recompute", "prefix_cache", "addition", "transition", "transition_rope", "transition_rope_recompute")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="toy shape (CPU smoke test)")
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--segments", type=int, default=None)
    parser.add_argument("--segment-len", type=int, default=None)
    parser.add_argument("--query-len", type=int, default=None)
    parser.add_argument("--seam", type=float, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--cache-gb", type=float, default=16.0, help="the entry pools' budget")
    parser.add_argument("--rungs", type=int, nargs="+", default=None,
                        help="explicit token rungs (the last >= the prompt; default: the engine's ladder below the "
                             "prompt's length, then that length)")
    parser.add_argument("--compose", default="auto", choices=COMPOSE_ALGORITHMS,
                        help="dot algorithm of the dense transfer products (KernelOptions.compose)")
    parser.add_argument("--linear-impl", default="auto", choices=LINEAR_IMPLS,
                        help="the linear cores (KernelOptions.linear)")
    parser.add_argument("--fold-impl", default="auto", choices=FOLD_IMPLS,
                        help="the fold over a request's pieces (KernelOptions.fold)")
    parser.add_argument("--profile-dir", default=None,
                        help="also trace one more warm request of each mode there (Perfetto JSON; summarise it with "
                             "bench/trace_summary.py)")
    parser.add_argument("--bandwidth-tbs", type=float, default=4.19, help="measured HBM bandwidth (H200: 4.19)")
    parser.add_argument("--peak-tflops", type=float, default=793.0, help="bf16 matmul peak (H200: 793)")
    args = parser.parse_args(argv)

    config = small_config() if args.small else full_config(args.layers)
    segments = args.segments or (8 if args.small else 64)
    segment_len = args.segment_len or (64 if args.small else 512)
    query_len = args.query_len or (16 if args.small else 64)
    dtype = jnp.float32 if args.small else jnp.bfloat16
    print(f"devices: {jax.devices()}", flush=True)

    def report_compile(event, duration, **_):  # where cold-request time goes: tracing, lowering, XLA compile
        if duration > 1.0 and event.startswith("/jax/core/compile/"):
            print(f"  {event.rsplit('/', 1)[-1]}: {duration:.1f} s", flush=True)

    jax.monitoring.register_event_duration_secs_listener(report_compile)
    start = time.perf_counter()
    params = qwen3_5.init_params(config, jax.random.key(0), dtype)  # eager: one small program per distinct shape
    jax.block_until_ready(params)
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    print(f"built {count_params(params) / 1e9:.2f}B params ({jnp.dtype(dtype).name}) in "
          f"{time.perf_counter() - start:.1f} s", flush=True)
    prompt_tokens = segments * segment_len + query_len
    if args.rungs:
        rungs = tuple(sorted(args.rungs))
    else:  # the engine's own ladder below the prompt, then the prompt's length: no padding of the whole prompt
        ladder = lay.Ladder(max_tokens=prompt_tokens, max_pieces=1, min_tokens=64, steps="fine")
        rungs = tuple(r for r in ladder.rungs if r < prompt_tokens) + (prompt_tokens,)
    if rungs[-1] < prompt_tokens:
        raise SystemExit(f"the largest rung ({rungs[-1]}) is below the prompt's {prompt_tokens} tokens")
    # prefill only: one decode row, no room for new tokens; programs compile on first use (the cold requests)
    kernels = KernelOptions(compose=args.compose, linear=args.linear_impl, fold=args.fold_impl)
    engine = Engine(Model(qwen3_5, config, params), cache_bytes=int(args.cache_gb * 2**30), seam=args.seam,
                    max_prompt_tokens=rungs[-1], max_segments=segments, max_new_tokens=0, max_batch=1,
                    token_rungs=rungs, mean_entry_tokens=segment_len, compile_cache="none", kernels=kernels,
                    consume_model=True)  # the engine stacks the layers: no second copy of the weights

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, config.vocab_size, segment_len).tolist() for _ in range(segments)]
    query = rng.integers(0, config.vocab_size, query_len).tolist()

    def timed_requests(mode):
        times, last = [], None
        for _ in range(args.repeats + 1):  # the first reordered request compiles what the warm-up did not
            order = rng.permutation(segments)
            last = engine.prefill([docs[i] for i in order] + [query], mode=mode)
            times.append(last.stats.ttft_s)
        st = last.stats  # where the last request's time went on the host
        print(f"  last request: ttft {1e3 * st.ttft_s:.1f} ms = planning {1e3 * st.cold_s:.1f} + the program and "
              f"its logits {1e3 * st.combine_s:.1f}", flush=True)
        return times, last

    rows = []
    for mode in args.modes:
        engine.clear_cache()
        start = time.perf_counter()
        warm = engine.prefill(docs + [query], mode=mode)  # cold: fills the cache, compiles
        warm_s = time.perf_counter() - start
        entry_bytes, entries = engine.cache.stats.bytes, engine.cache.stats.entries  # before timed requests add more
        print(f"{mode}: cold request (compiles included) {warm_s:.1f} s", flush=True)
        times, last = timed_requests(mode)
        ttft = min(times[1:])
        if args.profile_dir:
            order = rng.permutation(segments)
            with jax.profiler.trace(str(Path(args.profile_dir) / mode), create_perfetto_trace=True):
                engine.prefill([docs[i] for i in order] + [query], mode=mode)
        row = dict(
            mode=mode, ttft_ms=round(1e3 * ttft, 2), runs_ms=[round(1e3 * t, 2) for t in times],
            cold_request_s=round(warm_s, 3), cold_ttft_s=round(warm.stats.ttft_s, 3),
            recomputed_tokens=last.stats.recomputed_tokens, cached_tokens=last.stats.cached_tokens,
            hits=last.stats.hits, misses=last.stats.misses,
            cache_bytes_per_segment=int(entry_bytes / max(1, entries)),
        )
        if entries:
            row["cache_bytes_per_token"] = int(entry_bytes / (entries * segment_len))
        rows.append(row)
        print(json.dumps(row), flush=True)

    by_mode = {r["mode"]: r["ttft_ms"] for r in rows}
    summary = dict(config="small" if args.small else f"qwen3.5-35b-a3b/{args.layers}L", prompt_tokens=prompt_tokens,
                   segments=segments, segment_len=segment_len, query_len=query_len, seam=args.seam,
                   rungs=list(engine.ladder.rungs), kernels=engine.kernels.as_dict(), plan=str(engine.plan))
    if "transition_rope_recompute" in by_mode:
        pic = by_mode["transition_rope_recompute"]
        fresh = next(r["recomputed_tokens"] for r in rows if r["mode"] == "transition_rope_recompute")
        # attention of the fresh tokens (seams at the start of documents 2.., then the query) to every earlier key
        seam = seam_tokens(args.seam, segment_len)
        fresh_positions = [i * segment_len + j for i in range(1, segments) for j in range(seam)]
        fresh_positions += [segments * segment_len + j for j in range(query_len)]
        full_layers = sum(t != qwen3_5.LINEAR for t in config.layer_types)
        attention_flops = 2.0 * full_layers * config.num_attention_heads * 2 * config.head_dim * sum(
            p + 1 for p in fresh_positions)
        floor_s = weight_bytes / (args.bandwidth_tbs * 1e12) + (
            2.0 * active_weights_per_token(config) * fresh + attention_flops) / (args.peak_tflops * 1e12)
        summary.update(
            pic_ttft_ms=pic, floor_ms=round(1e3 * floor_s, 2), pic_over_floor=round(pic / (1e3 * floor_s), 2),
            speedup_vs_prefix_cache=round(by_mode["prefix_cache"] / pic, 2) if "prefix_cache" in by_mode else None,
            speedup_vs_full_recompute=round(by_mode["full_recompute"] / pic, 2) if "full_recompute" in by_mode else None,
        )
    print(json.dumps(dict(summary=summary, results=rows)))


if __name__ == "__main__":
    main()
