"""Trial: the Gated DeltaNet forward cut into `parts` sequential pieces, each piece's chunk-local kernel launched on
a second GPU stream (`jax.experimental.compute_on`, "gpu_stream:1") so that it can run beside the previous
piece's state pass. Both launches are latency-bound at low occupancy (bench/RESULTS.md), and an SM that holds one
state-pass program (189 KB of shared memory, 166 registers a thread) still has room for one chunk-local program,
so overlapping them is the question this script measures, side by side with the one-stream forward.

Result on the H200 with jax 0.11.2 (2026-11-30, bench/RESULTS.md): XLA put the kernels on stream 1 but
scheduled each one's start right before its done, after the previous state pass, so nothing overlapped; and the
pieces' input slices and output concatenation cost 0.38 ms at 2 pieces. `OVERLAP_SCHEDULE=1` records the
scheduled order of the launches, to check a later XLA.

    python -m bench.investigations.overlap_gdn --out DIR [--length 32768] [--parts 1,2,4,8] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

import jax
import jax.numpy as jnp

from hypic_jax.core import linear_attn as la
from hypic_jax.kernels import gdn
from hypic_jax.kernels.gdn.common import chunk_cumsum
from hypic_jax.kernels.gdn.state import state_pass

HEADS, KEY_HEADS, DIM = 32, 16, 128


def _side_stream(fn, n_out, stream):
    """fn on GPU stream `stream` (0: as is): `compute_on2` where this jax has it, else the `compute_on` context
    around a jitted call (the call op carries the stream annotation)."""
    if not stream:
        return fn
    import jax.experimental.compute_on as con
    kind = f"gpu_stream:{stream}"
    import inspect

    from jax._src import core
    spaces = (core.MemorySpace.Device,) * n_out
    if hasattr(con, "compute_on2"):
        return con.compute_on2(fn, compute_type=kind, out_memory_spaces=spaces)
    if "out_memory_spaces" in inspect.signature(con.compute_on).parameters:  # later jax: the function form
        return con.compute_on(fn, compute_type=kind, out_memory_spaces=spaces)
    jitted = jax.jit(fn)

    def wrapped(*args):
        with con.compute_on(kind):
            return jitted(*args)

    return wrapped


def overlapped(q, k, v, g, beta, *, parts, stream, scale, config, interpret):
    """o, final state: `parts` pieces, each (chunk-local kernel on `stream`, then the state pass on the main one)."""
    length = k.shape[0]
    config = config.resolved(k.dtype)
    chunk = config.chunk
    piece = length // parts
    assert piece % chunk == 0, "length must split into whole-chunk parts"
    b = chunk_cumsum(g, length, HEADS, chunk)
    beta_t = beta.astype(jnp.float32).T
    state = jnp.zeros((1, HEADS, DIM, DIM), jnp.float32)
    outs = []
    for i in range(parts):
        rows = slice(i * piece, (i + 1) * piece)

        def local(q, k, v, b, bt):
            return tuple(gdn.chunk_locals(q, k, v, b, bt, chunk=chunk, scale=scale, inter_dtype=k.dtype,
                                          config=config, interpret=interpret))

        p, w, u = _side_stream(local, 3, stream)(q[rows], k[rows], v[rows], b[:, rows], beta_t[:, rows])
        o, state = state_pass(w, u, k[rows], b[:, rows], q[rows], p, state, chunk=chunk, pieces=1,
                              value_dim=DIM, out_dtype=v.dtype, scale=scale, config=config,
                              interpret=interpret)
        outs.append(o)
    return jnp.concatenate(outs), state[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--parts", default="1,2,4,8")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode")
    args = ap.parse_args()
    global HEADS, KEY_HEADS, DIM
    interpret = args.smoke
    if args.smoke:
        HEADS, KEY_HEADS, DIM = 4, 2, 16
        args.length = 256
    os.makedirs(args.out, exist_ok=True)
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    L = args.length
    q = la.l2_normalize(jax.random.normal(keys[0], (L, KEY_HEADS, DIM), jnp.float32)).astype(jnp.bfloat16)
    k = la.l2_normalize(jax.random.normal(keys[1], (L, KEY_HEADS, DIM), jnp.float32)).astype(jnp.bfloat16)
    v = jax.random.normal(keys[2], (L, HEADS, DIM), jnp.bfloat16)
    g = -jax.random.uniform(keys[3], (L, HEADS), jnp.float32) * 0.1
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (L, HEADS), jnp.float32))
    scale = DIM ** -0.5
    # the Triton state pass throughout: the pieces below run it, so the direct row does too
    base_cfg = gdn.GDNConfig(locals_precision="bf16", state_precision="bf16", state_lowering="triton")
    ref = jax.jit(lambda q, k, v, g, b: gdn.gdn_forward(q, k, v, g=g, beta=b, scale=scale, config=base_cfg,
                                                        interpret=interpret))
    ro, rs = ref(q, k, v, g, beta)
    rows = [("direct (gdn_forward)", ref)]
    for parts in [int(x) for x in args.parts.split(",")]:
        for stream in (0, 1):
            fn = jax.jit(lambda q, k, v, g, b, parts=parts, stream=stream: overlapped(
                q, k, v, g, b, parts=parts, stream=stream, scale=scale, config=base_cfg, interpret=interpret))
            rows.append((f"parts {parts} stream {stream}", fn))
    with open(os.path.join(args.out, "overlap.jsonl"), "w") as fh:
        for name, fn in rows:
            rec = {"impl": name, "L": L}
            try:
                t0 = time.perf_counter()
                o, s = jax.block_until_ready(fn(q, k, v, g, beta))
                rec["compile_s"] = time.perf_counter() - t0
                rec["o_vs_direct"] = float(jnp.linalg.norm((o - ro).astype(jnp.float32)) /
                                           jnp.linalg.norm(ro.astype(jnp.float32)))
                rec["state_vs_direct"] = float(jnp.linalg.norm(s - rs) / jnp.linalg.norm(rs))
                if "stream 1" in name and not args.smoke:
                    text = fn.lower(q, k, v, g, beta).compile().as_text()
                    rec["async_ops"] = text.count("async-start") + text.count("-start(")
                    rec["stream_attr"] = text.count("_xla_stream_annotation")
                    if os.environ.get("OVERLAP_SCHEDULE"):  # the scheduled order of the launches
                        rec["schedule"] = [ln.split("=")[0].strip()[:40] for ln in text.splitlines()
                                           if "-start" in ln or "-done" in ln or "custom-call(" in ln][:40]
                    rec["streams"] = sorted(set(re.findall(r"_xla_stream_annotation=.?\"?(\d+)", text)))
                reps = 3 if args.smoke else 30
                times = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        out = fn(q, k, v, g, beta)
                    jax.block_until_ready(out)
                    times.append((time.perf_counter() - t0) / reps * 1e3)
                rec["ms"] = min(times)
            except Exception as e:  # noqa: BLE001 - record and go on: this is a trial
                rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            print(json.dumps(rec), flush=True)
            fh.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
