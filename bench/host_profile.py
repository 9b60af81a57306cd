"""Where the scheduler loop's host time goes: the loop driven on this thread under cProfile, a batch of streamed
requests at once, and the functions that take its time, ranked by their own time.

The device's work shows under the calls that wait for it (`Sampled.ids`, `numpy.asarray` of a device array) or,
where the backend runs programs on the calling thread, under the calls that issue them; the rest is the host's
own work (planning, layouts, sampling arrays, detokenization, delivering events). Runs on any backend; on the CPU
the "device" shares the cores with the host, so the split is the GPU's only roughly.

    python bench/host_profile.py                     # the embedded model, float32, 16 requests of 32 tokens
    python bench/host_profile.py --overlap --requests 32 --json out.json
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time

import numpy as np

from common import write_json

from hypic_jax.checkpoint.embedded import require_embedded_model
from hypic_jax.engine import Engine, SamplingParams
from hypic_jax.engine.scheduler import Request, Scheduler


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--doc-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--overlap", action="store_true")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    engine = Engine.from_pretrained(require_embedded_model(), dtype="float32", max_prompt_tokens=512,
                                    token_rungs=(512,), max_new_tokens=args.max_tokens, max_batch=args.max_batch,
                                    cache_bytes=1 << 26, compile_cache="none")
    engine.warmup(progress=False)
    vocab = engine.vocab_size
    rng = np.random.default_rng(0)
    pool = [rng.integers(3, min(vocab, 4000), args.doc_tokens).tolist() for _ in range(4 * args.docs)]

    def requests(salt):
        done, out = [], []
        for k in range(args.requests):
            docs = [pool[i] for i in rng.choice(len(pool), args.docs, replace=False)]
            segments = docs + [rng.integers(3, min(vocab, 4000), 16).tolist()]
            params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
            out.append(Request(segments, params, lambda e, d=done: e["type"] != "delta" and d.append(e),
                               mode="transition_rope_recompute", seam=8, cache_salt=salt, tokenizer=engine.tokenizer))
        return out, done

    scheduler = Scheduler(engine, overlap=args.overlap, max_queue=10_000)
    warm, warm_done = requests("warm")  # the cache's entries and the loop's first rounds, untimed
    for request in warm:
        scheduler.submit(request)
    while len(warm_done) < len(warm):
        scheduler._iterate()
    batch, done = requests("warm")  # the same documents: every one a cache hit
    for request in batch:
        scheduler.submit(request)
    profile = cProfile.Profile()
    steps = scheduler.steps
    start = time.perf_counter()
    profile.enable()
    while len(done) < len(batch):
        scheduler._iterate()
    profile.disable()
    wall = time.perf_counter() - start
    stats = pstats.Stats(profile)
    rows = sorted(((v[2], v[3], f"{k[0].split('/')[-1]}:{k[1]}({k[2]})") for k, v in stats.stats.items()),
                  reverse=True)[:args.top]
    tokens = sum(len(r.tokens) for r in batch)
    report = dict(overlap=args.overlap, requests=args.requests, wall_s=round(wall, 3), steps=scheduler.steps - steps,
                  tokens=tokens, tokens_per_s=round(tokens / wall, 1),
                  top=[dict(function=name, own_s=round(own, 4), total_s=round(total, 4)) for own, total, name in rows])
    print(f"{args.requests} requests, {tokens} tokens in {wall:.2f} s ({tokens / wall:.0f} tokens/s), "
          f"{report['steps']} steps, overlap={args.overlap}")
    print(f"{'own s':>8} {'total s':>8}  function")
    for own, total, name in rows:
        print(f"{own:>8.3f} {total:>8.3f}  {name}")
    print(json.dumps(report))
    write_json(args.json, report)
    engine.close()


if __name__ == "__main__":
    main()
