"""Fixed-capacity device pools holding every cache entry's pieces, addressed by slot and row.

Per linear layer, one summary pool (states [S, H, K, V] and transfers in the family's form) and one conv-tail
pool [S, W-1, D]: an entry owns one slot. Per attention layer, one per-token pool (K/V or latents, [R, ...]): an
entry owns the rows of whole pages of `page` tokens. The layers' pools are stored by the model's `LayerPlan`
(`hypic_jax.models.stack.PoolStack`): the layers of one pattern position share one array, each in its own
block of S (or R) rows, so a scan over the layers reads them without slicing. The pools are allocated once, at
their full capacity, so their shapes never change and no request recompiles because the cache grew; a program
reads them by the slot and row arrays of its layout and writes its records into them (donated, in place).

Slot 0 and page 0 belong to no entry: a layout's padded reads point there (its writes that record nothing are
dropped instead, see `hypic_jax.stitch.layout`).

Over a model mesh (tensor parallelism: `Engine(tensor_parallel=M)`) every pool is split over the mesh's
"model" axis along the first axis of its entries' pieces that M divides (the heads of a state, else its channels),
so each device holds 1/M of every entry; the programs read and write the pools where they lie.

Allocation is on the host. When the pools are full, the owner evicts entries (least recently used first, never
one a running request holds) until the new entry fits; `Pools.free` returns an evicted entry's slot and pages.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from hypic_jax.cache.index import tree_nbytes
from hypic_jax.models.stack import LayerPlan, pool_stack


def split_spec(shape: tuple[int, ...], parts: int, axis: str = "model") -> PartitionSpec:
    """The split of a pool array [S or R, *piece] over `parts` devices: the first axis of the piece that `parts`
    divides (none: replicated)."""
    spec = [None] * len(shape)
    for i in range(1, len(shape)):
        if shape[i] % parts == 0:
            spec[i] = axis
            break
    return PartitionSpec(*spec)


def _maker(device) -> Callable:
    """pool_stack's allocator on `device`: a jax device or sharding; a sharding over a mesh with a "model" axis
    of several devices splits each pool over it (`split_spec`)."""
    if isinstance(device, NamedSharding) and device.mesh.shape.get("model", 1) > 1:
        parts = device.mesh.shape["model"]
        return lambda shape, dtype: jnp.zeros(shape, dtype,
                                              device=NamedSharding(device.mesh, split_spec(shape, parts)))
    return lambda shape, dtype: jnp.zeros(shape, dtype, device=device)


class PoolFull(ValueError):
    """No free slot or pages even after evicting every entry that no request holds: the request needs more pool
    room at once than the cache has (a `ValueError`: the server answers 400 and goes on serving)."""


class Pools:
    """Device pools of one model (see the module docstring).

    layers: per layer the per-entry piece's abstract tree (`jax.ShapeDtypeStruct` leaves) of a linear layer,
    wrapped as ("slot", tree), or the per-token piece of an attention layer, ("token", tree) with leaves [D...]
    per token. slots: entries the pools hold; pages: per-token pages of `page` tokens.
    """

    def __init__(self, layers: list[tuple[str, Any]], *, slots: int, pages: int, page: int = 16,
                 plan: LayerPlan | None = None, device=None):
        if slots < 2 or pages < 2:
            raise ValueError(f"the pools need at least 2 slots and 2 pages (one of each belongs to no entry), got "
                             f"{slots} slots, {pages} pages")
        self.kinds = tuple(kind for kind, _ in layers)
        self.page, self.slots, self.pages = page, slots, pages
        self.plan = plan or LayerPlan.unrolled(len(layers))
        self.lock = threading.RLock()
        # a PoolStack: per part of the plan (a layer, or a pattern position's layers) one tree of arrays
        # on `device` (a jax device; None: the default one)
        make = None if device is None else _maker(device)
        self.arrays = pool_stack(layers, self.plan, slots=slots, rows=pages * page, make=make)
        self.layer_pieces = list(layers)
        self.slot_bytes = sum(tree_nbytes(tree) for kind, tree in layers if kind == "slot")
        self.token_bytes = sum(tree_nbytes(tree) for kind, tree in layers if kind == "token")
        self._free_slots = list(range(slots - 1, 0, -1))
        self._free_pages = list(range(pages - 1, 0, -1))

    @classmethod
    def for_budget(cls, layers: list[tuple[str, Any]], budget_bytes: int, *, mean_tokens: int = 512,
                   page: int = 16, plan: LayerPlan | None = None, device=None) -> "Pools":
        """Pools sized for `budget_bytes`, split as if entries held `mean_tokens` tokens each."""
        slot_bytes = sum(tree_nbytes(t) for k, t in layers if k == "slot")
        token_bytes = sum(tree_nbytes(t) for k, t in layers if k == "token")
        per_entry = slot_bytes + mean_tokens * token_bytes
        slots = max(2, int(budget_bytes // max(1, per_entry)) + 1)
        pages = max(2, -(-(slots - 1) * mean_tokens // page) + 1)
        return cls(layers, slots=slots, pages=pages, page=page, plan=plan, device=device)

    def like(self, device) -> "Pools":
        """Empty pools of the same shapes and capacity on another device."""
        return Pools(self.layer_pieces, slots=self.slots, pages=self.pages, page=self.page, plan=self.plan,
                     device=device)

    def layers(self) -> list[tuple[str, Any, int]]:
        """Per layer (its pool kind, its part's pool tree, its base row there): layer i's piece of an entry is row
        `base + slot` (or rows `base + rows`) of every leaf of the tree."""
        out = []
        for layer in range(self.plan.layers):
            tree, spec, base = self.arrays.layer(layer)
            out.append((spec.kind, tree, base))
        return out

    @property
    def nbytes(self) -> int:
        return tree_nbytes(self.arrays)

    def entry_bytes(self, tokens: int) -> int:
        """Bytes an entry of `tokens` tokens holds (its slot and its whole pages)."""
        return self.slot_bytes + -(-tokens // self.page) * self.page * self.token_bytes

    def free_slots(self) -> int:
        return len(self._free_slots)

    def check_room(self, entry_tokens) -> None:
        """PoolFull unless entries of these token counts could all be held at once (in empty pools): what a request
        checks before it looks anything up, since finding out while allocating would first evict every other
        entry for nothing. Slot 0 and page 0 are the null ones."""
        entry_tokens = list(entry_tokens)
        pages = sum(-(-n // self.page) for n in entry_tokens)
        if len(entry_tokens) > self.slots - 1 or pages > self.pages - 1:
            count = len(entry_tokens)
            entries = "1 entry" if count == 1 else f"{count} entries"
            raise PoolFull(f"no room in the cache for this request: it needs {entries} of {sum(entry_tokens)} tokens "
                           f"({pages} pages of {self.page}) at once, the pools hold {self.slots - 1} slots and "
                           f"{self.pages - 1} pages (raise cache_bytes, or send fewer or shorter segments)")

    def allocate(self, tokens: int, evict: Callable[[], bool]) -> tuple[int, np.ndarray]:
        """(slot, rows [tokens]) for a new entry, evicting through `evict()` (False: nothing left to evict)."""
        self.check_room([tokens])
        need = -(-tokens // self.page)
        with self.lock:
            while not self._free_slots or len(self._free_pages) < need:
                if not evict():
                    raise PoolFull(f"no room in the cache for an entry of {tokens} tokens: the entries left "
                                   f"({self.slots - 1 - len(self._free_slots)} of {self.slots - 1} slots, "
                                   f"{self.pages - 1 - len(self._free_pages)} of {self.pages - 1} pages) are all "
                                   f"held by this request or another running one (raise cache_bytes, or send "
                                   f"fewer or shorter segments)")
            slot = self._free_slots.pop()
            pages = [self._free_pages.pop() for _ in range(need)]
        rows = (np.asarray(pages, np.int32)[:, None] * self.page + np.arange(self.page, dtype=np.int32)).reshape(-1)
        return slot, rows[:tokens]

    def free(self, slot: int | None, rows) -> None:
        if slot is None:
            return
        with self.lock:
            self._free_slots.append(int(slot))
            if rows is not None and len(rows):
                self._free_pages.extend(sorted({int(r) // self.page for r in np.asarray(rows)}, reverse=True))

    def reset(self) -> None:
        """Every slot and page free again (the arrays keep their contents until overwritten)."""
        with self.lock:
            self._free_slots = list(range(self.slots - 1, 0, -1))
            self._free_pages = list(range(self.pages - 1, 0, -1))
