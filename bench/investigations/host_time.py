"""The host's part of a stitched request's time to first token: what `Engine.prefill` does before the program
is dispatched, step by step, for an all-cached trr request of the headline's layout (64 documents of 512 tokens,
seams of 8, a 32 to 96-token query, the 768-token rung and 33,792 keys). The model is the small one of
`bench/common.py` (the host's work does not depend on the widths); the engine is warmed and every document cached
first. Prints the mean ms per call of each step over `--repeats` runs: the token ids (`engine.reader`), the 64 cache
keys (SHA-256), the 64 lookups, the whole plan, the layout (`layout.build`) and its packing, then the packed
vector's size.

    python3 -m bench.investigations.host_time [--repeats 200]
"""
import argparse
import dataclasses
import time

import jax.numpy as jnp

from bench.common import rag_requests, random_model, small_config

from hypic_jax.cache import index as cache_keys
from hypic_jax.stitch import layout as lay
from hypic_jax.engine import Engine
from hypic_jax.engine.programs import ProgramKey

parser = argparse.ArgumentParser()
parser.add_argument("--repeats", type=int, default=200)
args = parser.parse_args()

config = small_config()
model = random_model(config, jnp.float32, scan=True)
requests = rag_requests(config.vocab_size, corpus=64, requests=6, docs=64, min_len=200, max_len=1200, seed=0,
                        fixed_len=512)
engine = Engine(model, max_prompt_tokens=33792, max_segments=65, cache_bytes=1 << 30, max_new_tokens=0, max_batch=1,
                token_rungs=(768, 2048, 32768, 33792), compile_cache="none")
engine.prefill(requests[0])  # compiles, caches every document
engine.prefill(requests[1])
request, seam, mode = requests[5], 8, "transition_rope_recompute"


def timed(name, fn):
    for _ in range(5):
        fn()
    start = time.perf_counter()
    for _ in range(args.repeats):
        fn()
    print(f"{name:24s} {(time.perf_counter() - start) / args.repeats * 1e3:.3f} ms", flush=True)


ids = engine.reader(request)
docs = ids[:-1]
keys = [cache_keys.entry_key(d, fingerprint=engine.fingerprint, kind="pic", seam=seam, salt=None) for d in docs]


def lookups():
    with engine.cache.pinned() as pins:
        return [engine.hierarchy.find(k, d, pins, kind="pic", seam=seam) for k, d in zip(keys, docs)]


def plan():
    with engine.cache.pinned() as pins, engine.hierarchy.request():
        return engine._plan(mode, ids, seam, None, pins, sum(map(len, ids)))


planned = plan()
capacity = engine.capacity(ProgramKey("pic", 768, engine.max_keys))
build = lambda: lay.build(planned.spans, capacity, isolated=False, tokens=planned.fresh,  # noqa: E731
                          summaries=True)
arrays = build()
timed("token ids", lambda: engine.reader(request))
timed("cache keys (SHA-256)", lambda: [cache_keys.entry_key(d, fingerprint=engine.fingerprint, kind="pic", seam=seam,
                                                             salt=None) for d in docs])
timed("lookups", lookups)
timed("plan (keys and lookups)", plan)
timed("layout.build", build)
timed("layout.pack", lambda: lay.pack(arrays))
fields = sum(getattr(arrays, f.name).nbytes // getattr(arrays, f.name).itemsize for f in dataclasses.fields(arrays))
print(f"packed layout            {lay.pack(arrays).nbytes / 1e3:.0f} KB ({4 * fields / 1e3:.0f} KB as one int32 per "
      f"field entry; capacity {capacity})", flush=True)
