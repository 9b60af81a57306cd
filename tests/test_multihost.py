"""Multi-host serving (`hypic_jax.parallel.multihost`): two processes on loopback through `jax.distributed` (gloo CPU
collectives), each with two fake CPU devices, so the segment mesh spans four devices of two processes.

- The cluster serves `tests/multihost_worker.py`'s requests (all cold, bins on every device; hits only; hits and a
  miss) with the one-process engine's logits, hit/miss/cold statistics and cache entries (the coordinator's and
  the follower's); a request every process refuses leaves the cluster serving; a request that fails on the
  follower alone is reported as a divergence on the next one, and the follower stops when the coordinator marks
  the cluster broken.
- Process 1 killed after warmup: the coordinator's next request fails with `ClusterError` naming it, within the
  timeout.
- The coordinator killed after warmup: the follower ends (`jax.distributed` terminates it, or `follow` raises)
  instead of waiting.
- Engines that differ (process 1 with half the cache): `Runner` refuses them on both processes.
- The processes share one compile cache folder (as those of one machine do by default: the engine's
  `compile_cache="auto"`, one folder per user), and the cluster restarts on it: each process runs its programs on
  its own devices, and the cluster still serves the one-process engine's logits. The divergence cluster is the
  first start on that folder; the restart and the killed clusters load its programs instead of compiling them.

Every process runs under a deadline and is killed past it: nothing here can hang.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import fake_devices_env, rel_err

pytestmark = pytest.mark.xdist_group("multihost")

WORKER = Path(__file__).with_name("multihost_worker.py")
TIMEOUT_S = 6.0  # the cluster's request timeout (the worker's default)
DEADLINE_S = 180  # per cluster: warmup, requests and every timeout, with room for a loaded machine


def _gloo_missing() -> str | None:
    import jax

    try:
        from jax._src.lib import _jax
    except ImportError:
        return f"jax {jax.__version__} has no _jax extension module"
    if not hasattr(jax, "distributed") or not hasattr(_jax, "make_gloo_tcp_collectives"):
        return f"jax {jax.__version__} has no jax.distributed with gloo CPU collectives"
    try:
        jax.config.jax_cpu_collectives_implementation  # noqa: B018
    except AttributeError:
        return f"jax {jax.__version__} has no jax_cpu_collectives_implementation option"
    return None


if _gloo_missing():
    pytest.skip(_gloo_missing(), allow_module_level=True)


def _free_port() -> int:
    """A port free on every interface (the coordination service binds [::]:port, or 0.0.0.0:port)."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::", 0))
            return s.getsockname()[1]
    except OSError:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return s.getsockname()[1]


def _env() -> dict:
    return {**fake_devices_env(2), "PYTHONUNBUFFERED": "1"}


class Run:
    """One worker process's end: exit code, seconds, log, status (OUT.json) and outputs."""

    def __init__(self, out: Path, rc: int, seconds: float, log: str):
        self.out, self.rc, self.seconds, self.log = out, rc, seconds, log
        status = out.with_suffix(".json")
        self.status = json.loads(status.read_text()) if status.exists() else None

    def npz(self, suffix: str = ".npz") -> dict:
        with np.load(str(self.out) + suffix) as data:
            return {k: data[k] for k in data.files}

    def tail(self) -> str:
        return f"--- {self.out.name} rc={self.rc} status={self.status}\n{self.log[-3000:]}"


def _start(out: Path, process_id: int, port: int, extra) -> tuple[subprocess.Popen, float]:
    log = open(str(out) + ".log", "w")
    proc = subprocess.Popen([sys.executable, str(WORKER), str(out), str(process_id), str(port), *extra],
                            stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=str(WORKER.parent.parent))
    log.close()
    return proc, time.perf_counter()


def _bind_failed(out: Path) -> bool:
    """The coordination service could not bind its port (another process took it after `_free_port`)."""
    return "Failed to add port" in Path(str(out) + ".log").read_text()


