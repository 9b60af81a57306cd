"""`hypic-jax serve` under a burst far above what it can serve: what it refuses, how fast what it accepts is
answered, and how soon it is back to its normal latency.

The server runs as its own process (as in `bench/serve.py`, whose trace and client this script uses) with
`--max-queue-wait`. Three phases of Poisson arrivals, one after the other without a pause: `--base-rate` for
`--phase` seconds (the normal latency), `--burst x` that rate for `--phase` seconds, then the base rate again for
2 x `--phase` seconds. Per phase: requests sent, answered (200), refused with 429 (and how many carried
Retry-After), other statuses, the TTFT p50 / p99 of the answered ones, and how long the slowest 429 took (a queued
request shed before its prefill is answered 429 after waiting; `hypic:requests_shed` counts those). The recovery time is the arrival time,
after the burst ends, from which every later request's TTFT is within 1.5 x the first phase's p99 (0 when the
first request after the burst already is). Compilations while serving are counted and must be 0.

    python bench/overload.py --small                  # CPU: the embedded model in float32
    python bench/overload.py --model DIR --base-rate 4 --burst 10 --phase 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx
import numpy as np

from serve import trace

from hypic_jax.serve.client import launch, metric, wait_ready


async def _one(client, body, start_at, t0):
    await asyncio.sleep(max(0.0, t0 + start_at - time.perf_counter()))
    arrival = time.perf_counter()
    first = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return dict(at=start_at, status=response.status_code, retry_after=response.headers.get("retry-after"),
                        answered_after=time.perf_counter() - arrival)
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: ") and line != "data: [DONE]":
                payload = json.loads(line[6:])
                if payload.get("choices") and payload["choices"][0].get("token_ids"):
                    first = time.perf_counter()
    return dict(at=start_at, status=200, ttft=None if first is None else first - arrival)


async def run(args, base, vocab):
    phases = [("base", args.base_rate, args.phase), ("burst", args.base_rate * args.burst, args.phase),
              ("after", args.base_rate, 2 * args.phase)]
    arrivals, offset = [], 0.0
    for k, (name, rate, seconds) in enumerate(phases):
        args.duration = seconds
        for at, segments in trace(args, np.random.default_rng(100 + k), vocab, rate):
            arrivals.append((name, offset + at, segments))
        offset += seconds
    limits = httpx.Limits(max_connections=10000, max_keepalive_connections=1000)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
        before = (await client.get("/metrics")).text
        t0 = time.perf_counter()
        results = await asyncio.gather(*[
            _one(client, dict(segments=segments, max_tokens=args.max_tokens, temperature=0, stream=True,
                              ignore_eos=True, return_token_ids=True, cache_salt="overload"), at, t0)
            for _, at, segments in arrivals])
        after = (await client.get("/metrics")).text
    for (name, _, _), result in zip(arrivals, results):
        result["phase"] = name
    return results, phases, before, after


def summary(results, phases, limit: float) -> dict:
    out = {}
    for name, rate, seconds in phases:
        rows = [r for r in results if r["phase"] == name]
        ttft = np.array([r["ttft"] for r in rows if r["status"] == 200 and r["ttft"] is not None] or [np.nan])
        refused = [r for r in rows if r["status"] == 429]
        out[name] = dict(rate=rate, seconds=seconds, sent=len(rows), answered=sum(r["status"] == 200 for r in rows),
                         refused=len(refused), retry_after=sum(r["retry_after"] is not None for r in refused),
                         refused_after_max=max((r["answered_after"] for r in refused), default=0.0),
                         other={s: sum(r["status"] == s for r in rows) for s in {r["status"] for r in rows}
                                if s not in (200, 429)},
                         ttft_p50=float(np.nanpercentile(ttft, 50)), ttft_p99=float(np.nanpercentile(ttft, 99)),
                         over_limit=int(np.sum(ttft > limit)))
    end = phases[0][2] + phases[1][2]
    bound = 1.5 * out["base"]["ttft_p99"]
    later = sorted((r for r in results if r["phase"] == "after" and r["status"] == 200), key=lambda r: r["at"])
    slow = [r["at"] for r in later if r["ttft"] is None or r["ttft"] > bound]
    out["recovery_s"] = max(0.0, slow[-1] - end) if slow else 0.0
    out["recovery_bound_s"] = bound
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: the built-in model)")
    parser.add_argument("--small", action="store_true", help="CPU size: the embedded model in float32")
    parser.add_argument("--base-rate", type=float, default=None, help="requests/s the server sustains (bench/serve.py)")
    parser.add_argument("--burst", type=float, default=10.0, help="the burst's rate, as a multiple of --base-rate")
    parser.add_argument("--phase", type=float, default=20.0, help="seconds of the base and burst phases")
    parser.add_argument("--max-queue-wait", type=float, default=2.0, help="the server's --max-queue-wait (seconds)")
    parser.add_argument("--pool", type=int, default=64)
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--docs-per-request", type=int, default=4)
    parser.add_argument("--doc-tokens", type=int, default=64)
    parser.add_argument("--query-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--port", type=int, default=8766)
    parser.add_argument("--compile-cache", default=None, help="the server's compile cache folder")
    parser.add_argument("--json", default=None, help="write the summary here")
    args = parser.parse_args()
    load = ["--dtype", "float32"] if args.small else []
    args.base_rate = args.base_rate or (2.0 if args.small else 4.0)
    prompt = args.docs_per_request * args.doc_tokens + args.query_tokens
    rung = 1 << (prompt - 1).bit_length()
    command = [*([args.model] if args.model else []),
               "--port", str(args.port), "--max-batch", str(args.max_batch), "--max-prompt-tokens", str(rung),
               "--token-rungs", str(rung), "--max-new-tokens", str(args.max_tokens), "--max-queue", "100000",
               "--max-queue-wait", f"{args.max_queue_wait:g}", "--cache-gb", "0.25", "--log-level", "warning",
               *load, *(["--compile-cache", args.compile_cache] if args.compile_cache else [])]
    server = launch(command)
    base = f"http://127.0.0.1:{args.port}"
    try:
        start = time.perf_counter()
        wait_ready(base, server)
        print(f"server ready in {time.perf_counter() - start:.1f} s: hypic-jax serve {' '.join(command)}", flush=True)
        results, phases, before, after = asyncio.run(run(args, base, args.vocab))
        out = summary(results, phases, args.max_queue_wait)
        out["rejected_metric"] = metric(after, "hypic:requests_rejected_total") - metric(
            before, "hypic:requests_rejected_total")
        out["shed_metric"] = metric(after, "hypic:requests_shed_total") - metric(before, "hypic:requests_shed_total")
        out["compiles"] = metric(after, "hypic:compilations_while_serving_total")
        out["max_queue_wait_s"] = args.max_queue_wait
        out["requests"] = [dict(phase=r["phase"], at=round(r["at"], 3), status=r["status"],
                                ttft=None if r.get("ttft") is None else round(r["ttft"], 3),
                                **({"answered_after": round(r["answered_after"], 3)} if "answered_after" in r else {}))
                           for r in results]
        print(f"{'phase':<6} {'rate/s':>7} {'sent':>5} {'200':>5} {'429':>5} {'Retry-After':>11} {'other':>8} "
              f"{'TTFT p50':>9} {'p99':>8} {'> limit':>8} {'latest 429':>10}")
        for name, _, _ in phases:
            row = out[name]
            print(f"{name:<6} {row['rate']:>7g} {row['sent']:>5} {row['answered']:>5} {row['refused']:>5} "
                  f"{row['retry_after']:>11} {str(row['other'] or '-'):>8} {row['ttft_p50']:>9.3f} "
                  f"{row['ttft_p99']:>8.3f} {row['over_limit']:>8} {row['refused_after_max']:>10.3f}")
        print(f"recovery: {out['recovery_s']:.2f} s after the burst (TTFT within {out['recovery_bound_s']:.3f} s); "
              f"hypic:requests_rejected +{out['rejected_metric']:g} (of them shed from the queue, hypic:requests_shed: "
              f"+{out['shed_metric']:g}); compilations while serving: {out['compiles']:g}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
