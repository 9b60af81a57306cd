"""Crash consistency of the disk tier: `hypic-jax serve` killed (SIGKILL) while it writes entries under load, then
restarted on the same folder, cycle after cycle.

Each cycle starts the server on one disk folder and one compile cache (the programs load from the store after the
first start), sends concurrent requests over a pool of documents, kills the process at a random moment while
requests are in flight, and then, as a power loss between write and rename would, damages the folder: it truncates
and corrupts some entry files and leaves partial temporary files. The next start must come up (a failed start ends
the run) and must serve nothing it did not fully write. The load mixes `prefix_cache` and PIC requests. Every
checked answer of the restarted server, its entries taken from the disk tier where they are, must equal a
reference's: `full_recompute` for prefix_cache (prefix reuse is exact) and, for PIC, the same request under a new
cache salt, every entry computed afresh: the same greedy tokens, their log-probabilities within `--tolerance`.
Reported per cycle: requests answered before the kill, the entries of those requests missing from the disk after the
kill (`lost`: with write-through, an entry is written before its request is answered, so none should be), entry
files before and after the damage, the files the restart found corrupt and removed, the entries it read from disk,
and the answers checked. With `--write-through both`, the cycles alternate the server's `--disk-write-through` on
and off (off: entries reach the disk when the device cache demotes them, the cache kept small so that it does).

    python bench/crash.py --model DIR --cycles 20          # any model folder; CPU: add --dtype float32
    python bench/crash.py --small --cycles 4               # CPU: the embedded model, small shapes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np

from hypic_jax.cache.tiers.disk import read_header
from hypic_jax.serve.client import launch, metric, wait_ready


def start(args, folder: Path, write_through: bool) -> subprocess.Popen:
    command = [*([args.model] if args.model else []),
               "--port", str(args.port), "--dtype", args.dtype, "--max-batch", str(args.max_batch),
               "--max-prompt-tokens", str(args.rung), "--token-rungs", str(args.rung),
               "--max-new-tokens", str(args.max_tokens), "--max-segments", str(args.docs + 1),
               "--cache-gb", f"{args.cache_gb:g}", "--host-cache-gb", "0", "--disk-cache-dir", str(folder),
               "--compile-cache", str(args.compile_cache), "--log-level", "warning",
               *(["--disk-write-through"] if write_through else [])]
    return launch(command, stdout=subprocess.DEVNULL, stderr=None if args.verbose else subprocess.DEVNULL)


def prompts(args, rng: np.random.Generator, pool: list[list[int]], count: int) -> list[dict]:
    """Requests over the pool: prefix_cache ones over a few fixed orders (so prefixes repeat), PIC ones over random
    draws and orders."""
    orders = [rng.permutation(len(pool)).tolist() for _ in range(3)]
    out = []
    for k in range(count):
        if k % 2:
            docs = orders[k % len(orders)][: rng.integers(1, args.docs + 1)]
            mode = "prefix_cache"
        else:
            docs = rng.choice(len(pool), args.docs, replace=False).tolist()
            mode = "transition_rope_recompute"
        query = rng.integers(3, args.vocab, args.query_tokens).tolist()
        out.append(dict(segments=[pool[d] for d in docs] + [query], pic_mode=mode))
    return out


def body(prompt: dict, max_tokens: int, **extra) -> dict:
    return dict(prompt, max_tokens=max_tokens, temperature=0, logprobs=0, return_token_ids=True, **extra)


async def load(base: str, requests: list[dict], max_tokens: int, kill_after: float, server) -> list[dict]:
    """Send every request at once; kill the server `kill_after` seconds in. Returns the requests answered."""
    answered = []

    async def one(client, prompt):
        try:
            response = await client.post("/v1/completions", json=body(prompt, max_tokens))
            if response.status_code == 200:
                answered.append(prompt)
        except httpx.HTTPError:
            pass  # the kill

    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        tasks = [asyncio.create_task(one(client, p)) for p in requests]
        await asyncio.sleep(kill_after)
        server.send_signal(signal.SIGKILL)
        await asyncio.gather(*tasks)
    server.wait(30)
    return answered


def lost_entries(folder: Path, answered: list[dict]) -> dict:
    """The entries of the requests answered before the kill (their documents, by the kind of entry their mode
    keeps; a prefix entry is matched by its document, whatever came before it) against the entry files whose
    headers are whole after the kill: with write-through every one of them should be there, since an entry is
    written before its request is answered."""
    on_disk = {(h["kind"], tuple(h["tokens"])) for h in map(read_header, folder.glob("*/*.seg")) if h is not None}
    kind = {"prefix_cache": "prefix", "transition_rope_recompute": "pic"}
    wanted = {(kind[p["pic_mode"]], tuple(doc)) for p in answered for doc in p["segments"][:-1]}
    return dict(entries_of_answered=len(wanted), lost=len(wanted - on_disk))


def damage(folder: Path, rng: np.random.Generator, share: float) -> dict:
    """A power loss between write and rename, and torn sectors: truncate or corrupt a share of the entry files and
    leave partial temporary files beside them."""
    files = sorted(folder.glob("*/*.seg"))
    hit = [f for f in files if rng.random() < share]
    for k, path in enumerate(hit):
        data = bytearray(path.read_bytes())
        if k % 2:
            path.write_bytes(bytes(data[: rng.integers(0, len(data))]))
        else:
            data[rng.integers(0, len(data))] ^= 0xFF
            path.write_bytes(bytes(data))
    for k, path in enumerate(files[:2]):
        (path.parent / f".tmp-{path.stem}-{os.getpid()}-{k}").write_bytes(path.read_bytes()[: 100])
    return dict(files=len(files), damaged=len(hit))


def check(base: str, requests: list[dict], args) -> dict:
    """Each request as served (cache hits wherever its entries are, the disk's among them) against a reference:
    full_recompute for a prefix_cache request (prefix reuse is exact), and for a PIC request the same request
    under a new cache salt, whose entries are all computed afresh (an intact entry read from disk is the entry
    computed again). Greedy tokens equal, log-probabilities within the tolerance."""
    worst, checked, hits = 0.0, 0, 0
    with httpx.Client(base_url=base, timeout=300) as client:
        for prompt in requests:
            got = client.post("/v1/completions", json=body(prompt, args.max_tokens)).json()
            fresh = (dict(prompt, pic_mode="full_recompute") if prompt["pic_mode"] == "prefix_cache"
                     else dict(prompt, cache_salt=f"reference-{time.monotonic_ns()}"))
            want = client.post("/v1/completions", json=body(fresh, args.max_tokens)).json()
            hits += got["usage"]["pic"]["hits"]
            a, b = got["choices"][0], want["choices"][0]
            if a["token_ids"] != b["token_ids"]:
                raise AssertionError(f"different greedy tokens from the cache: {a['token_ids']} != {b['token_ids']}")
            gap = float(np.max(np.abs(np.subtract(a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"]))))
            if gap > args.tolerance:
                raise AssertionError(f"log-probabilities differ by {gap:.2e} (> {args.tolerance:g})")
            worst, checked = max(worst, gap), checked + 1
    return dict(checked=checked, worst_logprob_gap=worst, cache_hits=hits)


def run(args) -> dict:
    folder = Path(args.folder)
    folder.mkdir(parents=True, exist_ok=True)
    args.compile_cache = args.compile_cache or str(folder / "compile-cache")
    disk = folder / "disk"
    rng = np.random.default_rng(args.seed)
    pool = [rng.integers(3, args.vocab, int(n)).tolist()
            for n in rng.integers(args.doc_tokens // 2, args.doc_tokens + 1, args.pool)]
    base = f"http://127.0.0.1:{args.port}"
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.write_through]
    rows = []
    for cycle in range(args.cycles):
        write_through = modes[cycle % len(modes)]
        server = start(args, disk, write_through)
        try:
            ready_s = wait_ready(base, server, args.start_timeout)
            before = httpx.get(f"{base}/metrics").text
            requests = prompts(args, rng, pool, args.requests)
            if cycle:  # the restart serves only what was fully written: answers equal their references
                verified = check(base, requests[: args.checks], args)
                after = httpx.get(f"{base}/metrics").text
                rows[-1].update(verified, restart_ready_s=round(ready_s, 2),
                                corrupt_removed=metric(after, "hypic:tier_corrupt_files_total"),
                                disk_entries=metric(before, "hypic:tier_entries", tier="disk"))
                print(json.dumps(rows[-1]), flush=True)
            kill_after = float(rng.uniform(*args.kill_window))
            answered = asyncio.run(load(base, requests, args.max_tokens, kill_after, server))
            lost = lost_entries(disk, answered)
        finally:
            if server.poll() is None:
                server.kill()
                server.wait(30)
        rows.append(dict(cycle=cycle, write_through=write_through, killed_after_s=round(kill_after, 2),
                         answered_before_kill=len(answered), **lost, **damage(disk, rng, args.damage)))
    server = start(args, disk, False)  # the last restart: checked, then stopped
    try:
        ready_s = wait_ready(base, server, args.start_timeout)
        before = httpx.get(f"{base}/metrics").text
        verified = check(base, prompts(args, rng, pool, args.checks), args)
        after = httpx.get(f"{base}/metrics").text
        rows[-1].update(verified, restart_ready_s=round(ready_s, 2),
                        corrupt_removed=metric(after, "hypic:tier_corrupt_files_total"),
                        disk_entries=metric(before, "hypic:tier_entries", tier="disk"))
        print(json.dumps(rows[-1]), flush=True)
    finally:
        server.terminate()
        server.wait(60)
    return dict(cycles=args.cycles, restarts_failed=0, wrong_answers=0, rows=rows)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder (default: the built-in model)")
    p.add_argument("--small", action="store_true", help="CPU: float32 and small shapes")
    p.add_argument("--folder", default=None, help="the disk tier's and compile cache's parent folder (default: a "
                   "new temporary folder)")
    p.add_argument("--compile-cache", default=None)
    p.add_argument("--cycles", type=int, default=20)
    p.add_argument("--write-through", choices=["on", "off", "both"], default="both")
    p.add_argument("--requests", type=int, default=48, help="requests sent at once in each cycle")
    p.add_argument("--checks", type=int, default=4, help="requests checked against their references per restart")
    p.add_argument("--kill-window", type=float, nargs=2, default=(0.05, 1.0), metavar=("FROM", "TO"),
                   help="the kill comes this many seconds into the load, drawn uniformly")
    p.add_argument("--damage", type=float, default=0.2, help="share of the entry files truncated or corrupted")
    p.add_argument("--pool", type=int, default=16)
    p.add_argument("--docs", type=int, default=3)
    p.add_argument("--doc-tokens", type=int, default=48)
    p.add_argument("--query-tokens", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--rung", type=int, default=256)
    p.add_argument("--cache-gb", type=float, default=0.002, help="device cache: small, so that entries demote")
    p.add_argument("--vocab", type=int, default=256, help="token ids are drawn below this")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tolerance", type=float, default=1e-3, help="largest log-probability gap to a reference")
    p.add_argument("--port", type=int, default=8767)
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verbose", action="store_true", help="the server's log on stderr")
    p.add_argument("--json", default=None)
    return p


def main() -> None:
    args = parser().parse_args()
    if args.small:
        args.dtype = "float32"
    if args.folder is None:
        import tempfile

        args.folder = tempfile.mkdtemp(prefix="hypic-crash-")
    out = run(args)
    print(f"{out['cycles']} kill/restart cycles: every restart came up, every checked answer equal to "
          f"its reference (largest log-probability gap "
          f"{max(r.get('worst_logprob_gap', 0.0) for r in out['rows']):.2e})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