def _finish(procs, outs, deadline: float) -> list[Run]:
    """Wait for every process until `deadline` (perf_counter), killing them all past it (or once the coordinator
    could not bind its port: the retry takes another)."""
    ended = {}
    while len(ended) < len(procs) and time.perf_counter() < deadline:
        for proc, started in procs:
            if proc.pid not in ended and proc.poll() is not None:
                ended[proc.pid] = time.perf_counter() - started
        if procs[0][0].pid in ended and _bind_failed(outs[0]):
            break
        time.sleep(0.05)
    for proc, _ in procs:
        if proc.poll() is None:
            proc.kill()  # SIGKILL: jax.distributed catches SIGTERM (its preemption notice)
            proc.wait()
    runs = [Run(out, proc.returncode, ended.get(proc.pid, float("inf")), Path(str(out) + ".log").read_text())
            for (proc, _), out in zip(procs, outs)]
    if len(ended) < len(procs) and not _bind_failed(outs[0]):
        pytest.fail("a worker ran past its deadline and was killed:\n" + "\n".join(r.tail() for r in runs))
    return runs


def _cluster(tmp_path: Path, name: str, *extra: str, reference: Path | None = None) -> list[Run]:
    """Both processes of one cluster (and, with `reference`, the one-process reference beside them, sharing the
    machine's cores with the cluster's waits); retried on a new port when the coordination service could not bind
    its port (another test took it meanwhile)."""
    ref = None
    for attempt in range(3):
        port = _free_port()
        outs = [tmp_path / f"{name}{attempt}-p{p}" for p in (0, 1)]
        procs = [_start(out, p, port, extra) for p, out in enumerate(outs)]
        if reference is not None and (ref is None or ref.status is None):  # again if the retry cut it short
            procs.append(_start(reference, 0, 0, ["--single"]))
            outs.append(reference)
        runs = _finish(procs, outs, time.perf_counter() + DEADLINE_S)
        ref = runs[2] if len(runs) > 2 else ref
        if not _bind_failed(outs[0]) or attempt == 2:
            return runs[:2] + ([ref] if reference is not None else [])
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def first_cluster(tmp_path_factory):
    """The divergence cluster beside its one-process reference, both processes keeping their programs in one
    folder (the default per-user compile cache of one machine): (folder, coordinator, follower, reference, wall).
    One cluster serves both tests that start from an empty program folder; starting one costs a warmup."""
    root = tmp_path_factory.mktemp("multihost")
    folder = root / "programs"
    started = time.perf_counter()
    runs = _cluster(root, "serve", "--diverge", "--compile-cache", str(folder), reference=root / "single")
    return folder, *runs, time.perf_counter() - started


def test_two_processes_serve_like_one_and_report_a_divergence(first_cluster):
    _, coordinator, follower, single, wall = first_cluster
    for run in (coordinator, follower, single):
        assert run.status is not None, run.tail()
    assert single.status["status"] == "ok" and single.status["requests"] == 3, single.tail()
    assert coordinator.status["status"] == "ok" and coordinator.status["requests"] == 3, coordinator.tail()

    got, want = coordinator.npz(), single.npz()
    np.testing.assert_array_equal(got["stats"], want["stats"])  # (hits, misses, cold tokens) per request
    assert want["stats"][:, 0].tolist() == [0, 3, 2] and want["stats"][:, 1].tolist() == [4, 0, 1]
    for i in range(3):
        assert rel_err(got[f"logits{i}"], want[f"logits{i}"], norm="max") <= 1e-5, i
    # the cold request's segments went one to each of the four devices, two on each process; the miss to one
    bins = coordinator.status["bins"]
    assert len(bins[0]) == 4 and all(len(b) == 1 for b in bins[0]), bins
    assert bins[1] == [] and sum(map(len, bins[2])) == 1, bins

    # every process committed every record: both caches hold the reference's entries, row for row
    ref = single.npz(".entries.npz")
    assert len(ref) > 0
    for run in (coordinator, follower):
        entries = run.npz(".entries.npz")
        assert set(entries) == set(ref), run.out.name
        for key, rows in ref.items():
            assert entries[key].shape == rows.shape, (run.out.name, key)
            assert rel_err(entries[key], rows, norm="max") <= 1e-5, (run.out.name, key)

    # request 4 (too long) failed on every process alike: the cluster went on
    assert "max_prompt_tokens" in (coordinator.status["refused"] or ""), coordinator.status
    # request 5 failed on process 1 alone: request 6 fails on the coordinator, which names it; process 1 stops
    diverged = coordinator.status["diverged"]
    assert diverged and "diverged" in diverged and "process 1 after request 5" in diverged, diverged
    assert "injected failure" in diverged, diverged
    assert follower.status["status"] == "error", follower.tail()
    assert "marked the cluster broken" in follower.status["error"], follower.status
    assert coordinator.rc == 0 and follower.rc == 0 and single.rc == 0
    print(f"cluster and reference: {wall:.1f} s")


