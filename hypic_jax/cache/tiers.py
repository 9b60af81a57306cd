"""Cache tiers below the device pools: other devices' memory, host memory, then disk; the cost model and the
eviction policy.

An entry evicted from the device pools is demoted: its slot's pieces and its token rows are copied to the host in
one buffer (`Mover.gather_start`, `Mover.gather_finish`) and kept in the peer tier (that buffer moved to the memory
of one of the engine's other devices, `PeerStore`) or the host tier; the peer tier's evictions go to the host tier,
the host tier's to disk, one file per entry. A
hit in a lower tier promotes the entry back into the pools: its buffer goes to the device in one transfer, issued
while the request plans, and is written into the pools after the request's cold prefill was issued, so the copy
overlaps with it (`Mover.transfer`, `Mover.scatter_programs`). The copies are compiled programs, one pair per bucket
of whole pages (powers of two up to the longest entry), so no entry size compiles anything after warmup.

Peer and host tiers: exclusive (a promoted entry leaves them). Disk tier: inclusive (a promoted entry's file stays, so a
restarted process finds it; demoting an entry whose file exists writes nothing).

Disk files (`DiskStore`): `<dir>/<key[:2]>/<key>.seg`, written to a temporary file in the same folder, fsynced and
renamed into place, so a crash never leaves a partial entry under an entry's name. Layout:

    8 bytes   magic b"HYPICSEG"
    4 bytes   format version (little-endian uint32)
    4 bytes   header length H (little-endian uint32)
    H bytes   header, UTF-8 JSON: fingerprint, form (`compact_form`), key, kind, seam, tokens, arrays (dtype
              and shape of each piece), kept (the dense T heads stored, where some were left out), payload_bytes,
              digests (per piece, BLAKE2b-256 of each DIGEST_SLICE bytes of it, hex)
    32 bytes  BLAKE2b-256 of the version, length and header bytes
    payload   the pieces' bytes in order (C order)

Opening a folder scans the headers (the index is rebuilt from them, no separate index file): a file with a bad
magic, header checksum, size or name is corrupt (deleted, counted); one of another format version or model
fingerprint is foreign (left alone, counted, never read as a hit). A hit re-reads the whole file and checks the
header, the token ids and the payload checksum before anything is served; a failure deletes the file, counts it
and the request recomputes the entry.

Policy (`Policy`): per entry, the time to bring it back from a tier (bytes over the tier's bandwidth; the disk
adds the host copy) against the time to recompute it (`CostModel`). With `eviction="cost"`, an entry that is
cheaper to recompute than to load is not kept in that tier, and each tier evicts by GreedyDual-Size-Frequency:
priority = clock + uses * (recompute - load) / bytes, the lowest first, the clock rising to each evicted
priority (recompute time saved per byte, aged). `eviction="lru"`: least recently used first, every entry kept.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import os
import struct
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hypic_jax.core.summary import Summary

log = logging.getLogger("hypic_jax.cache.tiers")

MAGIC = b"HYPICSEG"
FORMAT_VERSION = 2
SUFFIX = ".seg"
# payload checksums: BLAKE2b-256 of each piece in slices of this many bytes, computed by a pool of threads (hashlib
# releases the interpreter lock over large buffers), so that checking a file runs near the drive's read rate
DIGEST_SLICE = 4 << 20
_DIGESTERS = concurrent.futures.ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1)),
                                                   thread_name_prefix="hypic-digest")


def _blake2b(view) -> str:
    return hashlib.blake2b(view, digest_size=32).hexdigest()


def payload_digests(views: Sequence[memoryview]) -> list[list[str]]:
    """Per piece (its bytes as a memoryview) the digests of its `DIGEST_SLICE`-byte slices, in parallel."""
    jobs = [[_DIGESTERS.submit(_blake2b, v[i: i + DIGEST_SLICE]) for i in range(0, len(v), DIGEST_SLICE)]
            for v in views]
    return [[job.result() for job in piece] for piece in jobs]


# where the host tier keeps entries (`Mover`): "pinned" (page-locked, where the device has such memory) or "pageable"
HOST_MEMORY = ("pinned", "pageable")

DROP = np.iinfo(np.int32).max // 2  # a pool row past every pool: padded scatter rows are dropped

# Bandwidths when not measured (bytes/s): host -> device (a PCIe 5 x16 link's sustained rate, about a third of its
# peak) and disk -> host including the payload checksum (an NVMe drive).
DEFAULT_HOST_BANDWIDTH = 20e9
DEFAULT_DISK_BANDWIDTH = 2e9
# device -> device between the engine's devices (the peer tier) when not measured: NVLink 4's sustained rate
DEFAULT_PEER_BANDWIDTH = 200e9
# Recompute cost when not calibrated (seconds): fixed, per token, per token squared. From the full prefill of the
# Qwen3.5-35B-A3B shape on one H200 (bench/RESULTS.md, prefill.py: 0.158 s at 8k, 0.653 s at 32k tokens).
DEFAULT_COST = (5e-3, 1.9e-5, 2.5e-11)

TIERS = ("device", "peer", "host", "disk")


# ----------------------------------------------------------------------------------------------------------------
# Cost model and policy


class CostModel:
    """Seconds to recompute an entry of n tokens: c0 + c1 n + c2 n^2 (linear work plus causal attention).

    `observe(lengths, seconds)` records one cold prefill (its segments' lengths and its wall time); once there are
    enough distinct samples, the constants are a non-negative least-squares fit over [1, sum n, sum n^2]. The
    samples are bounded (`max_samples`); `wants_samples()` says whether the engine should still time its cold
    prefills (timing one waits for it to finish)."""

    def __init__(self, constants: Sequence[float] = DEFAULT_COST, max_samples: int = 32):
        self.constants = tuple(float(c) for c in constants)
        self.calibrated = False
        self.max_samples = max_samples
        self._samples: list[tuple[float, float, float, float]] = []
        self._lock = threading.Lock()

    def seconds(self, tokens: int) -> float:
        c0, c1, c2 = self.constants
        return c0 + c1 * tokens + c2 * tokens * tokens

    def wants_samples(self) -> bool:
        return len(self._samples) < self.max_samples

    def observe(self, lengths: Sequence[int], seconds: float) -> None:
        lengths = np.asarray(lengths, np.float64)
        with self._lock:
            if len(self._samples) >= self.max_samples:
                return
            self._samples.append((1.0, float(lengths.sum()), float((lengths**2).sum()), float(seconds)))
            self._fit()

    def _fit(self) -> None:
        data = np.asarray(self._samples)
        x, y = data[:, :3], data[:, 3]
        if len({tuple(row) for row in x[:, 1:]}) < 3:
            return  # the three constants are not determined yet
        active = [0, 1, 2]
        while active:  # least squares, dropping any feature whose coefficient comes out negative
            scale = np.maximum(np.abs(x[:, active]).max(0), 1e-30)
            coef, *_ = np.linalg.lstsq(x[:, active] / scale, y, rcond=None)
            coef = coef / scale
            if np.all(coef >= 0):
                break
            active.pop(int(np.argmin(coef)))
        constants = [0.0, 0.0, 0.0]
        for index, value in zip(active, coef if active else ()):
            constants[index] = float(value)
        if sum(constants) > 0:
            self.constants = tuple(constants)
            self.calibrated = True

    def as_dict(self) -> dict:
        return dict(constants=list(self.constants), calibrated=self.calibrated, samples=len(self._samples))


@dataclasses.dataclass
class Bandwidths:
    """Bytes per second into the device from each lower tier (the disk's includes reading and checking)."""

    host: float = DEFAULT_HOST_BANDWIDTH
    disk: float = DEFAULT_DISK_BANDWIDTH
    peer: float = DEFAULT_PEER_BANDWIDTH
    measured: bool = False

    def load_s(self, tier: str, nbytes: int) -> float:
        if tier == "device":
            return 0.0
        if tier == "peer":
            return nbytes / self.peer
        seconds = nbytes / self.host
        return seconds + (nbytes / self.disk if tier == "disk" else 0.0)

    @classmethod
    def measure(cls, folder: str | Path | None, nbytes: int = 8 << 20, *, host: float | None = None,
                disk: float | None = None, staging=None, device=None, peers=(), peer: float | None = None
                ) -> "Bandwidths":
        """Time a host -> device copy (best of 3; from a buffer placed by `staging`, a sharding in pinned host
        memory, as promotions send, else from numpy) to `device` (a sharding; None: the default device), with
        `peers` (devices of the peer tier) a copy from the first of them to `device`, and, with a folder, a
        write + fsync, an uncached read and its checksum; `host`/`disk`/`peer` given are kept as they are."""
        data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)

        def best_copy(source) -> float:
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                jax.device_put(source, device).block_until_ready()
                best = min(best, time.perf_counter() - start)
            return nbytes / max(best, 1e-9)

        if host is None:
            host = best_copy(data if staging is None else jax.device_put(data, staging))
        if peer is None and peers:
            peer = best_copy(jax.device_put(data, peers[0]).block_until_ready())
        if disk is None and folder is not None:
            path = Path(folder) / f".bandwidth-{os.getpid()}-{uuid.uuid4().hex}"
            try:
                with open(path, "wb") as f:
                    f.write(data.tobytes())
                    f.flush()
                    os.fsync(f.fileno())
                start = time.perf_counter()
                with open(path, "rb") as f:
                    if hasattr(os, "posix_fadvise"):  # read from the drive, not the page cache
                        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                    payload_digests([memoryview(f.read())])
                disk = nbytes / max(time.perf_counter() - start, 1e-9)
            finally:
                path.unlink(missing_ok=True)
        return cls(host=float(host), disk=float(disk if disk is not None else DEFAULT_DISK_BANDWIDTH),
                   peer=float(peer if peer is not None else DEFAULT_PEER_BANDWIDTH), measured=True)


class Policy:
    """Ranks and admits entries in each tier (module docstring). kind: "cost" or "lru"."""

    def __init__(self, kind: str, cost: CostModel, bandwidths: Callable[[], Bandwidths]):
        if kind not in ("cost", "lru"):
            raise ValueError(f"eviction must be 'cost' or 'lru', got {kind!r}")
        self.kind, self.cost, self._bandwidths = kind, cost, bandwidths
        self.clock = {tier: 0.0 for tier in TIERS}
        self._tick = 0
        self._lock = threading.Lock()

    def saved_s(self, tier: str, tokens: int, nbytes: int) -> float:
        """Seconds a hit in `tier` saves against recomputing."""
        return self.cost.seconds(tokens) - self._bandwidths().load_s(tier, nbytes)

    def keeps(self, tier: str, tokens: int, nbytes: int) -> bool:
        return self.kind == "lru" or self.saved_s(tier, tokens, nbytes) > 0

    def rank(self, tier: str, tokens: int, nbytes: int, uses: int) -> float:
        with self._lock:
            self._tick += 1
            if self.kind == "lru":
                return float(self._tick)
            saved = max(self.saved_s(tier, tokens, nbytes), 0.0)
            return self.clock[tier] + max(uses, 1) * saved / max(nbytes, 1)

    def evicted(self, tier: str, priority: float) -> None:
        if self.kind == "cost":
            with self._lock:
                self.clock[tier] = max(self.clock[tier], priority)


class DevicePolicy:
    """The device tier's side of a `Policy`, in the protocol of `hypic_jax.cache.index.SegmentCache(policy=...)`."""

    def __init__(self, policy: Policy):
        self.policy = policy

    def rank(self, entry) -> float:
        return self.policy.rank("device", entry.length, entry.nbytes, entry.uses + 1)

    def evicted(self, entry) -> None:
        self.policy.evicted("device", entry.priority)


# ----------------------------------------------------------------------------------------------------------------
# Entries off the device


class Pieces:
    """One entry's content off the device: per pooled leaf (layer by layer, in `jax.tree.leaves` order) the slot's
    piece, or its token rows [length, ...] (`arrays`), and `kept`: leaf index -> the heads stored of a dense
    transfer leaf (increasing int16), whose array then holds those heads only (the others were negligible, `Mover`'s
    transfer_tol, and come back as zeros).

    An entry that came off the device holds its `Staged` buffers only (in pinned host memory where the device has
    it), which a promotion sends as they are; `arrays` and `kept` are then host copies made when asked for (a disk
    write). An entry read from disk holds its arrays."""

    def __init__(self, key: str, tokens: tuple[int, ...], kind: str, seam: int, arrays: list | None = None,
                 uses: int = 0, kept: dict | None = None, staged: "Staged | None" = None):
        if arrays is None and staged is None:
            raise ValueError("Pieces need their arrays or their staged buffers")
        self.key, self.tokens, self.kind, self.seam, self.uses = key, tokens, kind, seam, uses
        self.staged = staged
        self._arrays = arrays
        self._kept = dict(kept or {})

    @property
    def length(self) -> int:
        return len(self.tokens) - self.seam

    @property
    def arrays(self) -> list[np.ndarray]:
        return self._arrays if self._arrays is not None else self.staged.views(self.length)[0]

    @property
    def kept(self) -> dict[int, np.ndarray]:
        return self._kept if self._arrays is not None else self.staged.views(self.length)[1]

    @property
    def nbytes(self) -> int:
        if self.staged is not None:
            return self.staged.nbytes
        return int(sum(a.nbytes for a in self._arrays) + sum(k.nbytes for k in self._kept.values()))

    def __repr__(self) -> str:
        return f"Pieces(key={self.key[:12]}..., kind={self.kind}, seam={self.seam}, tokens={self.length}, " \
               f"nbytes={self.nbytes}, staged={self.staged is not None})"


def dense_transfer_leaves(tree) -> list[bool]:
    """Per leaf of a pool tree (`jax.tree.leaves` order): whether it is a dense summary's T [..., H, K, K]."""
    flags = []
    for item in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, Summary)):
        if isinstance(item, Summary):
            flags += [False] + ([item.form == "dense"] if item.transfer is not None else [])
        else:
            flags.append(False)
    return flags


