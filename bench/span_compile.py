"""Compile cost and host-side latency of the PIC combine as the number of cached segments grows (any machine).

The engine compiles one program per request layout. This measures, for a small Qwen3.5-MoE-shaped model with
`--layers` layers, the warm `transition_rope_recompute` request over `--segments` cached documents: the time to
trace, lower and compile its program, the optimised program's instruction and fusion counts (what the compiler and
the GPU's kernel launches scale with), and the warm time to first token. Run it on two checkouts to compare them.

    python bench/span_compile.py --layers 8 --segments 64            # about a minute on a 2-core CPU
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prefill import small_config  # noqa: E402

from hypic_jax import engine as engine_module  # noqa: E402
from hypic_jax.engine import Engine  # noqa: E402
from hypic_jax.models import qwen3_5  # noqa: E402
from hypic_jax.models.base import Model  # noqa: E402

MODE = "transition_rope_recompute"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--segments", type=int, default=64)
    parser.add_argument("--segment-len", type=int, default=32)
    parser.add_argument("--query-len", type=int, default=16)
    parser.add_argument("--seam", type=float, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefix-impl", default="auto", help="Engine(prefix_impl=...): 'pallas' takes the seam fold "
                        "(interpret mode off a GPU)")
    parser.add_argument("--no-stack-entries", dest="stack_entries", action="store_false",
                        help="Engine(stack_entries=False): entries stored layer by layer")
    args = parser.parse_args(argv)

    config = dataclasses.replace(small_config(), layer_types=qwen3_5.default_layer_types(args.layers),
                                 mlp_types=("moe",) * args.layers)
    params = qwen3_5.init_params(config, jax.random.key(0), jnp.float32)
    engine = Engine(Model(qwen3_5, config, params), seam=args.seam, prefix_impl=args.prefix_impl,
                    stack_entries=args.stack_entries)
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, config.vocab_size, args.segment_len).tolist() for _ in range(args.segments)]
    query = rng.integers(0, config.vocab_size, args.query_len).tolist()
    engine.prefill(docs + [query], mode=MODE)  # fills the cache (and compiles both programs once)

    segments = [docs[i] for i in rng.permutation(args.segments)] + [query]
    with engine.cache.pinned() as pins:
        plan = engine._plan_pic(segments, MODE, args.seam, None, pins)
        span_mode = engine._span_mode(MODE) if hasattr(engine, "_span_mode") else engine_module.spans.MODES[MODE]
        tokens = jnp.asarray(np.asarray(plan["fresh"], np.int32))
        static = dict(arch=engine.arch, config=engine.config, layout=plan["layout"], mode=span_mode,
                      want_logits=True, want_decode=True, want_hidden=False)
        jax.clear_caches()  # time this layout's compilation from scratch
        start = time.perf_counter()
        cached = engine._cached_arg(plan["cached"], plan.get("slots"))
        traced = engine_module._span_call.trace(engine.params, tokens, cached, **static)
        traced_s = time.perf_counter() - start
        lowered = traced.lower()
        lowered_s = time.perf_counter() - start - traced_s
        compiled = lowered.compile()
        compiled_s = time.perf_counter() - start - traced_s - lowered_s
    ops = collections.Counter(re.findall(r"= \S+ ([a-z][\w\-]*)\(", compiled.as_text()))
    times = []
    for _ in range(args.repeats):
        order = rng.permutation(args.segments)
        times.append(engine.prefill([docs[i] for i in order] + [query], mode=MODE).stats.ttft_s)
    print(json.dumps(dict(
        backend=jax.default_backend(), layers=args.layers, segments=args.segments, segment_len=args.segment_len,
        query_len=args.query_len, prefix_impl=engine.prefix_impl, stack_entries=engine.stack_entries,
        cached_leaves=len(jax.tree.leaves(cached)),
        trace_s=round(traced_s, 2), lower_s=round(lowered_s, 2), compile_s=round(compiled_s, 2),
        hlo_instructions=sum(ops.values()), fusions=ops["fusion"], warm_ttft_ms=round(1e3 * min(times), 1),
    )))


if __name__ == "__main__":
    main()