def test_a_killed_process_fails_the_request_within_the_timeout(first_cluster, tmp_path):
    """Its warmup loads the first cluster's programs (`first_cluster`): the kill comes after it either way."""
    coordinator, killed = _cluster(tmp_path, "kill1", "--kill", "1", "--compile-cache", str(first_cluster[0]))
    assert killed.rc == -9 and killed.status is None, killed.tail()
    status = coordinator.status
    assert status is not None and status["status"] == "error", coordinator.tail()
    assert status["request"] == 1
    assert "process 1 of 2 did not reach request 1 within 6 s" in status["error"], status["error"]
    # the barrier's timeout, not a hang: no sooner than it, and soon after it
    assert 0.9 * TIMEOUT_S <= status["seconds"] <= TIMEOUT_S + 5, status
    assert coordinator.rc == 0


def test_a_follower_does_not_outlive_its_coordinator(first_cluster, tmp_path):
    killed, follower = _cluster(tmp_path, "kill0", "--kill", "0", "--compile-cache", str(first_cluster[0]))
    assert killed.rc == -9, killed.tail()
    # jax.distributed terminates a process whose coordination service is gone; should it not, `follow` raises
    # (the service is unreachable, or no request within its idle timeout)
    if follower.status is None:
        assert follower.rc != 0 and "Terminating process" in follower.log, follower.tail()
    else:
        assert follower.status["status"] == "error", follower.tail()
    assert follower.seconds < killed.seconds + 60 + 10, (follower.seconds, killed.seconds)


def test_engines_that_differ_are_refused(tmp_path):
    runs = _cluster(tmp_path, "differ", "--differ")
    for run in runs:
        assert run.status is not None and run.status["status"] == "refused", run.tail()
        assert "process 1: cache_bytes, pools" in run.status["error"], run.status


def test_processes_sharing_a_compile_cache_serve_like_one(first_cluster, tmp_path):
    """Both processes keep their programs in one folder (the default per-user compile cache of one machine), and
    the cluster is started twice on it (the first start is `first_cluster`'s; the second time every program is
    stored, by one process or the other): a program stored for another process's devices is never run on this
    one's, and both times the cluster serves the one-process engine's logits."""
    folder, first, _, single, _ = first_cluster
    want = single.npz()
    assert first.status is not None and first.status["status"] == "ok", first.tail()
    assert any(folder.rglob("*.*")), "no program was stored"
    runs = _cluster(tmp_path, "again", "--compile-cache", str(folder))
    for run in runs:
        assert run.status is not None and run.status["status"] == "ok", run.tail()
    for coordinator in (first, runs[0]):
        assert coordinator.status["requests"] == 3, coordinator.tail()
        got = coordinator.npz()
        np.testing.assert_array_equal(got["stats"], want["stats"])
        for i in range(3):
            assert rel_err(got[f"logits{i}"], want[f"logits{i}"], norm="max") <= 1e-5, (coordinator.out.name, i)
