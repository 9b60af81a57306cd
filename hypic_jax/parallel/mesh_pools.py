"""A pool per device of the segment mesh: cache entries stay on the device that computed them.

With `Engine(devices=N)` in one process, every device of the mesh holds entry pools of the engine's own
shapes and capacity (the home device's are the engine's pools) and an index of the entries in them (a
`SegmentCache` per device; the home device's is the engine's cache). The segment-parallel cold program writes each
bin's records into the pools of the device that computed it, inside the program (`SegmentMesh`): no record leaves
its device on the way into the cache.

The stitched (pic) program runs on the home device and reads the home pools only, so the combine copies what a
request needs there (`fetch`): an entry of another device is gathered out of that device's pools into one byte
buffer (the tiers' `Mover` layout, exact: no compact form between devices), copied to the home device and written
into a home slot by the same scatter programs a promotion uses. The gathers run as one program over the mesh, at
most one entry per device per call (entries of one bucket of pages per call), so each device gathers its own
entries; a device's copies to the home device are issued right after, and each waits only for its own device's
part of the programs before it (its bin of the cold program), so a bin that finished early can send its entries
while other bins still compute (not yet measured on several GPUs), and each scatter waits only for its own
transfer.

The home copy is an ordinary home entry: later requests hit it there, and evicting it demotes nothing while its
device still holds the entry (that device's pool is the inclusive copy; a later hit fetches it again). An entry
evicted from another device's pool is dropped. `hypic_jax.parallel.multihost` keeps its replicated pools instead (every
process commits every record), so across processes the records still travel to every process.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from hypic_jax.cache import tiers as tr
from hypic_jax.cache.hierarchy import Fetch
from hypic_jax.cache.index import Entry, SegmentCache
from hypic_jax.cache.pools import Pools

__all__ = ["MeshPools", "Fetch"]


@dataclasses.dataclass
class FetchStats:
    fetches: int = 0  # entries copied to the home device
    fetched_bytes: int = 0  # their buffers' bytes
    gather_calls: int = 0  # mesh gather programs run (each moves at most one entry per device)
    remote_hits: int = 0  # requests' lookups found on another device's pools only


def _gather_local(pools, slot, rows, *, gather):
    """One device's entry (slot [1], rows [1, bucket rows]) out of its pools as one byte buffer [bytes] (over the
    mesh: [devices * bytes], each device's shard its own buffer)."""
    main, _, _ = gather(pools, slot[0], rows[0])
    return main


