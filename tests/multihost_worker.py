"""One process of the two-process clusters of tests/test_multihost.py (or, with --single, the one-process reference).

    python tests/multihost_worker.py OUT PROCESS_ID PORT [--single] [--kill PROCESS] [--diverge] [--differ]
                                                         [--timeout SECONDS] [--compile-cache DIR]

Builds the demo's tiny model and an engine whose segment mesh spans every device of every process
(`--single`: one device, no cluster), warms it up and, on the coordinator, runs the requests of `requests()`. Files:
OUT.npz (the coordinator's, or the reference's, logits and statistics), OUT.entries.npz (every process: its cache
entries' pool contents), OUT.json (how the process ended: "ok" with the bins of each request, or "error" with the
ClusterError and the seconds from the start of the request it ended, or "refused" with the Runner's ValueError).

`--kill P`: process P kills itself (SIGKILL) after warmup. `--diverge`: after the requests, a request over the
engine's max_prompt_tokens (every process refuses it: the cluster goes on), then a repeat of the second request (hits
only) that process 1 alone fails; the coordinator records the ClusterError of the next request (the same again).
`--differ`: process 1's engine has half the cache (the Runner refuses it). `--compile-cache DIR`: every process keeps
its compiled programs in DIR (the engine's `compile_cache`; by default none, so that each process compiles its own).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np


def requests(vocab: int):
    """All cold (bins on every device), then reordered with a repeat (hits only), then partly new (hits and a
    miss)."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(3, vocab, int(n)).tolist() for n in (40, 9, 25, 17)]
    query = rng.integers(3, vocab, 6).tolist()
    return [docs + [query], [docs[2], docs[0], docs[3], query],
            [docs[1], rng.integers(3, vocab, 30).tolist(), docs[0], query]]


def engine_for(devices, cache_bytes: int = 1 << 22, compile_cache: str = "none"):
    from hypic_jax.demo import tiny_model
    from hypic_jax.engine import Engine

    model = tiny_model()
    return Engine(model, max_prompt_tokens=128, max_segments=6, token_rungs=(128,), max_new_tokens=0, max_batch=1,
                  cache_bytes=cache_bytes, mean_entry_tokens=32, eviction="lru", seam=4, devices=devices,
                  compile_cache=compile_cache), model


