"""The cache hierarchy of one engine (`CacheHierarchy`): the entries in the device pools, the tiers below them
(other devices, host memory, disk: `hypic_jax.cache.tiers`), and the moves between them.

Demotion: an entry the device index drops (`dropped`) has its copy out of the pools issued at once, so its pool
room is free again, and one background thread brings it into its tier. Promotion: a lookup (`find`) that hits a
lower tier allocates the entry's pool room and issues its copy to the device; the request writes it into the pools
(`finish_promotions`) after it issued its cold prefill, so the copy overlaps with that. Persistence: `persist`
writes what the device and host tiers hold to the disk tier, and with write-through every new entry goes there too.

The hierarchy knows nothing of the engine's programs: it is given the pools (`hypic_jax.cache.pools.Pools`), a
function that returns their live arrays, one that runs a program writing them (donated), the lock the engine holds
over device work, and, for the cost model's first samples, the cold prefills it may time (`ColdPrefills`). With a
segment mesh the engine hands it the other devices' pools (`mesh_pools`) once they exist.

One request at a time (under the engine's device lock) runs inside `request()`: the entries given pool room by it
and not yet stored, and its promotions and copies from other devices in flight, are its own until it stores them,
and go back when it fails.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import numpy as np

from hypic_jax.cache import tiers as tr
from hypic_jax.cache.index import Entry, SegmentCache
from hypic_jax.cache.pools import PoolFull, Pools

log = logging.getLogger(__name__)

__all__ = ["CacheHierarchy", "ColdPrefills", "Fetch", "token_tuple"]


def host_memory_error(error: BaseException) -> bool:
    """An allocation of host memory failed: Python's MemoryError, or XLA's when it could not get host buffers."""
    text = str(error)
    return isinstance(error, MemoryError) or ("RESOURCE_EXHAUSTED" in text and "host" in text.lower())


def token_tuple(tokens) -> tuple[int, ...]:
    """Token ids as the tuple of ints an entry keeps."""
    return tuple(tokens.tolist()) if isinstance(tokens, np.ndarray) else tuple(int(t) for t in tokens)


@dataclasses.dataclass
class Fetch:
    """One entry on its way from device `device`'s pools to the home pools (`source` there, `target` at home)."""

    device: int
    source: Entry
    target: Entry


@dataclasses.dataclass(frozen=True)
class ColdPrefills:
    """The cold prefills that calibrating the cost model times (`CacheHierarchy.calibrate`).

    rungs: the token rungs warmed, increasing. max_segments: the most segments one prefill takes. vocab_size: token
    ids are drawn below it. ready(rung): whether the cold program of that rung is compiled. run(lengths, tokens):
    one cold prefill of segments of `lengths` over `tokens` that records nothing, waited for."""

    rungs: Sequence[int]
    max_segments: int
    vocab_size: int
    ready: Callable[[int], bool]
    run: Callable[[Sequence[int], np.ndarray], None]


