"""Faults a long-running server meets: load beyond what it can serve, and a shutdown with requests in flight.

Overload: the scheduler predicts a new request's wait for a row from the measured time between admissions and
refuses (429 with Retry-After) what would wait past its limit, so what it accepts is served in time. The graceful
shutdown on a real socket is in tests/test_serve.py (it runs on that module's compiled programs).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

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
