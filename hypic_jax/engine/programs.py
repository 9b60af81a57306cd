"""The engine's compiled programs: a fixed ladder of shapes, compiled ahead of time, stored across processes, and
guarded while serving.

    program       per               what it runs
    cold          token rung        the missing segments of a request, packed and isolated, recording their entries
    pic           token rung        a PIC request: cached interiors stitched with fresh seams and the query (it
                                    records nothing, so it returns no writes)
    plain         token rung        full recompute and prefix cache (fresh spans continue each other's state)
    commit        token rung        the records a span program returns, written into the pools in place
    slots         max_batch         the batched decode cache, allocated (zeros, in the layouts the decode programs take)
    insert        -                 a prefill's decode caches into a row of the batched decode cache; its first token
    batch         batch bucket      one decode step of rows [0, b) of the batched decode cache, sampled per row
    *_full                          insert and batch with the sampler that truncates and ranks (`SamplingRows.full`)
    *_hidden      token rung        pic and plain returning every layer's hidden states (`Engine.diagnose` only)
    fused         bucket, rung      one decode step of rows [0, b) and a pic request's forward in one layer loop
                                    (each layer's MLP once over both token lists), its caches then inserted into a
                                    row and its first token sampled (`LimitOptions.fused_prefill_tokens`)

Everything else is data: the layout's arrays (`layout.LayoutArrays`) and the entries' slots and rows in the pools
(`pools.Pools`). `Programs` owns them: `keys_for` lists what a prompt limit needs, `compile` builds them on a thread
pool (optionally the larger ones in the background, which `get` then waits for), `get` hands one out. Once
`serving` is set, a program outside the ladder is a compilation while serving: counted in `stats` and logged, or,
with `guard="refuse"`, refused with `CompileWhileServing`. The diagnostic programs are compiled on first use and
counted apart (`diagnostic`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import os
import threading
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.layout import Format, Layout

from hypic_jax.stitch import layout as lay
from hypic_jax import stitch
from hypic_jax.engine.sampling import SamplingRows, sample_rows
from hypic_jax.models import mixing
from hypic_jax.models.base import ModelCache
from hypic_jax.models.stack import LayerStack, stacked_like

log = logging.getLogger("hypic_jax.engine")

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_compile_events = [0, 0]  # every compilation; those on a background compile thread
_thread = threading.local()


def _count_compile(event: str, duration: float, **_) -> None:
    if event == _BACKEND_COMPILE:  # reported on the thread that compiled
        _compile_events[0] += 1
        if getattr(_thread, "background", False):
            _compile_events[1] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)


def _count_cache_hit(event: str, **_) -> None:
    if event == "/jax/compilation_cache/cache_hits":  # reported on the thread that asked for the program
        _thread.cache_hits = getattr(_thread, "cache_hits", 0) + 1


jax.monitoring.register_event_listener(_count_cache_hit)


def backend_compiles() -> int:
    """XLA compilations this process has run so far (every program, any caller; a program that JAX's persistent
    cache serves counts too, programs loaded whole from the engine's program store do not): what a test or
    benchmark reads before and after serving to prove that nothing compiled."""
    return _compile_events[0]


def background_compiles() -> int:
    """The part of `backend_compiles` that ran on a warmup's background compile threads (`Engine.warmup(
    ready_tokens=...)`): planned programs, not compilations a request caused."""
    return _compile_events[1]


SPAN_KINDS = ("cold", "pic", "plain")
HIDDEN_KINDS = ("pic_hidden", "plain_hidden")


class ProgramKey(NamedTuple):
    kind: str  # see the module docstring
    tokens: int  # the token rung, or for batch programs the rows
    keys: int  # the keys capacity (attention context): a cold program's is its rung
    rows: int = 0  # a fused program's batch bucket (0 for every other kind)


class CompileWhileServing(RuntimeError):
    """A program outside the warmed-up ladder was needed while serving, and the engine refuses to compile it."""


class DeviceMemoryError(RuntimeError):
    """The engine's programs do not fit the device memory JAX may use (the message says what it holds)."""


def out_of_memory(error: Exception) -> bool:
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


@dataclasses.dataclass
class ProgramStats:
    programs: int = 0
    compile_s: float = 0.0
    serving_compiles: int = 0
    loaded: int = 0  # programs read from the program store instead of compiled
    pending: int = 0  # programs still compiling in the background
    waits: int = 0  # requests that waited for a program compiling in the background
    diagnostic: int = 0  # programs compiled for `Engine.diagnose`


# XLA options of the span programs. Without the dot merger: it joins the products that share an input (a layer's
# q/k/v or qkv/z projections) into one by concatenating their weights, and for a few hundred fresh tokens that copy
# costs more than the second product it saves. The stitched (pic) program also runs without XLA's Triton GEMMs:
# inside the scan over the layers those take their weights as copies sliced out of the stacked arrays, where
# cuBLAS reads them in place (bench/RESULTS.md, "The weights' copies and the logits").
SPAN_OPTIONS = {"xla_disable_hlo_passes": "dot-merger"}


def span_options(kind: str) -> dict:
    base = kind.removesuffix("_hidden")
    return {**SPAN_OPTIONS, "xla_gpu_enable_triton_gemm": False} if base == "pic" else dict(SPAN_OPTIONS)


class Programs:
    """Owns every compiled program of one engine (see the module docstring). guard: "count" (a compilation while
    serving is counted and logged) or "refuse" (it raises `CompileWhileServing`)."""

    def __init__(self, engine, *, guard: str = "count", workers: int | None = None):
        if guard not in ("count", "refuse"):
            raise ValueError(f"guard must be 'count' or 'refuse', got {guard!r}")
        self.engine = engine
        self.guard = guard
        self.workers = workers or max(1, min(8, os.cpu_count() or 1))
        self._compiled: dict[ProgramKey, Any] = {}
        self._seconds: dict[ProgramKey, float] = {}
        self._pending: dict[ProgramKey, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._background: concurrent.futures.ThreadPoolExecutor | None = None
        self.serving = False
        self.stats = ProgramStats()
        self._signature = None  # the parameters' and pools' shapes, as text (part of every digest)

    # The ladder ------------------------------------------------------------------------------------------------------
    def keys_for(self, max_prompt_tokens: int) -> list[ProgramKey]:
        """Every program a prompt of up to `max_prompt_tokens` tokens can use, smallest rungs first."""
        engine = self.engine
        top = engine.ladder.rung(max_prompt_tokens)
        keys = []
        for rung in (r for r in engine.ladder.rungs if r <= top):
            keys += [ProgramKey(kind, rung, rung if kind == "cold" else engine.max_keys) for kind in SPAN_KINDS]
            keys.append(ProgramKey("commit", rung, 0))
        keys.append(ProgramKey("slots", engine.max_batch, engine.max_keys))
        keys += [ProgramKey(kind, 1, engine.max_keys) for kind in ("insert", "insert_full", "move")]
        keys += [ProgramKey(kind, b, engine.max_keys) for kind in ("batch", "batch_full")
                 for b in engine.batch_buckets]
        keys += [ProgramKey("fused", rung, engine.max_keys, b) for rung in engine.fused_rungs if rung <= top
                 for b in engine.batch_buckets]
        return keys

    def later(self, keys: list[ProgramKey], ready_rung: int) -> list[ProgramKey]:
        """What of `keys` a warmup that must be ready for prompts up to `ready_rung` tokens can compile in the
        background, in the order to compile it: the smaller decode buckets (a larger compiled bucket steps the same
        rows meanwhile, `Engine.batch_bucket`), the samplers that truncate and rank (a request that needs one waits
        for it), then the span programs of the larger rungs. What stays: the span programs up to `ready_rung`, the
        decode cache, the plain insert and the largest bucket's step."""
        largest = max((k.tokens for k in keys if k.kind == "batch"), default=None)
        order = [k for k in keys if k.kind == "batch" and k.tokens != largest]
        order += [k for k in keys if k.kind in ("insert_full", "batch_full")]
        order += [k for k in keys if k.kind in SPAN_KINDS + ("commit",) and k.tokens > ready_rung]
        order += [k for k in keys if k.kind == "fused"]  # until one is ready, the programs apart serve
        return order

    # Lowering --------------------------------------------------------------------------------------------------------
    def _lower(self, key: ProgramKey):
        engine = self.engine
        shapes = self._abstract
        if key.kind == "commit":
            fn = self._jit(_commit, donate_argnums=0, out_shardings=self.pool_shardings())
            return fn.lower(*shapes((engine.pool_shapes, engine.writes_shapes(key.tokens))))
        if key.kind == "slots":
            shapes_ = engine.slot_shapes()
            fill = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes_)  # noqa: E731
            return jax.jit(fill, out_shardings=self.slot_formats() or engine.placement).lower()
        if key.kind in ("insert", "insert_full"):
            layers = engine.decode_shapes().layers
            args = shapes((engine.slot_shapes(), jax.ShapeDtypeStruct((), jnp.int32), layers,
                           jax.ShapeDtypeStruct((engine.vocab_size,), jnp.float32), SamplingRows.shapes(1)))
            body = functools.partial(_insert, top_n=engine.top_logprobs, full=key.kind == "insert_full")
            return self._slot_jit(body, args, 0, self.slot_formats()).lower(*args)
        if key.kind == "move":
            row = jax.ShapeDtypeStruct((), jnp.int32)
            args = shapes((engine.slot_shapes(), row, row))
            return self._slot_jit(_move, args, 0, self.slot_formats()).lower(*args)
        if key.kind in ("batch", "batch_full"):
            rows = jax.ShapeDtypeStruct((key.tokens,), jnp.int32)
            args = shapes((engine.params, engine.slot_shapes(), rows, rows, SamplingRows.shapes(key.tokens)))
            body = functools.partial(_batch_decode, arch=engine.arch, config=engine.config, rows=key.tokens,
                                     top_n=engine.top_logprobs, full=key.kind == "batch_full",
                                     kernels=engine.kernels)
            # the largest bucket chooses the cache's layouts (slot_layouts="auto"); the rest take its choice
            chooses = key == self._layout_key()
            formats = Format(Layout.AUTO, engine.placement) if chooses else self.slot_formats()
            return self._slot_jit(body, args, 1, formats).lower(*args)
        if key.kind == "fused":
            capacity = engine.capacity(key)
            rows, one = jax.ShapeDtypeStruct((key.rows,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32)
            packed = jax.ShapeDtypeStruct((lay.packed_size(capacity),), jnp.int32)
            args = shapes((engine.params, engine.slot_shapes(), rows, rows, SamplingRows.shapes(key.rows), packed,
                           engine.pool_shapes, one, SamplingRows.shapes(1)))
            body = functools.partial(_fused_decode, arch=engine.arch, config=engine.config, rows=key.rows,
                                     capacity=capacity, top_n=engine.top_logprobs, kernels=engine.kernels)
            return self._slot_jit(body, args, 1, self.slot_formats()).lower(*args)
        base = key.kind.removesuffix("_hidden")
        if base not in SPAN_KINDS:
            raise ValueError(f"unknown program kind {key.kind!r}")
        capacity = engine.capacity(key)
        fn = self._jit(functools.partial(span_program, arch=engine.arch, config=engine.config, capacity=capacity,
                                         isolated=base == "cold", summaries=base != "plain",
                                         want_decode=base != "cold", want_writes=base != "pic",
                                         want_hidden=key.kind.endswith("_hidden"), kernels=engine.kernels),
                       compiler_options=span_options(key.kind))
        packed = jax.ShapeDtypeStruct((lay.packed_size(capacity),), jnp.int32)
        return fn.lower(*shapes((engine.params, packed, engine.pool_shapes)))

    def _tracing_mesh(self):
        """The context a program is traced in: on a model mesh that mesh (`jax.set_mesh`), under which the span
        programs' linear cores and attention run on each device's own heads (`stitch.model_split`)."""
        placement = self.engine.placement
        return contextlib.nullcontext() if placement is None else jax.set_mesh(placement.mesh)

    def _abstract(self, tree):
        """Abstract values of a program's arguments: arrays with their shardings; on a model mesh every value
        without one (layouts, tokens, the decode caches) replicated over it (`Engine.placement`)."""
        placement = self.engine.placement

        def leaf(a):
            sharding = getattr(a, "sharding", None)
            if placement is not None and not isinstance(sharding, jax.sharding.Sharding):
                sharding = placement
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)

        return jax.tree.map(leaf, tree)

    def _jit(self, fn, out_shardings=None, **options):
        """jax.jit; on a model mesh with its results where the next program expects them: `out_shardings`
        (the pools' own, for a program that returns them), else replicated over the mesh."""
        if self.engine.placement is not None:
            options["out_shardings"] = out_shardings or self.engine.placement
        return jax.jit(fn, **options)

    def pool_shardings(self):
        """The pools' shardings (a tree like them) on a model mesh, else None."""
        if self.engine.placement is None:
            return None
        return jax.tree.map(lambda a: a.sharding, self.engine.pool_shapes)

    def _slot_jit(self, body, args, slot_arg: int, formats):
        """jit of a program that takes the decode cache as argument `slot_arg` (donated) and returns it last, with
        the cache in `formats` (None: the default layouts) on the way in and out."""
        if formats is None:
            return self._jit(body, donate_argnums=slot_arg)
        outputs = jax.eval_shape(body, *args)
        in_shardings = tuple(formats if i == slot_arg else None for i in range(len(args)))
        out_shardings = tuple([self.engine.placement] * (len(outputs) - 1) + [formats])
        return jax.jit(body, donate_argnums=slot_arg, in_shardings=in_shardings, out_shardings=out_shardings)

    def _layout_key(self) -> ProgramKey | None:
        """The program that chooses the decode cache's layouts (slot_layouts="auto"): the largest batch bucket's."""
        engine = self.engine
        if engine.kernels.slot_layouts != "auto" or not engine.batch_buckets:
            return None
        return ProgramKey("batch", engine.batch_buckets[-1], engine.max_keys)

    def slot_formats(self):
        """The decode cache's formats (a tree like it): those the largest batch program chose, with
        slot_layouts="auto" (compiling that program first if needed); None for the default layouts."""
        if self._layout_key() is None:
            return None
        compiled = self.get(self._layout_key())
        slots_in, slots_out = compiled.input_formats[0][1], compiled.output_formats[-1]
        if jax.tree.leaves(slots_in) != jax.tree.leaves(slots_out):
            raise RuntimeError("the batch program chose different layouts for the decode cache it takes and returns")
        return slots_in

    def devices(self) -> list:
        """The devices the programs run on, in their mesh's order: the model mesh's, else the one device that holds
        the pools (so a program stored by one process never loads onto another's device)."""
        placement = self.engine.placement
        if placement is not None:
            return list(placement.mesh.devices.flat)
        return [next(iter(jax.tree.leaves(self.engine.pool_shapes)[0].sharding.device_set))]

    def _digest(self, key: ProgramKey) -> str:
        """What the program of `key` is made of, without tracing it (`executables.ExecutableStore.digest`)."""
        from hypic_jax.engine import store as executables

        engine = self.engine
        if self._signature is None:
            self._signature = (executables.describe(engine.params), executables.describe(engine.pool_shapes))
        capacity = engine.capacity(key) if key.kind.removesuffix("_hidden") in SPAN_KINDS + ("fused",) else None
        ladder = engine.ladder
        return engine.executables.digest(
            key, capacity, ladder.max_pieces, ladder.records, ladder.chunk, ladder.conv, engine.arch.__name__,
            repr(engine.config), repr(engine.kernels), engine.top_logprobs, engine.max_batch, engine.max_keys,
            repr(sorted(span_options(key.kind).items())), [d.id for d in self.devices()], *self._signature)

    # Building --------------------------------------------------------------------------------------------------------
    def _build(self, key: ProgramKey):
        start = time.perf_counter()
        engine = self.engine
        store = engine.executables
        compiled = store.load(self._digest(key), self.devices()) if store is not None else None
        loaded = compiled is not None
        hits = getattr(_thread, "cache_hits", 0)
        while compiled is None:
            try:
                with self._tracing_mesh():
                    lowered = self._lower(key)
                compiled = lowered.compile()
            except Exception as error:  # noqa: BLE001  (a kernel's lowering or compile failed: see below)
                self._fall_back(key, error)
        # a program JAX's persistent cache served is not stored again: serialised a second time, it no longer runs
        # where it is loaded (on the CPU its functions are not found); the next real compilation stores it
        from_jax_cache = getattr(_thread, "cache_hits", 0) > hits
        if store is not None and not loaded and not from_jax_cache:
            store.save(self._digest(key), compiled)  # under the choices it compiled with (after any fallback)
        seconds = time.perf_counter() - start
        with self._lock:
            self._compiled[key] = compiled
            self._seconds[key] = seconds
            self.stats.programs = len(self._compiled)
            if loaded:
                self.stats.loaded += 1
            else:
                self.stats.compile_s += seconds
        return compiled

    def _fall_back(self, key: ProgramKey, error: Exception) -> None:
        """An automatic choice of Pallas kernels must never cost the engine its programs: fall back to XLA (same
        results up to rounding; the records keep one form), the fold first (to the blocked fold, which needs no
        host round trip per piece); any other failure is raised."""
        engine = self.engine
        kernels = engine.kernels
        if key.kind.removesuffix("_hidden") not in SPAN_KINDS:
            raise error
        if kernels.fold == "auto":
            what, kernels = "the fold over the pieces through its Pallas kernel", kernels.replace(fold="blocked")
        elif kernels.linear == "auto":
            what, kernels = "the linear cores through the Pallas kernels", kernels.replace(linear="xla")
        else:
            raise error
        engine.kernels = kernels
        log.warning("the %s program for %d tokens failed to compile with %s (%s: %s); every span program compiled "
                    "from now on runs that part through XLA instead", key.kind, key.tokens, what,
                    type(error).__name__, str(error)[:500])

    def get(self, key: ProgramKey, *, diagnostic: bool = False):
        """The program of `key`: compiled, or compiling in the background (waited for), or compiled now (while
        serving: counted and logged, or refused with guard="refuse"; a diagnostic program is counted apart)."""
        compiled = self._compiled.get(key)
        if compiled is not None:
            return compiled
        with self._lock:
            future = self._pending.get(key)
            if future is not None:
                self.stats.waits += 1
        if future is not None:
            return future.result()
        if diagnostic:
            self.stats.diagnostic += 1
        elif self.serving:
            self.compiling_while_serving(f"the {key.kind} program for {key.tokens} tokens and {key.keys} keys")
        return self._build(key)

    def compiling_while_serving(self, what: str) -> None:
        """`what` must compile although the engine serves: counted and logged, or refused (guard="refuse")."""
        if self.guard == "refuse":
            raise CompileWhileServing(f"{what} is outside the warmed-up ladder, and this engine refuses to compile "
                                      f"while serving (warm up a larger max_prompt_tokens)")
        self.stats.serving_compiles += 1
        log.warning("compiling while serving: %s (outside the warmed-up ladder)", what)

    def compile(self, keys: list[ProgramKey], *, progress: bool = True, background: list[ProgramKey] = ()) -> float:
        """Compile `keys` (those not compiled yet) on a thread pool (XLA compiles release the interpreter lock), then
        return the wall time; `background`: programs compiled after them on a background thread, which `get` waits
        for when a request needs one first."""
        todo = [k for k in keys if k not in self._compiled]
        # the program that chooses the decode cache's layouts comes before those that take them
        first = [k for k in todo if k == self._layout_key()]
        start = time.perf_counter()
        bar = None
        if progress and todo:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(todo), desc="compiling programs", unit="program")
        for key in first:
            self._build(key)
            if bar is not None:
                bar.update(1)
        rest = [k for k in todo if k not in first]
        with concurrent.futures.ThreadPoolExecutor(min(self.workers, max(1, len(rest)))) as pool:
            for _ in pool.map(self._build, rest):
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        later = [k for k in background if k not in self._compiled and k not in self._pending]
        if later:
            self._compile_in_background(later)
        return time.perf_counter() - start

    def _compile_in_background(self, keys: list[ProgramKey]) -> None:
        if self._background is None:
            self._background = concurrent.futures.ThreadPoolExecutor(
                max(1, self.workers // 2), thread_name_prefix="hypic-compile",
                initializer=lambda: setattr(_thread, "background", True))
        with self._lock:
            for key in keys:
                future = self._background.submit(self._build, key)
                self._pending[key] = future
                future.add_done_callback(functools.partial(self._done, key))
            self.stats.pending = len(self._pending)

    def _done(self, key: ProgramKey, future) -> None:
        with self._lock:
            self._pending.pop(key, None)
            self.stats.pending = len(self._pending)
        if not future.cancelled() and future.exception() is not None:
            log.error("compiling the %s program for %d tokens in the background failed: %s", key.kind, key.tokens,
                      future.exception(), exc_info=future.exception())

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the programs compiling in the background; True when none is left."""
        with self._lock:
            pending = list(self._pending.values())
        done, left = concurrent.futures.wait(pending, timeout)
        return not left

    def close(self) -> None:
        """Stop compiling in the background (programs already started finish)."""
        if self._background is not None:
            self._background.shutdown(wait=True, cancel_futures=True)
            self._background = None

    def report(self) -> list[dict]:
        return [dict(kind=k.kind, tokens=k.tokens, keys=k.keys, **(dict(rows=k.rows) if k.rows else {}),
                     compile_s=round(s, 3)) for k, s in sorted(self._seconds.items())]

    def __contains__(self, key: ProgramKey) -> bool:
        return key in self._compiled


# ------------------------------------------------------------------------------------------------------------------
# Program bodies


def span_program(params, packed, pools, *, arch, config, capacity, isolated, summaries, want_decode, kernels,
                 want_writes=True, want_hidden=False):
    """A span program: the request's layout arrives packed in one int32 vector (`layout.pack`). Without
    `want_writes` (a stitched PIC request stores nothing) it returns None for the writes, and the rows it would
    write are never computed. With `want_hidden` it returns a fourth value, every layer's hidden states of the
    fresh tokens [layers, F, H]."""
    arrays = lay.unpack(packed, capacity)
    extra = dict(want_hidden=True) if want_hidden else {}
    out = arch.span_forward_arrays(params, config, arrays, pools, isolated=isolated, summaries=summaries,
                                   want_decode=want_decode, kernels=kernels, **extra)
    logits, writes, decode = out[:3]
    result = (logits, (writes if want_writes else None), decode)
    return result + (out[3],) if want_hidden else result


def _commit(pools, writes):
    """Write a span program's records into the pools (donated: in place; see `stitch.row_writes` for why this is
    a program of its own)."""
    return pools.replace(stitch.apply_row_writes(pool, w) for pool, w in zip(pools.parts, writes))


def row_axes(layers):
    """Per leaf of a decode cache (a `LayerStack` or a tuple of per-layer caches), its batch (row) axis: 1 in a
    stacked part of a `LayerStack` (the layers come first), else 0."""
    if isinstance(layers, LayerStack):
        plan = layers.plan
        return LayerStack(tuple(jax.tree.map(lambda _, axis=int(plan.members(p) > 1): axis, tree)
                                for p, tree in enumerate(layers.parts)), plan)
    return jax.tree.map(lambda _: 0, layers)


def _insert(slots, row, layers, logits, sampling, *, top_n, full):
    """Write one request's decode caches (batch size 1, in the form the span programs return them) into `row` of
    the batched cache (the same form with `max_batch` rows); sample its first token."""
    slots = jax.tree.map(lambda full, one, axis: jax.lax.dynamic_update_slice_in_dim(full, one.astype(full.dtype),
                                                                                     row, axis=axis),
                         slots, layers, row_axes(slots))
    return (*sample_rows(logits[None], sampling, top_n, full), slots)


def _move(slots, source, target):
    """Copy row `source` of the batched decode cache into row `target` (every layer's caches), returned as the
    only output: the scheduler moves a stream from a high row into a free low one so its steps take a smaller
    batch bucket."""
    def move(a, axis):
        return jax.lax.dynamic_update_slice_in_dim(a, jax.lax.dynamic_slice_in_dim(a, source, 1, axis=axis), target,
                                                   axis=axis)

    return (jax.tree.map(move, slots, row_axes(slots)),)


def _batch_decode(params, slots, tokens, lengths, sampling, *, arch, config, rows, top_n, full, kernels):
    """One decode step of rows [0, rows) of the batched cache, each at its own length: the model's forward over a
    batch of `rows` one-token rows with per-row positions (`ModelCache.length` of shape [rows]: keys and values
    are written by a scatter of one token per row), then per-row sampling. Rows never mix: every operation is per
    row or per token."""
    logits, cache = arch.forward(params, config, tokens[:, None], cache=ModelCache(_first_rows(slots, rows), lengths),
                                 kernels=kernels)
    return (*sample_rows(logits[:, -1], sampling, top_n, full), _put_first_rows(slots, cache.layers))


def _first_rows(slots, rows: int):
    """Rows [0, rows) of the batched decode cache (all of it when rows is its size)."""
    axes = row_axes(slots)
    capacity = jax.tree.leaves(slots)[0].shape[jax.tree.leaves(axes)[0]]  # max_batch
    if rows == capacity:
        return slots
    return jax.tree.map(lambda a, axis: jax.lax.slice_in_dim(a, 0, rows, axis=axis), slots, axes)


def _put_first_rows(slots, part):
    """`part` (rows [0, b) in the cache's form) written back into the batched decode cache."""
    return jax.tree.map(lambda full, new, axis: jax.lax.dynamic_update_slice_in_dim(full, new.astype(full.dtype), 0,
                                                                                    axis=axis),
                        slots, part, row_axes(slots))


def _fused_decode(params, slots, tokens, lengths, sampling, packed, pools, row, first, *, arch, config, rows,
                  capacity, top_n, kernels):
    """`_batch_decode` of rows [0, rows) and a pic request's `span_program` in one layer loop
    (`mixing.fused_forward_arrays`), then the request's `_insert` into `row` (after the step: a free row inside
    the bucket was stepped with whatever it held) with its first token sampled by `first`. Returns the rows'
    samples, the request's, its logits and the decode cache. The plain sampler only (`SamplingRows.full` takes the
    programs apart)."""
    logits, new, request_logits, decode = mixing.fused_forward_arrays(
        arch, params, config, tokens, ModelCache(_first_rows(slots, rows), lengths), lay.unpack(packed, capacity),
        pools, kernels=kernels)
    slots = _put_first_rows(slots, new)
    sampled = sample_rows(logits, sampling, top_n, False)
    *first_sampled, slots = _insert(slots, row, stacked_like(params["layers"], decode), request_logits, first,
                                    top_n=top_n, full=False)
    return (*sampled, *first_sampled, request_logits, slots)


__all__ = ["Programs", "ProgramKey", "ProgramStats", "CompileWhileServing", "DeviceMemoryError", "backend_compiles",
           "background_compiles",
           "span_program", "span_options", "row_axes", "SPAN_KINDS", "HIDDEN_KINDS"]
