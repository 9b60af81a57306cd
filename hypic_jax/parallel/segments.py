"""The segment-parallel cold path of the engine: a request's missing segments prefilled over a 1-D mesh of devices
in one program.

`Engine(devices=...)` splits the missing segments of a request into one bin per device (`hypic_jax.parallel.policy`:
LPT on the per-segment cost model, or round-robin), packs each bin into one isolated layout of the token rung that
holds the largest bin, stacks the layouts along a leading `bins` axis and runs the engine's cold span program on
every device at once (`jax.shard_map`: each device runs exactly the single-device program on its own bin). Empty
bins run a one-token layout that records nothing.

In one process every device of the mesh has entry pools of its own (`hypic_jax.parallel.mesh_pools.MeshPools`): the engine
allocates each new entry in the pools of the device its bin runs on, and the cold program writes each bin's
records there, in place (the pools of every device are one sharded array per leaf, donated), so records never
leave the device that computed them on their way into the cache. The stitched (pic) program then runs on the home
device (where the engine's own pools live) after `MeshPools.fetch` copied the entries it needs there. The weights
are replicated on every device of the mesh.

Across processes (`hypic_jax.parallel.multihost`, one process per host) the mesh holds every process's devices. Each process
keeps its own pools on its own device and runs the same requests in the same order, so every process needs every
bin's records: the cold program returns them replicated (gathered over the mesh; its logits stay sharded, nothing
reads them) and each process commits all of them from its own copy into its home pools (the devices receive a
two-row stand-in of the pools, which an isolated layout never reads). An engine whose model is split over a model
mesh (`Engine(tensor_parallel=...)`) takes its records the same way, gathered, and commits them into its split
pools, where its stitched program reads them. The processes run the collective program on
the coordinator's bins (`agree`) after waiting for one another (`sync`), so a missing process fails a request with
a clear error instead of leaving the others inside the collective.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hypic_jax.stitch import layout as lay
from hypic_jax.parallel import policy as parallel

AXIS = "bins"

__all__ = ["SegmentMesh", "resolve_devices", "AXIS"]


def resolve_devices(devices, *, name: str = "devices", local: bool = False) -> list:
    """An integer N (the first N devices of the default backend; with `local`, of this process) or a sequence of
    jax devices. `name`: the argument the errors name."""
    if isinstance(devices, (int, np.integer)) and not isinstance(devices, bool):
        available = jax.local_devices() if local else jax.devices()
        if not 1 <= devices <= len(available):
            raise ValueError(f"{name}={devices}: this process has {len(available)} device(s)")
        return list(available[:devices])
    devices = list(devices)
    if not devices or len({d.id for d in devices}) != len(devices):
        raise ValueError(f"{name} must be a positive count or a non-empty sequence of distinct jax devices")
    return devices


class _ColdKey(NamedTuple):
    """The fields of `hypic_jax.engine.programs.ProgramKey` that the engine's layout capacities read."""

    kind: str
    tokens: int
    keys: int


def _stack(trees):
    return jax.tree.map(lambda *xs: np.stack(xs), *trees)


def _cold_bins(params, arrays, pools, *, arch, config, kernels):
    """One device's bin (leading axis 1): the cold span program on it, records and logits with the axis back."""
    one = jax.tree.map(lambda a: a[0], arrays)
    logits, writes, _ = arch.span_forward_arrays(params, config, one, pools, isolated=True, summaries=True,
                                                 want_decode=False, kernels=kernels)
    return jax.tree.map(lambda a: a[None], (logits, writes))


def _commit_bins(pools, parts):
    """Every bin's records (each with a leading axis of 1) written into the home pools (donated: in place)."""
    from hypic_jax import stitch

    for writes in parts:
        pools = pools.replace(stitch.apply_row_writes(pool, jax.tree.map(lambda a: a[0], w))
                              for pool, w in zip(pools.parts, writes))
    return pools


