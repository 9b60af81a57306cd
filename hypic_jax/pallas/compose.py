"""Composition of many dense (T, S) pairs for all layers and heads at once, with a selectable dot algorithm.

A request that reuses n cached segments needs, per linear layer and value head, the state at every segment
boundary: S_i = T_i S_{i-1} + S(C_i|0). For dense transfers (delta rules, K = V = 128) that is n products of
128 x 128 matrices per (layer, head), and composing the pairs themselves, (T2, S2) o (T1, S1) = (T2 T1, T2 S1 + S2),
doubles it. At 64 segments x 30 layers x 32 heads (the shape called "the composition bar" below) this is about
0.26 TFLOP (states) or 0.5 TFLOP (pairs), too much for plain float32 FMA, so the products go to the tensor cores
with an algorithm that keeps float32 accuracy:

  "f32"    float32 FMA (Precision.HIGHEST): the accuracy reference, slow;
  "tf32"   one TF32 pass: fast, ~1e-3 relative error per product, not float32-level;
  "tf32x3" three TF32 passes (split operands into hi + lo): float32-level;
  "bf16x3" three bfloat16 passes (a_hi b_hi + a_hi b_lo + a_lo b_hi): ~1e-5 relative per product, float32-level
           in practice, and bfloat16 runs at twice TF32's rate on Hopper;
  "bf16x6" / "bf16x9": more correction terms, closer to exact float32.

Associativity: composing pairs is associative but not commutative, so any bracketing of the ordered sequence gives
the same pair in exact arithmetic. `compose_all` uses a balanced tree (log2 n launches of one large batched
matmul each, n - 1 compositions in all), `prefix_states` a sequential fold of state updates (n launches, half the
products of composing pairs, and exactly the states a request needs), `prefix_pairs` `lax.associative_scan`
(every prefix pair, about 2n compositions). Rounding differs between bracketings only at the algorithm's own level.
All functions take T [n, ..., K, K] and S [n, ..., K, V] with the segment axis first and any batch axes (layers,
heads) after it.

The Pallas folds below run every (layer, head) in one launch. `fold_split_pallas` takes the pairs as
`split_operands` stores them (T as bfloat16 hi/lo planes, S transposed): the same bf16x3 arithmetic, with T's
split done once per cache entry instead of in every step, and the running state kept in registers.
`fold_split` and `prefix_fold_split` pick between them and the same folds under the Mosaic GPU lowering
(`compose_mgpu`, Hopper only), which is the faster of the two on Hopper for the composed pair and for every prefix
state. `bench/pic_kernels.py --sections bar` times every fold here at the composition bar's shape and
`bench/kernels.py` the XLA compositions; bench/RESULTS.md holds the numbers.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hypic_jax.pallas import compose_mgpu
from hypic_jax.pallas.platform import is_hopper
from hypic_jax.pallas.split import check_split_operands, split_bf16, split_operands
from hypic_jax.summary import ALGORITHMS, matmul, precision_of

__all__ = ["ALGORITHMS", "precision_of", "matmul", "compose_pair", "compose_all", "prefix_states", "prefix_pairs"]


def compose_pair(first: tuple[Array, Array], second: tuple[Array, Array], algorithm: str = "bf16x3"):
    """(T2, S2) o (T1, S1) = (T2 T1, T2 S1 + S2), both products in one matmul of T2 against [T1 | S1]."""
    t1, s1 = first
    t2, s2 = second
    key_dim = t1.shape[-1]
    both = matmul(t2, jnp.concatenate([t1, s1], axis=-1), algorithm)
    return both[..., :key_dim], both[..., key_dim:] + s2


def compose_all(transfers: Array, states: Array | None, algorithm: str = "bf16x3") -> tuple[Array, Array | None]:
    """The pair of the whole ordered sequence (segment axis 0), by a balanced tree of batched compositions.
    states None: the transfers' ordered product T_n ... T_1 alone (returned with None)."""
    t, s = transfers, states
    while t.shape[0] > 1:
        n = t.shape[0]
        if n % 2:  # carry the last pair up unchanged
            t_last, t = t[-1:], t[:-1]
            if s is not None:
                s_last, s = s[-1:], s[:-1]
        if s is None:
            t_new, s_new = matmul(t[1::2], t[0::2], algorithm), None
        else:
            t_new, s_new = compose_pair((t[0::2], s[0::2]), (t[1::2], s[1::2]), algorithm)
        if n % 2:
            t_new = jnp.concatenate([t_new, t_last])
            s_new = None if s is None else jnp.concatenate([s_new, s_last])
        t, s = t_new, s_new
    return t[0], None if s is None else s[0]


def prefix_states(transfers: Array, states: Array, initial_state: Array | None = None,
                  algorithm: str = "bf16x3") -> Array:
    """The state after each segment, S_i = T_i S_{i-1} + S(C_i|0), by a sequential fold (one batched matmul each)."""
    init = jnp.zeros(states.shape[1:], jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)

    def step(state, pair):
        t, s = pair
        state = matmul(t, state, algorithm) + s
        return state, state

    _, out = lax.scan(step, init, (transfers, states))
    return out


def prefix_pairs(transfers: Array, states: Array, algorithm: str = "bf16x3") -> tuple[Array, Array]:
    """Every prefix pair (T_i ... T_1, S after segment i from zero) by `lax.associative_scan` (log depth)."""

    def fn(first, second):
        return compose_pair(first, second, algorithm)

    return lax.associative_scan(fn, (transfers, states), axis=0)


