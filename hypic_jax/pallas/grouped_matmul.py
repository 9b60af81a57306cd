"""Grouped matmul for MoE experts (Pallas, Triton lowering): rows grouped by expert times that expert's weights.

Why: `jax.lax.ragged_dot` has no fast GPU lowering in the supported jax/XLA builds (XLA rewrites it into a dense dot
over all groups, materialising [rows, experts * K]: out of memory at 32k tokens x top-8 of 256 experts). This
kernel does the grouped GEMM directly: the expert-sorted rows are laid out so that every block of `block_m` rows
belongs to one expert (each expert's group is padded up to a multiple of block_m, at most one partial block per
expert), and each program multiplies one row block by one column block of its expert's weight matrix.

    layout = block_layout(group_sizes, num_rows, config.block_m)  # XLA: sorted rows' positions, block -> expert
    out_padded = gmm(x_padded, layout.block_expert, weights, config=config)  # Pallas: [padded rows, N]

Rows of padding blocks compute garbage that nobody reads; blocks past the last used one (block_expert = -1) are
skipped. On the CPU the kernel runs in the Pallas interpreter (tests); `jax.lax.ragged_dot` is the reference.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

__all__ = ["BlockLayout", "ChunkedWeights", "GMMConfig", "FEW_ROWS_CONFIG", "ONE_HOT_ROUTING_MAX", "block_layout", "copy_layout",
           "default_config", "gmm", "default_interpret", "sorted_copies"]


@dataclasses.dataclass(frozen=True)
class GMMConfig:
    """Tiling of the MoE grouped matmul: block_m rows per expert block (each expert's rows are padded to a multiple
    of it), block_n / block_k the weight tile, Triton warps and pipeline stages. The class defaults are the launch
    the long prefills run with (about a thousand copies per expert at 32k tokens); `default_config` picks per row
    count, and `bench/pic_kernels.py --sections moe` times the alternatives at the PIC request's shape."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


# Few copies per expert (a PIC request's seams and query: 576 tokens x top-8 of 256 experts, ~18 copies each) make
# the matmul a read of every used expert's weights. This launch is the fastest at that shape (hidden 2048, expert
# width 512; `bench/pic_kernels.py --sections moe` times it against the class defaults, see bench/RESULTS.md): a
# wider weight tile with 8 warps keeps more bytes in flight, and 32-row blocks waste less work on padding. Long
# prefills keep the class defaults, where block_m 64 reuses each weight tile for twice the rows; hence the split.
FEW_ROWS_CONFIG = GMMConfig(block_m=32, block_n=256, block_k=64, num_warps=8, num_stages=3)
FEW_ROWS_MAX = 16384


def default_config(num_rows: int) -> GMMConfig:
    """The launch for `num_rows` (token, expert) copies: FEW_ROWS_CONFIG up to FEW_ROWS_MAX, else GMMConfig()."""
    return FEW_ROWS_CONFIG if num_rows <= FEW_ROWS_MAX else GMMConfig()


def default_interpret() -> bool:
    return jax.default_backend() not in ("gpu", "cuda", "rocm")


class BlockLayout(NamedTuple):
    """positions: padded row of each expert-sorted row [num_rows]; block_expert: expert of each row block, -1 for
    unused blocks [num_blocks]; num_blocks * block_m padded rows in all (a static bound)."""

    positions: Array
    block_expert: Array
    block_m: int

    @property
    def num_padded(self) -> int:
        return self.block_expert.shape[0] * self.block_m


