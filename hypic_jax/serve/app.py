"""The HTTP layer: an OpenAI-compatible Starlette app over one `Engine` and its scheduler.

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
import dataclasses
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

from hypic_jax.engine import Engine, EngineOptions
from hypic_jax.engine.scheduler import Request
from hypic_jax.engine.scheduler import RequestError as ApiError
from hypic_jax.options import OptionGroup, number, option, whole
from hypic_jax.serve import protocol
from hypic_jax.serve.metrics import Metrics

log = logging.getLogger("hypic_jax.serve")
POLL_S = 0.25  # how often a waiting non-streaming handler checks that its client is still there


@dataclasses.dataclass(frozen=True)
class ServerOptions(OptionGroup):
    """The HTTP server (`hypic-jax serve`); the engine's options are `EngineOptions`."""

    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8000, "port to listen on", check=whole(0))
    max_request_bytes: int | None = option(
        None, "largest request body; a larger one is refused with 413 before it is read whole (derived: 256 bytes "
        "per prompt token of max_prompt_tokens plus 1 MiB)", check=whole(1, optional=True), metavar="BYTES")
    ready_tokens: int | None = option(
        None, "become ready (/health 200) once the programs for prompts up to this many tokens are compiled; the "
        "larger ones compile in the background, and a request that needs one waits for it (derived: 1024 on the "
        "CPU, every prompt size on an accelerator)", check=whole(1, optional=True))
    shutdown_timeout: float = option(
        30.0, "on the first SIGTERM or SIGINT, seconds to let accepted requests finish (new ones are answered 503) "
        "before the server answers the rest 503, writes its tiers to the disk tier and exits; a second signal "
        "stops at once", check=number(0), metavar="SECONDS")


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
    """An OpenAI-compatible server over `engine`. `app` is the ASGI app; `warmup()` compiles the programs, starts
    the engine's scheduler on its thread and marks the server ready (the app's startup does it on a thread when
    `warm_on_start`). Its shutdown closes the engine (`Engine.close`: the tiers reach the disk tier)."""

    def __init__(self, engine: Engine, options: ServerOptions | None = None, *, model_name: str = "hypic",
                 chat_template: str | None = None, special_tokens: dict | None = None, eos_ids=(),
                 warm_on_start: bool = True, registry=None):
        options = options or ServerOptions()
        self.options = options
        max_request_bytes = options.max_request_bytes or default_max_request_bytes(engine.max_prompt_tokens)
        self.engine, self.model_name = engine, model_name
        self.max_request_bytes = max_request_bytes
        # one thread: bodies are parsed in the order they arrived (module docstring)
        self._parser = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hypic-parse")
        self.tokenizer = engine.tokenizer
        self.separator = engine.separator
        self.request_timeout = engine.options.scheduler.request_timeout
        self.metrics = Metrics(engine, registry)
        self.scheduler = engine.scheduler
        self.scheduler.metrics = self.metrics
        self.renderer = protocol.ChatRenderer(chat_template, special_tokens)
        self.limits = protocol.Limits(vocab_size=engine.vocab_size, max_prompt_tokens=engine.max_prompt_tokens,
                                      max_keys=engine.max_keys, max_new_tokens=engine.max_new_tokens,
                                      max_segments=engine.max_segments, top_logprobs=engine.top_logprobs,
                                      eos_ids=tuple(eos_ids))
        self.ready = False
        self.draining = False  # `drain`: new requests are refused while the accepted ones finish
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
    def ready_tokens(self) -> int | None:
        """The prompt size up to which programs are compiled before the server is ready (None: every size)."""
        if self.options.ready_tokens is not None:
            return self.options.ready_tokens
        import jax

        return 1024 if jax.default_backend() == "cpu" else None

    def warmup(self) -> dict:
        start = time.perf_counter()
        self._programs_total = len(self.engine.programs.keys_for(self.engine.max_prompt_tokens))
        log.info("warming up: compiling %d programs (a progress bar on a terminal; /health counts them)",
                 self._programs_total)
        report = self.engine.warmup(progress=sys.stderr.isatty(), ready_tokens=self.ready_tokens())
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
            self.close()

    def drain(self, timeout: float | None = None) -> bool:
        """The first half of a graceful shutdown: /health and new requests answer 503 while the queued and running
        ones go on, for up to `timeout` seconds (`ServerOptions.shutdown_timeout`). True when every accepted
        request finished; `close` then answers what is left with a 503 error."""
        timeout = self.options.shutdown_timeout if timeout is None else timeout
        self.draining = True
        self.scheduler.close_intake()
        log.info("draining: %d running, %d waiting (up to %.0f s)", self.scheduler.running, self.scheduler.waiting,
                 timeout)
        end = time.monotonic() + timeout
        while not self.scheduler.idle and time.monotonic() < end:
            time.sleep(0.02)
        drained = self.scheduler.idle
        if not drained:
            log.warning("the shutdown deadline passed with %d running and %d waiting: they are answered 503",
                        self.scheduler.running, self.scheduler.waiting)
        return drained

    def close(self) -> None:
        """On shutdown: the scheduler stops (what it still holds is answered 503) and the engine closes, writing the
        device and host tiers to the disk tier where there is one (`Engine.close`). A failure is logged, never
        raised (the shutdown goes on)."""
        try:
            self.engine.close()
        except Exception:
            log.exception("closing the engine at shutdown failed")
        if self.engine.tiers.disk is not None:
            log.info("the disk tier holds %d entries", self.engine.tiers.disk.stats.entries)

    # Plain endpoints --------------------------------------------------------------------------------------------
    async def health(self, request: HttpRequest) -> Response:
        if self.warmup_error is not None:
            return JSONResponse(dict(status="failed", error=self.warmup_error), status_code=500)
        if self.draining:
            return JSONResponse(dict(status="draining", waiting=self.scheduler.waiting,
                                     running=self.scheduler.running), status_code=503)
        if not self.ready:
            total = getattr(self, "_programs_total", None)
            return JSONResponse(dict(status="warming up", programs_compiled=self.engine.programs.stats.programs,
                                     programs_total=total), status_code=503)
        return JSONResponse(dict(status="ok", waiting=self.scheduler.waiting, running=self.scheduler.running,
                                 programs_pending=self.engine.programs.stats.pending))

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
            if self.draining:
                raise ApiError(503, "the server is shutting down", code="shutting_down")
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


