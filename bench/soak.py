"""`hypic-jax serve` under hours of mixed traffic: does anything grow, does anything go unanswered?

The server runs as its own process. A client sends Poisson arrivals at `--rate` for `--minutes`, each drawn from a
mix: PIC, prefix-cache and full-recompute requests over a pool of documents that keeps growing (new documents beside
reordered old ones), several cache salts, streamed and whole answers, streams the client leaves after a few tokens
(cancellations), and bad inputs (which must be answered 4xx in OpenAI's error shape). Every `--sample-every` seconds
it reads the server process's resident memory, memory maps, open files and threads (from /proc) and the server's own
counters (/metrics: device memory in use where the backend reports it, cache bytes and entries, tier entries,
compilations while serving). At the end, per resource over the samples after `--warmup-minutes`: the growth of its
median and of its minimum from the first third of them to the last third (`growth`), and its least-squares slope per
hour; requests by outcome, of which none may be left unanswered (a transport error or a timeout), and the
compilations while serving (must be 0).

    python bench/soak.py --small --minutes 60             # CPU: the embedded model in float32, an hour
    python bench/soak.py --small --minutes 5 --warmup-minutes 1 --sample-every 15
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

import httpx
import numpy as np

from hypic_jax.serve.client import launch, metric, wait_ready

RESOURCES = ("rss_mb", "maps", "open_files", "threads")


def process_sample(pid: int) -> dict:
    """Resident memory, memory maps, open files and threads of process `pid` (Linux /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return dict(rss_mb=int(fields["VmRSS"].split()[0]) / 1024, threads=int(fields["Threads"]),
                maps=len(Path(f"/proc/{pid}/maps").read_text().splitlines()),
                open_files=len(os.listdir(f"/proc/{pid}/fd")))


class Mix:
    """The requests: a growing pool of documents, drawn with a Zipf tilt towards the old ones."""

    BAD = (dict(max_tokens=-1), dict(temperature="hot"), dict(pic_mode="sometimes"), dict(n=3),
           dict(segments=[]), dict(logprobs=99))

    def __init__(self, args, rng: np.random.Generator):
        self.args, self.rng = args, rng
        self.pool = [self._doc() for _ in range(args.pool)]

    def _doc(self) -> list[int]:
        return self.rng.integers(3, self.args.vocab, int(self.rng.integers(self.args.doc_tokens // 2,
                                                                           self.args.doc_tokens + 1))).tolist()

    def next(self) -> tuple[str, dict]:
        rng, args = self.rng, self.args
        if rng.random() < args.new_docs:
            self.pool.append(self._doc())
        weights = 1.0 / np.arange(1, len(self.pool) + 1) ** 0.8
        docs = rng.choice(len(self.pool), min(args.docs, len(self.pool)), replace=False, p=weights / weights.sum())
        rng.shuffle(docs)
        segments = [self.pool[d] for d in docs] + [rng.integers(3, args.vocab, args.query_tokens).tolist()]
        body = dict(segments=segments, max_tokens=int(rng.integers(1, args.max_tokens + 1)),
                    temperature=float(rng.choice([0.0, 0.7])), seed=int(rng.integers(1 << 30)),
                    pic_mode=str(rng.choice(["transition_rope_recompute", "transition_rope_recompute",
                                             "prefix_cache", "full_recompute"])),
                    cache_salt=str(rng.choice(["", "tenant-a", "tenant-b"])), return_token_ids=True)
        kind = rng.random()
        if kind < args.bad:
            return "bad", dict(body, **self.BAD[int(rng.integers(len(self.BAD)))])
        if kind < args.bad + args.cancel:
            return "cancel", dict(body, stream=True, max_tokens=args.max_tokens, ignore_eos=True)  # long enough to leave
        return ("stream", dict(body, stream=True)) if rng.random() < 0.5 else ("whole", body)


async def one(client, kind: str, body: dict, outcomes: dict) -> None:
    try:
        if kind == "whole" or kind == "bad":
            response = await client.post("/v1/completions", json=body)
            status = response.status_code
            if kind == "bad":
                ok = 400 <= status < 500 and "error" in response.json()
                outcomes["bad input answered 4xx" if ok else f"bad input answered {status}"] += 1
            else:
                outcomes["answered" if status == 200 else f"status {status}"] += 1
            return
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                outcomes[f"status {response.status_code}"] += 1
                return
            tokens = 0
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    payload = json.loads(line[6:])
                    if "error" in payload:
                        outcomes[f"stream error {payload['error'].get('code')}"] += 1
                        return
                    tokens += sum(len(c.get("token_ids") or []) for c in payload.get("choices", []))
                    if kind == "cancel" and tokens >= 2:
                        outcomes["cancelled by the client"] += 1
                        return  # leaving the stream closes the connection: the server cancels the request
                if line == "data: [DONE]":
                    outcomes["answered"] += 1
                    return
            outcomes["stream ended without [DONE]"] += 1
    except (httpx.TransportError, httpx.TimeoutException) as error:
        outcomes[f"unanswered ({type(error).__name__})"] += 1


async def drive(args, base: str, pid: int) -> tuple[list[dict], dict]:
    import collections

    rng = np.random.default_rng(args.seed)
    mix, outcomes, samples, tasks = Mix(args, rng), collections.Counter(), [], set()
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=base, timeout=args.request_timeout, limits=limits) as client:
        start = time.monotonic()
        next_sample, next_arrival = start, start

        async def sample():
            text = (await client.get("/metrics")).text
            row = dict(minute=round((time.monotonic() - start) / 60, 3), **process_sample(pid),
                       cache_bytes=metric(text, "hypic:cache_bytes"), cache_entries=metric(text, "hypic:cache_entries"),
                       tier_entries=metric(text, "hypic:tier_entries"),
                       device_mb=metric(text, "hypic:device_memory_bytes") / 2**20,
                       compiles=metric(text, "hypic:compilations_while_serving_total"),
                       requests=sum(outcomes.values()))
            samples.append(row)
            print(json.dumps(row), flush=True)

        while time.monotonic() - start < 60 * args.minutes:
            now = time.monotonic()
            if now >= next_sample:
                await sample()
                next_sample += args.sample_every
            if now >= next_arrival:
                kind, body = mix.next()
                task = asyncio.create_task(one(client, kind, body, outcomes))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                next_arrival += rng.exponential(1.0 / args.rate)
            await asyncio.sleep(max(0.0, min(next_sample, next_arrival) - time.monotonic()))
        await asyncio.gather(*tasks)
        await sample()
    return samples, dict(outcomes)


