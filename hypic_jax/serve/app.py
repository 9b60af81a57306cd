"""The HTTP layer: an OpenAI-compatible Starlette app over one `StableEngine` and its `Scheduler`.

Endpoints: POST /v1/completions and /v1/chat/completions (JSON or SSE with `stream`), GET /v1/models and
/v1/models/{id}, /health (503 until warmup is done, then 200) and /metrics (Prometheus text). Handlers read the body
on the event loop (refused with 413 past `max_request_bytes`, before it is all read), then decode, validate and
tokenize it on one parsing thread, so a large prompt does not hold up /health or the other clients' streams; one
thread, in order, so requests still reach the scheduler's queue in the order their bodies arrived. Then they hand
the request to the scheduler thread and wait for its events; a client that goes away (a closed stream, or a closed
connection while a request waits for its answer or its first token) cancels its request, which frees its row. A
stream starts with the request's first token, so a request that fails before it is answered with its status.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import math
import os
import sys
import threading
import time
import uuid
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from hypic_jax.runtime import StableEngine, stack_layers
from hypic_jax.serve import protocol
from hypic_jax.serve.metrics import Metrics
from hypic_jax.serve.scheduler import ApiError, Request, Scheduler

log = logging.getLogger("hypic_jax.serve")
POLL_S = 0.25  # how often a waiting non-streaming handler checks that its client is still there


def default_max_request_bytes(max_prompt_tokens: int) -> int:
    """The body limit when none is given: 256 bytes per prompt token (room for JSON-escaped text, token-id lists
    and chat markup) plus 1 MiB for the other fields; 2 MiB at the default 4096 prompt tokens. A body within it
    can still be a prompt over the limit (a 400 once tokenized); one past it is refused before it is read."""
    return 256 * max_prompt_tokens + (1 << 20)


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def usage(stats, completion_tokens: int) -> dict:
    """OpenAI's usage block, with prompt_tokens_details.cached_tokens and the `pic` block of the prefill."""
    return dict(prompt_tokens=stats.prompt_tokens, completion_tokens=completion_tokens,
                total_tokens=stats.prompt_tokens + completion_tokens,
                prompt_tokens_details=dict(cached_tokens=stats.cached_tokens),
                pic=dict(mode=stats.mode, seam=stats.seam, segments=stats.segments, cached_tokens=stats.cached_tokens,
                         recomputed_tokens=stats.recomputed_tokens, cold_tokens=stats.cold_tokens, hits=stats.hits,
                         misses=stats.misses, prefill_s=round(stats.ttft_s, 6)))


