"""Where the copies of the cache tiers spend their time, outside the engine's request path.

    python -m bench.investigations.tier_copies --demotion [--layers 8]   # GPU: the 35B-A3B shape, random weights
    python -m bench.investigations.tier_copies --checksums [--mb 41]     # any machine

--demotion: one demotion of a 512- and a 1,024-token entry taken apart, exact and compact (bfloat16, T heads at
most 0 left out): the gather program's dispatch, `copy_to_host_async` on its outputs, waiting for them, the host
copy, the host-side slicing (`Mover.gather_finish`), and `Engine.demote_all` with and without waiting
(ms; three 512-token entries, then one of 1,024).
--checksums: a disk file's payload checksum as one serial BLAKE2b and as `tiers.payload_digests` (4 MB slices on a
pool of threads), GB/s over random bytes in 2 MB pieces (one per layer's S or T) and as one piece.
"""

from __future__ import annotations

import argparse
import os
import time


def demotion(layers: int) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from bench.common import full_config, random_model

    from hypic_jax.engine import Engine

    config = full_config(layers)
    model = random_model(config, jnp.bfloat16)
    for dtype, tol in ((None, None), ("bfloat16", 0.0)):
        engine = Engine(model, max_prompt_tokens=1040, max_segments=1, max_new_tokens=0, max_batch=1,
                        cache_bytes=1 << 31, mean_entry_tokens=1040, token_rungs=(528, 1040), host_cache_bytes=1 << 40,
                        eviction="lru", tier_dtype=dtype, tier_transfer_tol=tol, compile_cache="none")
        engine.warmup(progress=False)
        rng = np.random.default_rng(0)
        for n in (512, 512, 512, 1024):
            segs = [rng.integers(3, config.vocab_size, n).tolist(), [5, 6, 7]]
            engine.prefill(segs)
            engine.prefill(segs)
            entry = next(iter(engine.cache.entries()))
            arrays = engine._pool_arrays()
            marks = [time.perf_counter()]
            out, length = engine.mover.gather_start(arrays, entry.slot, entry.rows)
            marks.append(time.perf_counter())
            for a in jax.tree.leaves(out):
                a.copy_to_host_async()
            marks.append(time.perf_counter())
            jax.block_until_ready(out)
            marks.append(time.perf_counter())
            jax.device_get(out)
            marks.append(time.perf_counter())
            engine.mover.gather_finish((out, length))
            marks.append(time.perf_counter())
            engine.demote_all(sync=False)
            marks.append(time.perf_counter())
            engine.sync_tiers()
            marks.append(time.perf_counter())
            names = ("dispatch", "copy_to_host_async", "ready", "device_get", "finish", "demote_all", "sync")
            row = {name: round(1e3 * (b - a), 2) for name, a, b in zip(names, marks, marks[1:])}
            print(dict(form=dtype or "exact", tokens=n,
                       mb=round(sum(a.nbytes for a in jax.tree.leaves(out)) / 2**20, 1), **row), flush=True)
        engine.close()


def checksums(mb: int) -> None:
    import hashlib

    from hypic_jax.cache.tiers import payload_digests

    data = os.urandom(mb << 20)
    pieces = [memoryview(data)[i: i + (2 << 20)] for i in range(0, len(data), 2 << 20)]
    for _ in range(2):  # the second round is reported (the thread pool is up)
        times = []
        for run in (lambda: hashlib.blake2b(data, digest_size=32).hexdigest(), lambda: payload_digests(pieces),
                    lambda: payload_digests([memoryview(data)])):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
    gbs = [round(mb / 1024 / t, 2) for t in times]
    print(dict(mb=mb, cpus=os.cpu_count(), serial_gbs=gbs[0], per_piece_gbs=gbs[1], one_piece_gbs=gbs[2]))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--demotion", action="store_true")
    parser.add_argument("--checksums", action="store_true")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--mb", type=int, default=41)
    args = parser.parse_args(argv)
    if not (args.demotion or args.checksums):
        parser.error("give --demotion and/or --checksums")
    if args.checksums:
        checksums(args.mb)
    if args.demotion:
        demotion(args.layers)


if __name__ == "__main__":
    main()
