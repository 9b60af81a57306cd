"""Variants of the Mosaic GPU state pass timed in the twelfth session's call 1: the loads alone, the arithmetic
alone (every step on the first slots), no output store, clusters of 2 and 4 column blocks sharing multicast
operands, 64 columns.

Measurement scaffolding kept for the record (bench/RESULTS.md, twelfth session), not a kernel of the package.
Run from the repository root on the GPU:  python3 bench/state_pass_variants/call1_modes.py
"""
import functools, os, sys, time
sys.path.insert(0, "bench"); sys.path.insert(0, ".")
import jax, jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from hypic_jax.pallas import gdn, gdn_mgpu
from kernels import DIM, HEADS, gdn_inputs, timeit

C = 64

def kern(w_g, u_g, k_g, q_g, p_g, eb_g, eu_g, ek_g, init_g, o_g, final_g,
         w_s, u_s, k_s, q_s, p_s, eb_s, eu_s, ek_s, sb_s, ub_s, u2_s, o_s, f_s, ready, used, init_ready, *,
         num_chunks, group, block_v, stages, mode, cs):
    c = C
    h = lax.axis_index("h")
    if cs:
        j = lax.axis_index("jo") * cs + lax.axis_index("cj")
        coll = dict(collective_axes="cj")
    else:
        j = lax.axis_index("j")
        coll = {}
    wg = lax.axis_index("wg")
    cols = pl.ds(j * block_v, block_v)
    kh = lax.div(h, jnp.asarray(group, h.dtype))
    layout = plgpu.Layout.WGMMA

    def rowvec(ref):
        v = plgpu.load(ref, (), layout=layout.reduce(1), optimized=False)
        return lax.broadcast_in_dim(v, (c, block_v), (0,))

    @pl.when(wg == 0)
    def _compute():
        plgpu.barrier_wait(init_ready.at[0])
        top, bot = f_s[pl.ds(0, c)], f_s[pl.ds(c, c)]

        def step(n, carry):
            top, bot = carry
            slot = lax.rem(n, stages)
            if mode == "load":
                plgpu.barrier_wait(ready.at[slot])
                plgpu.barrier_arrive(used.at[slot])
                return top, bot
            sb_s[pl.ds(0, c)] = top.astype(jnp.bfloat16)
            sb_s[pl.ds(c, c)] = bot.astype(jnp.bfloat16)
            plgpu.commit_smem()
            if mode == "compute":
                @pl.when(n < stages)
                def _():
                    plgpu.barrier_wait(ready.at[slot])
            else:
                plgpu.barrier_wait(ready.at[slot])

            def first(x1_ref, x2_ref):
                plgpu.wgmma(x1_ref, w_s.at[slot], sb_s)
                plgpu.wgmma(x2_ref, q_s.at[slot], sb_s)
                return x1_ref[...], x2_ref[...]

            x1, x2 = pl.run_scoped(first, plgpu.ACC((c, block_v), jnp.float32), plgpu.ACC((c, block_v), jnp.float32))
            u = u_s[slot].astype(jnp.float32) - x1
            ub_s[...] = u.astype(jnp.bfloat16)
            u2_s[...] = (u * rowvec(eu_s.at[slot])).astype(jnp.bfloat16)
            plgpu.commit_smem()
            kt_top = plgpu.transpose_ref(k_s.at[slot, :, pl.ds(0, c)], (1, 0))
            kt_bot = plgpu.transpose_ref(k_s.at[slot, :, pl.ds(c, c)], (1, 0))

            def second(po_ref, t_ref, b_ref):
                plgpu.wgmma(po_ref, p_s.at[slot], ub_s)
                plgpu.wgmma(t_ref, kt_top, u2_s)
                plgpu.wgmma(b_ref, kt_bot, u2_s)
                return po_ref[...], t_ref[...], b_ref[...]

            acc = plgpu.ACC((c, block_v), jnp.float32)
            pu, kt_u_top, kt_u_bot = pl.run_scoped(second, acc, acc, acc)
            decay = rowvec(ek_s.at[slot])
            if mode != "compute":
                plgpu.barrier_arrive(used.at[slot])
            if mode != "noo":
                o = x2 * rowvec(eb_s.at[slot]) + pu
                buf = lax.rem(n, 2)
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                o_s[buf] = o.astype(o_s.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_s.at[buf], o_g.at[pl.ds(n * c, c), h, cols])
            return top * decay + kt_u_top, bot * decay + kt_u_bot

        top, bot = lax.fori_loop(0, num_chunks, step, (top, bot))
        f_s[pl.ds(0, c)] = top
        f_s[pl.ds(c, c)] = bot
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(f_s, final_g.at[h, :, cols])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _memory():
        plgpu.copy_gmem_to_smem(init_g.at[h, :, cols], f_s, init_ready.at[0])

        def load(n, slot):
            rows = pl.ds(n * c, c)
            bar = ready.at[slot]
            plgpu.copy_gmem_to_smem(w_g.at[rows, h], w_s.at[slot], bar, **coll)
            plgpu.copy_gmem_to_smem(u_g.at[rows, h, cols], u_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(k_g.at[rows, kh], k_s.at[slot], bar, **coll)
            plgpu.copy_gmem_to_smem(q_g.at[rows, kh], q_s.at[slot], bar, **coll)
            plgpu.copy_gmem_to_smem(p_g.at[h, rows], p_s.at[slot], bar, **coll)
            plgpu.copy_gmem_to_smem(eb_g.at[h, rows], eb_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(eu_g.at[h, rows], eu_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(ek_g.at[h, n], ek_s.at[slot], bar)

        for n in range(min(stages, num_chunks)):
            load(jnp.asarray(n, jnp.int32), n)
        if mode == "compute":
            return

        @pl.loop(stages, max(num_chunks, stages))
        def _(n):
            slot = lax.rem(n, stages)
            plgpu.barrier_wait(used.at[slot])
            load(n, slot)

        for slot in range(min(stages, num_chunks)):
            plgpu.barrier_wait(used.at[slot])


@functools.partial(jax.jit, static_argnames=("scale", "bv", "stages", "mode", "cs"))
def probe(w, u, k, b, q, p, init, *, scale, bv=32, stages=2, mode="base", cs=0):
    length, heads, key_dim = w.shape
    key_heads, value_dim = k.shape[1], u.shape[-1]
    chunk = C
    num_chunks = length // chunk
    bf = jnp.bfloat16
    b = b.astype(jnp.float32)
    b_last = b.reshape(heads, num_chunks, chunk)[..., -1]
    eb = scale * jnp.exp(b)
    eu = jnp.exp(jnp.repeat(b_last, chunk, axis=1) - b)
    ek = jnp.broadcast_to(jnp.exp(b_last)[..., None], (heads, num_chunks, chunk))
    w, u, q, p, k = w.astype(bf), u.astype(bf), q.astype(bf), p.astype(bf), k.astype(bf)
    tile = (plgpu.TilingTransform((8, bv)), plgpu.SwizzleTransform(2 * bv))
    smem = lambda shape, dtype=bf: plgpu.SMEM(shape, dtype, transforms=tile)
    f32_tile = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
    used = (plgpu.ClusterBarrier(collective_axes=("cj",), num_barriers=stages) if cs
            else plgpu.Barrier(num_barriers=stages))
    scratch = [
        smem((stages, chunk, key_dim)), smem((stages, chunk, bv)), smem((stages, chunk, key_dim)),
        smem((stages, chunk, key_dim)), smem((stages, chunk, chunk)),
        plgpu.SMEM((stages, chunk), jnp.float32), plgpu.SMEM((stages, chunk), jnp.float32),
        plgpu.SMEM((stages, chunk), jnp.float32),
        smem((key_dim, bv)), smem((chunk, bv)), smem((chunk, bv)), smem((2, chunk, bv), bf),
        plgpu.SMEM((key_dim, bv), jnp.float32, transforms=f32_tile),
        plgpu.Barrier(num_arrivals=8, num_barriers=stages), used, plgpu.Barrier(num_barriers=1),
    ]
    kw = dict(grid=(value_dim // bv // cs, heads), grid_names=("jo", "h"), cluster=(cs,), cluster_names=("cj",)) \
        if cs else dict(grid=(value_dim // bv, heads), grid_names=("j", "h"))
    kernel = plgpu.kernel(
        functools.partial(kern, num_chunks=num_chunks, group=heads // key_heads, block_v=bv, stages=stages,
                          mode=mode, cs=cs),
        out_type=(jax.ShapeDtypeStruct((length, heads, value_dim), bf),
                  jax.ShapeDtypeStruct((heads, key_dim, value_dim), jnp.float32)),
        num_threads=2, thread_name="wg", kernel_name=f"probe_{mode}_{cs}", scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(), **kw)
    return kernel(w, u, k, q, p, eb, eu, ek, init.astype(jnp.float32))


def main():
    length = 32768
    q, k, v, g, beta = gdn_inputs(length)
    scale = DIM ** -0.5
    cfg = gdn.GDNConfig().resolved(jnp.bfloat16)
    b, p, w, u, ks, qs = jax.jit(lambda q, k, v, g, bt: gdn._locals(q, k, v, g, None, bt, scale=scale, config=cfg,
                                                                     interpret=False))(q, k, v, g, beta)
    init = jnp.zeros((HEADS, DIM, DIM), jnp.float32)
    ref = gdn_mgpu.state_pass_mgpu(w, u, ks, b, qs, p, init, chunk=64, out_dtype=jnp.bfloat16, scale=scale)
    ms, _ = timeit(lambda *a: gdn_mgpu.state_pass_mgpu(*a, chunk=64, out_dtype=jnp.bfloat16, scale=scale),
                   w, u, ks, b, qs, p, init)
    print(f"committed kernel: {ms:.4f} ms", flush=True)
    variants = [dict(mode="base"), dict(mode="compute"), dict(mode="load"), dict(mode="noo"),
                dict(mode="base", cs=2), dict(mode="base", cs=4), dict(mode="load", cs=4),
                dict(mode="base", cs=2, bv=64), dict(mode="base", stages=3, cs=4),
                dict(mode="compute", bv=64), dict(mode="load", bv=64)]
    for var in variants:
        try:
            fn = jax.jit(functools.partial(probe, scale=scale, **var))
            ms, _ = timeit(fn, w, u, ks, b, qs, p, init)
            o, f = fn(w, u, ks, b, qs, p, init)
            d = max(float(jnp.abs(o.astype(jnp.float32) - ref[0].astype(jnp.float32)).max()),
                    float(jnp.abs(f - ref[1]).max()))
            print(f"{var}: {ms:.4f} ms  diff {d:.2e}", flush=True)
        except Exception as e:
            print(f"{var}: FAILED {repr(e)[:600]}", flush=True)


if __name__ == "__main__":
    main()
