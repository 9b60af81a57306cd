"""A RAG trace against the engine (`hypic_jax.Engine`): compiles, TTFT percentiles.

A corpus of documents of log-uniform lengths (`--min-len` to `--max-len` tokens); each request takes
`--docs` documents by Zipf popularity, in a random order, plus a query of 32 to 96 tokens. The engine is warmed up
first (every program of its ladder, timed; with `--compile-cache` a second run loads them), then the same trace
runs through each mode. Reported per mode: backend compilations during the trace (the bar is zero), p50 and p99
TTFT split into requests whose documents were all cached and the rest; for `full_recompute` also the same
prompts through the model's own prefill compiled at their exact lengths (a sample, timed warm), as the ratio the
padding costs.

    python bench/rag_trace.py --small --requests 12        # CPU smoke size
    python bench/rag_trace.py                              # Qwen3.5-35B-A3B shape, random bf16 weights (GPU)
    python bench/rag_trace.py --fp8                        # its projections and experts in block-wise FP8

`--fixed-len 512 --docs 64 --corpus 64` gives the headline shape instead (every request the same 64 documents of
512 tokens in a new order, so every request after the first is served from the cache); `--modes` with no mode
and `--max-prompt-tokens 65536 --max-segments 128` times the warmup alone (with `--compile-cache`, run twice: cold,
then loaded).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from common import full_config, rag_requests, random_model, small_config, write_json

from hypic_jax.engine import Engine, KernelOptions, backend_compiles
from hypic_jax.models.base import FOLD_IMPLS

MODES = ("full_recompute", "prefix_cache", "transition_rope_recompute")


def percentiles(values) -> dict:
    if not values:
        return dict(n=0)
    v = np.asarray(values) * 1e3
    return dict(n=len(v), p50_ms=round(float(np.percentile(v, 50)), 2), p99_ms=round(float(np.percentile(v, 99)), 2))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="toy model (CPU smoke size)")
    parser.add_argument("--fp8", action="store_true", help="the projections and experts in block-wise FP8")
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--docs", type=int, default=32)
    parser.add_argument("--corpus", type=int, default=96)
    parser.add_argument("--min-len", type=int, default=200)
    parser.add_argument("--max-len", type=int, default=1200)
    parser.add_argument("--fixed-len", type=int, default=None, help="every document this long (the headline shape)")
    parser.add_argument("--max-prompt-tokens", type=int, default=None)
    parser.add_argument("--max-segments", type=int, default=None, help="the engine's segment limit (default --docs)")
    parser.add_argument("--min-tokens", type=int, default=64, help="the ladder's smallest token rung")
    parser.add_argument("--rungs", type=int, nargs="+", default=None, help="explicit token rungs (the last >= the "
                        "longest prompt) instead of the geometric ladder")
    parser.add_argument("--cache-gb", type=float, default=24.0, help="the entry pools (0: the engine's derived "
                        "budget, from the device memory left after the weights)")
    parser.add_argument("--modes", nargs="*", default=list(MODES), help="none: the warmup alone")
    parser.add_argument("--exact-sample", type=int, default=3, help="full_recompute prompts compiled at exact lengths")
    parser.add_argument("--compile-cache", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--linear-impl", default="auto", choices=["xla", "pallas", "auto"])
    parser.add_argument("--fold-impl", default="auto", choices=list(FOLD_IMPLS),
                        help="the fold over the pieces (KernelOptions.fold)")
    parser.add_argument("--no-scan", dest="scan", action="store_false", help="every layer unrolled")
    parser.add_argument("--profile-dir", default=None, help="trace there (Perfetto traces for bench/trace_summary.py) "
                        "an all-cached transition_rope_recompute request, and the first prompt's full recompute, "
                        "padded and at its exact length")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    if args.small:
        config, dtype = small_config(), jnp.float32
        args.docs, args.min_len, args.max_len, args.corpus = min(args.docs, 6), 20, 120, min(args.corpus, 16)
        args.cache_gb = min(args.cache_gb, 0.25)
    else:
        config, dtype = full_config(args.layers), jnp.bfloat16
    model = random_model(config, dtype, scan=args.scan, fp8=args.fp8)
    requests = rag_requests(config.vocab_size, corpus=args.corpus, requests=args.requests, docs=args.docs,
                     min_len=args.min_len, max_len=args.max_len, seed=args.seed, fixed_len=args.fixed_len)
    longest = max(sum(map(len, r)) for r in requests)
    max_prompt = args.max_prompt_tokens or (args.rungs[-1] if args.rungs else longest)
    # prefill only: one decode row, no room for new tokens
    engine = Engine(model, max_prompt_tokens=max_prompt, max_segments=args.max_segments or args.docs + 1,
                    cache_bytes=int(args.cache_gb * (1 << 30)) or None, max_new_tokens=0, max_batch=1,
                    compile_cache=args.compile_cache or "none", min_tokens=args.min_tokens, ladder="fine",
                    token_rungs=tuple(args.rungs) if args.rungs else None,
                    kernels=KernelOptions(linear=args.linear_impl, fold=args.fold_impl, scan_layers=args.scan))
    report = dict(device=str(jax.devices()[0]), weights="fp8" if args.fp8 else str(jnp.dtype(dtype)),
                  shape="small" if args.small else f"35B-A3B x{args.layers} layers",
                  plan=str(engine.plan), linear_impl=args.linear_impl, fold_impl=args.fold_impl,
                  longest_prompt=longest, max_prompt_tokens=max_prompt, rungs=list(engine.ladder.rungs),
                  pool_slots=engine.pools.slots, pool_gb=round(engine.pools.nbytes / 2**30, 2))
    start = time.perf_counter()
    warm = engine.warmup(progress=True)
    report["warmup"] = dict(warm, wall_s=round(time.perf_counter() - start, 1), programs_detail=engine.programs.report())
    print(json.dumps(report, indent=1), flush=True)
    last_cached = None  # an all-cached transition_rope_recompute request, for --profile-dir
    exact_prefill = jax.jit(lambda params, tokens: model.arch.prefill(params, model.config, tokens, tokens.shape[1],
                                                                      kernels=engine.kernels)[0])

    def exact(segs):  # the full prompt through the model's own prefill, compiled at its exact length
        return np.asarray(exact_prefill(engine.params, np.concatenate(segs)[None].astype(np.int32)))
    for mode in args.modes:
        engine.clear_cache()
        before = backend_compiles()
        cached, rest = [], []
        for segs in requests:
            result = engine.prefill(segs, mode=mode)
            all_cached = result.stats.misses == 0 and result.stats.hits > 0
            (cached if all_cached else rest).append(result.stats.ttft_s)
            if all_cached and mode == "transition_rope_recompute":
                last_cached = segs
        row = dict(mode=mode, compiles_during_trace=backend_compiles() - before, all_cached=percentiles(cached),
                   rest=percentiles(rest))
        if mode == "full_recompute" and args.exact_sample:
            ratios = []
            for segs in requests[: args.exact_sample]:
                exact(segs)  # compiles this exact length
                t = time.perf_counter()
                exact(segs)
                exact_s = time.perf_counter() - t
                t = time.perf_counter()
                engine.prefill(segs, mode="full_recompute")
                ratios.append((time.perf_counter() - t) / exact_s)
            row["padded_over_exact"] = [round(r, 3) for r in ratios]
            row["padded_over_exact_p50"] = round(float(np.median(ratios)), 3)
        report.setdefault("modes", []).append(row)
        print(json.dumps(row), flush=True)
    if args.profile_dir:  # one traced request each: all-cached trr, full recompute padded and at its exact length
        def traced(name, run):
            run()
            with jax.profiler.trace(f"{args.profile_dir}/{name}", create_perfetto_trace=True):
                start = time.perf_counter()
                with jax.profiler.TraceAnnotation(f"prefill {name}"):  # the anchor of trace_summary's timeline
                    run()
                seconds = time.perf_counter() - start
            print(json.dumps(dict(profiled=name, ms=round(1e3 * seconds, 2))), flush=True)

        if "transition_rope_recompute" in args.modes and last_cached is not None:
            traced("trr", lambda: engine.prefill(last_cached, mode="transition_rope_recompute"))
        if "full_recompute" in args.modes:
            traced("full", lambda: engine.prefill(requests[0], mode="full_recompute"))
            if args.exact_sample:
                traced("exact", lambda: exact(requests[0]))
    rows = {row["mode"]: row for row in report.get("modes", [])}
    full = rows.get("full_recompute", {}).get("rest", {}).get("p50_ms")  # full recompute never hits the cache
    trr = rows.get("transition_rope_recompute", {}).get("all_cached", {}).get("p50_ms")
    if full and trr:
        report["full_recompute_over_all_cached_trr"] = round(full / trr, 2)
        print(json.dumps(dict(full_recompute_over_all_cached_trr=report["full_recompute_over_all_cached_trr"])))
    write_json(args.json, report)


if __name__ == "__main__":
    main()
