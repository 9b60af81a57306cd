"""What handing a request's packed layout to a program costs, by the vector's size.

A stitched request passes its layout as one int32 vector (`layout.pack`). This times a small jitted program that
reads such a vector, called four ways: with a fresh numpy vector each call (as the engine does), with the same
numpy vector every call, with a vector already on the device, and through an explicit `jax.device_put` first.
The sizes span 4 KB to 2.8 MB, around the headline layout's 183 KB packed and 721 KB unpacked. Prints one JSON
line per size: the median over 50 timed calls (after 10 untimed) in ms, host clock, until the result is back.
Answers in bench/RESULTS.md ("The packed layout itself").

    python -m bench.investigations.h2d_probe
"""
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

SIZES = (1024, 16384, 65536, 175000, 700000)
WAYS = ("fresh numpy", "reused numpy", "device array", "device_put then call")


@jax.jit
def _reads(packed, x):
    return x * (packed[0] + packed[-1]).astype(x.dtype) + packed.sum().astype(x.dtype)


def time_size(n: int, calls: int = 60, skip: int = 10) -> dict:
    x = jnp.ones((1024,), jnp.float32)
    base = np.random.default_rng(0).integers(0, 100, n).astype(np.int32)
    _reads(base, x).block_until_ready()
    result = {}
    for way in WAYS:
        times = []
        for i in range(calls):
            if way == "device array":
                arg = jax.device_put(base)
                arg.block_until_ready()
            elif way == "reused numpy":
                arg = base
            else:
                arg = base + np.int32(i % 3)
            t0 = time.perf_counter()
            if way == "device_put then call":
                arg = jax.device_put(arg)
            np.asarray(_reads(arg, x))
            times.append((time.perf_counter() - t0) * 1e3)
        result[way] = round(float(np.median(times[skip:])), 4)
    return dict(int32s=n, bytes=4 * n, ms_p50=result)


def main():
    for n in SIZES:
        print(json.dumps(time_size(n)), flush=True)


if __name__ == "__main__":
    main()