def fail_on_call(engine, call: int) -> None:
    """Make the engine's `call`-th prefill (from 1) raise, as a process-local failure would."""
    prefill, calls = engine.prefill, [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call:
            raise RuntimeError(f"injected failure of prefill {call}")
        return prefill(*args, **kwargs)

    engine.prefill = failing


def entries(engine) -> dict:
    """Every cached entry's rows of every pool leaf (the records each process committed)."""
    import jax

    out = {}
    for entry in engine.cache.entries():
        index = 0
        for kind, pool, base in engine.pools.layers():
            rows = base + (entry.slot if kind == "slot" else np.asarray(entry.rows))
            for leaf in jax.tree.leaves(pool):
                out[f"{entry.key}/{index}"] = np.asarray(leaf)[rows]
                index += 1
    return out


def finish(out: str, engine, status: dict, cluster=None, *, wait: bool = False) -> None:
    # the status first: a peer that already exited takes the coordination service with it, and the runtime may
    # abort this process soon after (the status is what every test reads). Then, with `cluster`, this process
    # says it has written its files; with `wait`, it waits (60 s at most) until every other process has said so
    # too, so that a process that reaches this together with its peers (a refusal on all of them, or the
    # coordinator releasing its followers from a broken cluster) does not exit while a slower one still writes;
    # the coordinator always waits, and also until each follower has exited (`_wait_until_gone`)
    with open(out + ".json", "w") as f:
        json.dump(status, f)
    np.savez(out + ".entries", **entries(engine))
    sys.stdout.flush()
    sys.stderr.flush()
    if cluster is not None:
        from hypic_jax.parallel.multihost import ClusterError

        try:
            cluster.publish(f"worker/finished/{cluster.process_id}", os.getpid())
            deadline = time.monotonic() + 60
            for p in range(cluster.processes) if wait or cluster.process_id == 0 else ():
                if p != cluster.process_id:
                    found, pid = cluster.poll(f"worker/finished/{p}", max(0.001, deadline - time.monotonic()))
                    if found and cluster.process_id == 0:
                        _wait_until_gone(pid, deadline)
        except ClusterError:
            pass  # a peer took the service down: it has written its files
    os._exit(0)  # no `jax.distributed` shutdown handshake: the peer may be gone


def _wait_until_gone(pid: int, deadline: float) -> None:
    """Until process `pid` (a peer on this host that has written its files) has exited, at most until `deadline`.
    The coordinator hosts the coordination service: a peer's runtime that sees the service vanish before its own
    exit aborts the process, so the coordinator leaves last. Where /proc cannot be read, at once."""
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":  # exited, not yet reaped by the test
                    return
        except (OSError, IndexError):
            return
        time.sleep(0.01)


def main() -> None:
    out, process_id, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    args = sys.argv[4:]
    kill = int(args[args.index("--kill") + 1]) if "--kill" in args else None
    timeout_s = float(args[args.index("--timeout") + 1]) if "--timeout" in args else 6.0
    compile_cache = args[args.index("--compile-cache") + 1] if "--compile-cache" in args else "none"

    from hypic_jax.parallel import multihost

    single = "--single" in args
    if single:
        engine, model = engine_for(None, compile_cache=compile_cache)
        engine.warmup(progress=False)
        results = [engine.prefill(segs) for segs in requests(model.config.vocab_size)]
        bins, diverged, refused = [], None, None
    else:
        cluster = multihost.Cluster.initialize(f"127.0.0.1:{port}", 2, process_id, timeout_s=timeout_s,
                                               setup_timeout_s=120)
        differ = "--differ" in args and process_id == 1
        engine, model = engine_for(cluster.devices, cache_bytes=1 << 21 if differ else 1 << 22,
                                   compile_cache=compile_cache)
        mesh = engine.segment_mesh
        assert mesh is not None and mesh.multiprocess and mesh.size == len(cluster.devices)
        try:
            runner = multihost.Runner(engine, cluster)
        except ValueError as error:
            finish(out, engine, dict(status="refused", error=str(error)), cluster, wait=True)
        engine.warmup(progress=False)
        if "--diverge" in args and process_id == 1:
            fail_on_call(engine, len(requests(model.config.vocab_size)) + 2)
        if kill == process_id:
            os.kill(os.getpid(), signal.SIGKILL)
        if process_id != 0:
            started = time.perf_counter()
            try:
                count = runner.follow(idle_timeout_s=60)
            except multihost.ClusterError as error:
                finish(out, engine, dict(status="error", error=str(error), seconds=time.perf_counter() - started),
                       cluster)
            finish(out, engine, dict(status="ok", requests=count), cluster)
        results, bins = [], []
        for segs in requests(model.config.vocab_size):
            started = time.perf_counter()
            try:
                results.append(runner.prefill(segs))
            except multihost.ClusterError as error:
                finish(out, engine, dict(status="error", error=str(error), seconds=time.perf_counter() - started,
                                         request=len(results) + 1))
            bins.append(mesh.last["bins"] if results[-1].stats.misses else [])
        diverged = refused = None
        if "--diverge" in args:
            try:
                runner.prefill([list(range(3, 200)), [3, 4]])
            except ValueError as error:
                refused = str(error)
            repeat = requests(model.config.vocab_size)[1]
            runner.prefill(repeat)  # fails on process 1 only
            try:
                runner.prefill(repeat)
            except multihost.ClusterError as error:
                diverged = str(error)
        runner.shutdown()
    np.savez(out, **{f"logits{i}": np.asarray(r.logits) for i, r in enumerate(results)},
             stats=np.asarray([(r.stats.hits, r.stats.misses, r.stats.cold_tokens) for r in results]))
    finish(out, engine, dict(status="ok", requests=len(results), bins=bins, refused=refused, diverged=diverged),
           None if single else cluster, wait=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
