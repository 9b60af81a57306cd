"""The transfer pass (the group products behind a Gated DeltaNet forward's (T_C, S)) and the cost of emitting (T_C,
S), at 32k on the H200 (Qwen3.5 shapes: 16 key -> 32 value heads of 128, bf16), in one process:

1. the group products alone on the chunk-local kernel's own operands: Mosaic GPU (`gdn.mosaic_state.transfer_pass_mgpu`)
   at 32, 64 and 128 chunks a group, with and without clusters, against Triton's (`gdn.state.state_pass` over the
   groups' identity columns, 64 chunks a group); products compared with Triton's;
2. `gdn_forward` with `GDNConfig()` without and with `emit_summary`, the added time as a ratio (target: +30%),
   and the same with the transfer pass pinned to Triton (`state_lowering="triton"` there, so the state pass too);
3. the default forward with (T, S) vmapped over a batch of two sequences (as the models call it: under vmap the
   Mosaic GPU kernels gain a grid axis) against each sequence on its own;
4. (T, S) of short sequences, the engine's segments (one chunk to a little over one group), with slow gates (T of
   norm ~1): `GDNConfig()` and the Triton passes against `linear_attn.summarize` in float32, with the lowering the
   transfer pass took and the time of the emitting forward.

    python3 -m bench.investigations.transfer_pass            # on the H200; LENGTH=... for another length
    python3 -m bench.investigations.transfer_pass --short    # section 4 only
"""

from __future__ import annotations

import os
import sys


SHORT_LENGTHS = (64, 256, 512, 2048, 4096, 4160)


def short_sequences():
    """Section 4: (T, S) of segment-sized sequences through both lowerings against the float32 core."""
    import jax
    import jax.numpy as jnp

    from hypic_jax.core import linear_attn as la
    from hypic_jax.kernels import gdn
    from hypic_jax.kernels.gdn.state import use_mosaic_transfer
    from bench.linear_kernels import DIM, HEADS, KEY_HEADS, gdn_inputs, rel, timeit

    scale = DIM**-0.5
    rep = lambda x: jnp.repeat(x.astype(jnp.float32), HEADS // KEY_HEADS, 1)  # noqa: E731
    for length in SHORT_LENGTHS:
        q, k, v, _, beta = gdn_inputs(length, seed=6)
        g = -jax.random.uniform(jax.random.PRNGKey(5), (length, HEADS), jnp.float32) * 1e-3
        ref = jax.jit(lambda k, v, g, b: la.summarize(rep(k), v.astype(jnp.float32), g=g, beta=b))(k, v, g, beta)
        configs = (("GDNConfig()", gdn.GDNConfig()), ("Triton passes", gdn.GDNConfig(state_lowering="triton")))
        for name, config in configs:
            c = config.resolved(jnp.bfloat16)
            b = jnp.zeros((HEADS, length), jnp.float32) if length % c.chunk == 0 else None
            mosaic = b is not None and use_mosaic_transfer(c, c.chunk, DIM, b, None, False)
            lowering = "mosaic gpu" if mosaic else "triton"
            fn = jax.jit(lambda q, k, v, g, bb, c=config: gdn.gdn_forward(q, k, v, g=g, beta=bb, scale=scale, config=c,
                                                                          emit_summary=True))
            try:
                ms, _ = timeit(fn, q, k, v, g, beta)
                _, _, summary = fn(q, k, v, g, beta)
            except Exception as error:  # noqa: BLE001 (a launch that fails is the result this section looks for)
                print(f"short (T, S), L={length}, {name}: {repr(error)[:300]}", flush=True)
                continue
            print(f"short (T, S), L={length}, {name} (transfer pass: {lowering}): {ms:.4f} ms; relative error "
                  f"T {rel(summary.transfer, ref.transfer):.2e}, S {rel(summary.state, ref.state):.2e}", flush=True)


def main():
    import jax
    import jax.numpy as jnp

    from hypic_jax.kernels import gdn
    from hypic_jax.kernels.gdn import mosaic_state
    from hypic_jax.kernels.gdn.state import state_pass
    from bench.linear_kernels import DIM, HEADS, locals_operands, rel, timeit

    if "--short" in sys.argv[1:]:
        short_sequences()
        return
    length = int(os.environ.get("LENGTH", 32768))
    (q, k, v, g, beta), (b, _, w, _, ks, _) = locals_operands(length)
    scale = DIM**-0.5
    cfg = gdn.GDNConfig().resolved(jnp.bfloat16)
    groups = length // 64 // 64
    eye = jnp.broadcast_to(jnp.eye(DIM, dtype=jnp.float32), (groups, HEADS, DIM, DIM))
    triton = jax.jit(lambda w, k, b: state_pass(w, None, k, b, None, None, eye, chunk=64, pieces=groups,
                                                value_dim=DIM, out_dtype=jnp.float32, scale=1.0, config=cfg,
                                                interpret=False)[1])
    ref = triton(w, ks, b)
    print(f"group products, triton, 64 chunks a group: {timeit(triton, w, ks, b)[0]:.4f} ms", flush=True)
    for group_chunks in (64, 32, 128):
        for cluster in (2, 1):
            config = mosaic_state.MosaicStateConfig(cluster=cluster)
            fn = jax.jit(lambda w, k, b, n=group_chunks, c=config: mosaic_state.transfer_pass_mgpu(
                w, k, b, chunk=64, group_chunks=n, config=c))
            line = f"group products, mosaic gpu, {group_chunks} chunks a group, clusters of {cluster}: "
            try:
                ms, _ = timeit(fn, w, ks, b)
            except Exception as error:  # noqa: BLE001 (a launch that does not fit is a result too)
                print(line + repr(error)[:200], flush=True)
                continue
            diff = f" (relative difference from Triton's {rel(fn(w, ks, b), ref):.2e})" if group_chunks == 64 else ""
            print(line + f"{ms:.4f} ms{diff}", flush=True)
    for name, c in (("GDNConfig()", gdn.GDNConfig()), ("Triton state and transfer passes",
                                                       gdn.GDNConfig(state_lowering="triton"))):
        times = []
        for emit in (False, True):
            fn = jax.jit(lambda q, k, v, g, bb, c=c, e=emit: gdn.gdn_forward(q, k, v, g=g, beta=bb, scale=scale,
                                                                             config=c, emit_summary=e))
            times.append(timeit(fn, q, k, v, g, beta)[0])
        print(f"gdn_forward {name}: {times[0]:.4f} ms, with (T, S) {times[1]:.4f} ms "
              f"(+{100 * (times[1] / times[0] - 1):.1f}%)", flush=True)
    batch = [x[: length // 4] for x in (q, k, v, g, beta)]
    second = [x[length // 4: length // 2] for x in (q, k, v, g, beta)]
    one = jax.jit(lambda q, k, v, g, bb: gdn.gdn_forward(q, k, v, g=g, beta=bb, scale=scale, emit_summary=True))
    stacked = jax.jit(jax.vmap(one))(*(jnp.stack(pair) for pair in zip(batch, second)))
    alone = [one(*batch), one(*second)]
    diffs = [max(rel(a[i], b) for a, b in zip(jax.tree_util.tree_leaves(stacked),
                                              jax.tree_util.tree_leaves(alone[i]))) for i in range(2)]
    print(f"vmapped forward with (T, S), 2 x {length // 4} tokens: largest relative difference from each sequence "
          f"alone {max(diffs):.2e}", flush=True)
    short_sequences()


if __name__ == "__main__":
    main()
