"""What a tier is worth: the recompute cost model (`CostModel`), the tiers' bandwidths (`Bandwidths`, measured at
warmup) and the eviction policy that weighs the two (`Policy`, and its device-tier side `DevicePolicy`).

Per entry, the time to bring it back from a tier (bytes over the tier's bandwidth; the disk adds the host copy)
against the time to recompute it. With `eviction="cost"`, an entry that is cheaper to recompute than to load is not
kept in that tier, and each tier evicts by GreedyDual-Size-Frequency: priority = clock + uses * (recompute - load) /
bytes, the lowest first, the clock rising to each evicted priority (recompute time saved per byte, aged).
`eviction="lru"`: least recently used first, every entry kept.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Sequence

import jax
import numpy as np

from hypic_jax.cache.tiers.pieces import payload_digests


# Bandwidths when not measured (bytes/s): host -> device (a PCIe 5 x16 link's sustained rate, about a third of its
# peak) and disk -> host including the payload checksum (an NVMe drive).
DEFAULT_HOST_BANDWIDTH = 20e9
DEFAULT_DISK_BANDWIDTH = 2e9
# device -> device between the engine's devices (the peer tier) when not measured: NVLink 4's sustained rate
DEFAULT_PEER_BANDWIDTH = 200e9
# Recompute cost when not calibrated (seconds): fixed, per token, per token squared. From the full prefill of the
# Qwen3.5-35B-A3B shape on one H200 (`bench/prefill.py`, bench/RESULTS.md).
DEFAULT_COST = (5e-3, 1.9e-5, 2.5e-11)

TIERS = ("device", "peer", "host", "disk")


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
