"""Device-resident slots for the linear layers' parts of PIC cache entries.

Why a pool: a request that stitches n cached segments of an L-layer model would otherwise hand jit one array per
leaf, layer and entry (about 7,000 at 64 segments of Qwen3.5-35B-A3B), and every linear layer would first copy its
n dense (T, S) pairs into one stacked array (268 MB per layer there) before the fold reads them. With the pool, each
linear layer's pieces of every entry live as rows of one array per leaf ([capacity, ...]); an entry keeps only its
slot number, a request passes the pools once plus an int32 vector of slots, and the fold kernel reads each
interior where it lies (`pallas.compose.span_fold_pallas(..., slots)`).

Memory: the pool grows when a request stores more entries than it has free slots, to at least twice its size
(so n entries cost log2 n growths) but not past what the cache's byte budget can hold unless pinned entries need
it; freeing slots (`release`) never shrinks it. Every growth changes the pools' shapes, so the next request of each
layout compiles again; requests over a stable working set do not grow it. Writes donate the pools (in place).
`Engine.clear_cache()` empties the cache and then gives the pools' memory back (`trim`).

Slots are freed when the cache drops an entry (`release`); the cache defers that while a request holds the entry
pinned, so a slot is never rewritten under a running request. One lock orders writes against request dispatches.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from hypic_jax.spans import LinearEntry, PoolSlot


@jax.jit
def _grow(pools, extra):
    return jax.tree.map(lambda a, e: jnp.concatenate([a, e]), pools, extra)


def _write(pools, slot, pieces):
    return jax.tree.map(lambda a, x: jax.lax.dynamic_update_index_in_dim(a, x.astype(a.dtype), slot, 0), pools,
                        pieces)


_write_donated = jax.jit(_write, donate_argnums=0)


def _signature(piece) -> Any:
    leaves, treedef = jax.tree.flatten(piece)
    return treedef, tuple((tuple(a.shape), str(a.dtype)) for a in leaves)


class EntryPool:
    """Rows of one array per pooled leaf (per linear layer: summary state, transfer, conv tail).

    `store(layers, budget_entries)` moves an entry's linear-layer pieces into a free slot and returns (slot, the
    layers with those pieces replaced by `PoolSlot`); entries whose pieces do not match the pool's layout are left
    as they are (slot None). The engine wraps a request's entries, `pools` and their slots in a
    `spans.CachedSegments` for jit (`Engine._cached_arg`).
    """

    def __init__(self):
        self.lock = threading.RLock()
        self.pools: tuple | None = None  # per layer: None or the LinearEntry PyTree with a leading capacity axis
        self._signatures: tuple | None = None
        self._free: list[int] = []
        self.capacity = 0

    @staticmethod
    def _poolable(layers: Sequence) -> list[bool]:
        return [isinstance(piece, LinearEntry) for piece in layers]

    def _create(self, layers: Sequence, capacity: int) -> None:
        pooled = self._poolable(layers)
        self._signatures = tuple(_signature(p) if keep else None for p, keep in zip(layers, pooled))
        self.pools = tuple(
            jax.tree.map(lambda a: jnp.zeros((capacity,) + a.shape, a.dtype), p) if keep else None
            for p, keep in zip(layers, pooled)
        )
        self.capacity = capacity
        self._free = list(range(capacity - 1, -1, -1))

    def matches(self, layers: Sequence) -> bool:
        if self._signatures is None:
            return any(self._poolable(layers))
        return len(layers) == len(self._signatures) and all(
            (sig is None and not isinstance(p, LinearEntry)) or (sig is not None and _signature(p) == sig)
            for p, sig in zip(layers, self._signatures))

    def reserve(self, layers: Sequence, count: int, budget_entries: int | None = None) -> None:
        """Make room for `count` entries shaped like `layers` in one growth (at least doubling, at most the budget's
        entry count unless more are needed now)."""
        with self.lock:
            if count <= 0 or not self.matches(layers):
                return
            needed = self.in_use + count
            if needed <= self.capacity:
                return
            target = max(needed, 2 * self.capacity)
            if budget_entries is not None:
                target = max(needed, min(target, budget_entries))
            if self.pools is None:
                self._create(layers, target)
            else:
                self._grow_to(target)

    def store(self, layers: Sequence, budget_entries: int | None = None) -> tuple[int | None, tuple]:
        """Write `layers`' linear pieces into a slot; returns (slot, layers with `PoolSlot` for the moved pieces)."""
        layers = tuple(layers)
        with self.lock:
            if not self.matches(layers):
                return None, layers
            if not self._free:
                self.reserve(layers, 1, budget_entries)
            slot = self._free.pop()
            pieces = tuple(p if sig is not None else None for p, sig in zip(layers, self._signatures))
            self.pools = _write_donated(self.pools, jnp.asarray(slot, jnp.int32), pieces)
            return slot, tuple(PoolSlot() if sig is not None else p for p, sig in zip(layers, self._signatures))

    def _grow_to(self, capacity: int) -> None:
        extra = capacity - self.capacity
        zeros = jax.tree.map(lambda a: jnp.zeros((extra,) + a.shape[1:], a.dtype), self.pools)
        self.pools = _grow(self.pools, zeros)
        self._free = list(range(capacity - 1, self.capacity - 1, -1)) + self._free
        self.capacity = capacity

    def release(self, slot: int | None) -> None:
        if slot is None:
            return
        with self.lock:
            if not 0 <= slot < self.capacity or slot in self._free:
                raise ValueError(f"slot {slot} is not in use")
            self._free.append(slot)

    def trim(self) -> bool:
        """Give the pools' device memory back when no slot is in use (the next store allocates anew); returns
        whether it did."""
        with self.lock:
            if self.pools is None or self.in_use:
                return False
            self.pools, self._signatures, self._free, self.capacity = None, None, [], 0
            return True

    @property
    def in_use(self) -> int:
        with self.lock:
            return self.capacity - len(self._free)

    @property
    def nbytes(self) -> int:
        with self.lock:
            return sum(a.nbytes for a in jax.tree.leaves(self.pools))
