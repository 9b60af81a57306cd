"""The Gated DeltaNet state pass (`gdn._state_kernel`, scalar gates, delta rule, outputs) under Pallas's Mosaic GPU
lowering (Hopper).

Per chunk n of c = 64 tokens and value columns [j * BV, j * BV + BV) of head h, with S [K, BV] float32:

    X1 = W_n S,  X2 = Q_n S                       (bf16 products of S's bf16 copy)
    u  = U_n - X1
    o  = (scale e^b) * X2 + P_n u                 (rows scaled; written as the chunk's output)
    S  = e^{b_last} S + K_n^T (e^{b_last - b} * u)

One compute warpgroup issues X1 and X2 together and waits once, then P u and the two halves of K^T u' together and
waits once; a second warpgroup streams the chunk's operands (W, U, K, Q, P and three decay rows precomputed in XLA)
into `stages` shared-memory slots with the TMA engine. One block per (value column block, head).

What bounds it (H200, 32k, bench/RESULTS.md, eleventh session): each block pulls about 60 KB of operands per chunk
into shared memory, and both lowerings sit near 47 GB/s per SM. One slot doubles the time (1.31 ms), a third slot
adds nothing (0.668 against 0.662 ms at BV = 32), and BV = 64 (64 blocks, 65 KB each) takes 0.705: the pass is
bound by what each SM draws from L2, not by waits or latency. At BV = 32 it takes 0.651 to 0.662 ms against
Triton's 0.731, which makes the forward 1.331 to 1.346 ms against 1.400 to 1.421, so `GDNConfig.state_lowering`
"auto" picks it on Hopper for the launches it takes.

The GPU interpreter (`interpret=True`) runs it on the CPU: it takes MMA operands from shared memory untransposed
and has no layout casts, so there K arrives transposed and vectors are read without an explicit layout.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from hypic_jax.pallas.platform import gpu_interpreter

__all__ = ["MosaicStateConfig", "supported", "state_pass_mgpu"]

_ROWS = 64  # the warpgroup MMA's M: the chunk, and each half of K


@dataclasses.dataclass(frozen=True)
class MosaicStateConfig:
    """block_v: value columns per block (32 or 64: rows of 64 or 128 bytes of bf16, the swizzle every MMA operand
    then takes); stages: shared-memory slots for a chunk's operands (about 60 KB each at block_v 32). Measured on
    the H200 at 32k (bench/RESULTS.md, eleventh session): block_v 32 with 2 slots 0.662 ms, 3 slots 0.668, 1 slot
    1.306; block_v 64 with 2 slots 0.705 (1 slot 1.315); Triton's pass 0.731."""

    block_v: int = 32
    stages: int = 2


def supported(chunk: int, key_dim: int, value_dim: int, block_v: int = 32) -> bool:
    """Shapes the kernel takes: chunk 64 (the MMA's M), K = 128 (two 64-row halves of S), 32- or 64-column blocks."""
    return chunk == _ROWS and key_dim == 2 * _ROWS and block_v in (32, 64) and value_dim % block_v == 0