class Server:
    """An OpenAI-compatible server over `engine` (a `StableEngine` with `max_batch` >= 1). `app` is the ASGI app;
    `warmup()` compiles every program, starts the scheduler and marks the server ready (the app's startup does it
    on a thread when `warm_on_start`)."""

    def __init__(self, engine: StableEngine, *, model_name: str = "hypic", max_queue: int = 256,
                 separator: str | None = None, chat_template: str | None = None, special_tokens: dict | None = None,
                 eos_ids=(), request_timeout: float = 600.0, warm_on_start: bool = True, registry=None,
                 overlap: bool = False, max_request_bytes: int | None = None):
        if max_request_bytes is None:
            max_request_bytes = default_max_request_bytes(engine.max_prompt_tokens)
        if isinstance(max_request_bytes, bool) or not isinstance(max_request_bytes, int) or max_request_bytes < 1:
            raise ValueError(f"--max-request-bytes must be a whole number of bytes >= 1, got {max_request_bytes!r}")
        self.engine, self.model_name = engine, model_name
        self.max_request_bytes = max_request_bytes
        # one thread: bodies are parsed in the order they arrived (module docstring)
        self._parser = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hypic-parse")
        self.tokenizer = engine.tokenizer
        self.separator = separator or engine.separator
        self.request_timeout = request_timeout
        self.metrics = Metrics(engine, registry)
        self.scheduler = Scheduler(engine, max_queue=max_queue, metrics=self.metrics, overlap=overlap)
        self.renderer = protocol.ChatRenderer(chat_template, special_tokens)
        self.limits = protocol.Limits(vocab_size=engine.vocab_size, max_prompt_tokens=engine.max_prompt_tokens,
                                      max_keys=engine.max_keys, max_new_tokens=engine.max_new_tokens,
                                      max_segments=engine.max_segments, top_logprobs=engine.top_logprobs,
                                      eos_ids=tuple(eos_ids))
        self.ready = False
        self.warm_on_start = warm_on_start
        self.warmup_error: str | None = None  # why the warmup failed (the server then stops: `on_warmup_failure`)
        self.on_warmup_failure = None  # called with the error when the warmup thread fails
        self.warmup_report: dict | None = None
        routes = [Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                  Route("/health", self.health, methods=["GET"]),
                  Route("/metrics", self.metrics_text, methods=["GET"])]
        self.app = Starlette(routes=routes, lifespan=self._lifespan,
                             exception_handlers={HTTPException: self._http_error, Exception: self._internal_error})

    # Lifecycle --------------------------------------------------------------------------------------------------
    def warmup(self) -> dict:
        start = time.perf_counter()
        self._programs_total = len(self.engine.programs.keys_for(self.engine.max_prompt_tokens))
        log.info("warming up: compiling %d programs (a progress bar on a terminal; /health counts them)",
                 self._programs_total)
        report = self.engine.warmup(progress=sys.stderr.isatty())
        self.warmup_report = dict(report, wall_s=round(time.perf_counter() - start, 3))
        self.metrics.mark_ready()
        self.scheduler.start()
        self.ready = True
        log.info("ready: %s", json.dumps(self.warmup_report))
        return self.warmup_report

    def _warmup_or_stop(self) -> None:
        """The startup's warmup: a failure (out of device memory, say) is logged, /health answers 500 with it, and
        the server stops instead of answering 503 forever."""
        try:
            self.warmup()
        except Exception as error:
            self.warmup_error = f"{type(error).__name__}: {error}"
            log.critical("warmup failed, the server stops: %s", self.warmup_error, exc_info=True)
            if self.on_warmup_failure is not None:
                self.on_warmup_failure(error)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        if self.warm_on_start and not self.ready:
            threading.Thread(target=self._warmup_or_stop, name="hypic-warmup", daemon=True).start()
        try:
            yield
        finally:
            self.scheduler.stop()
            self.persist()

    def persist(self) -> int | None:
        """On shutdown: every entry of the device and host tiers written to the disk tier, where there is one, so
        a restarted server serves them (`StableEngine.persist`); the entries on disk, or None without a disk tier.
        A failure is logged, never raised (the shutdown goes on)."""
        if not self.ready or self.engine.tiers.disk is None:
            return None
        log.info("writing the cache to the disk tier %s before exiting", self.engine.tiers.disk.folder)
        try:
            entries = self.engine.persist()
        except Exception:
            log.exception("writing the cache to the disk tier at shutdown failed")
            return None
        log.info("cache written to the disk tier: %d entries", entries)
        return entries

    # Plain endpoints --------------------------------------------------------------------------------------------
    async def health(self, request: HttpRequest) -> Response:
        if self.warmup_error is not None:
            return JSONResponse(dict(status="failed", error=self.warmup_error), status_code=500)
        if not self.ready:
            total = getattr(self, "_programs_total", None)
            return JSONResponse(dict(status="warming up", programs_compiled=self.engine.programs.stats.programs,
                                     programs_total=total), status_code=503)
        return JSONResponse(dict(status="ok", waiting=self.scheduler.waiting, running=self.scheduler.running))

    def _model_card(self) -> dict:
        return dict(id=self.model_name, object="model", created=0, owned_by="hypic-jax",
                    max_model_len=self.engine.max_keys)

    async def models(self, request: HttpRequest) -> Response:
        return JSONResponse(dict(object="list", data=[self._model_card()]))

    async def model(self, request: HttpRequest) -> Response:
        """One model by id (the openai client's `models.retrieve`); another id is a 404 `model_not_found`."""
        try:
            protocol.check_model(dict(model=request.path_params["model"]), (self.model_name,))
        except ApiError as error:
            return error_response(error)
        return JSONResponse(self._model_card())

    async def metrics_text(self, request: HttpRequest) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def _http_error(self, request: HttpRequest, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                       code=code, headers=exc.headers))  # a 405's Allow

    async def _internal_error(self, request: HttpRequest, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path, exc_info=exc)
        return error_response(ApiError(500, f"internal error: {exc}", code="internal_error"))

    # Generation -------------------------------------------------------------------------------------------------
    async def completions(self, request: HttpRequest) -> Response:
        return await self._generate(request, chat=False)

    async def chat(self, request: HttpRequest) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: HttpRequest, *, chat: bool) -> Response:
        try:
            if not self.ready:
                raise ApiError(503, "the server is warming up; see /health", code="not_ready")
            try:
                raw = await self._body(request)
            except ClientDisconnect:  # gone before its body arrived: nobody to answer, nothing went wrong here
                return Response(status_code=499)
            loop = asyncio.get_running_loop()
            # no await between the parse and `submit` below: the order of the parsing thread is the queue's
            parsed = await loop.run_in_executor(self._parser, self._parse, raw, chat)
        except ApiError as error:
            return error_response(error)
        events: asyncio.Queue = asyncio.Queue()

        def sink(event):
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is waiting any more
                loop.call_soon_threadsafe(events.put_nowait, event)

        kind = "chatcmpl" if chat else "cmpl"
        job = Request(parsed.segments, parsed.params, sink, mode=parsed.mode, seam=parsed.seam,
                      cache_salt=parsed.cache_salt, timeout=parsed.timeout or self.request_timeout,
                      tokenizer=self.tokenizer, id=f"{kind}-{uuid.uuid4().hex[:24]}")
        try:
            self.scheduler.submit(job)
        except ApiError as error:
            return error_response(error)
        meta = dict(id=job.id, created=int(time.time()), model=self.model_name)
        if parsed.stream:
            # the stream starts with the first event: a request that fails before its first token (a prefill the
            # cache cannot hold, its deadline in the queue) is answered with its status, not a 200 stream
            try:
                first = await self._next(request, job, events)
            except BaseException:
                self._cancel(job)  # the handler was cancelled
                raise
            if first is None:
                return Response(status_code=499)
            if first["type"] == "error":
                return error_response(first["error"])
            return EventStream(self._stream(job, events, parsed, meta, chat, first), lambda: self._cancel(job),
                               media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await self._collect(request, job, events, parsed, meta, chat)

    async def _body(self, request: HttpRequest) -> bytes:
        """The body, refused with 413 past `max_request_bytes`: by its Content-Length before any of it is read, and
        by the bytes read so far for a chunked body, which has none."""
        limit = self.max_request_bytes
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise ApiError(413, f"the request body is {int(length)} bytes, over the server's limit of {limit} bytes "
                           "(--max-request-bytes)", code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body is over the server's limit of {limit} bytes "
                               "(--max-request-bytes)", code="request_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    def _parse(self, raw: bytes, chat: bool) -> protocol.Parsed:
        """The body decoded, validated and tokenized (on the parsing thread: the CPU-heavy part of a request)."""
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as error:  # also integers past Python's digit limit, deep nesting
            raise ApiError(400, f"the body is not valid JSON: {error}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object", code="invalid_json")
        protocol.check_model(body, (self.model_name,))
        if chat:
            return protocol.parse_chat(body, self.limits, self.tokenizer, self.renderer)
        return protocol.parse_completion(body, self.limits, self.tokenizer, self.separator)

    def _cancel(self, job: Request) -> None:
        if not job.finished:
            job.cancel()
            self.scheduler.wake()

    async def _next(self, request, job, events) -> dict | None:
        """The request's next event; None once its client has gone (checked every POLL_S), which cancels it."""
        while True:
            try:
                return await asyncio.wait_for(events.get(), POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    self._cancel(job)
                    return None

    async def _collect(self, request, job, events, parsed, meta, chat) -> Response:
        texts, tokens, logprobs = [], [], []
        try:
            while True:
                event = await self._next(request, job, events)
                if event is None:
                    return Response(status_code=499)
                if event["type"] == "delta":
                    texts.append(event["text"])
                    tokens += event["token_ids"]
                    logprobs += event["logprobs"] or []
                elif event["type"] == "error":
                    return error_response(event["error"])
                else:
                    break
        finally:
            self._cancel(job)  # a no-op once finished; otherwise the handler was cancelled
        text, reason = "".join(texts), event["finish_reason"]
        lp = None
        if parsed.params.logprobs is not None:
            lp = (protocol.chat_logprobs if chat else protocol.completion_logprobs)(
                logprobs, protocol.TokenTexts(self.tokenizer))
        if chat:
            choice = dict(index=0, message=dict(role="assistant", content=text), logprobs=lp, finish_reason=reason)
            obj = "chat.completion"
        else:
            choice = dict(index=0, text=text, logprobs=lp, finish_reason=reason)
            obj = "text_completion"
        if parsed.return_token_ids:
            choice["token_ids"] = tokens
        return JSONResponse(dict(meta, object=obj, choices=[choice], usage=usage(event["stats"], len(tokens))))

    async def _stream(self, job, events, parsed, meta, chat, first):
        obj = "chat.completion.chunk" if chat else "text_completion"
        texts = protocol.TokenTexts(self.tokenizer)

        def chunk(text=None, reason=None, token_ids=None, logprobs=None, role=False):
            if chat:
                delta = {} if text is None else dict(content=text)
                if role:
                    delta["role"] = "assistant"
                choice = dict(index=0, delta=delta, logprobs=logprobs, finish_reason=reason)
            else:
                choice = dict(index=0, text=text or "", logprobs=logprobs, finish_reason=reason)
            if token_ids is not None:
                choice["token_ids"] = token_ids
            return _sse(dict(meta, object=obj, choices=[choice]))

        try:
            if chat:
                yield chunk("", role=True)
            count, event = 0, first
            while True:
                if event["type"] == "delta":
                    count += len(event["token_ids"])
                    lp = None
                    if parsed.params.logprobs is not None and event["logprobs"]:
                        lp = (protocol.chat_logprobs if chat else protocol.completion_logprobs)(event["logprobs"],
                                                                                                texts)
                    if event["text"] or lp is not None or parsed.return_token_ids:
                        yield chunk(event["text"], token_ids=event["token_ids"] if parsed.return_token_ids else None,
                                    logprobs=lp)
                    event = await events.get()
                elif event["type"] == "error":
                    yield _sse(event["error"].body())
                    yield "data: [DONE]\n\n"
                    return
                else:
                    yield chunk(None if chat else "", reason=event["finish_reason"])
                    if parsed.include_usage:
                        yield _sse(dict(meta, object=obj, choices=[], usage=usage(event["stats"], count)))
                    yield "data: [DONE]\n\n"
                    return
        finally:
            self._cancel(job)  # the client went away mid-stream (the response task was cancelled)


class EventStream(StreamingResponse):
    """A streamed answer that calls `on_close` however the response ends. The stream's generator cancels its
    request in its own `finally`, but a generator that never started runs none: a client gone between the first
    token and the first byte would leave its request decoding to its token limit."""

    def __init__(self, content, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def default_max_batch() -> int:
    """Decode rows when none are asked for: 64 on an accelerator, where a 64-row step costs 1.19x a 32-row one
    (bench/RESULTS.md, decode_step.py); 8 on the CPU, where every row bucket adds compile time to the warmup (the
    embedded model's: 258 s with 8 rows, 315 s with 64, on 2 cores)."""
    import jax

    return 8 if jax.default_backend() == "cpu" else 64


def build(model: str | None = None, *, dtype: str = "bfloat16", mode: str = "transition_rope_recompute",
          seam: float = 8, cache_gb: float = 1.0, max_queue: int = 256, max_batch: int | None = None,
          max_prompt_tokens: int = 4096, max_new_tokens: int = 256, max_segments: int = 64,
          separator: str = "<<PIC_SEP>>", request_timeout: float = 600.0, token_rungs=None,
          compile_cache: str | None = None, load_format: str = "auto", devices: int | None = None,
          policy: str = "lpt", slot_layouts: str = "auto", host_cache_gb: float = 0.0,
          disk_cache_dir: str | None = None, disk_cache_gb: float | None = None, eviction: str = "cost",
          tier_dtype: str | None = None, peer_cache_gb: float = 0.0, tensor_parallel: int | None = None,
          **server_options) -> Server:
    """A `Server` for a model folder (or `model.default_model()` when `model` is None), not yet warmed up.
    load_format "dummy": the folder's architecture with random weights (`serve.model.load_folder`). devices N > 1:
    cold segments prefilled over the first N devices by `policy` (`StableEngine(devices=...)`); None or 1 is the
    single-device path (a mesh of one device would only add programs). Both are checked before the model loads.
    max_batch None: `default_max_batch()` (64 decode rows on an accelerator, 8 on the CPU).
    host_cache_gb, disk_cache_dir, disk_cache_gb, eviction, tier_dtype, peer_cache_gb: the cache tiers below the
    device (`StableEngine`'s host_cache_bytes, disk_cache_dir, disk_cache_bytes, eviction, tier_dtype,
    peer_cache_bytes). tensor_parallel M > 1: the parameters, the entry pools and every program split over the
    first M devices (`StableEngine(tensor_parallel=...)`; a model folder is loaded straight into that split, random
    weights are made there); the tiers below the device pools are refused with it."""
    from hypic_jax.parallel import POLICIES
    from hypic_jax.serve.model import default_model, load_folder

    for flag, count in (("--devices", devices), ("--tensor-parallel-size", tensor_parallel)):
        if count is not None:
            import jax

            available = len(jax.devices())
            if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= available:
                raise ValueError(f"{flag} {count!r}: must be a count from 1 to {available}, the devices this "
                                 f"process sees ({jax.default_backend()})")
    tensor_parallel = None if tensor_parallel in (None, 1) else tensor_parallel
    if tensor_parallel is not None:
        tiers = [flag for flag, on in (("--host-cache-gb", host_cache_gb), ("--disk-cache-dir", disk_cache_dir),
                                       ("--peer-cache-gb", peer_cache_gb)) if on]
        if tiers:
            raise ValueError(f"{', '.join(tiers)}: the cache tiers below the device need the model on one device; "
                             f"with --tensor-parallel-size the entries stay in the device pools")
    if policy not in POLICIES:
        raise ValueError(f"--policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    for flag, value in (("--host-cache-gb", host_cache_gb), ("--peer-cache-gb", peer_cache_gb),
                        ("--disk-cache-gb", disk_cache_gb)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{flag} must be a finite number >= 0, got {value}")
    if disk_cache_dir is not None:
        try:
            Path(disk_cache_dir).mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ValueError(f"--disk-cache-dir {disk_cache_dir}: cannot create it ({error.strerror})") from None
        if not os.access(disk_cache_dir, os.W_OK | os.X_OK):
            raise ValueError(f"--disk-cache-dir {disk_cache_dir}: not writable")
    if peer_cache_gb and devices in (None, 1):
        raise ValueError("--peer-cache-gb needs --devices N with N >= 2 (the tier lives on the other devices)")
    if model is None and load_format != "auto":
        raise ValueError("--load-format dummy needs a MODEL folder (its config gives the shapes)")
    max_batch = default_max_batch() if max_batch is None else max_batch
    mesh = None
    if tensor_parallel is not None:
        from hypic_jax.runtime import tensor_parallel_mesh

        mesh = tensor_parallel_mesh(tensor_parallel)
    served = default_model(dtype) if model is None else load_folder(model, dtype, load_format, mesh=mesh)
    if served.max_context is not None and max_prompt_tokens + max_new_tokens > served.max_context:
        raise ValueError(f"max_prompt_tokens + max_new_tokens ({max_prompt_tokens + max_new_tokens}) exceeds the "
                         f"model's context of {served.max_context}")
    # the layers stacked in place: the engine scans them stacked, and a model as large as the device cannot be held
    # twice (`runtime.stack_layers`)
    engine = StableEngine(stack_layers(served.model, consume=True), tokenizer=served.tokenizer,
                          cache_bytes=int(cache_gb * (1 << 30)), mode=mode, seam=seam, separator=separator,
                          max_context=served.max_context, source=served.source,
                          max_prompt_tokens=max_prompt_tokens, max_new_tokens=max_new_tokens,
                          max_segments=max_segments, max_batch=max_batch, token_rungs=token_rungs,
                          compile_cache=compile_cache, devices=None if devices in (None, 1) else devices,
                          policy=policy, slot_layouts=slot_layouts, host_cache_bytes=int(host_cache_gb * (1 << 30)),
                          disk_cache_dir=disk_cache_dir,
                          disk_cache_bytes=None if disk_cache_gb is None else int(disk_cache_gb * (1 << 30)),
                          eviction=eviction, tier_dtype=tier_dtype,
                          peer_cache_bytes=int(peer_cache_gb * (1 << 30)),
                          tensor_parallel=None if mesh is None else list(mesh.devices.flat))
    return Server(engine, model_name=served.name, max_queue=max_queue, separator=separator,
                  chat_template=served.chat_template, special_tokens=served.special_tokens, eos_ids=served.eos_ids,
                  request_timeout=request_timeout, **server_options)


def main(args) -> int:
    """`hypic-jax serve`: build the server, warm it up in the background (/health says when), serve until stopped."""
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rungs = tuple(int(r) for r in args.token_rungs.split(",")) if args.token_rungs else None
    server = build(args.model, dtype=args.dtype, mode=args.mode, seam=args.seam, cache_gb=args.cache_gb,
                   max_queue=args.max_queue, max_batch=args.max_batch, max_prompt_tokens=args.max_prompt_tokens,
                   max_new_tokens=args.max_new_tokens, max_segments=args.max_segments, separator=args.separator,
                   request_timeout=args.request_timeout, token_rungs=rungs, compile_cache=args.compile_cache,
                   load_format=args.load_format, devices=args.devices, policy=args.policy,
                   slot_layouts=args.slot_layouts, overlap=args.overlap, host_cache_gb=args.host_cache_gb,
                   disk_cache_dir=args.disk_cache_dir, disk_cache_gb=args.disk_cache_gb, eviction=args.eviction,
                   tier_dtype=args.tier_dtype, peer_cache_gb=args.peer_cache_gb,
                   tensor_parallel=args.tensor_parallel_size, max_request_bytes=args.max_request_bytes)
    mesh = server.engine.segment_mesh
    placement = "1 device" if mesh is None else f"{mesh.size} devices (cold segments split by {mesh.policy})"
    if server.engine.placement is not None:
        placement += f", the model split over {len(server.engine.placement.device_set)} devices"
    log.info("serving %r on %s at http://%s:%d (warming up: /health answers 503 until ready)", server.model_name,
             placement, args.host, args.port)
    runner = uvicorn.Server(uvicorn.Config(server.app, host=args.host, port=args.port,
                                           log_level=args.log_level.lower()))
    server.on_warmup_failure = lambda error: setattr(runner, "should_exit", True)
    runner.run()
    return 1 if server.warmup_error is not None else 0
