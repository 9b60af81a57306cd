"""Benchmark of the linear-attention kernels against flash-linear-attention (fla): the Pallas Gated DeltaNet
forward (with and without its cache entry (T_C, S(C|0))), KDA and GLA (per-key gates), packed segments
(`gdn_varlen`), the pure-JAX chunked path, and the composition of many dense (T, S) pairs.

  python bench/linear_kernels.py --fla-only --out DIR     fla's chunk_gated_delta_rule at each --lengths, then chunk_kda,
                                                   chunk_gla and varlen chunk_gated_delta_rule at 32k (torch; the
                                                   fla wheels installed). Run it first, in its own process.
  python bench/linear_kernels.py --all --out DIR          one table of run_all's --sections: "steps" (the library's
                                                   launches, `step_variants`: GDNConfig() is "tile c64 lw4 mosaic
                                                   both" on Hopper), "varlen", "per-key", and the solve
                                                   variants "gdn" and "locals"; the fla column comes from a
                                                   --fla-only run into the same DIR
  python bench/linear_kernels.py --out DIR                the Triton launch table (`variants`: chunk 32 and 64, the rows,
                                                   doubling and tile solves), the XLA composition, other lengths
  python bench/linear_kernels.py --focus --out DIR        the Triton composition fold, the Triton forward kernel by kernel,
                                                   T on slow gates
  python bench/linear_kernels.py --all --smoke ...        tiny shapes through the Pallas interpreter (CPU check)

Shapes: batch 1, 16 key heads -> 32 value heads of 128 (the Qwen3.5 shapes), bf16 q, k, v, float32 gates and state.
Each mode appends JSON lines to DIR/<mode>.jsonl as it goes (so a run cut short still reports) and prints a table.
Timing: one call to compile, warm-up calls, then the median over repeats of the mean time of a burst of calls,
each burst closed by block_until_ready. Inputs of the timed sizes are far larger than the 60 MB L2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time


HEADS, KEY_HEADS, DIM = 32, 16, 128
PEAK_TFLOPS_BF16 = 793.0  # measured on this H200 (ENVIRONMENT.md): bf16 8192^3 matmul
PEAK_TBS = 4.19  # measured elementwise pass, bytes read + written
COMPOSE = (64, 30, 512)  # segments, layers, tokens per segment
ALL_SECTIONS = ("gdn", "locals", "per-key", "varlen", "steps")  # run_all's sections, in run order
INTERPRET = False  # --smoke: tiny shapes through the Pallas interpreter (CPU check of this script)


def log(path, record):
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps(record), flush=True)


# ----------------------------------------------------------------------------------------------------------------
# fla (torch) timing, run in its own process so that torch and JAX do not share the GPU's memory pools.


def fla_gdn_inputs(length, key_heads, dev="cuda"):
    """fla's Gated DeltaNet inputs at the bench shapes (torch, seed 0): q, k [1, L, Hk, K] normalized bf16,
    v [1, L, H, V] bf16, g = -U(0, 0.1) and beta float32 [1, L, H]."""
    import torch

    torch.manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(1, length, key_heads, DIM, device=dev), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(1, length, key_heads, DIM, device=dev), dim=-1).bfloat16()
    v = torch.randn(1, length, HEADS, DIM, device=dev, dtype=torch.bfloat16)
    g = -torch.rand(1, length, HEADS, device=dev, dtype=torch.float32) * 0.1
    beta = torch.rand(1, length, HEADS, device=dev, dtype=torch.float32).sigmoid()
    return q, k, v, g, beta


def run_fla(out_dir, lengths):
    import torch
    from triton.testing import do_bench

    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    path = os.path.join(out_dir, "fla.jsonl")
    dev = "cuda"
    for length in lengths:
        for key_heads in (HEADS, KEY_HEADS):
            q, k, v, g, beta = fla_gdn_inputs(length, key_heads, dev)
            fn = lambda: chunk_gated_delta_rule(q, k, v, g=g, beta=beta, scale=DIM**-0.5,  # noqa: E731
                                                output_final_state=True)
            try:
                ms = do_bench(fn, warmup=50, rep=200, return_mode="median")
                log(path, dict(impl="fla chunk_gated_delta_rule", L=length, key_heads=key_heads, ms=ms))
            except Exception as e:  # GVA may be missing in an older fla
                log(path, dict(impl="fla chunk_gated_delta_rule", L=length, key_heads=key_heads, error=repr(e)[:300]))
            del q, k, v, g, beta
            torch.cuda.empty_cache()
    for length in lengths:  # per-key families and packed segments (32 heads of 128 everywhere), at 32k only
        if length != 32768 and len(lengths) > 1:
            continue
        torch.manual_seed(0)
        q = torch.nn.functional.normalize(torch.randn(1, length, HEADS, DIM, device=dev), dim=-1).bfloat16()
        k = torch.nn.functional.normalize(torch.randn(1, length, HEADS, DIM, device=dev), dim=-1).bfloat16()
        v = torch.randn(1, length, HEADS, DIM, device=dev, dtype=torch.bfloat16)
        gk = -torch.rand(1, length, HEADS, DIM, device=dev, dtype=torch.float32) * 0.1
        g = -torch.rand(1, length, HEADS, device=dev, dtype=torch.float32) * 0.1
        beta = torch.rand(1, length, HEADS, device=dev, dtype=torch.float32).sigmoid()
        cu = torch.tensor(varlen_offsets(length), device=dev, dtype=torch.long)
        cases = {"fla chunk_gated_delta_rule varlen": lambda: chunk_gated_delta_rule(  # first: the packed rows
            q, k, v, g=g, beta=beta, scale=DIM**-0.5, output_final_state=True, cu_seqlens=cu)}
        try:
            from fla.ops.kda import chunk_kda

            cases["fla chunk_kda"] = lambda: chunk_kda(q, k, v, gk, beta, scale=DIM**-0.5, output_final_state=True)
        except Exception as e:  # noqa: BLE001
            log(path, dict(impl="fla chunk_kda", error=repr(e)[:300]))
        try:
            from fla.ops.gla import chunk_gla

            cases["fla chunk_gla"] = lambda: chunk_gla(q, k, v, gk, scale=DIM**-0.5, output_final_state=True)
        except Exception as e:  # noqa: BLE001
            log(path, dict(impl="fla chunk_gla", error=repr(e)[:300]))
        if "fla chunk_kda" in cases:  # last: on the H200 it ran past a 240 s limit (compile or run, not known)
            cases["fla chunk_kda varlen"] = lambda: chunk_kda(q, k, v, gk, beta, scale=DIM**-0.5,
                                                              output_final_state=True, cu_seqlens=cu)
        for name, fn in cases.items():
            try:
                ms = do_bench(fn, warmup=50, rep=200, return_mode="median")
                log(path, dict(impl=name, L=length, key_heads=HEADS, ms=ms))
            except Exception as e:  # noqa: BLE001
                log(path, dict(impl=name, L=length, error=repr(e)[:300]))
        del q, k, v, gk, g, beta
        torch.cuda.empty_cache()


def varlen_offsets(length, segments=64, seed=0):
    """Offsets of `segments` uneven packed segments (lengths uniform in [0.25, 1.75] x the mean) summing to L."""
    import numpy as np

    weights = np.random.default_rng(seed).uniform(0.25, 1.75, segments)
    cuts = np.round(np.cumsum(weights) / weights.sum() * length).astype(int)
    return [0] + [int(c) for c in cuts[:-1]] + [length]


# ----------------------------------------------------------------------------------------------------------------
# JAX side.


def timeit(fn, *args, warmup=2, repeats=5, min_burst_s=0.05):
    import jax

    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    compile_s = time.perf_counter() - t0
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    one = time.perf_counter() - t0
    burst = max(1, min(50, int(min_burst_s / max(one, 1e-6))))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = None
        for _ in range(burst):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / burst)
    return statistics.median(times) * 1e3, compile_s


def rel(a, b):
    import numpy as np

    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def gdn_inputs(length, seed=0):
    import jax
    import jax.numpy as jnp

    from hypic_jax.core.linear_attn import l2_normalize

    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = l2_normalize(jax.random.normal(ks[0], (length, KEY_HEADS, DIM), jnp.float32)).astype(jnp.bfloat16)
    k = l2_normalize(jax.random.normal(ks[1], (length, KEY_HEADS, DIM), jnp.float32)).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], (length, HEADS, DIM), jnp.float32).astype(jnp.bfloat16)
    g = -jax.random.uniform(ks[3], (length, HEADS), jnp.float32) * 0.1
    beta = jax.nn.sigmoid(jax.random.uniform(ks[4], (length, HEADS), jnp.float32))
    return q, k, v, g, beta


def locals_operands(length):
    """`gdn_inputs(length)` and what the default chunk-local step makes of them, (b, p, w, u, k, q): the operands
    of the state and transfer passes, for benchmarks that time those passes alone."""
    import jax
    import jax.numpy as jnp

    from hypic_jax.kernels import gdn
    from hypic_jax.kernels.gdn.chunk_local import chunk_local_pass

    inputs = gdn_inputs(length)
    config = gdn.GDNConfig().resolved(jnp.bfloat16)
    local = jax.jit(lambda q, k, v, g, beta: chunk_local_pass(q, k, v, g, None, beta, scale=DIM**-0.5,
                                                              config=config, interpret=False))(*inputs)
    return inputs, local


def named_config(**kwargs):
    """A GDNConfig as the variant names read: chunk 64 and the "rows" solve unless a name says otherwise (cN, the
    solve's name), a 2-warp chunk-local kernel and (T, S) from the widened pass, both kernels in Triton. Every field
    is spelled out, so a name keeps its meaning when the library's defaults change."""
    from hypic_jax.kernels.gdn import GDNConfig

    return GDNConfig(**{"chunk": 64, "solve": "rows", "locals_warps": 2, "transfer_group": 0,
                        "state_lowering": "triton", "locals_lowering": "triton", **kwargs})


def variants():
    """Variants in priority order (a run cut short by its time budget drops the last ones)."""
    C = named_config

    b16 = dict(locals_precision="bf16", state_precision="bf16", state_lowering="triton", locals_lowering="triton")
    t32 = dict(locals_precision="tf32", state_precision="tf32")
    return {
        "pallas bv32 bf16": (C(block_v=32, **b16), False),
        "pallas bv16 bf16": (C(block_v=16, **b16), False),
        "pallas P8 bv32 bf16": (C(block_v=32, pieces=8, **b16), False),
        "pallas bv32 tf32": (C(block_v=32, **t32), False),
        "pallas bv32 bf16 +TS": (C(block_v=32, **b16), True),
        "pallas P8 bv32 bf16 +TS": (C(block_v=32, pieces=8, **b16), True),
        "pallas bv32 tf32 +TS": (C(block_v=32, **t32), True),
        "pallas P8 bv32 tf32 +TS": (C(block_v=32, pieces=8, **t32), True),
        "pallas bv32 tf32 f32-inter": (C(block_v=32, inter_dtype="float32", **t32), False),
        "pallas P8 bv32 tf32 f32-inter +TS": (C(block_v=32, pieces=8, inter_dtype="float32", **t32), True),
        "pallas P4 bv32 bf16": (C(block_v=32, pieces=4, **b16), False),
        "pallas P16 bv32 bf16": (C(block_v=32, pieces=16, **b16), False),
        "pallas bv64 bf16": (C(block_v=64, **b16), False),
        "pallas bv32 bf16 w8": (C(block_v=32, state_warps=8, **b16), False),
        "pallas bv32 bf16 s3": (C(block_v=32, state_stages=3, **b16), False),
        "pallas c32 bv32 bf16": (C(chunk=32, block_v=32, **b16), False),
        "pallas bv32 state-bf16x3": (C(block_v=32, locals_precision="bf16", state_precision="bf16x3"), False),
        "pallas P8 bv16 tf32": (C(block_v=16, pieces=8, **t32), False),
        "pallas bv32 ieee": (C(block_v=32), False),
        # Solve variants of the chunk-local inverse.
        "pallas rows bv32 bf16 s3": (C(solve="rows", **b16), False),
        "pallas doubling bv32 bf16 s3": (C(solve="doubling", **b16), False),
        "pallas tile bv32 bf16 s3": (C(solve="tile", **b16), False),
        "pallas doubling c32 bv32 bf16 s3": (C(chunk=32, solve="doubling", **b16), False),
        "pallas tile c32 bv32 bf16 s3": (C(chunk=32, solve="tile", **b16), False),
        "pallas doubling solve-bf16x3 bv32 s3": (C(solve="doubling", solve_precision="bf16x3", **b16), False),
        "pallas doubling bv32 bf16 s3 +TS": (C(solve="doubling", **b16), True),
        "pallas doubling bv32 tf32 f32-inter +TS": (C(solve="doubling", inter_dtype="float32", **t32), True),
        # tile, chunk 32 emitting (T, S), and split into pieces.
        "pallas tile c32 bv32 bf16 s3 +TS": (C(chunk=32, solve="tile", **b16), True),
        "pallas P2 tile c32 bv32 bf16 s3": (C(chunk=32, solve="tile", pieces=2, **b16), False),
        "pallas P4 tile c32 bv32 bf16 s3": (C(chunk=32, solve="tile", pieces=4, **b16), False),
        "pallas P4 tile c32 bv32 bf16 s3 +TS": (C(chunk=32, solve="tile", pieces=4, **b16), True),
    }


def run_jax(out_dir, lengths, check_length, budget_s, only=None):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from hypic_jax.core import linear_attn as la
    from hypic_jax.kernels import compose as cmp
    from hypic_jax.kernels.gdn import flops, gdn_forward

    start = time.perf_counter()
    path = os.path.join(out_dir, "jax.jsonl")
    log(path, dict(jax=jax.__version__, devices=[str(d) for d in jax.devices()], date=time.strftime("%Y-%m-%d")))
    scale = DIM**-0.5
    group = HEADS // KEY_HEADS
    vs = variants()
    if only:
        vs = {name: val for name, val in vs.items() if name in only}

    def xla_chunked(q, k, v, g, beta):
        return la.chunked(jnp.repeat(q, group, 1), jnp.repeat(k, group, 1), v, g=g, beta=beta, scale=scale)

    xla_fn = jax.jit(xla_chunked)

    def pallas_fn(config, emit):
        return jax.jit(lambda q, k, v, g, beta: gdn_forward(q, k, v, g=g, beta=beta, scale=scale, config=config,
                                                            emit_summary=emit, interpret=INTERPRET))

    fns = {name: pallas_fn(*val) for name, val in vs.items()}

    # 1. Correctness on the GPU against the core (float32 HIGHEST on the same bf16-rounded inputs).
    q, k, v, g, beta = gdn_inputs(check_length, seed=1)
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    ref_o, ref_s = jax.jit(lambda *a: la.chunked(jnp.repeat(up(a[0]), group, 1), jnp.repeat(up(a[1]), group, 1),
                                                 up(a[2]), g=a[3], beta=a[4], scale=scale))(q, k, v, g, beta)
    ref_sum = jax.jit(lambda k, v, g, beta: la.summarize(jnp.repeat(up(k), group, 1), up(v), g=g, beta=beta))(
        k, v, g, beta)
    o, s = xla_fn(q, k, v, g, beta)
    log(path, dict(check="xla chunked bf16", L=check_length, o=rel(o, ref_o), state=rel(s, ref_s)))
    for name, fn in fns.items():
        try:
            res = fn(q, k, v, g, beta)
            rec = dict(check=name, L=check_length, o=rel(res[0], ref_o), state=rel(res[1], ref_s))
            if len(res) == 3:
                rec.update(T=rel(res[2].transfer, ref_sum.transfer), S0=rel(res[2].state, ref_sum.state))
            log(path, rec)
        except Exception as e:
            log(path, dict(check=name, error=repr(e)[:600]))
            fns[name] = None
    fns = {n: f for n, f in fns.items() if f is not None}
    del ref_o, ref_s, ref_sum

    # 2. Timings at the Qwen3.5 shapes (32k first: the target length), then the compose benchmark, then the other
    # lengths.
    def time_length(length, names):
        q, k, v, g, beta = gdn_inputs(length)
        in_bytes = sum(int(x.size) * x.dtype.itemsize for x in (q, k, v, g, beta)) + length * HEADS * DIM * 2
        todo = [("xla chunked", xla_fn, None)] + [(n, fns[n], vs[n]) for n in names if n in fns]
        timed = {}
        for name, fn, val in todo:
            if time.perf_counter() - start > budget_s:
                log(path, dict(skipped=name, L=length, reason="time budget"))
                continue
            try:
                ms, comp = timeit(fn, q, k, v, g, beta)
                rec = dict(impl=name, L=length, ms=ms, compile_s=comp, Mtok_s=length / ms / 1e3,
                           min_bytes_TBs=in_bytes / ms / 1e9)
                if val is not None:
                    cfg, emit = val
                    fl = flops(length, HEADS, DIM, DIM, cfg.chunk, emit=emit, pieces=cfg.pieces)
                    rec["TFLOPs"] = fl / ms / 1e9
                    timed[name] = ms
                log(path, rec)
            except Exception as e:
                log(path, dict(impl=name, L=length, error=repr(e)[:600]))
        del q, k, v, g, beta
        return timed

    lengths = list(lengths)
    timed = {}
    if check_length in lengths:  # its functions are compiled already
        timed = time_length(check_length, list(fns))
        lengths.remove(check_length)

    # 3. Compose: 64 segments x 30 layers x 32 heads of dense 128 x 128 (T, S) pairs from real GDN summaries.
    if time.perf_counter() - start < budget_s:
        try:
            run_compose(path, cmp, la, segments=COMPOSE[0], layers=COMPOSE[1], seg_len=COMPOSE[2])
        except Exception as e:
            log(path, dict(compose="failed", error=repr(e)[:600]))

    # The other lengths: the 4 fastest plain variants and the 2 fastest emitting ones at the check length.
    plain = sorted((ms, n) for n, ms in timed.items() if not vs[n][1])
    emitting = sorted((ms, n) for n, ms in timed.items() if vs[n][1])
    best = [n for _, n in plain[:4] + emitting[:2]] or list(fns)
    for length in lengths:
        time_length(length, best)
    log(path, dict(done=True, elapsed_s=time.perf_counter() - start))


def run_compose(path, cmp, la, segments=64, layers=30, seg_len=512):
    import jax
    import numpy as np

    transfers, states, ref_states, tt = compose_pairs(la, segments, layers, seg_len)
    t64 = np.asarray(transfers[:, 0], np.float64)  # layer 0 is the unpermuted one
    flop_pairs = 2 * (segments - 1) * layers * HEADS * DIM * DIM * (2 * DIM)
    flop_states = 2 * segments * layers * HEADS * DIM * DIM * DIM
    log(path, dict(compose_setup=dict(segments=segments, layers=layers, heads=HEADS, dim=DIM, seg_len=seg_len,
                                      T_norm_range=[float(np.linalg.norm(t64[:, h], axis=(-2, -1)).mean())
                                                    for h in (0, HEADS - 1)])))
    for alg in cmp.ALGORITHMS:
        fa = jax.jit(lambda t, s, alg=alg: cmp.compose_all(t, s, alg))
        fs = jax.jit(lambda t, s, alg=alg: cmp.prefix_fold_reference(t, s, algorithm=alg))
        for kind, fn, fl in (("compose_all (pairs, tree)", fa, flop_pairs),
                             ("prefix_fold_reference (fold)", fs, flop_states)):
            try:
                ms, comp = timeit(fn, transfers, states)
                res = fn(transfers, states)
                if kind.startswith("compose_all"):
                    err = dict(S=rel(res[1][0], ref_states[-1]), T=rel(res[0][0], tt))
                else:
                    got = np.asarray(res[:, 0], np.float64)
                    err = dict(S_last=rel(got[-1], ref_states[-1]),
                               S_worst=max(rel(got[i], ref_states[i]) for i in range(segments)))
                log(path, dict(compose=kind, algorithm=alg, ms=ms, TFLOPs=fl / ms / 1e9, compile_s=comp, **err))
            except Exception as e:
                log(path, dict(compose=kind, algorithm=alg, error=repr(e)[:400]))


def run_focus(out_dir, budget_s):
    """The Triton composition fold, a per-kernel breakdown of the Triton GDN forward at 32k,
    a few launch-parameter variants, and the accuracy of T_C with slow gates (fast gates make T_C vanish)."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    from hypic_jax.core import linear_attn as la
    from hypic_jax.kernels import compose as cmp
    from hypic_jax.kernels import gdn
    from hypic_jax.kernels.gdn.common import chunk_cumsum
    from hypic_jax.kernels.gdn.state import state_pass
    C = named_config

    start = time.perf_counter()
    path = os.path.join(out_dir, "focus.jsonl")
    log(path, dict(jax=jax.__version__, devices=[str(d) for d in jax.devices()], date=time.strftime("%Y-%m-%d")))
    over = lambda: time.perf_counter() - start > budget_s  # noqa: E731

    # 1. Compose fold kernel on 64 x 30 x 32 real GDN pairs.
    try:
        transfers, states, ref_states, ref_t = compose_pairs(la, COMPOSE[0], COMPOSE[1], COMPOSE[2])
        segs, layers = COMPOSE[0], COMPOSE[1]
        flop_pairs = 2 * segs * layers * HEADS * DIM * DIM * (2 * DIM)
        flop_states = 2 * segs * layers * HEADS * DIM * DIM * DIM
        # (algorithm, block_w, with T, warps, stages): block_w 128 reads each T_i once per (layer, head) instead of
        # once per column block, at the price of a [128, 128] float32 accumulator per program (8 warps to hold it)
        for alg, bw, with_t, warps, stages in [
                ("bf16x3", 32, False, 4, 2), ("bf16x3", 128, False, 8, 2), ("bf16x3", 128, False, 8, 3),
                ("bf16x3", 64, False, 8, 2), ("bf16x3", 32, False, 4, 3), ("bf16x3", 16, False, 4, 2),
                ("bf16x3", 32, True, 4, 2), ("bf16x3", 128, True, 8, 2), ("tf32x3", 32, False, 4, 2),
                ("tf32", 32, True, 4, 2)]:
            if over():
                break
            cfg = cmp.FoldConfig(block_w=bw, algorithm=alg, num_warps=warps, num_stages=stages)
            fn = jax.jit(lambda t, s, cfg=cfg, w=with_t: cmp.fold_pallas(t, s, with_transfer=w, config=cfg,
                                                                         interpret=INTERPRET))
            try:
                ms, comp = timeit(fn, transfers, states)
                tt, ss = fn(transfers, states)
                rec = dict(compose="pallas fold " + ("pairs" if with_t else "states"), algorithm=alg, block_w=bw,
                           warps=warps, stages=stages,
                           ms=ms, TFLOPs=(flop_pairs if with_t else flop_states) / ms / 1e9,
                           S=rel(ss[0], ref_states[-1]))
                if with_t:
                    rec["T"] = rel(tt[0], ref_t)
                log(path, rec)
            except Exception as e:
                log(path, dict(compose="pallas fold", algorithm=alg, block_w=bw, error=repr(e)[:400]))
        del transfers, states
    except Exception as e:
        log(path, dict(compose="failed", error=repr(e)[:600]))

    # 2. GDN at 32k: per-kernel breakdown and launch variants.
    length = 32768 if not INTERPRET else 256
    q, k, v, g, beta = gdn_inputs(length)
    scale = DIM**-0.5
    b16 = dict(locals_precision="bf16", state_precision="bf16", state_lowering="triton", locals_lowering="triton")
    base = C(block_v=32, state_stages=3, **b16)
    b = chunk_cumsum(g, length, HEADS, base.chunk)
    beta_t = beta.T
    for name, cfg in [("locals w4 s1", base), ("locals w2", dataclasses.replace(base, locals_warps=2)),
                      ("locals w8", dataclasses.replace(base, locals_warps=8)),
                      ("locals s2", dataclasses.replace(base, locals_stages=2)),
                      ("locals tf32", dataclasses.replace(base, locals_precision="tf32"))]:
        if over():
            break
        fn = jax.jit(lambda q, k, v, b, beta, cfg=cfg: gdn.chunk_locals(
            q, k, v, b, beta, chunk=cfg.chunk, scale=scale, inter_dtype=jnp.bfloat16, config=cfg,
            interpret=INTERPRET))
        try:
            ms, _ = timeit(fn, q, k, v, b, beta_t)
            log(path, dict(part=name, L=length, ms=ms))
        except Exception as e:
            log(path, dict(part=name, error=repr(e)[:400]))
    p, w, u = jax.jit(lambda q, k, v, b, beta: gdn.chunk_locals(
        q, k, v, b, beta, chunk=base.chunk, scale=scale, inter_dtype=jnp.bfloat16, config=base,
        interpret=INTERPRET))(q, k, v, b, beta_t)
    init = jnp.zeros((1, HEADS, DIM, DIM), jnp.float32)
    for name, cfg, outputs in [("state bv32 s3 +out", base, True), ("state bv32 s3 no-out", base, False),
                               ("state bv32 s4 +out", dataclasses.replace(base, state_stages=4), True),
                               ("state bv16 s3 +out", dataclasses.replace(base, block_v=16), True),
                               ("state bv64 s3 +out", dataclasses.replace(base, block_v=64), True),
                               ("state bv32 s3 w2 +out", dataclasses.replace(base, state_warps=2), True)]:
        if over():
            break
        fn = jax.jit(lambda w, u, k, b, q, p, init, cfg=cfg, outputs=outputs: state_pass(
            w, u, k, b, q if outputs else None, p if outputs else None, init, chunk=cfg.chunk, pieces=1,
            value_dim=DIM, out_dtype=jnp.bfloat16, scale=scale, config=cfg, interpret=INTERPRET))
        try:
            ms, _ = timeit(fn, w, u, k, b, q, p, init)
            log(path, dict(part=name, L=length, ms=ms))
        except Exception as e:
            log(path, dict(part=name, error=repr(e)[:400]))
    del p, w, u
    for name, cfg, emit in [("pallas bv32 bf16 s3", base, False), ("pallas bv32 bf16 s3 +TS", base, True),
                            ("pallas bv32 bf16 s4", dataclasses.replace(base, state_stages=4), False),
                            ("pallas c32 bv32 bf16 s3", dataclasses.replace(base, chunk=32), False),
                            ("pallas P4 bv32 bf16 s3 +TS", dataclasses.replace(base, pieces=4), True),
                            ("pallas bv32 tf32-state s3 +TS", dataclasses.replace(base, state_precision="tf32"), True),
                            ("pallas bv32 tf32 f32-inter s3 +TS", dataclasses.replace(
                                base, locals_precision="tf32", state_precision="tf32", inter_dtype="float32"), True)]:
        if over():
            break
        fn = jax.jit(lambda q, k, v, g, beta, cfg=cfg, emit=emit: gdn.gdn_forward(
            q, k, v, g=g, beta=beta, scale=scale, config=cfg, emit_summary=emit, interpret=INTERPRET))
        try:
            ms, _ = timeit(fn, q, k, v, g, beta)
            log(path, dict(impl=name, L=length, ms=ms))
        except Exception as e:
            log(path, dict(impl=name, error=repr(e)[:400]))
    del q, k, v, g, beta

    # 3. Accuracy of (T_C, S(C|0)) with slow gates (T_C of norm ~1), against the core in float32 HIGHEST.
    length = 4096 if not INTERPRET else 128
    q, k, v, _, beta = gdn_inputs(length, seed=3)
    g = -jax.random.uniform(jax.random.PRNGKey(5), (length, HEADS)) * 1e-3
    up = lambda x: jnp.repeat(x.astype(jnp.float32), HEADS // KEY_HEADS, 1)  # noqa: E731
    ref = la.summarize(up(k), v.astype(jnp.float32), g=g, beta=beta)
    ref_o, _ = la.chunked(up(q), up(k), v.astype(jnp.float32), g=g, beta=beta, scale=scale)
    for name, cfg in [("bv32 bf16", base), ("P8 bv32 bf16", dataclasses.replace(base, pieces=8)),
                      ("bv32 tf32", dataclasses.replace(base, locals_precision="tf32", state_precision="tf32")),
                      ("P8 bv32 tf32", dataclasses.replace(base, pieces=8, locals_precision="tf32",
                                                           state_precision="tf32")),
                      ("bv32 bf16-state f32-inter", dataclasses.replace(base, inter_dtype="float32")),
                      ("bv32 tf32 f32-inter", dataclasses.replace(base, locals_precision="tf32",
                                                                  state_precision="tf32", inter_dtype="float32"))]:
        if over():
            break
        try:
            o, s, summ = gdn.gdn_forward(q, k, v, g=g, beta=beta, scale=scale, config=cfg, emit_summary=True,
                                         interpret=INTERPRET)
            log(path, dict(slow_gate_check=name, L=length, o=rel(o, ref_o), T=rel(summ.transfer, ref.transfer),
                           S0=rel(summ.state, ref.state), T_norm=float(jnp.linalg.norm(ref.transfer[0]))))
        except Exception as e:
            log(path, dict(slow_gate_check=name, error=repr(e)[:400]))
    log(path, dict(done=True, elapsed_s=time.perf_counter() - start))


def compose_pairs(la, segments, layers, seg_len):
    """64 x 32 real GDN segment pairs (per-head decay rates over three decades: slow heads keep T near norm 1, fast
    ones near 0), tiled over layers by per-layer permutations (layer 0 unpermuted); float64 host reference of
    layer 0: all prefix states and the total T."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    ks = jax.random.split(jax.random.PRNGKey(7), 5)
    shape = (segments, seg_len, HEADS, DIM)
    k = la.l2_normalize(jax.random.normal(ks[0], shape, jnp.float32))
    v = jax.random.normal(ks[1], shape, jnp.float32)
    rate = jnp.exp(jax.random.uniform(ks[2], (HEADS,), minval=jnp.log(1e-4), maxval=jnp.log(1e-1)))
    g = -rate * jax.random.uniform(ks[3], (segments, seg_len, HEADS), minval=0.5, maxval=1.5)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (segments, seg_len, HEADS)))
    summ = jax.jit(jax.vmap(lambda k, v, g, b: la.summarize(k, v, g=g, beta=b)))(k, v, g, beta)
    t1, s1 = summ.transfer, summ.state
    perms = [np.random.default_rng(i).permutation(segments) for i in range(layers)]
    perms[0] = np.arange(segments)
    idx = jnp.asarray(np.stack(perms, axis=1))
    transfers, states = t1[idx], s1[idx]
    t64, s64 = np.asarray(t1, np.float64), np.asarray(s1, np.float64)
    st = np.zeros_like(s64[0])
    ref_states = []
    for i in range(segments):
        st = t64[i] @ st + s64[i]
        ref_states.append(st)
    tt = t64[0]
    for i in range(1, segments):
        tt = t64[i] @ tt
    return transfers, states, np.stack(ref_states), tt


