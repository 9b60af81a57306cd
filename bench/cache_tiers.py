"""Cache tiers and eviction policies of the engine on a Zipf RAG trace whose corpus overflows the device.

A corpus of documents of log-uniform lengths; each request takes `--docs` of them by Zipf popularity (exponent
`--zipf`), in random order, plus a fresh query, served in `transition_rope_recompute` with a seam of `--seam`
tokens. The device budget is `--device-frac` of the bytes the whole corpus's entries take in the pools, the host
tier `--host-frac` of it, the disk unbounded (a temporary folder). For each tier setting (device only, + host,
+ host + disk) and each policy (`lru`, `cost`) a fresh engine runs the same trace; then a new engine on the disk
folder replays it (a restart). Reported per run: entry hit rate, cached share of document tokens, cold-prefilled
tokens, the seconds spent planning and cold-prefilling (`cold_s`: the recompute the cache did not save, plus
promotions), p50 TTFT, promotions per tier, and the cost model's constants.

With `--forms`, instead: per stored form (`FORMS`: exact; every float32 piece in bfloat16; and also without the
dense T heads whose largest |entry| is at most 0 or 1e-3, `tier_transfer_tol`) the bytes per segment token the host
tier holds and the share of T heads stored, for the model with its own gates and with its linear layers' decay
slowed to `--decay` per token (so that T carries weight, as the engine tests do), and the relative L2 deviation
of the last logits of requests served from the promoted entries against the same requests on the device entries.

With `--load-times N ...`, instead: per document length, the TTFT of a request of that document plus a short
query when the document is missing, cached on the device, in the host tier and on disk, and the copies alone.

    python bench/cache_tiers.py --small            # CPU size
    python bench/cache_tiers.py --small --forms    # compact entries
    python bench/cache_tiers.py --small --load-times
    python bench/cache_tiers.py                    # Qwen3.5-35B-A3B shape, random bf16 weights (GPU)
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from common import full_config, random_model, small_config, write_json

from hypic_jax.cache import tiers as tr
from hypic_jax.engine import Engine, backend_compiles
from hypic_jax.models import qwen3_5
from hypic_jax.models.base import Model
from hypic_jax.cache.pools import Pools


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


def run(engine: Engine, requests, seam: int) -> dict:
    before = backend_compiles()
    hits = misses = cached = doc_tokens = cold = 0
    cold_s, ttft, all_hit = 0.0, [], []
    start = time.perf_counter()
    for segs in requests:
        result = engine.prefill(segs, seam=seam)
        s = result.stats
        hits, misses, cached, cold = hits + s.hits, misses + s.misses, cached + s.cached_tokens, cold + s.cold_tokens
        doc_tokens += sum(len(d) - min(seam, len(d)) for d in segs[:-1])
        cold_s += s.cold_s
        ttft.append(s.ttft_s)
        all_hit.append(s.misses == 0)
    wall = time.perf_counter() - start
    tiers = engine.stats["tiers"]
    ttft, all_hit = np.asarray(ttft), np.asarray(all_hit)
    p50 = lambda x: round(float(np.percentile(x, 50)) * 1e3, 2) if len(x) else None  # noqa: E731
    return dict(hit_rate=round(hits / max(1, hits + misses), 3),
                cached_token_share=round(cached / max(1, doc_tokens), 3),
                cold_tokens=cold, cold_s=round(cold_s, 3), p50_ttft_ms=p50(ttft),
                all_hit_share=round(float(all_hit.mean()), 3), p50_ttft_all_hit_ms=p50(ttft[all_hit]),
                p50_ttft_with_miss_ms=p50(ttft[~all_hit]),
                trace_s=round(wall, 2), promotions=tiers["promotions"], demotions=tiers["demotions"],
                corrupt=tiers["disk"]["corrupt"] if tiers["disk"] else 0, compiles=backend_compiles() - before,
                cost=[float(f"{c:.3g}") for c in tiers["cost"]["constants"]], host_memory=tiers["host_memory"],
                tier_s=tiers["seconds"])


def slow_decay(params, decay: float):
    """Every linear layer's A_log set to log(decay): random-init gates forget within a few tokens, so T would be
    nearly zero and its rounding would not show. Works on stacked layers too; every other leaf is shared."""
    found = []

    def visit(path, leaf):
        if getattr(path[-1], "key", None) == "A_log":
            found.append(path)
            return jnp.full_like(leaf, np.log(decay))
        return leaf

    out = jax.tree_util.tree_map_with_path(visit, params)
    if not found:
        raise ValueError("the parameters have no A_log to slow")
    return out


def entry_bytes_per_token(layout, tokens: int, compact: bool, seam: int = 0, transfer_kept: float = 1.0) -> float:
    """Bytes of one entry off the device (a `pool_layout`'s pieces; every float32 piece halved when compact, a
    dense T's heads kept in the share `transfer_kept`) of a segment of `tokens` tokens whose first `seam` are
    recomputed at reuse (not stored), per token of the segment."""
    total = 0.0
    for kind, tree in layout:
        dense = tr.dense_transfer_leaves(tree)
        for flag, leaf in zip(dense, jax.tree.leaves(tree)):
            size = int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
            if compact and leaf.dtype == jnp.float32:
                size //= 2
            if flag and kind == "slot":
                size *= transfer_kept
            total += size if kind == "slot" else size * (tokens - seam)
    return total / tokens


# (name, tier_dtype, tier_transfer_tol) of the stored forms compared by --forms
FORMS = (("exact", None, None), ("bfloat16", "bfloat16", None), ("bfloat16+t<=0", "bfloat16", 0.0),
         ("bfloat16+t<=1e-3", "bfloat16", 1e-3))


def forms(models, requests, base, seam: int, layers: int) -> dict:
    """Per stored form and per model (name -> Model: the same shapes, so one engine's programs serve all): the
    bytes per segment token the host tier holds, the share of dense T heads stored, and the relative L2
    deviation of the last logits of requests served from promoted entries against the same requests on the
    device entries."""
    layout = qwen3_5.pool_layout(full_config(layers), jnp.bfloat16)
    out = dict(shape_35b_analytic=dict(
        exact=round(entry_bytes_per_token(layout, 512, False)),
        bfloat16=round(entry_bytes_per_token(layout, 512, True)),
        bfloat16_no_transfer=round(entry_bytes_per_token(layout, 512, True, transfer_kept=0.0))))
    donors = {}  # the engines' programs, and the copy programs of each way of storing pieces, compiled once
    for model_name, model in models.items():
        for name, dtype, tol in FORMS:
            engine = Engine(model, **base, host_cache_bytes=1 << 40, tier_dtype=dtype, tier_transfer_tol=tol,
                            eviction="lru")
            storage = (tuple(engine.mover.leaves), engine.mover.droppable)
            if donors:
                engine.programs._compiled.update(next(iter(donors.values())).programs._compiled)
            if storage in donors:
                engine.mover.adopt(donors[storage].mover)
            engine.warmup(progress=False)
            donors.setdefault(storage, engine)
            deviations, stored, tokens, heads = [], 0, 0, [0, 0]
            for segs in requests:
                engine.clear_cache()
                engine.prefill(segs, seam=seam)
                warm = engine.prefill(segs, seam=seam)
                engine.demote_all()
                held = engine.tiers.host.values()
                stored += sum(p.nbytes for p in held)
                tokens += sum(p.length for p in held)
                for p in held:
                    for j, flag in enumerate(engine.mover.droppable):
                        if flag:
                            heads[0] += len(p.kept[j])
                            heads[1] += engine.mover.leaves[j][1][0]
                back = engine.prefill(segs, seam=seam)
                a, b = np.asarray(back.logits, np.float64), np.asarray(warm.logits, np.float64)
                deviations.append(float(np.linalg.norm(a - b) / np.linalg.norm(b)))
            row = dict(model=model_name, form=name, bytes_per_token=round(stored / max(tokens, 1), 1),
                       transfer_heads_stored=round(heads[0] / heads[1], 4) if heads[1] else None,
                       max_rel_logit_deviation=float(f"{max(deviations):.3g}"),
                       median_rel_logit_deviation=float(f"{np.median(deviations):.3g}"))
            engine.close()  # its compiled programs stay with the donors
            out.setdefault("measured", []).append(row)
            print(json.dumps(row), flush=True)
    return out


def load_times(engine: Engine, vocab: int, lengths, seam: int, repeats: int = 3) -> list[dict]:
    """Per segment length: the TTFT of a request of that one document plus a 16-token query when the document is
    missing (recomputed), on the device, in the host tier and on disk, and the copies alone (demote: what an
    eviction costs the request that causes it, the copy issued; demote_total: until the entry is in the host tier;
    disk read: the file read with its checks). `engine` has a host tier and a disk folder. Medians of
    `repeats`."""
    rng = np.random.default_rng(1)

    def demote() -> tuple[float, float]:
        """Seconds until the eviction returns (what a request waits), and until the entry is in the host tier."""
        start = time.perf_counter()
        engine.demote_all(sync=False)
        issued = time.perf_counter() - start
        engine.sync_tiers()
        return issued, time.perf_counter() - start

    rows = []
    for n in lengths:
        samples = {key: [] for key in ("miss", "device", "host", "disk", "demote", "demote_total", "disk_read")}
        for _ in range(repeats):
            engine.clear_cache(disk=True)
            segs = [rng.integers(3, vocab, n).tolist(), rng.integers(3, vocab, 16).tolist()]
            samples["miss"].append(engine.prefill(segs, seam=seam).stats.ttft_s)
            samples["device"].append(engine.prefill(segs, seam=seam).stats.ttft_s)
            issued, total = demote()
            samples["demote"].append(issued)
            samples["demote_total"].append(total)
            (pieces,) = engine.tiers.host.values()
            assert engine.persist() == 1
            samples["host"].append(engine.prefill(segs, seam=seam).stats.ttft_s)
            demote()
            engine.tiers.host.clear()
            start = time.perf_counter()
            assert engine.tiers.disk.take(pieces.key, pieces.tokens) is not None
            samples["disk_read"].append(time.perf_counter() - start)
            before = engine.stats["tiers"]["promotions"]["disk"]
            result = engine.prefill(segs, seam=seam)
            assert result.stats.hits == 1 and engine.stats["tiers"]["promotions"]["disk"] == before + 1
            samples["disk"].append(result.stats.ttft_s)
        row = dict(tokens=n, entry_mb=round(pieces.nbytes / 2**20, 2),
                   **{f"{key}_ms": round(1e3 * float(np.median(v)), 2) for key, v in samples.items()})
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


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
    parser.add_argument("--decay", type=float, default=0.05, help="--forms: the slowed model's per-token decay")
    parser.add_argument("--forms-requests", type=int, default=20, help="--forms: requests per form and model")
    parser.add_argument("--tier-dtype", default=None, choices=[None, "bfloat16"],
                        help="the trace's and --load-times' engines store entries off the device in this form")
    parser.add_argument("--transfer-tol", type=float, default=None,
                        help="... and without the dense T heads whose largest |entry| is at most this")
    parser.add_argument("--load-times", type=int, nargs="*", default=None,
                        help="instead: TTFT of one document of each of these lengths missing, on the device, in "
                             "the host tier and on disk")
    parser.add_argument("--devices", type=int, default=1,
                        help="the engines' devices (Engine(devices=N)); above 1 the trace also runs with a "
                             "peer tier on the other devices")
    parser.add_argument("--peer-frac", type=float, default=0.3,
                        help="the peer tier's budget, as a share of the corpus's entry bytes over all other devices")
    parser.add_argument("--host-memory", nargs="+", default=["pinned"], choices=list(tr.HOST_MEMORY),
                        help="where the host tier keeps entries; several: the trace's host-tier runs once per kind")
    parser.add_argument("--demote-copy", nargs="+", default=["program"], choices=["program", "thread"],
                        help="who copies a demoted entry to pinned host memory (`tiers.Mover.DEMOTE_COPY`); "
                             "several: the trace's host-tier runs once per choice")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    if args.small:
        config, dtype = small_config(), jnp.float32
        args.requests, args.corpus = min(args.requests, 60), min(args.corpus, 64)
        args.min_len, args.max_len, args.docs = 16, 192, min(args.docs, 4)
    else:
        config, dtype = full_config(args.layers), jnp.bfloat16
    # the layers stacked once (`consume`: no second copy of the weights), as every engine here runs them
    model = random_model(config, dtype)
    documents, requests = trace(config.vocab_size, corpus=args.corpus, requests=args.requests, docs=args.docs,
                                min_len=args.min_len, max_len=args.max_len, zipf=args.zipf, seed=args.seed)
    layout = qwen3_5.pool_layout(config, dtype)
    probe = Pools(layout, slots=2, pages=2)
    corpus_bytes = sum(probe.entry_bytes(len(d) - args.seam) for d in documents)
    longest = max(sum(map(len, r)) for r in requests)
    mean_tokens = int(np.mean([len(d) for d in documents]))
    rungs = tuple(args.rungs) if args.rungs else ((256, 1024) if args.small else None)
    # prefill only: one decode row, no room for new tokens; the ladder from 64 tokens in fine steps on any backend
    base = dict(max_prompt_tokens=max(longest, max(rungs or (0,))), token_rungs=rungs, max_segments=args.docs,
                max_new_tokens=0, max_batch=1, min_tokens=64, ladder="fine", compile_cache="none",
                cache_bytes=int(args.device_frac * corpus_bytes), mean_entry_tokens=mean_tokens)
    host_bytes = int(args.host_frac * corpus_bytes)
    peer_bytes = int(args.peer_frac * corpus_bytes / max(1, args.devices - 1)) if args.devices > 1 else 0
    if args.devices > 1:
        base["devices"] = args.devices  # every run: the same cold path over the mesh
    shape = "small" if args.small else f"35B-A3B x{args.layers} layers"
    if args.forms:
        models = {"own gates": model,
                  f"decay {args.decay:g}": Model(qwen3_5, config, slow_decay(model.params, args.decay))}
        picked = requests[: args.forms_requests]
        report = dict(device=str(jax.devices()[0]), shape=shape, requests=len(picked), decay=args.decay,
                      **forms(models, picked, base, args.seam, args.layers))
        print(json.dumps(report, indent=1))
        write_json(args.json, report)
        return
    if args.load_times is not None:
        lengths = args.load_times or ([32, 128, 512] if args.small else [128, 512, 2048, 8192])
        top = max(lengths) + 16
        with tempfile.TemporaryDirectory() as root:
            engine = Engine(model, max_prompt_tokens=top, max_segments=1, max_new_tokens=0, max_batch=1,
                            min_tokens=64, ladder="fine", compile_cache="none",
                            cache_bytes=1 << (27 if args.small else 32), mean_entry_tokens=top,
                            token_rungs=tuple(args.rungs) if args.rungs else None, host_cache_bytes=1 << 40,
                            disk_cache_dir=root, eviction="lru", tier_dtype=args.tier_dtype,
                            tier_transfer_tol=args.transfer_tol, host_memory=args.host_memory[0])
            before = backend_compiles()
            warm = engine.warmup(progress=False)
            compiled = backend_compiles()
            rows = load_times(engine, config.vocab_size, lengths, args.seam)
            report = dict(device=str(jax.devices()[0]), shape=shape, seam=args.seam, rows=rows,
                          form=tr.compact_form(args.tier_dtype, args.transfer_tol),
                          warmup_programs=warm.get("programs"), warmup_compiles=compiled - before,
                          compiles_while_measuring=backend_compiles() - compiled,
                          bandwidths=dict(host=engine.bandwidths.host, disk=engine.bandwidths.disk))
            engine.close()
        print(json.dumps(report, indent=1))
        write_json(args.json, report)
        return
    report = dict(device=str(jax.devices()[0]), shape=shape, corpus=len(documents),
                  corpus_entry_mb=round(corpus_bytes / 2**20, 2), requests=len(requests),
                  docs_per_request=args.docs, zipf=args.zipf, longest_prompt=longest, rungs=list(rungs or ()),
                  device_mb=round(base["cache_bytes"] / 2**20, 2), host_mb=round(host_bytes / 2**20, 2),
                  devices=args.devices, peer_mb_per_device=round(peer_bytes / 2**20, 2),
                  form=tr.compact_form(args.tier_dtype, args.transfer_tol), runs=[])

    donor = None
    with tempfile.TemporaryDirectory() as root:
        def engine(demote_copy="program", **options):
            nonlocal donor
            tr.Mover.DEMOTE_COPY = demote_copy
            try:
                made = Engine(model, **base, **options, tier_dtype=args.tier_dtype,
                              tier_transfer_tol=args.transfer_tol)
            finally:
                tr.Mover.DEMOTE_COPY = "program"
            if donor is not None:  # the same pool shapes: the first engine's compiled programs serve every engine
                made.programs._compiled.update(donor.programs._compiled)
                made.mover.adopt(donor.mover)
            made.warmup(progress=False)
            donor = donor or made
            return made

        kinds = args.host_memory
        # the host tier's variants: where entries live, and for pinned memory who copies them there
        hosts = [(k, c) for k in kinds for c in (args.demote_copy if k == "pinned" else ["program"])]
        def named(name, kind, copy):
            tags = ([kind] if len(kinds) > 1 else []) + ([f"copy by {copy}"] if len(args.demote_copy) > 1
                                                          and kind == "pinned" else [])
            return f"{name} ({', '.join(tags)})" if tags else name

        peer = [("device+peer", dict(peer_cache_bytes=peer_bytes)),
                ("device+peer+host", dict(peer_cache_bytes=peer_bytes, host_cache_bytes=host_bytes,
                                          host_memory=kinds[0]))] if peer_bytes else []
        settings = ([("device", {})] + peer
                    + [(named("device+host", k, c), dict(host_cache_bytes=host_bytes, host_memory=k,
                                                         demote_copy=c)) for k, c in hosts]
                    + [(named("device+host+disk", k, c), dict(host_cache_bytes=host_bytes, host_memory=k,
                                                              demote_copy=c)) for k, c in hosts])
        for name, options in settings:
            for policy in args.policies:
                if "disk" in name:
                    options = dict(options, disk_cache_dir=str(
                        Path(root) / f"{policy}-{options['host_memory']}-{options['demote_copy']}"))
                made = engine(eviction=policy, **options)
                row = dict(tiers=name, eviction=policy, **run(made, requests, args.seam))
                if made.tiers.disk is not None:
                    row["persisted"] = made.persist()  # a graceful shutdown writes what the disk lacks
                made.close()  # its compiled programs stay with the donor
                report["runs"].append(row)
                print(json.dumps(row), flush=True)
        for policy in args.policies:  # a new process on the disk folder: the trace again, from the disk
            restarted = engine(eviction=policy, host_cache_bytes=host_bytes, host_memory=kinds[0],
                               disk_cache_dir=str(Path(root) / f"{policy}-{kinds[0]}-{hosts[0][1]}"),
                               demote_copy=hosts[0][1])
            row = dict(tiers="restart on the disk", eviction=policy, **run(restarted, requests, args.seam))
            restarted.close()
            report["runs"].append(row)
            print(json.dumps(row), flush=True)
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}))
    write_json(args.json, report)


if __name__ == "__main__":
    main()
