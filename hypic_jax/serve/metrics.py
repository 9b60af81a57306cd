"""Prometheus metrics of the server, named after vLLM's with the `hypic:` prefix (one registry per server).

Histograms: hypic:time_to_first_token_seconds (arrival to first token), hypic:inter_token_latency_seconds,
hypic:e2e_request_latency_seconds, hypic:request_queue_time_seconds, hypic:request_prefill_time_seconds,
hypic:decode_stall_seconds (how long running streams waited on a prefill between two decode steps).
Gauges: hypic:num_requests_waiting, hypic:num_requests_running, hypic:cache_bytes, hypic:cache_capacity_bytes,
hypic:cache_entries (the first device's), hypic:device_cache_entries{device} (with --devices N: the entries each
device of the segment mesh holds in its own pools). Counters (exposed with `_total`): hypic:prompt_tokens, hypic:cached_tokens,
hypic:recomputed_tokens, hypic:cold_tokens, hypic:generation_tokens, hypic:cache_queries{kind},
hypic:cache_hits{kind} (segments looked up and found, kind "pic" or "prefix"), hypic:cache_evictions,
hypic:request_success{finished_reason}, hypic:request_errors{code}, hypic:requests_rejected (429: a full queue or an overload),
hypic:requests_shed (of those, queued requests answered 429 before their prefill), hypic:decode_rows_moved,
hypic:decode_fused_steps (decode steps that carried an admission in one program, --fused-prefill-tokens),
hypic:tier_entries{tier}, hypic:tier_bytes{tier}, hypic:tier_off{tier} (1 while a fault of its medium has turned it
off), hypic:tier_turned_off{tier}, hypic:tier_write_errors{tier}, hypic:tier_corrupt_files{tier} (the tiers below
the device: peer, host, disk), hypic:decode_steps{chained} (batched decode steps; chained "true": dispatched before the host had read the step
before, `Scheduler(overlap=True)`), hypic:compilations_while_serving (XLA compilations since the server became
ready, other than the planned ones of larger rungs compiling in the background), hypic:programs_pending (those
still compiling), hypic:device_memory_bytes{device} and hypic:device_memory_peak_bytes{device} (where the backend
reports them: GPUs, not the CPU), hypic:device_cache_fetches (entries copied from another device's pools to the first device's),
hypic:decode_bucket_steps{bucket} and hypic:decode_rows{bucket} (steps per batch bucket, and the running rows they
stepped: with a step time per bucket, the tokens/s the batched step alone would give the same rows, as
bench/serve.py reports), hypic:prefill_pieces (cold prefills spread between decode steps, `--prefill-chunk`),
hypic:scheduler_seconds{part} (the scheduler loop waiting for the device, and doing its own host work).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from hypic_jax.engine.programs import backend_compiles, background_compiles

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0)
TOKEN_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)


_TIER_GAUGES = (("entries", "hypic:tier_entries", "Entries held by each tier below the device."),
                ("bytes", "hypic:tier_bytes", "Bytes held by each tier below the device."),
                ("off", "hypic:tier_off", "1 while a tier is turned off by a fault of its medium (a full or "
                 "read-only disk, host memory that cannot be had), else 0."))
_TIER_COUNTERS = (("turned_off", "hypic:tier_turned_off", "Times a tier was turned off by a fault of its medium."),
                  ("write_errors", "hypic:tier_write_errors", "Entries a tier failed to write (dropped)."),
                  ("corrupt", "hypic:tier_corrupt_files", "Corrupt or truncated disk files found, removed, never "
                   "served."))


class _EngineCollector:
    """Read at scrape time: the segment cache's state and the compilations since `ready`."""

    def __init__(self, engine, metrics: "Metrics"):
        self.engine, self.metrics = engine, metrics

    def _tiers(self):
        """The tiers below the device (`Tiers.stats`, which waits for nothing), labelled by tier."""
        tiers = self.engine.tiers.stats()
        present = [(name, tiers[name]) for name in ("peer", "host", "disk") if tiers.get(name) is not None]
        for key, name, doc in _TIER_GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["tier"])
            for tier, stats in present:
                family.add_metric([tier], float(stats[key]))
            yield family
        for key, name, doc in _TIER_COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["tier"])
            for tier, stats in present:
                family.add_metric([tier], float(stats[key]))
            yield family

    def collect(self):
        stats = self.engine.cache.stats
        yield GaugeMetricFamily("hypic:cache_bytes", "Bytes held by cache entries.", value=stats.bytes)
        yield GaugeMetricFamily("hypic:cache_capacity_bytes", "The cache's byte budget.", value=stats.capacity_bytes)
        yield GaugeMetricFamily("hypic:cache_entries", "Cache entries.", value=stats.entries)
        yield from self._tiers()
        yield CounterMetricFamily("hypic:cache_evictions", "Entries evicted from the cache.", value=stats.evictions)
        mesh = getattr(self.engine, "segment_mesh", None)
        if mesh is not None and mesh.pools is not None:
            held = GaugeMetricFamily("hypic:device_cache_entries", "Cache entries in each mesh device's pools.",
                                     labels=["device"])
            for k, cache in enumerate(mesh.pools.caches):
                held.add_metric([str(k)], len(cache))
            yield held
            yield CounterMetricFamily("hypic:device_cache_fetches", "Entries copied from another device's pools to "
                                      "the first device's.", value=mesh.pools.stats.fetches)
        base = self.metrics.compiles_at_ready
        yield CounterMetricFamily("hypic:compilations_while_serving",
                                  "XLA compilations since the server became ready, other than the planned programs "
                                  "of larger prompts compiling in the background (0 when every program was "
                                  "compiled in warmup).", value=0 if base is None else
                                  backend_compiles() - background_compiles() - base)
        yield GaugeMetricFamily("hypic:programs_pending", "Programs of larger prompts still compiling in the "
                                "background.", value=self.engine.programs.stats.pending)
        yield from self._device_memory()

    def _device_memory(self):
        """Bytes in use and their peak on each device the programs run on, where the backend reports them (GPUs;
        the CPU reports none, and the families are then empty)."""
        used = GaugeMetricFamily("hypic:device_memory_bytes", "Device memory in use.", labels=["device"])
        peak = GaugeMetricFamily("hypic:device_memory_peak_bytes", "The peak of device memory in use.",
                                 labels=["device"])
        for device in self.engine.programs.devices():
            stats = device.memory_stats() or {}
            if "bytes_in_use" in stats:
                used.add_metric([str(device.id)], stats["bytes_in_use"])
                peak.add_metric([str(device.id)], stats.get("peak_bytes_in_use", stats["bytes_in_use"]))
        yield used
        yield peak


