"""The state pass (`state.state_pass` for one piece: scalar gates, the delta rule, outputs) and the transfer pass's
group products (`state.transfer_pass`) under Pallas's Mosaic GPU lowering (Hopper).

Per chunk n of c = 64 tokens and value columns [j * BV, j * BV + BV) of head h, with S [K, BV] float32:

    X1 = W_n S,  X2 = Q_n S                       (bf16 products of S's bf16 copy)
    u  = U_n - X1
    o  = (scale e^b) * X2 + P_n u                 (rows scaled; written as the chunk's output)
    S  = e^{b_last} S + K_n^T (e^{b_last - b} * u)

One compute warpgroup issues X1 and X2 together and waits once, then P u and the two halves of K^T u' together and
waits once; a second warpgroup streams the chunk's operands (W, U, K, Q, P and three decay rows precomputed in XLA)
into `stages` shared-memory slots with the TMA engine. One block per (value column block, head); by default the
column blocks of a head run in clusters of two that receive W, K, Q and P through one multicast copy.

What bounds it: each block pulls a chunk's W, U, K, Q and P into shared memory every step, and with the arithmetic
removed the loads alone run at the same total rate from L2 into the SMs whatever the number of blocks, so the
ceiling is what the L2 delivers in total, not each SM's share of it; the arithmetic alone takes less time than the
loads. Multicasting the operands that a head's column blocks share halves their L2 reads, hence the clusters of
two. (`bench/investigations/state_pass.py` times the pass per block width, slot count and cluster size, and
`forward_lowerings.py` the whole forward under each lowering; bench/RESULTS.md, "Findings of the investigations".)

The transfer pass (`transfer_pass_mgpu`, behind a forward's (T, S)) is the same step with zero values and no
outputs, run from the identity over groups of chunks in parallel: per step only W S and K^T (.), and only W, K and
two decay rows to load; multicast halves what the L2 must deliver here too (`bench/investigations/
transfer_pass.py`).

The GPU interpreter (`interpret=True`) runs both on the CPU: it takes MMA operands from shared memory untransposed
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

from hypic_jax.kernels.platform import check_semantics, gpu_interpreter, mosaic_compiler_params

__all__ = ["MosaicStateConfig", "supported", "state_pass_mgpu", "transfer_pass_mgpu"]

_ROWS = 64  # the warpgroup MMA's M: the chunk, and each half of K


@dataclasses.dataclass(frozen=True)
class MosaicStateConfig:
    """block_v: value columns per block (32 or 64: rows of 64 or 128 bytes of bf16, the swizzle every MMA operand
    then takes); stages: shared-memory slots for a chunk's operands; cluster: column blocks of one head launched as
    a cluster that receives the head's W, K, Q and P through one multicast copy (1 turns multicast off; a head with
    fewer or indivisible column blocks, and the interpreter, which has no cluster barriers, run 1). The defaults
    are the fastest launch of `bench/investigations/state_pass.py` (block widths, slots and clusters against
    Triton's pass; bench/RESULTS.md, "Findings of the investigations"). semantics: Mosaic GPU's lowering
    (`platform.mosaic_compiler_params`): "lane", as the kernel sets its layouts itself, so lane skips the
    inference search."""

    block_v: int = 32
    stages: int = 2
    cluster: int = 2
    semantics: str = "lane"

    def __post_init__(self):
        check_semantics(self.semantics)
        if self.block_v not in (32, 64):
            raise ValueError(f"block_v must be 32 or 64, got {self.block_v}")
        if self.stages < 1:
            raise ValueError(f"stages must be >= 1, got {self.stages}")
        if self.cluster not in (1, 2, 4):
            raise ValueError(f"cluster must be 1, 2 or 4, got {self.cluster}")


def supported(chunk: int, key_dim: int, value_dim: int, block_v: int = 32) -> bool:
    """Shapes the kernel takes: chunk 64 (the MMA's M), K = 128 (two 64-row halves of S), 32- or 64-column blocks."""
    return chunk == _ROWS and key_dim == 2 * _ROWS and block_v in (32, 64) and value_dim % block_v == 0


def _stream_chunks(num_chunks, stages, load, used):
    """The TMA warpgroup's loop: fill the `stages` slots, refill each slot as soon as its step releases it, then
    observe every slot's last release (each waiter must see every completion of a barrier to track its phase)."""
    for n in range(min(stages, num_chunks)):
        load(jnp.asarray(n, jnp.int32), n)

    @pl.loop(stages, max(num_chunks, stages))
    def _(n):
        slot = lax.rem(n, stages)
        plgpu.barrier_wait(used.at[slot])
        load(n, slot)

    for slot in range(min(stages, num_chunks)):
        plgpu.barrier_wait(used.at[slot])


def _keys_transposed(k_s, slot, interpret):
    """K_n^T's two 64-row halves as MMA left operands: transposed views of the [c, K] slot (the interpreter, which
    has no transposed views, receives K^T [K, c] from the wrapper instead)."""
    c = _ROWS
    if interpret:
        return k_s.at[slot, pl.ds(0, c)], k_s.at[slot, pl.ds(c, c)]
    return (plgpu.transpose_ref(k_s.at[slot, :, pl.ds(0, c)], (1, 0)),
            plgpu.transpose_ref(k_s.at[slot, :, pl.ds(c, c)], (1, 0)))


def _rowvec(ref, *, width, interpret):
    """A [c] float32 row of shared memory as the per-row factor of a [c, width] MMA accumulator."""
    layout = plgpu.Layout.WGMMA
    v = ref[...] if interpret else plgpu.load(ref, (), layout=layout.reduce(1), optimized=False)
    return lax.broadcast_in_dim(v, (_ROWS, width), (0,))


def _kernel_keys(k, num_chunks, chunk, interpret):
    """K as the kernels take it: [L, Hk, K] bf16, or [Hk, Nc, K, c] (K^T per chunk) for the interpreter."""
    k = k.astype(jnp.bfloat16)
    if not interpret:
        return k
    key_heads, key_dim = k.shape[1:]
    return jnp.transpose(k.reshape(num_chunks, chunk, key_heads, key_dim), (2, 0, 3, 1))


def _column_block(cluster):
    """(j, shared): the block's column block, and the copy arguments that multicast an operand to its cluster."""
    if cluster > 1:
        return lax.axis_index("j") * cluster + lax.axis_index("cj"), dict(collective_axes="cj")
    return lax.axis_index("j"), {}


def _state_chain(f_s, sb_s, init_ready, ready, steps, stages, update, out):
    """The compute warpgroup's chain. S [K, BV] float32 starts from f_s once its copy has landed and is carried in
    registers as two 64-row halves; each step writes S's bf16 copy to sb_s (the right operand of the step's first
    products), waits for the slot's operands and takes S <- update(n, slot, top, bot); at the end S goes out
    through f_s to `out`."""
    c = _ROWS
    plgpu.barrier_wait(init_ready.at[0])

    def step(n, carry):
        top, bot = carry
        slot = lax.rem(n, stages)
        sb_s[pl.ds(0, c)] = top.astype(jnp.bfloat16)
        sb_s[pl.ds(c, c)] = bot.astype(jnp.bfloat16)
        plgpu.commit_smem()
        plgpu.barrier_wait(ready.at[slot])
        return update(n, slot, top, bot)

    top, bot = lax.fori_loop(0, steps, step, (f_s[pl.ds(0, c)], f_s[pl.ds(c, c)]))
    f_s[pl.ds(0, c)] = top
    f_s[pl.ds(c, c)] = bot
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(f_s, out)
    plgpu.wait_smem_to_gmem(0)


def _launch_params(*, grid, grid_names, cluster, name, scratch, semantics, interpret):
    """`plgpu.kernel`'s launch arguments shared by both passes: one compute and one TMA warpgroup ("wg"), the first
    grid axis in clusters of `cluster` blocks ("cj") when above 1, the lowering semantics named."""
    return dict(grid=grid, grid_names=grid_names,
                **(dict(cluster=(cluster,), cluster_names=("cj",)) if cluster > 1 else {}),
                num_threads=2, thread_name="wg", kernel_name=name, scratch_types=scratch,
                compiler_params=mosaic_compiler_params(semantics),
                interpret=gpu_interpreter() if interpret else False)


def _state_kernel(w_g, u_g, k_g, q_g, p_g, eb_g, eu_g, ek_g, init_g, o_g, final_g,
                  w_s, u_s, k_s, q_s, p_s, eb_s, eu_s, ek_s, sb_s, ub_s, u2_s, o_s, f_s, ready, used, init_ready, *,
                  num_chunks, group, block_v, stages, cluster, interpret):
    c = _ROWS
    h = lax.axis_index("h")
    j, shared = _column_block(cluster)  # a cluster's blocks share one multicast copy of the head's W, K, Q and P
    wg = lax.axis_index("wg")
    cols = pl.ds(j * block_v, block_v)
    kh = lax.div(h, jnp.asarray(group, h.dtype))
    rowvec = functools.partial(_rowvec, width=block_v, interpret=interpret)

    @pl.when(wg == 0)
    def _compute():
        def step(n, slot, top, bot):  # from the initial state in f_s
            def first(x1_ref, x2_ref):
                plgpu.wgmma(x1_ref, w_s.at[slot], sb_s)
                plgpu.wgmma(x2_ref, q_s.at[slot], sb_s)
                return x1_ref[...], x2_ref[...]

            x1, x2 = pl.run_scoped(first, plgpu.ACC((c, block_v), jnp.float32), plgpu.ACC((c, block_v), jnp.float32))
            u = u_s[slot].astype(jnp.float32) - x1
            ub_s[...] = u.astype(jnp.bfloat16)
            u2_s[...] = (u * rowvec(eu_s.at[slot])).astype(jnp.bfloat16)
            plgpu.commit_smem()
            kt_top, kt_bot = _keys_transposed(k_s, slot, interpret)

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

        _state_chain(f_s, sb_s, init_ready, ready, num_chunks, stages, step, final_g.at[h, :, cols])

    @pl.when(wg == 1)
    def _memory():
        plgpu.copy_gmem_to_smem(init_g.at[h, :, cols], f_s, init_ready.at[0])

        def load(n, slot):
            rows = pl.ds(n * c, c)
            bar = ready.at[slot]
            plgpu.copy_gmem_to_smem(w_g.at[rows, h], w_s.at[slot], bar, **shared)
            plgpu.copy_gmem_to_smem(u_g.at[rows, h, cols], u_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(k_g.at[kh, n] if interpret else k_g.at[rows, kh], k_s.at[slot], bar, **shared)
            plgpu.copy_gmem_to_smem(q_g.at[rows, kh], q_s.at[slot], bar, **shared)
            plgpu.copy_gmem_to_smem(p_g.at[h, rows], p_s.at[slot], bar, **shared)
            plgpu.copy_gmem_to_smem(eb_g.at[h, rows], eb_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(eu_g.at[h, rows], eu_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(ek_g.at[h, n], ek_s.at[slot], bar)

        _stream_chunks(num_chunks, stages, load, used)


_COPIES = 8  # TMA copies per chunk slot, each one arrival on the slot's ready barrier


@functools.partial(jax.jit, static_argnames=("chunk", "out_dtype", "scale", "config", "interpret"))
def state_pass_mgpu(w, u, k, b, q, p, init, *, chunk: int, out_dtype, scale: float,
                    config: MosaicStateConfig = MosaicStateConfig(), interpret: bool = False):
    """`state.state_pass` for one piece, scalar gates, the delta rule and outputs: w [L, H, K], u [L, H, V], k, q
    [L, Hk, K], b [H, L] (in-chunk cumulative log gates), p [H, L, c], init [H, K, V] float32, L a multiple of the
    chunk. Returns (o [L, H, V] out_dtype, final [H, K, V] float32); `reference.state_pass_reference` computes the
    same in float32."""
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
    k = _kernel_keys(k, num_chunks, chunk, interpret)
    # every MMA operand takes the swizzle of BV bf16 values (64 or 128 bytes): an MMA's two operands must agree
    stages = config.stages
    # clusters where they divide a head's column blocks (and not in the interpreter: no cluster barriers there)
    cluster = config.cluster if not interpret and (value_dim // bv) % config.cluster == 0 else 1
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
        # a slot's step is done (in every block of the cluster, which all receive the slot's shared copies)
        plgpu.ClusterBarrier(collective_axes=("cj",), num_barriers=stages) if cluster > 1
        else plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=1),  # the initial state has landed
    ]
    kernel = plgpu.kernel(
        functools.partial(_state_kernel, num_chunks=num_chunks, group=heads // key_heads, block_v=bv,
                          stages=stages, cluster=cluster, interpret=interpret),
        out_type=(jax.ShapeDtypeStruct((length, heads, value_dim), out_dtype),
                  jax.ShapeDtypeStruct((heads, key_dim, value_dim), jnp.float32)),
        **_launch_params(grid=(value_dim // bv // cluster, heads), grid_names=("j", "h"), cluster=cluster,
                         name="gdn_mgpu_state_pass", scratch=scratch, semantics=config.semantics,
                         interpret=interpret),
    )
    return kernel(w, u, k, q, p, eb, eu, ek, init.astype(jnp.float32))


def _transfer_kernel(w_g, k_g, eu_g, ek_g, eye_g, t_g, w_s, k_s, eu_s, ek_s, sb_s, u2_s, f_s, ready, used,
                     init_ready, *, group_chunks, group, heads, block_v, stages, cluster, interpret):
    """The state pass's step with zero values and no outputs, from the identity, over one group of chunks:
    S <- e^{b_last} S - K^T (e^{b_last - b} * (W S)), so that S ends as the group's A_last ... A_first. Block
    (column block, head, group); the TMA warpgroup streams W, K and two decay rows (W and K multicast to a
    cluster's column blocks), as in `_state_kernel`."""
    c = _ROWS
    hg = lax.axis_index("hg")  # heads and groups share one grid axis, leaving a third for a vmapped batch
    h, gi = lax.rem(hg, jnp.asarray(heads, hg.dtype)), lax.div(hg, jnp.asarray(heads, hg.dtype))
    j, shared = _column_block(cluster)
    wg = lax.axis_index("wg")
    cols = pl.ds(j * block_v, block_v)
    kh = lax.div(h, jnp.asarray(group, h.dtype))
    first = gi * group_chunks
    rowvec = functools.partial(_rowvec, width=block_v, interpret=interpret)

    @pl.when(wg == 0)
    def _compute():
        def step(n, slot, top, bot):  # from the identity's columns in f_s
            def first_product(x_ref):
                plgpu.wgmma(x_ref, w_s.at[slot], sb_s)
                return x_ref[...]

            x = pl.run_scoped(first_product, plgpu.ACC((c, block_v), jnp.float32))
            u2_s[...] = (-(x * rowvec(eu_s.at[slot]))).astype(jnp.bfloat16)
            plgpu.commit_smem()
            kt_top, kt_bot = _keys_transposed(k_s, slot, interpret)

            def second(t_ref, b_ref):
                plgpu.wgmma(t_ref, kt_top, u2_s)
                plgpu.wgmma(b_ref, kt_bot, u2_s)
                return t_ref[...], b_ref[...]

            acc = plgpu.ACC((c, block_v), jnp.float32)
            kt_u_top, kt_u_bot = pl.run_scoped(second, acc, acc)
            decay = rowvec(ek_s.at[slot])
            plgpu.barrier_arrive(used.at[slot])
            return top * decay + kt_u_top, bot * decay + kt_u_bot

        _state_chain(f_s, sb_s, init_ready, ready, group_chunks, stages, step, t_g.at[gi, h, :, cols])

    @pl.when(wg == 1)
    def _memory():
        plgpu.copy_gmem_to_smem(eye_g.at[:, cols], f_s, init_ready.at[0])

        def load(n, slot):
            m = first + n
            rows = pl.ds(m * c, c)
            bar = ready.at[slot]
            plgpu.copy_gmem_to_smem(w_g.at[rows, h], w_s.at[slot], bar, **shared)
            plgpu.copy_gmem_to_smem(k_g.at[kh, m] if interpret else k_g.at[rows, kh], k_s.at[slot], bar, **shared)
            plgpu.copy_gmem_to_smem(eu_g.at[h, rows], eu_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(ek_g.at[h, m], ek_s.at[slot], bar)

        _stream_chunks(group_chunks, stages, load, used)


@functools.partial(jax.jit, static_argnames=("chunk", "group_chunks", "config", "interpret"))
def transfer_pass_mgpu(w, k, b, *, chunk: int, group_chunks: int, config: MosaicStateConfig = MosaicStateConfig(),
                       interpret: bool = False):
    """The per-group products of `state.transfer_pass` for scalar gates: w [L, H, K], k [L, Hk, K], b [H, L]
    (in-chunk cumulative log gates), L a whole number of groups of `group_chunks` chunks. Returns [groups, H, K, K]
    float32, group i's A_last ... A_first (A_n = e^{b_last} I - K_n^T diag(e^{b_last - b}) W_n), with bf16 products
    of S's bf16 copy as in the state pass. One block per (column block of the identity's K columns, head, group):
    the groups run in parallel, each `group_chunks` steps deep. `reference.transfer_pass_reference` computes the
    same in float32."""
    length, heads, key_dim = w.shape
    key_heads = k.shape[1]
    bv = config.block_v
    num_chunks = length // chunk
    if not supported(chunk, key_dim, key_dim, bv) or length % chunk or group_chunks < 1 or num_chunks % group_chunks:
        raise ValueError(f"transfer_pass_mgpu takes chunk 64, K 128 and whole groups of chunks; got chunk {chunk}, K "
                         f"{key_dim}, L {length}, group of {group_chunks} chunks")
    groups = num_chunks // group_chunks
    b = b.astype(jnp.float32)
    b_last = b.reshape(heads, num_chunks, chunk)[..., -1]
    eu = jnp.exp(jnp.repeat(b_last, chunk, axis=1) - b)
    ek = jnp.broadcast_to(jnp.exp(b_last)[..., None], (heads, num_chunks, chunk))
    w, k = w.astype(jnp.bfloat16), _kernel_keys(k, num_chunks, chunk, interpret)
    stages = config.stages
    cluster = config.cluster if not interpret and (key_dim // bv) % config.cluster == 0 else 1
    tile = (plgpu.TilingTransform((8, bv)), plgpu.SwizzleTransform(2 * bv))
    smem = lambda shape: plgpu.SMEM(shape, jnp.bfloat16, transforms=tile)  # noqa: E731
    scratch = [
        smem((stages, chunk, key_dim)),  # W
        smem((stages, key_dim, chunk) if interpret else (stages, chunk, key_dim)),  # K (K^T in the interpreter)
        plgpu.SMEM((stages, chunk), jnp.float32),  # e^{b_last - b}
        plgpu.SMEM((stages, chunk), jnp.float32),  # e^{b_last}
        smem((key_dim, bv)),  # S in bf16
        smem((chunk, bv)),  # -e^{b_last - b} W S in bf16
        plgpu.SMEM((key_dim, bv), jnp.float32,
                   transforms=(plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))),  # S, from the identity
        plgpu.Barrier(num_arrivals=4, num_barriers=stages),  # a slot's W, K and rows have landed
        plgpu.ClusterBarrier(collective_axes=("cj",), num_barriers=stages) if cluster > 1
        else plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=1),  # the identity's columns have landed
    ]
    kernel = plgpu.kernel(
        functools.partial(_transfer_kernel, group_chunks=group_chunks, group=heads // key_heads, heads=heads,
                          block_v=bv, stages=stages, cluster=cluster, interpret=interpret),
        out_type=jax.ShapeDtypeStruct((groups, heads, key_dim, key_dim), jnp.float32),
        **_launch_params(grid=(key_dim // bv // cluster, heads * groups), grid_names=("j", "hg"), cluster=cluster,
                         name="gdn_mgpu_transfer_pass", scratch=scratch, semantics=config.semantics,
                         interpret=interpret),
    )
    return kernel(w, k, eu, ek, jnp.eye(key_dim, dtype=jnp.float32))