def _state_kernel(w_g, u_g, k_g, q_g, p_g, eb_g, eu_g, ek_g, init_g, o_g, final_g,
                  w_s, u_s, k_s, q_s, p_s, eb_s, eu_s, ek_s, sb_s, ub_s, u2_s, o_s, f_s, ready, used, init_ready, *,
                  num_chunks, group, block_v, stages, interpret):
    c = _ROWS
    j, h = lax.axis_index("j"), lax.axis_index("h")
    wg = lax.axis_index("wg")
    cols = pl.ds(j * block_v, block_v)
    kh = lax.div(h, jnp.asarray(group, h.dtype))
    layout = plgpu.Layout.WGMMA

    def rowvec(ref):  # a [64] float32 row of shared memory as the per-row factor of a [64, BV] tile
        v = ref[...] if interpret else plgpu.load(ref, (), layout=layout.reduce(1), optimized=False)
        return lax.broadcast_in_dim(v, (c, block_v), (0,))

    @pl.when(wg == 0)
    def _compute():
        plgpu.barrier_wait(init_ready.at[0])  # the initial state, in f_s
        top, bot = f_s[pl.ds(0, c)], f_s[pl.ds(c, c)]

        def step(n, carry):
            top, bot = carry
            slot = lax.rem(n, stages)
            sb_s[pl.ds(0, c)] = top.astype(jnp.bfloat16)
            sb_s[pl.ds(c, c)] = bot.astype(jnp.bfloat16)
            plgpu.commit_smem()
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
            if interpret:  # K^T arrives from the wrapper already transposed: [K, c]
                kt_top, kt_bot = k_s.at[slot, pl.ds(0, c)], k_s.at[slot, pl.ds(c, c)]
            else:
                kt_top = plgpu.transpose_ref(k_s.at[slot, :, pl.ds(0, c)], (1, 0))
                kt_bot = plgpu.transpose_ref(k_s.at[slot, :, pl.ds(c, c)], (1, 0))

            def second(po_ref, t_ref, b_ref):
                plgpu.wgmma(po_ref, p_s.at[slot], ub_s)
                plgpu.wgmma(t_ref, kt_top, u2_s)
                plgpu.wgmma(b_ref, kt_bot, u2_s)
                return po_ref[...], t_ref[...], b_ref[...]

            acc = plgpu.ACC((c, block_v), jnp.float32)
            pu, kt_u_top, kt_u_bot = pl.run_scoped(second, acc, acc, acc)
            o = x2 * rowvec(eb_s.at[slot]) + pu
            decay = rowvec(ek_s.at[slot])
            plgpu.barrier_arrive(used.at[slot])
            buf = lax.rem(n, 2)
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # o_s[buf]'s copy of two chunks ago is done
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
            plgpu.copy_gmem_to_smem(w_g.at[rows, h], w_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(u_g.at[rows, h, cols], u_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(k_g.at[kh, n] if interpret else k_g.at[rows, kh], k_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(q_g.at[rows, kh], q_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(p_g.at[h, rows], p_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(eb_g.at[h, rows], eb_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(eu_g.at[h, rows], eu_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(ek_g.at[h, n], ek_s.at[slot], bar)

        for n in range(min(stages, num_chunks)):
            load(jnp.asarray(n, jnp.int32), n)

        @pl.loop(stages, max(num_chunks, stages))
        def _(n):
            slot = lax.rem(n, stages)
            plgpu.barrier_wait(used.at[slot])
            load(n, slot)

        for slot in range(min(stages, num_chunks)):  # drain: observe each slot's last release
            plgpu.barrier_wait(used.at[slot])


_COPIES = 8  # TMA copies per chunk slot, each one arrival on the slot's ready barrier


@functools.partial(jax.jit, static_argnames=("chunk", "out_dtype", "scale", "config", "interpret"))
def state_pass_mgpu(w, u, k, b, q, p, init, *, chunk: int, out_dtype, scale: float,
                    config: MosaicStateConfig = MosaicStateConfig(), interpret: bool = False):
    """`gdn._state_pass` for one piece, scalar gates, the delta rule and outputs: w [L, H, K], u [L, H, V], k, q
    [L, Hk, K], b [H, L] (in-chunk cumulative log gates), p [H, L, c], init [H, K, V] float32, L a multiple of the
    chunk. Returns (o [L, H, V] out_dtype, final [H, K, V] float32)."""
    length, heads, key_dim = w.shape
    key_heads, value_dim = k.shape[1], u.shape[-1]
    bv = config.block_v
    if not supported(chunk, key_dim, value_dim, bv) or length % chunk:
        raise ValueError(f"state_pass_mgpu takes chunk 64, K 128, V a multiple of {bv} and whole chunks; got chunk "
                         f"{chunk}, K {key_dim}, V {value_dim}, L {length}")
    num_chunks = length // chunk
    bf = jnp.bfloat16
    b = b.astype(jnp.float32)
    b_last = b.reshape(heads, num_chunks, chunk)[..., -1]  # [H, Nc]
    eb = scale * jnp.exp(b)
    eu = jnp.exp(jnp.repeat(b_last, chunk, axis=1) - b)
    ek = jnp.broadcast_to(jnp.exp(b_last)[..., None], (heads, num_chunks, chunk))
    w, u, q, p = w.astype(bf), u.astype(bf), q.astype(bf), p.astype(bf)
    if interpret:  # the interpreter's K^T: [Hk, Nc, K, c]
        k = jnp.transpose(k.astype(bf).reshape(num_chunks, chunk, key_heads, key_dim), (2, 0, 3, 1))
    else:
        k = k.astype(bf)
    # every MMA operand takes the swizzle of BV bf16 values (64 or 128 bytes): an MMA's two operands must agree
    stages = config.stages
    tile = (plgpu.TilingTransform((8, bv)), plgpu.SwizzleTransform(2 * bv))
    cols_tile = tile
    smem = lambda shape, dtype=bf, t=tile: plgpu.SMEM(shape, dtype, transforms=t)  # noqa: E731
    f32_tile = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
    scratch = [
        smem((stages, chunk, key_dim)),  # W
        smem((stages, chunk, bv), t=cols_tile),  # U
        smem((stages, key_dim, chunk) if interpret else (stages, chunk, key_dim)),  # K (K^T in the interpreter)
        smem((stages, chunk, key_dim)),  # Q
        smem((stages, chunk, chunk)),  # P
        plgpu.SMEM((stages, chunk), jnp.float32),  # scale e^b
        plgpu.SMEM((stages, chunk), jnp.float32),  # e^{b_last - b}
        plgpu.SMEM((stages, chunk), jnp.float32),  # e^{b_last}
        smem((key_dim, bv), t=cols_tile),  # S in bf16, the first products' right operand
        smem((chunk, bv), t=cols_tile),  # u in bf16
        smem((chunk, bv), t=cols_tile),  # e^{b_last - b} u in bf16
        smem((2, chunk, bv), out_dtype, t=cols_tile),  # o, double-buffered for its copies out
        plgpu.SMEM((key_dim, bv), jnp.float32, transforms=f32_tile),  # the initial and the final state
        plgpu.Barrier(num_arrivals=_COPIES, num_barriers=stages),  # a slot's operands have landed
        plgpu.Barrier(num_barriers=stages),  # a slot's step is done
        plgpu.Barrier(num_barriers=1),  # the initial state has landed
    ]
    kernel = plgpu.kernel(
        functools.partial(_state_kernel, num_chunks=num_chunks, group=heads // key_heads, block_v=bv,
                          stages=stages, interpret=interpret),
        out_type=(jax.ShapeDtypeStruct((length, heads, value_dim), out_dtype),
                  jax.ShapeDtypeStruct((heads, key_dim, value_dim), jnp.float32)),
        grid=(value_dim // bv, heads),
        grid_names=("j", "h"),
        num_threads=2,
        thread_name="wg",
        kernel_name="gdn_mgpu_state_pass",
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(),
        interpret=gpu_interpreter() if interpret else False,
    )
    return kernel(w, u, k, q, p, eb, eu, ek, init.astype(jnp.float32))