class MeshPools:
    """The pools and indexes of every device of one engine's segment mesh, and the copies between them."""

    def __init__(self, engine, mesh):
        self.engine, self.mesh = engine, mesh
        self.devices = list(mesh.devices)
        home = mesh.home
        self.home_index = next((k for k, d in enumerate(self.devices) if d == home), None)
        self.pools: list[Pools] = [engine.pools if d == home else engine.pools.like(d) for d in self.devices]
        self.caches: list[SegmentCache] = [engine.cache if d == home else
                                           SegmentCache(None, on_drop=engine.hierarchy.dropped)
                                           for d in self.devices]
        # exact copies between devices (the tiers' compact forms are for host and disk)
        self.mover = tr.Mover(engine.pools, engine.max_prompt_tokens, compact=None, transfer_tol=None,
                              host_memory="pageable")
        self._sharded = NamedSharding(mesh.mesh, PartitionSpec(mesh.axis))
        self._gather: dict[int, Any] = {}
        self.stats = FetchStats()

    @property
    def size(self) -> int:
        return len(self.devices)

    def remote(self, k: int | None) -> bool:
        """Whether mesh device k's pools are not the engine's own."""
        return k is not None and k != self.home_index

    # The pools as one array per leaf -------------------------------------------------------------------------------
    def arrays(self):
        """Every device's pools as one PoolStack of global arrays (devices x rows, sharded over the mesh): the
        devices' own buffers, no copy."""
        per = []
        for k, pools in enumerate(self.pools):
            arrays = self.engine._pool_arrays() if pools is self.engine.pools else pools.arrays
            if arrays is None:
                raise RuntimeError(f"the entry pools of {self.devices[k]} were lost when a write into them failed; "
                                   f"restart the engine")
            per.append(jax.tree.leaves(arrays))
        treedef = jax.tree.structure(self.pools[0].arrays)
        leaves = []
        for j, first in enumerate(per[0]):
            shape = (self.size * first.shape[0],) + tuple(first.shape[1:])
            leaves.append(jax.make_array_from_single_device_arrays(shape, self._sharded, [p[j] for p in per]))
        return jax.tree.unflatten(treedef, leaves)

    def shapes(self):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct((self.size * a.shape[0],) + a.shape[1:], a.dtype,
                                                           sharding=self._sharded), self.pools[0].arrays)

    def adopt(self, arrays) -> None:
        """Take each device's shard of `arrays` (a program's output of `arrays()`'s form) as that device's pools."""
        leaves, treedef = jax.tree.flatten(arrays)
        order = {d: k for k, d in enumerate(self.devices)}
        per = [[None] * len(leaves) for _ in self.devices]
        for j, leaf in enumerate(leaves):
            for shard in leaf.addressable_shards:
                per[order[shard.device]][j] = shard.data
        for k, pools in enumerate(self.pools):
            pools.arrays = jax.tree.unflatten(treedef, per[k])

    def write(self, program):
        """(out, arrays) = program(arrays) over every device's pools (donated), under the home pools' lock; returns
        out. A program refused before it ran leaves the pools as they were."""
        home = self.engine.pools
        with home.lock:
            arrays = self.arrays()
            try:
                out, new = program(arrays)
            except Exception:
                for pools in self.pools:  # donated and lost: the engine refuses further requests
                    if pools.arrays is not None and any(a.is_deleted() for a in jax.tree.leaves(pools.arrays)):
                        pools.arrays = None
                raise
            self.adopt(new)
        return out

    # Entries -----------------------------------------------------------------------------------------------------
    def allocate(self, k: int, tokens: int):
        return self.pools[k].allocate(tokens, self.caches[k].evict_one)

    def free(self, entry: Entry) -> None:
        self.pools[entry.device].free(entry.slot, entry.rows)

    def holds(self, key: str) -> bool:
        """Whether another device's pools hold `key`."""
        return any(key in cache for k, cache in enumerate(self.caches) if self.remote(k))

    def lookup(self, key: str, tokens, pins) -> Entry | None:
        """The entry under `key` in another device's pools (pinned into `pins`), or None."""
        for k, cache in enumerate(self.caches):
            if self.remote(k):
                entry = cache.lookup(key, tokens, pins=pins)
                if entry is not None:
                    self.stats.remote_hits += 1
                    return entry
        return None

    def entries(self) -> list[Entry]:
        return [e for k, cache in enumerate(self.caches) if self.remote(k) for e in cache.entries()]

    def clear(self) -> None:
        for k, cache in enumerate(self.caches):
            if self.remote(k):
                cache.clear()
                self.pools[k].reset()

    # Copies to the home device -------------------------------------------------------------------------------------
    def _gather_program(self, bucket: int):
        program = self._gather.get(bucket)
        if program is None:
            body = functools.partial(_gather_local, gather=self.mover._gather_fn)
            spec = PartitionSpec(self.mesh.axis)
            mapped = jax.shard_map(body, mesh=self.mesh.mesh, in_specs=(spec, spec, spec), out_specs=spec,
                                   check_vma=False)
            rows = bucket * self.mover.page
            args = (self.shapes(), jax.ShapeDtypeStruct((self.size,), jnp.int32, sharding=self._sharded),
                    jax.ShapeDtypeStruct((self.size, rows), jnp.int32, sharding=self._sharded))
            program = jax.jit(mapped, out_shardings=self._sharded).lower(*args).compile()
            self._gather[bucket] = program
        return program

    def compile(self) -> int:
        """The gather programs over the mesh and the home device's scatter programs, one of each per bucket."""
        arrays = self.engine._pool_arrays()
        for bucket in self.mover.buckets:
            self._gather_program(bucket)
            self.mover._program("scatter", bucket, arrays)
        return 2 * len(self.mover.buckets)

    def _gather_round(self, arrays, entries: dict[int, Entry], bucket: int) -> dict[int, Any]:
        """One gather program over the mesh: device k's entry `entries[k]` out of its pools as one buffer of
        `bucket` pages, left on device k (devices without an entry gather slot 0 and row 0, nobody's)."""
        slots = np.zeros(self.size, np.int32)
        rows = np.zeros((self.size, bucket * self.mover.page), np.int32)
        for k, entry in entries.items():
            slots[k] = entry.slot
            rows[k, : entry.length] = entry.rows
        main = self._gather_program(bucket)(arrays, jax.device_put(slots, self._sharded),
                                            jax.device_put(rows, self._sharded))
        self.stats.gather_calls += 1
        shards = {s.device: s.data for s in main.addressable_shards}
        return {k: shards[self.devices[k]] for k in entries}

    def fetch(self, fetches: Sequence[Fetch]) -> list[tuple[Fetch, tr.Transfer]]:
        """Issue the copies of `fetches` to the home device (asynchronous); returns each with its transfer, which
        `scatter_programs` writes into the home pools. Entries go by bucket, each gather taking at most one entry
        per device, so every buffer is its entry's own bucket (`Mover.transfer`)."""
        groups: dict[tuple[int, int], list[Fetch]] = {}
        for f in fetches:
            groups.setdefault((self.mover.bucket(f.source.length), f.device), []).append(f)
        out = []
        with self.engine.pools.lock:
            arrays = self.arrays() if fetches else None
            for bucket in sorted({b for b, _ in groups}):
                queues = [fs for (b, _), fs in groups.items() if b == bucket]
                for r in range(max(map(len, queues))):
                    batch = {fs[r].device: fs[r] for fs in queues if r < len(fs)}
                    held = self._gather_round(arrays, {k: f.source for k, f in batch.items()}, bucket)
                    for k, f in batch.items():
                        staged = tr.Staged(bucket=bucket, main=held[k], owner=self.mover)
                        out.append((f, self.mover.transfer(staged, f.target.slot, f.target.rows)))
                        self.stats.fetches += 1
                        self.stats.fetched_bytes += int(held[k].nbytes)
        return out

    def pieces(self, entry: Entry) -> list[np.ndarray]:
        """An entry of another device as host arrays, per stored leaf in the pools' dtypes (`Mover.views`)."""
        bucket = self.mover.bucket(entry.length)
        with self.engine.pools.lock:
            held = self._gather_round(self.arrays(), {entry.device: entry}, bucket)[entry.device]
        staged = tr.Staged(bucket=bucket, main=np.asarray(jax.device_get(held)), owner=self.mover)
        return [np.array(a) for a in staged.views(entry.length)[0]]

    def scatter_programs(self, transfer: tr.Transfer):
        return self.mover.scatter_programs(self.engine._pool_arrays(), transfer)

    def as_dict(self) -> dict:
        return dict(entries_per_device=[len(c) for c in self.caches],
                    free_slots_per_device=[p.free_slots() for p in self.pools],
                    **dataclasses.asdict(self.stats))
