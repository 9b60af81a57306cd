"""Multi-host serving over `jax.distributed` (multi-controller): one process per host, the same programs everywhere.

JAX runs one program over devices of several processes only if every process calls it, in the same order, with the
same inputs. The processes here therefore hold the same engine and run every request together:

- `Cluster.initialize` starts `jax.distributed` (CPU collectives through gloo, GPU through NCCL) and gives the
  processes a channel through the distributed key-value store; every read and barrier is bounded by `timeout_s`
  (`setup_timeout_s` while the engines are built and warmed up, which takes longer and unevenly).
- `Runner` (built on every process before `warmup`) checks that the engines agree (weights, settings, mesh,
  cache), and again before each of warmup's collective programs (a Pallas kernel that failed to compile on one
  process changes its implementation choices, and so its programs). `Runner.prefill` on the coordinator
  (process 0) publishes the request and waits at a barrier until every process has it; the followers
  (`Runner.follow`) run each published request as it comes. The segment-parallel cold program spans every
  process's devices (`segment_mesh.SegmentMesh`), so a request's missing segments are prefilled across the hosts;
  the coordinator decides the bins (`agree`) and every process waits for the others before each collective
  program (`sync`). Each process commits every record into its own pools and runs the stitched program locally:
  the cache is replicated, and the coordinator's result is the answer.
- A process that died or stalls misses a barrier: the request fails on the coordinator with `ClusterError` within
  `timeout_s`, naming the processes that did not arrive, and the cluster refuses every later request (`broken`).
  A follower whose request failed differently from the coordinator's, or whose cache no longer matches, is
  reported at the next request (each process publishes what its request did and a digest of its cache). A
  follower stops with `ClusterError` when its coordinator marks the cluster broken, when a barrier fails, when the
  coordinator is unreachable, or after `idle_timeout_s` without a request.

The processes must make the same decisions from the same requests: the engine's eviction must be "lru" and it must
have no host or disk tier (their timing-driven choices would differ per process; `Runner` checks). Every other
choice a request makes (cache lookups, pool rows, the token rung) follows from the request and the replicated cache;
the one timed choice, the segment mesh's bins (its cost model is calibrated per process), is the coordinator's.
The hosts are meant to be alike (the same software, the same kind of device): the collective program is compiled
on each process and must be the same program everywhere.

What a timeout cannot cover: a process that dies inside a collective program (after the barrier before it) leaves
the others waiting on the collectives' own timeout (XLA's CPU collectives give up after 30 minutes; on GPUs it is
NCCL's behaviour), and `jax.distributed` terminates every process once a peer has missed heartbeats for
`heartbeat_timeout_s`, or as soon as the coordinator's process is gone. A cluster that lost a process is restarted
as a whole.

Tested on two CPU processes on loopback (tests/test_multihost.py); not yet run across GPU hosts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from typing import Any

import jax
import numpy as np

log = logging.getLogger("hypic_jax.parallel.multihost")

__all__ = ["Cluster", "ClusterError", "Runner"]

PREFIX = "hypic"


class ClusterError(RuntimeError):
    """A process of the cluster did not answer within the timeout (it died or stalls), or the processes diverged."""


def _status(error: Exception) -> str:
    """The status code that starts a `jax.distributed` client error ("DEADLINE_EXCEEDED", "UNAVAILABLE", ...)."""
    return str(error).split(":", 1)[0].strip()


def _short(error: Exception, limit: int = 160) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= limit else text[:limit] + "..."


class Cluster:
    """This process's place in a `jax.distributed` cluster and the channel between the processes (keys under
    "hypic/" in the distributed key-value store)."""

    def __init__(self, timeout_s: float = 60.0, setup_timeout_s: float = 600.0):
        from jax._src import distributed

        self.client = distributed.global_state.client
        if self.client is None:
            raise RuntimeError("jax.distributed is not initialized (use Cluster.initialize)")
        if timeout_s <= 0 or setup_timeout_s <= 0:
            raise ValueError("timeouts must be > 0 seconds")
        self.timeout_s, self.setup_timeout_s = float(timeout_s), float(setup_timeout_s)
        self.process_id, self.processes = jax.process_index(), jax.process_count()
        self.broken: str | None = None
        self.runner: Runner | None = None

    @classmethod
    def initialize(cls, coordinator: str, num_processes: int, process_id: int, *, timeout_s: float = 60.0,
                   setup_timeout_s: float = 600.0, heartbeat_timeout_s: int = 100) -> "Cluster":
        """`jax.distributed.initialize` (gloo collectives on the CPU unless another implementation is set), then
        the cluster. `coordinator`: "host:port" of process 0. `timeout_s` bounds every request's reads and
        barriers; `setup_timeout_s` joining, the engines' check and warmup; `heartbeat_timeout_s` is
        `jax.distributed`'s (after it, a process that stopped answering takes the others down)."""
        if not 0 <= process_id < num_processes:
            raise ValueError(f"process_id {process_id} outside [0, {num_processes})")
        if timeout_s >= heartbeat_timeout_s:
            log.warning("timeout_s %g >= heartbeat_timeout_s %d: jax.distributed will take every process down "
                        "for a dead one before a request can fail with ClusterError", timeout_s, heartbeat_timeout_s)
        try:  # an implementation already chosen (gloo, mpi) stays
            if str(jax.config.jax_cpu_collectives_implementation or "none").lower() == "none":
                jax.config.update("jax_cpu_collectives_implementation", "gloo")
        except AttributeError:  # a JAX without the option: its own default
            pass
        jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id,
                                   initialization_timeout=max(1, int(setup_timeout_s)),
                                   heartbeat_timeout_seconds=heartbeat_timeout_s)
        return cls(timeout_s, setup_timeout_s)

    @property
    def coordinator(self) -> bool:
        return self.process_id == 0

    @property
    def devices(self) -> list:
        """Every device of every process (a segment mesh over all of them)."""
        return list(jax.devices())

    # The channel ----------------------------------------------------------------------------------------------------
    def publish(self, key: str, value: Any) -> None:
        try:
            self.client.key_value_set(f"{PREFIX}/{key}", json.dumps(value), allow_overwrite=True)
        except Exception as error:  # noqa: BLE001  (the client raises one runtime error type for every failure)
            raise ClusterError(f"cannot publish {key!r}: the coordination service (process 0) is unreachable "
                               f"({_short(error)})") from error

    def read(self, key: str, timeout_s: float | None = None) -> Any:
        """The value under `key`, waiting up to `timeout_s` (default: the cluster's); ClusterError past it."""
        seconds = self.timeout_s if timeout_s is None else timeout_s
        found, value = self.poll(key, seconds)
        if not found:
            raise ClusterError(f"no value for {key!r} within {seconds:g} s")
        return value

    def poll(self, key: str, timeout_s: float) -> tuple[bool, Any]:
        """(True, value) once `key` holds one within `timeout_s`, else (False, None); ClusterError when the
        coordination service is unreachable."""
        try:
            return True, json.loads(self.client.blocking_key_value_get(f"{PREFIX}/{key}",
                                                                        max(1, int(1000 * timeout_s))))
        except Exception as error:  # noqa: BLE001
            if _status(error) == "DEADLINE_EXCEEDED":
                return False, None
            raise ClusterError(f"the coordination service (process 0) is unreachable ({_short(error)})") from error

    def peek(self, key: str) -> Any:
        """The value under `key` now, or None."""
        try:
            return json.loads(self.client.key_value_try_get(f"{PREFIX}/{key}"))
        except Exception:  # noqa: BLE001  (NOT_FOUND, or the service is gone: nothing to read either way)
            return None

    def listing(self, directory: str) -> dict[str, Any]:
        """Every key under `directory` (relative to it) and its value; empty when nothing is readable."""
        base = f"{PREFIX}/{directory.rstrip('/')}/"
        try:
            return {k[len(base):]: json.loads(v) for k, v in self.client.key_value_dir_get(base)}
        except Exception:  # noqa: BLE001
            return {}

    def delete(self, directory: str) -> None:
        """Drop a key and every key under it (a finished request's), so the store does not grow with requests."""
        try:
            self.client.key_value_delete(f"{PREFIX}/{directory}")
        except Exception as error:  # noqa: BLE001  (nothing depends on it; the next barrier reports a dead service)
            log.debug("could not delete %s: %s", directory, _short(error))

    # Barriers -------------------------------------------------------------------------------------------------------
    def barrier(self, name: str, *, what: str | None = None, timeout_s: float | None = None) -> None:
        """Every process reaches `name`, or ClusterError after the timeout (and the cluster is broken). The error
        names the processes that did not arrive and whatever a process reported (`report`)."""
        if self.broken:
            raise ClusterError(f"the cluster is broken: {self.broken}")
        seconds = self.timeout_s if timeout_s is None else timeout_s
        what = what or repr(name)
        try:
            self.client.key_value_set(f"{PREFIX}/{name}/arrived/{self.process_id}", "1", allow_overwrite=True)
            self.client.wait_at_barrier(f"{PREFIX}/{name}", max(1, int(1000 * seconds)))
        except Exception as error:  # noqa: BLE001
            if _status(error) != "DEADLINE_EXCEEDED":
                reason = (f"the coordination service (process 0) became unreachable while waiting for {what} "
                          f"({_short(error)})")
            else:
                arrived = {int(k) for k in self.listing(f"{name}/arrived") if k.isdigit()} | {self.process_id}
                missing = [p for p in range(self.processes) if p not in arrived]
                who = (f"process{'es' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of "
                       f"{self.processes}" if missing else "a process")
                reason = f"{who} did not reach {what} within {seconds:g} s (died or stalls)"
            self.fail(reason)
            raise ClusterError(self.broken) from error

    def report(self, message: str) -> None:
        """Leave `message` where the other processes read it when a barrier fails (this process's last failure)."""
        try:
            self.client.key_value_set(f"{PREFIX}/report/{self.process_id}", json.dumps(message), allow_overwrite=True)
        except Exception:  # noqa: BLE001  (the service is gone: nobody is left to read it)
            pass

    def fail(self, reason: str) -> None:
        """Mark the cluster broken (with the other processes' reports); the coordinator also tells the followers,
        which stop following."""
        reports = {p: m for p, m in self.listing("report").items() if p != str(self.process_id)}
        if reports:
            reason += "; " + "; ".join(f"process {p} reported: {m}" for p, m in sorted(reports.items()))
        self.broken = self.broken or reason
        if self.coordinator:
            try:
                self.client.key_value_set(f"{PREFIX}/broken", json.dumps(self.broken), allow_overwrite=True)
            except Exception:  # noqa: BLE001
                pass