# ----------------------------------------------------------------------------------------------------------------
# Pallas (Triton) fold: every (layer, head) in one launch, the running pair kept in registers.

_KERNEL_PRECISION = {
    "bf16": lax.DotAlgorithmPreset.BF16_BF16_F32,
    "f32": lax.Precision.HIGHEST,
    "tf32": lax.Precision.DEFAULT,
    "tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
    "bf16x3": lax.DotAlgorithmPreset.BF16_BF16_F32_X3,
    "bf16x6": lax.DotAlgorithmPreset.BF16_BF16_F32_X6,
    "bf16x9": lax.DotAlgorithmPreset.BF16_BF16_F32_X9,
}


@dataclasses.dataclass(frozen=True)
class FoldConfig:
    """block_w: accumulator columns per program; algorithm: in-kernel dot algorithm (see ALGORITHMS). Defaults: the
    fastest launch of `prefix_fold_pallas` for one PIC layer's 64 groups x 32 heads on the H200
    (`bench/pic_kernels.py --sections prefix` times the warps, stages and widths; see bench/RESULTS.md). The
    composition of all layers at once prefers wider blocks (`FINAL_STATE_CONFIG`)."""

    block_w: int = 32
    algorithm: str = "bf16x3"
    num_warps: int = 8
    num_stages: int = 3
    seam_step: str = "nested"  # span fold only: "nested" or "split" (see `_span_fold_kernel`)
    # span fold only: dot algorithm of the seam's two rank-c products (None: `algorithm`). "bf16" is the precision
    # of the GDN kernel's own state dots for bfloat16 models; the interior's T product keeps `algorithm`.
    seam_algorithm: str | None = None


# The launch of `fold_pallas` for the composed state of many heads and layers at once (the composition bar: 64
# segments x 30 layers x 32 heads of dense 128 x 128 pairs): whole 128-column states per program, the fastest of
# the variants that `bench/pic_kernels.py --sections bar` times (fewer stages, narrower blocks and fewer warps are
# slower; see bench/RESULTS.md).
FINAL_STATE_CONFIG = FoldConfig(block_w=128, num_warps=8, num_stages=3)


def _fold_kernel(t_ref, s_ref, o_ref, *, num_segments, value_blocks, block_w, prec, with_transfer):
    """One (column block j, batch entry): acc <- T_i acc + S_i[:, cols] for i = 0 .. n-1.

    Column blocks j < value_blocks are state columns (start at zero, add S_i); the others are identity-widened
    transfer columns (start at the identity's columns, add nothing), so the same loop yields T_n ... T_1.
    Columns are independent (T_i multiplies from the left), which is what splits one head's fold over programs.
    Without the transfer every program is a state block: no selects in the loop.
    """
    if not with_transfer:
        def plain(i, acc):
            return lax.dot_general(t_ref[i].astype(jnp.float32), acc, (((1,), (0,)), ((), ())), precision=prec,
                                   preferred_element_type=jnp.float32) + s_ref[i].astype(jnp.float32)

        o_ref[...] = lax.fori_loop(0, num_segments, plain, jnp.zeros(o_ref.shape, jnp.float32))
        return
    j = pl.program_id(0)
    is_state = j < value_blocks
    key_dim = t_ref.shape[-1]
    rows = lax.broadcasted_iota(jnp.int32, (key_dim, block_w), 0)
    cols = lax.broadcasted_iota(jnp.int32, (key_dim, block_w), 1)
    offset = (j - value_blocks) * block_w
    acc0 = jnp.where(jnp.logical_and(jnp.logical_not(is_state), rows == cols + offset), 1.0, 0.0)

    def body(i, acc):
        s = jnp.where(is_state, s_ref[i].astype(jnp.float32), 0.0)
        t = t_ref[i].astype(jnp.float32)
        return lax.dot_general(t, acc, (((1,), (0,)), ((), ())), precision=prec,
                               preferred_element_type=jnp.float32) + s

    o_ref[...] = lax.fori_loop(0, num_segments, body, acc0.astype(jnp.float32))


