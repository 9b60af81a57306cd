"""Benchmark of the pure-JAX core: chunked vs recurrent, and the overhead of building (T_C, S(C|0)).

For each family and length it times, jitted, median of several runs:
  recurrent   token-by-token scan (the reference)
  chunked     the chunk-parallel form (outputs + final state)
  summarize   (T_C, S(C|0)) of the whole sequence (no outputs)
  fused       chunked outputs + summarize, i.e. what a cold segment's prefill costs when it also emits its entry
and reports speed-ups and the T_C build overhead (summarize / chunked). Run on any backend:

    python bench/linear_attn.py                       # CPU defaults
    python bench/linear_attn.py --lengths 4096 16384 --heads 32 --head-dim 128 --dtype bfloat16   # GPU
"""

from __future__ import annotations

import argparse
import datetime
import platform

import jax
import jax.numpy as jnp

from common import write_json

from hypic_jax.demo import FAMILY_BUILDERS, median_time as timed


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="*", default=list(FAMILY_BUILDERS))
    parser.add_argument("--lengths", nargs="*", type=int, default=[1024, 4096])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-recurrent-above", type=int, default=8192)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    device = jax.devices()[0]
    print(
        f"# {datetime.date.today()} jax {jax.__version__} on {device.platform} ({device.device_kind}), "
        f"{platform.machine()}; heads={args.heads} head_dim={args.head_dim} chunk={args.chunk_size} dtype={args.dtype}"
    )
    print(f"{'family':<16} {'L':>7} {'recurrent ms':>13} {'chunked ms':>11} {'speed-up':>9} {'summarize ms':>13} "
          f"{'T build / chunked':>18} {'tok/s chunked':>14}")
    rows = []
    for index, name in enumerate(args.families):
        for length in args.lengths:
            keys = iter(jax.random.split(jax.random.PRNGKey(index), 8))
            rand = lambda shape: jax.random.normal(next(keys), shape)  # noqa: E731
            shape = (length, args.heads, args.head_dim)
            inputs = FAMILY_BUILDERS[name](rand(shape).astype(dtype), rand(shape).astype(dtype), rand(shape).astype(dtype), rand)
            chunked = jax.jit(lambda inp: inp.chunked(chunk_size=args.chunk_size))
            summarize = jax.jit(lambda inp: inp.summarize(chunk_size=args.chunk_size))
            t_chunked = timed(chunked, inputs, repeats=args.repeats)
            t_summary = timed(summarize, inputs, repeats=args.repeats)
            t_recurrent = float("nan")
            if length <= args.skip_recurrent_above:
                t_recurrent = timed(jax.jit(lambda inp: inp.recurrent()), inputs, repeats=max(1, args.repeats // 2))
            row = dict(family=name, length=length, recurrent_ms=1e3 * t_recurrent, chunked_ms=1e3 * t_chunked,
                       summarize_ms=1e3 * t_summary, build_overhead=t_summary / t_chunked,
                       tokens_per_s=length / t_chunked)
            rows.append(row)
            print(f"{name:<16} {length:>7} {row['recurrent_ms']:>13.2f} {row['chunked_ms']:>11.2f} "
                  f"{t_recurrent / t_chunked:>8.1f}x {row['summarize_ms']:>13.2f} {row['build_overhead']:>17.2f}x "
                  f"{row['tokens_per_s']:>14.0f}", flush=True)
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