def compact_form(dtype: str | None, transfer_tol: float | None) -> str:
    """The storage form's name, recorded in every disk file ("exact", "bfloat16", "bfloat16+t<=0.001", ...)."""
    form = dtype or "exact"
    return form if transfer_tol is None else f"{form}+t<={transfer_tol:g}"


@dataclasses.dataclass
class Staged:
    """An entry in the form its promotion sends (`Mover.stage`): one byte buffer of every piece at the static
    offsets of its bucket (token rows padded to the bucket), and the kept heads of the droppable T leaves as rows of
    one array, with the stored leaf and head each row belongs to (padded to a power of two with leaf -1). `main`
    and `heads` are numpy arrays, or jax arrays in pinned host memory (`Mover`'s host_sharding)."""

    bucket: int
    main: Any  # uint8 [Mover.layout(bucket)[1]]
    heads: Any = None  # [hb, *head shape] in the T leaves' stored dtype
    head_leaf: np.ndarray | None = None  # int32 [hb]
    head_id: np.ndarray | None = None  # int32 [hb]
    owner: "Mover | None" = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return int(self.main.nbytes + (0 if self.heads is None else self.heads.nbytes + 8 * len(self.head_id)))

    def views(self, length: int) -> tuple[list[np.ndarray], dict[int, np.ndarray]]:
        """Host arrays of the pieces of an entry of `length` tokens and its kept heads (`Mover.views`)."""
        return self.owner.views(self, length)