def block_layout(group_sizes: Array, num_rows: int, block_m: int) -> BlockLayout:
    """Layout of `num_rows` expert-sorted rows (group sizes [E], summing to num_rows) in expert-aligned blocks."""
    num_experts = group_sizes.shape[0]
    num_blocks = -(-num_rows // block_m) + num_experts  # each expert adds at most one partial block
    sizes = group_sizes.astype(jnp.int32)
    blocks = (sizes + block_m - 1) // block_m
    block_end = jnp.cumsum(blocks)
    padded_start = (block_end - blocks) * block_m
    group_start = jnp.cumsum(sizes) - sizes
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    expert_of_row = _ends_passed(jnp.cumsum(sizes), num_rows)
    positions = padded_start[expert_of_row] + rows - group_start[expert_of_row]
    block_ids = jnp.arange(num_blocks, dtype=jnp.int32)
    owner = _ends_passed(block_end, num_blocks)
    block_expert = jnp.where(block_ids < block_end[-1], owner, -1)
    return BlockLayout(positions, block_expert, block_m)


# Largest rows x experts for which `copy_layout` ranks the copies with a one-hot running count ([rows, experts]
# int32, 64 MiB at this bound) instead of sorting them: a PIC request's seams and query (4,608 copies x 256
# experts at the 35B-A3B shape) take the one-hot path; a 32k-token prefill (262,144 copies) sorts.
ONE_HOT_ROUTING_MAX = 1 << 24


def sorted_copies(flat_experts: Array, num_experts: int) -> tuple[Array, Array, Array]:
    """The (token, slot) copies stably sorted by expert: (order: sorted position -> copy, inverse: copy -> sorted
    position, group sizes [E] int32)."""
    order = jnp.argsort(flat_experts, stable=True)
    inverse = jnp.argsort(order)
    return order, inverse, jnp.bincount(flat_experts, length=num_experts).astype(jnp.int32)


def copy_layout(experts: Array, num_experts: int, block_m: int) -> tuple[Array, BlockLayout]:
    """Where each (token, slot) copy goes in the expert-aligned row blocks, without a sort when it is small.

    experts: [T, k] expert ids. Returns (slot_rows [T * k]: padded row of each copy, in row-major (token, slot)
    order; the BlockLayout of the expert-sorted copies). Copies of one expert keep token order (a stable sort), so
    this equals `block_layout` applied to the stably sorted copies. For rows x experts up to ONE_HOT_ROUTING_MAX a
    copy's rank inside its expert is a running count over a one-hot [rows, experts] matrix: a handful of fused
    kernels, where two argsorts cost four radix-sort launches plus scatters per MoE layer (the PIC request runs 40
    such layers; `bench/pic_kernels.py --sections moe` times both). Above it the copies are sorted.
    """
    flat = experts.reshape(-1).astype(jnp.int32)
    num_rows = flat.shape[0]
    if num_rows * num_experts > ONE_HOT_ROUTING_MAX:
        _, inverse, group_sizes = sorted_copies(flat, num_experts)
        layout = block_layout(group_sizes, num_rows, block_m)
        return layout.positions[inverse], layout
    one_hot = (flat[:, None] == jnp.arange(num_experts, dtype=jnp.int32)[None, :]).astype(jnp.int32)
    running = jnp.cumsum(one_hot, axis=0)  # copies of each expert among rows 0..i
    group_sizes = running[-1]
    rank = jnp.take_along_axis(running, flat[:, None], axis=1)[:, 0] - 1
    blocks = (group_sizes + block_m - 1) // block_m
    block_end = jnp.cumsum(blocks)
    padded_start = (block_end - blocks) * block_m
    slot_rows = padded_start[flat] + rank
    num_blocks = -(-num_rows // block_m) + num_experts
    block_ids = jnp.arange(num_blocks, dtype=jnp.int32)
    block_expert = jnp.where(block_ids < block_end[-1], _ends_passed(block_end, num_blocks), -1)
    sorted_positions = jnp.zeros((num_rows,), jnp.int32).at[
        jnp.cumsum(group_sizes)[flat] - group_sizes[flat] + rank].set(slot_rows)
    return slot_rows, BlockLayout(sorted_positions, block_expert, block_m)


def _ends_passed(ends: Array, length: int) -> Array:
    """For i in [0, length): how many of the sorted `ends` are <= i (`searchsorted(ends, i, side="right")`), as a
    scatter of ones at the ends and a running sum. jnp.searchsorted's default is a binary-search loop: a dozen tiny
    kernels and copies per call on a GPU, twice per MoE layer."""
    marks = jnp.zeros((length,), jnp.int32).at[ends].add(1, mode="drop")
    return jnp.cumsum(marks).astype(jnp.int32)


class ChunkedWeights(NamedTuple):
    """Expert weights stored as several arrays (`chunks`, each [E_c, K, N] with at most 2**31 - 1 elements, so the
    kernel's int32 offsets reach every element) and `index`, the chunk that a call's expert ids index (an int32
    scalar, traced inside a scan over layers). The kernel reads only that chunk: choosing it inside the kernel
    instead of with `lax.switch` around the call keeps the program free of conditionals, which on a GPU wait for
    the host to read their predicate (three per scanned step of a 40-layer MoE model)."""

    chunks: tuple
    index: Array


def _gmm_kernel(expert_ref, *refs, block_k, num_k, gather, swiglu, chunks):
    """One (row block, column block): x rows @ the block's expert's weight columns, over K in block_k steps.
    gather: the first ref holds the block's source rows of x, which is then the whole unpadded x.
    swiglu: the weights come as a gate tile and the matching up tile (two refs); the block's output is
    silu(x W_gate) * (x W_up), computed from the float32 accumulators.
    chunks: the weights as that many chunks (a ref of the chunk index first, then each chunk's weight refs); only
    the indexed chunk is read."""
    chunk_ref, refs = (refs[0], refs[1:]) if chunks else (None, refs)
    rows_ref, x_ref, *w_refs, o_ref = refs if gather else (None, *refs)
    expert = jnp.sum(expert_ref[...])  # the block's expert as a scalar (a [1] tile summed: no register indexing)
    rows = rows_ref[...] if gather else slice(None)
    dims = (((1,), (0,)), ((), ()))
    per_chunk = len(w_refs) // max(chunks, 1)
    chunk = jnp.sum(chunk_ref[...]) if chunks else 0

    def compute(refs):
        def body(t, accs):
            cols = pl.ds(pl.multiple_of(t * block_k, block_k), block_k)
            x = x_ref[rows, cols]
            return tuple(acc + lax.dot_general(x, w_ref[expert, cols, :], dims, preferred_element_type=jnp.float32)
                         for acc, w_ref in zip(accs, refs))

        accs = lax.fori_loop(0, num_k, body, tuple(jnp.zeros(o_ref.shape, jnp.float32) for _ in refs))
        out = accs[0] * jax.nn.sigmoid(accs[0]) * accs[1] if swiglu else accs[0]
        o_ref[...] = out.astype(o_ref.dtype)

    for c in range(max(chunks, 1)):
        pl.when((expert >= 0) & (chunk == c))(functools.partial(compute, w_refs[c * per_chunk:(c + 1) * per_chunk]))


def _tile(block: int, dim: int) -> int:
    """The widest power-of-two tile edge <= block that divides dim (down to 16; a dim below the block is its own
    tile when it is a power of two), so that a launch tuned for one model still fits another model's widths
    (an expert width of 768 takes 256-wide tiles, 384 takes 128)."""
    edge = 1 << (min(block, dim).bit_length() - 1)
    while edge > 16 and dim % edge:
        edge //= 2
    return edge


@functools.partial(jax.jit, static_argnames=("config", "interpret", "swiglu"))
def gmm(
    x: Array,
    block_expert: Array,
    weights: Array | ChunkedWeights,
    *,
    config: GMMConfig = GMMConfig(),
    interpret: bool | None = None,
    rows: Array | None = None,
    swiglu: bool = False,
) -> Array:
    """x [num_blocks * block_m, K] (expert-aligned row blocks) @ weights[block_expert] [E, K, N] -> [rows, N].

    block_m is x.shape[0] / len(block_expert) (the layout's, see `block_layout`). The weight tile is the config's,
    narrowed to a power of two that divides K and N (`_tile`); the output has x's dtype, accumulation is float32.
    rows: None, or int32 [num_blocks * block_m]: padded row r is x[rows[r]] (x is then [T, K], unpadded) and the
    kernel gathers the rows as it loads them. A gathered copy of x first would write every padded row (52 MB per
    MoE layer at a PIC request's shape, where x itself is 2.4 MB) and each column block would read it back.
    swiglu: weights are [E, K, 2I] fused [gate | up] and the result is silu(x W_gate) * (x W_up) [rows, I], the
    activation applied to the float32 accumulators: the [rows, 2I] product is never written and read back.
    weights may be `ChunkedWeights`: the block experts then index the chunk `weights.index`.
    """
    if interpret is None:
        interpret = default_interpret()
    gather = rows is not None
    if gather and rows.ndim != 1:
        raise ValueError(f"gmm rows must be a vector of source rows, got shape {rows.shape}")
    rows_total = rows.shape[0] if gather else x.shape[0]  # padded rows
    k_dim = x.shape[1]
    chunked = isinstance(weights, ChunkedWeights)
    parts = tuple(weights.chunks) if chunked else (weights,)
    if len({w.shape[1:] for w in parts}) != 1:
        raise ValueError(f"gmm weight chunks must agree but in their experts, got {[w.shape for w in parts]}")
    _, k_w, n_dim = parts[0].shape
    if swiglu:
        if n_dim % 2:
            raise ValueError(f"gmm swiglu needs fused [gate | up] weights of even width, got {weights.shape}")
        n_dim //= 2
    num_blocks = block_expert.shape[0]
    block_m = rows_total // num_blocks
    block_n, block_k = _tile(config.block_n, n_dim), _tile(config.block_k, k_dim)
    num_warps, num_stages = config.num_warps, config.num_stages
    if k_w != k_dim or rows_total != num_blocks * block_m or n_dim % block_n or k_dim % block_k:
        raise ValueError(
            f"gmm shapes: x {x.shape} ({rows_total} padded rows), weights {[w.shape for w in parts]}, "
            f"{num_blocks} blocks, block_n {block_n}, block_k {block_k}"
        )
    kernel = functools.partial(_gmm_kernel, block_k=block_k, num_k=k_dim // block_k, gather=gather, swiglu=swiglu,
                               chunks=len(parts) if chunked else 0)
    n_blocks = n_dim // block_n
    w_specs, w_args = [], []
    for w in parts:
        w_specs.append(pl.BlockSpec((w.shape[0], k_dim, block_n), lambda i, j: (0, 0, j)))
        if swiglu:  # the up tile is the gate tile's partner n_blocks column blocks further on
            w_specs.append(pl.BlockSpec((w.shape[0], k_dim, block_n), lambda i, j: (0, 0, j + n_blocks)))
        w_args += [w.astype(x.dtype)] * (2 if swiglu else 1)
    if gather:
        x_specs = [pl.BlockSpec((block_m,), lambda i, j: (i,)), pl.BlockSpec(x.shape, lambda i, j: (0, 0))]
        x_args = [rows.astype(jnp.int32), x]
    else:
        x_specs, x_args = [pl.BlockSpec((block_m, k_dim), lambda i, j: (i, 0))], [x]
    chunk_specs, chunk_args = ([pl.BlockSpec((1,), lambda i, j: (0,))],
                               [jnp.reshape(weights.index, (1,)).astype(jnp.int32)]) if chunked else ([], [])
    return pl.pallas_call(
        kernel,
        grid=(num_blocks, n_blocks),
        in_specs=[pl.BlockSpec((1,), lambda i, j: (i,)), *chunk_specs, *x_specs, *w_specs],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((rows_total, n_dim), x.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="moe_grouped_matmul",
    )(block_expert.astype(jnp.int32), *chunk_args, *x_args, *w_args)