def growth(samples: list[dict], warmup_minutes: float) -> dict:
    """Per resource, over the samples after the warm-up: the least-squares slope per hour, and the growth from the
    first third of them to the last third, of their median and of their minimum. A process's memory swings with
    the requests in flight (buffers taken and given back); the minimum is its floor between them and the median
    its usual level, so a leak shows as both rising, where one sample against another measures the swing."""
    after = [s for s in samples if s["minute"] >= warmup_minutes]
    if len(after) < 3:
        return {}
    t = np.array([s["minute"] for s in after]) / 60
    third = max(1, len(after) // 3)
    out = {}
    for key in RESOURCES + ("device_mb", "cache_bytes", "tier_entries"):
        y = np.array([s.get(key, 0.0) for s in after], float)
        first, last = y[:third], y[-third:]

        def change(f):
            return float((f(last) - f(first)) / f(first)) if f(first) else 0.0

        out[key] = dict(first=float(np.median(first)), last=float(np.median(last)), median_growth=change(np.median),
                        floor_growth=change(np.min),
                        slope_per_hour=float(np.polyfit(t, y, 1)[0]) if np.ptp(t) > 0 else 0.0)
    return out


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: the built-in model)")
    parser.add_argument("--small", action="store_true", help="CPU: float32")
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--warmup-minutes", type=float, default=10.0)
    parser.add_argument("--sample-every", type=float, default=60.0, help="seconds between samples")
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second (Poisson)")
    parser.add_argument("--pool", type=int, default=32, help="documents at the start")
    parser.add_argument("--new-docs", type=float, default=0.2, help="chance that a request adds a new document")
    parser.add_argument("--docs", type=int, default=3)
    parser.add_argument("--doc-tokens", type=int, default=64)
    parser.add_argument("--query-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--bad", type=float, default=0.05, help="share of bad inputs")
    parser.add_argument("--cancel", type=float, default=0.05, help="share of streams the client leaves early")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--cache-gb", type=float, default=0.05, help="device cache: small, so that it evicts")
    parser.add_argument("--host-cache-gb", type=float, default=0.05)
    parser.add_argument("--disk-cache-dir", default=None, help="a disk tier (default: none)")
    parser.add_argument("--compile-cache", default=None)
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--port", type=int, default=8768)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    return parser


def main() -> None:
    args = parser().parse_args()
    prompt = args.docs * args.doc_tokens + args.query_tokens
    rung = 1 << (prompt - 1).bit_length()
    command = [*([args.model] if args.model else []),
               "--port", str(args.port), "--max-prompt-tokens", str(rung), "--token-rungs", str(rung),
               "--max-new-tokens", str(args.max_tokens), "--max-batch", "8", "--cache-gb", f"{args.cache_gb:g}",
               "--host-cache-gb", f"{args.host_cache_gb:g}", "--log-level", "warning",
               *(["--dtype", "float32"] if args.small else []),
               *(["--disk-cache-dir", args.disk_cache_dir] if args.disk_cache_dir else []),
               *(["--compile-cache", args.compile_cache] if args.compile_cache else [])]
    server = launch(command)
    base = f"http://127.0.0.1:{args.port}"
    try:
        wait_ready(base, server)
        samples, outcomes = asyncio.run(drive(args, base, server.pid))
    finally:
        server.terminate()
        server.wait(120)
    out = dict(minutes=args.minutes, rate=args.rate, outcomes=outcomes, growth=growth(samples, args.warmup_minutes),
               compiles=samples[-1]["compiles"], exit_status=server.returncode, samples=samples)
    unanswered = sum(v for k, v in outcomes.items() if k.startswith("unanswered") or "without" in k)
    print("outcomes:", json.dumps(outcomes, sort_keys=True))
    for key, row in out["growth"].items():
        print(f"  {key:<13} median {row['first']:>12.1f} -> {row['last']:>12.1f} ({100 * row['median_growth']:+6.2f}%)"
              f"  floor {100 * row['floor_growth']:+6.2f}%  slope {row['slope_per_hour']:+.2f}/h")
    print(f"unanswered: {unanswered}; compilations while serving: {out['compiles']:g}; "
          f"the server exited with {server.returncode} on SIGTERM")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