def run_all(out_dir, length, budget_s, sections=ALL_SECTIONS):
    """Every kernel section in one run, one table (Qwen3.5 / Kimi shapes, batch 1, bf16
    inputs, float32 state). Errors are relative to the core in float32 HIGHEST on the same bf16-rounded inputs.

    Sections: GDN forward per solve variant (and +TS); the chunk-local kernel alone per solve (the measured
    bottleneck); KDA and GLA (per-key gates, 32 q/k heads as in Kimi-Linear); packed segments (64 uneven segments
    with their dense (T, S)) against the vmapped pure-JAX reference and the unsegmented forward. fla rows are
    read from DIR/fla.jsonl when a --fla-only run wrote it first.
    """
    import jax
    import jax.numpy as jnp

    start = time.perf_counter()
    path = os.path.join(out_dir, "all.jsonl")
    log(path, dict(jax=jax.__version__, devices=[str(d) for d in jax.devices()], date=time.strftime("%Y-%m-%d")))
    over = lambda: time.perf_counter() - start > budget_s  # noqa: E731
    scale = DIM**-0.5
    group = HEADS // KEY_HEADS
    rows = []
    fla = {}
    fla_path = os.path.join(out_dir, "fla.jsonl")
    if os.path.exists(fla_path):
        with open(fla_path) as f:
            for line in f:
                rec = json.loads(line)
                if rec.get("L") == length and "ms" in rec:
                    fla.setdefault(rec["impl"], rec["ms"])

    def record(section, name, fn, args, ref=None, tokens=length, fla_name=None, nbytes=None):
        if over():
            log(path, dict(skipped=name, reason="time budget"))
            return
        try:
            ms, comp = timeit(fn, *args)
            rec = dict(section=section, impl=name, L=tokens, ms=ms, compile_s=comp, Mtok_s=tokens / ms / 1e3)
            if nbytes is not None:
                rec["TBs"] = nbytes / ms / 1e9
            if fla_name in fla:
                rec["vs_fla"] = fla[fla_name] / ms
            if ref is not None:
                got = fn(*args)
                rec.update({key: rel(pick(got), want) for key, (pick, want) in ref.items()})
            log(path, rec)
            rows.append(rec)
        except Exception as e:  # noqa: BLE001
            log(path, dict(section=section, impl=name, error=repr(e)[:600]))

    b16 = dict(locals_precision="bf16", state_precision="bf16", state_lowering="triton", locals_lowering="triton")
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    rep = lambda x: jnp.repeat(up(x), group, 1)  # noqa: E731

    if "gdn" in sections or "locals" in sections:  # 1-2. GDN forward, 16 key heads -> 32 value heads
        _all_gdn(record, sections, length, *gdn_inputs(length), scale, group, b16, up, rep)
    if "per-key" in sections:
        _all_per_key(record, length, scale, group, b16, up)
    if "varlen" in sections:
        _all_varlen(record, length, scale, b16)
    if "steps" in sections:
        _all_steps(record, length, *gdn_inputs(length), scale, up, rep)
    log(path, dict(done=True, elapsed_s=time.perf_counter() - start))
    _all_table(rows, fla, length)