def _settings(engine) -> dict:
    """What must be equal on every process for the same requests to make the same decisions (JSON form)."""
    mesh = engine.segment_mesh
    settings = dict(
        fingerprint=engine.fingerprint, mode=engine.mode, seam=repr(engine.seam),
        kernels=repr(engine.kernels), max_prompt_tokens=engine.max_prompt_tokens,
        max_segments=engine.max_segments, max_new_tokens=engine.max_new_tokens, rungs=list(engine.ladder.rungs),
        cache_bytes=engine.cache.capacity_bytes, eviction=engine.eviction,
        pools=[[list(a.shape), str(a.dtype)] for a in jax.tree.leaves(engine.pools.arrays)],
        mesh=None if mesh is None else dict(devices=[int(d.id) for d in mesh.devices], policy=mesh.policy),
        warmed=bool(engine.programs.serving), state=_state(engine))
    return json.loads(json.dumps(settings))


def _state(engine) -> str:
    """A digest of the cache: every entry's key, pool slot and rows, in eviction order (what the next request's
    lookups, evictions and allocations depend on)."""
    digest = hashlib.sha256()
    for entry in engine.cache.entries():
        digest.update(entry.key.encode())
        digest.update(str(entry.slot).encode())
        if entry.rows is not None:
            digest.update(np.asarray(entry.rows, np.int32).tobytes())
    return digest.hexdigest()[:16]


