"""The peer tier (`PeerStore`): demoted entries kept in the memory of the engine's other devices, from which a
promotion is one copy between devices.
"""

from __future__ import annotations

from hypic_jax.cache.tiers.cost import Policy
from hypic_jax.cache.tiers.host import HostStore


class PeerStore(HostStore):
    """The peer tier on one device: entries demoted from the engine's device into another device's memory (the
    engine's mesh: `Engine(devices=N, peer_cache_bytes=...)`), from which a promotion is one copy between
    devices. Exclusive, like the host tier."""

    tier = "peer"

    def __init__(self, capacity_bytes: int | None, policy: Policy, device):
        super().__init__(capacity_bytes, policy)
        self.device = device

    @property
    def room(self) -> int:
        return (self.capacity_bytes or 0) - self.stats.bytes
