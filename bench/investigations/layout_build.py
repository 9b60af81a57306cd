"""Host time of `layout.build` for one all-cached trr request of the 32-document RAG trace's shape: 32 documents of
log-uniform lengths 200 to 1,200 tokens, each a fresh seam of 8 tokens and a cached interior, then a 64-token
query, at the 35B-A3B engine's `pic` capacity (512 fresh tokens, 68 pieces, 20,480 keys, 33 records, chunks of 16,
conv width 4). Also times `layout.pack`. Prints the mean ms per call over 200 calls.

    python -m bench.investigations.layout_build
"""
import time

import numpy as np

from hypic_jax.stitch import layout as lay

rng = np.random.default_rng(0)
spans, seam = [], 8
for doc in range(32):
    length = int(np.exp(rng.uniform(np.log(200), np.log(1200))))
    spans.append(lay.Span(lay.FRESH, seam))
    spans.append(lay.Span(lay.CACHED, length - seam, canonical_start=seam, slot=doc,
                          kv_rows=np.arange(length - seam, dtype=np.int32) + doc * 1200))
spans.append(lay.Span(lay.FRESH, 64))
fresh = sum(s.length for s in spans if s.kind == lay.FRESH)
capacity = lay.Capacity(tokens=512, pieces=68, keys=20480, records=33, chunk=16, conv=3)
tokens = np.zeros(fresh, np.int32)


def timed(fn, calls=200):
    for _ in range(5):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


build = lambda: lay.build(spans, capacity, isolated=False, tokens=tokens, summaries=True)  # noqa: E731
arrays = build()
print(f"layout.build: {timed(build):.3f} ms; layout.pack: {timed(lambda: lay.pack(arrays)):.3f} ms "
      f"({len(spans)} spans, {fresh} fresh tokens)")
