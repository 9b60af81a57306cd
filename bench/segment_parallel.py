"""Segment-parallel cold prefill (`Engine(devices=N, policy=...)`) against the number of devices.

A cold request (every document missing from the cache) of `--segments` documents, uniform (`--segment-len` tokens
each) and skewed (log-normal lengths of the same total), plus a query, served in `transition_rope_recompute`. For
each device count of 2 or more that this process has (2, 4, 8 by default) and each policy (`lpt`, `rr`) an engine
with that mesh serves the request `--repeats` times, its cache cleared before each; the plain single-device cold
path is the baseline (an engine of one device runs no mesh: `devices=1` is that path). Reported per run: median TTFT
(cold prefill over the mesh with each bin's records written into its own device's pools, the copies of the entries
to the home device and the stitched program), the same phases timed one after the other in one more run (`phases`:
each waited for, so they do not overlap as in the timed runs), the bins' token counts, and per bin the cost model's
prediction against the bin measured alone on one device (the single-device cold program on that bin's segments). The
cost model is calibrated once (`SegmentMesh.calibrate`, single-device cold prefills of the plain engine) and shared
by every engine.

    python bench/segment_parallel.py --small     # CPU: a tiny model on 8 forced host devices (they share the cores)
    python bench/segment_parallel.py             # the 35B-A3B shape, random bf16 weights, on the GPUs present
    python bench/segment_parallel.py --tensor-parallel 2   # every engine but the baseline split over 2 devices

Programs compile on first use (an untimed first run of each case), not through `warmup`, so that only the rungs a
case needs are compiled.
"""

from __future__ import annotations

import os
import sys

if "--small" in sys.argv:  # the host device count is read when JAX starts
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in _flags:
        os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from hypic_jax.stitch import layout as lay  # noqa: E402
from hypic_jax.parallel import policy as parallel  # noqa: E402
from hypic_jax.engine import Engine, backend_compiles  # noqa: E402
from hypic_jax.parallel.segments import SegmentMesh  # noqa: E402


