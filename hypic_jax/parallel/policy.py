"""Segment parallelism: a cost model per segment and the policies that split a request's missing segments into one
bin per device.

The cold prefill of a segment of n tokens costs about `a + b n + c n^2` seconds: a fixed part (a program's pieces
and records), the per-token work of every layer (projections, MLPs, the linear layers' chunked core) and the
attention layers' causal quadratic term. The bins run as one program over the devices, so a request waits for its
slowest bin: the policy minimises the makespan, the largest bin's predicted cost.

* `lpt` (longest processing time first): segments in decreasing cost, each onto the currently least-loaded bin;
  Graham's bound puts its makespan within 4/3 of the optimum, and much closer on many small segments.
* `round_robin`: segment i onto bin i mod devices, in request order; the comparison policy.

Rungs. A mesh program runs every bin at the token rung of its largest bin, so a bin a few tokens past a rung costs
the next rung on every device (`bench/segment_parallel.py --small` times bins on either side of a rung;
bench/RESULTS.md). Given the rungs, `lpt` therefore repacks when its
bins' largest token count lands past a rung that some split could stay under: for each smaller rung (from the
smallest any split could fit), LPT with that rung as every bin's token capacity, then first-fit decreasing by
tokens; the first packing that fits is taken.

Pure Python: nothing here touches a device.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Callable, Sequence

# Seconds for one segment before any measurement: of the order of a small model's cold prefill on one accelerator
# (20 us per program piece, 2 us per token, 1e-10 s per token pair). Only their ratios steer the policies; the
# absolute values matter once predictions are compared with measurements, which is what `calibrate` is for.
DEFAULT_SEGMENT_COST = (2e-5, 2e-6, 1e-10)

POLICIES = ("lpt", "rr")

__all__ = ["SegmentCost", "DEFAULT_SEGMENT_COST", "POLICIES", "lpt", "round_robin", "assign", "makespan",
           "lower_bound"]


@dataclasses.dataclass
class SegmentCost:
    """Predicted seconds of a segment's cold prefill: a + b n + c n^2 (all non-negative).

    `observe(lengths, seconds)` records one measured cold prefill of a bin of segments (its time is the sum of its
    segments' costs: features [count, sum n, sum n^2]); `calibrate()` refits the constants by non-negative least
    squares once the samples determine them."""

    a: float = DEFAULT_SEGMENT_COST[0]
    b: float = DEFAULT_SEGMENT_COST[1]
    c: float = DEFAULT_SEGMENT_COST[2]
    calibrated: bool = False
    max_samples: int = 64

    def __post_init__(self):
        if min(self.a, self.b, self.c) < 0:
            raise ValueError(f"segment cost constants must be >= 0, got {(self.a, self.b, self.c)}")
        self._samples: list[tuple[float, float, float, float]] = []
        self._lock = threading.Lock()

    def __call__(self, n: int) -> float:
        return self.a + self.b * n + self.c * n * n

    def bin_seconds(self, lengths: Sequence[int]) -> float:
        return sum(self(n) for n in lengths)

    def observe(self, lengths: Sequence[int], seconds: float) -> None:
        with self._lock:
            if len(self._samples) < self.max_samples:
                self._samples.append((float(len(lengths)), float(sum(lengths)), float(sum(n * n for n in lengths)),
                                      float(seconds)))

    def samples(self) -> int:
        return len(self._samples)

    def calibrate(self) -> bool:
        """Refit (a, b, c) from the samples; False (constants kept) while fewer than three distinct samples."""
        import numpy as np

        with self._lock:
            data = np.asarray(self._samples, np.float64)
        if len(data) == 0 or len({tuple(row) for row in data[:, :3]}) < 3:
            return False
        x, y = data[:, :3], data[:, 3]
        active = [0, 1, 2]
        coef = np.zeros(3)
        while active:  # least squares, dropping any feature whose coefficient comes out negative
            scale = np.maximum(np.abs(x[:, active]).max(0), 1e-30)
            fit, *_ = np.linalg.lstsq(x[:, active] / scale, y, rcond=None)
            fit = fit / scale
            if np.all(fit >= 0):
                coef[:] = 0
                coef[active] = fit
                break
            active = [f for f, v in zip(active, fit) if v >= 0]
        else:
            return False
        self.a, self.b, self.c = (float(v) for v in coef)
        self.calibrated = True
        return True

    def as_dict(self) -> dict:
        return dict(a=self.a, b=self.b, c=self.c, calibrated=self.calibrated, samples=self.samples())


def _check(lengths: Sequence[int], devices: int) -> None:
    if devices < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")
    if any(n < 1 for n in lengths):
        raise ValueError("every segment needs at least one token")


def _lpt_capped(lengths: Sequence[int], devices: int, cost: Callable[[int], float],
                capacity: int | None) -> list[list[int]] | None:
    """LPT where a bin takes a segment only while its tokens stay within `capacity` (None: no cap); None when a
    segment fits no bin."""
    order = sorted(range(len(lengths)), key=lambda i: (-cost(lengths[i]), i))
    load = [0.0] * devices
    tokens = [0] * devices
    bins: list[list[int]] = [[] for _ in range(devices)]
    for i in order:
        room = [d for d in range(devices) if capacity is None or tokens[d] + lengths[i] <= capacity]
        if not room:
            return None
        d = min(room, key=lambda d: (load[d], d))
        bins[d].append(i)
        load[d] += cost(lengths[i])
        tokens[d] += lengths[i]
    return [sorted(b) for b in bins]


def _first_fit_decreasing(lengths: Sequence[int], devices: int, capacity: int) -> list[list[int]] | None:
    """Longest segment first into the first bin with room for it; None when one has none."""
    tokens = [0] * devices
    bins: list[list[int]] = [[] for _ in range(devices)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        d = next((d for d in range(devices) if tokens[d] + lengths[i] <= capacity), None)
        if d is None:
            return None
        bins[d].append(i)
        tokens[d] += lengths[i]
    return [sorted(b) for b in bins]


def lpt(lengths: Sequence[int], devices: int, cost: Callable[[int], float] | None = None,
        rungs: Sequence[int] | None = None) -> list[list[int]]:
    """Bins (lists of segment indices, each in increasing order) of `devices` bins: costliest segment first onto
    the least-loaded bin (ties: the lower bin). With `rungs` (token capacities a bin's program runs at), repacked
    to fit a smaller rung where one can be fitted (the module docstring). Deterministic."""
    _check(lengths, devices)
    cost = cost or SegmentCost()
    bins = _lpt_capped(lengths, devices, cost, None)
    if not rungs or not lengths:
        return bins
    rungs = sorted(set(int(r) for r in rungs))
    largest = max(sum(lengths[i] for i in b) for b in bins)
    at = next((r for r in rungs if r >= largest), None)  # past the top rung: whatever a smaller rung can hold
    floor = max(max(lengths), -(-sum(lengths) // devices))
    for rung in (r for r in rungs if floor <= r and (at is None or r < at)):
        packed = _lpt_capped(lengths, devices, cost, rung) or _first_fit_decreasing(lengths, devices, rung)
        if packed is not None:
            return packed
    return bins


def round_robin(lengths: Sequence[int], devices: int) -> list[list[int]]:
    """Segment i onto bin i mod `devices`."""
    _check(lengths, devices)
    return [list(range(d, len(lengths), devices)) for d in range(devices)]


def assign(policy: str, lengths: Sequence[int], devices: int, cost: Callable[[int], float] | None = None,
           rungs: Sequence[int] | None = None):
    """Bins under `policy`; `rungs` (the token rungs of the bins' program) steer `lpt` only."""
    if policy == "lpt":
        return lpt(lengths, devices, cost, rungs)
    if policy == "rr":
        return round_robin(lengths, devices)
    raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")


def makespan(bins: Sequence[Sequence[int]], lengths: Sequence[int], cost: Callable[[int], float]) -> float:
    """The largest bin's predicted seconds."""
    return max((sum(cost(lengths[i]) for i in b) for b in bins), default=0.0)


def lower_bound(lengths: Sequence[int], devices: int, cost: Callable[[int], float]) -> float:
    """No assignment beats max(the costliest segment, the total over the devices)."""
    costs = [cost(n) for n in lengths]
    return max(max(costs, default=0.0), sum(costs) / devices)
