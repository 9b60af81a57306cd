"""What a span forward writes into its pools: the summaries of its records, and the row writes that run as
their own program."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import Array

from hypic_jax.core import linear_attn
from hypic_jax.core.linear_attn import Summary
from hypic_jax.stitch.layout import LayoutArrays
from hypic_jax.stitch.linear_common import LinearResult


def record_summaries(result: LinearResult, layout: LayoutArrays, *, isolated: bool, pool: Summary) -> Summary:
    """The summaries to store for the layout's records, in the pool's form: a cold prefill stores each recorded
    interior's own summary; a stitched request stores each recorded span's end state (a prefix-cache snapshot,
    which a later request loads with `piece_reset`, so its transfer is never read and is stored as zeros)."""
    if not layout.record_piece.shape[0]:  # records nothing (the result may hold no summaries nor end states)
        return jax.tree.map(lambda a: jnp.zeros((0,) + a.shape[1:], a.dtype), pool)
    if isolated:
        rows = jax.tree.map(lambda a: a[layout.record_piece], result.piece_summaries)
        return linear_attn.promote(rows, pool.form)
    state = result.piece_ends[layout.record_piece]
    transfer = None if pool.transfer is None else jnp.zeros((state.shape[0],) + pool.transfer.shape[1:],
                                                            pool.transfer.dtype)
    return Summary(pool.form, state, transfer)


class RowWrites(NamedTuple):
    """Rows to write into one layer's pool: `rows` [n] (past the pool, `layout.DROP`, for none: unused records,
    unrecorded and padded tokens) and `values`, a tree like the pool's with leading axis n, in its dtypes."""

    rows: Array
    values: Any


def row_writes(pool, rows: Array, values) -> RowWrites:
    """What a span forward returns instead of writing its pool: the write runs as its own program
    (`apply_row_writes`), because a program that both reads a donated pool (the fold, the key gather) and writes it
    in place makes XLA copy the whole pool on every call, a cost proportional to the cache's size."""
    return RowWrites(rows, jax.tree.map(lambda a, v: v.astype(a.dtype), pool, values))


def apply_row_writes(pool, writes: RowWrites):
    """pool (a PyTree of [S, ...] arrays) with rows `writes.rows` set to `writes.values`; rows past the pool are
    dropped. Write-only, so a donated pool is updated in place."""
    return jax.tree.map(lambda a, v: a.at[writes.rows].set(v, mode="drop"), pool, writes.values)
