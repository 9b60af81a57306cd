"""The continuous-batching scheduler: one loop owns the device and runs every request's prefill and decode steps.

The server runs the loop on a thread of its own (`start`); `Engine.generate` runs it on the calling thread until its
request is done (`run`), or hands its request to the running thread. Requests enter through a bounded queue
(`submit` raises `RequestError` 429 when it is full). The loop repeats:

1. drop what is cancelled (the client went away) or past its deadline, freeing its row;
2. admit one queued request if a row of the engine's batched decode cache is free: its prefill (cold segments,
   then the stitched forward), then `Engine.slot_insert` into the lowest free row, which samples its first token
   (with `max_queue_wait`, a request that would get it past that limit is answered 429 instead);
3. run one decode step of every running request as one batched call (`Engine.slot_decode` over rows
   [0, b), b the smallest batch bucket holding the highest busy row), each row sampled with its own parameters.

With `overlap=True` (`SchedulerOptions.overlap`, `hypic-jax serve --overlap`), decode steps overlap with the host's work: step k+1 is
dispatched with step k's sampled ids as its tokens, still on the device, before the host reads step k's ids back
and turns them into text, stop checks and events. The device then runs a step while the host handles the one
before, instead of waiting for it. A row that a stop ends at step k has one more token computed in step k+1, which
is discarded (a row whose token in flight is its last, by `max_tokens`, is not stepped again). A step chains only
onto one of the same batch bucket with no admission between (an admission, or a change of bucket, first finishes
the step in flight), so the rows' tokens, positions and seeded draws are the same as without overlap. The engine
turns it on where the device is not the CPU (on the CPU the host and the "device" share the cores and it gains
nothing; on a GPU, bench/serve.py measures it).

An admission issues the request's prefill without waiting for it, handles the step in flight while it runs, then
waits for its logits and inserts it. With fused programs (`LimitOptions.fused_prefill_tokens`) and streams running,
the admission and the streams' next step are one call instead (`Engine.slot_decode_and_prefill`: a stitched
request's forward and the step in one program, each layer's experts read once for both); the step after it does
not chain onto it (the admitted row's first token is not among its ids). With `prefill_chunk` and streams running, a queued request's uncached segments
are first prefilled in pieces of at most that many tokens, one piece per loop round (`Engine.prefill_piece`), so a
long cold prefill is spread between decode steps instead of stalling every stream at once.

So prefills interleave with decode steps one at a time: a running stream waits for at most one prefill (or piece)
between two of its tokens (`hypic:decode_stall_seconds` measures how much longer that gap was than one without),
and a burst of arrivals fills the free rows one step at a time. With no request running, queued prefills run back
to back.

Everything a request produces goes to its `sink` (called on the scheduler thread, so it must not block): dicts
with `type` "delta" (new text, token ids, log-probabilities), "done" (finish reason, stats) or "error" (a
`RequestError`). Every submitted request gets exactly one "done" or "error", whatever happens, shutdown included.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import threading
import time
import uuid
from typing import Any, Callable

import numpy as np

from hypic_jax.engine.programs import out_of_memory
from hypic_jax.engine.requests import SamplingParams
from hypic_jax.engine.sampling import SamplingRows

log = logging.getLogger("hypic_jax.engine")


class RequestError(Exception):
    """Why a request failed, with the HTTP status the server answers it with and OpenAI's error shape
    ({"error": {"message", "type", "param", "code"}})."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class TextStream:
    """Incremental detokenization with stop strings: text is released only once it is whole (no partial UTF-8
    sequence) and cannot be the start of a stop string; a stop string ends the text before it."""

    def __init__(self, tokenizer, stops: tuple[str, ...]):
        self.tokenizer, self.stops = tokenizer, tuple(s for s in stops if s)
        self.ids: list[int] = []
        self._prefix = self._read = 0  # token offsets: decoded context, then tokens already turned into text
        self.text = ""
        self.emitted = 0

    def push(self, token: int) -> tuple[str, bool]:
        """Add a token; returns (text to release now, whether a stop string ended the text)."""
        self.ids.append(token)
        if self.tokenizer is None:
            return "", False
        prefix = self.tokenizer.decode(self.ids[self._prefix:self._read])
        full = self.tokenizer.decode(self.ids[self._prefix:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]
            self._prefix, self._read = self._read, len(self.ids)
        return self._release(final=False)

    def _release(self, final: bool) -> tuple[str, bool]:
        limit = len(self.text)
        if self.stops:
            longest = max(map(len, self.stops))
            start = max(0, self.emitted - longest + 1)
            found = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
            if found:
                self.text = self.text[:min(found)]
                delta, self.emitted = self.text[self.emitted:], len(self.text)
                return delta, True
            if not final:  # hold back a tail that may grow into a stop string
                for n in range(min(longest - 1, len(self.text) - self.emitted), 0, -1):
                    if any(s.startswith(self.text[-n:]) for s in self.stops):
                        limit = len(self.text) - n
                        break
        delta, self.emitted = self.text[self.emitted:limit], max(self.emitted, limit)
        return delta, False

    def flush(self) -> tuple[str, bool]:
        """At the end: whatever is left, an incomplete last character included."""
        if self.tokenizer is not None and self._read < len(self.ids):
            prefix = self.tokenizer.decode(self.ids[self._prefix:self._read])
            self.text += self.tokenizer.decode(self.ids[self._prefix:])[len(prefix):]
            self._prefix = self._read = len(self.ids)
        return self._release(final=True)


class Request:
    """One generation request as the scheduler sees it."""

    def __init__(self, segments: list[list[int]], params: SamplingParams, sink: Callable[[dict], None], *,
                 mode: str | None = None, seam: float | None = None, cache_salt: str | None = None,
                 timeout: float = 600.0, tokenizer=None, id: str | None = None):
        self.id = id or uuid.uuid4().hex[:24]
        self.segments, self.params, self.sink = segments, params, sink
        self.mode, self.seam, self.cache_salt = mode, seam, cache_salt
        self.prompt_tokens = sum(map(len, segments))
        self.arrival = time.monotonic()
        self.deadline = self.arrival + timeout
        self.seed = params.seed if params.seed is not None else int(np.random.default_rng().integers(1 << 62))
        self.text = TextStream(tokenizer, params.stop)
        self.tokens: list[int] = []
        self.stats = None  # PrefillStats once prefilled
        self.row: int | None = None
        self.length = 0  # tokens in its decode cache
        self.first_token_at: float | None = None
        self.accepted_wait: float | None = None  # the uncalibrated predicted wait it was accepted with
        self.admitted_at: float | None = None  # monotonic time its admission (prefill) began
        self.pieces: list = []  # `PrefillPiece`s of its cold prefill run before its admission
        self.last_token_at: float | None = None
        self.finished = False
        self.ended: float | None = None  # monotonic time it finished or failed
        self.cancelled = False
        self.done = threading.Event()  # set once its "done" or "error" event was sent

    def cancel(self) -> None:
        """Called from any thread (the client went away): the scheduler drops it and frees its row."""
        self.cancelled = True


def _truncates(params: SamplingParams) -> bool:
    """Whether a request's rows need the sampler that sorts the vocabulary (`SamplingRows.full`)."""
    return (params.temperature > 0 and (params.top_p < 1 or params.top_k > 0)) or bool(params.logprobs)


class Scheduler:
    """See the module docstring. `engine`: an `Engine` (its batched decode cache has `max_batch` rows); `metrics`
    an object with the server's counters (`hypic_jax.serve.metrics.Metrics`) or None."""

    def __init__(self, engine, *, max_queue: int = 256, metrics=None, retry_after_s: int = 1,
                 overlap: bool = False, max_queue_wait: float | None = None, prefill_chunk: int | None = None,
                 compact_rows: bool = False):
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.engine, self.max_queue, self.metrics, self.retry_after_s = engine, max_queue, metrics, retry_after_s
        self.max_queue_wait = max_queue_wait
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1 token or None, got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        self.prefill_pieces = 0  # cold prefill pieces run between decode steps
        self.compact_rows = compact_rows
        self.rows_moved = 0  # streams moved into a lower row (`compact_rows`)
        self.fused_steps = 0  # decode steps that carried an admission (`_admit_fused`)
        self.fused_chained_steps = 0  # of those, chained onto the step in flight
        # the loop's time spent waiting for the device (reading a step's ids, a prefill's logits); the rest of it is
        # the host's own work (planning, issuing, detokenizing, delivering), `hypic:scheduler_seconds`
        self.waited_s = 0.0
        # the time between two admissions while requests wait (an exponential average): the queue's service time,
        # from which `submit` predicts a new request's wait for a row
        self.admission_interval: float | None = None
        self._latest_interval: float | None = None  # the last one alone: a rising load shows here first
        self._last_admission: float | None = None
        # observed time to first token over the prediction a request was accepted with, for the last requests that
        # had one; `calibration` (their 99th percentile, at least 1: the bound is on the p99) scales the
        # predictions, so that the requests ahead's own prefills and the step times' spread, which the admission
        # interval averages away, count
        self._ratios: collections.deque[float] = collections.deque(maxlen=64)
        self.calibration = 1.0
        # seconds from admission to first token of the last requests (`first_token_estimate`)
        self._admission_to_first: collections.deque[float] = collections.deque(maxlen=32)
        self._backlog = False  # requests still waited at the last admission
        self.rows: list[Request | None] = [None] * engine.max_batch
        self._queue: collections.deque[Request] = collections.deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._driving = threading.Lock()  # held by whoever runs the loop: the thread, or a `run` caller
        self._stopping = False
        self._intake_closed = False  # `close_intake`: new requests are refused while the accepted ones finish
        self.steps = 0
        self.bucket_steps: collections.Counter = collections.Counter()  # decode steps per batch bucket
        self.overlap = overlap
        self.chained_steps = 0  # decode steps dispatched before the host read the step before them
        # the decode step in flight, whose ids the host has not read yet: (Sampled, its bucket, the request of each
        # row it stepped)
        self._pending: tuple | None = None
        # the stall metric: reads of decode steps' ids so far, when the last one came back, the gap between the last
        # two reads without a prefill between them, and the reads a prefill (or a piece of one) delayed
        self._reads = 0
        self._read_at: float | None = None
        self._plain_gap: float | None = None
        self._stalled_reads: set[int] = set()

    # Public -----------------------------------------------------------------------------------------------------
    def submit(self, request: Request) -> None:
        with self._cv:
            if self._stopping or self._intake_closed:
                raise RequestError(503, "the server is shutting down", code="shutting_down")
            if len(self._queue) >= self.max_queue:
                if self.metrics:
                    self.metrics.rejected.inc()
                raise RequestError(429, f"the request queue is full ({self.max_queue} waiting); retry later",
                               code="queue_full", type="rate_limit_error",
                               headers={"Retry-After": str(self.retry_after_s)})
            raw, limit = self._raw_wait(), self._wait_limit(request)
            wait = None if raw is None else raw * self.calibration
            if wait is not None and wait > limit:
                if self.metrics:
                    self.metrics.rejected.inc()
                raise self._overloaded(f"a new request would wait about {wait:.1f} s for its first token", wait,
                                       limit)
            request.accepted_wait = raw
            self._queue.append(request)
            self._gauges()
            self._cv.notify()

    def wake(self) -> None:
        with self._cv:
            self._cv.notify()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return sum(r is not None for r in self.rows)

    def predicted_wait(self) -> float | None:
        """Seconds a request submitted now would wait for its first token: one admission interval for each request
        ahead of it and one for itself (its own admission runs its prefill), the interval the largest of the
        average, the latest and the one in progress (so that a rising load is seen at once, even before the next
        admission, and a falling one as the average follows it), times
        `calibration`, what the requests accepted last actually waited over what was predicted for them. None
        before any backlog was seen, or with an empty queue: the loop's next round admits it."""
        raw = self._raw_wait()
        return None if raw is None else raw * self.calibration

    def _raw_wait(self) -> float | None:
        if self.admission_interval is None or not self._queue:
            return None
        return (len(self._queue) + 1) * self._service_interval(time.monotonic())

    def _service_interval(self, now: float) -> float:
        """The time one admission takes now, while requests wait: the largest of the average, the latest and the
        interval in progress. The last: no admission since the later of the last one and the oldest waiting
        request's arrival, so the service time now is at least that long (a service that slows shows here before
        the next admission measures it)."""
        since = self._queue[0].arrival if self._last_admission is None else max(self._last_admission,
                                                                                 self._queue[0].arrival)
        return max(self.admission_interval, self._latest_interval or 0.0, now - since)

    def _calibrate(self, request: Request, now: float) -> None:
        """Record what `request` waited for its first token against the uncalibrated prediction it was accepted
        with, and update `calibration`."""
        if request.accepted_wait:
            self._ratios.append((now - request.arrival) / request.accepted_wait)
            if len(self._ratios) >= 8:
                self.calibration = max(1.0, float(np.quantile(np.asarray(self._ratios), 0.99)))

    def _wait_limit(self, request: Request) -> float:
        """The longest predicted wait a request is accepted with: `max_queue_wait`, and never past its deadline
        (a request that would wait longer would end in a 504 after holding its place)."""
        limit = request.deadline - time.monotonic()
        return limit if self.max_queue_wait is None else min(limit, self.max_queue_wait)

    @property
    def idle(self) -> bool:
        """Nothing queued, running or in flight on the device."""
        with self._cv:
            return not self._queue and not any(self.rows) and self._pending is None

    def close_intake(self) -> None:
        """Refuse new requests (503 `shutting_down`) while the queued and running ones go on: the first half of a
        graceful shutdown, whose second half is `stop`."""
        with self._cv:
            self._intake_closed = True
            self._cv.notify()

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        """Run the loop on a thread of its own (the server's way) until `stop`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="hypic-scheduler", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop; whatever is queued or running is answered with a 503 error."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        self._fail_all(RequestError(503, "the engine is shutting down", code="shutting_down"))

    def run(self, request: Request) -> None:
        """Submit `request` and return once it is done. With the loop's thread running, the thread serves it; else
        this caller runs the loop (every queued request advances with it) until its request is done."""
        self.submit(request)
        while not request.done.is_set():
            if self._thread is not None or not self._driving.acquire(blocking=False):
                request.done.wait(0.05)  # another caller (or the thread) drives the loop
                continue
            try:
                while not request.done.is_set() and not self._stopping:
                    self._iterate()
            finally:
                self._driving.release()
            if self._stopping:
                request.done.wait()

    # Loop -------------------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        with self._driving:
            while True:
                with self._cv:
                    while not self._stopping and not self._queue and not any(self.rows):
                        self._cv.wait(0.5)
                    if self._stopping:
                        return
                self._iterate()

    def _iterate(self) -> None:
        """One round of the loop: drop what ended, admit one request (or run one piece of its cold prefill), run one
        decode step."""
        start, waited = time.monotonic(), self.waited_s
        try:
            self._reap()
            if self.compact_rows:
                self._compact()
            if self._queue and None in self.rows and not self._piece(self._queue[0]):
                while self._shed_late_head(time.monotonic()):
                    pass
                if self._queue:
                    self._time_admission(time.monotonic())
                    with self._cv:
                        request = self._queue.popleft()
                    if not self._admit_fused(request):
                        self._admit(request)
            if any(self.rows):
                self._step()
            else:
                self._drain()
                self._read_at = None  # no stream waits: the next gap starts with the next stream
        except Exception as error:  # noqa: BLE001  (the loop must survive; the requests it held get the error)
            log.exception("scheduler step failed")
            self._pending = None
            self._fail_running(RequestError(500, f"internal error: {error}", code="internal_error"))
        finally:
            self._gauges()
            if self.metrics:
                host = time.monotonic() - start - (self.waited_s - waited)
                self.metrics.scheduler_time.labels("host").inc(host)
                self.metrics.scheduler_time.labels("device_wait").inc(self.waited_s - waited)

    def _wait(self, sampled) -> None:
        """Read `sampled`'s ids (waiting for the device), counting the wait in `waited_s`."""
        start = time.monotonic()
        sampled.ids
        self.waited_s += time.monotonic() - start

    def _time_admission(self, now: float) -> None:
        """Update `admission_interval` with the time since the last admission, when requests waited between the
        two (an idle gap says nothing of the service time)."""
        if self._backlog and self._last_admission is not None:
            interval = self._latest_interval = now - self._last_admission
            previous = self.admission_interval
            self.admission_interval = interval if previous is None else 0.8 * previous + 0.2 * interval
        self._last_admission = now
        with self._cv:
            self._backlog = len(self._queue) > 1  # requests left behind the one admitted now

    def _gauges(self) -> None:
        if self.metrics:
            self.metrics.waiting.set(len(self._queue))
            self.metrics.running.set(self.running)

    def _reap(self) -> None:
        now = time.monotonic()
        with self._cv:
            queued = list(self._queue)
        for request in queued:
            if request.cancelled or now > request.deadline:
                with self._cv:
                    self._queue.remove(request)
                self._end_unstarted(request, now)
        for request in self.rows:
            if request is None:
                continue
            if request.cancelled:
                self._finish(request, "cancelled")
            elif now > request.deadline:
                self._error(request, RequestError(504, "the request ran past its deadline", code="deadline_exceeded"))

    def _compact(self) -> None:
        """Move the highest running rows into free lower rows while the step's batch bucket would shrink: a stream
        in a high row keeps every step at the bucket that holds it after the rows below it have ended. The step in
        flight is handled first (it stepped the rows where they were); each move is one copy of a row's caches
        (`Engine.slot_move`)."""
        def bucket(rows: int) -> int:
            full = any(_truncates(r.params) for r in self.rows if r is not None)
            return self.engine.batch_bucket(rows, full)

        busy = [i for i, r in enumerate(self.rows) if r is not None]
        if not busy or bucket(len(busy)) >= bucket(busy[-1] + 1):
            return
        self._drain()
        while True:
            busy = [i for i, r in enumerate(self.rows) if r is not None]
            if not busy or bucket(len(busy)) >= bucket(busy[-1] + 1):
                return
            source, target = busy[-1], self.rows.index(None)
            self.engine.slot_move(source, target)
            request = self.rows[target] = self.rows[source]
            self.rows[source], request.row = None, target
            self.rows_moved += 1
            if self.metrics:
                self.metrics.rows_moved.inc()

    def _overloaded(self, what: str, wait: float, limit: float) -> RequestError:
        """The 429 `overloaded` for a request whose first token would come `wait` seconds after its arrival, past
        `limit`; Retry-After is at least the excess."""
        retry = max(self.retry_after_s, math.ceil(wait - limit))
        return RequestError(429, f"the server is overloaded: {what}, past its limit of {limit:.1f} s; retry later",
                            code="overloaded", type="rate_limit_error", headers={"Retry-After": str(retry)})

    def first_token_estimate(self) -> float | None:
        """Seconds from an admission to its first token: the 90th percentile of the last 32 requests' (None before
        8 were measured)."""
        if len(self._admission_to_first) < 8:
            return None
        return float(np.quantile(np.asarray(self._admission_to_first), 0.9))

    def _shed_late_head(self, now: float) -> bool:
        """With `max_queue_wait`, answer 429 `overloaded` (with Retry-After) to the head of the queue, about to be
        admitted, if the time it has waited plus `first_token_estimate` passes that limit, and return True. The
        prediction `submit` accepted it with cannot see a slowdown after it was queued (a burst's own load, long
        prefills ahead); its stream has not started, so the client gets the answer it would have got at
        submission, only later. Nothing is shed while the estimate alone passes the limit (no request could meet
        it: serving late beats serving none, and the estimate is only renewed by admissions). Counted in
        `hypic:requests_rejected` and `hypic:requests_shed`."""
        estimate = self.first_token_estimate()
        if self.max_queue_wait is None or estimate is None or estimate >= self.max_queue_wait:
            return False
        with self._cv:
            if not self._queue:
                return False
            request = self._queue[0]
            predicted = now - request.arrival + estimate
            if predicted <= self.max_queue_wait or request.cancelled:
                return False
            self._queue.popleft()
        if self._end(request):
            error = self._overloaded(f"this request would get its first token about {predicted:.1f} s after it "
                                     "arrived", predicted, self.max_queue_wait)
            if self.metrics:
                self.metrics.rejected.inc()
                self.metrics.shed.inc()
            self._log(request, "shed 429", error.code, request.ended)
            self._send(request, dict(type="error", error=error))
        return True

    def _end_unstarted(self, request: Request, now: float) -> None:
        if request.cancelled:
            self._finish(request, "cancelled")
        else:
            self._error(request, RequestError(504, "the request waited past its deadline", code="deadline_exceeded"))

    def _piece(self, request: Request) -> bool:
        """With `prefill_chunk` and streams running, one piece of `request`'s cold prefill (its missing segments, up
        to `prefill_chunk` tokens, `Engine.prefill_piece`) instead of its admission, so a long cold prefill is
        spread between decode steps; True if a piece ran. Whatever fails here is left to the admission, which
        answers the request with it."""
        if not self.prefill_chunk or not any(self.rows) or request.cancelled or time.monotonic() > request.deadline:
            return False
        try:
            piece = self.engine.prefill_piece(request.segments, mode=request.mode, seam=request.seam,
                                              cache_salt=request.cache_salt, budget=self.prefill_chunk)
        except Exception:  # noqa: BLE001
            log.debug("prefill piece of request %s failed; its admission reports it", request.id, exc_info=True)
            return False
        if not piece.tokens:
            return False
        request.pieces.append(piece)
        self.prefill_pieces += 1
        self._mark_stall()
        if self.metrics:
            self.metrics.prefill_pieces.inc()
        return True

    def _admit(self, request: Request) -> None:
        """Prefill `request` and insert it into a free row. The prefill is issued without waiting for it, and the
        step in flight is handled while it runs; the first token's read then waits for both."""
        now = request.admitted_at = time.monotonic()
        if request.cancelled or now > request.deadline:
            self._end_unstarted(request, now)
            return
        if self.metrics:
            self.metrics.queue_time.observe(now - request.arrival)
        try:
            pre = self.engine.prefill(request.segments, mode=request.mode, seam=request.seam,
                                      cache_salt=request.cache_salt, wait=False)
        except Exception as error:  # noqa: BLE001
            self._prefill_failed(request, error)
            return
        self._mark_stall()
        try:
            self._drain()  # an admission changes the rows: the step in flight is handled while the prefill runs
        except Exception as error:  # the loop's handler answers the running requests; this one is answered here
            self._error(request, RequestError(500, f"internal error: {error}", code="internal_error"))
            raise
        wait = time.monotonic()
        try:
            pre.logits = np.asarray(pre.logits)  # waits for the prefill: its failure is this request's alone
        except Exception as error:  # noqa: BLE001
            self._prefill_failed(request, error)
            return
        finally:
            self.waited_s += time.monotonic() - wait
        self._prefilled(request, pre)
        self._prefill_done(request, now)
        if request.params.max_tokens == 0:
            self._finish(request, "length")
            return
        row = self.rows.index(None)
        p = request.params
        try:
            sampling = SamplingRows.build([p.temperature], [p.top_p], [p.top_k], [request.seed], [0],
                                          [p.logprobs or 0])
        except Exception as error:  # noqa: BLE001  (parameters the device arrays cannot hold: this request only)
            log.exception("sampling parameters of request %s", request.id)
            self._error(request, RequestError(500, f"internal error: {error}", code="internal_error"))
            return
        try:
            sampled = self.engine.slot_insert(row, pre, sampling)
        except Exception as error:
            # not in a row yet, so the loop's handler would not answer it: answered here, the others there
            self._error(request, RequestError(500, f"internal error: {error}", code="internal_error"))
            raise
        self.rows[row] = request
        request.row = row
        self._wait(sampled)
        self._accept(request, sampled, 0)

    def _admit_fused(self, request: Request) -> bool:
        """With fused programs (`LimitOptions.fused_prefill_tokens`) and streams running: `request`'s admission and
        the running rows' next decode step as one call (`Engine.slot_decode_and_prefill`), which runs a stitched
        request's forward and the step as one program, each layer's experts read once for both. With overlap it
        chains onto the step in flight as `_step` does (that step's ids, still on the device, are the rows' tokens,
        and the host handles that step while this one runs). False, having done nothing, where that does not apply
        (nothing running, a sampler that truncates or ranks, no token to generate); the admission then goes on
        alone."""
        engine = self.engine
        if not engine.fused_rungs or not any(self.rows) or request.params.max_tokens == 0:
            return False
        if _truncates(request.params) or any(_truncates(r.params) for r in self.rows if r is not None):
            return False
        ahead = int(self._pending is not None)
        busy = [i for i, r in enumerate(self.rows) if r is not None and len(r.tokens) + ahead < r.params.max_tokens]
        rows = engine.batch_bucket(busy[-1] + 1) if busy else 0
        chained = (self.overlap and ahead and rows == self._pending[1]
                   and all(i in self._pending[2] for i in busy))
        if not chained:
            self._drain()
            busy = [i for i, r in enumerate(self.rows) if r is not None]
            if not busy:  # every stream ended with the step just handled
                return False
            rows = engine.batch_bucket(busy[-1] + 1)
        ahead = 1 if chained else 0
        now = request.admitted_at = time.monotonic()
        if request.cancelled or now > request.deadline:
            self._end_unstarted(request, now)
            return True
        if self.metrics:
            self.metrics.queue_time.observe(now - request.arrival)
        row = self.rows.index(None)
        p = request.params
        try:
            first = SamplingRows.build([p.temperature], [p.top_p], [p.top_k], [request.seed], [0], [0])
        except Exception as error:  # noqa: BLE001  (parameters the device arrays cannot hold: this request only)
            self._error(request, RequestError(500, f"internal error: {error}", code="internal_error"))
            return True
        tokens, lengths, sampling = self._step_inputs(busy, rows, ahead)
        try:
            sampled, first_sampled, pre = engine.slot_decode_and_prefill(
                self._pending[0].device_ids if chained else tokens, lengths, sampling, request.segments, row, first,
                mode=request.mode, seam=request.seam, cache_salt=request.cache_salt)
        except Exception as error:  # noqa: BLE001
            # refused, or out of memory, before the decode cache was given to a program: this request's failure
            if engine.slots_held and (isinstance(error, ValueError) or out_of_memory(error)):
                self._prefill_failed(request, error)
                return True
            # not in a row yet, so the loop's handler would not answer it: answered here, the others there
            self._error(request, RequestError(500, f"internal error: {error}", code="internal_error"))
            raise
        self._mark_stall()  # before the step is recorded as in flight: its read is the one the admission delays
        self._count_step(rows, len(busy), chained)
        self.fused_steps += 1
        self.fused_chained_steps += chained
        if self.metrics:
            self.metrics.fused_steps.inc()
        previous, self._pending = self._pending if chained else None, (sampled, rows, {i: self.rows[i] for i in busy})
        self.rows[row] = request
        request.row = row
        if previous is not None:
            self._take(previous)  # while the fused step runs
        self._prefilled(request, pre)
        self._wait(first_sampled)
        self._prefill_done(request, now)
        self._accept(request, first_sampled, 0)
        if not self.overlap:
            self._drain()
        return True

    def _prefill_failed(self, request: Request, error: Exception) -> None:
        """Answer `request` for its failed prefill: 400 for a prompt the engine refuses or a request too large for
        the device's memory (the loop goes on), else 500."""
        if isinstance(error, ValueError):
            self._error(request, RequestError(400, str(error), param="prompt"))
        elif out_of_memory(error):
            log.warning("request %s ran out of device memory in its prefill: %s", request.id,
                        str(error).splitlines()[0])
            self._error(request, RequestError(
                400, f"the device ran out of memory for this request ({request.prompt_tokens} prompt tokens in "
                f"{len(request.segments)} segments; this server takes up to {self.engine.max_prompt_tokens} "
                f"prompt tokens in {self.engine.max_segments} segments): send a shorter prompt or fewer "
                f"segments", param="prompt", code="device_memory"))
        else:
            log.error("prefill failed for request %s", request.id, exc_info=error)
            self._error(request, RequestError(500, f"internal error during prefill: {error}", code="internal_error"))

    @staticmethod
    def _prefilled(request: Request, pre) -> None:
        """`request`'s stats and length from its prefill (the pieces of its cold prefill counted in)."""
        stats = pre.stats
        for piece in request.pieces:
            stats = piece.as_stats(stats)
        request.stats = stats
        request.length = pre.stats.prompt_tokens

    def _prefill_done(self, request: Request, start: float) -> None:
        """The prefill of `request`, admitted at `start`, has ended: its stats' times become the measured ones (it was
        issued without waiting), and the prefill-time metric sees them."""
        seconds = time.monotonic() - start
        stats = request.stats
        request.stats = dataclasses.replace(stats, ttft_s=seconds, combine_s=max(0.0, seconds - stats.cold_s))
        if self.metrics:
            self.metrics.prefill_time.observe(seconds)

    def _step(self) -> None:
        """Dispatch the next decode step of the running rows; with overlap, chained onto the step in flight (whose
        results are then handled while this one runs), else after it."""
        # rows that need another token: with a step in flight, one whose token in flight is its last (max_tokens)
        # needs none
        ahead = int(self._pending is not None)
        busy = [i for i, r in enumerate(self.rows) if r is not None and len(r.tokens) + ahead < r.params.max_tokens]
        full = any(_truncates(self.rows[i].params) for i in busy)
        rows = self.engine.batch_bucket(busy[-1] + 1, full) if busy else 0
        # a row the step in flight did not step (one admitted with it, `_admit_fused`) has no token on the device
        chained = self.overlap and ahead and rows == self._pending[1] and all(i in self._pending[2] for i in busy)
        if not chained:
            self._drain()
            busy = [i for i, r in enumerate(self.rows) if r is not None]
            if not busy:
                return
            full = any(_truncates(self.rows[i].params) for i in busy)
            rows = self.engine.batch_bucket(busy[-1] + 1, full)
        # a chained step's rows are one token ahead of what the host has read: the token in flight
        tokens, lengths, sampling = self._step_inputs(busy, rows, 1 if chained else 0)
        sampled = self.engine.slot_decode(self._pending[0].device_ids if chained else tokens, lengths, sampling)
        self._count_step(rows, len(busy), chained)
        previous, self._pending = self._pending if chained else None, (sampled, rows, {i: self.rows[i] for i in busy})
        if previous is not None:
            self._take(previous)
        if not self.overlap:
            self._drain()

    def _step_inputs(self, busy: list[int], rows: int, ahead: int):
        """A step of `rows` rows: (tokens, lengths, sampling) of the running rows `busy` (the others zeros), each
        `ahead` tokens past what the host has read."""
        tokens, lengths = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
        temperature, top_p = np.zeros(rows, np.float32), np.ones(rows, np.float32)
        top_k, seeds, steps = np.zeros(rows, np.int32), np.zeros(rows, np.uint64), np.zeros(rows, np.int32)
        top = np.zeros(rows, np.int32)
        for i in busy:
            r = self.rows[i]
            tokens[i], lengths[i], steps[i] = r.tokens[-1], r.length + ahead, len(r.tokens) + ahead
            temperature[i], top_p[i], top_k[i], seeds[i] = r.params.temperature, r.params.top_p, r.params.top_k, r.seed
            top[i] = r.params.logprobs or 0
        return tokens, lengths, SamplingRows.build(temperature, top_p, top_k, seeds, steps, top)

    def _count_step(self, rows: int, running: int, chained: bool) -> None:
        self.steps += 1
        self.chained_steps += chained
        self.bucket_steps[rows] += 1
        if self.metrics:
            self.metrics.decode_steps.labels("true" if chained else "false").inc()
            self.metrics.decode_bucket_steps.labels(str(rows)).inc()
            self.metrics.decode_rows.labels(str(rows)).inc(running)

    def _drain(self) -> None:
        """Handle the step in flight, if any."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._take(pending)

    def _take(self, pending: tuple) -> None:
        """A dispatched step's tokens to the requests it stepped that are still running (reading them waits for
        the step); a row whose request ended since (a stop, a cancel) is discarded."""
        sampled, _, requests = pending
        self._wait(sampled)
        self._time_read(time.monotonic())
        for i, request in requests.items():
            if self.rows[i] is request and not request.finished:
                request.length += 1
                self._accept(request, sampled, i)

    def _mark_stall(self) -> None:
        """A prefill (or a piece of one) was just issued: the first decode step issued after it is the one it delays
        (with a step in flight, the read after that step's). With no stream running it delays none, and the gap to
        the next read is no stream's: it must not become the plain gap that later stalls are measured against."""
        if any(self.rows):
            self._stalled_reads.add(self._reads + 1 + (self._pending is not None))
        else:
            self._read_at = None

    def _time_read(self, now: float) -> None:
        """A decode step's ids came back at `now`. If a prefill or a piece of one ran before this step, the streams
        waited the gap between this read and the one before: what it exceeds the last gap without one by is the
        stall (`hypic:decode_stall_seconds`)."""
        self._reads += 1
        stalled = self._reads in self._stalled_reads
        self._stalled_reads = {r for r in self._stalled_reads if r > self._reads}
        if self._read_at is not None:
            gap = now - self._read_at
            if not stalled:
                self._plain_gap = gap
            elif self._plain_gap is not None and self.metrics:
                self.metrics.stall.observe(max(0.0, gap - self._plain_gap))
        self._read_at = now

    def _accept(self, request: Request, sampled, i: int) -> None:
        """Row i of `sampled` is `request`'s next token: release its text, then finish it if it is done."""
        token = int(sampled.ids[i])
        now = time.monotonic()
        request.tokens.append(token)
        if self.metrics:
            if request.first_token_at is None:
                self.metrics.ttft.observe(now - request.arrival)
            else:
                self.metrics.itl.observe(now - request.last_token_at)
        if request.first_token_at is None:
            request.first_token_at = now
            self._calibrate(request, now)
            if request.admitted_at is not None:
                self._admission_to_first.append(now - request.admitted_at)
        request.last_token_at = now
        logprobs = None
        if request.params.logprobs is not None:
            chosen, top_ids, top_lps = sampled.logprobs()
            k = request.params.logprobs
            logprobs = [(token, float(chosen[i]), [(int(a), float(b)) for a, b in zip(top_ids[i, :k], top_lps[i, :k])])]
        p = request.params
        if token in p.stop_token_ids:
            text, stopped = request.text.flush()[0], True
        else:
            text, stopped = request.text.push(token)
        reason = "stop" if stopped else ("length" if len(request.tokens) >= p.max_tokens else None)
        if reason == "length":
            tail, stopped = request.text.flush()
            text += tail
            reason = "stop" if stopped else reason
        self._send(request, dict(type="delta", text=text, token_ids=[token], logprobs=logprobs))
        if reason is not None:
            self._finish(request, reason)

    # Endings ----------------------------------------------------------------------------------------------------
    def _release(self, request: Request) -> None:
        if request.row is not None and self.rows[request.row] is request:
            self.rows[request.row] = None
        request.row = None

    def _finish(self, request: Request, reason: str) -> None:
        if self._end(request):
            if self.metrics:
                self.metrics.record_finish(request, reason, request.ended)
            self._log(request, "cancelled" if reason == "cancelled" else "ok", reason, request.ended)
            self._send(request, dict(type="done", finish_reason=reason, stats=request.stats,
                                     tokens=list(request.tokens), text=request.text.text))

    def _error(self, request: Request, error: RequestError) -> None:
        if self._end(request):
            if self.metrics:
                self.metrics.record_error(request, error, request.ended)
            self._log(request, f"error {error.status}", error.code, request.ended)
            self._send(request, dict(type="error", error=error))

    def _end(self, request: Request) -> bool:
        """Mark `request` finished and free its row; False if it had already ended (a request ends once)."""
        if request.finished:
            return False
        request.finished = True
        self._release(request)
        request.ended = time.monotonic()
        return True

    def _fail_running(self, error: RequestError) -> None:
        for request in list(self.rows):
            if request is not None:
                self._error(request, error)

    def _fail_all(self, error: RequestError) -> None:
        with self._cv:
            queued = list(self._queue)
            self._queue.clear()
        for request in queued + [r for r in self.rows if r is not None]:
            self._error(request, error)
        self._gauges()

    def _send(self, request: Request, event: dict) -> None:
        try:
            request.sink(event)
        except Exception:  # noqa: BLE001  (a client's sink failing must not stop the others)
            log.exception("delivering an event of request %s failed", request.id)
            request.cancel()
        if event["type"] != "delta":
            request.done.set()

    @staticmethod
    def _log(request: Request, status: str, reason: Any, end: float) -> None:
        stats = request.stats
        ttft = None if request.first_token_at is None else round(request.first_token_at - request.arrival, 6)
        log.info("request %s", json.dumps(dict(
            id=request.id, status=status, finish_reason=reason, prompt_tokens=request.prompt_tokens,
            cached_tokens=None if stats is None else stats.cached_tokens,
            recomputed_tokens=None if stats is None else stats.recomputed_tokens,
            cold_tokens=None if stats is None else stats.cold_tokens, completion_tokens=len(request.tokens),
            mode=None if stats is None else stats.mode, ttft_s=ttft, e2e_s=round(end - request.arrival, 6))))
