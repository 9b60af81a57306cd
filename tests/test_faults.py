"""Faults a long-running server meets: load beyond what it can serve, and a shutdown with requests in flight.

Overload: the scheduler predicts a new request's wait for its first token from the measured time between admissions,
scaled by what the last accepted requests waited against their predictions, and refuses (429 with Retry-After) what
would wait past its limit, so what it accepts is served in time. The graceful
shutdown on a real socket is in tests/test_serve.py (it runs on that module's compiled programs).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from helpers import LONG
from hypic_jax.engine.requests import SamplingParams
from hypic_jax.engine.scheduler import Request, RequestError, Scheduler


def _request(timeout: float = 600.0) -> Request:
    return Request([[1, 2, 3]], SamplingParams(max_tokens=2), sink=lambda event: None, timeout=timeout)


def _scheduler(**options) -> Scheduler:
    return Scheduler(SimpleNamespace(max_batch=2), **options)  # submit reads the queue alone, never the engine


def test_the_admission_interval_is_learned_only_from_a_backlog():
    scheduler = _scheduler()
    for _ in range(3):
        scheduler._queue.append(_request())
    scheduler._time_admission(10.0)  # the first admission: nothing to measure yet
    assert scheduler.admission_interval is None
    scheduler._queue.popleft()
    scheduler._time_admission(10.5)  # the queue held two more when the first was admitted: a service time
    assert scheduler.admission_interval == pytest.approx(0.5)
    scheduler._queue.popleft()
    scheduler._time_admission(11.5)  # one was left: still a backlog, averaged in
    assert scheduler.admission_interval == pytest.approx(0.8 * 0.5 + 0.2 * 1.0)
    scheduler._queue.popleft()
    scheduler._time_admission(100.0)  # none waited behind the last one: an idle gap, not a service time
    assert scheduler.admission_interval == pytest.approx(0.6)


@pytest.mark.parametrize("max_queue_wait, timeout, accepted", [(1.0, 600.0, 3), (None, 2.0, 6), (5.0, 2.0, 6)])
def test_an_overloaded_queue_refuses_what_would_wait_past_its_limit(max_queue_wait, timeout, accepted):
    """With 0.3 s between admissions, the k-th waiting request is predicted to wait 0.3 k s: accepted while that is
    within `max_queue_wait` and its own deadline, then refused with 429 `overloaded` and a Retry-After."""
    scheduler = _scheduler(max_queue=100, max_queue_wait=max_queue_wait)
    scheduler.submit(_request(timeout))  # nothing measured yet: no prediction
    scheduler.admission_interval = 0.3
    for _ in range(accepted - 1):
        scheduler.submit(_request(timeout))
    with pytest.raises(RequestError) as refused:
        scheduler.submit(_request(timeout))
    error = refused.value
    assert error.status == 429 and error.code == "overloaded"
    assert int(error.headers["Retry-After"]) >= 1
    assert scheduler.waiting == accepted  # nothing accepted was dropped


def test_an_empty_queue_never_refuses_for_wait():
    scheduler = _scheduler(max_queue=100, max_queue_wait=0.1)
    scheduler.admission_interval = 10.0  # a slow service time, but nobody is ahead
    scheduler.submit(_request())
    assert scheduler.waiting == 1


def test_a_closed_intake_refuses_new_requests_and_keeps_the_accepted_ones():
    scheduler = _scheduler()
    scheduler.submit(_request())
    scheduler.close_intake()
    with pytest.raises(RequestError) as refused:
        scheduler.submit(_request())
    assert refused.value.status == 503 and refused.value.code == "shutting_down"
    assert scheduler.waiting == 1 and not scheduler.idle
    scheduler._queue.clear()
    assert scheduler.idle


def test_predicted_wait_counts_the_requests_ahead():
    scheduler = _scheduler()
    scheduler.admission_interval = 0.25
    assert scheduler.predicted_wait() is None
    for _ in range(3):
        scheduler._queue.append(_request())
    assert scheduler.predicted_wait() == pytest.approx(4 * 0.25)
    scheduler._latest_interval = 0.5  # the load rises: the latest interval counts before the average follows
    assert scheduler.predicted_wait() == pytest.approx(4 * 0.5)
    scheduler._latest_interval = 0.1  # and falls: the average
    assert scheduler.predicted_wait() == pytest.approx(4 * 0.25)


def test_an_admission_overdue_counts_before_it_happens():
    """No admission for a second while requests wait: the service time is at least that, whatever the intervals
    measured before said; the interval in progress starts no earlier than the oldest waiting request's arrival."""
    import time

    scheduler = _scheduler()
    scheduler.admission_interval = 0.25
    now = time.monotonic()
    scheduler._last_admission = now - 1.0
    waiting = [_request() for _ in range(3)]
    for request in waiting:
        request.arrival = now - 5.0
    scheduler._queue.extend(waiting)
    assert scheduler.predicted_wait() == pytest.approx(4 * 1.0, rel=0.05)
    scheduler._last_admission = now - 100.0  # an idle server: the gap began when the first of them arrived
    for request in waiting:
        request.arrival = now - 0.1
    assert scheduler.predicted_wait() == pytest.approx(4 * 0.25)


