"""The segment cache: content-addressed entries on device, evicted under a byte budget, pinned while in use.

Keys are SHA-256 digests over the entry's token ids, the model fingerprint (which weights, which dtype), the entry
kind and the settings that change what an entry holds (the seam length it was recorded with, the prefix it
continues), and an optional tenant salt. A digest match is confirmed by comparing the stored token ids, so a hash
collision can never serve another segment's states.

Entries are PyTrees of device arrays. A request pins the entries it reads or creates; eviction skips pinned entries
(the budget may be overshot while a request runs and is restored when it unpins). Eviction only drops the cache's
reference: a request that already holds an entry keeps using it, so a small budget can slow requests down but never
break one. `on_drop(entry)` runs once an entry has left the cache and no request holds it pinned (the engine frees
the entry's pool slot there), never earlier.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
import threading
from typing import Any, Iterator, Sequence

import jax
import numpy as np


def tree_nbytes(tree: Any) -> int:
    return int(sum(int(np.prod(leaf.shape)) * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree)))


def model_fingerprint(arch_name: str, config: Any, params: Any, source: str | None = None) -> str:
    """A digest naming one set of weights: architecture, config, parameter structure, shapes and dtypes, and a few
    values from every leaf (first and last elements), plus the checkpoint path when known. Cheap (one tiny slice per
    leaf leaves the device) and different for any two differently initialised or converted models."""
    digest = hashlib.sha256()
    digest.update(arch_name.encode())
    digest.update(repr(config).encode())
    digest.update((source or "").encode())
    leaves, treedef = jax.tree.flatten(params)
    digest.update(str(treedef).encode())
    samples = []
    for leaf in leaves:
        digest.update(f"{leaf.shape}{leaf.dtype}".encode())
        if leaf.size < 2**31:
            flat = leaf.reshape(-1)
            samples.append(flat[:4])
            samples.append(flat[-4:])
        else:  # a flat index past int32 (stacked layers): the first and last rows of the last axis instead
            samples.append(leaf[(0,) * (leaf.ndim - 1)][:4])
            samples.append(leaf[(-1,) * (leaf.ndim - 1)][-4:])
    for sample in jax.device_get(samples):
        digest.update(np.asarray(sample, np.float32).tobytes())
    return digest.hexdigest()


def entry_key(tokens: Sequence[int], *, fingerprint: str, kind: str, seam: int = 0, parent: str = "",
              salt: str | None = None) -> str:
    """SHA-256 of (fingerprint, kind, seam, parent key, salt, token ids as int32 bytes)."""
    header = _key_header if not parent else _key_header.__wrapped__  # a chain's parents are seen once each
    digest = header(fingerprint, kind, int(seam), parent, salt).copy()
    digest.update(np.asarray(tokens, np.int32).tobytes())
    return digest.hexdigest()


@functools.lru_cache(maxsize=64)
def _key_header(fingerprint: str, kind: str, seam: int, parent: str, salt: str | None):
    """The digest of a key's settings, before its tokens: shared by every key of one kind and seam (copied, never
    updated in place)."""
    digest = hashlib.sha256()
    for part in (fingerprint, kind, str(seam), parent, "" if salt is None else f"salt:{salt}"):
        digest.update(part.encode())
        digest.update(b"\x00")
    return digest


@dataclasses.dataclass
class Entry:
    """One cached segment: its token ids (for the equality check), how it was recorded, and the per-layer PyTree.

    seam: tokens at the segment's start that are not in the entry (recomputed at reuse); the entry covers tokens
    [seam, len(tokens)). kind: "pic" (interior recorded in isolation at canonical positions) or "prefix" (exact
    state snapshot after the segment, K/V at absolute positions)."""

    key: str
    tokens: tuple[int, ...]
    kind: str
    seam: int
    layers: Any
    nbytes: int
    pins: int = 0
    slot: int | None = None  # its slot in the engine's entry pools, if any (`hypic_jax.cache.pools`)
    rows: Any = None  # its tokens' rows in the per-token pools (`hypic_jax.cache.pools`), if any
    device: int | None = None  # the segment mesh device whose pools hold it (`hypic_jax.parallel.mesh_pools`); None: the
    # engine's own pools
    dropped: bool = False  # left the cache while pinned: `on_drop` runs when the last pin goes
    uses: int = 0  # lookups it served (the frequency a cost-aware policy weighs)
    priority: float = 0.0  # its rank under the cache's policy: the lowest is evicted first

    @property
    def length(self) -> int:
        return len(self.tokens) - self.seam

    @functools.cached_property
    def token_bytes(self) -> bytes:
        """Its token ids as int32 bytes: a lookup by an int32 array compares these instead of the ids one by one."""
        return np.asarray(self.tokens, np.int32).tobytes()

    def holds(self, tokens) -> bool:
        """Whether `tokens` (a sequence of ids or an array) are its tokens."""
        if isinstance(tokens, np.ndarray) and tokens.dtype == np.int32 and tokens.ndim == 1:
            return tokens.tobytes() == self.token_bytes
        return self.tokens == (tuple(tokens) if isinstance(tokens, (list, tuple)) else tuple(int(t) for t in tokens))


@dataclasses.dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    insertions: int = 0
    evictions: int = 0
    bytes: int = 0
    entries: int = 0
    capacity_bytes: int = 0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class SegmentCache:
    """Map key -> Entry under a byte budget (`capacity_bytes`; None = unbounded). Thread-safe.

    Eviction is least recently used first, or with `policy` (an object with `rank(entry) -> float`, called on
    insertion and on every hit, and `evicted(entry)`) lowest `entry.priority` first, least recently used among
    equals (`hypic_jax.cache.tiers.DevicePolicy`)."""

    def __init__(self, capacity_bytes: int | None = None, on_drop=None, policy=None):
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0 or None, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._on_drop = on_drop
        self._policy = policy
        self._entries: collections.OrderedDict[str, Entry] = collections.OrderedDict()
        self._lock = threading.RLock()
        self._stats = CacheStats(capacity_bytes=capacity_bytes or 0)

    # Queries ------------------------------------------------------------------------------------------------------
    def lookup(self, key: str, tokens: Sequence[int], *, count: bool = True,
               pins: "PinSet | None" = None) -> Entry | None:
        """The entry under `key` if its tokens equal `tokens` (then it becomes most recently used), added to `pins`
        in the same critical section: pinned after the lookup instead, it could be evicted (and its pool slot
        handed to another entry) by another thread in between."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and not entry.holds(tokens):
                entry = None  # a digest collision or a mismatched key: never serve it
            if entry is not None:
                self._entries.move_to_end(key)
                entry.uses += 1
                if self._policy is not None:
                    entry.priority = self._policy.rank(entry)
            if count:
                if entry is None:
                    self._stats.misses += 1
                else:
                    self._stats.hits += 1
            if entry is not None and pins is not None:
                pins.add(entry)
            return entry

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def entries(self) -> list[Entry]:
        """The entries now cached (a snapshot)."""
        with self._lock:
            return list(self._entries.values())

    @property
    def stats(self) -> CacheStats:
        with self._lock:
            return dataclasses.replace(self._stats, entries=len(self._entries))

    # Updates ------------------------------------------------------------------------------------------------------
    def insert(self, entry: Entry) -> Entry:
        """Store `entry` (replacing an entry under the same key) and evict down to the budget."""
        with self._lock:
            old = self._entries.pop(entry.key, None)
            if old is not None:
                self._stats.bytes -= old.nbytes  # a request still holding `old` keeps its arrays alive
                self._drop(old)
            self._entries[entry.key] = entry
            if self._policy is not None:
                entry.priority = self._policy.rank(entry)
            self._stats.bytes += entry.nbytes
            self._stats.insertions += 1
            self._evict()
            return entry

    def _order(self) -> list[Entry]:
        """Entries in eviction order (the sort is stable: least recently used first among equal priorities)."""
        entries = list(self._entries.values())
        if self._policy is not None:
            entries.sort(key=lambda e: e.priority)
        return entries

    def _remove(self, entry: Entry) -> None:
        del self._entries[entry.key]
        self._stats.bytes -= entry.nbytes
        self._stats.evictions += 1
        if self._policy is not None:
            self._policy.evicted(entry)
        self._drop(entry)

    def _evict(self) -> None:
        if self.capacity_bytes is None or self._stats.bytes <= self.capacity_bytes:
            return
        for entry in self._order():
            if self._stats.bytes <= self.capacity_bytes:
                break
            if entry.pins == 0:
                self._remove(entry)

    def evict_one(self) -> bool:
        """Drop the first entry in eviction order that no request holds (to free room in a fixed pool); False
        when every entry is pinned."""
        with self._lock:
            for entry in self._order():
                if entry.pins == 0:
                    self._remove(entry)
                    return True
            return False

    def _drop(self, entry: Entry) -> None:
        """`entry` has left the cache: hand it to on_drop now, or when its last pin goes."""
        entry.dropped = True
        if entry.pins == 0 and self._on_drop is not None:
            self._on_drop(entry)

    def clear(self) -> None:
        with self._lock:
            entries = list(self._entries.values())
            self._entries.clear()
            self._stats.bytes = 0
            for entry in entries:
                self._drop(entry)

    @contextlib.contextmanager
    def pinned(self, entries: Sequence[Entry] = ()) -> Iterator["PinSet"]:
        """Pin `entries` (and whatever is added to the yielded set) for the duration of a request."""
        pins = PinSet(self)
        try:
            for entry in entries:
                pins.add(entry)
            yield pins
        finally:
            pins.release()


class PinSet:
    """The entries one request holds pinned."""

    def __init__(self, cache: SegmentCache):
        self._cache = cache
        self._held: list[Entry] = []

    def add(self, entry: Entry) -> Entry:
        with self._cache._lock:
            entry.pins += 1
        self._held.append(entry)
        return entry

    def release(self) -> None:
        with self._cache._lock:
            for entry in self._held:
                entry.pins -= 1
                if entry.pins == 0 and entry.dropped and self._cache._on_drop is not None:
                    self._cache._on_drop(entry)
            self._held.clear()
            self._cache._evict()
