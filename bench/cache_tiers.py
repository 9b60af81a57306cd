"""Cache tiers and eviction policies of the shape-stable engine on a Zipf RAG trace whose corpus overflows the device.

A corpus of documents of log-uniform lengths; each request takes `--docs` of them by Zipf popularity (exponent
`--zipf`), in random order, plus a fresh query, served in `transition_rope_recompute` with a seam of `--seam`
tokens. The device budget is `--device-frac` of the bytes the whole corpus's entries take in the pools, the host
tier `--host-frac` of it, the disk unbounded (a temporary folder). For each tier setting (device only, + host,
+ host + disk) and each policy (`lru`, `cost`) a fresh engine runs the same trace; then a new engine on the disk
folder replays it (a restart). Reported per run: entry hit rate, cached share of document tokens, cold-prefilled
tokens, the seconds spent planning and cold-prefilling (`cold_s`: the recompute the cache did not save, plus
promotions), p50 TTFT, promotions per tier, and the cost model's constants.

With `--forms`, instead: the bytes per token of an entry stored exactly and with `tier_dtype="bfloat16"` (T and S
in bfloat16 off the device), measured on the model through the host tier and computed for the 35B-A3B shape at
512 tokens, and the relative L2 deviation of the last logits of requests served from promoted bfloat16 entries
against the same requests on the exact entries (the linear layers' decay is slowed to `--decay` per token, as the
engine tests do, so that T carries weight).

    python bench/cache_tiers.py --small            # CPU size
    python bench/cache_tiers.py --small --forms    # compact entries
    python bench/cache_tiers.py                    # Qwen3.5-35B-A3B shape, random bf16 weights (GPU)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prefill import full_config, small_config  # noqa: E402

from hypic_jax.models import qwen3_5  # noqa: E402
from hypic_jax.models.base import Model  # noqa: E402
from hypic_jax.pools import Pools  # noqa: E402
from hypic_jax.runtime import StableEngine, backend_compiles  # noqa: E402


def trace(vocab: int, *, corpus: int, requests: int, docs: int, min_len: int, max_len: int, zipf: float, seed: int):
    rng = np.random.default_rng(seed)
    lengths = np.exp(rng.uniform(np.log(min_len), np.log(max_len), corpus)).astype(int)
    documents = [rng.integers(3, vocab, n).tolist() for n in lengths]
    weights = 1.0 / np.arange(1, corpus + 1) ** zipf
    weights /= weights.sum()
    out = []
    for _ in range(requests):
        picked = rng.choice(corpus, size=min(docs, corpus), replace=False, p=weights)
        out.append([documents[i] for i in picked] + [rng.integers(3, vocab, int(rng.integers(8, 33))).tolist()])
    return documents, out


def run(engine: StableEngine, requests, seam: int) -> dict:
    before = backend_compiles()
    hits = misses = cached = doc_tokens = cold = 0
    cold_s, ttft = 0.0, []
    start = time.perf_counter()
    for segs in requests:
        result = engine.prefill(segs, seam=seam)
        s = result.stats
        hits, misses, cached, cold = hits + s.hits, misses + s.misses, cached + s.cached_tokens, cold + s.cold_tokens
        doc_tokens += sum(len(d) - min(seam, len(d)) for d in segs[:-1])
        cold_s += s.cold_s
        ttft.append(s.ttft_s)
    wall = time.perf_counter() - start
    tiers = engine.stats["tiers"]
    return dict(hit_rate=round(hits / max(1, hits + misses), 3),
                cached_token_share=round(cached / max(1, doc_tokens), 3),
                cold_tokens=cold, cold_s=round(cold_s, 3), p50_ttft_ms=round(float(np.percentile(ttft, 50)) * 1e3, 2),
                trace_s=round(wall, 2), promotions=tiers["promotions"], demotions=tiers["demotions"],
                corrupt=tiers["disk"]["corrupt"] if tiers["disk"] else 0, compiles=backend_compiles() - before,
                cost=[float(f"{c:.3g}") for c in tiers["cost"]["constants"]])


def slow_decay(params, decay: float):
    """Every linear layer's A_log set to log(decay): random-init gates forget within a few tokens, so T would be
    nearly zero and its rounding would not show."""

    def visit(tree):
        if isinstance(tree, dict):
            return {k: (jnp.full_like(v, np.log(decay)) if k == "A_log" else visit(v)) for k, v in tree.items()}
        if isinstance(tree, (list, tuple)):
            return type(tree)(visit(v) for v in tree)
        return tree

    return visit(params)


def entry_bytes_per_token(layout, tokens: int, compact: bool, seam: int = 0) -> float:
    """Bytes of one entry off the device (a `pool_layout`'s pieces; float32 summaries halved when compact) of a
    segment of `tokens` tokens whose first `seam` are recomputed at reuse (not stored), per token of the
    segment."""
    total = 0
    for kind, tree in layout:
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            size = int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
            if compact and kind == "slot" and leaf.dtype == jnp.float32 and any(
                    getattr(part, "key", None) == "summary" for part in path):
                size //= 2
            total += size if kind == "slot" else size * (tokens - seam)
    return total / tokens


def forms(model, config, requests, base, seam: int, layers: int) -> dict:
    out = dict(shape_35b=dict(
        (name, round(entry_bytes_per_token(qwen3_5.pool_layout(full_config(layers), jnp.bfloat16), 512, compact)))
        for name, compact in (("exact", False), ("bfloat16", True))))
    logits, rows = {}, []
    for form in (None, "bfloat16"):
        engine = StableEngine(model, **base, host_cache_bytes=1 << 40, tier_dtype=form)
        engine.warmup(progress=False)
        deviations, tokens = [], 0
        for segs in requests:
            engine.clear_cache()
            engine.prefill(segs, seam=seam)
            warm = engine.prefill(segs, seam=seam)
            with engine._device_lock:
                while engine.cache.evict_one():
                    pass
            stored = engine.stats["tiers"]["host"]["bytes"]
            tokens = sum(len(d) - min(seam, len(d)) for d in segs[:-1])
            back = engine.prefill(segs, seam=seam)
            a, b = np.asarray(back.logits, np.float64), np.asarray(warm.logits, np.float64)
            deviations.append(float(np.linalg.norm(a - b) / np.linalg.norm(b)))
            rows.append(dict(form=form or "exact", bytes_per_token=round(stored / tokens, 1)))
        logits[form or "exact"] = dict(max_rel_logit_deviation=float(f"{max(deviations):.3g}"),
                                       median_rel_logit_deviation=float(f"{np.median(deviations):.3g}"),
                                       bytes_per_token=round(float(np.mean([r["bytes_per_token"] for r in rows
                                                                            if r["form"] == (form or "exact")])), 1))
    out["model"] = logits
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="toy model (CPU size)")
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--corpus", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=128)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--zipf", type=float, default=0.9)
    parser.add_argument("--seam", type=int, default=8)
    parser.add_argument("--device-frac", type=float, default=0.2)
    parser.add_argument("--host-frac", type=float, default=0.3)
    parser.add_argument("--policies", nargs="+", default=["lru", "cost"])
    parser.add_argument("--rungs", type=int, nargs="+", default=None, help="explicit token rungs (the last >= the "
                        "longest prompt; --small: 256 1024) instead of the geometric ladder from 64")
    parser.add_argument("--forms", action="store_true", help="bytes per token and logit deviation of compact entries")
    parser.add_argument("--decay", type=float, default=0.05, help="--forms: the linear layers' per-token decay")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    if args.small:
        config, dtype = small_config(), jnp.float32
        args.requests, args.corpus = min(args.requests, 60), min(args.corpus, 64)
        args.min_len, args.max_len, args.docs = 16, 192, min(args.docs, 4)
    else:
        config, dtype = full_config(args.layers), jnp.bfloat16
    model = Model(qwen3_5, config, qwen3_5.init_params(config, jax.random.key(0), dtype))
    documents, requests = trace(config.vocab_size, corpus=args.corpus, requests=args.requests, docs=args.docs,
                                min_len=args.min_len, max_len=args.max_len, zipf=args.zipf, seed=args.seed)
    layout = qwen3_5.pool_layout(config, dtype)
    probe = Pools(layout, slots=2, pages=2)
    corpus_bytes = sum(probe.entry_bytes(len(d) - args.seam) for d in documents)
    longest = max(sum(map(len, r)) for r in requests)
    mean_tokens = int(np.mean([len(d) for d in documents]))
    rungs = tuple(args.rungs) if args.rungs else ((256, 1024) if args.small else None)
    base = dict(max_prompt_tokens=max(longest, max(rungs or (0,))), token_rungs=rungs, max_segments=args.docs,
                max_new_tokens=0,
                cache_bytes=int(args.device_frac * corpus_bytes), mean_entry_tokens=mean_tokens)
    host_bytes = int(args.host_frac * corpus_bytes)
    if args.forms:
        slow = Model(qwen3_5, config, slow_decay(model.params, args.decay))
        report = dict(device=str(jax.devices()[0]), shape="small" if args.small else f"35B-A3B x{args.layers} layers",
                      requests=len(requests[:20]), decay=args.decay,
                      **forms(slow, config, requests[:20], base, args.seam, args.layers))
        print(json.dumps(report, indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
        return
    report = dict(device=str(jax.devices()[0]), shape="small" if args.small else f"35B-A3B x{args.layers} layers",
                  corpus=len(documents), corpus_entry_mb=round(corpus_bytes / 2**20, 2), requests=len(requests),
                  docs_per_request=args.docs, zipf=args.zipf, longest_prompt=longest, rungs=list(rungs or ()),
                  device_mb=round(base["cache_bytes"] / 2**20, 2), host_mb=round(host_bytes / 2**20, 2), runs=[])

    donor = None
    with tempfile.TemporaryDirectory() as root:
        def engine(**options):
            nonlocal donor
            made = StableEngine(model, **base, **options)
            if donor is not None:  # the same pool shapes: the first engine's compiled programs serve every engine
                made.programs._compiled.update(donor.programs._compiled)
                made.mover._gather.update(donor.mover._gather)
                made.mover._scatter.update(donor.mover._scatter)
            made.warmup(progress=False)
            donor = donor or made
            return made

        settings = [("device", {}), ("device+host", dict(host_cache_bytes=host_bytes)),
                    ("device+host+disk", dict(host_cache_bytes=host_bytes))]
        for name, options in settings:
            for policy in args.policies:
                if name.endswith("disk"):
                    options = dict(options, disk_cache_dir=str(Path(root) / policy))
                made = engine(eviction=policy, **options)
                row = dict(tiers=name, eviction=policy, **run(made, requests, args.seam))
                if made.tiers.disk is not None:
                    row["persisted"] = made.persist()  # a graceful shutdown writes what the disk lacks
                report["runs"].append(row)
                print(json.dumps(row), flush=True)
        for policy in args.policies:  # a new process on the disk folder: the trace again, from the disk
            restarted = engine(eviction=policy, host_cache_bytes=host_bytes, disk_cache_dir=str(Path(root) / policy))
            row = dict(tiers="restart on the disk", eviction=policy, **run(restarted, requests, args.seam))
            report["runs"].append(row)
            print(json.dumps(row), flush=True)
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
