"""The batched decode step of the engine: time per step against the batch bucket, and the floor.

    python bench/decode_step.py                 # the Qwen3.5-35B-A3B shape, random bf16 weights (GPU)
    python bench/decode_step.py --small         # CPU smoke size
    python bench/decode_step.py --fp8           # the projections and experts in block-wise FP8
    python bench/decode_step.py --fp8 --serving-pools 64   # and the entry pools a 64-row engine derives beside them
    python bench/decode_step.py --profile-dir DIR --profile-rows 16   # one traced step (bench/trace_summary.py)
    python bench/decode_step.py --few-query-rows 4 0   # decode attention in the cache layout, then as matmuls
    python bench/decode_step.py --slot-layouts default auto   # the decode cache row-major, then in the layouts
                                                              # the compiler picks (KernelOptions.slot_layouts)
    python bench/decode_step.py --moe-copy-blocks 0 64   # the routed experts' copies sorted by expert at every
                                                         # bucket, then one block per copy up to 64 copies
    python bench/decode_step.py --fused-prefill 16 768 64   # per bucket, a step and the admission of a stitched
                        # request of 16 cached documents of 768 tokens and a 64-token query (seam 8): the programs
                        # apart, then in one program (`Engine.slot_decode_and_prefill`)

A server's decode throughput is rows / step time; `bench/serve.py` finds the transition_rope_recompute server
decode-bound. Each bucket's program (`Engine.slot_decode`, the one the server runs) steps rows [0, b) of the
batched cache, every row at `--length` cached tokens. The floor column is the bytes a step must read once: every
parameter outside the routed experts, the routed experts that at least one row picks (uniform routing, expected
count E (1 - (1 - 1/E)^(b k))) and each row's decode caches, at `--bandwidth` GB/s. Compilations are counted:
after warmup there must be none. Every variant steps the same rows from the same state, so the digest of all the
ids it sampled (`ids_sha1`) is equal across variants exactly when they decode alike.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from common import full_config, random_model, small_config, write_json

from hypic_jax.core import attention
from hypic_jax.engine import Engine, KernelOptions, backend_compiles
from hypic_jax.engine.programs import ProgramKey
from hypic_jax.engine.sampling import SamplingRows
from hypic_jax.kernels import grouped_matmul as gm


def expert_bytes(params) -> tuple[int, int]:
    """(bytes of the routed experts, bytes of everything else)."""
    routed = other = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = [str(getattr(p, "key", getattr(p, "name", ""))) for p in path]
        if any(n in ("gate_up", "down") for n in names):
            routed += leaf.size * leaf.dtype.itemsize
        else:
            other += leaf.size * leaf.dtype.itemsize
    return routed, other


def measure(args, model, config, label: str, slot_layouts: str = "auto") -> dict:
    """Compile the batch programs of a new engine over `model`, time a step per bucket, profile if asked."""
    engine = Engine(model, max_prompt_tokens=args.length, max_new_tokens=64, max_batch=args.max_batch,
                    kernels=KernelOptions(slot_layouts=slot_layouts), cache_bytes=1 << 28,
                    token_rungs=(args.length,), compile_cache="none")
    keys = [ProgramKey("batch", b, engine.max_keys) for b in engine.batch_buckets]
    start = time.perf_counter()
    engine.programs.compile(keys)
    engine._slot_cache()
    compile_s = time.perf_counter() - start
    engine.programs.serving = True
    routed, other = expert_bytes(engine.params)
    experts, top_k = config.num_experts, config.num_experts_per_tok
    cache_row = sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(engine.slot_shapes())) / args.max_batch
    before = backend_compiles()
    rows_out, digest = [], hashlib.sha1()
    print(label)
    print(f"{'rows':>5} {'step ms':>8} {'floor ms':>8} {'tok/s':>8} {'of floor':>8}")
    for b in engine.batch_buckets:
        sampling = SamplingRows.build([0.0] * b, [1.0] * b, [0] * b, list(range(b)), [0] * b)
        tokens = np.arange(3, 3 + b, dtype=np.int32)
        lengths = np.full(b, args.length - 1, np.int32)
        out = engine.slot_decode(tokens, lengths, sampling)
        digest.update(np.asarray(out.ids).tobytes())
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            out = engine.slot_decode(tokens, lengths, sampling)
            ids = np.asarray(out.ids)  # the server reads the sampled ids back every step
            times.append(time.perf_counter() - t)
            digest.update(ids.tobytes())
        step = float(np.median(times))
        touched = experts * (1 - (1 - 1 / experts) ** (b * top_k))
        floor = (other + routed * touched / experts + b * cache_row) / (args.bandwidth * 1e9)
        rows_out.append(dict(rows=b, step_ms=round(1e3 * step, 3), floor_ms=round(1e3 * floor, 3),
                             tokens_per_s=round(b / step, 1)))
        print(f"{b:>5} {1e3 * step:>8.2f} {1e3 * floor:>8.2f} {b / step:>8.1f} {floor / step:>8.2f}", flush=True)
    report = dict(variant=label, device=str(jax.devices()[0]), weights="fp8" if args.fp8 else str(jnp.dtype(model.dtype)),
                  shape="small" if args.small else f"35B-A3B x{args.layers}", length=args.length,
                  compile_s=round(compile_s, 1), compiles_after_warmup=backend_compiles() - before,
                  routed_gb=round(routed / 1e9, 2), other_gb=round(other / 1e9, 2),
                  cache_mb_per_row=round(cache_row / 1e6, 1), steps=rows_out, ids_sha1=digest.hexdigest())
    print(f"compile {compile_s:.1f} s, compilations after warmup {report['compiles_after_warmup']}, "
          f"ids sha1 {report['ids_sha1'][:16]}", flush=True)
    if args.profile_dir:
        for b in args.profile_rows:
            sampling = SamplingRows.build([0.0] * b, [1.0] * b, [0] * b, list(range(b)), [0] * b)
            tokens, lengths = np.arange(3, 3 + b, dtype=np.int32), np.full(b, args.length - 1, np.int32)
            name = label.replace("=", "").replace(" ", "_")
            with jax.profiler.trace(f"{args.profile_dir}/{name}_rows{b}", create_perfetto_trace=True):
                with jax.profiler.TraceAnnotation(f"decode rows{b}"):
                    np.asarray(engine.slot_decode(tokens, lengths, sampling).ids)
    engine.clear_cache()
    engine.close()
    engine._slots = None  # the next variant's engine gets the memory
    del engine
    gc.collect()
    return report


def measure_fused(args, model) -> dict:
    """Per batch bucket of two rows or more: the step alone, then the step with one admission (a stitched PIC
    request whose documents are all cached, into the bucket's last row) run apart (`prefill`, `slot_decode`,
    `slot_insert`) and fused (`slot_decode_and_prefill`); medians of `--steps`, each reading every sampled id."""
    docs, doc_tokens, query_tokens = args.fused_prefill
    rng = np.random.default_rng(0)
    segments = [rng.integers(3, 1000, doc_tokens).tolist() for _ in range(docs)]
    segments.append(rng.integers(3, 1000, query_tokens).tolist())
    prompt = docs * doc_tokens + query_tokens
    fresh = docs * min(8, doc_tokens) + query_tokens
    # the entry pools as the engine derives them (a share of the device memory beside the weights); fused programs
    # allowed at every rung (only the one holding the admission's fresh tokens is compiled)
    engine = Engine(model, max_prompt_tokens=max(args.length, prompt), max_segments=docs, max_batch=args.max_batch,
                    max_new_tokens=64, compile_cache="none", seam=8, fused_prefill_tokens=max(args.length, prompt))
    fused_rung = engine.ladder.rung(fresh)
    assert fused_rung in engine.fused_rungs, (fused_rung, engine.fused_rungs)
    start = time.perf_counter()
    first = engine.prefill(segments)  # the documents' entries (cold), then the stitched program
    assert first.stats.hits == 0 and engine.prefill(segments).stats.misses == 0
    buckets = [b for b in engine.batch_buckets if b >= 2]
    engine.programs.compile([ProgramKey(kind, b, engine.max_keys) for b in buckets for kind in ("batch",)]
                            + [ProgramKey("fused", fused_rung, engine.max_keys, b) for b in buckets]
                            + [ProgramKey("insert", 1, engine.max_keys)], progress=False)
    engine._slot_cache()
    compile_s = time.perf_counter() - start
    engine.programs.serving = True
    before = backend_compiles()
    one = SamplingRows.build([0.0], [1.0], [0], [0], [0])
    rows, digests = [], {"apart": hashlib.sha1(), "fused": hashlib.sha1()}
    print(f"fused admissions: {docs} documents x {doc_tokens} + {query_tokens}, {fresh} fresh tokens (rung "
          f"{fused_rung})")
    print(f"{'rows':>5} {'step ms':>8} {'apart ms':>9} {'fused ms':>9} {'saved ms':>9} {'of prefill':>10}")
    for b in buckets:
        sampling = SamplingRows.build([0.0] * b, [1.0] * b, [0] * b, list(range(b)), [0] * b)
        tokens = np.arange(3, 3 + b, dtype=np.int32)
        lengths = np.full(b, args.length - 1, np.int32)

        def step():
            return np.asarray(engine.slot_decode(tokens, lengths, sampling).ids), None

        def apart():
            pre = engine.prefill(segments)
            ids = engine.slot_decode(tokens, lengths, sampling)
            return np.asarray(ids.ids), np.asarray(engine.slot_insert(b - 1, pre, one).ids)

        def fused():
            ids, first_id, _ = engine.slot_decode_and_prefill(tokens, lengths, sampling, segments, b - 1, one)
            return np.asarray(ids.ids), np.asarray(first_id.ids)

        times = {}
        for name, fn in (("step", step), ("apart", apart), ("fused", fused)):
            engine._slots = None  # from zeros, so that both ways step the same rows from the same states
            out = fn()
            if name in digests:
                digests[name].update(out[0][:b - 1].tobytes() + out[1].tobytes())
            samples = []
            for _ in range(args.steps):
                t = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t)
            times[name] = float(np.median(samples))
        saved = times["apart"] - times["fused"]
        prefill = times["apart"] - times["step"]
        rows.append(dict(rows=b, **{f"{k}_ms": round(1e3 * v, 3) for k, v in times.items()}))
        print(f"{b:>5} {1e3 * times['step']:>8.2f} {1e3 * times['apart']:>9.2f} {1e3 * times['fused']:>9.2f} "
              f"{1e3 * saved:>9.2f} {saved / prefill if prefill > 0 else float('nan'):>10.2f}", flush=True)
    same = digests["apart"].hexdigest() == digests["fused"].hexdigest()
    report = dict(docs=docs, doc_tokens=doc_tokens, query_tokens=query_tokens, fresh_tokens=fresh,
                  fused_rung=fused_rung, compile_s=round(compile_s, 1),
                  compiles_after_warmup=backend_compiles() - before, same_ids=same, buckets=rows)
    print(f"compile {compile_s:.1f} s, compilations after warmup {report['compiles_after_warmup']}, the same ids "
          f"apart and fused: {same}", flush=True)
    engine.close()
    return report


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=4096, help="cached tokens of every row")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--bandwidth", type=float, default=4800.0, help="GB/s of the floor (H200: 4.8 TB/s peak)")
    parser.add_argument("--profile-dir", default=None)
    parser.add_argument("--profile-rows", type=int, nargs="*", default=[16])
    parser.add_argument("--few-query-rows", type=int, nargs="*", default=None,
                        help="attention.FEW_QUERY_ROWS per variant, timed one after the other in this process (0: "
                             "every decode attention as batched matrix products); default: attention.FEW_QUERY_ROWS")
    parser.add_argument("--slot-layouts", nargs="*", default=["auto"], choices=["default", "auto"],
                        help="KernelOptions(slot_layouts=...) per variant (each with every --few-query-rows)")
    parser.add_argument("--moe-copy-blocks", type=int, nargs="*", default=None, metavar="COPIES",
                        help="grouped_matmul.layout.COPY_BLOCKS_MAX per variant (0: the copies sorted by expert at "
                             "every bucket); default: its value")
    parser.add_argument("--fp8", action="store_true", help="the projections and experts in block-wise FP8")
    parser.add_argument("--serving-pools", type=int, default=None, metavar="ROWS",
                        help="afterwards, the entry pools an engine of ROWS decode rows (max_prompt_tokens "
                             "--length) derives from the device memory left beside these weights")
    parser.add_argument("--fused-prefill", type=int, nargs=3, default=None, metavar=("DOCS", "TOKENS", "QUERY"),
                        help="afterwards, a step with one admission of DOCS cached documents of TOKENS tokens and a "
                             "QUERY-token query, apart and fused (LimitOptions.fused_prefill_tokens); with "
                             "--fused-only, without the buckets' step table")
    parser.add_argument("--fused-only", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    config, dtype = (small_config(), jnp.float32) if args.small else (full_config(args.layers), jnp.bfloat16)
    if args.small:
        args.length = min(args.length, 200)
    model = random_model(config, dtype, fp8=args.fp8)
    variants = args.few_query_rows if args.few_query_rows else [attention.FEW_QUERY_ROWS]
    reports = []
    copy_blocks = args.moe_copy_blocks if args.moe_copy_blocks else [gm.layout.COPY_BLOCKS_MAX]
    for slot_layouts in ([] if args.fused_only else args.slot_layouts or ["auto"]):
        for few in variants:
            for copies in copy_blocks:
                attention.FEW_QUERY_ROWS = few  # both read when the programs are traced
                gm.layout.COPY_BLOCKS_MAX = copies
                label = (f"few_query_rows={attention.few_query_rows()} slot_layouts={slot_layouts} "
                         f"moe_copy_blocks={copies}")
                reports.append(measure(args, model, config, label=label, slot_layouts=slot_layouts))
    report = reports[0] if len(reports) == 1 else dict(variants=reports)
    report = dict(report, device=str(jax.devices()[0]), shape="small" if args.small else f"35B-A3B x{args.layers}")
    if args.fused_prefill:
        report["fused_prefill"] = measure_fused(args, model)
    if args.serving_pools:
        engine = Engine(model, max_batch=args.serving_pools, max_prompt_tokens=args.length, compile_cache="none")
        stats = jax.devices()[0].memory_stats() or {}
        report["serving_pools"] = dict(rows=args.serving_pools, pool_gb=round(engine.pools.nbytes / 2**30, 2),
                                       device_in_use_gb=round(stats.get("bytes_in_use", 0) / 2**30, 2),
                                       device_limit_gb=round(stats.get("bytes_limit", 0) / 2**30, 2))
        print("serving pools:", report["serving_pools"])
        engine.close()
    print(json.dumps(report))
    write_json(args.json, report)


if __name__ == "__main__":
    main()