def _all_gdn(record, sections, length, q, k, v, g, beta, scale, group, b16, up, rep):
    """run_all 1-2: the GDN forward per solve variant (+TS), then the chunk-local kernel alone per solve."""
    import jax
    import jax.numpy as jnp

    from hypic_jax.core import linear_attn as la
    from hypic_jax.kernels import gdn
    from hypic_jax.kernels.gdn.common import chunk_cumsum
    C = named_config
    if "gdn" in sections:
        ref_o, ref_s = jax.jit(lambda q, k, v, g, b: la.chunked(rep(q), rep(k), up(v), g=g, beta=b, scale=scale))(
            q, k, v, g, beta)
        ref = {"o": (lambda r: r[0], ref_o), "state": (lambda r: r[1], ref_s)}
        record("gdn", "xla chunked", jax.jit(lambda q, k, v, g, b: la.chunked(
            jnp.repeat(q, group, 1), jnp.repeat(k, group, 1), v, g=g, beta=b, scale=scale)), (q, k, v, g, beta),
            ref, fla_name="fla chunk_gated_delta_rule")
        for name, (cfg, emit) in variants().items():
            if " s3" not in name or not any(x in name for x in ("rows", "doubling", "tile")):
                continue
            fn = jax.jit(lambda q, k, v, g, b, cfg=cfg, emit=emit: gdn.gdn_forward(
                q, k, v, g=g, beta=b, scale=scale, config=cfg, emit_summary=emit, interpret=INTERPRET))
            record("gdn", name, fn, (q, k, v, g, beta), ref, fla_name="fla chunk_gated_delta_rule")
        del ref_o, ref_s
    if "locals" not in sections:
        return
    # 2. The chunk-local kernel alone, per solve.
    for solve in ("rows", "doubling", "tile"):
        for chunk in (64, 32):
            cfg = C(chunk=chunk, solve=solve, **b16)
            b = chunk_cumsum(g, length, HEADS, chunk)
            fn = jax.jit(lambda q, k, v, b, bt, cfg=cfg: gdn.chunk_locals(
                q, k, v, b, bt, chunk=cfg.chunk, scale=scale, inter_dtype=jnp.bfloat16, config=cfg,
                interpret=INTERPRET))
            record("locals", f"locals {solve} c{chunk}", fn, (q, k, v, b, beta.T))


