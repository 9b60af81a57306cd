"""Where each (token, expert) copy goes: the expert-aligned row blocks the grouped matmul reads.

The expert-sorted rows are laid out so that every block of `block_m` rows belongs to one expert: each expert's
group is padded up to a multiple of block_m (at most one partial block per expert), and `block_expert` names each
block's expert (-1 for blocks past the last used one, which the kernel skips).
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax import Array

__all__ = ["BlockLayout", "block_layout", "ONE_HOT_ROUTING_MAX", "COPY_BLOCKS_MAX", "sorted_copies", "copy_layout",
           "copy_blocks"]


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
# int32) instead of sorting them: a PIC request's seams and query take the one-hot path, a long prefill sorts.
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
    kernels, where two argsorts cost several radix-sort launches plus scatters per MoE layer (`bench/pic_kernels.py
    --sections moe` times both; bench/RESULTS.md, "pic_kernels.py"). Above it the copies are sorted (the one-hot
    matrix grows as rows x experts). The bound is read when the function is traced.
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


# Largest number of (token, expert) copies that `copy_blocks` lays out one block each (64: a decode step of up to 8
# rows of a top-8 model): up to it the copies are not ranked at all. Read when the MoE layer is traced. 0 (off)
# until it is timed on a GPU against the sorted layout: `bench/decode_step.py --moe-copy-blocks 0 64`.
COPY_BLOCKS_MAX = 0


def copy_blocks(experts: Array, block_m: int, valid: Array | None = None) -> tuple[Array, BlockLayout, Array]:
    """One row block per (token, slot) copy, in row-major order: the layout of a decode step's few copies.

    Ranking copies by expert (`copy_layout`: one-hot running counts, scatters, a search of block ends) costs about
    ten small kernels per MoE layer, each a few microseconds: at a decode step of one to a few rows that is more GPU
    time than the expert products themselves. Here block b holds copy b alone (its token in all block_m rows,
    row 0 read back), so the layout is arithmetic on the copy index. The price: an expert that two copies pick is
    read twice (rare among a few rows' picks of many experts) and block_m - 1 padding rows per copy are computed,
    which at this size costs nothing the weight reads do not already (the product is bound by them).

    experts: [T, k] expert ids; valid: [T] bool or None (copies of invalid tokens get expert -1: not computed).
    Returns (slot_rows [T * k]: padded row of each copy, the BlockLayout, padded_token [T * k * block_m]: the token
    each padded row reads).
    """
    num_tokens, top_k = experts.shape
    copies = num_tokens * top_k
    flat = experts.reshape(-1).astype(jnp.int32)
    if valid is not None:
        flat = jnp.where(jnp.repeat(valid, top_k), flat, -1)
    slot_rows = jnp.arange(copies, dtype=jnp.int32) * block_m
    padded_token = jnp.arange(copies * block_m, dtype=jnp.int32) // (block_m * top_k)
    return slot_rows, BlockLayout(slot_rows, flat, block_m), padded_token


def _ends_passed(ends: Array, length: int) -> Array:
    """For i in [0, length): how many of the sorted `ends` are <= i (`searchsorted(ends, i, side="right")`), as a
    scatter of ones at the ends and a running sum. jnp.searchsorted's default is a binary-search loop: a dozen tiny
    kernels and copies per call on a GPU, twice per MoE layer."""
    marks = jnp.zeros((length,), jnp.int32).at[ends].add(1, mode="drop")
    return jnp.cumsum(marks).astype(jnp.int32)
