"""Compile cost and host-side latency of the PIC combine program as the engine's segment limit grows (any machine).

`hypic_jax.Engine` compiles one stitched (`pic`) program per token rung, for any request of up to `max_segments`
segments: the request's layout is data, and its capacity of pieces (2 per segment, plus the query's) is what grows
with the segment limit. This measures, for a small Qwen3.5-MoE-shaped model with `--layers` layers and an engine of
`max_segments = --segments`, the `pic` program of the rung that holds a warm `transition_rope_recompute` request
over `--segments` cached documents: the time to trace, lower and compile it, the optimised program's instruction
and fusion counts (what the compiler and the GPU's kernel launches scale with), and the warm time to first token.
Run it on two checkouts to compare them.

    python bench/span_compile.py --layers 8 --segments 64            # about a minute on a 2-core CPU
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from common import small_config, write_json

from hypic_jax.stitch import layout as lay
from hypic_jax.engine import Engine, KernelOptions, seam_tokens
from hypic_jax.engine.programs import ProgramKey, span_options, span_program
from hypic_jax.models import qwen3_5
from hypic_jax.models.base import FOLD_IMPLS, Model

MODE = "transition_rope_recompute"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--segments", type=int, default=64)
    parser.add_argument("--segment-len", type=int, default=32)
    parser.add_argument("--query-len", type=int, default=16)
    parser.add_argument("--seam", type=float, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fold-impl", default="auto", choices=FOLD_IMPLS,
                        help="the fold over the pieces (KernelOptions.fold; 'pallas' runs the kernel, in interpret "
                             "mode off a GPU)")
    parser.add_argument("--no-scan", dest="scan", action="store_false", help="every layer unrolled")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    config = dataclasses.replace(small_config(), layer_types=qwen3_5.default_layer_types(args.layers),
                                 mlp_types=("moe",) * args.layers)
    params = qwen3_5.init_params(config, jax.random.key(0), jnp.float32)
    prompt = args.segments * args.segment_len + args.query_len
    fresh = sum(seam_tokens(args.seam, args.segment_len) for _ in range(args.segments)) + args.query_len
    # two rungs: the warm request's fresh tokens (the program measured) and the whole prompt (the cold prefill)
    rungs = tuple(sorted({-(-fresh // 16) * 16, prompt}))
    engine = Engine(Model(qwen3_5, config, params), seam=args.seam, max_prompt_tokens=prompt,
                    max_segments=args.segments, max_new_tokens=0, max_batch=1, token_rungs=rungs,
                    mean_entry_tokens=args.segment_len, compile_cache="none", consume_model=True,
                    kernels=KernelOptions(fold=args.fold_impl, scan_layers=args.scan))
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, config.vocab_size, args.segment_len).tolist() for _ in range(args.segments)]
    query = rng.integers(0, config.vocab_size, args.query_len).tolist()
    engine.prefill(docs + [query], mode=MODE)  # fills the cache (and compiles the cold and pic programs once)

    key = ProgramKey("pic", engine.ladder.rung(fresh), engine.max_keys)
    capacity = engine.capacity(key)
    fn = jax.jit(functools.partial(span_program, arch=engine.arch, config=engine.config, capacity=capacity,
                                   isolated=False, summaries=True, want_decode=True, want_writes=False,
                                   kernels=engine.kernels), compiler_options=span_options("pic"))
    packed = jax.ShapeDtypeStruct((lay.packed_size(capacity),), jnp.int32)
    jax.clear_caches()  # time this program's compilation from scratch
    start = time.perf_counter()
    traced = fn.trace(engine.params, packed, engine.pools.arrays)
    traced_s = time.perf_counter() - start
    lowered = traced.lower()
    lowered_s = time.perf_counter() - start - traced_s
    compiled = lowered.compile()
    compiled_s = time.perf_counter() - start - traced_s - lowered_s
    ops = collections.Counter(re.findall(r"= \S+ ([a-z][\w\-]*)\(", compiled.as_text()))
    times = []
    for _ in range(args.repeats):
        order = rng.permutation(args.segments)
        result = engine.prefill([docs[i] for i in order] + [query], mode=MODE)
        assert result.stats.misses == 0, result.stats
        times.append(result.stats.ttft_s)
    report = dict(
        backend=jax.default_backend(), layers=args.layers, segments=args.segments, segment_len=args.segment_len,
        query_len=args.query_len, fold_impl=engine.kernels.fold, plan=str(engine.plan), rung=key.tokens,
        pieces=capacity.pieces, keys=capacity.keys,
        trace_s=round(traced_s, 2), lower_s=round(lowered_s, 2), compile_s=round(compiled_s, 2),
        hlo_instructions=sum(ops.values()), fusions=ops["fusion"], warm_ttft_ms=round(1e3 * min(times), 1),
    )
    print(json.dumps(report))
    write_json(args.json, report)


if __name__ == "__main__":
    main()