class Metrics:
    def __init__(self, engine, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        self.compiles_at_ready: int | None = None
        h = lambda name, doc, buckets=LATENCY_BUCKETS: Histogram(name, doc, buckets=buckets, registry=r)  # noqa: E731
        self.ttft = h("hypic:time_to_first_token_seconds", "Time from arrival to the first token.")
        self.itl = h("hypic:inter_token_latency_seconds", "Time between two tokens of one request.", TOKEN_BUCKETS)
        self.e2e = h("hypic:e2e_request_latency_seconds", "Time from arrival to the last token.")
        self.queue_time = h("hypic:request_queue_time_seconds", "Time a request waited in the queue.")
        self.prefill_time = h("hypic:request_prefill_time_seconds", "Prefill time (cold segments and stitching).")
        self.stall = h("hypic:decode_stall_seconds", "Time running streams waited on a prefill between two steps.")
        self.waiting = Gauge("hypic:num_requests_waiting", "Requests in the queue.", registry=r)
        self.running = Gauge("hypic:num_requests_running", "Requests holding a decode row.", registry=r)
        c = lambda name, doc, labels=(): Counter(name, doc, labelnames=labels, registry=r)  # noqa: E731
        self.prompt_tokens = c("hypic:prompt_tokens", "Prompt tokens of prefilled requests.")
        self.cached_tokens = c("hypic:cached_tokens", "Prompt tokens served from cache entries.")
        self.recomputed_tokens = c("hypic:recomputed_tokens", "Tokens of the final (stitched) forwards.")
        self.cold_tokens = c("hypic:cold_tokens", "Tokens prefilled in isolation to create cache entries.")
        self.generation_tokens = c("hypic:generation_tokens", "Generated tokens.")
        self.cache_queries = c("hypic:cache_queries", "Segments looked up in the cache.", ("kind",))
        self.cache_hits = c("hypic:cache_hits", "Segments found in the cache.", ("kind",))
        self.success = c("hypic:request_success", "Finished requests.", ("finished_reason",))
        self.errors = c("hypic:request_errors", "Accepted requests that ended in an error.", ("code",))
        self.rejected = c("hypic:requests_rejected", "Requests refused with 429: the queue was full, or the predicted wait for a first token too long.")
        self.rows_moved = c("hypic:decode_rows_moved", "Running streams moved into a lower free row of the batched "
                            "decode cache so that the steps take a smaller bucket (--compact-rows).")
        self.fused_steps = c("hypic:decode_fused_steps", "Decode steps that carried a request's admission (its "
                             "stitched forward) in one program with them (--fused-prefill-tokens).")
        self.shed = c("hypic:requests_shed", "Queued requests answered 429 before their prefill, their predicted first "
                      "token past max_queue_wait (also counted in hypic:requests_rejected).")
        self.decode_steps = c("hypic:decode_steps", "Batched decode steps; chained: dispatched before the host read "
                              "the step before.", ("chained",))
        self.decode_rows = c("hypic:decode_rows", "Running requests' rows in batched decode steps (a step over b rows "
                             "of which r run counts r here and 1 under its bucket).", ("bucket",))
        self.decode_bucket_steps = c("hypic:decode_bucket_steps", "Batched decode steps per batch bucket (rows).",
                                     ("bucket",))
        self.scheduler_time = c("hypic:scheduler_seconds", "The scheduler loop's time: waiting for the device "
                                "(part device_wait) and the host's own work (part host).", ("part",))
        self.prefill_pieces = c("hypic:prefill_pieces", "Pieces of cold prefills run between decode steps "
                                "(--prefill-chunk).")
        r.register(_EngineCollector(engine, self))

    def mark_ready(self) -> None:
        self.compiles_at_ready = backend_compiles() - background_compiles()

    def _prefilled(self, request) -> None:
        stats = request.stats
        if stats is None:
            return
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.cached_tokens.inc(stats.cached_tokens)
        self.recomputed_tokens.inc(stats.recomputed_tokens)
        self.cold_tokens.inc(stats.cold_tokens)
        if stats.mode != "full_recompute":
            kind = "prefix" if stats.mode == "prefix_cache" else "pic"
            self.cache_queries.labels(kind).inc(stats.hits + stats.misses)
            self.cache_hits.labels(kind).inc(stats.hits)

    def record_finish(self, request, reason: str, end: float) -> None:
        self._prefilled(request)
        self.generation_tokens.inc(len(request.tokens))
        self.success.labels(reason).inc()
        if request.first_token_at is not None:
            self.e2e.observe(end - request.arrival)

    def record_error(self, request, error, end: float) -> None:
        self._prefilled(request)
        self.generation_tokens.inc(len(request.tokens))
        self.errors.labels(error.code or str(error.status)).inc()
