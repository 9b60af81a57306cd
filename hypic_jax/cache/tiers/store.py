"""What every tier's store shares (`_Store`): entries under a byte budget, ranked by the policy, with their
bookkeeping (`_Meta`) and counters (`TierStats`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path

from hypic_jax.cache.tiers.cost import Policy
from hypic_jax.cache.tiers.pieces import Pieces


@dataclasses.dataclass
class _Meta:
    tokens: int
    nbytes: int
    uses: int
    priority: float = 0.0
    pieces: Pieces | None = None  # host tier
    path: Path | None = None  # disk tier


@dataclasses.dataclass
class TierStats:
    entries: int = 0
    bytes: int = 0
    capacity_bytes: int | None = None  # None: unbounded
    hits: int = 0
    puts: int = 0
    evictions: int = 0
    skipped: int = 0  # not kept: cheaper to recompute than to load, or larger than the budget
    corrupt: int = 0  # disk: truncated or corrupt files found, deleted, never served
    foreign: int = 0  # disk: files of another model or format version, left alone
    write_errors: int = 0  # disk: writes that failed (the entry was dropped)
    turned_off: int = 0  # times the tier was turned off by a fault of its medium (`_Store.turn_off`)
    off: bool = False  # off now: it takes no new entries until `off_s` after the fault

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


log = logging.getLogger(__name__)


class _Store:
    """Entries of one tier under a byte budget, ranked by the policy.

    A fault of the tier's medium (a full or read-only disk, host memory that cannot be had) turns the tier off for
    `off_s` seconds (`turn_off`): it takes no new entries meanwhile, so requests go on without it instead of each
    meeting the fault again, and what it holds stays readable. The first write after that tries the medium again."""

    tier = ""
    off_s = 60.0

    def __init__(self, capacity_bytes: int | None, policy: Policy):
        self.capacity_bytes = capacity_bytes
        self.policy = policy
        self.index: dict[str, _Meta] = {}
        self.stats = TierStats(capacity_bytes=capacity_bytes)
        self.lock = threading.RLock()
        self._off_until = 0.0
        self.off_reason: str | None = None

    @property
    def off(self) -> bool:
        """Turned off by a fault less than `off_s` ago (the stats' `off` follows)."""
        off = time.monotonic() < self._off_until
        self.stats.off = off
        return off

    def turn_off(self, reason: str) -> None:
        """Take no new entries for `off_s` seconds, with a warning and the stats' `turned_off` and `off`."""
        with self.lock:
            if not self.off:
                self.stats.turned_off += 1
                log.warning("the %s tier is off for %.0f s: %s (requests are served without it)", self.tier,
                            self.off_s, reason)
            self._off_until = time.monotonic() + self.off_s
            self.off_reason = reason
            self.stats.off = True

    def __contains__(self, key: str) -> bool:
        with self.lock:
            return key in self.index

    def _add(self, key: str, meta: _Meta) -> None:
        old = self.index.pop(key, None)
        if old is not None:
            self.stats.bytes -= old.nbytes
        meta.priority = self.policy.rank(self.tier, meta.tokens, meta.nbytes, meta.uses)
        self.index[key] = meta
        self.stats.bytes += meta.nbytes
        self.stats.entries = len(self.index)

    def _pop(self, key: str) -> _Meta | None:
        meta = self.index.pop(key, None)
        if meta is not None:
            self.stats.bytes -= meta.nbytes
            self.stats.entries = len(self.index)
        return meta

    def _victims(self, room: int) -> list[tuple[str, _Meta]]:
        """Remove and return entries in eviction order until `room` more bytes fit the budget."""
        if self.capacity_bytes is None:
            return []
        out = []
        order = sorted(self.index.items(), key=lambda item: item[1].priority)  # dicts keep insertion order: LRU ties
        for key, meta in order:
            if self.stats.bytes + room <= self.capacity_bytes:
                break
            self._pop(key)
            self.policy.evicted(self.tier, meta.priority)
            self.stats.evictions += 1
            out.append((key, meta))
        return out

    def fits(self, nbytes: int) -> bool:
        return self.capacity_bytes is None or nbytes <= self.capacity_bytes
