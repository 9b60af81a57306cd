"""Where the engine's plain program spends its time: one long fresh span against many short ones of the same total,
through the same compiled program, with a profiler trace of each.

    python -m bench.investigations.stable_probe --layers 8 --profile-dir /tmp/probe
    python bench/trace_summary.py /tmp/probe/one_span --top 25
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import full_config

from hypic_jax.models import qwen3_5
from hypic_jax.models.base import Model
from hypic_jax.engine import Engine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=11200)
    parser.add_argument("--rung", type=int, default=16384)
    parser.add_argument("--profile-dir", default=None)
    args = parser.parse_args()
    config = full_config(args.layers)
    model = Model(qwen3_5, config, qwen3_5.init_params(config, jax.random.key(0), jnp.bfloat16))
    engine = Engine(model, max_prompt_tokens=args.rung, max_segments=16, token_rungs=(args.rung,),
                    cache_bytes=4 << 30, max_new_tokens=0, max_batch=1, compile_cache="none", consume_model=True)
    rng = np.random.default_rng(0)
    one = [rng.integers(3, 1000, args.tokens - 64).tolist(), [5] * 64]
    many = [rng.integers(3, 1000, (args.tokens - 64) // 16).tolist() for _ in range(16)] + [[5] * 64]
    cases = [("one_span", one, "full_recompute"), ("many_spans_full", many, "full_recompute"),
             ("many_spans_prefix_miss", many, "prefix_cache")]
    for name, segs, mode in cases:
        for attempt in range(3):
            engine.clear_cache()
            start = time.perf_counter()
            if attempt == 2 and args.profile_dir:
                with jax.profiler.trace(f"{args.profile_dir}/{name}", create_perfetto_trace=True):
                    engine.prefill(segs, mode=mode)
            else:
                engine.prefill(segs, mode=mode)
            print(name, mode, attempt, f"{time.perf_counter() - start:.3f} s", flush=True)


if __name__ == "__main__":
    main()