def build(model: str | None = None, *, dtype: str = "bfloat16", load_format: str = "auto",
          quantize: str | None = None, options: EngineOptions | None = None, server: ServerOptions | None = None, **fields) -> Server:
    """A `Server` for a model folder (None: `serve.model.load_served`'s default, the embedded model when it is installed),
    not yet warmed up. `options` and `fields` (any `EngineOptions` field by name) configure the engine, `server`
    the HTTP side."""
    from hypic_jax.serve.model import load_served

    options = (options or EngineOptions()).replace(**fields) if fields else (options or EngineOptions())
    parallel = options.parallel
    for flag, count in (("--devices", parallel.devices), ("--tensor-parallel-size", parallel.tensor_parallel)):
        if isinstance(count, int):
            import jax

            available = len(jax.devices())
            if not 1 <= count <= available:
                raise ValueError(f"{flag} {count!r}: must be a count from 1 to {available}, the devices this "
                                 f"process sees ({jax.default_backend()})")
    if model is None and load_format != "auto":
        raise ValueError("--load-format dummy needs a MODEL folder (its config gives the shapes)")
    served = load_served(model, dtype=dtype, load_format=load_format, quantize=quantize, options=options)
    return Server(served.engine, server, model_name=served.name, chat_template=served.chat_template,
                  special_tokens=served.special_tokens, eos_ids=served.eos_ids)


def graceful_uvicorn(server: Server, config):
    """A uvicorn server for `server` whose first SIGTERM or SIGINT drains the accepted requests (`Server.drain`)
    before it stops, so that the process exits 0; a second signal, or one before the server is ready, is uvicorn's
    own (stop now). uvicorn is imported here: it is needed only to listen on a socket."""
    import uvicorn

    class GracefulServer(uvicorn.Server):
        def __init__(self):
            super().__init__(config)
            self._drainer = None

        def handle_exit(self, sig, frame) -> None:
            if self._drainer is not None or not server.ready:
                super().handle_exit(sig, frame)
                return
            log.info("signal %d: draining before shutdown (a second signal stops at once)", sig)
            self._drainer = threading.Thread(target=self._drain_then_exit, name="hypic-drain", daemon=True)
            self._drainer.start()

        def _drain_then_exit(self) -> None:
            server.drain()
            self.should_exit = True

    return GracefulServer()


def main(args) -> int:
    """`hypic-jax serve`: build the server, warm it up in the background (/health says when), serve until stopped."""
    from hypic_jax.options import from_args

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = build(args.model, dtype=args.dtype, load_format=args.load_format, quantize=args.quantize,
                   options=args.engine_options,
                   server=from_args(ServerOptions, args))
    engine = server.engine
    mesh = engine.segment_mesh
    placement = "1 device" if mesh is None else f"{mesh.size} devices (cold segments split by {mesh.policy})"
    if engine.placement is not None:
        placement += f", the model split over {len(engine.placement.device_set)} devices"
    host, port = server.options.host, server.options.port
    log.info("serving %r on %s at http://%s:%d (warming up: /health answers 503 until ready)", server.model_name,
             placement, host, port)
    import uvicorn

    runner = graceful_uvicorn(server, uvicorn.Config(server.app, host=host, port=port,
                                                     log_level=args.log_level.lower(), timeout_graceful_shutdown=5))
    server.on_warmup_failure = lambda error: setattr(runner, "should_exit", True)
    runner.run()
    return 1 if server.warmup_error is not None else 0
