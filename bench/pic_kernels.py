"""The GPU kernels of a warm PIC request, alone, at the shape of bench/pic_ttft.py's request, with their tuning
variants side by side.

A request of 64 cached 512-token documents with 8-token seams and a 64-token query on the Qwen3.5-35B-A3B shape
runs, per linear layer, a fold over 64 groups x 32 heads (`kernels.compose.prefix_fold_pallas` after an XLA
composition of each seam with its interior); and per full-attention layer the positioned attention of 576 fresh
queries (16 heads of 256) over 32,832 keys (2 KV heads) (`kernels.attention.positioned_attention`). Timing each
launch variant alone says which parameters to give the engine without a full request per variant (a cold request
compiles for minutes). Each list holds every variant timed on the H200, best first, so --budget-s decides how
many run.

Also timed, the composition benchmark ("bar"): 64 segments x 30 layers x 32 heads of dense pairs (the
composed state, the composed pair, every prefix state), at several column widths; and the MoE layer's two grouped
matmuls at the request's 576 tokens with tiling variants (`kernels.grouped_matmul.GMMConfig`). `--sections` picks
which of these run, in that order.

    python bench/pic_kernels.py --out DIR          # GPU; one JSON line per variant in DIR/pic_kernels.jsonl
    python bench/pic_kernels.py --small            # CPU smoke test (interpret mode, small shapes)

Errors are relative (Frobenius): the prefix fold against a float64 host fold, the attention against its float32
pure-JAX reference.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from linear_kernels import compose_pairs, rel, timeit

from hypic_jax.core import linear_attn as la
from hypic_jax.kernels import attention as pattn
from hypic_jax.kernels import compose as cmp


def host_prefix(t, s):
    """float64 S_i = T_i S_{i-1} + S_i over axis 0 (batch axes after it)."""
    t, s = np.asarray(t, np.float64), np.asarray(s, np.float64)
    state = np.zeros_like(s[0])
    out = []
    for i in range(t.shape[0]):
        state = t[i] @ state + s[i]
        out.append(state)
    return np.stack(out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench-out")
    parser.add_argument("--budget-s", type=float, default=240.0, help="stop starting new variants after this")
    parser.add_argument("--skip-compose-bar", action="store_true")
    parser.add_argument("--sections", nargs="+", default=["prefix", "moe", "attention", "bar"],
                        choices=["prefix", "moe", "attention", "bar"], help="which kernels to time, in order")
    parser.add_argument("--bar-kinds", nargs="*", default=None,
                        help="composition bar: only these kinds (final, pairs, prefix)")
    parser.add_argument("--small", action="store_true",
                        help="CPU smoke test: interpret mode, small shapes, one variant each")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "pic_kernels.jsonl")
    start = time.perf_counter()

    def log(record):
        print(json.dumps(record), flush=True)
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def over():
        return time.perf_counter() - start > args.budget_s

    small = args.small
    interpret = jax.default_backend() != "gpu"
    segments, keys, layers = (4, 1024, 2) if small else (64, 32832, 30)
    log(dict(jax=jax.__version__, devices=[str(d) for d in jax.devices()], date=time.strftime("%Y-%m-%d")))

    t, s, _, _ = compose_pairs(la, segments, 1, 64 if small else 512)
    t, s = t[:, 0], s[:, 0]  # [64, 32, 128, 128]
    for section in args.sections:
        if section == "prefix":
            # 1. one linear layer's prefix fold: 64 real GDN (T, S) pairs x 32 heads
            want = host_prefix(t[:, :2], s[:, :2])  # two heads suffice for the error
            # every variant timed on the H200, the best first, so a short budget still times the useful ones
            variants = [("single", None, bw, w, st) for bw, w, st in
                        [(32, 8, 3), (32, 4, 3), (64, 8, 3), (32, 4, 4), (32, 4, 2), (16, 4, 2), (16, 2, 2), (8, 2, 2),
                         (32, 2, 2), (64, 4, 2), (64, 8, 2)]]
            variants += [("blocked", b, bw, w, 2) for b, bw, w in [(0, 32, 4), (0, 16, 4), (4, 16, 4), (16, 16, 4)]]
            if small:
                variants = variants[:1]
            for kind, block, bw, warps, stages in variants:
                if over():
                    break
                config = cmp.FoldConfig(block_w=bw, num_warps=warps, num_stages=stages)
                fn = jax.jit(lambda t, s, c=config, b=block: cmp.prefix_fold_pallas(t, s, config=c, block=b,
                                                                                    interpret=interpret))
                name = dict(kernel="prefix_fold layer", fold=kind, block=block, block_w=bw, warps=warps, stages=stages)
                try:
                    ms, compile_s = timeit(fn, t, s)
                    log(dict(name, ms=round(ms, 4), us_per_step=round(1e3 * ms / segments, 2),
                             err=rel(fn(t, s)[:, :2], want), compile_s=round(compile_s, 1)))
                except Exception as error:  # noqa: BLE001 - report and go on
                    log(dict(name, error=repr(error)[:300]))
            # the seam composition that precedes the fold in the engine (T_interior (T_seam, S_seam) + S_interior), XLA
            for algorithm in ("bf16x3", None) if interpret else ("bf16x3", "tf32", None):
                first = la.Summary("dense", s, t)
                fn = jax.jit(lambda a, b, alg=algorithm: la.compose(a, b, algorithm=alg))
                ms, _ = timeit(fn, first, first)
                log(dict(kernel="group compose layer (XLA)", algorithm=algorithm or "f32", ms=round(ms, 4)))

        elif section == "moe":
            moe(log, over, small, interpret)
        elif section == "attention":
            # 2. one full-attention layer's positioned attention: 576 fresh queries over 32,832 keys
            rng = np.random.default_rng(0)
            doc = (keys - 64) // segments
            positions = np.sort(np.concatenate([doc * i + np.arange(8) for i in range(1, segments)]
                                               + [keys - 64 + np.arange(64)]))
            q = jnp.asarray(rng.standard_normal((len(positions), 16, 256)), jnp.bfloat16)
            k = jnp.asarray(rng.standard_normal((keys, 2, 256)), jnp.bfloat16)
            v = jnp.asarray(rng.standard_normal((keys, 2, 256)), jnp.bfloat16)
            pos = jnp.asarray(positions, jnp.int32)
            scale = 256**-0.5
            want = jax.jit(pattn.positioned_attention_reference, static_argnames="scale")(q, k, v, pos, scale=scale)
            reach = float(sum(p + 1 for p in positions))
            flops = 16 * reach * 256 * 4  # QK and PV, exact causal need
            # (block_q, block_k, warps, stages, target programs, pack_gqa): the unpacked launch, then the engine's
            # default (packed heads, block_q 128, 8 warps), then every other variant timed (block_k 128 exceeds
            # shared memory at this width)
            attention_variants = [(64, 64, 4, 2, 1024, False), (128, 64, 8, 2, 1024, True), (128, 64, 4, 2, 1024, True),
                                  (64, 64, 4, 2, 1024, True), (128, 64, 8, 2, 256, True), (128, 64, 8, 3, 1024, True),
                                  (64, 64, 4, 2, 1, False), (64, 64, 4, 2, 288, False), (64, 64, 4, 3, 1, False),
                                  (64, 64, 8, 2, 1, False), (64, 64, 8, 2, 256, False), (64, 64, 8, 2, 1024, False),
                                  (64, 64, 8, 3, 1, False), (64, 128, 8, 2, 1, False), (32, 64, 4, 2, 1, False),
                                  (32, 64, 4, 2, 512, False), (16, 64, 4, 2, 1, False), (128, 64, 8, 2, 1, False),
                                  (64, 32, 4, 2, 1, False), (64, 32, 2, 2, 1, False), (32, 64, 2, 2, 1, False)]
            for bq, bk, warps, stages, programs, pack in attention_variants[:2] if small else attention_variants:
                if over():
                    break
                config = pattn.AttentionConfig(block_q=bq, block_k=bk, num_warps=warps, num_stages=stages,
                                               target_programs=programs, pack_gqa=pack)
                fn = jax.jit(lambda q, k, v, p, c=config: pattn.positioned_attention(q, k, v, p, scale=scale, config=c,
                                                                                     interpret=interpret))
                name = dict(kernel="positioned_attention layer", block_q=bq, block_k=bk, warps=warps, stages=stages,
                            target_programs=programs, pack_gqa=pack)
                try:
                    ms, compile_s = timeit(fn, q, k, v, pos)
                    log(dict(name, ms=round(ms, 4), TFLOPs_needed=round(flops / ms / 1e9, 1), err=rel(fn(q, k, v, pos), want),
                             compile_s=round(compile_s, 1)))
                except Exception as error:  # noqa: BLE001
                    log(dict(name, error=repr(error)[:300]))
            del q, k, v, want

        elif section == "bar":
            # 3. the composition bar: 64 segments x 30 layers x 32 heads
            if args.skip_compose_bar or over():
                continue
            t, s, ref_states, _ = compose_pairs(la, segments, layers, 64 if small else 512)
            # "final": the composition's target output, the composed state after all 64 segments (`fold_pallas`
            # without the transfer: T and S read once, one state written); "pairs": with the composed transfer;
            # "prefix": every prefix state (what a PIC request needs). Every variant timed on the H200; --budget-s
            # may cut the tail. (The joint pair layout, measured slower and removed, is at commit 1fe9e81.)
            bar_variants = [("final", None, 128, 8, 3), ("pairs", None, 128, 8, 3), ("final", None, 128, 8, 2),
                            ("pairs", None, 64, 8, 3), ("final", None, 128, 8, 1), ("final", None, 128, 16, 1),
                            ("final", None, 128, 16, 2), ("final", None, 128, 4, 3), ("final", None, 64, 8, 2),
                            ("final", None, 64, 4, 3),
                            ("prefix", None, 128, 8, 3), ("prefix", None, 128, 8, 2), ("prefix", None, 64, 8, 2),
                            ("prefix", None, 32, 4, 2), ("prefix", 0, 32, 4, 2), ("prefix", None, 128, 4, 3)]
            variants = [v for v in bar_variants if not args.bar_kinds or v[0] in args.bar_kinds]

            for kind, block, bw, warps, stages in variants[:2] if small else variants:
                if over():
                    break
                config = cmp.FoldConfig(block_w=bw, num_warps=warps, num_stages=stages)
                args_in = (t, s)
                if kind != "prefix":  # pairs: the composed transfer too
                    fn = jax.jit(lambda t, s, c=config, p=kind != "final": cmp.fold_pallas(
                        t, s, with_transfer=p, config=c, interpret=interpret)[1][None])
                else:
                    fn = jax.jit(lambda t, s, c=config, b=block: cmp.prefix_fold_pallas(t, s, config=c, block=b,
                                                                                        interpret=interpret))
                name = dict(kernel=f"{kind} fold {segments}x{layers}x32 (composition bar)", block=block, block_w=bw,
                            warps=warps, stages=stages)
                try:
                    ms, compile_s = timeit(fn, *args_in)
                    got = fn(*args_in)[:, 0]  # layer 0 is the unpermuted one
                    worst = rel(got[-1], ref_states[-1]) if not kind.endswith("prefix") else max(
                        rel(got[i], ref_states[i]) for i in range(segments))
                    extra = {}
                    if "pairs" in kind:  # the composed transfer against the float64 product, on the
                        # first 8 segments of layer 0: all 64 multiply to ~1e-40, below float32's normal range
                        few = min(8, segments)
                        t8 = np.asarray(t[:few, 0], np.float64)
                        want = t8[0]
                        for i in range(1, few):
                            want = t8[i] @ want
                        got_t = cmp.fold_pallas(t[:few, :1], s[:few, :1], config=config, interpret=interpret)[0]
                        extra["T8_err"] = rel(got_t[0], want)
                    log(dict(name, ms=round(ms, 4), S_last=rel(got[-1], ref_states[-1]), S_worst=worst,
                             compile_s=round(compile_s, 1), **extra))
                except Exception as error:  # noqa: BLE001
                    log(dict(name, error=repr(error)[:300]))


def moe(log, over, small, interpret) -> None:
    from hypic_jax.kernels import grouped_matmul as gm

    tokens, hidden, inner, experts, top_k = (40, 64, 32, 8, 2) if small else (576, 2048, 512, 256, 8)
    rng = np.random.default_rng(2)
    ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).reshape(-1)
    sizes = jnp.asarray(np.bincount(ids, minlength=experts), jnp.int32)
    x = jnp.asarray(rng.standard_normal((tokens * top_k, hidden)), jnp.bfloat16)
    gate_up = jnp.asarray(0.02 * rng.standard_normal((experts, hidden, 2 * inner)), jnp.bfloat16)
    down = jnp.asarray(0.02 * rng.standard_normal((experts, inner, hidden)), jnp.bfloat16)
    h = jnp.asarray(rng.standard_normal((tokens * top_k, inner)), jnp.bfloat16)
    # (block_m, block_n, block_k, warps, stages): the MoE layers' launch first
    variants = [(64, 128, 64, 4, 3), (64, 128, 128, 4, 3), (64, 128, 128, 4, 4), (32, 128, 128, 4, 4),
                (16, 128, 128, 4, 4), (16, 64, 128, 4, 4), (32, 256, 64, 8, 3), (16, 256, 128, 8, 3),
                (64, 64, 128, 4, 4), (16, 128, 256, 4, 3), (32, 128, 64, 4, 5), (16, 128, 64, 4, 5)]
    # the whole routed-experts block (copy layout, two grouped matmuls, combine) with the one-hot copy layout and
    # with the sorted one (ONE_HOT_ROUTING_MAX = 0): what the routing costs around the kernels
    from hypic_jax.models import layers

    tok = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.bfloat16)
    route_w = jnp.asarray(rng.random((tokens, top_k)), jnp.float32)
    route_ids = jnp.asarray(ids.reshape(tokens, top_k), jnp.int32)
    one_hot_max = gm.layout.ONE_HOT_ROUTING_MAX
    for routing, bound in (("one-hot", one_hot_max), ("sorted", 0)):
        gm.layout.ONE_HOT_ROUTING_MAX = bound  # read at trace time, in the layout module
        fn = jax.jit(lambda a, wts, e, gu, dn: layers.grouped_swiglu_experts(a, wts, e, gu, dn, impl="pallas"))
        try:
            ms, compile_s = timeit(fn, tok, route_w, route_ids, gate_up, down)
            kernels = len(re.findall(r"^\s*\S+ = \S+ fusion\(|custom-call\(|sort\(",
                                     fn.lower(tok, route_w, route_ids, gate_up, down).compile().as_text(), re.M))
            log(dict(kernel="moe experts block", routing=routing, ms=round(ms, 4), launches_approx=kernels,
                     compile_s=round(compile_s, 1)))
        except Exception as error:  # noqa: BLE001
            log(dict(kernel="moe experts block", routing=routing, error=repr(error)[:300]))
    gm.layout.ONE_HOT_ROUTING_MAX = one_hot_max
    for bm, bn, bk, warps, stages in variants[:2] if small else variants:
        if over():
            break
        layout = gm.block_layout(sizes, tokens * top_k, bm)
        launch = dict(config=gm.GMMConfig(block_m=bm, block_n=bn if not small else 16,
                                          block_k=bk if not small else 32, num_warps=warps, num_stages=stages),
                      interpret=interpret)
        for which, rows, weights in (("gate_up", x, gate_up), ("down", h, down)):
            padded = jnp.zeros((layout.num_padded, rows.shape[1]), rows.dtype).at[layout.positions].set(rows)
            fn = jax.jit(lambda a, e, w, kw=launch: gm.gmm(a, e, w, **kw))
            name = dict(kernel=f"moe gmm {which}", block_m=bm, block_n=bn, block_k=bk, warps=warps, stages=stages)
            try:
                ms, compile_s = timeit(fn, padded, layout.block_expert, weights)
                ref = jax.lax.ragged_dot(rows, weights, sizes, preferred_element_type=jnp.float32)
                err = rel(fn(padded, layout.block_expert, weights)[layout.positions], ref)
                log(dict(name, ms=round(ms, 4), TBs=round(weights.nbytes / ms / 1e9, 2), err=err,
                         compile_s=round(compile_s, 1)))
            except Exception as error:  # noqa: BLE001
                log(dict(name, error=repr(error)[:300]))


if __name__ == "__main__":
    main()
