"""The engine's span programs with the linear cores as XLA chunk loops against the Pallas kernels
(`Engine(kernels=KernelOptions(linear="xla" | "pallas"))`, `stitch.linear_over_layout`), beside the model's own
full prefill (`arch.prefill`) compiled at each prompt's exact length.

For a Qwen3.5 shape (the 35B-A3B shape at `--layers` layers, random bf16 weights; `--small`: a 3-layer version of
`bench/common.py`'s toy float32 model, where "pallas" runs the kernels in the Pallas interpreter), builds one
engine per path, warms both (the cold, pic, plain and commit programs of each token rung; no decode programs), then
per prompt length times, warm, the median of `--repeats` runs of:

  full_recompute   the plain program over the whole prompt (its rung)
  engine_exact     the model's own full prefill of the same prompt, compiled at its exact length (`arch.prefill`)
  trr_cold         a transition_rope_recompute request whose `--docs` documents all miss: the cold program (the
                   documents packed, isolated, recorded) and then the pic program
  trr_warm         the same request again, every document cached: the pic program alone

and prints a table of ms per path, the Pallas path's speed-up, and the largest relative difference of the two
paths' logits (|a - b|max / |b|max). Compilations during the engines' timed requests are counted (the bar is
zero).

    python3 -m bench.investigations.stable_kernels                       # H200: 8 layers, rungs 1024 and 16384
    python3 -m bench.investigations.stable_kernels --small               # CPU smoke run (about two minutes)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import (compile_programs, full_config, log, max_rel, median_seconds, small_config, split_prompt,
                          write_json)

from hypic_jax.engine import Engine, KernelOptions, backend_compiles, stack_layers
from hypic_jax.models import qwen3_5
from hypic_jax.models.base import Model

IMPLS = ("xla", "pallas")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="toy float32 model (CPU smoke run)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--lengths", type=int, nargs="+", default=None, help="prompt lengths (default 4096 11000)")
    parser.add_argument("--rungs", type=int, nargs="+", default=None,
                        help="token rungs (default 1024 16384: the warm PIC request's seams and query fit the first)")
    parser.add_argument("--docs", type=int, default=16, help="documents per prompt (the engines' max_segments)")
    parser.add_argument("--query", type=int, default=64)
    parser.add_argument("--seam", type=float, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache-gb", type=float, default=4.0)
    parser.add_argument("--no-exact", action="store_true", help="skip the exact-length prefill")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    if args.small:  # 3 layers (GDN, GDN, attention) with dense MLPs and one rung: few, quick CPU compiles
        config, dtype = dataclasses.replace(small_config(), layer_types=qwen3_5.default_layer_types(3, 3),
                                            mlp_types=("dense",) * 3, intermediate_size=128), jnp.float32
        lengths, rungs = args.lengths or [200, 450], args.rungs or [512]
        args.docs, args.query, args.cache_gb = min(args.docs, 4), min(args.query, 16), min(args.cache_gb, 0.0625)
    else:
        config, dtype = full_config(args.layers), jnp.bfloat16
        lengths, rungs = args.lengths or [4096, 11000], args.rungs or [1024, 16384]
    if max(lengths) > rungs[-1]:
        raise SystemExit(f"the longest prompt ({max(lengths)}) is over the largest rung ({rungs[-1]})")
    log(f"device {jax.devices()[0]}, {'small' if args.small else f'35B-A3B shape x{args.layers} layers'}, "
        f"rungs {rungs}, lengths {lengths}, {args.docs} documents")
    start = time.perf_counter()
    params = qwen3_5.init_params(config, jax.random.key(0), dtype)
    jax.block_until_ready(params)
    model = stack_layers(Model(qwen3_5, config, params), consume=True)  # one stacked copy, shared by the engines
    log(f"random weights in {time.perf_counter() - start:.1f} s")

    engines = {}
    for impl in IMPLS:
        engine = Engine(model, max_prompt_tokens=rungs[-1], max_segments=args.docs, token_rungs=tuple(rungs),
                        max_new_tokens=0, max_batch=1, cache_bytes=int(args.cache_gb * (1 << 30)), eviction="lru",
                        kernels=KernelOptions(linear=impl), mean_entry_tokens=max(16, max(lengths) // args.docs),
                        compile_cache="none")
        count, wall, detail = compile_programs(engine, rungs[-1], ("cold", "pic", "plain", "commit"))
        log(f"[{impl}] compiled {count} programs in {wall:.1f} s wall: {detail}")
        engines[impl] = engine

    rng = np.random.default_rng(0)
    rows = []
    exact_prefill = jax.jit(lambda params, tokens: model.arch.prefill(params, config, tokens, tokens.shape[1])[0])

    def exact(segs):  # the whole prompt through the model's own prefill, compiled at its exact length
        return np.asarray(exact_prefill(model.params, np.concatenate(segs)[None].astype(np.int32))[0])
    for length in lengths:
        tokens = rng.integers(3, config.vocab_size, length).tolist()
        segs = split_prompt(rng, tokens, args.docs, args.query)
        before = backend_compiles()
        got = {}
        for impl, engine in engines.items():
            ms = {}
            ms["full_recompute"], full = median_seconds(lambda: engine.prefill(segs, mode="full_recompute"),
                                                        args.repeats)

            def cold(engine=engine):
                engine.clear_cache()
                return engine.prefill(segs, mode="transition_rope_recompute", seam=args.seam)

            ms["trr_cold"], trr = median_seconds(cold, args.repeats)
            assert trr.stats.misses > 0 and trr.stats.hits == 0, trr.stats
            ms["trr_warm"], warm = median_seconds(
                lambda: engine.prefill(segs, mode="transition_rope_recompute", seam=args.seam), args.repeats)
            assert warm.stats.misses == 0, warm.stats
            got[impl] = (ms, full.logits, trr.logits, warm.logits)
            log(f"[{impl}] length {length}: " + ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in ms.items()))
        serving_compiles = backend_compiles() - before
        exact_ms, exact_logits = None, None
        if not args.no_exact:
            exact_s, exact_logits = median_seconds(lambda: exact(segs), args.repeats)
            exact_ms = 1e3 * exact_s
            log(f"[exact] length {length}: exact-length full prefill {exact_ms:.2f} ms")
        (xms, xfull, xcold, xwarm), (pms, pfull, pcold, pwarm) = got["xla"], got["pallas"]
        diffs = dict(full_recompute=max_rel(pfull, xfull), trr_cold=max_rel(pcold, xcold),
                     trr_warm=max_rel(pwarm, xwarm))
        for what in ("full_recompute", "trr_cold", "trr_warm"):
            row = dict(length=length, what=what, xla_ms=round(1e3 * xms[what], 2), pallas_ms=round(1e3 * pms[what], 2),
                       speedup=round(xms[what] / pms[what], 2), rel_logit_diff=float(f"{diffs[what]:.3g}"))
            if what == "full_recompute" and exact_ms is not None:
                row.update(engine_exact_ms=round(exact_ms, 2), pallas_over_exact=round(1e3 * pms[what] / exact_ms, 2),
                           xla_over_exact=round(1e3 * xms[what] / exact_ms, 2),
                           rel_logit_diff_pallas_vs_exact=float(f"{max_rel(pfull, exact_logits):.3g}"))
            rows.append(row)
        log(f"length {length}: {serving_compiles} compilations in the engines' timed requests")
        rows.append(dict(length=length, what="engine_compiles", count=serving_compiles))

    log("")
    log(f"{'length':>7} {'request':<15} {'xla ms':>9} {'pallas ms':>10} {'speedup':>8} {'exact ms':>9} "
        f"{'pallas/exact':>12} {'rel diff':>9}")
    for r in rows:
        if "what" in r and r["what"] != "engine_compiles":
            exact = f"{r['engine_exact_ms']:9.2f} {r['pallas_over_exact']:12.2f}" if "engine_exact_ms" in r else \
                f"{'-':>9} {'-':>12}"
            log(f"{r['length']:>7} {r['what']:<15} {r['xla_ms']:9.2f} {r['pallas_ms']:10.2f} {r['speedup']:8.2f} "
                f"{exact} {r['rel_logit_diff']:9.2e}")
    report = dict(device=str(jax.devices()[0]), shape="small" if args.small else f"35B-A3B x{args.layers} layers",
                  rungs=rungs, docs=args.docs, rows=rows,
                  programs={impl: e.programs.report() for impl, e in engines.items()})
    log(json.dumps(rows))
    write_json(args.json, report)


if __name__ == "__main__":
    main()