def _all_per_key(record, length, scale, group, b16, up):
    """run_all 3: per-key gates (KDA with beta, GLA without), q/k at 32 heads."""
    import jax
    import jax.numpy as jnp

    from hypic_jax.core import linear_attn as la
    from hypic_jax.kernels import gdn
    C = named_config
    # 3. Per-key gates (KDA with beta, GLA without), q/k at 32 heads.
    ks = jax.random.split(jax.random.PRNGKey(3), 2)
    q, k, v, _, beta = gdn_inputs(length, seed=2)
    q, k = jnp.repeat(q, group, 1), jnp.repeat(k, group, 1)
    gk = -jax.random.uniform(ks[0], (length, HEADS, DIM), jnp.float32) * 0.1
    for family, bt, fla_name in (("kda", beta, "fla chunk_kda"), ("gla", None, "fla chunk_gla")):
        ref_o, ref_s = jax.jit(lambda q, k, v, gk, b: la.chunked(up(q), up(k), up(v), gk=gk, beta=b, scale=scale))(
            q, k, v, gk, bt)
        ref = {"o": (lambda r: r[0], ref_o), "state": (lambda r: r[1], ref_s)}
        record(family, "xla chunked", jax.jit(lambda q, k, v, gk, b: la.chunked(q, k, v, gk=gk, beta=b,
                                                                                scale=scale)),
               (q, k, v, gk, bt), ref, fla_name=fla_name)
        # chunk 64 with rows or doubling overflows the H200's shared memory with per-key gates (measured)
        for name, cfg in (("pallas doubling c32 bv32 bf16 s3", C(chunk=32, solve="doubling", **b16)),
                          ("pallas tile c32 bv32 bf16 s3", C(chunk=32, solve="tile", **b16)),
                          ("pallas rows c32 bv32 bf16 s3", C(chunk=32, solve="rows", **b16)),
                          ("pallas doubling bv32 bf16 s3", C(solve="doubling", **b16)),
                          ("pallas rows bv32 bf16 s3", C(solve="rows", **b16))):
            if bt is None and "rows" in name:
                continue  # no solve without the delta rule
            fn = jax.jit(lambda q, k, v, gk, b, cfg=cfg: gdn.gdn_forward(
                q, k, v, gk=gk, beta=b, scale=scale, config=cfg, interpret=INTERPRET))
            record(family, name, fn, (q, k, v, gk, bt), ref, fla_name=fla_name)


