"""The fold over a request's pieces (`stitch._fold_pieces`) as the XLA loop and as the Pallas kernel
(`pallas.piece_fold`, float32 and bf16x3 dots) on one layer's worth of random pieces: a capacity of 40 pieces, 33 in
use, 12 pool rows, 8 heads of 128 x 128 states, dense and scalar transfers. Prints the ms per call (median-free mean
of 5, after a warm call) and the largest difference to the XLA loop in float32, relative to its largest entry.

    python3 bench/investigations/piece_fold.py
"""
import types, numpy as np, jax, jax.numpy as jnp
from hypic_jax import stitch, layout as lay
from hypic_jax.linear_attn import Summary
rng = np.random.default_rng(0)
N, P, H, K, V = 40, 12, 8, 128, 128
for form in ["dense", "scalar"]:
    tr = (lambda n: jnp.asarray(rng.normal(size=(n, H, K, K)) / np.sqrt(K), jnp.float32)) if form == "dense" else (lambda n: jnp.asarray(-rng.uniform(0, 1, (n, H)), jnp.float32))
    st = lambda n: jnp.asarray(rng.normal(size=(n, H, K, V)), jnp.float32)
    pool = Summary(form, st(P), tr(P))
    count = 33
    kind = np.where(rng.uniform(size=N) < .5, lay.PIECE_CACHED, lay.PIECE_FRESH); kind[count:] = 0
    reset = rng.uniform(size=N) < .1; reset[0] = True
    L = types.SimpleNamespace(piece_kind=jnp.asarray(kind, jnp.int32), piece_slot=jnp.asarray(rng.integers(0, P, N), jnp.int32),
        piece_reset=jnp.asarray(reset), num_pieces=jnp.int32(count), drop_transfer=jnp.asarray(False), piece_offset=jnp.zeros(N, jnp.int32))
    fresh = Summary(form, st(N), tr(N))
    res = {}
    for impl, alg in [("xla", None), ("pallas", None), ("pallas", "bf16x3")]:
        f = jax.jit(lambda: stitch._fold_pieces(pool, L, form, fresh, None, alg, (H, K, V), impl))
        out = f(); jax.block_until_ready(out)
        import time; t = time.perf_counter(); [jax.block_until_ready(f()) for _ in range(5)]; ms = (time.perf_counter() - t) / 5 * 1e3
        res[(impl, alg)] = out
        ref = res[("xla", None)]
        err = max(float(jnp.max(jnp.abs((a[:count] if a.ndim == 4 else a) - (b[:count] if b.ndim == 4 else b))) / jnp.max(jnp.abs(b))) for a, b in zip(out, ref))
        print(form, impl, alg, f"{ms:.3f} ms", "rel err vs xla f32", f"{err:.2e}", flush=True)