def requests(vocab: int, segments: int, length: int, query: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    total = segments * length
    skew = rng.lognormal(0.0, 1.0, segments)
    skewed = np.maximum(8, np.floor(skew / skew.sum() * total)).astype(int)
    skewed[np.argmax(skewed)] -= skewed.sum() - total  # the same total as the uniform case
    out = {}
    for name, lengths in (("uniform", [length] * segments), ("skewed", skewed.tolist())):
        docs = [rng.integers(3, vocab, int(n)).tolist() for n in lengths]
        out[name] = docs + [rng.integers(3, vocab, query).tolist()]
    return out


def bin_alone(engine: Engine, docs, seconds_repeats: int) -> float:
    """The single-device cold program on these segments (recording nothing): the bin's own time."""
    spans = [lay.Span(lay.FRESH, len(d)) for d in docs]
    tokens = [t for d in docs for t in d]
    best = float("inf")
    for attempt in range(seconds_repeats + 1):
        start = time.perf_counter()
        logits, _ = engine._run("cold", spans, tokens)
        jax.block_until_ready(logits)
        if attempt:  # the first run of a program pays one-time costs
            best = min(best, time.perf_counter() - start)
    return best


def serve(engine: Engine, request, repeats: int) -> dict:
    engine.clear_cache()
    engine.prefill(request)  # compiles what this case needs; untimed
    before = backend_compiles()
    ttft = []
    for _ in range(repeats):
        engine.clear_cache()
        ttft.append(engine.prefill(request).stats.ttft_s)  # the logits are on the host: the request is done
    return dict(ttft_s=round(statistics.median(ttft), 6), compiles_while_timed=backend_compiles() - before)


def phases(engine: Engine, request) -> dict:
    """One more cold run of `request`, stopped after each phase to time it (so its phases do not overlap as they
    do in the timed runs): the mesh program with each bin's records written into its device's pools, the copies
    of the entries to the home device written into its pools, and the rest (planning and the stitched program)."""
    mesh, times = engine.segment_mesh, {}
    run, finish = mesh.run, engine._finish_promotions

    def timed_run(*args, **kwargs):
        start = time.perf_counter()
        out = run(*args, **dict(kwargs, timed=True))  # waits for every device's pools
        times["mesh_s"] = time.perf_counter() - start
        return out

    def timed_finish():
        start = time.perf_counter()
        finish()
        jax.block_until_ready(engine.pools.arrays)
        times["copies_home_s"] = times.get("copies_home_s", 0.0) + time.perf_counter() - start

    mesh.run, engine._finish_promotions = timed_run, timed_finish
    try:
        engine.clear_cache()
        start = time.perf_counter()
        engine.prefill(request)
        total = time.perf_counter() - start
    finally:
        del mesh.run, engine._finish_promotions  # the methods again
    times["rest_s"] = total - sum(times.values())
    times["phased_total_s"] = total
    return {k: round(v, 6) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny model on 8 forced CPU host devices")
    parser.add_argument("--layers", type=int, default=40, help="layers of the 35B-A3B shape (full size)")
    parser.add_argument("--segments", type=int, default=None)
    parser.add_argument("--segment-len", type=int, default=None)
    parser.add_argument("--query", type=int, default=64)
    parser.add_argument("--devices", type=int, nargs="+", default=[2, 4, 8],
                        help="mesh sizes (1: the plain cold path, which the baseline rows measure)")
    parser.add_argument("--policies", nargs="+", default=["lpt", "rr"], choices=parallel.POLICIES)
    parser.add_argument("--tensor-parallel", type=int, default=None, metavar="M",
                        help="split the model over the first M devices in every engine but the single-device "
                             "baseline (Engine(tensor_parallel=M)), and add a row of that engine without "
                             "a segment mesh")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache-gb", type=float, default=None,
                        help="each engine's pool budget (default: 16 MiB small, 12 GiB full; at most two engines "
                             "hold pools at once)")
    parser.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                        help="keep the cost model's default constants (no compile of every rung; enough for one "
                             "device, where the plan is one bin)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    args = parser.parse_args()

    if args.small:
        from hypic_jax.demo import tiny_model

        model = tiny_model()
        segments, length = args.segments or 16, args.segment_len or 64
        query = min(args.query, 32)
        rungs = (128, 256, 512, 1088)
        cache_bytes = int((args.cache_gb or 1 / 64) * 2**30)
    else:
        from common import full_config, random_model


        config = full_config(args.layers)
        model = random_model(config, jnp.bfloat16)  # every engine here shares its weights
        segments, length = args.segments or 64, args.segment_len or 512
        query = args.query
        rungs = None
        cache_bytes = int((args.cache_gb or 12) * 2**30)
    total = segments * length + query
    available = len(jax.devices())
    counts = [n for n in args.devices if 2 <= n <= available]
    if 1 in args.devices:
        print("one device: the plain cold path (an engine of one device runs no mesh); see the baseline rows",
              flush=True)
    base = dict(max_prompt_tokens=total, max_segments=segments, max_new_tokens=8, max_batch=1, token_rungs=rungs,
                min_tokens=128, ladder="fine", cache_bytes=cache_bytes, mean_entry_tokens=length, seam=8,
                eviction="lru", compile_cache="none")
    cases = requests(int(model.config.vocab_size), segments, length, query, args.seed)

    plain = Engine(model, **base)
    report = dict(device=str(jax.devices()[0]), devices_available=available,
                  shape="tiny (demo)" if args.small else f"35B-A3B x{args.layers} layers", segments=segments,
                  segment_len=length, query=query, rows=[])
    cost = parallel.SegmentCost()
    if args.calibrate:  # single-device cold prefills through the plain engine's programs
        top = plain.ladder.rung(max(sum(map(len, r[:-1])) for r in cases.values()))
        SegmentMesh(plain, 1, cost=cost).calibrate([r for r in plain.ladder.rungs if r <= top])
    report["cost"] = cost.as_dict()
    print(json.dumps(dict(cost=report["cost"])), flush=True)

    split = dict(tensor_parallel=args.tensor_parallel) if args.tensor_parallel else {}
    report["tensor_parallel"] = args.tensor_parallel
    for name, request in cases.items():
        row = dict(case=name, devices=0, policy="plain", **serve(plain, request, args.repeats))
        report["rows"].append(row)
        print(json.dumps(row), flush=True)
    if split:
        engine = Engine(model, **base, **split)
        for name, request in cases.items():
            row = dict(case=name, devices=0, policy="plain", **split, **serve(engine, request, args.repeats))
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
        engine.close()
        del engine
        gc.collect()
    shared: dict[int, tuple] = {}
    for n in counts:
        for policy in args.policies:
            engine = Engine(model, **base, devices=n, policy=policy, **split)
            if not split:  # the single-device programs are shared: same shapes and placement
                engine.programs = plain.programs
            mesh = engine.segment_mesh
            mesh.cost = cost
            if n in shared:
                mesh._cold, mesh._commit = shared[n]
            for name, request in cases.items():
                row = dict(case=name, devices=n, policy=policy, **split, **serve(engine, request, args.repeats))
                fetched = mesh.pools.stats.fetches if mesh.pools is not None else 0
                row["phases"] = phases(engine, request)
                if mesh.pools is not None:  # beside a model split the records come back gathered instead
                    row["phases"]["entries_copied_home"] = mesh.pools.stats.fetches - fetched
                docs = request[:-1]
                bins = mesh.plan([len(d) for d in docs])
                row["bins_tokens"] = [sum(len(docs[i]) for i in b) for b in bins]
                row["predicted_s"] = [round(cost.bin_seconds([len(docs[i]) for i in b]), 6) for b in bins]
                row["measured_alone_s"] = [round(bin_alone(plain, [docs[i] for i in b], args.repeats), 6)
                                           if b else 0.0 for b in bins]
                report["rows"].append(row)
                print(json.dumps(row), flush=True)
            shared[n] = (mesh._cold, mesh._commit)
            engine.close()
            del engine, mesh
            gc.collect()
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
