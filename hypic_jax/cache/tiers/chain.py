"""The tiers below the device pools together (`Tiers`): where a demoted entry goes (peer, then host, then disk, by
the policy, each tier's evictions one tier down) and where a missing one is found.
"""

from __future__ import annotations

import threading

from hypic_jax.cache.tiers.copies import Mover
from hypic_jax.cache.tiers.cost import Policy
from hypic_jax.cache.tiers.disk import DiskStore
from hypic_jax.cache.tiers.host import HostStore
from hypic_jax.cache.tiers.peer import PeerStore
from hypic_jax.cache.tiers.pieces import Pieces


class Tiers:
    """Host and disk tiers of one engine: where a demoted entry goes, where a missing one is found.

    host_bytes: the host tier's budget (0: off). disk_dir: the disk tier's folder (None: off), disk_bytes its
    budget (None: unbounded; 0: off). policy: a `Policy` (shared with the device tier). leaves: `Mover.leaves`;
    form: `compact_form`'s name of how pieces are stored (a disk file of another form is foreign); droppable:
    `Mover.droppable`."""

    def __init__(self, *, leaves, fingerprint: str, policy: Policy, host_bytes: int = 0, disk_dir=None,
                 disk_bytes: int | None = None, form: str = "exact", droppable=None, peers=(), peer_bytes: int = 0,
                 mover: Mover | None = None):
        for name, value in (("host_cache_bytes", host_bytes), ("disk_cache_bytes", disk_bytes),
                            ("peer_cache_bytes", peer_bytes)):
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if peer_bytes and not peers:
            raise ValueError("peer_cache_bytes needs other devices to hold the peer tier (Engine(devices=N), "
                             "N >= 2)")
        if peer_bytes and mover is None:
            raise ValueError("the peer tier needs the engine's Mover (its entries move between devices)")
        self.policy = policy
        self.mover = mover
        # the peer tier: a store per other device of the engine, each with `peer_bytes`
        self.peers = [PeerStore(peer_bytes, policy, device) for device in peers] if peer_bytes else []
        self.host = HostStore(host_bytes, policy) if host_bytes else None
        self.disk = (DiskStore(disk_dir, disk_bytes, policy, fingerprint=fingerprint, leaves=leaves, form=form,
                               droppable=droppable)
                     if disk_dir is not None and disk_bytes != 0 else None)
        self.promotions = dict({"peer": 0} if self.peers else {}, host=0, disk=0)
        self.demotions = 0
        self.lock = threading.RLock()
        self._spilling: dict[str, Pieces] = {}  # left the host tier, their disk files not yet written

    @property
    def enabled(self) -> bool:
        return self.host is not None or self.disk is not None or bool(self.peers)

    def _relocated(self, pieces: Pieces, where) -> Pieces:
        """`pieces` with its buffers moved to device `where` (the peer tier) or, with None, to host memory."""
        staged = self.mover.moved(self.mover.stage(pieces), where)
        return Pieces(key=pieces.key, tokens=pieces.tokens, kind=pieces.kind, seam=pieces.seam, uses=pieces.uses,
                      staged=staged)

    def _into_peer(self, pieces: Pieces) -> list[Pieces]:
        """Keep `pieces` in the peer store with the most room (moved to its device); returns what goes below, in
        host memory: the entries evicted to make room, or `pieces` itself when the peer tier does not keep it."""
        stores = [p for p in self.peers if p.fits(pieces.nbytes)]
        if not stores or not self.policy.keeps("peer", pieces.length, pieces.nbytes):
            self.peers[0].stats.skipped += 1
            return [pieces]
        store = max(stores, key=lambda p: p.room)
        evicted = store.put(self._relocated(pieces, store.device))
        return [self._relocated(p, None) for p in evicted]

    def _into_host(self, down: list[Pieces]) -> list[Pieces]:
        if self.host is None:
            return down
        out = []
        for pieces in down:
            if (not self.host.off and self.host.fits(pieces.nbytes)
                    and self.policy.keeps("host", pieces.length, pieces.nbytes)):
                out += self.host.put(pieces)
            else:
                self.host.stats.skipped += 1
                out.append(pieces)
        return out

    def put(self, pieces: Pieces) -> None:
        """An entry demoted from the device: into the peer tier, or the host tier, or the disk, or nowhere (by the
        policy); what a tier evicts to make room goes one tier down. Entries bound for the disk are written after
        this lock is released (`take` finds them meanwhile), so that a lookup never waits for the drive."""
        with self.lock:
            self.demotions += 1
            down = self._into_peer(pieces) if self.peers else [pieces]
            down = self._into_host(down)
        self._spill(down)

    def _spill(self, down: list[Pieces]) -> None:
        """Write entries that left the host tier to disk, outside this lock (`take` finds them meanwhile)."""
        if self.disk is None or not down:
            return
        with self.lock:
            for p in down:
                self._spilling[p.key] = p
        for p in down:
            self._to_disk(p)
        with self.lock:
            for p in down:
                if self._spilling.get(p.key) is p:
                    del self._spilling[p.key]

    def _to_disk(self, pieces: Pieces) -> None:
        if self.disk is None:
            return
        if pieces.key in self.disk:
            return
        if self.disk.fits(pieces.nbytes) and self.policy.keeps("disk", pieces.length, pieces.nbytes):
            self.disk.put(pieces)
        else:
            self.disk.stats.skipped += 1

    def persist(self, pieces: Pieces) -> bool:
        """Write an entry to disk (it also stays where it is); False when there is no disk tier or it refused."""
        with self.lock:
            if self.disk is None:
                return False
            if pieces.key not in self.disk:
                self._to_disk(pieces)
            return pieces.key in self.disk

    def take(self, key: str, tokens: tuple[int, ...]) -> tuple[Pieces, str] | None:
        """The entry from the peer or host tier (leaving it) or the disk (its file stays), and which."""
        with self.lock:
            for store in self.peers:
                found = store.take(key, tokens)
                if found is not None:
                    self.promotions["peer"] += 1
                    return found, "peer"
            found = self.host.take(key, tokens) if self.host is not None else None
            if found is not None:
                self.promotions["host"] += 1
                return found, "host"
            spilling = self._spilling.get(key)  # on its way to disk, still in host memory: its file is written too
            if spilling is not None and spilling.tokens == tokens:
                tier = "host" if self.host is not None else "disk"
                self.promotions[tier] += 1
                return spilling, tier
            found = self.disk.take(key, tokens) if self.disk is not None else None
            if found is not None:
                self.promotions["disk"] += 1
                return found, "disk"
            return None

    def give_back(self, pieces: Pieces, tier: str) -> None:
        """A taken entry that could not be promoted (the pools were full of running requests' entries, or the
        request failed first)."""
        with self.lock:
            self.promotions[tier] -= 1
            if tier == "peer":
                devices = pieces.staged.main.devices()
                store = next(p for p in self.peers if p.device in devices)
                down = self._into_host([self._relocated(p, None) for p in store.put(pieces)])
            else:
                down = self.host.put(pieces) if tier == "host" and self.host is not None else []
        self._spill(down)

    def clear(self, *, disk: bool = False) -> None:
        with self.lock:
            self._spilling.clear()
            for store in self.peers:
                store.clear()
            if self.host is not None:
                self.host.clear()
            if disk and self.disk is not None:
                self.disk.clear()

    def stats(self) -> dict:
        with self.lock:
            for store in [*self.peers, self.host, self.disk]:
                if store is not None:
                    store.off  # noqa: B018  (refreshes the stats' `off`)
            peer = None
            if self.peers:
                per = [p.stats.as_dict() for p in self.peers]
                peer = {k: sum(d[k] for d in per) for k in per[0] if k != "capacity_bytes"}
                peer.update(capacity_bytes=sum(d["capacity_bytes"] for d in per), devices=len(per),
                            entries_per_device=[d["entries"] for d in per])
            return dict(peer=peer, host=self.host.stats.as_dict() if self.host is not None else None,
                        disk=self.disk.stats.as_dict() if self.disk is not None else None,
                        promotions=dict(self.promotions), demotions=self.demotions)
