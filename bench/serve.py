"""`hypic-jax serve` under a synthetic RAG trace: the highest arrival rate whose TTFT stays under an SLO, per mode.

The server runs as its own process (`python -m hypic_jax.cli serve`, warmed up before the trace). Requests: Poisson
arrivals at a fixed rate; each takes `--docs-per-request` documents from a pool, drawn by Zipf popularity without
replacement and shuffled (so a prefix cache rarely matches while a position-independent one does), plus a fresh
query; prompts are token-id segments (the `segments` extension), each streamed with greedy decoding. For each mode
(`pic_mode`) and rising rate, with a fresh `cache_salt` per run (every run starts cold): TTFT p50 / p99 (arrival
to the first token, client side), inter-token p50 / p99, decode tokens/s (generated tokens over the run's wall
time), the decode stall a prefill caused (the server's hypic:decode_stall_seconds: how much longer the streams' gap
between two steps was than a gap without a prefill), the share of decode steps dispatched before the host read the
one before (hypic:decode_steps{chained}), the share of the scheduler loop's time spent on host work rather than
waiting for the device (hypic:scheduler_seconds), and the compilations while serving (must be 0). With
`--step-json` (bench/decode_step.py's report of the same model on the same machine), also the decode tokens/s over
what the batched step alone gives the rows the server stepped ("of step": the steps the server ran, per bucket,
timed at decode_step.py's step times), and the stall in those step times. Always: the steps' mean batch bucket
beside the running rows per step (how tightly the rows fill the buckets), and the streams moved into lower rows
(`--compact-rows`, hypic:decode_rows_moved) and the steps that carried an admission in one program
(`--fused-prefill-tokens`, hypic:decode_fused_steps). The sustained rate of a mode is the
highest rate whose p50 and p99 TTFT are both under `--slo`, as are those of every lower rate.

    python bench/serve.py --small            # CPU smoke size: the embedded model in float32
    python bench/serve.py --model DIR --rates 1 2 4 8 16 32 --duration 60
    python bench/serve.py --random-35b       # the Qwen3.5-35B-A3B shape with random bf16 weights (GPU)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx
import numpy as np

from hypic_jax.serve.client import launch, metric, wait_ready

MODES = ("full_recompute", "prefix_cache", "transition_rope_recompute")


def sustained(rows, mode: str, slo: float) -> float:
    """The highest rate that holds the SLO with every lower rate of the run holding it too (a rate that passes
    above a failed one is noise of a short run, not capacity)."""
    held = 0.0
    for row in sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["rate"]):
        if row["ttft_p50"] >= slo or row["ttft_p99"] >= slo:
            break
        held = row["rate"]
    return held


def documents(args, vocab: int) -> list[list[int]]:
    """The pool, the same for every mode and rate."""
    rng = np.random.default_rng(12345)
    return [rng.integers(3, vocab, args.doc_tokens).tolist() for _ in range(args.pool)]


def trace(args, rng: np.random.Generator, vocab: int, rate: float):
    pool = documents(args, vocab)
    weights = 1.0 / np.arange(1, args.pool + 1) ** args.zipf
    weights /= weights.sum()
    t, out = 0.0, []
    while t < args.duration:
        t += rng.exponential(1.0 / rate)
        docs = rng.choice(args.pool, args.docs_per_request, replace=False, p=weights)
        rng.shuffle(docs)
        out.append((t, [pool[i] for i in docs] + [rng.integers(3, vocab, args.query_tokens).tolist()]))
    return out


async def one(client, body, start_at, t0):
    await asyncio.sleep(max(0.0, t0 + start_at - time.perf_counter()))
    arrival = time.perf_counter()
    times = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return dict(status=response.status_code)
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                payload = json.loads(line[6:])
                if payload.get("choices") and payload["choices"][0].get("token_ids"):
                    times.extend([time.perf_counter()] * len(payload["choices"][0]["token_ids"]))
    gaps = np.diff(times).tolist()
    return dict(status=200, ttft=times[0] - arrival if times else None, gaps=gaps, tokens=len(times),
                end=times[-1] if times else arrival)


async def warm_pool(args, base, mode, vocab, salt) -> float:
    """Every pool document once, `docs_per_request` to a request, one request at a time, one token each."""
    pool, rng = documents(args, vocab), np.random.default_rng(99)
    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        for i in range(0, len(pool), args.docs_per_request):
            segments = pool[i:i + args.docs_per_request] + [rng.integers(3, vocab, args.query_tokens).tolist()]
            response = await client.post("/v1/completions", json=dict(segments=segments, max_tokens=1, temperature=0,
                                                                    pic_mode=mode, cache_salt=salt))
            response.raise_for_status()
    return time.perf_counter() - start


def step_times(path: str | None) -> dict[int, float]:
    """Seconds per batched decode step by bucket (rows), from `bench/decode_step.py --json` (its first variant)."""
    if not path:
        return {}
    with open(path) as f:
        report = json.load(f)
    report = report["variants"][0] if "variants" in report else report
    return {int(s["rows"]): s["step_ms"] / 1e3 for s in report["steps"]}


def bucket_use(before: str, after: str) -> dict:
    """The decode steps' mean batch bucket and running rows per step (`hypic:decode_bucket_steps`,
    `hypic:decode_rows`), whatever the step times: how tightly the running rows fill the buckets stepped."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets = {s.labels["bucket"] for f in text_string_to_metric_families(after) for s in f.samples
               if s.name == "hypic:decode_bucket_steps_total"}
    steps = rows = weighted = 0.0
    for bucket in buckets:
        n = (metric(after, "hypic:decode_bucket_steps_total", bucket=bucket)
             - metric(before, "hypic:decode_bucket_steps_total", bucket=bucket))
        rows += (metric(after, "hypic:decode_rows_total", bucket=bucket)
                 - metric(before, "hypic:decode_rows_total", bucket=bucket))
        steps, weighted = steps + n, weighted + n * int(bucket)
    return dict(mean_bucket=weighted / steps, rows_per_step=rows / steps) if steps else {}


