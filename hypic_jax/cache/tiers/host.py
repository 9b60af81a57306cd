"""The host tier (`HostStore`): demoted entries in host memory, as the buffers their demotion copied out (pinned
where the device has such memory). Exclusive: a promoted entry leaves it.
"""

from __future__ import annotations

from hypic_jax.cache.tiers.pieces import Pieces
from hypic_jax.cache.tiers.store import _Meta, _Store


class HostStore(_Store):
    tier = "host"

    def put(self, pieces: Pieces) -> list[Pieces]:
        """Keep `pieces`; returns the entries evicted to make room."""
        with self.lock:
            evicted = [meta.pieces for _, meta in self._victims(pieces.nbytes)]
            self._add(pieces.key, _Meta(pieces.length, pieces.nbytes, pieces.uses, pieces=pieces))
            self.stats.puts += 1
            return evicted

    def values(self) -> list[Pieces]:
        with self.lock:
            return [meta.pieces for meta in self.index.values()]

    def take(self, key: str, tokens: tuple[int, ...]) -> Pieces | None:
        with self.lock:
            meta = self.index.get(key)
            if meta is None or meta.pieces.tokens != tokens:
                return None
            self._pop(key)
            self.stats.hits += 1
            return meta.pieces

    def clear(self) -> None:
        with self.lock:
            self.index.clear()
            self.stats.bytes = self.stats.entries = 0
