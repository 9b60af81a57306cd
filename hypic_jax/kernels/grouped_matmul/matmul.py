"""The grouped matmul for MoE experts (Pallas, Triton lowering): row blocks of one expert each times that expert's
weights, `gmm`.

Why: `jax.lax.ragged_dot` has no fast GPU lowering in the supported jax/XLA builds (XLA rewrites it into a dense dot
over all groups, materialising [rows, experts * K]: out of memory at long prefills with many experts). This kernel
does the grouped GEMM directly over the expert-aligned row blocks of `layout`: each program multiplies one row
block by one column block of its expert's weight matrix,

    out[r, :] = x[r, :] @ weights[block_expert[r // block_m]]        (float32 accumulation)

    layout = block_layout(group_sizes, num_rows, config.block_m)  # XLA: sorted rows' positions, block -> expert
    out_padded = gmm(x_padded, layout.block_expert, weights, config=config)  # Pallas: [padded rows, N]

Rows of padding blocks compute values that nobody reads; blocks past the last used one (block_expert = -1) are
skipped. On the CPU the kernel runs in the Pallas interpreter (tests).

Block-wise FP8 experts (`kernels.fp8.BlockFP8`: float8_e4m3fn values, one float32 scale per block of `scale_block`
rows of K and column) are read as they are stored: the kernel converts each FP8 weight tile to x's dtype and
multiplies the tile's float32 partial product by its scale row, so no dequantized copy of the experts is ever
written. Each K tile then lies inside one scale block (block_k divides scale_block, or K fits one block).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hypic_jax.kernels.grouped_matmul.config import GMMConfig
from hypic_jax.kernels.platform import default_interpret

__all__ = ["ChunkedWeights", "gmm"]


class ChunkedWeights(NamedTuple):
    """Expert weights stored as several arrays (`chunks`, each [E_c, K, N] with at most 2**31 - 1 elements, so the
    kernel's int32 offsets reach every element) and `index`, the chunk that a call's expert ids index (an int32
    scalar, traced inside a scan over layers). The kernel reads only that chunk: choosing it inside the kernel
    instead of with `lax.switch` around the call keeps the program free of conditionals, which on a GPU wait for
    the host to read their predicate (in a scan over layers, each step would wait on the host)."""

    chunks: tuple
    index: Array


def _gmm_kernel(expert_ref, *refs, block_k, num_k, gather, swiglu, chunks, scale_block):
    """One (row block, column block): x rows @ the block's expert's weight columns, over K in block_k steps.
    gather: the first ref holds the block's source rows of x, which is then the whole unpadded x.
    swiglu: the weights come as a gate tile and the matching up tile (two refs); the block's output is
    silu(x W_gate) * (x W_up), computed from the float32 accumulators.
    chunks: the weights as that many chunks (a ref of the chunk index first, then each chunk's weight refs); only
    the indexed chunk is read.
    scale_block: None, or FP8 weights: a chunk's refs are its weight refs, then their scale refs [E, ceil(K /
    scale_block), N] in the same order, and each K tile's product is multiplied by its scale row."""
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

        def scaled_body(t, accs):
            cols = pl.ds(pl.multiple_of(t * block_k, block_k), block_k)
            scale_row = pl.ds(t * block_k // scale_block, 1)  # a [1, block_n] tile: the K tile's scale block
            x = x_ref[rows, cols]
            return tuple(acc + lax.dot_general(x, w_ref[expert, cols, :].astype(x.dtype), dims,
                                               preferred_element_type=jnp.float32) * s_ref[expert, scale_row, :]
                         for acc, w_ref, s_ref in zip(accs, refs[:len(accs)], refs[len(accs):]))

        width = len(refs) // (1 if scale_block is None else 2)
        loop = body if scale_block is None else scaled_body
        accs = lax.fori_loop(0, num_k, loop, tuple(jnp.zeros(o_ref.shape, jnp.float32) for _ in range(width)))
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


def _scale_tile(block_k: int, k_dim: int, scale_block: int) -> int:
    """The K tile of FP8 weights: the config's (`_tile`) when K fits one scale block, else narrowed to a power of
    two that divides both K and the scale block, so that every tile lies inside one block."""
    if k_dim <= scale_block:
        return _tile(block_k, k_dim)
    return _tile(min(block_k, scale_block), math.gcd(k_dim, scale_block))


@functools.partial(jax.jit, static_argnames=("config", "interpret", "swiglu", "scale_block"))
def gmm(
    x: Array,
    block_expert: Array,
    weights: Array | ChunkedWeights,
    *,
    config: GMMConfig = GMMConfig(),
    interpret: bool | None = None,
    rows: Array | None = None,
    swiglu: bool = False,
    scales: Array | ChunkedWeights | None = None,
    scale_block: int = 128,
) -> Array:
    """x [num_blocks * block_m, K] (expert-aligned row blocks) @ weights[block_expert] [E, K, N] -> [rows, N].

    block_m is x.shape[0] / len(block_expert) (the layout's, see `block_layout`). The weight tile is the config's,
    narrowed to a power of two that divides K and N (`_tile`); the output has x's dtype, accumulation is float32.
    rows: None, or int32 [num_blocks * block_m]: padded row r is x[rows[r]] (x is then [T, K], unpadded) and the
    kernel gathers the rows as it loads them. A gathered copy of x first would write every padded row (top-k
    copies of every token, padded to the blocks, many times x's size) and each column block would read it back.
    swiglu: weights are [E, K, 2I] fused [gate | up] and the result is silu(x W_gate) * (x W_up) [rows, I], the
    activation applied to the float32 accumulators: the [rows, 2I] product is never written and read back.
    weights may be `ChunkedWeights`: the block experts then index the chunk `weights.index`. Rows of blocks past the
    last used one (block_expert -1) are not written. `reference.gmm_reference` is the same product in float32.
    scales: None, or the float32 scales [E, ceil(K / scale_block), N] of block-wise FP8 weights (`kernels.fp8`;
    `ChunkedWeights` of scale chunks for chunked weights, read at the weights' index): the weights are then the
    float8_e4m3fn values, weight[e, k, n] = value[e, k, n] * scales[e, k // scale_block, n].
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
    scaled = scales is not None
    if scaled:
        if isinstance(scales, ChunkedWeights) != chunked:
            raise ValueError("gmm scales must be chunked exactly when the weights are")
        scale_parts = tuple(scales.chunks) if chunked else (scales,)
        want = [(w.shape[0], -(-k_w // scale_block), n_dim) for w in parts]
        if [tuple(s.shape) for s in scale_parts] != want:
            raise ValueError(f"gmm scales {[s.shape for s in scale_parts]} do not fit FP8 weights "
                             f"{[w.shape for w in parts]} in blocks of {scale_block} rows (expected {want})")
    if swiglu:
        if n_dim % 2:
            raise ValueError(f"gmm swiglu needs fused [gate | up] weights of even width, got {weights.shape}")
        n_dim //= 2
    num_blocks = block_expert.shape[0]
    block_m = rows_total // num_blocks
    block_n = _tile(config.block_n, n_dim)
    block_k = _scale_tile(config.block_k, k_dim, scale_block) if scaled else _tile(config.block_k, k_dim)
    num_warps, num_stages = config.num_warps, config.num_stages
    if k_w != k_dim or rows_total != num_blocks * block_m or n_dim % block_n or k_dim % block_k:
        raise ValueError(
            f"gmm shapes: x {x.shape} ({rows_total} padded rows), weights {[w.shape for w in parts]}, "
            f"{num_blocks} blocks, block_n {block_n}, block_k {block_k}"
        )
    if scaled and k_dim > scale_block and scale_block % block_k:
        raise ValueError(f"gmm FP8 weights need K tiles inside one scale block: K {k_dim} has no power-of-two tile "
                         f"that divides the scale block {scale_block} (tile {block_k})")
    kernel = functools.partial(_gmm_kernel, block_k=block_k, num_k=k_dim // block_k, gather=gather, swiglu=swiglu,
                               chunks=len(parts) if chunked else 0, scale_block=scale_block if scaled else None)
    n_blocks = n_dim // block_n
    w_specs, w_args = [], []
    for c, w in enumerate(parts):
        w_specs.append(pl.BlockSpec((w.shape[0], k_dim, block_n), lambda i, j: (0, 0, j)))
        if swiglu:  # the up tile is the gate tile's partner n_blocks column blocks further on
            w_specs.append(pl.BlockSpec((w.shape[0], k_dim, block_n), lambda i, j: (0, 0, j + n_blocks)))
        if not scaled:
            w_args += [w.astype(x.dtype)] * (2 if swiglu else 1)
            continue
        w_args += [w] * (2 if swiglu else 1)  # FP8: each tile is converted in the kernel
        s = scale_parts[c].astype(jnp.float32)
        s_shape = (s.shape[0], s.shape[1], block_n)
        w_specs.append(pl.BlockSpec(s_shape, lambda i, j: (0, 0, j)))
        if swiglu:
            w_specs.append(pl.BlockSpec(s_shape, lambda i, j: (0, 0, j + n_blocks)))
        w_args += [s] * (2 if swiglu else 1)
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
