"""The fold over a request's pieces (`stitch._fold_pieces`) in each of its implementations, on one layer's worth
of random pieces at the engine's shapes: 32 heads of 128 x 128 states, dense transfers, a pool of 188 rows, and
piece capacities of 66 (32 documents: seam and cached piece each, plus the query) and 258 (128 segments), every
piece in use, a fresh summary for every fresh piece, bf16x3 products (the engine's on a GPU).

Variants: the XLA loop ("xla"), the Pallas kernel (`pallas.piece_fold`, launch parameters varied) and the blocked
fold without a loop bound by data (`stitch._blocked_fold`, block sizes varied). Prints per variant the ms per
call (20 calls dispatched back to back, then one wait: what a step of a compiled program costs, without the host's
dispatch) and the largest difference to the float32 XLA loop relative to its largest entry. One JSON line each.

Then the same requests through `pallas.piece_fold.chunk_fold`, which takes each fresh piece as chunk steps (8-token
seams and a 64-token query in chunks of 16) and emits the fresh tokens' outputs instead of incoming states: what
it replaces in a stitched request is the fold above plus the two passes over the fresh tokens (the fresh pieces'
summaries, then the outputs from the incoming states), which `bench/rag_trace.py --profile-dir` times in place.
Its error is against `chunk_fold_reference` (float32, HIGHEST).

    python3 -m bench.investigations.piece_fold [--pieces 66 258] [--heads 32] [--blocked]
"""
import argparse
import json
import time
import types

import jax
import jax.numpy as jnp
import numpy as np

from hypic_jax.stitch import layout as lay
from hypic_jax import stitch
from hypic_jax.core.linear_attn import Summary
from hypic_jax.kernels import piece_fold

parser = argparse.ArgumentParser()
parser.add_argument("--pieces", type=int, nargs="+", default=[66, 258])
parser.add_argument("--heads", type=int, default=32)
parser.add_argument("--rows", type=int, default=188)
parser.add_argument("--calls", type=int, default=20)
parser.add_argument("--blocked", action="store_true", help="also the blocked folds (slower on the H200)")
args = parser.parse_args()
rng = np.random.default_rng(0)
H, K, V, P = args.heads, 128, 128, args.rows


def transfers(n):  # contractive, like a product of gated delta-rule steps
    return jnp.asarray(rng.normal(size=(n, H, K, K)) / np.sqrt(4 * K), jnp.float32)


def states(n):
    return jnp.asarray(rng.normal(size=(n, H, K, V)), jnp.float32)


def timed(fn, *operands):
    out = fn(*operands)
    jax.block_until_ready(out)
    start = time.perf_counter()
    for _ in range(args.calls):
        out = fn(*operands)
    jax.block_until_ready(out)
    return out, (time.perf_counter() - start) / args.calls * 1e3


