"""Time to first token of every PIC mode, side by side, on the Qwen3.5-35B-A3B shape with random bf16 weights.

A RAG-shaped prompt of `--segments` documents of `--segment-len` tokens plus a `--query-len` query (default 64 x
512 + 64 = 32832 tokens). For each mode the cache is first warmed with the documents in one order (this also
compiles: documents of one length give every later request the same span layout), then each timed request uses a
fresh random order of the same documents, so `prefix_cache` faces reordered documents as in a RAG workload and the
PIC modes are served from their entries. TTFT is the engine's wall time from request to first-token logits on the
host (hashing, lookups, layout, the forward, the device-to-host copy).

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
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prefill import active_weights_per_token, count_params, full_config, small_config  # noqa: E402

from hypic_jax.engine import Engine, seam_tokens  # noqa: E402
from hypic_jax.models import qwen3_5  # noqa: E402
from hypic_jax.models.base import Model  # noqa: E402

# Engine knobs that change speed only (see `Engine`): each variant re-times transition_rope_recompute.
VARIANTS = {
    "default": dict(),
    "block0": dict(prefix_block=0),
    "attn1": dict(attention_programs=1),
    "attn1024": dict(attention_programs=1024),  # the engine's default
    "attn512": dict(attention_programs=512),
    "stack": dict(stack_entries=True),  # the engine's default
    "nostack": dict(stack_entries=False),
    "noseamfold": dict(seam_fold=False),
    "nopool": dict(pool_entries=False),
    "graphs": dict(command_buffers=True),  # XLA's CUDA-graph capture of the span program (its default)
    "seamexact": dict(seam_precision=None),  # seam products inside the fold at the composition's bf16x3
    "nopackgqa": dict(attention_pack_gqa=False),  # one attention program per query head
    "all": dict(prefix_block=0, stack_entries=True),
}
KNOB_DEFAULTS = dict(prefix_block=None, attention_programs=1024, stack_entries=True, seam_fold=True,
                     pool_entries=True, command_buffers=False, seam_precision="auto", attention_pack_gqa=True)

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
    parser.add_argument("--cache-gb", type=float, default=16.0,
                        help="segment cache budget (the entry pool is sized from it at the first cold request)")
    parser.add_argument("--compose", default="auto", help="dot algorithm of the composition (auto, f32, bf16x3)")
    parser.add_argument("--prefix", default="auto",
                        help="states at segment boundaries: auto, associative, fold, pallas (linear_attn.prefix_states)")
    parser.add_argument("--prefix-block", type=int, default=None,
                        help="block size of the Pallas fold (0: about sqrt(n); default: one fold)")
    parser.add_argument("--attention-programs", type=int, default=1024,
                        help="split the fresh queries' attention over key ranges until this many programs run")
    parser.add_argument("--no-stack-entries", dest="stack_entries", action="store_false",
                        help="store cache entries layer by layer (Engine(stack_entries=False))")
    parser.add_argument("--no-seam-fold", action="store_true",
                        help="compose each seam with its interior in XLA, then fold (Engine(seam_fold=False))")
    parser.add_argument("--variants", nargs="*", default=[], choices=sorted(VARIANTS),
                        help="after the modes, time transition_rope_recompute again with each of these engine "
                             "settings on the warm cache (each compiles only its own combine program)")
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
    engine = Engine(Model(qwen3_5, config, params), cache_bytes=int(args.cache_gb * 2**30), seam=args.seam,
                    compose_algorithm=None if args.compose == "f32" else args.compose, prefix_impl=args.prefix,
                    prefix_block=args.prefix_block, attention_programs=args.attention_programs,
                    stack_entries=args.stack_entries, seam_fold=not args.no_seam_fold)

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, config.vocab_size, segment_len).tolist() for _ in range(segments)]
    query = rng.integers(0, config.vocab_size, query_len).tolist()
    prompt_tokens = segments * segment_len + query_len

    def timed_requests(mode):
        times, last = [], None
        for _ in range(args.repeats + 1):  # the first reordered request compiles what the warm-up did not
            order = rng.permutation(segments)
            last = engine.prefill([docs[i] for i in order] + [query], mode=mode)
            times.append(last.stats.ttft_s)
        st = last.stats  # where the last request's time went on the host
        print(f"  last request: ttft {1e3 * st.ttft_s:.1f} ms = planning {1e3 * st.cold_s:.1f} + dispatch "
              f"{1e3 * st.dispatch_s:.1f} + device wait and logits {1e3 * (st.combine_s - st.dispatch_s):.1f}",
              flush=True)
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

    main_seam_precision = engine.seam_precision  # the variants below change the engine's knobs
    variant_rows = []
    for name in args.variants:  # on the cache the last trr measurement left (or a cold request fills it)
        knobs = {**KNOB_DEFAULTS, **VARIANTS[name]}
        engine.prefix_block, engine.attention_programs = knobs["prefix_block"], knobs["attention_programs"]
        engine.seam_fold, engine.command_buffers = knobs["seam_fold"], knobs["command_buffers"]
        engine.seam_precision, engine.attention_pack_gqa = knobs["seam_precision"], knobs["attention_pack_gqa"]
        if (knobs["stack_entries"], knobs["pool_entries"]) != (engine.stack_entries, engine.pool_entries):
            engine.stack_entries, engine.pool_entries = knobs["stack_entries"], knobs["pool_entries"]
            engine.clear_cache()  # entries are stored in the new form by the next (cold) request
        start = time.perf_counter()
        try:
            engine.prefill(docs + [query], mode="transition_rope_recompute")
            first_s = time.perf_counter() - start
            times, _ = timed_requests("transition_rope_recompute")
        except Exception as error:  # a variant that fails to build or run is reported, the others still run
            row = dict(variant=name, **knobs, error=repr(error)[:500])
        else:
            row = dict(variant=name, **knobs, ttft_ms=round(1e3 * min(times[1:]), 2),
                       runs_ms=[round(1e3 * t, 2) for t in times], first_request_s=round(first_s, 1))
        variant_rows.append(row)
        print(json.dumps(row), flush=True)

    by_mode = {r["mode"]: r["ttft_ms"] for r in rows}
    summary = dict(config="small" if args.small else f"qwen3.5-35b-a3b/{args.layers}L", prompt_tokens=prompt_tokens,
                   segments=segments, segment_len=segment_len, query_len=query_len, seam=args.seam,
                   compose=engine.compose_algorithm, prefix=engine.prefix_impl, prefix_block=args.prefix_block,
                   attention_programs=args.attention_programs, stack_entries=args.stack_entries,
                   seam_fold=not args.no_seam_fold, pool_entries=True,
                   command_buffers=False, seam_precision=main_seam_precision)
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
    print(json.dumps(dict(summary=summary, results=rows, variants=variant_rows)))


if __name__ == "__main__":
    main()
