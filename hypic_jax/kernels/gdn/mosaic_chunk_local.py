"""The chunk-local kernel (`chunk_local`, the "tile" solve with a scalar gate, the delta rule) under Pallas's Mosaic
GPU lowering (Hopper).

Per chunk of c = 64 tokens and value head h, with b the chunk-local cumulative log gates:

    P = scale * mask_causal(Q K^T * e^{b_t - b_j})              the scores the state pass reads
    M = mask_strict(diag(beta) K K^T * e^{b_t - b_j})            strictly lower
    X = (I + M)^-1                                               by doubling: X_2 = I - E_1, X_2s = X_s - X_s (E_s X_s)
    W = X diag(beta e^b) K,   U = X diag(beta) V

The arithmetic is the Triton kernel's at bf16 dot precision (every product of bf16 operands, float32 sums; X and M
stay float32 between levels); the decays scale X's columns instead of K's and V's rows, so W and U round X diag(.)
to bf16 where Triton rounds diag(.) K, and differ from Triton's at bf16's rounding (P not at all). E_s is M
restricted to the entries whose row and column indices first differ in bit log2(s), i.e. the lower-left s x s block
of every 2s x 2s diagonal block (M is zero above the diagonal).

Why a Mosaic GPU version: the Triton kernel holds one chunk per program, two programs per SM (bound by its
registers), and its warps stall on the chunk's loads, which nothing prefetches (`bench/investigations/ncu_gdn.py`).
Here a block owns a run of chunks of one head: a TMA warpgroup streams each chunk's q, k, v, b and beta into a slot
while two compute warpgroups work on alternate chunks (chunk i: warpgroup i % 2, slot i % stages, so every slot has
one consumer and each thread tracks a barrier's phase by its own waits), each chunk's dots issued from registers
where they can be (the left operands E_s, X and the scaled X) and waited once per dependent step. The defaults (two
slots, two compute warpgroups, set register budgets) are the fastest launch of `bench/investigations/
locals_mgpu.py` (bench/RESULTS.md, "Findings of the investigations"). It lowers with lane semantics: the kernel
sets every layout itself, and the warpgroup semantics' layout-inference search does not finish on it.

The GPU interpreter (`interpret=True`) runs it on the CPU. It takes an MMA's left operand from shared memory only
and has no transposed views, layout casts or layout-aware loads, so there the left operands pass through a
shared-memory tile, K^T arrives as its own input, and constants and row vectors are plain arrays.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from hypic_jax.kernels.platform import check_semantics, gpu_interpreter, mosaic_compiler_params

__all__ = ["MosaicLocalsConfig", "supported", "chunk_locals_mgpu"]

_C = 64  # the chunk: the warpgroup MMA's M, and the N of every [c, c] product
_COPIES = 5  # TMA copies per chunk slot (q, k, v, b, beta), one arrival each on the slot's ready barrier


@dataclasses.dataclass(frozen=True)
class MosaicLocalsConfig:
    """blocks: blocks the launch aims for (one per SM: registers allow no second); the chunks of every head are split
    into as many runs as fit `blocks` (the last run of a head possibly shorter). stages: chunk slots (2 or 4: one
    or two per compute warpgroup). warpgroups: compute warpgroups per block (1 or 2, on alternate chunks).
    compute_registers / memory_registers: per-thread register budgets of the compute and TMA warpgroups
    (set_registers=False leaves the compiler's). smem_operands: the
    left operands through a shared-memory tile instead of registers; transposed_keys: K^T from its own input
    instead of a transposed view (both as in the interpreter, which takes neither form; on the GPU they are
    variants to bisect with, and smem_operands needs stages=2 to fit). semantics: Mosaic GPU's lowering
    (`platform.mosaic_compiler_params`); the kernel sets every layout itself, and under "warpgroup" (JAX 0.11's
    default) the layout-inference search does not finish (see the module docstring)."""

    blocks: int = 132
    stages: int = 2
    warpgroups: int = 2
    compute_registers: int = 232
    memory_registers: int = 40
    set_registers: bool = True
    smem_operands: bool = False
    transposed_keys: bool = False
    semantics: str = "lane"

    def __post_init__(self):
        check_semantics(self.semantics)
        if self.stages not in (2, 4):
            raise ValueError(f"stages must be 2 or 4, got {self.stages}")
        if self.warpgroups not in (1, 2):
            raise ValueError(f"warpgroups must be 1 or 2, got {self.warpgroups}")
        if self.blocks < 1:
            raise ValueError(f"blocks must be >= 1, got {self.blocks}")


def supported(chunk: int, key_dim: int, value_dim: int, length: int) -> bool:
    """Shapes the kernel takes: chunk 64, K = V = 128 (two 64-column halves of W and U), whole chunks."""
    return chunk == _C and key_dim == 128 and value_dim == 128 and length > 0 and length % _C == 0


def _runs_per_head(num_chunks: int, heads: int, blocks: int) -> tuple[int, int]:
    """(runs, run): a head's chunks in `runs` runs of `run` chunks, the last possibly shorter, with runs at most
    blocks / heads: as long as the launch fits the GPU in one wave, each block's chain is as short as it can be."""
    run = -(-num_chunks // max(1, min(blocks // heads, num_chunks)))
    return -(-num_chunks // run), run


def _kernel(q_g, k_g, v_g, b_g, beta_g, *refs, runs, run, last_run, group, scale, stages, warpgroups, registers,
            left_in_smem, keys_transposed, interpret):
    """runs: blocks a head; run / last_run: chunks of every block / of a head's last block; registers: (compute,
    memory) register budgets, or None; left_in_smem / keys_transposed: the left operands through shared memory, K^T
    from its own input (`MosaicLocalsConfig`); interpret: plain arrays for constants, iotas and row vectors."""
    if keys_transposed:
        kt_g, refs = refs[0], refs[1:]
    p_g, w_g, u_g, q_s, k_s, v_s, b_s, beta_s, x_s, y_s, ready, used, *extra = refs
    kt_s = extra.pop(0) if keys_transposed else None
    a_s = extra.pop(0) if left_in_smem else None
    c = _C
    j, h = lax.axis_index("j"), lax.axis_index("h")
    wg = lax.axis_index("wg")
    kh = lax.div(h, jnp.asarray(group, h.dtype))
    first = j * run  # the block's first chunk
    ragged = last_run != run  # the head's last block has fewer chunks: loads and turns past them are skipped
    mine = jnp.where(j == runs - 1, last_run, run).astype(j.dtype) if ragged else run  # this block's chunks
    layout = plgpu.Layout.WGMMA

    def full(value, dtype=jnp.float32):  # a [c, c] constant in the MMA accumulator's layout
        x = jnp.full((c, c), value, dtype)
        return x if interpret else plgpu.layout_cast(x, layout)

    def iota(dim):
        if interpret:
            return lax.broadcasted_iota(jnp.int32, (c, c), dim)
        return plgpu.broadcasted_iota(jnp.int32, (c, c), dim, layout=layout)

    def vector(ref, axis):  # a [c] float32 row of shared memory as a [c, c] tile indexed by `axis`
        v = ref[...] if interpret else plgpu.load(ref, (), layout=layout.reduce(1 - axis), optimized=False)
        return lax.broadcast_in_dim(v, (c, c), (axis,))

    def left(x):  # an MMA's left operand: registers, or a shared-memory tile (the interpreter, smem_operands)
        x = x.astype(jnp.bfloat16)
        if not left_in_smem:
            return x
        a_s.at[wg][...] = x
        plgpu.commit_smem()
        return a_s.at[wg]

    def dot(a, b):  # one [c, c] product of bf16 operands, float32 sums
        def body(acc):
            plgpu.wgmma(acc, a, b)
            return acc[...]

        return pl.run_scoped(body, plgpu.ACC((c, c), jnp.float32))

    def dot2(a1, b1, a2, b2):  # two independent products, issued together and waited once
        def body(acc1, acc2):
            plgpu.wgmma(acc1, a1, b1)
            plgpu.wgmma(acc2, a2, b2)
            return acc1[...], acc2[...]

        return pl.run_scoped(body, plgpu.ACC((c, c), jnp.float32), plgpu.ACC((c, c), jnp.float32))

    def stage(ref, x):  # a product's bf16 copy into shared memory, for the next MMA (or a TMA store)
        ref[...] = x.astype(jnp.bfloat16)
        plgpu.commit_smem()

    @pl.when(wg < warpgroups)
    def _compute():
        if registers:
            plgpu.set_max_registers(registers[0], action="increase")
        rows, cols = iota(0), iota(1)
        zero = full(0.0)
        causal = rows >= cols
        xr = lax.bitwise_xor(rows, cols)  # highest differing bit of (row, column): the doubling level
        x_tile, y_tile = x_s.at[wg], y_s.at[wg]

        def _chunk(i):
            n = first + i
            slot = lax.rem(i, stages)
            plgpu.barrier_wait(ready.at[slot])
            kt = kt_s.at[slot] if keys_transposed else plgpu.transpose_ref(k_s.at[slot], (1, 0))
            s_qk, s_kk = dot2(q_s.at[slot], kt, k_s.at[slot], kt)
            decay = jnp.exp(jnp.where(causal, vector(b_s.at[slot], 0) - vector(b_s.at[slot], 1), zero))
            decay = jnp.where(causal, decay, zero)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous chunk's U halves have left y_tile
            stage(y_tile, s_qk * decay * full(scale))
            plgpu.copy_smem_to_gmem(y_tile, p_g.at[h, pl.ds(n * c, c)])
            m = jnp.where(rows > cols, vector(beta_s.at[slot], 0) * s_kk * decay, zero)
            x = jnp.where(xr == full(1, jnp.int32), -m, zero) + jnp.where(rows == cols, full(1.0), zero)
            for shift in range(1, 6):  # levels s = 2 .. 32: X_2s = X_s - X_s (E_s X_s)
                lo, hi = full(1 << shift, jnp.int32), full(2 << shift, jnp.int32)
                e = jnp.where(jnp.logical_and(xr >= lo, xr < hi), m, zero)
                stage(x_tile, x)
                if shift == 1:
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # P has left y_tile
                y = dot(left(e), x_tile)
                stage(y_tile, y)
                x = x - dot(left(x), y_tile)
            beta_col = vector(beta_s.at[slot], 1)
            xw = left(x * beta_col * jnp.exp(vector(b_s.at[slot], 1)))
            w_lo, w_hi = dot2(xw, k_s.at[slot, :, pl.ds(0, c)], xw, k_s.at[slot, :, pl.ds(c, c)])
            stage(x_tile, w_lo)
            stage(y_tile, w_hi)
            plgpu.copy_smem_to_gmem(x_tile, w_g.at[pl.ds(n * c, c), h, pl.ds(0, c)])
            plgpu.copy_smem_to_gmem(y_tile, w_g.at[pl.ds(n * c, c), h, pl.ds(c, c)])
            xu = left(x * beta_col)
            u_lo, u_hi = dot2(xu, v_s.at[slot, :, pl.ds(0, c)], xu, v_s.at[slot, :, pl.ds(c, c)])
            plgpu.barrier_arrive(used.at[slot])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # W's halves have left the tiles
            stage(x_tile, u_lo)
            stage(y_tile, u_hi)
            plgpu.copy_smem_to_gmem(x_tile, u_g.at[pl.ds(n * c, c), h, pl.ds(0, c)])
            plgpu.copy_smem_to_gmem(y_tile, u_g.at[pl.ds(n * c, c), h, pl.ds(c, c)])

        @pl.loop(0, -(-run // warpgroups))
        def _(r):
            i = r * warpgroups + wg  # the block's chunk
            if run % warpgroups == 0 and not ragged:
                _chunk(i)
            else:  # an odd or short run: a warpgroup's last turn may have no chunk
                pl.when(i < mine)(lambda: _chunk(i))

        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == warpgroups)
    def _memory():
        if registers:
            plgpu.set_max_registers(registers[1], action="decrease")

        def load(i):
            slot = lax.rem(i, stages)
            n = first + i
            rows = pl.ds(n * c, c)
            bar = ready.at[slot]
            plgpu.copy_gmem_to_smem(q_g.at[rows, kh], q_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(k_g.at[rows, kh], k_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(v_g.at[rows, h], v_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(b_g.at[h, rows], b_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(beta_g.at[h, rows], beta_s.at[slot], bar)
            if keys_transposed:
                plgpu.copy_gmem_to_smem(kt_g.at[kh, n], kt_s.at[slot], bar)

        def guarded(i, fn):  # fn() for the block's chunks only (a short last run skips the rest)
            if ragged:
                pl.when(i < mine)(fn)
            else:
                fn()

        for i in range(min(stages, run)):
            guarded(i, functools.partial(load, jnp.asarray(i, jnp.int32)))

        @pl.loop(stages, max(run, stages))
        def _(i):
            def refill():
                plgpu.barrier_wait(used.at[lax.rem(i, stages)])
                load(i)

            guarded(i, refill)

        for slot in range(min(stages, run)):  # drain: observe each slot's last release
            guarded(slot, functools.partial(plgpu.barrier_wait, used.at[slot]))


@functools.partial(jax.jit, static_argnames=("chunk", "scale", "config", "interpret"))
def chunk_locals_mgpu(q, k, v, b, beta, *, chunk: int, scale: float,
                      config: MosaicLocalsConfig = MosaicLocalsConfig(), interpret: bool = False):
    """`chunk_local.chunk_locals` for the "tile" solve with scalar gates and the delta rule, bf16: q, k [L, Hk, K],
    v [L, H, V], b [H, L] (in-chunk cumulative log gates), beta [H, L], L a whole number of chunks (`supported`).
    Returns (p [H, L, c], w [L, H, K], u [L, H, V]) in bfloat16; `reference.chunk_locals_reference` computes the
    same in float32."""
    length, key_heads, key_dim = k.shape
    heads, value_dim = v.shape[1:]
    if not supported(chunk, key_dim, value_dim, length):
        raise ValueError(f"chunk_locals_mgpu takes chunk 64, K = V = 128 and whole chunks; got "
                         f"chunk {chunk}, K {key_dim}, V {value_dim}, L {length}")
    num_chunks = length // chunk
    runs, run = _runs_per_head(num_chunks, heads, config.blocks)
    stages = min(config.stages, run)
    wgs = config.warpgroups
    keys_transposed, left_in_smem = interpret or config.transposed_keys, interpret or config.smem_operands
    registers = (config.compute_registers, config.memory_registers) if config.set_registers and not interpret else None
    bf = jnp.bfloat16
    q, k, v = q.astype(bf), k.astype(bf), v.astype(bf)
    b, beta = b.astype(jnp.float32), beta.astype(jnp.float32)
    tile = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    smem = lambda shape: plgpu.SMEM(shape, bf, transforms=tile)  # noqa: E731
    scratch = [
        smem((stages, chunk, key_dim)),  # q
        smem((stages, chunk, key_dim)),  # k
        smem((stages, chunk, value_dim)),  # v
        plgpu.SMEM((stages, chunk), jnp.float32),  # b
        plgpu.SMEM((stages, chunk), jnp.float32),  # beta
        smem((wgs, chunk, chunk)),  # X's bf16 copy; the outputs' staging
        smem((wgs, chunk, chunk)),  # Y = E X's bf16 copy; the outputs' staging
        plgpu.Barrier(num_arrivals=_COPIES + int(keys_transposed), num_barriers=stages),  # a slot's chunk landed
        plgpu.Barrier(num_barriers=stages),  # a slot's chunk is done
    ]
    args = [q, k, v, b, beta]
    if keys_transposed:  # K^T per chunk [Hk, Nc, K, c]
        args.append(jnp.transpose(k.reshape(num_chunks, chunk, key_heads, key_dim), (2, 0, 3, 1)))
        scratch.append(smem((stages, key_dim, chunk)))
    if left_in_smem:  # the left operands' tiles
        scratch.append(smem((wgs, chunk, chunk)))
    kernel = plgpu.kernel(
        functools.partial(_kernel, runs=runs, run=run, last_run=num_chunks - (runs - 1) * run,
                          group=heads // key_heads, scale=scale, stages=stages, warpgroups=wgs, registers=registers,
                          left_in_smem=left_in_smem, keys_transposed=keys_transposed, interpret=interpret),
        out_type=(jax.ShapeDtypeStruct((heads, length, chunk), bf),
                  jax.ShapeDtypeStruct((length, heads, key_dim), bf),
                  jax.ShapeDtypeStruct((length, heads, value_dim), bf)),
        grid=(runs, heads),
        grid_names=("j", "h"),
        num_threads=wgs + 1,
        thread_name="wg",
        kernel_name="gdn_mgpu_chunk_locals",
        scratch_types=scratch,
        compiler_params=mosaic_compiler_params(config.semantics),
        interpret=gpu_interpreter() if interpret else False,
    )
    return kernel(*args)