@pytest.mark.parametrize("max_queue_wait", [2.0, None])
def test_a_head_that_would_get_its_first_token_past_the_limit_is_shed(max_queue_wait):
    """At its admission, a queued request whose wait so far plus the measured admission-to-first-token time (the
    90th percentile of the last 32) passes `max_queue_wait` is answered 429 `overloaded` with a Retry-After instead,
    and counted; the next one in time is kept. Nothing is shed before 8 requests were measured, while the estimate
    alone passes the limit (no request could meet it), or without `max_queue_wait`."""
    import time

    events, counted = [], SimpleNamespace(rejected=0, shed=0)
    bump = lambda name: SimpleNamespace(inc=lambda: setattr(counted, name, getattr(counted, name) + 1))  # noqa: E731
    scheduler = _scheduler(max_queue=100, max_queue_wait=max_queue_wait)
    scheduler.metrics = SimpleNamespace(rejected=bump("rejected"), shed=bump("shed"))
    now = time.monotonic()
    queued = []
    for seconds in (1.8, 1.7, 1.2):  # with a 0.5 s estimate: 2.3 and 2.2 s (shed), then 1.7 s (kept)
        request = Request([[1, 2, 3]], SamplingParams(max_tokens=2), sink=events.append)
        request.arrival = now - seconds
        queued.append(request)
    scheduler._queue.extend(queued)
    scheduler._admission_to_first.extend([0.5] * 7)
    assert scheduler.first_token_estimate() is None and not scheduler._shed_late_head(now)
    scheduler._admission_to_first.extend([0.1, 0.5])
    assert scheduler.first_token_estimate() == pytest.approx(0.5)
    shed = 0
    while scheduler._shed_late_head(now):
        shed += 1
    if max_queue_wait is None:
        assert shed == 0 and list(scheduler._queue) == queued and not events
        return
    assert shed == 2 and list(scheduler._queue) == queued[2:]
    assert [request.finished for request in queued] == [True, True, False]
    assert len(events) == 2 and all(event["type"] == "error" for event in events)
    for event in events:
        error = event["error"]
        assert error.status == 429 and error.code == "overloaded" and int(error.headers["Retry-After"]) >= 1
    assert counted.rejected == counted.shed == 2
    scheduler._admission_to_first.extend([2.5] * 32)  # an estimate past the limit by itself: no one is shed
    queued[2].arrival = now - 1.9
    assert not scheduler._shed_late_head(now) and scheduler.waiting == 1