@dataclasses.dataclass
class Transfer:
    """A promotion in flight (`Mover.transfer`): its buffers sent to the device, the rows they go to."""

    bucket: int
    slot: np.ndarray  # int32 scalar
    rows: np.ndarray  # int32 [bucket pages * page], DROP past the entry
    main: Any  # the device copy of `Staged.main`
    heads: tuple | None  # (heads, rows [droppable outputs, hb], head ids), on the device


def _as_bytes(x):
    """A device array's bytes, flat uint8 (bitcast: no conversion)."""
    return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)


def _from_bytes(b, dtype, shape):
    """`_as_bytes`'s inverse for one piece."""
    dtype = jnp.dtype(dtype)
    return jax.lax.bitcast_convert_type(b.reshape(-1, dtype.itemsize), dtype).reshape(shape)


class Mover:
    """Compiled copies of one entry between the device pools and the host, in one buffer each way.

    An entry has one piece per pooled leaf and layer (hundreds at the 35B-A3B shape); copying each on its own costs
    a fixed overhead per array that dominates the copy at these sizes. So the gather program writes every piece's
    bytes into one uint8 buffer at static offsets (`Staged`), the tier keeps that buffer as the entry (`views`
    reads its pieces back out), and a promotion sends it back as one transfer (`transfer`) that a scatter program
    cuts up on the device. Token rows are padded to a bucket of whole pages (1, 2, 4, ... pages, up to the longest
    entry), so the programs are one gather and one scatter per bucket, compiled by `compile` (the engine's warmup).

    Compact forms (`bench/cache_tiers.py --forms` measures their bytes and deviation):
    - compact: a dtype name ("bfloat16") in which every float32 piece (the linear layers' T and S, float32 K/V and
      conv tails) leaves the device and is stored off it (the gather rounds them; the scatter widens them back to
      the pools' dtype); None keeps every piece as the pools hold it.
    - transfer_tol: a dense T's heads whose largest |entry| is at most this are not stored and come back as zeros.
      T_h multiplies the state entering the segment, so dropping it changes that head's state by at most
      K * transfer_tol * max|S_in|; a gated head's T shrinks with its accumulated decay (||T_h||_2 <= prod alpha_t
      for Gated DeltaNet), which underflows to exactly 0 over a few hundred tokens for fast-forgetting heads, so
      0 drops only exact zeros. None stores every head. The kept heads travel as rows of their own array (padded
      to a power of two of heads, one small program per size) and the scatter writes zeros for the rest on the
      device: the link carries only what is stored."""

    DEMOTE_COPY = "program"  # or "thread": see __init__

    def __init__(self, pools, max_tokens: int, compact: str | None = None, transfer_tol: float | None = None,
                 host_memory: str = "pinned"):
        stack = pools.arrays  # a layer_stack.PoolStack: per part of the layer plan, its layers' rows in blocks
        self.specs, self.plan = stack.specs, stack.plan
        self.page = pools.page
        if host_memory not in HOST_MEMORY:
            raise ValueError(f"host_memory must be one of {HOST_MEMORY}, got {host_memory!r}")
        self.device = device = next(iter(jax.tree.leaves(stack.parts)[0].devices()))  # the pools'
        self.device_sharding = jax.sharding.SingleDeviceSharding(device)
        # where demoted entries live: page-locked host memory, which the device reads and writes by DMA at the
        # link's rate and without the caller waiting (pageable memory goes through a staging copy), where the
        # device has it; else numpy arrays
        kinds = {m.kind for m in device.addressable_memories()}
        self.host_sharding = (jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
                              if host_memory == "pinned" and "pinned_host" in kinds else None)
        # who copies a demoted entry to pinned host memory: the gather program itself, its output placed there
        # ("program"), or the demotion thread after the gather wrote it to device memory ("thread"), so that the
        # request's path issues a device-only program (`bench/cache_tiers.py --demote-copy` times both)
        self.demote_copy = self.DEMOTE_COPY
        self.compact = compact
        if transfer_tol is not None and not (np.isfinite(transfer_tol) and transfer_tol >= 0):
            raise ValueError(f"transfer_tol must be None or a finite number >= 0, got {transfer_tol!r}")
        self.transfer_tol = transfer_tol
        # the device programs move per part and leaf all the part's layers at once ([members, ...] per slot,
        # [rows, members, ...] per token); off the device an entry is per layer and leaf, in layer order, so
        # its stored form does not depend on how the layers are grouped
        part_stored: list[list[str]] = []
        part_drop: list[list[bool]] = []
        output_part: list[int] = []
        for p, (spec, tree) in enumerate(zip(stack.specs, stack.parts)):
            names = []
            for leaf in jax.tree.leaves(tree):
                dtype = np.dtype(leaf.dtype)
                if compact and dtype == np.float32:
                    dtype = np.dtype(jnp.dtype(compact))
                names.append(dtype.name)
                output_part.append(p)
            part_stored.append(names)
            part_drop.append([flag and spec.kind == "slot" and transfer_tol is not None
                              for flag in dense_transfer_leaves(tree)])
        self._stored = tuple(name for names in part_stored for name in names)
        self._drop = tuple(flag for flags in part_drop for flag in flags)  # per device output
        self._output_part = tuple(output_part)
        first = np.cumsum([0] + [len(names) for names in part_stored])
        self.leaves: list[tuple[str, tuple[int, ...], np.dtype]] = []  # (kind, per-entry/per-token shape, stored as)
        self._order: list[tuple[int, int]] = []  # per stored leaf: (device output, member)
        for layer in range(stack.plan.layers):
            part, member = stack.plan.part(layer)
            spec = stack.specs[part]
            for j, leaf in enumerate(jax.tree.leaves(stack.parts[part])):
                self.leaves.append((spec.kind, tuple(leaf.shape[1:]), np.dtype(part_stored[part][j])))
                self._order.append((int(first[part]) + j, member))
        self.droppable = tuple(self._drop[i] for i, _ in self._order)  # per stored leaf
        self._output_kinds = {i: kind for (i, _), (kind, _, _) in zip(self._order, self.leaves)}
        # per stored leaf: its row in its part's pools is slot + this
        self._row_base = tuple(int(self.specs[self._output_part[i]].lead) * member for i, member in self._order)
        self._drop_outputs = tuple(i for i, flag in enumerate(self._drop) if flag)
        heads = {(self.leaves[j][1][1:], self.leaves[j][2]) for j, flag in enumerate(self.droppable) if flag}
        if len(heads) > 1:
            raise ValueError(f"transfer_tol needs the dense transfers of every layer in one shape and dtype, got "
                             f"{sorted(heads, key=str)}")
        self.head_shape, self.head_dtype = next(iter(heads)) if heads else ((), None)
        top = max(1, min(-(-max_tokens // pools.page), pools.pages - 1))
        self.buckets = self._powers(top)
        total_heads = sum(self.leaves[j][1][0] for j, flag in enumerate(self.droppable) if flag)
        self.head_buckets = self._powers(total_heads) if total_heads else ()
        self._layouts: dict[int, tuple[list[tuple[int, int]], int]] = {}
        self._gather: dict[int, Any] = {}
        self._scatter: dict[int, Any] = {}
        self._heads: dict[int, Any] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _powers(top: int) -> tuple[int, ...]:
        out, b = [], 1
        while b < top:
            out.append(b)
            b *= 2
        return tuple(out + [top])

    def bucket(self, tokens: int) -> int:
        pages = max(1, -(-tokens // self.page))
        for b in self.buckets:
            if b >= pages:
                return b
        raise ValueError(f"an entry of {tokens} tokens is longer than the largest bucket of {self.buckets[-1]} pages")

    def head_bucket(self, heads: int) -> int:
        return next(b for b in self.head_buckets if b >= heads)

    def layout(self, bucket: int) -> tuple[list[tuple[int, int]], int]:
        """Per stored leaf (offset, bytes) in a `Staged.main` buffer of `bucket` pages (0 bytes for a droppable
        leaf, whose heads travel apart), and the buffer's size."""
        with self._lock:
            found = self._layouts.get(bucket)
        if found is not None:
            return found
        out, at = [], 0
        for (kind, shape, dtype), drop in zip(self.leaves, self.droppable):
            n = 0 if drop else int(np.prod(shape)) * dtype.itemsize * (1 if kind == "slot" else bucket * self.page)
            out.append((at, n))
            at += n
        with self._lock:
            self._layouts[bucket] = (out, at)
        return out, at

    def adopt(self, donor: "Mover") -> None:
        """Use `donor`'s compiled programs (an engine of the same pool shapes and stored forms)."""
        if (donor.leaves, donor.droppable, donor.specs) != (self.leaves, self.droppable, self.specs):
            raise ValueError("the donor's pools or stored forms differ")
        if donor.demote_copy == self.demote_copy and donor.host_sharding == self.host_sharding:
            self._gather.update(donor._gather)  # their outputs' placement differs otherwise
        self._scatter.update(donor._scatter)
        self._heads.update(donor._heads)

    # Device programs --------------------------------------------------------------------------------------------
    @staticmethod
    def _rows(spec, slot, rows):
        """Rows of every layer of a part: [members] for a slot, [len(rows), members] for token rows."""
        base = spec.lead * jnp.arange(spec.members, dtype=jnp.int32)
        return slot + base if spec.kind == "slot" else rows[:, None] + base[None, :]

    def _gather_fn(self, arrays, slot, rows):
        """The entry as one byte buffer (`layout`), the droppable outputs' pieces as they are and their heads'
        largest |entry| [members, H] (measured before rounding)."""
        outputs, head_max = [], []
        for spec, tree in zip(self.specs, arrays.parts):
            index = Mover._rows(spec, slot, rows)
            for leaf in jax.tree.leaves(tree):
                piece = leaf[index]
                if self._drop[len(outputs)]:
                    head_max.append(jnp.max(jnp.abs(piece), axis=(-2, -1)).astype(jnp.float32))
                outputs.append(piece.astype(jnp.dtype(self._stored[len(outputs)])))
        parts = [_as_bytes(outputs[i][member] if self._output_kinds[i] == "slot" else outputs[i][:, member])
                 for (i, member), drop in zip(self._order, self.droppable) if not drop]
        main = jnp.concatenate(parts) if parts else jnp.zeros((0,), jnp.uint8)
        return main, [outputs[i] for i in self._drop_outputs], head_max

    def _scatter_fn(self, arrays, slot, rows, main, *, bucket):
        """`main` cut into the pieces at `layout(bucket)`'s offsets, written to the entry's rows (padded rows are
        DROP, past the pool: dropped); droppable leaves are written as zeros (`_heads_fn` adds the kept heads)."""
        offsets, _ = self.layout(bucket)
        pieces: dict[int, list] = {}
        for (i, member), (kind, shape, dtype), (at, n), drop in zip(self._order, self.leaves, offsets,
                                                                     self.droppable):
            full = shape if kind == "slot" else (bucket * self.page,) + shape
            piece = jnp.zeros(full, dtype) if drop else _from_bytes(main[at: at + n], dtype, full)
            pieces.setdefault(i, []).append((member, piece))
        new, out = [], 0
        for spec, tree in zip(self.specs, arrays.parts):
            index = Mover._rows(spec, slot, rows)
            leaves, treedef = jax.tree.flatten(tree)
            written = []
            for leaf in leaves:
                members = [p for _, p in sorted(pieces[out], key=lambda mp: mp[0])]
                stacked = jnp.stack(members, axis=0 if spec.kind == "slot" else 1)
                written.append(leaf.at[index].set(stacked.astype(leaf.dtype), mode="drop"))
                out += 1
            new.append(jax.tree.unflatten(treedef, written))
        return arrays.replace(new)

    def _heads_fn(self, arrays, heads, head_rows, head_ids):
        """The kept heads written into the droppable outputs: row r of `heads` goes to pool row head_rows[k, r]
        (DROP where it belongs to another output) of droppable output k, head head_ids[r]."""
        new, out, k = [], 0, 0
        for tree in arrays.parts:
            leaves, treedef = jax.tree.flatten(tree)
            written = []
            for leaf in leaves:
                if self._drop[out]:
                    leaf = leaf.at[head_rows[k], head_ids].set(heads.astype(leaf.dtype), mode="drop")
                    k += 1
                written.append(leaf)
                out += 1
            new.append(jax.tree.unflatten(treedef, written))
        return arrays.replace(new)

    def _program(self, which: str, bucket: int, arrays):
        table = {"gather": self._gather, "scatter": self._scatter, "heads": self._heads}[which]
        with self._lock:
            program = table.get(bucket)
            if program is not None:
                return program
        import functools

        shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), arrays)
        slot = jax.ShapeDtypeStruct((), jnp.int32)
        if which == "gather":  # its outputs land in host memory when pinned (the program's own copy out)
            rows = jax.ShapeDtypeStruct((bucket * self.page,), jnp.int32)
            try:
                out = self.host_sharding if self.demote_copy == "program" else None
                program = jax.jit(self._gather_fn, out_shardings=out).lower(shapes, slot, rows).compile()
            except Exception as error:  # noqa: BLE001  (a backend without host outputs: numpy on the host instead)
                if self.host_sharding is None:
                    raise
                log.warning("the host tier cannot keep entries in pinned host memory here (%s: %s); it keeps them "
                            "in pageable memory", type(error).__name__, str(error)[:300])
                with self._lock:  # programs that wrote to pinned memory are not used again
                    self.host_sharding = None
                    self._gather.clear()
                program = jax.jit(self._gather_fn).lower(shapes, slot, rows).compile()
        elif which == "scatter":
            rows = jax.ShapeDtypeStruct((bucket * self.page,), jnp.int32)
            main = jax.ShapeDtypeStruct((self.layout(bucket)[1],), jnp.uint8)
            program = jax.jit(functools.partial(self._scatter_fn, bucket=bucket), donate_argnums=0).lower(
                shapes, slot, rows, main).compile()
        else:  # bucket: rows of kept heads
            heads = jax.ShapeDtypeStruct((bucket, *self.head_shape), self.head_dtype)
            head_rows = jax.ShapeDtypeStruct((len(self._drop_outputs), bucket), jnp.int32)
            ids = jax.ShapeDtypeStruct((bucket,), jnp.int32)
            program = jax.jit(self._heads_fn, donate_argnums=0).lower(shapes, heads, head_rows, ids).compile()
        with self._lock:
            table[bucket] = program
        return program

    def compile(self, arrays) -> int:
        for bucket in self.buckets:
            self._program("gather", bucket, arrays)
            self._program("scatter", bucket, arrays)
        for bucket in self.head_buckets:
            self._program("heads", bucket, arrays)
        return 2 * len(self.buckets) + len(self.head_buckets)

    @property
    def compiled(self) -> int:
        return len(self._gather) + len(self._scatter) + len(self._heads)

    # Demotion: pools -> host ------------------------------------------------------------------------------------
    def gather_start(self, arrays, slot: int, rows):
        """Issue the entry's copy out of the pools into device arrays of its own and return at once (the transfer
        to the host is `gather_finish`'s: on a GPU, starting it here would block the caller for the whole copy): the
        pools' rows may be overwritten by any program issued after this one."""
        rows = np.asarray(rows, np.int32)
        bucket = self.bucket(len(rows))
        padded = np.zeros(bucket * self.page, np.int32)  # padded reads hit row 0, which no entry owns
        padded[: len(rows)] = rows
        return self._program("gather", bucket, arrays)(arrays, np.asarray(slot, np.int32), padded), len(rows)

    def gather_finish(self, started) -> Staged:
        """`gather`'s result from `gather_start`'s handle (waits for the transfer)."""
        (main, dense, head_max), length = started
        if self.host_sharding is None:
            main = np.asarray(jax.device_get(main))
        else:  # in pinned host memory once the program is done, or copied there now
            if main.sharding.memory_kind != self.host_sharding.memory_kind:
                main = jax.device_put(main, self.host_sharding)
            main.block_until_ready()
        staged = Staged(bucket=self.bucket(length), main=main, owner=self)
        if self._drop_outputs:
            dense, head_max = jax.device_get((dense, head_max))
            dense = dict(zip(self._drop_outputs, dense))
            maxima = dict(zip(self._drop_outputs, head_max))
            rows, leaf_of, ids = [], [], []
            for j, (i, member) in enumerate(self._order):
                if self.droppable[j]:
                    heads = np.flatnonzero(np.asarray(maxima[i][member]) > self.transfer_tol)
                    rows.append(np.asarray(dense[i][member])[heads])
                    leaf_of += [j] * len(heads)
                    ids += heads.tolist()
            self._stage_heads(staged, np.concatenate(rows), leaf_of, ids)
        return staged

    def _stage_heads(self, staged: Staged, rows: np.ndarray, leaf_of, ids) -> None:
        n = len(leaf_of)
        if not n:
            return
        hb = self.head_bucket(n)
        heads = np.zeros((hb, *self.head_shape), self.head_dtype)
        heads[:n] = rows
        staged.heads = heads if self.host_sharding is None else jax.device_put(heads, self.host_sharding)
        staged.head_leaf = np.full(hb, -1, np.int32)
        staged.head_leaf[:n] = leaf_of
        staged.head_id = np.zeros(hb, np.int32)
        staged.head_id[:n] = ids

    def views(self, staged: Staged, length: int) -> tuple[list[np.ndarray], dict[int, np.ndarray]]:
        """The pieces of a staged entry of `length` tokens as views of its buffers, and its kept heads."""
        offsets, size = self.layout(staged.bucket)
        if staged.main.shape != (size,) or staged.main.dtype != np.uint8:
            raise ValueError(f"a staged entry of bucket {staged.bucket} needs {size} bytes, got {staged.main.shape}")
        main = np.asarray(staged.main)  # a host copy where the buffer is a jax array in pinned memory
        all_heads = None if staged.heads is None else np.asarray(staged.heads)
        arrays, kept = [], {}
        leaf_of = staged.head_leaf if staged.heads is not None else np.zeros(0, np.int32)
        for j, ((kind, shape, dtype), (at, n)) in enumerate(zip(self.leaves, offsets)):
            if self.droppable[j]:
                take = np.flatnonzero(leaf_of == j)
                lo, hi = (int(take[0]), int(take[-1]) + 1) if len(take) else (0, 0)
                arrays.append(all_heads[lo:hi] if len(take) else np.zeros((0, *shape[1:]), dtype))
                kept[j] = (staged.head_id[lo:hi] if len(take) else np.zeros(0)).astype(np.int16)
                continue
            full = shape if kind == "slot" else (staged.bucket * self.page,) + shape
            piece = np.frombuffer(main, dtype, int(np.prod(full)), at).reshape(full)
            arrays.append(piece if kind == "slot" else piece[:length])
        return arrays, kept

    def moved(self, staged: Staged, where=None) -> Staged:
        """`staged` with its buffers on another device (`where`, a jax device: the peer tier) or, with None, in the
        host tier's memory (pinned where the device has it, else numpy). The copies are issued, not awaited."""
        if where is not None:
            target = jax.sharding.SingleDeviceSharding(where)
            move = lambda a: jax.device_put(a, target)  # noqa: E731
        elif self.host_sharding is not None:
            move = lambda a: jax.device_put(a, self.host_sharding)  # noqa: E731
        else:
            move = lambda a: np.asarray(jax.device_get(a))  # noqa: E731
        return dataclasses.replace(staged, main=move(staged.main),
                                   heads=None if staged.heads is None else move(staged.heads))

    # Promotion: host -> pools -----------------------------------------------------------------------------------
    def stage(self, pieces: "Pieces") -> Staged:
        """`pieces` in the form a promotion sends (the demotion's own buffers when it has them)."""
        if pieces.staged is not None:
            return pieces.staged
        bucket = self.bucket(pieces.length)
        offsets, size = self.layout(bucket)
        main = np.zeros(size, np.uint8)
        rows, leaf_of, ids = [], [], []
        for j, (piece, (kind, shape, dtype), (at, n)) in enumerate(zip(pieces.arrays, self.leaves, offsets)):
            want = shape if kind == "slot" else (pieces.length,) + shape
            if self.droppable[j]:
                heads = (np.asarray(pieces.kept[j], np.int64) if j in pieces.kept
                         else np.arange(shape[0]))
                if piece.dtype != dtype or piece.shape != (len(heads), *shape[1:]):
                    raise ValueError(f"piece {j}: {piece.dtype}{list(piece.shape)} is not this engine's stored form")
                rows.append(piece)
                leaf_of += [j] * len(heads)
                ids += heads.tolist()
                continue
            if piece.dtype != dtype or piece.shape != want:
                raise ValueError(f"piece {j}: {piece.dtype}{list(piece.shape)}, this engine stores "
                                 f"{dtype}{list(want)}")
            raw = _raw(np.ascontiguousarray(piece))
            main[at: at + raw.nbytes] = raw
        staged = Staged(bucket=bucket, main=main, owner=self)
        if rows:
            self._stage_heads(staged, np.concatenate(rows), leaf_of, ids)
        return staged

    def transfer(self, staged: Staged, slot: int, rows) -> Transfer:
        """Start sending a staged entry to the device, bound for `slot` and `rows` (asynchronous: returns before
        the copy is done; `scatter_programs` writes it into the pools)."""
        rows = np.asarray(rows, np.int32)
        if self.bucket(len(rows)) != staged.bucket:
            raise ValueError(f"an entry of {len(rows)} rows does not fit a staged entry of bucket {staged.bucket}")
        padded = np.full(staged.bucket * self.page, DROP, np.int32)
        padded[: len(rows)] = rows
        slot = np.asarray(slot, np.int32)
        host = [staged.main]
        if staged.heads is not None:
            head_rows = np.full((len(self._drop_outputs), len(staged.heads)), DROP, np.int32)
            column = {i: k for k, i in enumerate(self._drop_outputs)}
            for r, j in enumerate(staged.head_leaf.tolist()):
                if j >= 0:
                    head_rows[column[self._order[j][0]], r] = int(slot) + self._row_base[j]
            host += [staged.heads, head_rows, staged.head_id]
        device = jax.device_put(host, self.device_sharding)  # one call: every buffer's copy is issued at once
        return Transfer(bucket=staged.bucket, slot=slot, rows=padded, main=device[0],
                        heads=tuple(device[1:]) if staged.heads is not None else None)

    def scatter_programs(self, arrays, transfer: Transfer) -> list[tuple[Any, tuple]]:
        """(program, arguments after the pools) per program that writes `transfer` into the pools, in order; each
        donates the pools (`Engine._write_pools`)."""
        out = [(self._program("scatter", transfer.bucket, arrays), (transfer.slot, transfer.rows, transfer.main))]
        if transfer.heads is not None:
            out.append((self._program("heads", len(transfer.heads[0]), arrays), transfer.heads))
        return out


# ----------------------------------------------------------------------------------------------------------------
# Stores


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

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class _Store:
    """Entries of one tier under a byte budget, ranked by the policy."""

    tier = ""

    def __init__(self, capacity_bytes: int | None, policy: Policy):
        self.capacity_bytes = capacity_bytes
        self.policy = policy
        self.index: dict[str, _Meta] = {}
        self.stats = TierStats(capacity_bytes=capacity_bytes)
        self.lock = threading.RLock()

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


class DiskStore(_Store):
    """One file per entry under `folder` (module docstring); `layout` is the engine's `pool_layout`."""

    tier = "disk"

    def __init__(self, folder, capacity_bytes: int | None, policy: Policy, *, fingerprint: str, leaves,
                 form: str = "exact", droppable=None):
        super().__init__(capacity_bytes, policy)
        self.folder = Path(folder).expanduser().resolve()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as error:  # a file, or under one: say which argument, not only errno's words
            raise ValueError(f"disk_cache_dir: cannot use {str(self.folder)!r} as a folder: {error}") from error
        self.fingerprint = fingerprint
        self.form = form
        self._leaves = list(leaves)  # `Mover.leaves`
        self._writing: set[str] = set()  # keys whose files are being written
        self._droppable = tuple(droppable) if droppable is not None else (False,) * len(self._leaves)
        self.scan()

    # Format ---------------------------------------------------------------------------------------------------------
    def path_of(self, key: str) -> Path:
        return self.folder / key[:2] / f"{key}{SUFFIX}"

    def _signature(self, length: int, kept: dict[int, list[int]]) -> list[list]:
        """The pieces' [dtype, shape] an entry of `length` tokens must have; a leaf in `kept` holds those heads."""
        out = []
        for j, (kind, shape, dtype) in enumerate(self._leaves):
            if j in kept:
                shape = (len(kept[j]), *shape[1:])
            out.append([dtype.str if dtype.kind != "V" else dtype.name,
                        list(shape if kind == "slot" else (length, *shape))])
        return out

    def _kept(self, header: dict) -> dict[int, list[int]] | None:
        """The header's kept heads per leaf, None when they are not a valid subset for this store's leaves."""
        kept = {int(j): [int(h) for h in heads] for j, heads in header.get("kept", {}).items()}
        for j, heads in kept.items():
            if not (0 <= j < len(self._leaves) and self._droppable[j]):
                return None
            if any(b <= a for a, b in zip(heads, heads[1:])) or (heads and not 0 <= heads[0] <= heads[-1] <
                                                                  self._leaves[j][1][0]):
                return None
        return kept

    def _encode(self, pieces: Pieces) -> tuple[bytes, list[np.ndarray]]:
        arrays = [np.ascontiguousarray(a) for a in pieces.arrays]
        digests = payload_digests([memoryview(_raw(a)) for a in arrays])
        header = json.dumps(dict(
            fingerprint=self.fingerprint, form=self.form, key=pieces.key, kind=pieces.kind, seam=int(pieces.seam),
            tokens=[int(t) for t in pieces.tokens],
            arrays=[[a.dtype.str if a.dtype.kind != "V" else a.dtype.name, list(a.shape)] for a in arrays],
            kept={str(j): [int(h) for h in heads] for j, heads in sorted(pieces.kept.items())},
            payload_bytes=int(sum(a.nbytes for a in arrays)), digests=digests),
            separators=(",", ":")).encode()
        head = struct.pack("<II", FORMAT_VERSION, len(header)) + header
        return MAGIC + head + hashlib.blake2b(head, digest_size=32).digest(), arrays

    @staticmethod
    def _read_header(f, size: int) -> tuple[str, dict | None, int]:
        """("ok" | "corrupt" | "foreign", header, payload offset) from an open file of `size` bytes."""
        start = f.read(16)
        if len(start) < 16 or start[:8] != MAGIC:
            return "corrupt", None, 0
        version, length = struct.unpack("<II", start[8:16])
        if version != FORMAT_VERSION:
            return "foreign", None, 0
        if 16 + length + 32 > size:
            return "corrupt", None, 0
        header = f.read(length)
        checksum = f.read(32)
        if hashlib.blake2b(start[8:16] + header, digest_size=32).digest() != checksum:
            return "corrupt", None, 0
        try:
            meta = json.loads(header)
        except ValueError:
            return "corrupt", None, 0
        return "ok", meta, 16 + length + 32

    def _check(self, path: Path, f, size: int) -> tuple[str, dict | None, int]:
        state, header, offset = self._read_header(f, size)
        if state != "ok":
            return state, None, 0
        if header.get("fingerprint") != self.fingerprint or header.get("form") != self.form:
            return "foreign", None, 0  # another model, or another storage form of this one: never served
        try:
            length = len(header["tokens"]) - int(header["seam"])
            kept = self._kept(header)
            ok = (kept is not None and header["key"] == path.name[: -len(SUFFIX)]
                  and header["arrays"] == self._signature(length, kept)
                  and offset + int(header["payload_bytes"]) == size)
        except (KeyError, TypeError, ValueError):
            ok = False
        return ("ok", header, offset) if ok else ("corrupt", None, 0)

    def _discard(self, path: Path, why: str) -> None:
        log.warning("disk cache: %s file %s removed", why, path)
        self.stats.corrupt += 1
        path.unlink(missing_ok=True)

    # Index ----------------------------------------------------------------------------------------------------------
    def scan(self) -> None:
        """Rebuild the index from the folder's headers (payload checksums are checked when a file is read)."""
        with self.lock:
            self.index.clear()
            self.stats.bytes = 0
            found = []
            for path in self.folder.glob(f"*/*{SUFFIX}"):
                try:
                    size = path.stat().st_size
                    with open(path, "rb") as f:
                        state, header, _ = self._check(path, f, size)
                except OSError:
                    continue
                if state == "corrupt":
                    self._discard(path, "corrupt or truncated")
                elif state == "foreign":
                    self.stats.foreign += 1
                else:
                    found.append((path.stat().st_mtime, header["key"], len(header["tokens"]) - header["seam"],
                                  size, path))
            for _, key, tokens, size, path in sorted(found):  # oldest first: LRU order across a restart
                self._add(key, _Meta(tokens, size, 1, path=path))
            self._clean_temporaries()

    def _clean_temporaries(self, age_s: float = 3600.0) -> None:
        """Temporary files of writes that never finished (a crash); a recent one may be another process's."""
        now = time.time()
        for path in self.folder.glob("*/.tmp-*"):
            try:
                if now - path.stat().st_mtime > age_s:
                    path.unlink()
            except OSError:
                pass

    # Reads and writes -----------------------------------------------------------------------------------------------
    def take(self, key: str, tokens: tuple[int, ...]) -> Pieces | None:
        """The entry under `key` if its file is intact and holds `tokens` (the file stays)."""
        with self.lock:
            meta = self.index.get(key)
            if meta is None:
                return None
            path = meta.path
            try:
                with open(path, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    state, header, offset = self._check(path, f, size)
                    if state != "ok":
                        self._pop(key)
                        if state == "corrupt":
                            self._discard(path, "corrupt or truncated")
                        else:
                            self.stats.foreign += 1
                        return None
                    if tuple(header["tokens"]) != tokens:
                        return None  # a digest collision: never serve it
                    payload = f.read(size - offset)
            except OSError:
                self._pop(key)
                return None
            layout, at = [], 0  # (dtype, shape, offset) of each piece in the payload
            for dtype_name, shape in header["arrays"]:
                dtype = np.dtype(jnp.dtype(dtype_name))
                layout.append((dtype, shape, at))
                at += int(np.prod(shape)) * dtype.itemsize
            view = memoryview(payload)
            if (len(payload) != header["payload_bytes"] or at != len(payload) or payload_digests(
                    [view[o: o + int(np.prod(sh)) * dt.itemsize] for dt, sh, o in layout]) != header.get("digests")):
                self._pop(key)
                self._discard(path, "corrupt")
                return None
            arrays = [np.frombuffer(payload, dt, int(np.prod(sh)), o).reshape(sh) for dt, sh, o in layout]
            meta.uses += 1
            meta.priority = self.policy.rank(self.tier, meta.tokens, meta.nbytes, meta.uses)
            self.index[key] = self.index.pop(key)  # most recently used
            self.stats.hits += 1
            kept = {j: np.asarray(heads, np.int16) for j, heads in self._kept(header).items()}
            return Pieces(key=key, tokens=tokens, kind=header["kind"], seam=int(header["seam"]), arrays=arrays,
                          uses=meta.uses, kept=kept)

    def put(self, pieces: Pieces) -> bool:
        """Write `pieces` (atomically) unless its file exists; False when the write failed. The file is encoded and
        written outside the store's lock, so lookups of other entries do not wait for the drive."""
        with self.lock:
            if pieces.key in self.index or pieces.key in self._writing:
                return True
            self._writing.add(pieces.key)
        path = self.path_of(pieces.key)
        tmp = path.parent / f".tmp-{pieces.key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            head, arrays = self._encode(pieces)
            size = len(head) + sum(a.nbytes for a in arrays)
            with self.lock:
                for _, meta in self._victims(size):
                    meta.path.unlink(missing_ok=True)
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(head)
                for a in arrays:
                    f.write(_raw(a))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            _fsync_dir(path.parent)
        except OSError as error:
            log.warning("disk cache: writing %s failed: %s", path, error)
            tmp.unlink(missing_ok=True)
            with self.lock:
                self.stats.write_errors += 1
                self._writing.discard(pieces.key)
            return False
        with self.lock:
            self._writing.discard(pieces.key)
            self._add(pieces.key, _Meta(pieces.length, size, pieces.uses, path=path))
            self.stats.puts += 1
        return True

    def clear(self) -> None:
        """Delete this model's files (foreign files stay)."""
        with self.lock:
            for meta in self.index.values():
                meta.path.unlink(missing_ok=True)
            self.index.clear()
            self.stats.bytes = self.stats.entries = 0


def _raw(a: np.ndarray) -> np.ndarray:
    """The bytes of a contiguous array as uint8 (the buffer protocol refuses bfloat16 itself)."""
    return a.reshape(-1).view(np.uint8)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------------------------------------------
# The tiers together


class Tiers:
    """Host and disk tiers of one engine: where a demoted entry goes, where a missing one is found.

    host_bytes: the host tier's budget (0: off). disk_dir: the disk tier's folder (None: off), disk_bytes its
    budget (None: unbounded; 0: off). policy: a `Policy` (shared with the device tier). leaves: `Mover.leaves`;
    form: `compact_form`'s name of how pieces are stored (a disk file of another form is foreign); droppable:
    `Mover.droppable`."""

    def __init__(self, *, leaves, fingerprint: str, policy: Policy, host_bytes: int = 0, disk_dir=None,
                 disk_bytes: int | None = None, form: str = "exact", droppable=None, peers=(), peer_bytes: int = 0,
                 mover: "Mover | None" = None):
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
            if self.host.fits(pieces.nbytes) and self.policy.keeps("host", pieces.length, pieces.nbytes):
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
            peer = None
            if self.peers:
                per = [p.stats.as_dict() for p in self.peers]
                peer = {k: sum(d[k] for d in per) for k in per[0] if k != "capacity_bytes"}
                peer.update(capacity_bytes=sum(d["capacity_bytes"] for d in per), devices=len(per),
                            entries_per_device=[d["entries"] for d in per])
            return dict(peer=peer, host=self.host.stats.as_dict() if self.host is not None else None,
                        disk=self.disk.stats.as_dict() if self.disk is not None else None,
                        promotions=dict(self.promotions), demotions=self.demotions)


__all__ = ["Bandwidths", "CostModel", "DevicePolicy", "DiskStore", "HostStore", "Mover", "PeerStore", "Pieces",
           "Policy", "Staged", "Tiers", "Transfer", "FORMAT_VERSION", "DEFAULT_COST", "DEFAULT_HOST_BANDWIDTH",
           "DEFAULT_DISK_BANDWIDTH", "DEFAULT_PEER_BANDWIDTH",
           "compact_form", "dense_transfer_leaves", "payload_digests"]
