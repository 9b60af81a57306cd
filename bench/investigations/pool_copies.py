"""Does a request's cost grow with the size of the entry pools? The engine's pools are donated to the
programs that write them; if a program also reads them, XLA's copy insertion keeps the old buffer alive for the
readers and copies whole pools on every call.

For each pool budget, this counts the pool-shaped `copy` instructions in the compiled `pic` and `commit` programs
and times a warm PIC request and a warm full recompute of the demo's tiny model (median of `--repeats`).

    python3 -m bench.investigations.pool_copies [--budgets-mb 16,1024] [--repeats 5]
"""

from __future__ import annotations

import argparse
import re
import time

import jax
import numpy as np

from hypic_jax.demo import tiny_model
from hypic_jax.engine import Engine
from hypic_jax.engine.programs import ProgramKey


def pool_copies(engine: Engine, key: ProgramKey) -> int:
    shapes = {",".join(map(str, a.shape)) for a in jax.tree.leaves(engine.pools.arrays)}
    hlo = engine.programs._lower(key).compile().as_text()
    return sum(1 for shape in re.findall(r"= \w+\[([\d,]+)\]\S* copy\(", hlo) if shape in shapes)


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets-mb", default="16,1024")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model = tiny_model()
    rng = np.random.default_rng(0)
    docs = [rng.integers(3, 500, 40).tolist() for _ in range(4)]
    print(f"{'pool MB':>8} {'pic copies':>10} {'commit copies':>13} {'pic request s':>13} {'full request s':>14}")
    for budget in (int(b) for b in args.budgets_mb.split(",")):
        engine = Engine(model, cache_bytes=budget << 20, max_prompt_tokens=512, token_rungs=(512,),
                        max_new_tokens=16, max_batch=1, compile_cache="none")
        engine.warmup(progress=False)
        engine.prefill(docs + [[5, 6, 7]])  # entries cached: the timed PIC requests are warm
        pic = median_seconds(lambda: engine.prefill(docs[::-1] + [[5, 6, 7]]), args.repeats)
        full = median_seconds(lambda: engine.prefill(docs + [[5, 6, 7]], mode="full_recompute"), args.repeats)
        copies = []
        for kind in ("pic", "commit"):
            try:
                copies.append(pool_copies(engine, ProgramKey(kind, 512, engine.max_keys if kind == "pic" else 0)))
            except ValueError:  # an engine whose span programs write the pools themselves has no commit program
                copies.append("-")
        size = sum(a.nbytes for a in jax.tree.leaves(engine.pools.arrays)) >> 20
        print(f"{size:>8} {copies[0]:>10} {copies[1]:>13} {pic:>13.4f} {full:>14.4f}")
        engine.close()


if __name__ == "__main__":
    main()