@functools.partial(jax.jit, static_argnames=("with_transfer", "config", "interpret"))
def fold_pallas(transfers: Array, states: Array, *, with_transfer: bool = True, config: FoldConfig = FoldConfig(),
                interpret: bool = False):
    """The composed pair of n ordered segments for every batch entry, in one Pallas launch.

    transfers [n, ..., K, K], states [n, ..., K, V] (batch axes: layers, heads). Returns (T [..., K, K] or None,
    S [..., K, V]): T = T_n ... T_1 and S the state after segment n from a zero start. The fold is sequential
    (n steps of one [K, K] x [K, block_w] product per program) but every batch entry and column block runs in
    parallel, and each T_i is read from memory once per column block (L2 serves the repeats). The pairs are bound
    by the dependent products, not by reading T, so state and transfer columns run in separate programs: one
    program holding both, each T_i loaded once for the two products, is no faster (bench/RESULTS.md).
    """
    n = transfers.shape[0]
    batch = transfers.shape[1:-2]
    key_dim, value_dim = states.shape[-2], states.shape[-1]
    t = transfers.reshape((n, -1, key_dim, key_dim))
    s = states.reshape((n, -1, key_dim, value_dim))
    b = t.shape[1]
    bw = min(config.block_w, value_dim)
    value_blocks = value_dim // bw
    width = value_dim + (key_dim if with_transfer else 0)
    kernel = functools.partial(_fold_kernel, num_segments=n, value_blocks=value_blocks, block_w=bw,
                               prec=_KERNEL_PRECISION[config.algorithm], with_transfer=with_transfer)
    out = pl.pallas_call(
        kernel,
        grid=(width // bw, b),
        in_specs=[
            pl.BlockSpec((n, None, key_dim, key_dim), lambda j, i: (0, i, 0, 0)),
            pl.BlockSpec((n, None, key_dim, bw), lambda j, i: (0, i, 0, jnp.minimum(j, value_blocks - 1))),
        ],
        out_specs=pl.BlockSpec((None, key_dim, bw), lambda j, i: (i, 0, j)),
        out_shape=jax.ShapeDtypeStruct((b, key_dim, width), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="compose_fold",
    )(t, s)
    state = out[..., :value_dim].reshape(batch + (key_dim, value_dim))
    transfer = out[..., value_dim:].reshape(batch + (key_dim, key_dim)) if with_transfer else None
    return transfer, state


__all__ += ["FoldConfig", "FINAL_STATE_CONFIG", "fold_pallas"]


# ----------------------------------------------------------------------------------------------------------------
# Split-operand fold: the pairs stored as the tensor cores read them (`split.split_operands`).


def _dot_t(a, b):
    """a [m, k] @ b[n, k]^T as one bfloat16 tensor-core product, float32 result."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _split_fold_kernel(th_ref, tl_ref, s_ref, *rest, num_segments, value_blocks, block_w, with_transfer,
                       every_step=False, has_initial=False):
    """One (column block j, batch entry) of the fold on split operands at bf16x3.

    The program holds X^T [block_w, K] (X: a block of state columns, or of the composed transfer's columns) and
    steps X^T <- X^T T_i^T + S_i^T: three bfloat16 products a step, the two small correction terms first. The
    running value is the products' left operand, which Hopper's warpgroup MMA reads from registers, and each
    warpgroup's rows evolve on their own, so no step result passes through shared memory; T_i's planes are the
    only shared-memory operands, and the loop prefetches them (no split of T in the loop). Holding X instead (X <-
    T_i X + S_i, the running value the right operand, staged in shared memory every step) is slower for both the
    composed state and the pair (bench/RESULTS.md).
    The first step is a load (X_1 = S_1, or T_1's columns), not a product, unless an initial state is given.
    every_step: write X_i^T after every step (the prefix states, o_ref [n, block_w, K]) instead of the last only;
    has_initial (with every_step only): an initial X_0^T comes before o_ref.
    """
    assert every_step or not has_initial
    init_ref, o_ref = rest if has_initial else (None, rest[0])
    shape = (block_w, th_ref.shape[-1])
    j = pl.program_id(0)
    is_state = j < value_blocks
    read_s = jnp.broadcast_to(is_state, shape) if with_transfer else None

    def load_s(i):  # a transfer program's S loads are masked off, so they move no memory
        return pltriton.load(s_ref.at[i], mask=read_s, other=0.0 if with_transfer else None)

    def step(i, acc):
        hi, lo = split_bf16(acc)
        th, tl = th_ref[i], tl_ref[i]
        # one loop for both kinds of program: one set of prefetch buffers
        acc = _dot_t(lo, th) + _dot_t(hi, tl) + _dot_t(hi, th) + load_s(i)
        if every_step:
            o_ref[i] = acc
        return acc

    if has_initial:  # the prefix fold from a given state (every_step): every step a product
        lax.fori_loop(0, num_segments, step, init_ref[...].astype(jnp.float32))
        return
    acc0 = load_s(jnp.asarray(0, jnp.int32))
    if every_step:
        o_ref[0] = acc0
        lax.fori_loop(1, num_segments, step, acc0)
        return
    if with_transfer:
        first = pl.ds(jnp.maximum(j - value_blocks, 0) * block_w, block_w)
        t0 = th_ref[0, :, first].astype(jnp.float32) + tl_ref[0, :, first].astype(jnp.float32)  # [K, block_w]
        acc0 = jnp.where(is_state, acc0, t0.T)
    o_ref[...] = lax.fori_loop(1, num_segments, step, acc0)


def _split_args(t_hi, t_lo, states_t, config):
    """`split.check_split_operands` for a Triton split-operand fold, whose config must name bf16x3."""
    if config.algorithm != "bf16x3":
        raise ValueError(f"the split-operand fold computes bf16x3 products, got algorithm {config.algorithm!r}")
    return check_split_operands(t_hi, t_lo, states_t)


@functools.partial(jax.jit, static_argnames=("with_transfer", "config", "interpret"))
def fold_split_pallas(t_hi: Array, t_lo: Array, states_t: Array, *, with_transfer: bool = False,
                      config: FoldConfig = FINAL_STATE_CONFIG, interpret: bool = False):
    """`fold_pallas` at bf16x3 on pairs in the format of `split_operands`: t_hi, t_lo [n, ..., K, K] bfloat16,
    states_t [n, ..., V, K] float32 (S transposed).

    Returns (T_n ... T_1 [..., K, K] or None, the state after segment n from zero [..., K, V]), like
    `fold_pallas`, with the same arithmetic and in less time than `fold_pallas` on float32 pairs, for the composed
    state and for the pair (`bench/pic_kernels.py --sections bar`; see bench/RESULTS.md); the Mosaic GPU kernel
    (`fold_split`, `compose_mgpu`) is faster still on Hopper. Each (batch entry, column block) is one program;
    with the transfer, programs past the state columns run the same loop from the identity's columns. L2 eviction
    hints, and one program per column block holding both its state and transfer columns, are no faster.
    """
    n, batch, th, tl, s = _split_args(t_hi, t_lo, states_t, config)
    b, value_dim, key_dim = s.shape[1:]
    bw = _block_width(config.block_w, value_dim)
    if with_transfer and key_dim % bw:
        bw = math.gcd(bw, key_dim)
    value_blocks = value_dim // bw
    width = value_dim + (key_dim if with_transfer else 0)
    t_spec = pl.BlockSpec((n, None, key_dim, key_dim), lambda j, i: (0, i, 0, 0))
    s_spec = pl.BlockSpec((n, None, bw, key_dim), lambda j, i: (0, i, jnp.minimum(j, value_blocks - 1), 0))
    out = pl.pallas_call(
        functools.partial(_split_fold_kernel, num_segments=n, value_blocks=value_blocks, block_w=bw,
                          with_transfer=with_transfer),
        grid=(width // bw, b),
        in_specs=[t_spec, t_spec, s_spec],
        out_specs=pl.BlockSpec((None, bw, key_dim), lambda j, i: (i, j, 0)),
        out_shape=jax.ShapeDtypeStruct((b, width, key_dim), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="compose_split_fold",
    )(th, tl, s)
    out = jnp.swapaxes(out, -1, -2)  # X^T -> X
    state = out[..., :value_dim].reshape(batch + (key_dim, value_dim))
    transfer = out[..., value_dim:].reshape(batch + (key_dim, key_dim)) if with_transfer else None
    return transfer, state


LOWERINGS = ("auto", "mosaic", "triton")


def _use_mosaic(lowering: str, t_hi: Array, states_t: Array, interpret: bool) -> bool:
    """Whether a split-operand fold runs under Mosaic GPU: "mosaic", or "auto" on a Hopper GPU where the shapes
    allow it."""
    if lowering not in LOWERINGS:
        raise ValueError(f"lowering must be one of {LOWERINGS}, got {lowering!r}")
    if lowering != "auto":
        return lowering == "mosaic"
    return compose_mgpu.supported(t_hi.shape[-1], states_t.shape[-2]) and not interpret and is_hopper()


def fold_split(t_hi: Array, t_lo: Array, states_t: Array, *, with_transfer: bool = False, lowering: str = "auto",
               interpret: bool = False):
    """The split-operand fold (arguments and results of `fold_split_pallas`) with its lowering chosen.

    lowering: "mosaic" (`compose_mgpu.fold_split_mgpu`: Hopper, K and V multiples of 128), "triton"
    (`fold_split_pallas`), or "auto": Mosaic GPU on a Hopper GPU where the shapes allow it, Triton otherwise.
    Mosaic GPU is the faster at the composition bar's shape, for the composed state and for the pair
    (`bench/pic_kernels.py --sections bar`; see bench/RESULTS.md): Triton waits out each of a step's three products
    and passes the running value's planes through shared memory, where the Mosaic GPU kernel issues the three into
    one accumulator from registers and streams T and S with the TMA engine.
    """
    if _use_mosaic(lowering, t_hi, states_t, interpret):
        return compose_mgpu.fold_split_mgpu(t_hi, t_lo, states_t, with_transfer=with_transfer, interpret=interpret)
    return fold_split_pallas(t_hi, t_lo, states_t, with_transfer=with_transfer, interpret=interpret)


# The launch of `prefix_fold_split_pallas` that is fastest at the composition bar's shape (`bench/pic_kernels.py
# --sections bar`; 128 columns need 8 warps in 2 stages, as 3 stages exceed the shared memory, and are slower).
PREFIX_SPLIT_CONFIG = FoldConfig(block_w=64, num_warps=4, num_stages=3)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def prefix_fold_split_pallas(t_hi: Array, t_lo: Array, states_t: Array, initial_state: Array | None = None, *,
                             config: FoldConfig = PREFIX_SPLIT_CONFIG, interpret: bool = False) -> Array:
    """`prefix_fold_pallas` at bf16x3 on pairs in the format of `split_operands`: the state after each of the n
    segments, S_i = T_i S_{i-1} + S(C_i|0) from `initial_state` [..., K, V] (zeros if None).

    Returns the states transposed like the input S, [n, ..., V, K] float32 (`jnp.swapaxes(out, -1, -2)` gives
    [n, ..., K, V]): the kernel holds S_i^T, and writing it as it is spares a transpose of every state. Faster
    than `prefix_fold_pallas` on float32 pairs at the composition bar's shape, where it reads 8 GB and writes 4 GB
    (`bench/pic_kernels.py --sections bar`).
    """
    n, batch, th, tl, s = _split_args(t_hi, t_lo, states_t, config)
    b, value_dim, key_dim = s.shape[1:]
    bw = _block_width(config.block_w, value_dim)
    t_spec = pl.BlockSpec((n, None, key_dim, key_dim), lambda j, i: (0, i, 0, 0))
    rows = pl.BlockSpec((n, None, bw, key_dim), lambda j, i: (0, i, j, 0))
    args, in_specs = [th, tl, s], [t_spec, t_spec, rows]
    if initial_state is not None:
        if initial_state.shape[-2:] != (key_dim, value_dim):
            raise ValueError(f"initial_state must end in (K, V) = {(key_dim, value_dim)}, got {initial_state.shape}")
        init = jnp.broadcast_to(initial_state.astype(jnp.float32), batch + (key_dim, value_dim))
        args.append(jnp.swapaxes(init.reshape((b, key_dim, value_dim)), -1, -2))
        in_specs.append(pl.BlockSpec((None, bw, key_dim), lambda j, i: (i, j, 0)))
    out = pl.pallas_call(
        functools.partial(_split_fold_kernel, num_segments=n, value_blocks=value_dim // bw, block_w=bw,
                          with_transfer=False, every_step=True, has_initial=initial_state is not None),
        grid=(value_dim // bw, b),
        in_specs=in_specs,
        out_specs=rows,
        out_shape=jax.ShapeDtypeStruct(s.shape, jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="compose_split_prefix_fold",
    )(*args)
    return out.reshape((n,) + batch + (value_dim, key_dim))


def prefix_fold_split(t_hi: Array, t_lo: Array, states_t: Array, initial_state: Array | None = None, *,
                      lowering: str = "auto", interpret: bool = False) -> Array:
    """Every prefix state on split operands (arguments and result of `prefix_fold_split_pallas`) with its lowering
    chosen as in `fold_split`. At the composition bar's shape Mosaic GPU moves its 8 GB read and 4 GB written at
    close to the device's bandwidth, well ahead of Triton (`bench/pic_kernels.py --sections bar`; see
    bench/RESULTS.md)."""
    if _use_mosaic(lowering, t_hi, states_t, interpret):
        return compose_mgpu.prefix_fold_split_mgpu(t_hi, t_lo, states_t, initial_state, interpret=interpret)
    return prefix_fold_split_pallas(t_hi, t_lo, states_t, initial_state, interpret=interpret)


__all__ += ["split_operands", "fold_split_pallas", "LOWERINGS", "fold_split", "PREFIX_SPLIT_CONFIG",
            "prefix_fold_split_pallas", "prefix_fold_split"]


def _block_width(block_w: int, width: int) -> int:
    """State columns per program: block_w, halved until it divides the state width (any width works)."""
    bw = min(block_w, width)
    while width % bw:
        bw //= 2
    return bw


def _prefix_fold_kernel(t_ref, s_ref, *rest, num_segments, prec, has_initial):
    """One (column block, batch entry, outer entry): acc <- T_i acc + S_i[:, cols], and every acc is written out.

    The T_i loads do not depend on the running state, so the compiler can issue the next one while the current
    product runs; the state block never leaves registers between steps.
    """
    init_ref, o_ref = rest if has_initial else (None, rest[0])
    key_dim = t_ref.shape[-1]

    def body(i, acc):
        t = t_ref[i].astype(jnp.float32)
        acc = lax.dot_general(t, acc, (((1,), (0,)), ((), ())), precision=prec,
                              preferred_element_type=jnp.float32) + s_ref[i].astype(jnp.float32)
        o_ref[i] = acc
        return acc

    acc0 = init_ref[...].astype(jnp.float32) if has_initial else jnp.zeros((key_dim, o_ref.shape[-1]), jnp.float32)
    lax.fori_loop(0, num_segments, body, acc0)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def _fold_call(t, s, initial, *, config, interpret):
    """t [outer, n, B, K, K], s [outer, n, B, K, V], initial [outer, B, K, V] or None -> states like s."""
    outer, n, b, key_dim, _ = t.shape
    value_dim = s.shape[-1]
    bw = _block_width(config.block_w, value_dim)
    in_specs = [
        pl.BlockSpec((None, n, None, key_dim, key_dim), lambda j, i, o: (o, 0, i, 0, 0)),
        pl.BlockSpec((None, n, None, key_dim, bw), lambda j, i, o: (o, 0, i, 0, j)),
    ]
    args = [t, s]
    if initial is not None:
        in_specs.append(pl.BlockSpec((None, None, key_dim, bw), lambda j, i, o: (o, i, 0, j)))
        args.append(initial)
    kernel = functools.partial(_prefix_fold_kernel, num_segments=n, prec=_KERNEL_PRECISION[config.algorithm],
                               has_initial=initial is not None)
    return pl.pallas_call(
        kernel,
        grid=(value_dim // bw, b, outer),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, n, None, key_dim, bw), lambda j, i, o: (o, 0, i, 0, j)),
        out_shape=jax.ShapeDtypeStruct(s.shape, jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="prefix_fold",
    )(*args)


def prefix_fold_pallas(transfers: Array, states: Array, initial_state: Array | None = None, *,
                       config: FoldConfig = FoldConfig(), block: int | None = None, interpret: bool = False) -> Array:
    """The state after each of n ordered segments, S_i = T_i S_{i-1} + S(C_i|0) from `initial_state` (zeros if
    None), with the sequential fold in Pallas.

    transfers [n, ..., K, K], states [n, ..., K, V], initial_state [..., K, V]; returns [n, ..., K, V] float32.
    This is what a PIC request needs per linear layer (the incoming state of every fresh span): n state products,
    half the work of the associative scan over pairs (which also multiplies transfers together), in few launches.

    block: None (default) runs one fold of depth n. The fold's depth is its cost (each step waits for the previous
    product), so a block size b (0: about sqrt(n)) cuts the segments into blocks: (1) each block's pair is composed
    by a balanced tree of batched products (tensor cores, all blocks at once), (2) one fold over the block pairs
    gives every block's incoming state, (3) one fold inside every block, all blocks in parallel, gives the states:
    depth n/b + b instead of n, for about n extra transfer products and two launches instead of one. The single
    fold (the engine's default) is the one `bench/pic_kernels.py --sections prefix` times; no benchmark covers the
    blocked one.
    """
    n = transfers.shape[0]
    batch = transfers.shape[1:-2]
    key_dim, value_dim = states.shape[-2], states.shape[-1]
    if transfers.shape[-2:] != (key_dim, key_dim) or states.shape[:-2] != transfers.shape[:-2]:
        raise ValueError(f"transfers [n, ..., K, K] and states [n, ..., K, V] disagree: {transfers.shape} vs "
                         f"{states.shape}")
    t = transfers.reshape((n, -1, key_dim, key_dim)).astype(jnp.float32)
    s = states.reshape((n, -1, key_dim, value_dim)).astype(jnp.float32)
    init = None if initial_state is None else jnp.broadcast_to(
        initial_state, batch + (key_dim, value_dim)).reshape((1, -1, key_dim, value_dim)).astype(jnp.float32)
    if block == 0:
        block = max(2, int(round(n**0.5)))
    if block is None or n <= 2 * block:
        out = _fold_call(t[None], s[None], init, config=config, interpret=interpret)[0]
        return out.reshape((n,) + batch + (key_dim, value_dim))
    blocks = -(-n // block)
    pad = blocks * block - n
    if pad:  # identity pairs at the end: their states are dropped
        eye = jnp.broadcast_to(jnp.eye(key_dim, dtype=jnp.float32), (pad,) + t.shape[1:])
        t = jnp.concatenate([t, eye])
        s = jnp.concatenate([s, jnp.zeros((pad,) + s.shape[1:], jnp.float32)])
    tb = t.reshape((blocks, block) + t.shape[1:])
    sb = s.reshape((blocks, block) + s.shape[1:])
    # (1) every block's pair: compose_all along the in-block axis (moved first), all blocks at once
    pair_t, pair_s = compose_all(jnp.moveaxis(tb, 1, 0), jnp.moveaxis(sb, 1, 0), config.algorithm)
    # (2) the state after every block, then each block's incoming state
    after = _fold_call(pair_t[None], pair_s[None], init, config=config, interpret=interpret)[0]
    first = jnp.zeros_like(after[:1]) if init is None else init
    incoming = jnp.concatenate([first, after[:-1]])
    # (3) inside every block from its incoming state
    out = _fold_call(tb, sb, incoming, config=config, interpret=interpret).reshape(t.shape[:1] + s.shape[1:])
    return out[:n].reshape((n,) + batch + (key_dim, value_dim))


__all__ += ["prefix_fold_pallas"]


# ----------------------------------------------------------------------------------------------------------------
# Seam fold: the PIC request's groups (a short fresh span, then a cached interior) folded without composing them.


def span_fold_reference(w, u, k_to_end, decay, transfers, states, initial_state=None, slots=None, q_decayed=None,
                        scores=None):
    """Pure-JAX reference of `span_fold_pallas` (float32 HIGHEST, sequential): for each group i,
    state <- T_i (Diag(decay_i) state + k_to_end_i^T (u_i - w_i state)) + S_i, and every state is returned.
    With `slots`, group i's interior is row slots[i] of the pools `transfers` and `states`. With `q_decayed` and
    `scores`, returns (each fresh span's outputs q_decayed S_in + scores (u - w S_in), the last state) instead."""
    hi = lax.Precision.HIGHEST
    if slots is not None:
        transfers, states = transfers[slots], states[slots]
    init = jnp.zeros(states.shape[1:], jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)

    outputs = q_decayed is not None

    def step(state, group):
        w_i, u_i, kt_i, d_i, t_i, s_i, *out_operands = group
        inner = u_i - jnp.einsum("...ck,...kv->...cv", w_i, state, precision=hi)
        if outputs:
            q_i, sc_i = out_operands
            out = (jnp.einsum("...ck,...kv->...cv", q_i, state, precision=hi)
                   + jnp.einsum("...cj,...jv->...cv", sc_i, inner, precision=hi))
        state = d_i[..., None] * state + jnp.einsum("...ck,...cv->...kv", kt_i, inner, precision=hi)
        state = jnp.einsum("...ij,...jv->...iv", t_i, state, precision=hi) + s_i
        return state, out if outputs else state

    xs = (w, u, k_to_end, decay, transfers, states) + ((q_decayed, scores) if outputs else ())
    final, per_group = lax.scan(step, init, xs)
    return (per_group, final) if outputs else per_group


def _span_fold_kernel(w_ref, u_ref, kt_ref, d_ref, t_ref, s_ref, *rest, num_groups, prec, seam_prec, pooled,
                      seam_step, incoming, outputs):
    """One (column block, batch entry): per group the fresh span's chunk step, then the interior's transfer.
    The group's operands do not depend on the running state, so their loads can run ahead of the products.
    pooled: t_ref / s_ref are whole entry pools and group i's interior is row slot_ref[i] (read in place).
    incoming: o_ref[i] gets the state before group i (zero for group 0) and final_ref the state after the last
    group, instead of o_ref[i] = the state after group i.
    outputs: q_ref [n, rows, K] / sc_ref [n, rows, rows] hold each fresh span's decayed queries and causal scores;
    o_ref[i] gets its (unscaled) outputs q_i acc + scores_i (U_i - W_i acc) from the state it starts from, which is
    in registers at that step anyway, and final_ref the last state: no state but the final one is written.

    seam_step "nested": acc <- T (d * acc + Kt (U - W acc)) + S, three dependent products per group.
    "split": the same map regrouped so that only two products wait for acc, side by side, plus one rank-c one:
    acc <- (T Diag(d)) acc - (T Kt) (W acc) + (T Kt U + S); T Kt, T Kt U + S and T Diag(d) do not depend on acc,
    so they are off the sequential chain (at the price of one extra [K, K] x [K, c] product per group).
    """
    rest = list(rest)
    q_ref, sc_ref = (rest.pop(0), rest.pop(0)) if outputs else (None, None)
    slot_ref = rest.pop(0) if pooled else None
    o_ref = rest.pop(0)
    final_ref = rest.pop(0) if incoming or outputs else None
    key_dim = t_ref.shape[-1]
    dims = (((1,), (0,)), ((), ()))
    dot = functools.partial(lax.dot_general, dimension_numbers=dims, precision=prec,
                            preferred_element_type=jnp.float32)
    seam_dot = functools.partial(lax.dot_general, dimension_numbers=dims, precision=seam_prec,
                                 preferred_element_type=jnp.float32)

    def nested(i, acc):
        row = slot_ref[i] if pooled else i
        if incoming:
            o_ref[i] = acc
        inner = u_ref[i] - seam_dot(w_ref[i], acc)
        if outputs:
            o_ref[i] = seam_dot(q_ref[i], acc) + seam_dot(sc_ref[i], inner)
        acc = d_ref[i][:, None] * acc + seam_dot(kt_ref[i], inner)
        acc = dot(t_ref[row], acc) + s_ref[row]
        if not incoming and not outputs:
            o_ref[i] = acc
        return acc

    def split(i, acc):
        row = slot_ref[i] if pooled else i
        if incoming:
            o_ref[i] = acc
        t = t_ref[row]
        t_kt = dot(t, kt_ref[i])  # [K, c]
        offset = dot(t_kt, u_ref[i]) + s_ref[row]
        acc = dot(t * d_ref[i][None, :], acc) - dot(t_kt, seam_dot(w_ref[i], acc)) + offset
        if not incoming:
            o_ref[i] = acc
        return acc

    body = {"nested": nested, "split": split}[seam_step]

    acc = lax.fori_loop(0, num_groups, body, jnp.zeros((key_dim, o_ref.shape[-1]), jnp.float32))
    if final_ref is not None:
        final_ref[...] = acc


@functools.partial(jax.jit, static_argnames=("config", "interpret", "incoming"))
def span_fold_pallas(w, u, k_to_end, decay, transfers, states, slots=None, *, config: FoldConfig = FoldConfig(),
                     interpret: bool = False, incoming: bool = False, q_decayed=None, scores=None):
    """The state after each of n groups "fresh span of c <= chunk tokens, then a cached interior (T, S)", from zero.

    w [n, ..., c, K] (zeros for families without a delta rule), u [n, ..., c, V], k_to_end [n, ..., c, K]: the
    fresh span as one chunk step of `linear_attn.chunk_step`; decay [n, ..., K] its per-key decay over the span;
    transfers [n, ..., K, K], states [n, ..., K, V]: the interiors' dense summaries. Returns [n, ..., K, V] float32.
    slots: None, or int32 [n]: then transfers [P, ..., K, K] and states [P, ..., K, V] are entry pools (float32) and
    group i's interior is pool row slots[i], read where it lies (no gathered copy of n interiors first: at the PIC
    request's shape that copy is 268 MB per layer).
    incoming: return (the state before each group [n, ..., K, V]: zero, then the states after groups 0 .. n-2;
    the state after the last group [..., K, V]) instead. That is what the fresh spans start from, written by the
    kernel as it goes; shifting the states afterwards costs a copy of all of them (136 MB per layer at the PIC
    request's shape).
    q_decayed [n, ..., c, K] and scores [n, ..., c, c] (`linear_attn.SpanChunk`'s output operands): return (the
    fresh spans' outputs [n, ..., c, V] float32, unscaled: q_decayed S_in + scores (u - w S_in) from each span's
    incoming state S_in; the state after the last group) instead. The incoming states are never written: at the
    PIC request's shape they are 134 MB per layer, which the outputs would otherwise read back (seam_step
    "nested" only).

    Why: composing each fresh span's dense summary with its interior (T_int T_span, T_int S_span + S_int) before a
    fold costs one batched 128 x 128 x 256 product per group and layer plus the copies that feed it, all memory-bound
    at float32; here the fresh span enters the fold as two rank-c products per step, so the groups' pairs are never
    formed and the step still costs one dense product. Columns of the state are independent, so they split over
    programs as in `prefix_fold_pallas`.
    """
    n = w.shape[0]
    batch = transfers.shape[1:-2]
    key_dim, value_dim = states.shape[-2], states.shape[-1]
    c = w.shape[-2]
    if (transfers.shape[-2:] != (key_dim, key_dim) or w.shape[-1] != key_dim or k_to_end.shape != w.shape
            or u.shape != w.shape[:-1] + (value_dim,) or decay.shape != w.shape[:-2] + (key_dim,)
            or w.shape[1:-2] != batch or states.shape[:-2] != transfers.shape[:-2]
            or (slots is None and transfers.shape[0] != n) or (slots is not None and slots.shape != (n,))):
        raise ValueError(f"span fold operands disagree: w {w.shape}, u {u.shape}, k_to_end {k_to_end.shape}, "
                         f"decay {decay.shape}, transfers {transfers.shape}, states {states.shape}, "
                         f"slots {None if slots is None else slots.shape}")
    outputs = q_decayed is not None
    if outputs and (scores is None or q_decayed.shape != w.shape or scores.shape != w.shape[:-1] + (c,)):
        raise ValueError(f"span fold outputs need q_decayed like w {w.shape} and scores [n, ..., c, c]: got "
                         f"{None if q_decayed is None else q_decayed.shape}, {None if scores is None else scores.shape}")
    if outputs and incoming:
        raise ValueError("span fold: incoming states and in-kernel outputs are exclusive")
    rows = max(16, -(-c // 16) * 16)  # Triton dots need 16 rows; zero rows add nothing
    pad = [(0, 0)] * (w.ndim - 2) + [(0, rows - c), (0, 0)]
    flat = lambda x, tail: x.reshape((n, -1) + tail).astype(jnp.float32)  # noqa: E731
    w_ = flat(jnp.pad(w, pad), (rows, key_dim))
    u_ = flat(jnp.pad(u, pad), (rows, value_dim))
    kt = jnp.swapaxes(flat(jnp.pad(k_to_end, pad), (rows, key_dim)), -1, -2)  # [n, B, K, rows]
    d = flat(decay, (key_dim,))
    interiors = transfers.shape[0]  # n, or the pool's capacity
    t = transfers.reshape((interiors, -1, key_dim, key_dim)).astype(jnp.float32)  # no-ops for float32 pools
    s = states.reshape((interiors, -1, key_dim, value_dim)).astype(jnp.float32)
    b = t.shape[1]
    bw = _block_width(config.block_w, value_dim)
    pooled = slots is not None
    if config.seam_step not in ("nested", "split"):
        raise ValueError(f"FoldConfig.seam_step must be 'nested' or 'split', got {config.seam_step!r}")
    if outputs and config.seam_step != "nested":
        raise ValueError("span fold outputs need FoldConfig.seam_step 'nested'")
    kernel = functools.partial(_span_fold_kernel, num_groups=n, prec=_KERNEL_PRECISION[config.algorithm],
                               seam_prec=_KERNEL_PRECISION[config.seam_algorithm or config.algorithm], pooled=pooled,
                               seam_step=config.seam_step, incoming=incoming, outputs=outputs)
    in_specs = [
        pl.BlockSpec((n, None, rows, key_dim), lambda j, i: (0, i, 0, 0)),
        pl.BlockSpec((n, None, rows, bw), lambda j, i: (0, i, 0, j)),
        pl.BlockSpec((n, None, key_dim, rows), lambda j, i: (0, i, 0, 0)),
        pl.BlockSpec((n, None, key_dim), lambda j, i: (0, i, 0)),
        pl.BlockSpec((interiors, None, key_dim, key_dim), lambda j, i: (0, i, 0, 0)),
        pl.BlockSpec((interiors, None, key_dim, bw), lambda j, i: (0, i, 0, j)),
    ]
    args = [w_, u_, kt, d, t, s]
    if outputs:
        in_specs += [pl.BlockSpec((n, None, rows, key_dim), lambda j, i: (0, i, 0, 0)),
                     pl.BlockSpec((n, None, rows, rows), lambda j, i: (0, i, 0, 0))]
        args += [flat(jnp.pad(q_decayed, pad), (rows, key_dim)),
                 flat(jnp.pad(scores, [(0, 0)] * (w.ndim - 2) + [(0, rows - c), (0, rows - c)]), (rows, rows))]
    if pooled:
        in_specs.append(pl.BlockSpec((n,), lambda j, i: (0,)))
        args.append(slots.astype(jnp.int32))
    if outputs:
        out_specs = [pl.BlockSpec((n, None, rows, bw), lambda j, i: (0, i, 0, j))]
        out_shape = [jax.ShapeDtypeStruct((n, b, rows, value_dim), jnp.float32)]
    else:
        out_specs = [pl.BlockSpec((n, None, key_dim, bw), lambda j, i: (0, i, 0, j))]
        out_shape = [jax.ShapeDtypeStruct((n, b, key_dim, value_dim), jnp.float32)]
    if incoming or outputs:
        out_specs.append(pl.BlockSpec((None, key_dim, bw), lambda j, i: (i, 0, j)))
        out_shape.append(jax.ShapeDtypeStruct((b, key_dim, value_dim), jnp.float32))
    out = pl.pallas_call(
        kernel,
        grid=(value_dim // bw, b),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="span_fold_pooled" if pooled else "span_fold",
    )(*args)
    if outputs:
        return out[0][:, :, :c].reshape((n,) + batch + (c, value_dim)), out[1].reshape(batch + (key_dim, value_dim))
    if incoming:
        return out[0].reshape((n,) + batch + (key_dim, value_dim)), out[1].reshape(batch + (key_dim, value_dim))
    return out[0].reshape((n,) + batch + (key_dim, value_dim))


__all__ += ["span_fold_reference", "span_fold_pallas"]