def _outcome(engine, error: BaseException | None) -> dict:
    """What a request did on this process: the error type it raised (None: it succeeded), the message, and the
    cache digest after it. The processes must agree on the type and the digest (messages may name devices)."""
    return dict(failed=None if error is None else type(error).__name__,
                error=None if error is None else _short(error, 300), state=_state(engine))


def _same(a: dict, b: dict) -> bool:
    return a.get("failed") == b.get("failed") and a.get("state") == b.get("state")


def _describe(outcome: dict) -> str:
    done = "succeeded" if outcome.get("failed") is None else f"failed ({outcome['failed']}: {outcome.get('error')})"
    return f"{done}, cache digest {outcome.get('state')}"


class Runner:
    """Runs one engine's requests on every process of `cluster` in the same order (see the module docstring).

    Build it on every process, after the engine and before its `warmup` (the warmup's collective programs then
    wait for every process too). The coordinator calls `prefill` (and `shutdown` at the end); every other process
    calls `follow`, which returns when the coordinator shuts down. `prefill` may be called from several threads:
    the requests run one at a time."""

    def __init__(self, engine, cluster: Cluster):
        if getattr(engine, "tiers", None) is not None and engine.tiers.enabled:
            raise ValueError("a multi-host engine has no peer, host or disk tier (their timing-driven choices "
                             "would differ per process)")
        if getattr(engine, "eviction", "lru") != "lru":
            raise ValueError(f"a multi-host engine evicts by 'lru' (the same choice on every process), not "
                             f"{engine.eviction!r}")
        if cluster.runner is not None:
            raise ValueError("the cluster already has a Runner (the processes' channel serves one engine)")
        self.engine, self.cluster = engine, cluster
        self.requests = 0  # requests published (coordinator) or taken (follower); 0 while setting up
        self.closed = False
        self._steps = 0
        self._lock = threading.Lock()
        self._outcome: dict | None = None  # the coordinator's own outcome of its last request
        self._check_settings("setup", "the engines' check")
        cluster.runner = self
        mesh = engine.segment_mesh
        if mesh is not None:
            mesh.agree = self._agree
            mesh.sync = self._sync

    def _check_settings(self, name: str, what: str) -> None:
        """Every process's engine equals the coordinator's (weights, settings, mesh, cache state), checked at the
        barrier `name`; ValueError naming the differences on every process otherwise."""
        cluster, mine = self.cluster, _settings(self.engine)
        if cluster.coordinator:
            cluster.publish(f"{name}/settings", mine)
        else:
            theirs = cluster.read(f"{name}/settings", timeout_s=cluster.setup_timeout_s)
            cluster.publish(f"{name}/verdict/{cluster.process_id}",
                            sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k)))
        cluster.barrier(name, what=what, timeout_s=cluster.setup_timeout_s)
        verdicts = {int(p): v for p, v in cluster.listing(f"{name}/verdict").items()}
        # every process has read the verdicts before any acts on them: a refused coordinator that exits at once
        # would otherwise take the coordination service away from a process still reading
        cluster.barrier(f"{name}/read", what=what, timeout_s=cluster.setup_timeout_s)
        if any(verdicts.values()):
            raise ValueError(f"the processes' engines differ from the coordinator's ({what}): " + "; ".join(
                f"process {p}: {', '.join(v)}" for p, v in sorted(verdicts.items()) if v))

    # The segment mesh's hooks ---------------------------------------------------------------------------------------
    def _agree(self, tag: str, value):
        self._steps += 1
        key = f"r{self.requests}/agree/{tag}/{self._steps}"
        if self.cluster.coordinator:
            self.cluster.publish(key, value)
            return value
        return self.cluster.read(key, timeout_s=self._timeout())

    def _sync(self, tag: str) -> None:
        self._steps += 1
        if tag == "warmup":  # the engines again: a kernel that failed to compile on one process changed its choices
            self._check_settings(f"r{self.requests}/warmup/{self._steps}", "warmup's collective program")
            return
        self.cluster.barrier(f"r{self.requests}/sync/{tag}/{self._steps}", timeout_s=self._timeout(),
                             what=f"the collective program of {self._what()}")

    def _timeout(self) -> float:
        return self.cluster.setup_timeout_s if self.requests == 0 else self.cluster.timeout_s

    def _what(self) -> str:
        return "warmup" if self.requests == 0 else f"request {self.requests}"

    def _begin(self, n: int) -> None:
        self.requests, self._steps = n, 0

    def _check_followers(self, n: int) -> None:
        """The followers' outcomes of request `n` equal the coordinator's (read once every follower has moved past
        it); then its keys go."""
        if n < 1 or self._outcome is None:
            return
        theirs = self.cluster.listing(f"r{n}/outcome")
        self.cluster.delete(f"r{n}")
        differ = []
        for p in range(1, self.cluster.processes):
            other = theirs.get(str(p))
            if other is None:
                differ.append(f"process {p} left no outcome of request {n}")
            elif not _same(other, self._outcome):
                differ.append(f"process {p} after request {n}: {_describe(other)}; the coordinator: "
                              f"{_describe(self._outcome)}")
        if differ:
            self.cluster.fail("the processes diverged: " + "; ".join(differ))
            self._release_followers()
            raise ClusterError(self.cluster.broken)

    def _release_followers(self) -> None:
        """On a broken cluster: the next request the followers wait for says so, which wakes them at once (the
        `broken` key is only checked between their waits)."""
        try:
            self.cluster.publish(f"r{self.requests + 1}/request", dict(op="broken", reason=self.cluster.broken))
        except ClusterError:
            pass  # the service is gone: the followers end with it

    # The coordinator ------------------------------------------------------------------------------------------------
    def prefill(self, segments, mode: str | None = None, seam: float | None = None,
                cache_salt: str | None = None):
        """On the coordinator: the request on every process; returns this process's `PrefillResult`. ClusterError
        when a process did not join it in time (or diverged on the previous one)."""
        if not self.cluster.coordinator:
            raise RuntimeError("only the coordinator (process 0) submits requests; the others call follow()")
        segments = self.engine.segment_tokens(segments)  # token ids: the same on every process
        with self._lock:
            if self.closed:
                raise RuntimeError("the runner is shut down")
            if self.cluster.broken:
                raise ClusterError(f"the cluster is broken: {self.cluster.broken}")
            n = self.requests + 1
            self._begin(n)
            self.cluster.publish(f"r{n}/request", dict(op="prefill", segments=segments, mode=mode, seam=seam,
                                                        cache_salt=cache_salt))
            self.cluster.barrier(f"r{n}/start", what=f"request {n}")
            self._check_followers(n - 1)
            try:
                result = self.engine.prefill(segments, mode=mode, seam=seam, cache_salt=cache_salt)
            except ClusterError:
                raise
            except Exception as error:  # the followers meet the same error: the cluster goes on
                self._outcome = _outcome(self.engine, error)
                raise
            self._outcome = _outcome(self.engine, None)
            return result

    def shutdown(self) -> None:
        """On the coordinator: the followers return from `follow`, and every process may then exit (each leaves
        `jax.distributed` at exit, which waits for the others). ClusterError if a follower diverged on the last
        request (the followers are released first). On a broken cluster, waits up to `timeout_s` for the followers
        still alive to stop following (the coordinator's exit would take them down mid-way)."""
        with self._lock:
            if not self.cluster.coordinator or self.closed:
                return
            self.closed = True
            if self.cluster.broken:
                self._release_followers()
                deadline = time.monotonic() + self.cluster.timeout_s
                for p in range(1, self.cluster.processes):
                    try:
                        self.cluster.poll(f"report/{p}", max(0.001, deadline - time.monotonic()))
                    except ClusterError:
                        break
                return
            n = self.requests + 1
            self._begin(n)
            self.cluster.publish(f"r{n}/request", dict(op="shutdown"))
            self.cluster.barrier(f"r{n}/start", what="shutdown")
            try:
                self._check_followers(n - 1)
            finally:
                self.cluster.delete(f"r{n}")

    # The followers --------------------------------------------------------------------------------------------------
    def follow(self, *, idle_timeout_s: float | None = None) -> int:
        """On a follower: run the coordinator's requests until it shuts down; returns the requests run. Waits for
        the next request indefinitely, or up to `idle_timeout_s`. ClusterError when the cluster breaks (a barrier
        fails, the coordinator marks it broken or is unreachable, or the idle timeout passes); the error is left
        for the coordinator to report."""
        if self.cluster.coordinator:
            raise RuntimeError("the coordinator submits requests; follow() is for the other processes")
        try:
            return self._follow(idle_timeout_s)
        except ClusterError as error:
            self.cluster.report(f"stopped following at request {self.requests}: {error}")
            raise

    def _follow(self, idle_timeout_s: float | None) -> int:
        cluster = self.cluster
        while True:
            n = self.requests + 1
            request = self._next(n, idle_timeout_s)
            self._begin(n)
            cluster.barrier(f"r{n}/start", what=f"request {n}" if request["op"] == "prefill" else "shutdown")
            if request["op"] == "shutdown":
                return n - 1
            started = time.perf_counter()
            try:
                self.engine.prefill(request["segments"], mode=request["mode"], seam=request["seam"],
                                    cache_salt=request["cache_salt"])
                outcome = _outcome(self.engine, None)
            except ClusterError as error:
                try:
                    cluster.publish(f"r{n}/outcome/{cluster.process_id}", _outcome(self.engine, error))
                except ClusterError:
                    pass  # the coordination service is gone: the first error is the one to report
                raise
            except Exception as error:  # noqa: BLE001  (the coordinator compares it with its own outcome)
                log.warning("request %d failed on process %d: %s", n, cluster.process_id, error)
                outcome = _outcome(self.engine, error)
            cluster.publish(f"r{n}/outcome/{cluster.process_id}", outcome)
            log.debug("request %d run in %.3f s", n, time.perf_counter() - started)

    def _next(self, n: int, idle_timeout_s: float | None) -> dict:
        """Request `n` once the coordinator publishes it; ClusterError when the cluster is marked broken, the
        coordinator is unreachable, or `idle_timeout_s` passes."""
        cluster, started = self.cluster, time.monotonic()
        while True:
            broken = cluster.peek("broken")
            if broken is not None:
                cluster.broken = cluster.broken or broken
                raise ClusterError(f"the coordinator marked the cluster broken: {broken}")
            waited = time.monotonic() - started
            if idle_timeout_s is not None and waited >= idle_timeout_s:
                raise ClusterError(f"no request from the coordinator within {idle_timeout_s:g} s")
            step = min(cluster.timeout_s, 2.0)
            if idle_timeout_s is not None:
                step = max(0.001, min(step, idle_timeout_s - waited))
            found, request = cluster.poll(f"r{n}/request", step)
            if found and request["op"] == "broken":
                cluster.broken = cluster.broken or request["reason"]
                raise ClusterError(f"the coordinator marked the cluster broken: {request['reason']}")
            if found:
                return request