def capacity(before: str, after: str, steps_s: dict[int, float]) -> dict:
    """What the batched step alone gives the rows the server stepped: the running rows it stepped over the time
    its steps take at `steps_s` (tokens/s), and that mean step time."""
    rows = steps = step_time = 0.0
    for bucket, seconds in steps_s.items():
        n = (metric(after, "hypic:decode_bucket_steps_total", bucket=str(bucket))
             - metric(before, "hypic:decode_bucket_steps_total", bucket=str(bucket)))
        rows += (metric(after, "hypic:decode_rows_total", bucket=str(bucket))
                 - metric(before, "hypic:decode_rows_total", bucket=str(bucket)))
        steps += n
        step_time += n * seconds
    if not step_time:
        return {}
    return dict(step_capacity_tok_s=rows / step_time, mean_step_ms=1e3 * step_time / steps, rows_per_step=rows / steps)


async def run_rate(args, base, mode, rate, vocab, salt):
    rng = np.random.default_rng(int(rate * 1000) + 7)
    requests = trace(args, rng, vocab, rate)
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
        before = (await client.get("/metrics")).text
        t0 = time.perf_counter()
        results = await asyncio.gather(*[one(client, dict(segments=segs, max_tokens=args.max_tokens, temperature=0,
                                                          pic_mode=mode, cache_salt=salt, stream=True, ignore_eos=True,
                                                          return_token_ids=True), at, t0)
                                         for at, segs in requests])
        after = (await client.get("/metrics")).text
    ok = [r for r in results if r["status"] == 200 and r["ttft"] is not None]
    ttft = np.array([r["ttft"] for r in ok])
    gaps = np.array([g for r in ok for g in r["gaps"]] or [0.0])
    wall = max(r["end"] for r in ok) - t0
    stall_n = metric(after, "hypic:decode_stall_seconds_count") - metric(before, "hypic:decode_stall_seconds_count")
    stall_s = metric(after, "hypic:decode_stall_seconds_sum") - metric(before, "hypic:decode_stall_seconds_sum")
    steps = metric(after, "hypic:decode_steps_total") - metric(before, "hypic:decode_steps_total")
    chained = (metric(after, "hypic:decode_steps_total", chained="true")
               - metric(before, "hypic:decode_steps_total", chained="true"))
    loop = {part: metric(after, "hypic:scheduler_seconds_total", part=part)
            - metric(before, "hypic:scheduler_seconds_total", part=part) for part in ("host", "device_wait")}
    decode_tok_s = sum(r["tokens"] for r in ok) / wall
    step = capacity(before, after, args.step_times)
    if step:
        step["of_capacity"] = decode_tok_s / step["step_capacity_tok_s"]
        step["stall_steps"] = stall_s / stall_n / (step["mean_step_ms"] / 1e3) if stall_n else 0.0
    step = {**bucket_use(before, after), **step}
    return dict(mode=mode, rate=rate, requests=len(requests), answered=len(ok), **step,
                rows_moved=metric(after, "hypic:decode_rows_moved_total") - metric(before, "hypic:decode_rows_moved_total"),
                fused_steps=(metric(after, "hypic:decode_fused_steps_total")
                             - metric(before, "hypic:decode_fused_steps_total")),
                loop_host_s=loop["host"], loop_device_wait_s=loop["device_wait"],
                prefill_pieces=(metric(after, "hypic:prefill_pieces_total")
                                - metric(before, "hypic:prefill_pieces_total")),
                ttft_p50=float(np.percentile(ttft, 50)), ttft_p99=float(np.percentile(ttft, 99)),
                itl_p50=float(np.percentile(gaps, 50)), itl_p99=float(np.percentile(gaps, 99)),
                decode_tok_s=decode_tok_s,
                stall_mean_ms=1e3 * stall_s / stall_n if stall_n else 0.0,
                compiles=metric(after, "hypic:compilations_while_serving_total"),
                decode_steps=steps, chained_share=round(chained / steps, 3) if steps else 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: the built-in model)")
    parser.add_argument("--small", action="store_true", help="CPU smoke size")
    parser.add_argument("--rates", type=float, nargs="+", default=None,
                        help="arrival rates per second (default 1 to 32; --small: 0.5 to 16)")
    parser.add_argument("--mode-rates", nargs="+", default=[], metavar="MODE=R1,R2,...",
                        help="rates of one mode instead of --rates (e.g. prefix_cache=4,5,6)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per rate")
    parser.add_argument("--modes", nargs="+", default=list(MODES))
    parser.add_argument("--pool", type=int, default=200, help="documents in the pool")
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--docs-per-request", type=int, default=8)
    parser.add_argument("--doc-tokens", type=int, default=512)
    parser.add_argument("--query-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--slo", type=float, default=1.0, help="TTFT SLO (seconds) for p50 and p99")
    parser.add_argument("--vocab", type=int, default=512, help="token ids are drawn below this (the model's vocabulary)")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--random-35b", action="store_true", help="serve the Qwen3.5-35B-A3B shape (bench/prefill.py "
                        "full_config) with random weights (`hypic-jax serve --load-format dummy`)")
    parser.add_argument("--layers", type=int, default=40, help="--random-35b: layers")
    parser.add_argument("--token-rungs", type=int, nargs="+", default=None,
                        help="the server's token rungs (default: one rung, the prompt's power of two)")
    parser.add_argument("--cache-gb", type=float, default=None, help="the server's segment cache (default 16; "
                        "--small: 0.25)")
    parser.add_argument("--compile-cache", default=None, help="the server's compile cache folder")
    parser.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                        help="the server's --overlap / --no-overlap (default: the server's, on where the device is "
                             "not the CPU)")
    parser.add_argument("--prefill-chunk", type=int, default=None, metavar="TOKENS",
                        help="the server's --prefill-chunk")
    parser.add_argument("--compact-rows", action="store_true", help="the server's --compact-rows")
    parser.add_argument("--wait-programs", action=argparse.BooleanOptionalAction, default=True,
                        help="wait until the server's background compilations end before the first rate")
    parser.add_argument("--fused-prefill-tokens", type=int, default=None, metavar="TOKENS",
                        help="the server's --fused-prefill-tokens (admissions in one program with a decode step)")
    parser.add_argument("--step-json", default=None, metavar="FILE",
                        help="bench/decode_step.py --json of the same model and machine: report each rate's decode "
                             "tokens/s against what the batched step alone gives the rows the server stepped, and "
                             "the stall in step times")
    parser.add_argument("--fp8", action="store_true", help="the server's --quantize fp8 (block-wise FP8 weights)")
    parser.add_argument("--tensor-parallel-size", type=int, default=None, metavar="M",
                        help="the server's --tensor-parallel-size (the model split over M devices)")
    parser.add_argument("--devices", type=int, default=None, metavar="N", help="the server's --devices")
    parser.add_argument("--slot-layouts", default=None, choices=["default", "auto"],
                        help="the server's --slot-layouts (default: the server's default)")
    parser.add_argument("--warm-pool", action="store_true",
                        help="before a mode's first rate, send every pool document once (untimed, "
                        "--docs-per-request at a time) and keep that mode's cache salt for all its rates: the rates "
                        "then measure a warm cache instead of each starting cold")
    args = parser.parse_args()
    args.step_times = step_times(args.step_json)
    load = []
    if args.random_35b:
        import tempfile

        from common import full_config

        from hypic_jax.checkpoint import write_metadata

        config = full_config(args.layers)
        args.model = tempfile.mkdtemp(prefix="hypic-35b-")
        write_metadata(args.model, model_type="qwen3_5", config=config, dtype="bfloat16")
        args.vocab, load = config.vocab_size, ["--load-format", "dummy"]
    if args.small:  # float32: the CPU has no bfloat16 matrix units (the embedded model's bfloat16 runs emulated)
        args.rates, args.duration, args.pool = args.rates or [0.5, 1, 2, 4, 8, 16], 8.0, 32
        load = load + ["--dtype", "float32"]
        args.docs_per_request, args.doc_tokens, args.query_tokens, args.max_tokens, args.max_batch = 4, 64, 16, 16, 8
    args.rates = args.rates or [1, 2, 4, 8, 16, 32]
    mode_rates = {}
    for item in args.mode_rates:
        mode, _, rates = item.partition("=")
        if mode not in MODES or not rates:
            raise SystemExit(f"--mode-rates takes MODE=R1,R2,... with MODE one of {MODES}, got {item!r}")
        mode_rates[mode] = [float(r) for r in rates.split(",")]
    prompt = args.docs_per_request * args.doc_tokens + args.query_tokens
    rungs = sorted(args.token_rungs or [1 << (prompt - 1).bit_length()])
    if rungs[-1] < prompt:
        raise SystemExit(f"the largest token rung ({rungs[-1]}) is below the prompt's {prompt} tokens")
    cache_gb = args.cache_gb if args.cache_gb is not None else (0.25 if args.small else 16)
    command = [*([args.model] if args.model else []),
               "--port", str(args.port), "--max-batch", str(args.max_batch), "--max-prompt-tokens", str(rungs[-1]),
               "--token-rungs", ",".join(map(str, rungs)), "--max-new-tokens", str(args.max_tokens),
               "--max-queue", "100000", "--cache-gb", f"{cache_gb:g}", "--log-level", "warning", *load,
               *(["--compile-cache", args.compile_cache] if args.compile_cache else []),
               *(["--slot-layouts", args.slot_layouts] if args.slot_layouts else []),
               *([] if args.overlap is None else ["--overlap" if args.overlap else "--no-overlap"]),
               *(["--prefill-chunk", str(args.prefill_chunk)] if args.prefill_chunk else []),
               *(["--compact-rows"] if args.compact_rows else []),
               *(["--fused-prefill-tokens", str(args.fused_prefill_tokens)] if args.fused_prefill_tokens else []),
               *(["--quantize", "fp8"] if args.fp8 else []),
               *(["--tensor-parallel-size", str(args.tensor_parallel_size)] if args.tensor_parallel_size else []),
               *(["--devices", str(args.devices)] if args.devices else [])]
    server = launch(command)
    base = f"http://127.0.0.1:{args.port}"
    rows = []
    try:
        start = time.perf_counter()
        wait_ready(base, server)
        print(f"server ready in {time.perf_counter() - start:.1f} s: hypic-jax serve {' '.join(command)}", flush=True)
        if args.wait_programs:  # the steady state: no background compilation sharing the machine with the rates
            start = time.perf_counter()
            while metric(httpx.get(f"{base}/metrics", timeout=30).text, "hypic:programs_pending") > 0:
                if time.perf_counter() - start > 1800:
                    raise SystemExit("the server's background compilations did not end within 30 minutes")
                time.sleep(1.0)
            print(f"background compilations done {time.perf_counter() - start:.1f} s later", flush=True)
        vocab = args.vocab
        header = (f"{'mode':<26} {'rate/s':>6} {'n':>4} {'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} {'p99':>8} "
                  f"{'decode tok/s':>12} {'of step':>7} {'stall ms':>8} {'steps':>5} {'chained':>7} {'host %':>6} "
                  f"{'bucket':>6} {'rows':>5} {'moved':>5} {'fused':>5} {'compiles':>8}")
        print(header)
        for mode in args.modes:
            if args.warm_pool:
                seconds = asyncio.run(warm_pool(args, base, mode, vocab, salt=mode))
                print(f"{mode}: {args.pool} pool documents sent once in {seconds:.1f} s (untimed)", flush=True)
            for rate in mode_rates.get(mode, args.rates):
                salt = mode if args.warm_pool else f"{mode}-{rate}"
                row = asyncio.run(run_rate(args, base, mode, rate, vocab, salt=salt))
                rows.append(row)
                print(f"{mode:<26} {rate:>6g} {row['answered']:>4} {row['ttft_p50']:>9.3f} {row['ttft_p99']:>8.3f} "
                      f"{row['itl_p50']:>8.4f} {row['itl_p99']:>8.4f} {row['decode_tok_s']:>12.1f} "
                      f"{row.get('of_capacity', float('nan')):>7.2f} {row['stall_mean_ms']:>8.1f} "
                      f"{row.get('stall_steps', float('nan')):>5.2f} {row['chained_share']:>7.2f} "
                      f"{100 * row['loop_host_s'] / max(1e-9, row['loop_host_s'] + row['loop_device_wait_s']):>6.1f} "
                      f"{row.get('mean_bucket', float('nan')):>6.2f} {row.get('rows_per_step', float('nan')):>5.2f} "
                      f"{row['rows_moved']:>5g} {row['fused_steps']:>5g} {row['compiles']:>8g}", flush=True)
                if row["ttft_p99"] > 4 * args.slo:  # far past the SLO: higher rates only queue longer
                    break
        print(f"\nsustained rate (p50 and p99 TTFT < {args.slo} s):")
        for mode in args.modes:
            print(f"  {mode:<26} {sustained(rows, mode, args.slo):g} requests/s")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
