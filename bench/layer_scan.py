"""The engine's span programs with the repeating layers as one scan (`layer_stack`) against every layer unrolled:
compile time per program, results and warm request times.

Two parts, one process:

  check     a Qwen3.5 model of the 35B-A3B widths at `--check-layers` layers (random weights, `--check-dtype`):
            engines with the layers unrolled and scanned (and each `--impls` linear path), warmed on the check
            rung; per prompt length, full_recompute, a cold and a warm transition_rope_recompute request: ms
            (median of `--repeats`), the largest relative logit difference to the unrolled XLA engine, and
            full_recompute's to the model's own full prefill (`arch.prefill`, an independent implementation)
  compile   the same widths at `--layers` layers, weights stacked in place (`engine.stack_layers(consume=True)`,
            so one copy fits): per `--impls` path, each span program of each `--rungs` rung and the batched
            decode programs of `--max-batch` rows (the cache's allocation, the insert into a row and the step of
            each batch bucket) compiled one at a time (seconds each); then the warm requests of the check part at
            the longest length and the decode step (ms per token of a greedy `generate`), with the model's own
            full prefill of the same prompt compiled at its exact length beside it

    python bench/layer_scan.py                          # H200: 8 layers checked, 40 compiled, rungs 1024 16384
    python bench/layer_scan.py --small                  # CPU smoke run (toy widths)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from common import (compile_programs, full_config, log, max_rel, median_seconds, small_config, split_prompt,
                    write_json)

from hypic_jax.engine import Engine, KernelOptions, backend_compiles, stack_layers
from hypic_jax.models import stack as layer_stack, qwen3_5
from hypic_jax.models.base import Model


def split(rng, length: int, vocab: int, docs: int, query: int) -> list[list[int]]:
    """A random prompt of `length` tokens as `docs` documents and a `query`-token query."""
    return split_prompt(rng, rng.integers(3, vocab, length).tolist(), docs, query)


def requests(engine, segs, seam, repeats):
    """ms of full_recompute, cold trr and warm trr, and their logits."""
    out, logits = {}, {}
    out["full_recompute"], r = median_seconds(lambda: engine.prefill(segs, mode="full_recompute"), repeats)
    logits["full_recompute"] = r.logits

    def cold():
        engine.clear_cache()
        return engine.prefill(segs, mode="transition_rope_recompute", seam=seam)

    out["trr_cold"], r = median_seconds(cold, repeats)
    logits["trr_cold"] = r.logits
    out["trr_warm"], r = median_seconds(lambda: engine.prefill(segs, mode="transition_rope_recompute", seam=seam),
                                        repeats)
    assert r.stats.misses == 0, r.stats
    logits["trr_warm"] = r.logits
    return {k: round(1e3 * v, 2) for k, v in out.items()}, logits


def decode_ms(engine, segs, new_tokens: int, repeats: int) -> float | None:
    """ms per step of the decode program: a greedy `generate` of `new_tokens` tokens after a warm request (its
    `decode_s`, median of `repeats` after one untimed run)."""
    if new_tokens < 2:
        return None
    run = lambda: engine.generate(segs, max_new_tokens=new_tokens, mode="transition_rope_recompute")  # noqa: E731
    run()
    steps = [run() for _ in range(repeats)]
    return round(1e3 * float(np.median([r.decode_s / (len(r.tokens) - 1) for r in steps])), 3)


def exact_prefill(model, kernels=None):
    """The whole prompt through the model's own prefill (`arch.prefill`), compiled at its exact length: the last
    position's logits."""
    kernels = kernels or KernelOptions()
    fn = jax.jit(lambda params, tokens: model.arch.prefill(params, model.config, tokens, tokens.shape[1],
                                                           kernels=kernels)[0])
    return lambda segs: np.asarray(fn(model.params, np.concatenate(segs)[None].astype(np.int32))[0])