def _all_varlen(record, length, scale, b16):
    """run_all 4: packed segments (64 uneven ones): the unsegmented forward on the same tokens, then outputs and
    each segment's dense (T, S) from the widened state (`gdn.default_varlen_config`) with q, k, v read in place
    (`GDNConfig.packed_reads`, the default) and gathered into the chunk-aligned layout, final states only both
    ways, then the transfer pass over groups of 64, 16 and 8 chunks and the rows without the prefetch.
    Rows whose names lack "packed reads" gather."""
    import jax
    import jax.numpy as jnp

    from hypic_jax.core import linear_attn as la
    from hypic_jax.kernels import gdn
    from hypic_jax.kernels.gdn import GDNConfig
    segments = min(64, max(2, length // 16))
    cu_list = varlen_offsets(length, segments)
    cu = jnp.asarray(cu_list, jnp.int32)
    max_len = max(b - a for a, b in zip(cu_list[:-1], cu_list[1:]))
    q, k, v, g, beta = gdn_inputs(length, seed=4)
    ref_o, ref_sum = jax.jit(lambda q, k, v, cu, g, b: la.varlen_reference(
        q, k, v, cu, g=g, beta=b, scale=scale, max_len=max_len, chunk_size=64))(q, k, v, cu, g, beta)
    ref = {"o": (lambda r: r[0], ref_o), "S": (lambda r: r[1].state, ref_sum.state),
           "T": (lambda r: r[1].transfer, ref_sum.transfer)}
    record("varlen", f"xla vmapped reference ({segments} segments)", jax.jit(
        lambda q, k, v, cu, g, b: la.varlen_reference(q, k, v, cu, g=g, beta=b, scale=scale, max_len=max_len,
                                                      chunk_size=64)), (q, k, v, cu, g, beta), ref,
           fla_name="fla chunk_gated_delta_rule varlen")
    pf = dict(b16, state_prefetch=True)  # the Triton default launch (tile solve, chunk 64, prefetch)
    gat = dict(pf, packed_reads=False)  # q, k, v gathered into the chunk-aligned layout, o gathered back
    ref_states = {"o": (lambda r: r[0], ref_o), "S": (lambda r: r[1], ref_sum.state)}
    rows = (  # name -> (config, emit (T, S)); the default (packed reads, widened T) and its gathering twin first
        ("pallas packed reads +TS widened", GDNConfig(transfer_group=0, **pf), True),
        ("pallas tile c64 lw4 prefetch +TS widened", GDNConfig(transfer_group=0, **gat), True),
        ("pallas packed reads (states only)", GDNConfig(**pf), False),
        ("pallas tile c64 lw4 prefetch (states only)", GDNConfig(**gat), False),
        ("pallas packed reads +TS group64", GDNConfig(transfer_group=64, **pf), True),
        ("pallas tile c64 lw4 prefetch +TS group64", GDNConfig(transfer_group=64, **gat), True),
        ("pallas tile c64 lw4 prefetch +TS group16", GDNConfig(transfer_group=16, **gat), True),
        ("pallas tile c64 lw4 prefetch +TS group8", GDNConfig(transfer_group=8, **gat), True),
        ("pallas tile c64 lw4 +TS widened (no prefetch)",
         GDNConfig(transfer_group=0, state_prefetch=False, packed_reads=False, **b16), True),
        ("pallas tile c64 lw4 (states only, no prefetch)",
         GDNConfig(state_prefetch=False, packed_reads=False, **b16), False),
    )
    cfg = GDNConfig(**pf)
    fn = jax.jit(lambda q, k, v, g, b: gdn.gdn_forward(q, k, v, g=g, beta=b, scale=scale, config=cfg,
                                                       interpret=INTERPRET))
    record("varlen", "pallas tile c64 lw4 prefetch, unsegmented (baseline)", fn, (q, k, v, g, beta))
    for name, tcfg, emit in rows:
        fn = jax.jit(lambda q, k, v, cu, g, b, tcfg=tcfg, emit=emit: gdn.gdn_varlen(
            q, k, v, cu, g=g, beta=b, scale=scale, config=tcfg, emit_summary=emit, interpret=INTERPRET))
        record("varlen", name, fn, (q, k, v, cu, g, beta), ref if emit else ref_states,
               fla_name="fla chunk_gated_delta_rule varlen")
    # per-key gates (KDA: `default_varlen_config(per_key=True)`), in place against gathered, timed only: the
    # float32 per-key reference compiles for minutes at this length (the CPU tests check these paths)
    gk = -jax.random.uniform(jax.random.PRNGKey(5), g.shape + (q.shape[-1],), jnp.float32) * 0.1
    kda = gdn.default_varlen_config(per_key=True)
    for name, tcfg, emit in (("kda packed reads +TS widened", kda, True),
                             ("kda gathered +TS widened", dataclasses.replace(kda, packed_reads=False), True),
                             ("kda packed reads (states only)", kda, False),
                             ("kda gathered (states only)", dataclasses.replace(kda, packed_reads=False), False)):
        fn = jax.jit(lambda q, k, v, cu, gk, b, tcfg=tcfg, emit=emit: gdn.gdn_varlen(
            q, k, v, cu, gk=gk, beta=b, scale=scale, config=tcfg, emit_summary=emit, interpret=INTERPRET))
        record("varlen", name, fn, (q, k, v, cu, gk, beta), fla_name="fla chunk_kda varlen")


def step_variants():
    """run_all 6: the library's launches (chunk 64, tile solve, 4-warp chunk-local kernel; on Hopper `GDNConfig()`
    is "tile c64 lw4 mosaic both", both kernels under Mosaic GPU; "prefetch" is the same launch in Triton), emitting
    (T, S) through the transfer pass (`GDNConfig.transfer_group`, 64-chunk groups; "tf32 f32-inter" = tf32 dots and
    float32 W, U, P, the cache-grade T), and KDA (`default_config(per_key=True)`, less the prefetch, is the chunk-16
    row); name -> (config, emit (T, S), per-key gates), every config spelled out so that a name keeps its meaning
    when defaults change. Variants measured slower and removed (output folds, shared key heads, stacked doubling
    levels, several chunks per chunk-local program) are listed in bench/RESULTS.md with the commits that hold them.
    Priority order: a run cut by its budget drops the last ones."""
    from hypic_jax.kernels.gdn import GDNConfig

    b16 = dict(locals_precision="bf16", state_precision="bf16", state_lowering="triton", locals_lowering="triton")
    C = lambda **kw: GDNConfig(**{**b16, **kw})  # noqa: E731
    c32 = dict(chunk=32, solve="tile", locals_warps=2, state_prefetch=False)
    c64 = dict(chunk=64, solve="tile", locals_warps=4, state_prefetch=False)
    kda = dict(solve="doubling", locals_warps=2, state_prefetch=False)
    return {
        # both kernels in Triton, the state pass's small loads one step ahead (the Triton default)
        "tile c64 lw4 prefetch": (C(**{**c64, "state_prefetch": True}), False, False),
        "tile c64 lw4 prefetch +TS group64": (C(**{**c64, "state_prefetch": True}, transfer_group=64), True, False),
        # the same with the state pass under Mosaic GPU (`gdn.mosaic_state.state_pass_mgpu`)
        "tile c64 lw4 mosaic": (C(**c64, state_lowering="mosaic"), False, False),
        "tile c64 lw4 mosaic +TS group64": (C(**c64, state_lowering="mosaic", transfer_group=64), True, False),
        # both launches under Mosaic GPU (`gdn.mosaic_chunk_local.chunk_locals_mgpu` and the state pass): `GDNConfig()`
        # on Hopper
        "tile c64 lw4 mosaic both": (C(**c64, state_lowering="mosaic", locals_lowering="mosaic"), False, False),
        "tile c64 lw4 mosaic both +TS group64": (C(**c64, state_lowering="mosaic", locals_lowering="mosaic",
                                                   transfer_group=64), True, False),
        # the Mosaic GPU state pass without clusters (each column block reads its own W, K, Q, P)
        "tile c64 lw4 mosaic c1": (C(**c64, state_lowering="mosaic", state_cluster=1), False, False),
        # the same with q, k, v zero-padded to whole chunks when L is not a multiple of 64 (before packed reads)
        "tile c64 lw4 prefetch pad": (C(**{**c64, "state_prefetch": True}, packed_reads=False), False, False),
        "tile c64 lw4 prefetch +TS group64 pad": (C(**{**c64, "state_prefetch": True}, transfer_group=64,
                                                    packed_reads=False), True, False),
        # the Triton launch without the prefetch
        "tile c64 lw4": (C(**c64), False, False),
        "tile c64 lw4 +TS group64": (C(**c64, transfer_group=64), True, False),
        # a decay-only layer (g, no beta: the chunk-local kernel forms P only)
        "decay tile c64 lw4": (C(**c64), False, "decay"),
        "tile c64 lw4 bv64": (C(**c64, block_v=64), False, False),
        "tile c64 lw4 +TS group64 tf32 f32-inter": (C(**c64, transfer_group=64, inter_dtype="float32",
                                                      locals_precision="tf32", state_precision="tf32"), True, False),
        # chunk 128: half the state pass's sequential steps; one state stage (two exceed the shared memory)
        "tile c128 lw8 ss1": (C(chunk=128, solve="tile", locals_warps=8, state_stages=1), False, False),
        "doubling c128 sub64 lw4 ss1": (C(chunk=128, solve="doubling", sub=64, locals_warps=4, state_stages=1),
                                        False, False),
        "doubling c128 sub64 lw8 ss1": (C(chunk=128, solve="doubling", sub=64, locals_warps=8, state_stages=1),
                                        False, False),
        "KDA doubling c16": (C(chunk=16, **kda), False, True),
        "KDA doubling c16 pad": (C(chunk=16, **kda, packed_reads=False), False, True),  # odd lengths: copies
        "KDA doubling c16 +TS group16": (C(chunk=16, **kda, transfer_group=16), True, True),
        # other transfer groups and chunk 32, last: they run only when the budget allows
        "tile c32 lw2": (C(**c32), False, False),
        "tile c64 lw4 +TS group16": (C(**c64, transfer_group=16), True, False),
        "tile c64 lw4 +TS group32": (C(**c64, transfer_group=32), True, False),
        "tile c64 lw4 +TS widened": (C(**c64, transfer_group=0), True, False),
        "tile c32 lw2 +TS group32": (C(**c32, transfer_group=32), True, False),
        "KDA doubling c32": (C(chunk=32, **kda), False, True),
        "KDA doubling c32 +TS group16": (C(chunk=32, **kda, transfer_group=16), True, True),
        "KDA doubling c32 +TS widened": (C(chunk=32, **kda, transfer_group=0), True, True),
    }


SPLIT = ("tile c64 lw4 prefetch +TS group64",)
ONLY = set()  # --only: run_all's steps section times these step_variants names only (default: all)
STEP_LENGTHS = ()  # --step-lengths: other lengths at which LENGTH_VARIANTS are timed after the split
LENGTH_VARIANTS = ("tile c64 lw4 prefetch", "tile c64 lw4 prefetch +TS group64")


def _step_args(per_key, q, k, v, g, gk, beta):
    """The (q, k, v, g, gk, beta) a `step_variants` kind takes: True = KDA (q, k repeated to the value heads, as in
    Kimi-Linear, and per-key gates gk), "decay" = g only (no beta), False = Gated DeltaNet."""
    import jax.numpy as jnp

    if per_key is True:
        group = v.shape[1] // k.shape[1]
        return jnp.repeat(q, group, 1), jnp.repeat(k, group, 1), v, None, gk, beta
    return q, k, v, g, None, None if per_key == "decay" else beta


def _all_steps(record, length, q, k, v, g, beta, scale, up, rep):
    """run_all 6: the GDN (and KDA) forward at each `step_variants` entry, errors vs the float32 core; T and S of
    the emitting ones on slow gates; then the chunk-local kernel, the state pass and the transfer pass alone for
    `SPLIT`: where the time goes."""
    import jax
    import jax.numpy as jnp

    from hypic_jax.core import linear_attn as la
    from hypic_jax.kernels import gdn
    from hypic_jax.kernels.gdn import mosaic_state
    from hypic_jax.kernels.gdn.chunk_local import chunk_local_pass
    from hypic_jax.kernels.gdn.state import mosaic_state_config, state_pass, transfer_pass
    gk = -jax.random.uniform(jax.random.PRNGKey(3), (length, HEADS, DIM), jnp.float32) * 0.1
    refs = {}
    variants_ = step_variants()
    for name, (cfg, emit, per_key) in variants_.items():
        if ONLY and name not in ONLY:
            continue
        if per_key not in refs:  # per_key: True (KDA), False (GDN) or "decay" (g only, no beta)
            args = _step_args(per_key, q, k, v, g, gk, beta)
            ro, rs = jax.jit(lambda q, k, v, g, gk, b: la.chunked(rep(q) if q.shape[1] != HEADS else up(q),
                                                                  rep(k) if k.shape[1] != HEADS else up(k), up(v),
                                                                  g=g, gk=gk, beta=b, scale=scale))(*args)
            refs[per_key] = (args, {"o": (lambda r: r[0], ro), "state": (lambda r: r[1], rs)})
        args, ref = refs[per_key]
        fn = jax.jit(lambda q, k, v, g, gk, b, cfg=cfg, emit=emit: gdn.gdn_forward(
            q, k, v, g=g, gk=gk, beta=b, scale=scale, config=cfg, emit_summary=emit, interpret=INTERPRET))
        record("steps", name, fn, args, ref, fla_name={True: "fla chunk_kda", False: "fla chunk_gated_delta_rule"}.get(
            per_key))
    # (T, S(C|0)) of the emitting variants: at 32k the fast gates above drive T to 0, so check T on 4k tokens with
    # slow gates (g, gk = -U(0, 1e-3)) against `linear_attn.summarize` in float32.
    slow_len = min(length, 4096)  # per-key gates: 1,024 (the float32 per-key summary compiled for minutes at 4k)
    gate_keys = jax.random.split(jax.random.PRNGKey(5), 2)
    sq, sk, sv, _, sbeta = gdn_inputs(slow_len, seed=6)
    sg = -jax.random.uniform(gate_keys[0], (slow_len, HEADS), jnp.float32) * 1e-3
    sgk = -jax.random.uniform(gate_keys[1], (slow_len, HEADS, DIM), jnp.float32) * 1e-3
    slow_refs = {}
    for name, (cfg, emit, per_key) in variants_.items():
        if not emit or (ONLY and name not in ONLY):
            continue
        if per_key not in slow_refs:
            args = _step_args(per_key, sq, sk, sv, sg, sgk, sbeta)
            if per_key is True:
                args = tuple(None if x is None else x[:min(slow_len, 1024)] for x in args)
            summ = jax.jit(lambda k, v, g, gk, b: la.summarize(rep(k) if k.shape[1] != HEADS else up(k), up(v), g=g,
                                                               gk=gk, beta=b))(*args[1:])
            slow_refs[per_key] = (args, {"T": (lambda r: r[2].transfer, summ.transfer),
                                         "S": (lambda r: r[2].state, summ.state)})
        args, ref = slow_refs[per_key]
        fn = jax.jit(lambda q, k, v, g, gk, b, cfg=cfg: gdn.gdn_forward(
            q, k, v, g=g, gk=gk, beta=b, scale=scale, config=cfg, emit_summary=True, interpret=INTERPRET))
        record("steps T check", f"{name} (L={args[1].shape[0]}, slow gates)", fn, args, ref, tokens=args[1].shape[0])
    refs.clear()
    slow_refs.clear()
    for name in SPLIT:
        if ONLY and name not in ONLY:
            continue
        cfg, _, per_key = variants_[name]
        cfg = cfg.resolved(jnp.bfloat16)
        args = _step_args(per_key, q, k, v, g, gk, beta)
        whole = length // cfg.chunk * cfg.chunk  # the kernels alone take chunk-aligned tokens
        args = tuple(None if x is None else x[:whole] for x in args)
        locals_fn = jax.jit(lambda q, k, v, g, gk, b, cfg=cfg: chunk_local_pass(q, k, v, g, gk, b, scale=scale,
                                                                                config=cfg, interpret=INTERPRET))
        record("steps", f"locals only: {name}", locals_fn, args)
        b, p, w, u, ks, qs = locals_fn(*args)
        init = jnp.zeros((1, HEADS, DIM, DIM), jnp.float32)
        if cfg.state_lowering == "mosaic":
            state_fn = jax.jit(lambda w, u, k, b, q, p, init, cfg=cfg: mosaic_state.state_pass_mgpu(
                w, u, k, b, q, p, init[0], chunk=cfg.chunk, out_dtype=jnp.bfloat16, scale=scale,
                config=mosaic_state_config(cfg), interpret=INTERPRET))
        else:
            state_fn = jax.jit(lambda w, u, k, b, q, p, init, cfg=cfg: state_pass(
                w, u, k, b, q, p, init, chunk=cfg.chunk, pieces=1, value_dim=DIM, out_dtype=jnp.bfloat16,
                scale=scale, config=cfg, interpret=INTERPRET))
        record("steps", f"state pass only: {name}", state_fn, (w, u, ks, b, qs, p, init))
        if cfg.transfer_group:
            transfer_fn = jax.jit(lambda w, k, b, cfg=cfg: transfer_pass(
                w, k, b, chunk=cfg.chunk, group=cfg.transfer_group, config=cfg, interpret=INTERPRET))
            record("steps", f"transfer pass only: {name}", transfer_fn, (w, ks, b))
        del b, p, w, u, ks, qs
    for other in STEP_LENGTHS:  # the default and its variants at other lengths (no error check: timing only)
        oq, ok, ov, og, obeta = gdn_inputs(other)
        ogk = -jax.random.uniform(jax.random.PRNGKey(3), (other, HEADS, DIM), jnp.float32) * 0.1
        for name in LENGTH_VARIANTS:
            cfg, emit, per_key = variants_[name]
            args = _step_args(per_key, oq, ok, ov, og, ogk, obeta)
            fn = jax.jit(lambda q, k, v, g, gk, b, cfg=cfg, emit=emit: gdn.gdn_forward(
                q, k, v, g=g, gk=gk, beta=b, scale=scale, config=cfg, emit_summary=emit, interpret=INTERPRET))
            record("steps", f"{name} (L={other})", fn, args, tokens=other)
        del oq, ok, ov, og, obeta, ogk


def _all_table(rows, fla, length):
    """run_all's one table."""
    print(f"\n| section | implementation | L | ms | Mtok/s | vs fla | errors |\n|---|---|---|---|---|---|---|")
    for r in rows:
        errs = " ".join(f"{key} {r[key]:.2e}" for key in ("o", "state", "S", "T") if key in r)
        extra = f" ({r['TBs']:.2f} TB/s state)" if "TBs" in r else ""
        vs = f"{r['vs_fla']:.2f}" if "vs_fla" in r else ""
        print(f"| {r['section']} | {r['impl']}{extra} | {r['L']} | {r['ms']:.3f} | {r['Mtok_s']:.2f} | {vs} | {errs} |")
    for name, ms in fla.items():
        print(f"| fla | {name} | {length} | {ms:.3f} | {length / ms / 1e3:.2f} | 1.00 | |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    ap.add_argument("--fla-only", action="store_true")
    ap.add_argument("--lengths", default="8192,32768,131072")
    ap.add_argument("--check-length", type=int, default=32768)
    ap.add_argument("--budget-s", type=float, default=380.0, help="stop starting new timings after this long")
    ap.add_argument("--only", default="", help="comma-separated variant names (default: all; with --all: the steps "
                    "section's step_variants names)")
    ap.add_argument("--focus", action="store_true", help="Triton fold and per-kernel measurements (see run_focus)")
    ap.add_argument("--all", action="store_true", help="every kernel variant in one run and one table (run_all)")
    ap.add_argument("--sections", nargs="+", default=list(ALL_SECTIONS), choices=ALL_SECTIONS,
                    help="run_all's sections (default: all)")
    ap.add_argument("--step-lengths", default="", help="steps section: also time LENGTH_VARIANTS at these lengths")
    ap.add_argument("--length-variants", default="", help="steps section: the step_variants names timed at "
                    "--step-lengths (default: the LENGTH_VARIANTS tuple)")
    ap.add_argument("--split", default="", help="steps section: step_variants names timed kernel by kernel "
                    "(default: the SPLIT tuple)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU check of the script)")
    args = ap.parse_args()
    global HEADS, KEY_HEADS, DIM, INTERPRET, COMPOSE, STEP_LENGTHS, ONLY, SPLIT, LENGTH_VARIANTS
    LENGTH_VARIANTS = tuple(x for x in args.length_variants.split(",") if x) or LENGTH_VARIANTS
    SPLIT = tuple(x for x in args.split.split(",") if x) or SPLIT
    STEP_LENGTHS = tuple(int(x) for x in args.step_lengths.split(",") if x)
    ONLY = {x for x in args.only.split(",") if x}
    if args.smoke:
        HEADS, KEY_HEADS, DIM, INTERPRET, COMPOSE = 4, 2, 16, True, (5, 2, 40)
    os.makedirs(args.out, exist_ok=True)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    if args.fla_only:
        run_fla(args.out, lengths)
    elif args.focus:
        run_focus(args.out, args.budget_s)
    elif args.all:
        run_all(args.out, args.check_length if not args.smoke else 128, args.budget_s, tuple(args.sections))
    else:
        run_jax(args.out, lengths, args.check_length, args.budget_s, [x for x in args.only.split(",") if x])


if __name__ == "__main__":
    main()