def test_the_stall_is_counted_on_the_read_a_prefill_delays():
    """`hypic:decode_stall_seconds`: a prefill issued with no step in flight delays the next read of a step's ids;
    with a step in flight (overlap), the read after that step's. The stall is that gap beyond the last plain one;
    nothing is counted while no stream runs."""
    stalls = []
    scheduler = _scheduler()
    scheduler.metrics = SimpleNamespace(stall=SimpleNamespace(observe=stalls.append))
    scheduler._mark_stall()  # no stream running: no one waits
    scheduler.rows[0] = _request()
    for t in (0.000, 0.010, 0.020):  # plain gaps of 10 ms
        scheduler._time_read(t)
    scheduler._mark_stall()
    scheduler._time_read(0.055)
    assert stalls == [pytest.approx(0.025)]
    scheduler._time_read(0.065)
    scheduler._pending = ("a step in flight",)
    scheduler._mark_stall()
    scheduler._time_read(0.075)  # the step in flight, issued before the prefill: a plain gap
    scheduler._time_read(0.115)  # the step issued after it
    assert stalls == [pytest.approx(0.025), pytest.approx(0.030)]
    assert not scheduler._stalled_reads


def test_the_prediction_is_scaled_by_what_accepted_requests_waited():
    """Requests that waited twice what was predicted for them (their own prefills, a slower step) double the next
    predictions once eight were seen, so the limit holds for what is accepted; waits under the prediction never
    shrink it below the measured intervals."""
    scheduler = _scheduler(max_queue=100, max_queue_wait=1.0)
    scheduler.admission_interval = 0.25
    scheduler._queue.extend(_request() for _ in range(3))
    assert scheduler.predicted_wait() == pytest.approx(1.0)
    for k in range(8):
        served = _request()
        served.accepted_wait = 0.5
        scheduler._calibrate(served, served.arrival + (1.0 if k < 7 else 0.6))
        assert scheduler.calibration == (1.0 if k < 7 else pytest.approx(2.0, rel=0.05))
    assert scheduler.predicted_wait() == pytest.approx(2.0, rel=0.05)
    with pytest.raises(RequestError) as refused:  # 1 s uncalibrated, within the limit; 2 s calibrated, past it
        scheduler.submit(_request())
    assert refused.value.code == "overloaded"
    fast = _scheduler()
    for _ in range(10):
        served = _request()
        served.accepted_wait = 1.0
        fast._calibrate(served, served.arrival + 0.1)
    assert fast.calibration == 1.0


@LONG
def test_a_killed_server_restarts_and_serves_only_whole_entries(tmp_path):
    """`bench/crash.py` at a short size: a server with a disk tier killed (SIGKILL) under load, write-through on
    and off, its folder then damaged as a power loss would (truncated and corrupted files, partial temporaries);
    every restart comes up, removes what is damaged, and answers as its references do (`crash.check`: prefix
    reuse against full_recompute, PIC against its entries computed afresh), some of it from the disk tier."""
    import importlib.util
    import socket
    from pathlib import Path

    pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from helpers import tiny_checkpoint

    spec = importlib.util.spec_from_file_location("crash", Path(__file__).parents[1] / "bench" / "crash.py")
    crash = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(crash)
    _, vocab, folder = tiny_checkpoint("qwen_dense", str(tmp_path / "model"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = crash.parser().parse_args(["--model", str(folder), "--dtype", "float32", "--cycles", "2", "--vocab",
                                      str(vocab), "--folder", str(tmp_path / "run"), "--port", str(port),
                                      "--requests", "16", "--damage", "0.5", "--start-timeout", "300",
                                      "--rung", "128", "--doc-tokens", "24", "--max-batch", "2"])
    out = crash.run(args)  # raises on a failed restart or an answer unlike its reference
    rows = out["rows"]
    assert [r["write_through"] for r in rows] == [True, False]
    assert rows[0]["lost"] == 0  # write-through: every answered request's entries were on disk before the kill
    assert all(r["checked"] == args.checks for r in rows)
    assert sum(r["cache_hits"] for r in rows) > 0  # entries were read back from the disk tier
    assert sum(r["damaged"] for r in rows) > 0 and sum(r["corrupt_removed"] for r in rows) > 0