def engine_for(model, rungs, args, impl, scan, *, new_tokens=0, max_batch=1):
    return Engine(model, max_prompt_tokens=rungs[-1], max_segments=args.docs, token_rungs=tuple(rungs),
                  max_new_tokens=new_tokens, cache_bytes=int(args.cache_gb * (1 << 30)), eviction="lru",
                  kernels=KernelOptions(linear=impl, scan_layers=scan),
                  mean_entry_tokens=max(16, rungs[-1] // args.docs), max_batch=max_batch, compile_cache="none")


SPAN_KINDS = ("pic", "plain", "cold")
# a step per batch bucket (the largest first: it chooses the decode cache's layouts, which the others take), the
# batched decode cache's allocation, a row's insert
DECODE_KINDS = ("batch", "slots", "insert")


def compile_one_by_one(engine, rungs) -> dict:
    keys = [k for k in engine.programs.keys_for(rungs[-1]) if k.kind in SPAN_KINDS + ("commit",)]
    decode = [k for k in engine.programs.keys_for(rungs[-1]) if k.kind in DECODE_KINDS]
    keys += sorted(decode, key=lambda k: (DECODE_KINDS.index(k.kind), -k.tokens))
    seconds = {}
    for key in keys:
        start = time.perf_counter()
        engine.programs.compile([key], progress=False)
        seconds[f"{key.kind}@{key.tokens}"] = round(time.perf_counter() - start, 2)
        log(f"  {key.kind}@{key.tokens}: {seconds[f'{key.kind}@{key.tokens}']} s")
    engine.programs.serving = True
    return seconds


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--check-layers", type=int, default=8)
    parser.add_argument("--check-dtype", default=None, help="the check model's dtype (default: bfloat16 on a GPU)")
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--rungs", type=int, nargs="+", default=None)
    parser.add_argument("--check-rungs", type=int, nargs="+", default=None)
    parser.add_argument("--lengths", type=int, nargs="+", default=None)
    parser.add_argument("--impls", nargs="+", default=["xla", "pallas"])
    parser.add_argument("--docs", type=int, default=16)
    parser.add_argument("--query", type=int, default=64)
    parser.add_argument("--seam", type=float, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache-gb", type=float, default=4.0)
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens of the compile part's decode timing")
    parser.add_argument("--max-batch", type=int, default=1,
                        help="rows of the batched decode cache (its step programs: one per batch bucket)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["check", "compile", "exact"])
    parser.add_argument("--bank-max-elements", type=int, default=None,
                        help="store expert banks past this size in chunks (the check model's are below 2^31)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.bank_max_elements:
        layer_stack.BANK_MAX_ELEMENTS = args.bank_max_elements

    if args.small:
        make = lambda n: (dataclasses.replace(small_config(), layer_types=qwen3_5.default_layer_types(n),  # noqa
                                              mlp_types=("moe",) * n), jnp.float32)
        args.check_layers, args.layers = min(args.check_layers, 8), min(args.layers, 8)
        rungs, check_rungs = args.rungs or [256, 512], args.check_rungs or [512]
        lengths = args.lengths or [400]
        args.docs, args.query, args.cache_gb = min(args.docs, 4), min(args.query, 16), min(args.cache_gb, 0.0625)
    else:
        make = lambda n: (full_config(n), jnp.bfloat16)  # noqa: E731
        rungs, check_rungs = args.rungs or [1024, 16384], args.check_rungs or [16384]
        lengths = args.lengths or [4096, 11000]
    report = dict(device=str(jax.devices()[0]), check_layers=args.check_layers, layers=args.layers, rungs=rungs,
                  check_rungs=check_rungs, lengths=lengths, docs=args.docs, impls=args.impls,
                  bank_max_elements=layer_stack.BANK_MAX_ELEMENTS)
    rng = np.random.default_rng(0)

    def save():  # after every part, so a run cut short still leaves what it measured
        write_json(args.json, report)

    if "check" not in args.skip:
        config, dtype = make(args.check_layers)
        dtype = jnp.dtype(args.check_dtype) if args.check_dtype else dtype
        model = Model(qwen3_5, config, qwen3_5.init_params(config, jax.random.key(0), dtype))
        stacked = stack_layers(model)  # one stacked copy, shared by the scanned engines
        exact_reference = exact_prefill(model)
        variants = [("xla", False)] + [(impl, True) for impl in args.impls]
        engines = {}
        for impl, scan in variants:
            name = f"{impl}/{'scan' if scan else 'unrolled'}"
            engine = engine_for(stacked if scan else model, check_rungs, args, impl, scan)
            log(f"[check {name}] plan {engine.plan}")
            count, wall, detail = compile_programs(engine, check_rungs[-1], SPAN_KINDS + ("commit",))
            log(f"[check {name}] {count} programs in {wall:.1f} s wall: {detail}")
            engines[name] = engine
        rows = []
        for length in lengths:
            if length > check_rungs[-1]:
                continue
            segs = split(rng, length, config.vocab_size, args.docs, args.query)
            exact = exact_reference(segs)
            before = backend_compiles()
            results = {name: requests(e, segs, args.seam, args.repeats) for name, e in engines.items()}
            reference = results["xla/unrolled"][1]
            for name, (ms, logits) in results.items():
                row = dict(part="check", length=length, engine=name, ms=ms,
                           rel_diff={k: float(f"{max_rel(logits[k], reference[k]):.3g}") for k in logits},
                           full_recompute_vs_engine=float(f"{max_rel(logits['full_recompute'], exact):.3g}"))
                rows.append(row)
                log(json.dumps(row))
            log(f"compiles while timing: {backend_compiles() - before}")
        report["check"] = rows
        save()
        for engine in engines.values():
            engine.close()
        del engines, engine, model, stacked, results, exact_reference
        gc.collect()  # engines and their programs reference each other: free their weights and pools now

    if "compile" not in args.skip:
        config, dtype = make(args.layers)
        start = time.perf_counter()
        model = Model(qwen3_5, config, qwen3_5.init_params(config, jax.random.key(1), dtype))
        model = stack_layers(model, consume=True)
        jax.block_until_ready(model.params)
        log(f"[compile] {args.layers} layers, weights stacked by {model.params['layers'].plan} in "
            f"{time.perf_counter() - start:.1f} s")
        report["plan"] = str(model.params["layers"].plan)
        length = max(x for x in lengths if x <= rungs[-1])
        segs = split(rng, length, config.vocab_size, args.docs, args.query)
        compiled, timing = {}, {}
        for impl in args.impls:
            engine = engine_for(model, rungs, args, impl, True, new_tokens=args.new_tokens, max_batch=args.max_batch)
            log(f"[compile {impl}] one program at a time:")
            compiled[impl] = compile_one_by_one(engine, rungs)
            before = backend_compiles()
            ms, _ = requests(engine, segs, args.seam, args.repeats)
            ms["decode_per_token"] = decode_ms(engine, segs, args.new_tokens, args.repeats)
            timing[impl] = dict(length=length, ms=ms, compiles_while_timing=backend_compiles() - before)
            log(f"[compile {impl}] length {length}: {ms}")
            report["compile_s"], report["timing"] = compiled, timing
            save()
            engine.close()
            del engine
            gc.collect()
        report["compile_s"], report["timing"] = compiled, timing
        if "exact" not in args.skip:
            exact = exact_prefill(model)
            start = time.perf_counter()
            exact(segs)
            first = time.perf_counter() - start
            exact_s, _ = median_seconds(lambda: exact(segs), args.repeats)
            report["exact"] = dict(length=length, first_s=round(first, 1), ms=round(1e3 * exact_s, 2),
                                   padded_over_exact={impl: round(t["ms"]["full_recompute"] / (1e3 * exact_s), 3)
                                                      for impl, t in timing.items()})
            log(f"[exact] {report['exact']}")
    log(json.dumps(report))
    save()


if __name__ == "__main__":
    main()