def _cold_in_place(params, arrays, pools, **options):
    """One device's bin with that device's own pools (donated): `_cold_bins`, its records written into those
    pools; the logits and the pools."""
    logits, writes = _cold_bins(params, arrays, pools, **options)
    return logits, _commit_bins(pools, [writes])


def _commit_stacked(pools, writes, *, bins: int):
    """Every bin's records (one tree with a leading axis of `bins`, the gathered records of a multiprocess mesh)
    written into the home pools (donated: in place), in bin order."""
    return _commit_bins(pools, [jax.tree.map(lambda a: a[k:k + 1], writes) for k in range(bins)])


class SegmentMesh:
    """The mesh, its programs (one cold and one commit program per token rung) and the policy of one engine."""

    def __init__(self, engine, devices, policy: str = "lpt", cost: parallel.SegmentCost | None = None, *,
                 compiler_options: dict | None = None):
        if policy not in parallel.POLICIES:
            raise ValueError(f"policy must be one of {parallel.POLICIES}, got {policy!r}")
        self.engine = engine
        self.compiler_options = dict(compiler_options or {})  # the engine's for its cold span program
        self.devices = resolve_devices(devices)
        self.policy = policy
        self.cost = cost or parallel.SegmentCost()
        self.axis = AXIS
        self.mesh = Mesh(np.asarray(self.devices, dtype=object), (AXIS,))
        # devices of other processes (`hypic_jax.parallel.multihost`): every process holds every record, so the records come
        # back replicated (gathered over the mesh) instead of staying with the bin that made them
        self.multiprocess = len({d.process_index for d in self.devices}) > 1
        if self.multiprocess and engine.placement is not None:
            raise ValueError("tensor parallelism (a model mesh) with a segment mesh across processes is not "
                             "supported: run one process, or keep the model on one device per process")
        # the records come back gathered and are committed into the engine's pools: across processes (above) and
        # where those pools span a model mesh (tensor parallelism), whose stitched program reads them there
        self.gathered = self.multiprocess or engine.placement is not None
        # set by `hypic_jax.parallel.multihost.Runner`: `agree(tag, value)` returns the coordinator's value, `sync(tag)` waits
        # for every process (or fails with a clear error); so the processes run the same programs on the same bins
        self.agree: Callable[[str, Any], Any] | None = None
        self.sync: Callable[[str], None] | None = None
        self.home = next(iter(jax.tree.leaves(engine.pools.arrays)[0].devices()))
        self._replicated = NamedSharding(self.mesh, PartitionSpec())
        self._sharded = NamedSharding(self.mesh, PartitionSpec(AXIS))
        self.params = jax.device_put(engine.params, self._replicated)
        self._cold: dict[int, Any] = {}
        self._commit: dict[int, Any] = {}
        self.last: dict | None = None
        self.pools = None  # a pool per device (`MeshPools`), in one process
        self.standin = None  # across processes: two rows per part (the part specs keep the real rows)
        if self.gathered:
            standin = jax.tree.map(lambda a: jnp.zeros((min(2, a.shape[0]),) + a.shape[1:], a.dtype),
                                   engine.pools.arrays)
            self.standin = jax.device_put(standin, self._replicated)
        else:
            from hypic_jax.parallel.mesh_pools import MeshPools

            self.pools = MeshPools(engine, self)

    @property
    def size(self) -> int:
        return len(self.devices)

    # Programs ---------------------------------------------------------------------------------------------------
    def _shapes(self, tree, sharding=None):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)

    def _stacked_dummy(self, rung: int):
        one = self.engine.dummy_layout(self._key(rung))
        return _stack([one] * self.size)

    def _key(self, rung: int):
        return _ColdKey("cold", rung, rung)

    def _build_cold(self, rung: int):
        engine = self.engine
        if self.pools is not None:  # each bin's records into its own device's pools, in the program
            body = functools.partial(_cold_in_place, arch=engine.arch, config=engine.config,
                                     kernels=engine.kernels)
            spec = PartitionSpec(AXIS)
            mapped = jax.shard_map(body, mesh=self.mesh, in_specs=(PartitionSpec(), spec, spec),
                                   out_specs=(spec, spec), check_vma=False)
            fn = jax.jit(mapped, in_shardings=(self._replicated, self._sharded, self._sharded),
                         out_shardings=(self._sharded, self._sharded), donate_argnums=2, compiler_options=self.compiler_options)
            return fn.lower(self._shapes(self.params), self._shapes(self._stacked_dummy(rung)),
                            self.pools.shapes()).compile()
        body = functools.partial(_cold_bins, arch=engine.arch, config=engine.config, kernels=engine.kernels)
        mapped = jax.shard_map(body, mesh=self.mesh, in_specs=(PartitionSpec(), PartitionSpec(AXIS), PartitionSpec()),
                               out_specs=PartitionSpec(AXIS), check_vma=False)
        # across processes every process commits every bin's records: those come back gathered (replicated)
        fn = jax.jit(mapped, in_shardings=(self._replicated, self._sharded, self._replicated),
                     out_shardings=(self._sharded, self._replicated), compiler_options=self.compiler_options)
        return fn.lower(self._shapes(self.params), self._shapes(self._stacked_dummy(rung)),
                        self._shapes(self.standin)).compile()

    def _build_commit(self, rung: int):
        engine = self.engine
        if self.pools is not None:
            return None  # the cold program commits
        # this process's copy of the gathered records, every bin on one leading axis
        stacked = jax.tree.map(lambda s: jax.ShapeDtypeStruct((self.size,) + s.shape, s.dtype),
                               engine.writes_shapes(rung))
        fn = engine.programs._jit(functools.partial(_commit_stacked, bins=self.size), donate_argnums=0,
                                  out_shardings=engine.programs.pool_shardings())
        return fn.lower(*engine.programs._abstract((engine.pool_shapes, stacked))).compile()

    def compile(self, rungs: Sequence[int]) -> float:
        """Compile the cold and commit programs of `rungs` and run each once on layouts that record nothing (the
        first run of a program pays one-time costs), and the copies between the devices' pools; returns the
        seconds."""
        start = time.perf_counter()
        for rung in rungs:
            cold, commit = self._program(rung)
            if self.sync is not None:  # a collective program: every process must be there
                self.sync("warmup")
            self._issue(cold, commit, jax.device_put(self._stacked_dummy(rung), self._sharded))
            self._wait()
        if self.pools is not None:
            self.pools.compile()
        return time.perf_counter() - start

    def _wait(self) -> None:
        """Until every pool the cold program writes is written."""
        jax.block_until_ready(self.engine.pools.arrays if self.pools is None else [p.arrays for p in self.pools.pools])

    def _issue(self, cold, commit, arrays):
        """Run the cold program on the stacked layouts `arrays` and commit its records (asynchronous)."""
        if self.pools is not None:
            return self.pools.write(lambda pools: cold(self.params, arrays, pools))
        logits, writes = cold(self.params, arrays, self.standin)
        parts = self._to_home(writes)
        with self.engine.pools.lock:
            self.engine._write_pools(commit, parts)
        return logits

    def _program(self, rung: int):
        if rung not in self._cold:
            programs = self.engine.programs
            if programs.serving:
                programs.compiling_while_serving(f"the segment-parallel cold program for {rung} tokens")
            started = time.perf_counter()
            self._cold[rung] = self._build_cold(rung)
            self._commit[rung] = self._build_commit(rung)
            programs.stats.compile_s += time.perf_counter() - started
        return self._cold[rung], self._commit[rung]

    # Running ----------------------------------------------------------------------------------------------------
    def plan(self, lengths: Sequence[int]) -> list[list[int]]:
        """Segment indices per bin (one bin per device) under the engine's policy."""
        return parallel.assign(self.policy, list(lengths), self.size, self.cost, self.engine.ladder.rungs)

    def bins(self, lengths: Sequence[int]) -> list[list[int]]:
        """`plan`'s bins, or across processes the coordinator's (cost models are timed per process and may
        differ)."""
        bins = self.plan(lengths)
        if self.agree is not None:
            bins = [list(map(int, b)) for b in self.agree("bins", bins)]
        return bins

    def run(self, spans: Sequence[lay.Span], tokens: Sequence[Sequence[int]], *, bins=None, timed: bool = False):
        """Prefill the isolated, recording `spans` (their tokens per span) over the mesh and commit their records:
        bin k's into the pools of device k (`pools`), or across processes every record into the home pools.
        `bins`: segment indices per device (default: `bins(lengths)`); a record's slot and rows must be in the
        pools of its bin's device. Returns the bins. With `timed`, waits and records predicted and measured
        times."""
        engine = self.engine
        lengths = [s.length for s in spans]
        if bins is None:
            bins = self.bins(lengths)
        largest = max(sum(lengths[i] for i in b) for b in bins)
        counts = [lay.count_pieces([spans[i] for i in b], isolated=True) for b in bins]
        capacity = engine.ladder.fit(largest, largest, max(p for p, _ in counts), max(r for _, r in counts),
                                     isolated=True)
        rung = capacity.tokens
        key = self._key(rung)
        layouts = []
        for b in bins:
            if b:
                layouts.append(lay.build([spans[i] for i in b], engine.capacity(key), isolated=True,
                                         tokens=np.concatenate([np.asarray(tokens[i], np.int32) for i in b]),
                                         summaries=True))
            else:
                layouts.append(engine.dummy_layout(key))
        cold, commit = self._program(rung)
        if self.sync is not None:  # a collective program: every process must be there
            self.sync("cold")
        start = time.perf_counter()
        self._issue(cold, commit, jax.device_put(_stack(layouts), self._sharded))
        if timed:
            self._wait()
            measured = time.perf_counter() - start
            predicted = [self.cost.bin_seconds([lengths[i] for i in b]) for b in bins]
            self.last = dict(rung=rung, bins=[[lengths[i] for i in b] for b in bins], predicted_s=predicted,
                             measured_s=measured)
        return bins

    def _to_home(self, writes):
        """The gathered records (every bin) as held on the home device (or copied there from another of this
        process's devices), or copied to every device of the engine's model mesh: the commit program's input."""
        placement = self.engine.placement

        def local(leaf):
            shards = leaf.addressable_shards
            if placement is not None:
                return jax.device_put(shards[0].data, placement)
            held = next((s.data for s in shards if s.device == self.home), None)
            return held if held is not None else jax.device_put(shards[0].data, self.home)

        return jax.tree.map(local, writes)

    def calibrate(self, rungs: Sequence[int]) -> None:
        """Time single-device cold prefills (recording nothing; the second run of each, the first pays one-time
        costs) of one segment filling each rung, one of half of it and four of a quarter of it, and fit the
        segment cost model."""
        engine = self.engine
        rng = np.random.default_rng(0)
        vocab = int(getattr(engine.config, "vocab_size", 2))
        quarters = min(4, engine.max_segments)
        shapes = sorted({shape for rung in rungs
                         for shape in ((rung,), (max(1, rung // 2),), (max(1, rung // 4),) * quarters)})
        for lengths in shapes:
            spans = [lay.Span(lay.FRESH, n) for n in lengths]
            ids = rng.integers(0, vocab, sum(lengths))
            for attempt in range(2):
                start = time.perf_counter()
                logits, _ = engine._run("cold", spans, ids)
                jax.block_until_ready(logits)
                if attempt:
                    self.cost.observe(lengths, time.perf_counter() - start)
        self.cost.calibrate()

    def as_dict(self) -> dict:
        return dict(devices=self.size, policy=self.policy, cost=self.cost.as_dict(), last=self.last,
                    pools=None if self.pools is None else self.pools.as_dict())