class CacheHierarchy:
    """The device pools' entries and the tiers below them (module docstring).

    pools: the device pools. options: the engine's tier options (`hypic_jax.engine.options.TierOptions`'s fields).
    cache_bytes: the device index's budget. fingerprint: the model's (disk files of another are foreign).
    max_tokens: the longest entry. devices: the engine's devices, of which the others of this process hold the
    peer tier. pool_arrays(): the pools' live arrays. write_pools(program, *args): pools = program(pools, *args),
    donated. device_lock: held while the entries are walked (demoting or persisting them all)."""

    # at most this many demotions in flight (each holds its entry's copy, in device memory when the host tier is
    # pageable, until the host tier has it)
    MAX_PENDING_DEMOTIONS = 8

    def __init__(self, pools: Pools, options, *, cache_bytes: int, fingerprint: str, max_tokens: int,
                 devices: Sequence = (), pool_arrays: Callable[[], Any], write_pools: Callable[..., None],
                 device_lock):
        self.pools = pools
        self._pool_arrays, self._write_pools, self._device_lock = pool_arrays, write_pools, device_lock
        self.eviction = options.eviction
        self.cost = tr.CostModel()
        self.bandwidths = tr.Bandwidths(host=options.host_bandwidth or tr.DEFAULT_HOST_BANDWIDTH,
                                        disk=options.disk_bandwidth or tr.DEFAULT_DISK_BANDWIDTH)
        self._bandwidth_overrides = (options.host_bandwidth, options.disk_bandwidth)
        self.policy = tr.Policy(options.eviction, self.cost, lambda: self.bandwidths)
        self.mover = tr.Mover(pools, max_tokens, compact=options.tier_dtype, transfer_tol=options.tier_transfer_tol,
                              host_memory=options.host_memory)
        peers = ()
        if options.peer_cache_bytes:  # the peer tier: the engine's other devices (this process's), a budget on each
            home = self.mover.device
            peers = tuple(d for d in devices if d != home and d.process_index == jax.process_index())
        disk_dir = options.disk_cache_dir
        if disk_dir is not None and options.disk_cache_bytes != 0:  # a budget of 0 turns the disk tier off
            disk_dir = Path(disk_dir).expanduser()
            try:
                disk_dir.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                raise ValueError(f"disk_cache_dir {str(disk_dir)!r}: cannot create it ({error.strerror})") from None
        self.tiers = tr.Tiers(leaves=self.mover.leaves, fingerprint=fingerprint, policy=self.policy,
                              host_bytes=options.host_cache_bytes, disk_dir=disk_dir,
                              disk_bytes=options.disk_cache_bytes,
                              form=tr.compact_form(options.tier_dtype, options.tier_transfer_tol),
                              droppable=self.mover.droppable, peers=peers, peer_bytes=options.peer_cache_bytes,
                              mover=self.mover)
        self.disk_write_through = options.disk_write_through
        self.cache = SegmentCache(cache_bytes, on_drop=self.dropped,
                                  policy=tr.DevicePolicy(self.policy) if self.eviction == "cost" else None)
        self.mesh_pools = None  # the other devices' pools of a segment mesh (`hypic_jax.parallel.mesh_pools`)
        self._clearing = False
        self._demote_errors = 0
        # seconds a request spent on the tiers' copies (where a tiered request's time goes, `bench/cache_tiers.py`):
        # issuing demotions and waiting for the ones in flight, issuing promotions, writing them into the pools
        self.tier_seconds = dict(demote_issue=0.0, demote_wait=0.0, promote_issue=0.0, promote_write=0.0)
        # demotions finish off the request's path: the copy out of the pools is issued at eviction (so the pool room
        # is free at once), its transfer to the host and the tier's bookkeeping run on this one thread
        self._demoter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hypic-demote")
        self._demoting: dict[str, concurrent.futures.Future] = {}
        self._demoting_lock = threading.Lock()
        # the running request's entries given pool room and not stored yet (freed if it fails before storing them)
        self.unstored: list[Entry] = []
        # key -> (entry, tr.Transfer, tr.Pieces, tier): the request's promotions not yet written into the pools;
        # tier "device": a copy from another device's pools (`mesh_pools`), whose pieces are None
        self.promoting: dict[str, tuple] = {}
        self._fetching: list[Fetch] = []  # the request's copies from other devices' pools, not yet issued

    # Warmup ------------------------------------------------------------------------------------------------------------
    def warm(self, cold: ColdPrefills) -> dict:
        """Compile the promote/demote programs, measure the tiers' bandwidths, calibrate the cost model."""
        out = dict(tier_programs=0)
        if self.tiers.enabled:
            out["tier_programs"] = self.mover.compile(self.pools.arrays)
            host, disk = self._bandwidth_overrides
            folder = self.tiers.disk.folder if self.tiers.disk is not None else None
            self.bandwidths = tr.Bandwidths.measure(folder, host=host, disk=disk, staging=self.mover.host_sharding,
                                                    device=self.mover.device_sharding,
                                                    peers=[p.device for p in self.tiers.peers])
        if self.eviction == "cost":
            self.calibrate(cold)
        return out

    def calibrate(self, cold: ColdPrefills) -> None:
        """Time cold prefills of the top rung and of one a quarter of its size, as one segment and as four (records
        nothing): the cost model's first samples."""
        rungs = cold.rungs
        chosen = sorted({rungs[-1], min(rungs, key=lambda r: abs(r - rungs[-1] / 4))})
        if not all(cold.ready(r) for r in chosen):
            return  # compiling in the background: the cost model learns from the requests instead
        rng = np.random.default_rng(0)
        for rung in chosen:
            for lengths in ([rung], [max(1, rung // 4)] * min(4, cold.max_segments)):
                tokens = rng.integers(0, cold.vocab_size, sum(lengths))
                for attempt in range(2):  # the first run of a program pays one-time costs
                    start = time.perf_counter()
                    cold.run(lengths, tokens)
                    if attempt:
                        self.cost.observe(lengths, time.perf_counter() - start)

    # A request's entries -----------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def request(self):
        """One request's span: whatever it leaves unstored or in flight when it ends (a failure) goes back, its
        promotions to their tiers and its unstored entries' pool room to the pools."""
        self.unstored, self.promoting, self._fetching = [], {}, []
        try:
            yield
        finally:
            for _, _, pieces, tier in self.promoting.values():  # a failed request's promotions go back
                if tier != "device":  # another device's pools still hold those
                    self.tiers.give_back(pieces, tier)
            self.promoting = {}
            self._fetching = []
            for entry in self.unstored:
                self.free(entry)
            self.unstored = []

    def _allocate(self, tokens: int):
        return self.pools.allocate(tokens, self.cache.evict_one)

    def new_entry(self, kind: str, key: str, doc, seam: int, pins, device: int | None = None) -> Entry:
        """A pinned entry given room in the engine's pools, or with `device` in the pools of that device of the
        segment mesh (`mesh_pools`; the home device's are the engine's own)."""
        n = len(doc) - seam
        mesh_pools = self.mesh_pools
        if mesh_pools is None or not mesh_pools.remote(device):
            device = None
        slot, rows = self._allocate(n) if device is None else mesh_pools.allocate(device, n)
        entry = Entry(key=key, tokens=token_tuple(doc), kind=kind, seam=seam, layers=None,
                      nbytes=self.pools.entry_bytes(n), slot=slot, rows=rows, device=device)
        self.unstored.append(entry)
        return pins.add(entry)

    def free(self, entry: Entry) -> None:
        """Give an entry's pool room back (in whichever device's pools it has it)."""
        if entry.device is None:
            self.pools.free(entry.slot, entry.rows)
        else:
            self.mesh_pools.free(entry)

    def store(self, entry: Entry) -> None:
        """Make a recorded home entry visible to later requests (and with write-through, write it to disk)."""
        self.cache.insert(entry)
        self.unstored.remove(entry)
        if self.disk_write_through and self.tiers.disk is not None:
            self.persist_entry(entry)

    def store_remote(self, entry: Entry, pins) -> Entry:
        """Store an entry recorded in another device's pools there, where it stays; returns the home entry the
        request reads instead, a copy issued with its others (`finish_promotions` writes it)."""
        self.mesh_pools.caches[entry.device].insert(entry)
        self.unstored.remove(entry)
        if self.disk_write_through and self.tiers.disk is not None:
            self.tiers.persist(self.remote_pieces(entry))
        return self.fetch_home(entry, pins)

    # Promotion ---------------------------------------------------------------------------------------------------------
    def find(self, key: str, tokens, pins, *, kind: str, seam: int) -> Entry | None:
        """The pinned device entry under `key`, promoted from a lower tier when it is there. A promotion's copy is
        issued here and written into the pools by `finish_promotions`, which the request calls after it issued its
        cold prefill (so the copy overlaps with it); until then the entry is this request's alone."""
        promoting = self.promoting.get(key)
        if promoting is not None:
            return pins.add(promoting[0])
        entry = self.cache.lookup(key, tokens, pins=pins)
        if entry is not None:
            return entry
        mesh_pools = self.mesh_pools
        if mesh_pools is not None:
            source = mesh_pools.lookup(key, tokens, pins)
            if source is not None:  # on another device: a home copy, issued with this request's other copies
                return self.fetch_home(source, pins)
        if not self.tiers.enabled:
            return None
        waited = time.perf_counter()
        self._await_demotion(key)
        self.tier_seconds["demote_wait"] += time.perf_counter() - waited
        found = self.tiers.take(key, token_tuple(tokens))
        if found is None:
            return None
        pieces, tier = found
        if pieces.kind != kind or pieces.seam != seam:  # the key covers both; a mismatch is never served
            return None
        try:
            slot, rows = self._allocate(pieces.length)
        except PoolFull:
            self.tiers.give_back(pieces, tier)
            if kind == "prefix":  # a prefix cache computes what it cannot hold: a miss from here on
                return None
            raise
        entry = Entry(key=key, tokens=pieces.tokens, kind=kind, seam=seam, layers=None,
                      nbytes=self.pools.entry_bytes(pieces.length), slot=slot, rows=rows, uses=pieces.uses)
        self.unstored.append(entry)
        pins.add(entry)
        issued = time.perf_counter()
        try:
            transfer = self.mover.transfer(self.mover.stage(pieces), slot, rows)
            self.tier_seconds["promote_issue"] += time.perf_counter() - issued
        except Exception:
            self.tiers.give_back(pieces, tier)
            raise
        self.promoting[key] = (entry, transfer, pieces, tier)
        return entry

    def fetch_home(self, source: Entry, pins) -> Entry:
        """A home entry for `source`, an entry in another device's pools: its copy is issued with the request's
        other copies (`issue_fetches`) and written like a promotion; `source` stays where it is."""
        doc = np.asarray(source.tokens, np.int32)
        target = self.new_entry(source.kind, source.key, doc, source.seam, pins)
        target.uses = source.uses
        self._fetching.append(Fetch(source.device, source, target))
        self.promoting[source.key] = (target, None, None, "device")
        return target

    def issue_fetches(self) -> None:
        """Issue the copies `fetch_home` queued (`MeshPools.fetch`: at most one gather per device and bucket)."""
        if not self._fetching:
            return
        fetching, self._fetching = self._fetching, []
        for fetch, transfer in self.mesh_pools.fetch(fetching):
            key = fetch.target.key
            self.promoting[key] = (fetch.target, transfer, None, "device")

    def finish_promotions(self) -> None:
        """Write the promotions `find` issued (and the copies from other devices) into the pools and make their
        entries visible to later requests."""
        self.issue_fetches()
        while self.promoting:  # one at a time: a failure leaves the rest to `request`, which gives them back
            key = next(iter(self.promoting))
            entry, transfer, pieces, tier = self.promoting[key]
            written = time.perf_counter()
            with self.pools.lock:
                programs = (self.mesh_pools.scatter_programs(transfer) if tier == "device"
                            else self.mover.scatter_programs(self._pool_arrays(), transfer))
                for program, args in programs:
                    self._write_pools(program, *args)
            self.tier_seconds["promote_write"] += time.perf_counter() - written
            del self.promoting[key]
            self.cache.insert(entry)
            self.unstored.remove(entry)
            if self.disk_write_through and pieces is not None:
                self.tiers.persist(pieces)

    # Demotion ----------------------------------------------------------------------------------------------------------
    def _pieces(self, entry: Entry) -> tr.Pieces:
        with self.pools.lock:
            started = self.mover.gather_start(self._pool_arrays(), entry.slot, entry.rows)
        return self._stored_pieces(entry, started)

    def _stored_pieces(self, entry: Entry, started) -> tr.Pieces:
        """`entry` off the device, from `Mover.gather_start`'s handle (waits for the transfer)."""
        return tr.Pieces(key=entry.key, tokens=entry.tokens, kind=entry.kind, seam=entry.seam, uses=entry.uses,
                         staged=self.mover.gather_finish(started))

    def dropped(self, entry: Entry) -> None:
        """`entry` left the device tier (no request holds it): issue its copy out of the pools, free its pool room,
        and let the demotion thread bring it to the host tier. An entry that another device of the segment mesh
        still holds is not demoted (that device keeps it); one evicted from another device's pools is dropped."""
        if entry.device is not None:
            self.free(entry)
            return
        mesh_pools = self.mesh_pools
        try:
            if (self.tiers.enabled and not self._clearing and entry.slot is not None and entry.key not in self.cache
                    and not (mesh_pools is not None and mesh_pools.holds(entry.key))):
                issued = time.perf_counter()
                with self.pools.lock:
                    started = self.mover.gather_start(self._pool_arrays(), entry.slot, entry.rows)
                waited = time.perf_counter()
                self.tier_seconds["demote_issue"] += waited - issued
                with self._demoting_lock:
                    pending = list(self._demoting.values())
                if len(pending) >= self.MAX_PENDING_DEMOTIONS:
                    concurrent.futures.wait(pending[: len(pending) - self.MAX_PENDING_DEMOTIONS + 1])
                self.tier_seconds["demote_wait"] += time.perf_counter() - waited
                with self._demoting_lock:
                    future = self._demoter.submit(self._finish_demotion, entry, started)
                    self._demoting[entry.key] = future
                future.add_done_callback(functools.partial(self._forget_demotion, entry.key))
        except Exception as error:  # a failed copy loses the entry, never the request
            self._demotion_failed(error)
        finally:
            self.pools.free(entry.slot, entry.rows)

    def _finish_demotion(self, entry: Entry, started) -> None:
        try:
            self.tiers.put(self._stored_pieces(entry, started))
        except Exception as error:
            self._demotion_failed(error)

    def _demotion_failed(self, error: Exception) -> None:
        """A demotion that failed drops its entry. Host memory that cannot be had turns the host tier off for a
        while (`_Store.turn_off`): the entries then go to the disk tier or nowhere, not into the same fault."""
        self._demote_errors += 1
        if self.tiers.host is not None and host_memory_error(error):
            self.tiers.host.turn_off(f"host memory for a demoted entry could not be had ({type(error).__name__})")
            return
        log.error("demoting a cache entry failed; it is dropped", exc_info=error)

    def _forget_demotion(self, key: str, future) -> None:
        with self._demoting_lock:
            if self._demoting.get(key) is future:
                del self._demoting[key]

    def _await_demotion(self, key: str) -> None:
        """Wait for `key`'s demotion if one is in flight (so that a lookup finds it in its tier)."""
        with self._demoting_lock:
            future = self._demoting.get(key)
        if future is not None:
            concurrent.futures.wait([future])

    def demote_all(self, *, sync: bool = True) -> int:
        """Evict every device entry that no request holds into the lower tiers (dropped where they are off);
        returns how many left the device. sync: wait until their demotions have reached their tiers."""
        count = 0
        with self._device_lock:
            while self.cache.evict_one():
                count += 1
        if sync:
            self.sync()
        return count

    def sync(self) -> None:
        """Wait until every demotion issued so far has reached its tier."""
        with self._demoting_lock:
            pending = list(self._demoting.values())
        concurrent.futures.wait(pending)

    # Persistence -------------------------------------------------------------------------------------------------------
    def persist_entry(self, entry: Entry) -> bool:
        if entry.key in self.tiers.disk:
            return True
        return self.tiers.persist(self._pieces(entry))

    def remote_pieces(self, entry: Entry) -> tr.Pieces:
        """An entry of another device's pools off the device, in the tiers' stored form (its dtypes; every head)."""
        arrays = [a.astype(dtype) for a, (_, _, dtype) in zip(self.mesh_pools.pieces(entry), self.mover.leaves)]
        return tr.Pieces(key=entry.key, tokens=entry.tokens, kind=entry.kind, seam=entry.seam, arrays=arrays,
                         uses=entry.uses)

    def persist(self) -> int:
        """Write every entry of the device tier (every device of the segment mesh) and the host tier to the disk tier
        (they stay where they are); returns the entries on disk afterwards. Needs a disk tier."""
        self.sync()
        with self._device_lock:
            for entry in self.cache.entries():
                self.persist_entry(entry)
            for entry in self.mesh_pools.entries() if self.mesh_pools is not None else ():
                if entry.key not in self.tiers.disk:  # held on another device only
                    self.tiers.persist(self.remote_pieces(entry))
            if self.tiers.host is not None:
                for pieces in self.tiers.host.values():
                    self.tiers.persist(pieces)
        return self.tiers.disk.stats.entries

    # Lifecycle and stats -----------------------------------------------------------------------------------------------
    def clear(self, *, disk: bool = False) -> None:
        """Drop every entry of the device and host tiers (and with `disk`, this model's files); nothing is demoted."""
        self._clearing = True
        try:
            self.cache.clear()
            if self.mesh_pools is not None:
                self.mesh_pools.clear()
        finally:
            self._clearing = False
        self.sync()
        self.tiers.clear(disk=disk)

    def close(self) -> None:
        """Wait for the demotions in flight and stop the demotion thread."""
        self.sync()
        self._demoter.shutdown(wait=True)

    def stats(self) -> dict:
        self.sync()
        return dict(eviction=self.eviction, **self.tiers.stats(), demote_errors=self._demote_errors,
                    cost=self.cost.as_dict(), bandwidths=dataclasses.asdict(self.bandwidths),
                    host_memory="pinned" if self.mover.host_sharding is not None else "pageable",
                    demote_copy=self.mover.demote_copy,
                    seconds={k: round(v, 6) for k, v in self.tier_seconds.items()})
