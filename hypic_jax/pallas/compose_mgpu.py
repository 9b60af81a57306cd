"""The split-operand fold (`compose.fold_split_pallas`) written for Pallas's Mosaic GPU lowering (Hopper).

Why a second lowering: Nsight Compute on the Triton fold (bench/RESULTS.md) shows each step's
three bf16 products issued as three warpgroup-MMA groups with a full wait after each (Triton waits on every dot
whose result is not a loop-carried accumulator), and the running value's bf16 planes passed to the next step's MMA
through shared memory. Here the kernel states the schedule itself:

- one block per (batch entry, 128 rows of X^T), X being the state (rows < V of the output) or the composed
  transfer (rows >= V); two compute warpgroups hold 64 rows each in registers, split them into bf16 hi/lo planes in
  registers (the planes are the MMAs' left operands, read from registers), issue the three products of a step into
  one accumulator, wait once and add S_i^T (`_bf16x3_step`);
- a third warpgroup streams the operands with the TMA engine (`_stream`): T_i's planes into `stages` shared-memory
  slots (64 KiB a slot at K = 128), S_i^T into one slot (64 KiB of float32, read into registers at the start of a
  step and refilled while the products run), each slot guarded by a ready and a consumed barrier.

The arithmetic is `fold_split_pallas`'s bf16x3 (X^T <- lo T_hi^T + hi T_lo^T + hi T_hi^T + S^T, the running value
rounded to its bf16 planes): a state block starts from S_1 (a load) as there, a transfer block from the identity's
rows (one more step than loading T_1's columns, whose planes the split carries exactly). `prefix_fold_split_mgpu`
runs the state blocks writing every step's X_i^T; the opt-in multicast pair (`MosaicFoldConfig.multicast`) pairs a
state block and a transfer block in a cluster that reads T once. Interpret mode (`interpret=True`) runs the kernels
on the CPU through Pallas's GPU interpreter (the multicast pair excepted: the interpreter has no cluster barriers).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from hypic_jax.pallas.platform import check_semantics, gpu_interpreter, mosaic_compiler_params
from hypic_jax.pallas.split import check_split_operands

__all__ = ["MosaicFoldConfig", "fold_split_mgpu", "PREFIX_CONFIG", "prefix_fold_split_mgpu", "supported"]

_ROWS = 64  # rows of X^T per compute warpgroup (the warpgroup MMA's M)
_WARPGROUPS = 2  # compute warpgroups per block


@dataclasses.dataclass(frozen=True)
class MosaicFoldConfig:
    """stages: shared-memory slots for T_i's planes (two fit beside S's slot at K = 128: 2 x 64 + 64 KiB);
    compute_registers / memory_registers: per-thread register budgets of the compute and TMA warpgroups (2 x 128 x
    232 + 128 x 40 fills the 64 Ki registers of an SM); multicast: the pair (K = V) as clusters of a state block and
    a transfer block that read T once through multicast copies (`_fold_kernel`'s cluster form), faster than the
    default at the composition bar's shape (`bench/pic_kernels.py --sections bar`; see bench/RESULTS.md). Off by
    default: Pallas's GPU interpreter has no cluster barriers, so this variant is checked on the GPU and lowered in
    CI, not run there. semantics: Mosaic GPU's lowering (`platform.mosaic_compiler_params`); the benchmarks ran
    under "warpgroup" (JAX 0.11's default) and none covers "lane"."""

    stages: int = 2
    compute_registers: int = 232
    memory_registers: int = 40
    multicast: bool = False
    semantics: str = "warpgroup"

    def __post_init__(self):
        check_semantics(self.semantics)


def supported(key_dim: int, value_dim: int) -> bool:
    """Shapes the kernel takes: whole 128-row blocks of both S^T and T^T, and 128-byte rows of bf16 tiles."""
    block = _ROWS * _WARPGROUPS
    return key_dim % block == 0 and value_dim % block == 0


def _bf16x3_step(acc, th, tl, ready_hi, ready_lo, used, planes=None):
    """One step's products for a warpgroup's 64 rows: X^T T^T at bf16x3 (lo T_hi^T + hi T_lo^T + hi T_hi^T), the
    running value split into its bf16 planes in registers, the three MMAs issued into one accumulator and waited
    once; waits for the slot's planes (th, tl) first and releases the slot (`used`) after. planes (the GPU
    interpreter only): shared memory [2, 64, K] the running value's planes pass through, T's slot then holding T^T
    (see `_fold_kernel`)."""
    hi = acc.astype(jnp.bfloat16)
    lo = (acc - hi.astype(jnp.float32)).astype(jnp.bfloat16)
    plgpu.barrier_wait(ready_hi)
    plgpu.barrier_wait(ready_lo)
    if planes is not None:
        planes.at[0][...] = lo
        planes.at[1][...] = hi
        plgpu.commit_smem()
        lo, hi = planes.at[0], planes.at[1]
    else:
        th, tl = plgpu.transpose_ref(th, (1, 0)), plgpu.transpose_ref(tl, (1, 0))

    def products(acc_ref):
        plgpu.wgmma(acc_ref, lo, th)
        plgpu.wgmma(acc_ref, hi, tl)
        plgpu.wgmma(acc_ref, hi, th)
        return acc_ref[...]

    out = pl.run_scoped(products, plgpu.ACC((_ROWS, th.shape[-1]), jnp.float32))
    plgpu.barrier_arrive(used)
    return out


def _stream(s_from, first, n, stages, load_s, refill_t, s_used, t_used):
    """The TMA warpgroup's loop after its first fills (S's slot, and T's slots with the steps first .. first +
    stages - 1): with s_from (a block that adds S), S_i for i = s_from .. n-1 once the slot's previous content is
    read, each followed by T_{i + stages - 1} once T_{i-1}'s step is done; without, T_t for t = stages .. n-1 as
    slots free up. Then a drain: each barrier's last phase is waited out, so the block ends with every arrival
    observed."""
    if s_from is not None:
        @pl.loop(s_from, n)
        def _(i):
            plgpu.barrier_wait(s_used.at[0])
            load_s(i)
            refill_t(i + stages - 1)
    else:
        @pl.loop(stages, max(n, stages))
        def _(t):
            refill_t(t)
    plgpu.barrier_wait(s_used.at[0])
    for slot in range(min(stages, n - first)):
        plgpu.barrier_wait(t_used.at[slot])


def _fold_kernel(th_g, tl_g, s_g, x0_g, o_g, th_s, tl_s, s_s, t_ready_hi, t_ready_lo, s_ready, t_used, s_used,
                 *extra, num_segments, value_dim, stages, compute_registers, memory_registers, every_step,
                 has_initial, interpret, cluster=False):
    """Block (rb, c): rows [rb * 128, rb * 128 + 128) of X^T, of the state (rb * 128 < V) or of the transfer.

    A state block starts from S_0 (a load) and steps i = 1 .. n-1 with S_i, or with `has_initial` from the given
    state's rows (x0_g [B, V, K]) and steps i = 0 .. n-1; a transfer block starts from the identity's rows (x0_g
    [K, K]) and steps i = 0 .. n-1 without S. The two kinds run separate loops, so neither has a data-dependent
    select or a scalar broadcast inside (Mosaic GPU's warpgroup semantics take neither), and transfer blocks move
    no S. every_step (state blocks only): o_g [n, B, V, K] takes X_i^T after every step, staged in extra[0].

    With `interpret` (Pallas's GPU interpreter) the last of `extra` is shared memory for the running value's
    planes: the interpreter takes an MMA's left operand from shared memory only and has no transposed right
    operand, so there the planes pass through it and T's planes arrive transposed; on the GPU the planes stay in
    registers and the MMA reads T^T through a transposed view of T's slot.

    With `cluster` (the multicast pair, K = V) the blocks of rows m of the state ("rb" 0) and of the transfer
    ("rb" 1) form a cluster and read T_i's planes from one multicast TMA copy (each block issues its share, the TMA
    engine writes the planes into both blocks' slots), so T leaves memory once per pair; a slot is refilled once
    both blocks are done with it (`t_used` is then a cluster barrier). To consume T in step, the state block starts
    from zero and adds S_i from i = 0, like the transfer block's i = 0 .. n-1."""
    block = _ROWS * _WARPGROUPS
    c = lax.axis_index("c")
    if cluster:  # rows of X^T: the state's rows m, or the transfer's
        row0 = lax.axis_index("rb") * value_dim + lax.axis_index("m") * block
    else:
        row0 = lax.axis_index("rb") * block
    collective = dict(collective_axes="rb") if cluster else {}
    wg = lax.axis_index("wg")
    is_state = row0 < value_dim
    n = num_segments
    o_s = extra[0] if every_step else None
    a_s = extra[-1] if interpret else None

    def compute(first, adds_s, zero_start=False):
        """first: the first step (T index) of the loop; adds_s: a state block (adds S_i every step); zero_start:
        the running value starts from zero instead of a load."""
        rows = pl.ds(wg * _ROWS, _ROWS)
        out_rows = pl.ds(row0 + wg * _ROWS, _ROWS)
        if zero_start:
            acc0 = plgpu.layout_cast(jnp.zeros((_ROWS, th_s.shape[-1]), jnp.float32), plgpu.Layout.WGMMA)
        else:
            plgpu.barrier_wait(s_ready.at[0])  # S_0, or the initial state's or the identity's rows
            acc0 = s_s[rows]
            plgpu.barrier_arrive(s_used.at[0])

        def emit(i, acc):  # every_step: X_i^T out through o_s, once o_s's previous copy has read it
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            o_s[rows] = acc
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_s.at[rows], o_g.at[i, c, out_rows])

        if every_step and first:
            emit(0, acc0)

        def step(i, acc):
            slot = lax.rem(i - first, stages)
            if adds_s:
                plgpu.barrier_wait(s_ready.at[0])
                s = s_s[rows]
                plgpu.barrier_arrive(s_used.at[0])
            out = _bf16x3_step(acc, th_s.at[slot], tl_s.at[slot], t_ready_hi.at[slot], t_ready_lo.at[slot],
                               t_used.at[slot], None if a_s is None else a_s.at[wg])
            out = out + s if adds_s else out
            if every_step:
                emit(i, out)
            return out

        acc = lax.fori_loop(first, n, step, acc0)
        if not every_step:
            s_s[rows] = acc  # no S load is pending: the slot stages the output
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(s_s.at[rows], o_g.at[c, out_rows])
        plgpu.wait_smem_to_gmem(0)

    def memory(first, adds_s):
        def load_t(t):
            slot = lax.rem(t - first, stages)
            plgpu.copy_gmem_to_smem(th_g.at[t, c], th_s.at[slot], t_ready_hi.at[slot], **collective)
            plgpu.copy_gmem_to_smem(tl_g.at[t, c], tl_s.at[slot], t_ready_lo.at[slot], **collective)

        def refill_t(t):  # T_t into the slot of T_{t - stages}, once that step is done
            @pl.when(jnp.logical_and(t >= first + stages, t < n))
            def _():
                plgpu.barrier_wait(t_used.at[lax.rem(t - first, stages)])
                load_t(t)

        def load_s(i):
            plgpu.copy_gmem_to_smem(s_g.at[i, c, pl.ds(row0, block)], s_s, s_ready.at[0])

        if not adds_s:
            plgpu.copy_gmem_to_smem(x0_g.at[pl.ds(row0 - value_dim, block)], s_s, s_ready.at[0])
        elif has_initial:
            plgpu.copy_gmem_to_smem(x0_g.at[c, pl.ds(row0, block)], s_s, s_ready.at[0])
        else:  # S_0 first: the running value's start, or (zero start) the first S added
            load_s(0)
        for t in range(first, min(first + stages, n)):
            load_t(jnp.asarray(t, jnp.int32))
        _stream((0 if has_initial else 1) if adds_s else None, first, n, stages, load_s, refill_t, s_used, t_used)

    state_first = 0 if has_initial or cluster else 1

    @pl.when(wg < _WARPGROUPS)
    def _compute():
        if not interpret:
            plgpu.set_max_registers(compute_registers, action="increase")
        pl.when(is_state)(lambda: compute(state_first, True, zero_start=cluster))
        if not every_step:
            pl.when(jnp.logical_not(is_state))(lambda: compute(0, False))

    @pl.when(wg == _WARPGROUPS)
    def _memory():
        if not interpret:
            plgpu.set_max_registers(memory_registers, action="decrease")
        pl.when(is_state)(lambda: memory(state_first, True))
        if not every_step:
            pl.when(jnp.logical_not(is_state))(lambda: memory(0, False))


def _launch(th, tl, s, x0, *, with_transfer, every_step, has_initial, config, interpret):
    """The fold's `plgpu.kernel` over flattened split operands: th, tl [n, B, K, K], s [n, B, V, K], x0 the
    transfer blocks' identity rows [K, K] or, with has_initial, the initial state's rows [B, V, K]."""
    n, b, value_dim, key_dim = s.shape
    if not supported(key_dim, value_dim):
        raise ValueError(f"the Mosaic GPU fold needs K and V multiples of {_ROWS * _WARPGROUPS}, got K {key_dim}, "
                         f"V {value_dim}")
    block = _ROWS * _WARPGROUPS
    width = value_dim + (key_dim if with_transfer else 0)
    tile = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    f32_tile = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
    stages = config.stages
    scratch = [
        plgpu.SMEM((stages, key_dim, key_dim), jnp.bfloat16, transforms=tile),
        plgpu.SMEM((stages, key_dim, key_dim), jnp.bfloat16, transforms=tile),
        plgpu.SMEM((block, key_dim), jnp.float32, transforms=f32_tile),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_arrivals=_WARPGROUPS, num_barriers=stages),
        plgpu.Barrier(num_arrivals=_WARPGROUPS, num_barriers=1),
    ]
    if every_step:  # the output's staging slot
        scratch.append(plgpu.SMEM((block, key_dim), jnp.float32, transforms=f32_tile))
    if interpret:  # the running value's planes (see `_fold_kernel`)
        scratch.append(plgpu.SMEM((_WARPGROUPS, 2, _ROWS, key_dim), jnp.bfloat16, transforms=tile))
        th, tl = jnp.swapaxes(th, -1, -2), jnp.swapaxes(tl, -1, -2)
    out_shape = (n, b, value_dim, key_dim) if every_step else (b, width, key_dim)
    cluster = with_transfer and config.multicast and key_dim == value_dim and not interpret
    if cluster:  # t_used: a slot is free once both blocks of the cluster are done with it
        scratch[-2] = plgpu.ClusterBarrier(collective_axes=("rb",), num_arrivals=_WARPGROUPS, num_barriers=stages)
        layout = dict(grid=(value_dim // block, b), grid_names=("m", "c"), cluster=(2,), cluster_names=("rb",))
        name = "compose_mgpu_pair_cluster"
    else:
        layout = dict(grid=(width // block, b), grid_names=("rb", "c"))
        name = "compose_mgpu_prefix_fold" if every_step else "compose_mgpu_fold"
    kernel = plgpu.kernel(
        functools.partial(_fold_kernel, num_segments=n, value_dim=value_dim, stages=stages,
                          compute_registers=config.compute_registers, memory_registers=config.memory_registers,
                          every_step=every_step, has_initial=has_initial, interpret=interpret, cluster=cluster),
        out_type=jax.ShapeDtypeStruct(out_shape, jnp.float32),
        **layout,
        num_threads=_WARPGROUPS + 1,
        thread_name="wg",
        kernel_name=name,
        scratch_types=scratch,
        compiler_params=mosaic_compiler_params(config.semantics),
        interpret=gpu_interpreter() if interpret else False,
    )
    return kernel(th, tl, s, x0)


@functools.partial(jax.jit, static_argnames=("with_transfer", "config", "interpret"))
def fold_split_mgpu(t_hi: Array, t_lo: Array, states_t: Array, *, with_transfer: bool = False,
                    config: MosaicFoldConfig = MosaicFoldConfig(), interpret: bool = False):
    """`compose.fold_split_pallas` (same arguments and results) under the Mosaic GPU lowering; K and V multiples of
    128 (`supported`)."""
    n, batch, th, tl, s = check_split_operands(t_hi, t_lo, states_t)
    value_dim, key_dim = s.shape[-2:]
    eye = jnp.eye(key_dim, dtype=jnp.float32)  # the transfer blocks' first rows
    out = _launch(th, tl, s, eye, with_transfer=with_transfer, every_step=False, has_initial=False, config=config,
                  interpret=interpret)
    out = jnp.swapaxes(out, -1, -2)  # X^T -> X
    state = out[..., :value_dim].reshape(batch + (key_dim, value_dim))
    transfer = out[..., value_dim:].reshape(batch + (key_dim, key_dim)) if with_transfer else None
    return transfer, state


# One T slot: two beside S's slot and the output's staging slot exceed the shared memory (64 KB each at K = 128).
PREFIX_CONFIG = MosaicFoldConfig(stages=1)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def prefix_fold_split_mgpu(t_hi: Array, t_lo: Array, states_t: Array, initial_state: Array | None = None, *,
                           config: MosaicFoldConfig = PREFIX_CONFIG, interpret: bool = False) -> Array:
    """`compose.prefix_fold_split_pallas` (same arguments and results: every state S_i = T_i S_{i-1} + S_i from
    `initial_state` or zeros, transposed like the input S, [n, ..., V, K]) under the Mosaic GPU lowering."""
    n, batch, th, tl, s = check_split_operands(t_hi, t_lo, states_t)
    b, value_dim, key_dim = s.shape[1:]
    if initial_state is None:
        x0 = jnp.eye(key_dim, dtype=jnp.float32)  # unread: state blocks start from S_0
    else:
        if initial_state.shape[-2:] != (key_dim, value_dim):
            raise ValueError(f"initial_state must end in (K, V) = {(key_dim, value_dim)}, got {initial_state.shape}")
        init = jnp.broadcast_to(initial_state.astype(jnp.float32), batch + (key_dim, value_dim))
        x0 = jnp.swapaxes(init.reshape((b, key_dim, value_dim)), -1, -2)
    out = _launch(th, tl, s, x0, with_transfer=False, every_step=True, has_initial=initial_state is not None,
                  config=config, interpret=interpret)
    return out.reshape((n,) + batch + (value_dim, key_dim))