pool = Summary("dense", states(P), transfers(P))
for num in args.pieces:
    kind = np.where(np.arange(num) % 2 == 0, lay.PIECE_FRESH, lay.PIECE_CACHED)  # seam, cached, seam, ... query
    kind[-1] = lay.PIECE_FRESH
    reset = np.zeros(num, bool)
    reset[0] = True
    arrays = dict(  # operands, not constants of the programs (XLA would fold them at compile time)
        piece_kind=jnp.asarray(kind, jnp.int32), piece_slot=jnp.asarray(rng.integers(0, P, num), jnp.int32),
        piece_reset=jnp.asarray(reset), num_pieces=jnp.int32(num), drop_transfer=jnp.asarray(False),
        piece_offset=jnp.zeros(num, jnp.int32))
    fresh = Summary("dense", states(num), transfers(num))

    def fold(impl, algorithm, block=None):
        def run(pool, fresh, arrays):
            return stitch._fold_pieces(pool, types.SimpleNamespace(**arrays), "dense", fresh, None, algorithm,
                                       (H, K, V), impl, block)
        return jax.jit(run)

    def kernel(warps, width, stages, algorithm="bf16x3"):
        def run(pool, fresh, arrays):
            return piece_fold.piece_fold(
                "dense", arrays["piece_kind"], arrays["piece_slot"], arrays["piece_reset"], arrays["num_pieces"],
                arrays["drop_transfer"], pool.transfer, pool.state, fresh.transfer, fresh.state, algorithm=algorithm,
                block_w=width, num_warps=warps, num_stages=stages)
        return jax.jit(run)

    variants = [("xla f32", fold("xla", None)), ("xla", fold("xla", "bf16x3"))]
    for warps, width, stages in [(4, 32, 1), (8, 32, 1), (4, 16, 1), (8, 64, 1), (4, 32, 2), (8, 32, 2)]:
        variants.append((f"pallas warps={warps} block_w={width} stages={stages}", kernel(warps, width, stages)))
    for warps, width in [(8, 32), (4, 32), (4, 16)]:  # float32 products (FMA, no tensor cores)
        variants.append((f"pallas f32 warps={warps} block_w={width}", kernel(warps, width, 1, None)))
    for block in (None, 4, 8, 12, 16, 24) if args.blocked else ():
        variants.append((f"blocked block={block or round(num ** 0.5)}", fold("blocked", "bf16x3", block)))
    reference = None
    for name, fn in variants:
        try:
            out, ms = timed(fn, pool, fresh, arrays)
        except Exception as error:  # noqa: BLE001  (a launch configuration that does not fit: report, go on)
            print(json.dumps(dict(pieces=num, variant=name, error=f"{type(error).__name__}: {str(error)[:200]}")),
                  flush=True)
            continue
        reference = out if reference is None else reference
        err = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(out, reference))
        print(json.dumps(dict(pieces=num, heads=H, variant=name, ms=round(ms, 3), rel_err=float(f"{err:.2e}"))),
              flush=True)

    # the chunk fold: each fresh piece one chunk of 16 rows (a seam of 8 tokens), the query 4 chunks
    c = 16
    per_piece = np.where(kind == lay.PIECE_FRESH, 1, 0)
    per_piece[-1] = 4
    piece_chunks = np.concatenate([[0], np.cumsum(per_piece)]).astype(np.int32)
    chunks = int(piece_chunks[-1])
    rows_used = np.zeros((chunks, c), bool)
    rows_used[:, :8] = True
    rows_used[-4:] = True
    mask = jnp.asarray(rows_used)[:, None, :, None]
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    operands = dict(w=normal(chunks, H, c, K) / np.sqrt(K) * mask, u=normal(chunks, H, c, V) * mask,
                    k_to_end=normal(chunks, H, c, K) / np.sqrt(K) * mask,
                    decay=jnp.asarray(rng.uniform(0.9, 1.0, (chunks, H, K)), jnp.float32),
                    q_decayed=normal(chunks, H, c, K) * mask, scores=normal(chunks, H, c, c) * mask)
    tables = (arrays["piece_kind"], arrays["piece_slot"], arrays["piece_reset"], arrays["num_pieces"],
              arrays["drop_transfer"], jnp.asarray(piece_chunks))
    want_final, want_out = piece_fold.chunk_fold_reference(
        "dense", kind, np.asarray(arrays["piece_slot"]), reset, num, False, piece_chunks, pool.transfer, pool.state,
        **operands)
    launches = [(8, 32, "bf16x3", "same"), (4, 32, "bf16x3", "same"), (8, 64, "bf16x3", "same"),
                (8, 32, "bf16x3", None), (8, 32, "bf16x3", "bf16"), (8, 32, None, None), (4, 32, None, None),
                (4, 16, None, None), (8, 16, None, None), (2, 16, None, None), (8, 32, "tf32x3", "same"),
                (4, 16, "bf16x3", None)]
    for warps, width, algorithm, chunk_algorithm in launches:
        name = f"chunk_fold warps={warps} block_w={width} dense={algorithm or 'f32'} chunks={chunk_algorithm or 'f32'}"
        fn = jax.jit(lambda tables, pool, operands, warps=warps, width=width, a=algorithm, ca=chunk_algorithm:
                     piece_fold.chunk_fold("dense", *tables, pool.transfer, pool.state, **operands, algorithm=a,
                                           chunk_algorithm=ca, block_w=width, num_warps=warps))
        try:
            (final, out), ms = timed(fn, tables, pool, operands)
        except Exception as error:  # noqa: BLE001
            print(json.dumps(dict(pieces=num, variant=name, error=f"{type(error).__name__}: {str(error)[:200]}")),
                  flush=True)
            continue
        err = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in
                  [(final, want_final), (out, want_out)])
        print(json.dumps(dict(pieces=num, heads=H, chunks=chunks, variant=name, ms=round(ms, 3),
                              rel_err=float(f"{err:.2e}"))), flush=True)
