"""How long `hypic-jax serve` takes to become ready: started with an empty compile cache (a newcomer's first run),
then again on the cache the first run filled.

Each run starts `hypic-jax serve [MODEL] [FLAGS...]` as its own process on a free port and polls `/health` until it
answers 200; reported: the seconds to ready, the programs compiled before ready and those still compiling in the
background (`programs_pending`), the time until none is pending, and one greedy completion's time once ready.

    python bench/first_start.py                      # the embedded model, the server's defaults
    python bench/first_start.py --model DIR -- --max-prompt-tokens 8192
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(url: str, timeout: float = 5.0):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None, None


def start(model: str | None, flags: list[str], cache: str, limit_s: float) -> dict:
    port = _port()
    command = [sys.executable, "-m", "hypic_jax.cli", "serve", *([model] if model else []), "--port", str(port),
               "--compile-cache", cache, "--log-level", "warning", *flags]
    began = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    row = dict(command=" ".join(command[1:]))
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with {process.returncode}: {process.stderr.read()[-2000:]}")
            if time.perf_counter() - began > limit_s:
                raise TimeoutError(f"not ready within {limit_s} s")
            status, body = _get(f"http://127.0.0.1:{port}/health")
            if status == 200:
                # a server that compiles nothing in the background reports no pending programs
                row.update(ready_s=round(time.perf_counter() - began, 2),
                           pending_at_ready=body.get("programs_pending", 0))
                break
            time.sleep(0.2)
        prompt = json.dumps(dict(prompt="<|doc|> Registry. Key 7QX2 holds 415.\n<<PIC_SEP>><|q|> Which value does "
                                        "key 7QX2 hold?<|a|>", max_tokens=4, temperature=0)).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=prompt,
                                         headers={"content-type": "application/json"})
        sent = time.perf_counter()
        with urllib.request.urlopen(request, timeout=600) as response:
            json.loads(response.read())
        row["first_completion_s"] = round(time.perf_counter() - sent, 3)
        while True:
            status, body = _get(f"http://127.0.0.1:{port}/health")
            if status == 200 and body.get("programs_pending", 0) == 0:
                row["all_programs_s"] = round(time.perf_counter() - began, 2)
                break
            if time.perf_counter() - began > limit_s:
                row["all_programs_s"] = None
                break
            time.sleep(0.5)
        _, metrics = None, urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        for line in metrics.splitlines():
            if line.startswith("hypic:compilations_while_serving"):
                row["compilations_while_serving"] = float(line.split()[-1])
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model folder (default: the embedded model)")
    parser.add_argument("--limit-s", type=float, default=1800.0)
    parser.add_argument("--json", default=None)
    parser.add_argument("flags", nargs="*", help="more flags of hypic-jax serve (after --)")
    args = parser.parse_args(argv)
    cache = tempfile.mkdtemp(prefix="hypic-first-start-")
    try:
        rows = [dict(start="empty compile cache", **start(args.model, args.flags, cache, args.limit_s)),
                dict(start="compile cache of the first run", **start(args.model, args.flags, cache, args.limit_s))]
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    report = dict(cpus=os.cpu_count(), rows=rows)
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
