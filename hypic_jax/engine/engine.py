"""The engine: position-independent caching behind `prefill`, `generate` and `diagnose`, served from a fixed ladder
of compiled programs.

A request is a list of segments; the last one is the query (always computed, never cached). Its layout (which
spans are fresh and which come from the cache, their lengths and positions) travels as data, fixed-capacity int32
arrays (`hypic_jax.stitch.layout`), and every cache entry lives in fixed device pools (`hypic_jax.cache.pools`), so after
`warmup` a workload of new document lengths and orders compiles nothing (`programs.Programs` owns the programs and
counts any compilation while serving). Modes:

    full_recompute             one fresh span of the whole prompt
    prefix_cache               the longest run of cached leading segments (exact K/V and state snapshots), then
                               fresh spans for the rest (each recorded as a new prefix entry) and the query
    addition                   cached segments whose zero-start states are added (T dropped), keys not re-rotated
    transition                 + composition through the transfer operators T
    transition_rope            + RoPE re-rotation of cached keys (and of RoPE'd linear states)
    transition_rope_recompute  + the seam window: the first w tokens of every segment are recomputed under the true
                               prefix; the cache holds only the interior [w, n)

Segments missing from the cache are first prefilled together in one packed, isolated program (state reset and
block-diagonal attention at segment boundaries), which records their entries, over several devices with
`devices=` (`segment_mesh`). One entry serves a segment in any position, first included: a segment's seam at
position 0 is recomputed from an empty prefix, which reproduces its isolated prefill exactly.

Generation runs through the continuous-batching scheduler (`engine.scheduler`), the same loop and the same device
sampler as the server, on the engine's batched decode cache of `max_batch` rows. A request's plan comes from
`engine.planner`; its entries live in the engine's `hypic_jax.cache.hierarchy.CacheHierarchy`: entries evicted from
the device pools go down the tiers (`hypic_jax.cache.tiers`: host memory, disk, other devices) and come back on a
hit; `close` writes what the device and host tiers hold to the disk tier.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hypic_jax.stitch import layout as lay
from hypic_jax.cache import tiers as tr
from hypic_jax.cache.hierarchy import CacheHierarchy, ColdPrefills
from hypic_jax.cache.index import Entry, model_fingerprint, tree_nbytes
from hypic_jax.engine import options as opts
from hypic_jax.engine import planner
from hypic_jax.engine.options import EngineOptions
from hypic_jax.engine.planner import Plan
from hypic_jax.parallel.tensor import model_placement, place_tensor_parallel
from hypic_jax.engine.programs import (HIDDEN_KINDS, DeviceMemoryError, ProgramKey, Programs, backend_compiles,
                                       out_of_memory, span_options, span_program)
from hypic_jax.engine.requests import (SegmentReader, check_mode, check_seam, is_integer, sampling_params,
                                       segment_seams)
from hypic_jax.engine.results import GenerateResult, PrefillPiece, PrefillResult, PrefillStats
from hypic_jax.engine.sampling import TOP_LOGPROBS, Sampled, SamplingRows
from hypic_jax.models.base import ModelCache
from hypic_jax.models.stack import LayerPlan, LayerStack, stacked_like
from hypic_jax.cache.pools import Pools

log = logging.getLogger("hypic_jax.engine")


# ------------------------------------------------------------------------------------------------------------------
# Helpers


def load_tokenizer(tokenizer):
    """A tokenizer object (anything with `encode`), or one read from a tokenizer.json path."""
    if tokenizer is None or hasattr(tokenizer, "encode"):
        return tokenizer
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer))


def use_compile_cache(directory: str | Path) -> Path:
    """Keep this process's compiled programs in `directory` (created if missing) and look there before compiling:
    JAX's persistent compilation cache, process-wide. Programs that compiled in under a second are not stored
    (JAX's `jax_persistent_cache_min_compile_time_secs`). Trust: whoever can write the folder can make this process
    run code; do not share it with untrusted users. Returns the resolved folder."""
    from jax.experimental.compilation_cache import compilation_cache

    path = Path(directory).expanduser().resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"compile_cache: cannot use {str(path)!r} as a folder: {error}") from error
    if jax.config.jax_compilation_cache_dir != str(path):
        compilation_cache.reset_cache()  # a cache opened on another folder would otherwise keep serving
        compilation_cache.set_cache_dir(str(path))
    return path


def layer_plan(model, *, scan: bool = True) -> LayerPlan:
    """How the engine runs `model`'s layers (`models.stack.LayerPlan`): its repeating pattern as one scan (layers
    share a pattern position when their parameters, pools and types have one structure), or with `scan=False`
    every layer unrolled."""
    layers = model.params["layers"]
    if isinstance(layers, LayerStack):
        return layers.plan
    if not scan:
        return LayerPlan.unrolled(len(layers))
    pieces = model.arch.pool_layout(model.config, model.dtype)
    types = [tuple(getattr(model.config, name)[i] for name in ("layer_types", "mlp_types")
                   if hasattr(model.config, name)) for i in range(len(layers))]
    return LayerStack.plan_for(layers, [(kind, tree, t) for (kind, tree), t in zip(pieces, types)])


def stack_layers(model, *, scan: bool = True, consume: bool = False):
    """`model` with its layers stacked by `layer_plan` (a `models.stack.LayerStack`, which reads like the list of
    layers). The engine stacks a copy itself; with `consume=True` the per-layer arrays are deleted as they are
    stacked, for a model too large for two copies (every other holder of them loses them)."""
    layers = LayerStack.build(model.params["layers"], layer_plan(model, scan=scan), consume=consume)
    return model.replace(params=dict(model.params, layers=layers))


def _layer_kinds(config) -> list[str]:
    if hasattr(config, "layer_types"):
        return ["linear" if t == "linear_attention" else "full" for t in config.layer_types]
    return ["full" if config.is_full_attention(i) else "linear" for i in range(config.num_hidden_layers)]


_OPEN_ENGINES: "weakref.WeakSet[Engine]" = weakref.WeakSet()


def _close_open_engines() -> None:
    """At interpreter exit every engine still open is closed: its device and host tiers reach its disk tier."""
    for engine in list(_OPEN_ENGINES):
        try:
            engine.close()
        except Exception:  # noqa: BLE001  (exit goes on; the other engines still close)
            log.exception("closing an engine at exit failed")


# Closing writes files through thread pools, which refuse work once the interpreter shuts its threads down: before
# `atexit`'s handlers run. `threading._register_atexit` runs a function at that point, ahead of the thread pools'
# own shutdown (registered earlier, run later).
getattr(threading, "_register_atexit", atexit.register)(_close_open_engines)


# ------------------------------------------------------------------------------------------------------------------
# The engine


class Engine:
    """Position-independent caching on one model (see the module docstring).

    `Engine(model, options, **fields)` wraps a loaded `hypic_jax.models.base.Model`; `Engine.from_pretrained(path)`
    loads one (and its tokenizer.json), `Engine.from_pretrained()` the model embedded in the package. Options: an
    `EngineOptions`, and/or any of its fields by name (`max_prompt_tokens=...`, `cache_bytes=...`,
    `disk_cache_dir=...`); fields left at None are derived from the model and the machine (`EngineOptions.resolve`,
    `options` holds the resolved ones). `tokenizer`: a tokenizers object or a tokenizer.json path (text segments
    and stop strings need one).

    Use it as a context manager, or call `close()`: that stops its scheduler and background compiles and, with a
    disk tier, writes what the device and host tiers hold there (interpreter exit does the same for engines still
    open).
    """

    def __init__(self, model, options: EngineOptions | None = None, *, tokenizer=None, consume_model: bool = False,
                 **fields):
        if not hasattr(model.arch, "span_forward_arrays"):
            raise ValueError(f"architecture {model.arch.__name__} has no span_forward_arrays; the engine cannot run it")
        options = options or EngineOptions()
        if not isinstance(options, EngineOptions):
            raise TypeError(f"options must be an EngineOptions, got {type(options).__name__}")
        options = options.replace(**fields) if fields else options
        options = options.resolve(max_context=model.max_context, backend=jax.default_backend())
        self.model = model
        self.arch, self.config = model.arch, model.config
        self.max_context = model.max_context
        self.tokenizer = load_tokenizer(tokenizer)
        self.vocab_size = int(self.config.vocab_size)
        self.kernels = options.kernels  # replaced if an automatic kernel choice fails to compile (`Programs`)
        limits, requests = options.limits, options.requests
        self.mode, self.seam, self.separator = requests.mode, requests.seam, requests.separator
        self.max_prompt_tokens, self.max_segments = limits.max_prompt_tokens, limits.max_segments
        self.max_new_tokens, self.max_batch = limits.max_new_tokens, limits.max_batch
        self.max_keys = self.max_prompt_tokens + self.max_new_tokens
        self.reader = SegmentReader(self.vocab_size, self.tokenizer, self.separator, self.max_context)
        self.fingerprint = model_fingerprint(self.arch.__name__, self.config, model.params, model.source)
        conv = int(getattr(self.config, "conv_kernel", 4)) - 1
        # a request records at most one entry per segment; a record is an entry's worth of program output
        # (4.2 MB per linear layer at the 35B-A3B shape), so records get their own, smaller capacity
        self.ladder = lay.Ladder(max_tokens=self.max_prompt_tokens, max_pieces=2 * self.max_segments + 2,
                                 max_records=self.max_segments + 1, min_tokens=limits.min_tokens,
                                 chunk=self.kernels.chunk_size, conv=conv, token_rungs=limits.token_rungs,
                                 steps=limits.ladder)
        # powers of two from min_batch_bucket below max_batch, then max_batch: a step pays for at most twice its
        # busy rows (or min_batch_bucket of them)
        self.batch_buckets = tuple(b for b in (1 << i for i in range(self.max_batch.bit_length()))
                                   if limits.min_batch_bucket <= b < self.max_batch) + (self.max_batch,)
        self.top_logprobs = min(TOP_LOGPROBS, self.vocab_size)
        # the token rungs of the fused programs (a decode step and a stitched request in one program)
        self.fused_rungs = tuple(r for r in self.ladder.rungs if r <= limits.fused_prefill_tokens)

        # the parameters: split over a tensor-parallel mesh, then the repeating layers stacked for the scan
        self.plan = layer_plan(model, scan=self.kernels.scan_layers)
        params = model.params
        parallel = options.parallel
        if parallel.tensor_parallel is not None:
            params = place_tensor_parallel(self.arch, self.config, params, parallel.tensor_parallel)
        self.placement = model_placement(params)
        self.params = dict(params, layers=LayerStack.build(params["layers"], self.plan, consume=consume_model))
        if consume_model:
            model.params = self.params  # the caller gave the model up: it now holds the stacked layers

        pools = options.pools
        if pools.cache_bytes is None:
            options = options.replace(cache_bytes=self._derived_cache_bytes())
        self.options = options
        self.pools = Pools.for_budget(self.arch.pool_layout(self.config, model.dtype), options.pools.cache_bytes,
                                      mean_tokens=options.pools.mean_entry_tokens, plan=self.plan,
                                      device=self.placement)
        # the pools' shapes and shardings, what programs are lowered for: the arrays themselves are swapped out
        # while a program writes them (`_write_pools`), which a background compile must never see
        self.pool_shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                                        self.pools.arrays)
        self._device_lock = threading.RLock()
        peer_devices = ()
        if options.tiers.peer_cache_bytes:  # the peer tier: held by the engine's other devices
            from hypic_jax.parallel.segments import resolve_devices

            peer_devices = resolve_devices(parallel.devices)
        # the entries: the device pools' index, the tiers below them, promotion, demotion and persistence
        self.hierarchy = CacheHierarchy(self.pools, options.tiers, cache_bytes=options.pools.cache_bytes,
                                        fingerprint=self.fingerprint, max_tokens=self.max_prompt_tokens,
                                        devices=peer_devices, pool_arrays=self._pool_arrays,
                                        write_pools=self._write_pools, device_lock=self._device_lock)
        # its parts the engine's callers reach: the device index (`SegmentCache`), the tiers below it (`tr.Tiers`),
        # the copies between them (`tr.Mover`), the eviction policy's name and its recompute cost model
        self.cache, self.tiers, self.mover = self.hierarchy.cache, self.hierarchy.tiers, self.hierarchy.mover
        self.eviction, self.cost = self.hierarchy.eviction, self.hierarchy.cost
        self._slots = None  # the batched decode cache, made on first use
        folder = options.compile.folder()
        self.compile_cache = None if folder is None else _compile_cache_or_none(
            folder, explicit=options.compile.compile_cache != "auto")
        # compiled programs kept whole next to JAX's cache: a restarted process loads them without lowering
        self.executables = None
        if self.compile_cache is not None:
            from hypic_jax.engine.store import ExecutableStore

            self.executables = ExecutableStore(self.compile_cache / "hypic-programs")
        self.programs = Programs(self, guard=options.compile.compile_guard, workers=options.compile.compile_workers)
        self.segment_mesh = None  # segment-parallel cold prefills (`hypic_jax.parallel.segments`); None: one device
        if parallel.devices is not None and not (isinstance(parallel.devices, int) and parallel.devices == 1):
            # a count of 1 is the one device; a list of devices, even of one, is a mesh over them
            from hypic_jax.parallel.segments import SegmentMesh

            self.segment_mesh = SegmentMesh(self, parallel.devices, parallel.policy,
                                            compiler_options=span_options("cold"))
            self.hierarchy.mesh_pools = self.segment_mesh.pools
        self._scheduler = None
        self.closed = False
        _OPEN_ENGINES.add(self)

    @classmethod
    def from_pretrained(cls, path=None, dtype: Any = "bfloat16", *, tokenizer=None, options: EngineOptions | None = None,
                        load_format: str = "auto", quantize: str | None = None, **fields) -> "Engine":
        """Load a model folder (a Hugging Face folder, or an orbax checkpoint of `hypic-jax convert`) and serve it;
        its tokenizer.json is picked up when present and `tokenizer` is None. Without a path: the model embedded in
        the package (`hypic_jax.checkpoint.embedded`); FileNotFoundError naming its folder when none is installed.
        load_format "dummy": random weights of the folder's architecture (for measuring shapes whose weights are
        not at hand). quantize "fp8": the projections and experts as block-wise FP8 weights (a bf16 folder is
        quantized as it loads; an FP8 folder loads as FP8 whatever is asked). With tensor parallelism the weights
        load straight into their split."""
        from hypic_jax.checkpoint import load, random_model

        if load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
        if path is None:
            from hypic_jax.checkpoint.embedded import require_embedded_model

            path = require_embedded_model()
        path = Path(path)
        options = (options or EngineOptions()).replace(**fields) if fields else (options or EngineOptions())
        mesh = None
        tp = options.parallel.tensor_parallel
        if tp is not None and (tp if isinstance(tp, int) else len(tp)) > 1:
            from hypic_jax.parallel.tensor import tensor_parallel_mesh

            mesh = tensor_parallel_mesh(tp)
        if load_format == "dummy":
            model = random_model(path, dtype, mesh=mesh, quantize=quantize)
        else:
            model = load(path, dtype, mesh=mesh, quantize=quantize)
        if tokenizer is None and (path / "tokenizer.json").exists():
            tokenizer = path / "tokenizer.json"
        return cls(model, options, tokenizer=tokenizer, consume_model=True)

    # Options and sizes -------------------------------------------------------------------------------------------------
    def _derived_cache_bytes(self) -> int:
        """The pools' budget when none is given: on an accelerator, 90% of what JAX may still use of the device
        after the weights, the batched decode cache and a reserve for the programs' workspace (a tenth of the
        device, at least 2 GiB; times the devices of a tensor-parallel split); 1 GiB on the CPU."""
        if jax.default_backend() == "cpu":
            return opts.CPU_CACHE_BYTES
        device = jax.devices()[0] if self.placement is None else next(iter(self.placement.device_set))
        stats = device.memory_stats() or {}
        if "bytes_limit" not in stats:
            return opts.CPU_CACHE_BYTES
        split = 1 if self.placement is None else len(self.placement.device_set)
        limit, in_use = stats["bytes_limit"], stats.get("bytes_in_use", 0)
        decode = jax.eval_shape(lambda: self.arch.init_cache(self.config, self.max_batch, self.max_keys,
                                                             self.model.dtype))
        reserve = max(2 * opts.GIB, limit // 10)
        free = limit - in_use - tree_nbytes(decode) // split - reserve
        budget = int(0.9 * max(0, free)) * split
        if budget < 64 << 20:
            raise DeviceMemoryError(
                f"no device memory left for the entry pools: JAX may use {limit / 1e9:.1f} GB of the device, the "
                f"weights hold {in_use / 1e9:.1f} GB and the batched decode cache ({self.max_batch} rows of "
                f"{self.max_keys} tokens) {tree_nbytes(decode) / 1e9:.1f} GB. Lower max_batch or max_prompt_tokens, "
                f"give cache_bytes yourself, or let JAX use more of the device (XLA_PYTHON_CLIENT_MEM_FRACTION; "
                f"hypic-jax serve --gpu-memory-fraction)")
        return budget

    @property
    def scheduler(self):
        """The continuous-batching scheduler (`engine.scheduler.Scheduler`) over this engine, made on first use:
        `generate` runs its requests through it, the server starts its thread."""
        if self._scheduler is None:
            from hypic_jax.engine.scheduler import Scheduler

            sched = self.options.scheduler
            overlap = sched.overlap if sched.overlap is not None else self.programs.devices()[0].platform != "cpu"
            self._scheduler = Scheduler(self, max_queue=sched.max_queue, overlap=overlap,
                                        max_queue_wait=sched.max_queue_wait, prefill_chunk=sched.prefill_chunk,
                                        compact_rows=sched.compact_rows)
        return self._scheduler

    # Programs ----------------------------------------------------------------------------------------------------------
    def capacity(self, key: ProgramKey) -> lay.Capacity:
        """The layout capacity of a span program's key."""
        kind = "pic" if key.kind == "fused" else key.kind.removesuffix("_hidden")
        records = 0 if kind == "pic" else self.ladder.records  # stitched PIC requests record nothing
        return lay.Capacity(tokens=key.tokens, pieces=self.ladder.max_pieces, keys=key.keys, records=records,
                            chunk=lay.chunk_for(kind, self.ladder.chunk), conv=self.ladder.conv)

    def dummy_layout(self, key: ProgramKey) -> lay.LayoutArrays:
        kind = key.kind.removesuffix("_hidden")
        return lay.build([lay.Span(lay.FRESH, 1)], self.capacity(key), isolated=kind == "cold",
                         tokens=np.zeros(1, np.int32), summaries=kind != "plain")

    def decode_shapes(self):
        """The decode cache a stitched program returns (shapes only): the batched decode cache's rows. With the
        layers scanned its layers are a `LayerStack` by the engine's plan, so the decode step scans them as they
        are."""
        key = ProgramKey("plain", self.ladder.rungs[0], self.max_keys)
        fn = functools.partial(span_program, arch=self.arch, config=self.config, capacity=self.capacity(key),
                               isolated=False, summaries=False, want_decode=True, kernels=self.kernels)
        decode = jax.eval_shape(fn, self.params, lay.pack(self.dummy_layout(key)), self.pool_shapes)[2]
        return ModelCache(layers=decode, length=jax.ShapeDtypeStruct((), jnp.int32))

    def slot_shapes(self):
        """The batched decode cache: a request's decode caches (stacked ones too) with `max_batch` rows on each
        leaf's batch axis (`programs.row_axes`)."""
        from hypic_jax.engine.programs import row_axes

        layers = self.decode_shapes().layers

        def widen(s, axis):
            shape = list(s.shape)
            shape[axis] = self.max_batch
            return jax.ShapeDtypeStruct(tuple(shape), s.dtype)

        return jax.tree.map(widen, layers, row_axes(layers))

    def writes_shapes(self, tokens: int):
        """What the span programs of a token rung write (shapes only): per pool part, for each of its layers the
        rows of the records capacity (linear layers' slots) or of the fresh tokens (attention layers' token rows),
        in the pools' own forms."""
        from hypic_jax import stitch

        capacity = self.capacity(ProgramKey("plain", tokens, self.max_keys))  # cold programs write the same
        out = []
        for spec, pool in zip(self.pool_shapes.specs, self.pool_shapes.parts):
            n = spec.members * (capacity.records if spec.kind == "slot" else capacity.tokens)
            out.append(stitch.RowWrites(jax.ShapeDtypeStruct((n,), jnp.int32),
                                        jax.tree.map(lambda a: jax.ShapeDtypeStruct((n,) + a.shape[1:], a.dtype),
                                                     pool)))
        return tuple(out)

    def warmup(self, max_prompt_tokens: int | None = None, *, progress: bool = True,
               ready_tokens: int | None = None) -> dict:
        """Compile every program a prompt of up to `max_prompt_tokens` tokens (default: the engine's limit) can use,
        ahead of time; with a compile cache a restarted process loads them instead. Afterwards a compilation counts
        as one while serving. `ready_tokens`: return once the programs of rungs up to it are ready and compile the
        larger rungs on a background thread (a request that needs one of them waits for it; `programs.wait()`
        waits for them all). Returns the programs, seconds, XLA compilations, programs loaded from the store and
        programs left compiling."""
        limit = self.max_prompt_tokens if max_prompt_tokens is None else max_prompt_tokens
        if not is_integer(limit) or limit < 1:
            raise ValueError(f"max_prompt_tokens must be an integer >= 1, got {limit!r}")
        if limit > self.max_prompt_tokens:
            raise ValueError(f"max_prompt_tokens {limit} exceeds the engine's {self.max_prompt_tokens}")
        if ready_tokens is not None and (not is_integer(ready_tokens) or ready_tokens < 1):
            raise ValueError(f"ready_tokens must be an integer >= 1 or None, got {ready_tokens!r}")
        self._check_open()
        try:
            return self._warmup(limit, progress, ready_tokens)
        except Exception as error:
            if out_of_memory(error):
                raise DeviceMemoryError(self._memory_advice(error)) from error
            raise

    def _memory_advice(self, error: Exception) -> str:
        """What a warmup that ran out of device memory should say: what the engine holds, what JAX may use, and
        what to change."""
        gb = lambda n: f"{n / 1e9:.1f} GB"  # noqa: E731
        held = [f"{gb(tree_nbytes(self.params))} of weights",
                f"{gb(self.pools.nbytes)} of entry pools (cache_bytes)",
                f"{gb(sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(self.slot_shapes())))} of batched "
                f"decode rows (max_batch={self.max_batch})"]
        stats = jax.devices()[0].memory_stats() or {}
        limit = (f"; JAX may use {gb(stats['bytes_limit'])} of the device (XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75 of "
                 f"it unless set)" if "bytes_limit" in stats else "")
        first = str(error).strip().splitlines()[0][:300]
        return (f"warmup ran out of device memory ({first}). The engine holds {', '.join(held)}{limit}. Lower "
                f"cache_bytes (--cache-gb), max_batch or max_prompt_tokens, or let JAX use more of the device "
                f"(XLA_PYTHON_CLIENT_MEM_FRACTION before the process starts; hypic-jax serve --gpu-memory-fraction).")

    def _warmup(self, limit: int, progress: bool, ready_tokens: int | None) -> dict:
        before = backend_compiles()
        keys = self.programs.keys_for(limit)
        later = [] if ready_tokens is None else self.programs.later(keys, self.ladder.rung(min(ready_tokens, limit)))
        now = [k for k in keys if k not in later]
        spans = [k for k in now if k.kind in ("cold", "pic", "plain")]
        seconds = self.programs.compile(spans, progress=progress)
        seconds += self.programs.compile([k for k in now if k not in spans], progress=False, background=later)
        if self.segment_mesh is not None:
            seconds += self._warm_mesh(limit)
        self._slot_cache()
        tiers = self.hierarchy.warm(self._cold_prefills(limit))
        self.programs.serving = True
        return dict(programs=len(keys), seconds=seconds, backend_compiles=backend_compiles() - before,
                    loaded=self.programs.stats.loaded, pending=len(later), **tiers)

    def _cold_prefills(self, limit: int) -> ColdPrefills:
        """The cold prefills of the rungs up to `limit` that calibrate the tiers' cost model."""

        def run(lengths, tokens) -> None:
            logits, _ = self._run("cold", [lay.Span(lay.FRESH, n) for n in lengths], tokens)
            jax.block_until_ready(logits)

        return ColdPrefills(rungs=[r for r in self.ladder.rungs if r <= self.ladder.rung(limit)],
                            max_segments=self.max_segments, vocab_size=self.vocab_size,
                            ready=lambda r: ProgramKey("cold", r, r) in self.programs, run=run)

    def _warm_mesh(self, limit: int) -> float:
        """Compile (and run once) the segment-parallel programs of every rung up to `limit`; calibrate the segment
        cost model."""
        mesh = self.segment_mesh
        rungs = [r for r in self.ladder.rungs if r <= self.ladder.rung(limit)]
        seconds = mesh.compile(rungs)
        mesh.calibrate(rungs)
        return seconds

    def first_linear_layer(self) -> int | None:
        """0 when the model's first layer is a linear one (whose state a seam of W-1 tokens makes exact)."""
        kinds = [kind for kind, _ in self.arch.pool_layout(self.config, self.model.dtype)]
        return 0 if kinds and kinds[0] == "slot" else None

    @property
    def stats(self) -> dict:
        out = dict(cache=self.cache.stats.as_dict(), programs=dataclasses.asdict(self.programs.stats),
                   pool_slots_free=self.pools.free_slots(), tiers=self.hierarchy.stats())
        if self.segment_mesh is not None:
            out["segment_parallel"] = self.segment_mesh.as_dict()
        return out

    # Inputs ------------------------------------------------------------------------------------------------------------
    def _request_options(self, mode, seam, cache_salt) -> tuple[str, float]:
        """A request's mode and seam (None: the engine's), checked with its salt before any work: only None means
        the default (an empty or zero mode is refused, not read as the engine's), and a salt must be a string
        (`str(salt)` would let 5 and "5" share entries)."""
        mode = check_mode(self.mode if mode is None else mode)
        seam = check_seam(self.seam if seam is None else seam)  # a knob, or a tuple of one per document
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt must be a string or None, got {type(cache_salt).__name__}")
        return mode, seam

    def segment_tokens(self, segments) -> list[list[int]]:
        """Token ids of each segment: a list of strings or of token-id lists, or one string split on the separator."""
        return [ids.tolist() for ids in self.reader(segments)]

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this engine is closed")

    # Running -----------------------------------------------------------------------------------------------------------
    def _run(self, kind: str, spans, fresh_tokens, *, transfer=True, rope=True, hidden=False):
        fresh_tokens = np.asarray(fresh_tokens, np.int32)
        capacity, keys = self._fit(kind, spans, len(fresh_tokens))
        key = ProgramKey(kind, capacity.tokens, capacity.tokens if kind == "cold" else self.max_keys)
        if keys > key.keys:
            raise ValueError(f"the request needs {keys} keys, over the engine's capacity of {key.keys}")
        arrays = lay.build(spans, self.capacity(key), isolated=kind == "cold", tokens=fresh_tokens,
                           summaries=kind != "plain", transfer=transfer, rope=rope)
        if hidden:
            key = key._replace(kind=f"{kind}_hidden")
        program = self.programs.get(key, diagnostic=hidden)
        # a stitched PIC request records nothing: its program returns no writes, and no commit runs
        commit = None if kind == "pic" else self.programs.get(ProgramKey("commit", key.tokens, 0))
        with self.pools.lock:
            logits, writes, decode, *rest = program(self.params, lay.pack(arrays), self._pool_arrays())
            logits.copy_to_host_async()  # queued behind the program: no host round trip once it ends
            if commit is not None:
                self._write_pools(commit, writes)
        return (logits, decode, rest[0]) if hidden else (logits, decode)

    def _fit(self, kind: str, spans, fresh: int) -> tuple[lay.Capacity, int]:
        """The smallest ladder capacity a `kind` program of these spans and `fresh` fresh tokens fits, and the keys
        it needs."""
        pieces, records = lay.count_pieces(spans, isolated=kind == "cold")
        keys = fresh if kind == "cold" else sum(s.length for s in spans)
        return self.ladder.fit(fresh, keys, pieces, records, isolated=kind == "cold"), keys

    def _pool_arrays(self):
        if self.pools.arrays is None:
            raise RuntimeError("the entry pools were lost when a write into them failed; restart the engine")
        return self.pools.arrays

    def _write_pools(self, program, *args) -> None:
        """pools = program(pools, *args), the pools donated (every program that writes them runs here, under
        `pools.lock`). The engine never keeps a reference to donated buffers; a program refused before it ran
        (nothing donated) leaves the pools as they were."""
        pools, self.pools.arrays = self._pool_arrays(), None
        try:
            self.pools.arrays = program(pools, *args)
        finally:
            if self.pools.arrays is None and not any(a.is_deleted() for a in jax.tree.leaves(pools)):
                self.pools.arrays = pools

    @property
    def _mesh_pools(self):
        """The pools of the segment mesh's devices (`mesh_pools.MeshPools`), or None."""
        return None if self.segment_mesh is None else self.segment_mesh.pools

    # Prefill -----------------------------------------------------------------------------------------------------------
    def prefill(self, segments, mode: str | None = None, seam: float | None = None,
                cache_salt: str | None = None, *, wait: bool = True) -> PrefillResult:
        """Prefill a request; returns the last position's logits, the stats (`PrefillStats`) and the per-layer
        caches after the prompt (`decode`, on the device: what a decode row continues from). `seam` (in
        transition_rope_recompute) is one knob for every document or a sequence of one knob per document.

        wait=False returns as soon as the programs are issued: the logits are then a device array (their copy to
        the host already queued behind the program), and the stats' times cover the planning and the issuing only.
        The scheduler admits requests this way, so the host handles the previous decode step while the prefill
        runs."""
        return self._prefill(segments, mode, seam, cache_salt, wait=wait)

    def _prefill(self, segments, mode, seam, cache_salt, *, hidden: bool = False, wait: bool = True,
                 fuse: tuple | None = None):
        self._check_open()
        mode, seam = self._request_options(mode, seam, cache_salt)
        ids = self.reader(segments)
        total = sum(map(len, ids))
        if total > self.max_prompt_tokens:
            raise ValueError(f"the prompt has {total} tokens, over the engine's max_prompt_tokens of "
                             f"{self.max_prompt_tokens}")
        if len(ids) > self.max_segments + 1:
            raise ValueError(f"the request has {len(ids) - 1} segments before its query, over the engine's "
                             f"max_segments of {self.max_segments}")
        if isinstance(seam, tuple) and mode == "transition_rope_recompute":
            segment_seams(seam, [len(d) for d in ids[:-1]])  # one knob per document, checked before any work
        start = time.perf_counter()
        # what the request gave pool room to and did not store, and its promotions, go back when it fails
        with self._device_lock, self.cache.pinned() as pins, self.hierarchy.request():
            plan = self._plan(mode, ids, seam, cache_salt, pins, total)
            cold_s = time.perf_counter() - start
            combine_start = time.perf_counter()
            transfer, rope = mode != "addition", mode not in ("addition", "transition")
            fused = None
            if fuse is not None and plan.kind == "pic":
                fused = self._run_fused(plan.spans, plan.fresh, fuse, transfer=transfer, rope=rope)
            if fused is None:
                out = self._run(plan.kind, plan.spans, plan.fresh, transfer=transfer, rope=rope, hidden=hidden)
                logits, decode = out[:2]
            else:
                logits, decode = fused[0], None
            for entry in plan.stores:
                self.hierarchy.store(entry)
            tokens = np.concatenate(ids).tolist()  # while the program runs
            if wait or hidden:
                logits = np.asarray(logits)
        end = time.perf_counter()
        stats = PrefillStats(
            mode=mode, seam=(tuple(map(float, seam)) if isinstance(seam, tuple) else float(seam))
            if mode == "transition_rope_recompute" else 0.0, segments=len(ids),
            prompt_tokens=total, cached_tokens=plan.cached_tokens, recomputed_tokens=len(plan.fresh),
            cold_tokens=plan.cold_tokens, hits=plan.hits, misses=plan.misses, ttft_s=end - start,
            cold_s=cold_s, combine_s=end - combine_start)
        result = PrefillResult(logits=logits, stats=stats, tokens=tokens, decode=decode)
        if hidden:
            return result, np.asarray(out[2]), len(plan.fresh)
        if fuse is not None:
            return result, None if fused is None else fused[1:]
        return result

    def _run_fused(self, spans, fresh_tokens, fuse, *, transfer: bool, rope: bool):
        """The fused program of a pic request's layout and a decode step (`slot_decode_and_prefill`), or None when
        none is compiled for its bucket and rung (the caller then runs the programs apart)."""
        tokens, lengths, sampling, row, first = fuse
        fresh_tokens = np.asarray(fresh_tokens, np.int32)
        capacity, keys = self._fit("pic", spans, len(fresh_tokens))
        key = ProgramKey("fused", capacity.tokens, self.max_keys, len(tokens))
        if capacity.tokens not in self.fused_rungs or keys > key.keys or sampling.full() or first.full():
            return None
        if self.programs.serving and key not in self.programs:
            return None  # still compiling in the background: never wait for it
        arrays = lay.build(spans, self.capacity(key), isolated=False, tokens=fresh_tokens, summaries=True,
                           transfer=transfer, rope=rope)
        program = self.programs.get(key)
        with self.pools.lock:
            slots, self._slots = self._slot_cache(), None
            tokens = tokens if isinstance(tokens, jax.Array) else np.asarray(tokens, np.int32)
            *out, self._slots = program(self.params, slots, tokens, np.asarray(lengths, np.int32), sampling,
                                        lay.pack(arrays), self._pool_arrays(), np.asarray(row, np.int32), first)
        logits = out[8]
        logits.copy_to_host_async()
        return logits, Sampled(*out[:4]), Sampled(*out[4:8])

    @property
    def slots_held(self) -> bool:
        """Whether the batched decode cache is held: False before its first use and after a program that took it
        failed (the rows' caches went with it; the next use allocates zeros)."""
        return self._slots is not None

    def slot_decode_and_prefill(self, tokens, lengths, sampling: SamplingRows, segments, row: int,
                                first: SamplingRows, *, mode: str | None = None, seam: float | None = None,
                                cache_salt: str | None = None) -> tuple[Sampled, Sampled, PrefillResult]:
        """`slot_decode(tokens, lengths, sampling)`, then the prefill of `segments` into `row` (`prefill`, then
        `slot_insert(row, ..., first)`): the rows' samples, the request's first token, its `PrefillResult` (whose
        `decode` is None, its caches being in `row`, and whose logits may still be on the device).

        A request whose final forward is a stitched PIC program of a rung in `fused_rungs` runs it in one program
        with the step (`programs._fused_decode`: each layer's MLP and experts read once for both; the same
        results); any other request, or a sampler that truncates, runs the programs one after the other. `row`
        may lie among the stepped rows if it is free (the step leaves it to the insert)."""
        if len(tokens) not in self.batch_buckets:
            raise ValueError(f"{len(tokens)} rows is not a batch bucket {self.batch_buckets}")
        if not 0 <= row < self.max_batch:
            raise ValueError(f"row must lie in [0, {self.max_batch}), got {row}")
        with self._device_lock:
            # issued, not waited for: the caller handles a step in flight while this runs
            result, fused = self._prefill(segments, mode, seam, cache_salt, wait=False,
                                          fuse=(tokens, lengths, sampling, row, first))
            if fused is not None:
                return (*fused, result)
            stepped = self.slot_decode(tokens, lengths, sampling)
            inserted = self.slot_insert(row, result, first)
            result.decode = None
            return stepped, inserted, result

    def prefill_piece(self, segments, mode: str | None = None, seam: float | None = None,
                      cache_salt: str | None = None, *, budget: int) -> PrefillPiece:
        """One piece of a request's prefill, for a prefill spread between decode steps: the segments whose entries
        no tier holds are prefilled in order, whole, until `budget` tokens (at least one segment), and their entries
        stored; the programs are issued, not waited for. In a position-independent mode those are the missing
        segments, each prefilled alone; in `prefix_cache` the leading segments after the longest cached run, under
        that run (each recorded as a prefix entry, as the request's own prefill would). Returns what the piece did
        (`PrefillPiece`; an empty one in `full_recompute`, which caches nothing). The request's own `prefill` then
        finds these entries, unless the pools evicted them in between (then it computes them again)."""
        self._check_open()
        mode, seam = self._request_options(mode, seam, cache_salt)
        if budget < 1:
            raise ValueError(f"budget must be >= 1 token, got {budget}")
        if mode == "full_recompute":
            return PrefillPiece(0, 0, 0, 0)
        ids = self.reader(segments)
        if mode == "prefix_cache":
            return self._prefix_piece(ids, cache_salt, budget)
        with self._device_lock, self.cache.pinned() as pins, self.hierarchy.request():
            docs, seams, keys, _, missing = planner.lookup_pic(self, ids, mode, seam, cache_salt, pins)
            piece, tokens = {}, 0
            for key, i in missing.items():
                if piece and tokens + len(docs[i]) > budget:
                    break
                piece[key] = i
                tokens += len(docs[i])
            mine = [k if k in piece else None for k in keys]
            if piece:
                self._prefill_missing(piece, docs, seams, pins, {}, mine)
            self._finish_promotions()
        return PrefillPiece(tokens, sum(len(docs[i]) for i in missing.values()) - tokens,
                            sum(k is not None for k in mine),
                            sum(len(d) - w for d, w, k in zip(docs, seams, mine) if k is not None))

    def _prefix_piece(self, ids, salt, budget: int) -> PrefillPiece:
        """`prefill_piece` in `prefix_cache`: the documents after the longest cached run, up to `budget` tokens,
        computed under that run and recorded as prefix entries."""
        docs = ids[:-1]
        with self._device_lock, self.cache.pinned() as pins, self.hierarchy.request():
            _, hits = planner.prefix_hits(self, docs, salt, pins)
            start = end = len(hits)
            tokens = 0
            while end < len(docs) and (end == start or tokens + len(docs[end]) <= budget):
                tokens += len(docs[end])
                end += 1
            if end == start:
                self._finish_promotions()
                return PrefillPiece(0, 0, 0, 0)
            plan = planner.plan_prefix(self, docs[:end], salt, pins, query=False)
            self._run(plan.kind, plan.spans, plan.fresh)
            for entry in plan.stores:  # those the pools had room for
                self.hierarchy.store(entry)
        return PrefillPiece(tokens, sum(map(len, docs[end:])), len(plan.stores), sum(e.length for e in plan.stores))

    def _plan(self, mode, ids, seam, salt, pins, total) -> Plan:
        """What a request runs (`planner.plan`)."""
        return planner.plan(self, mode, ids, seam, salt, pins, total)

    def _finish_promotions(self) -> None:
        """Write the request's promotions and copies from other devices into the pools (the planner calls this once
        the request's cold prefill was issued)."""
        self.hierarchy.finish_promotions()

    def _prefill_missing(self, missing: dict[str, int], docs, seams, pins, entries: dict[int, Entry], keys) -> int:
        """Prefill the documents under `missing` (key -> first document) in one packed, isolated program that
        records their entries; every document under a missing key then reads its entry (into `entries`). Returns
        the tokens computed."""
        mesh = self.segment_mesh
        bins, device_of = None, {}
        if mesh is not None and mesh.pools is not None:  # each entry in the pools of the device that computes it
            bins = mesh.bins([len(docs[i]) for i in missing.values()])
            device_of = {j: k for k, b in enumerate(bins) for j in b}
            self.hierarchy.issue_fetches()  # this request's hits on other devices: their gathers go before the bins
        spans, stored = [], {}
        for j, (key, i) in enumerate(missing.items()):
            entry = self.hierarchy.new_entry("pic", key, docs[i], seams[i], pins, device=device_of.get(j))
            spans.append(lay.Span(lay.FRESH, len(docs[i]), record_from=seams[i], record_slot=entry.slot,
                                  record_rows=entry.rows))
            stored[key] = entry
        cold = [docs[i] for i in missing.values()]
        timed = self.programs.serving and self.cost.wants_samples()
        cold_start = time.perf_counter()
        if mesh is not None:
            mesh.run(spans, cold, bins=bins, timed=self.programs.serving)
            timed = False  # the mesh keeps its own predicted and measured times
        else:
            cold_logits, _ = self._run("cold", spans, np.concatenate(cold))
        if timed:  # calibrates the recompute cost model (waits for the cold prefill)
            jax.block_until_ready(cold_logits)
            self.cost.observe([len(doc) for doc in cold], time.perf_counter() - cold_start)
        for key, entry in stored.items():
            if entry.device is None:
                self.hierarchy.store(entry)
            else:  # kept where it was computed; the request reads a home copy (`_finish_promotions` writes it)
                stored[key] = self.hierarchy.store_remote(entry, pins)
        for i, key in enumerate(keys):
            if key is not None and i not in entries:
                entries[i] = stored[key]
        return sum(map(len, cold))

    # Generation --------------------------------------------------------------------------------------------------------
    def generate(self, segments, max_new_tokens: int = 32, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, stop=None, seed: int | None = 0, logprobs: int | None = None,
                 mode: str | None = None, seam: float | None = None, cache_salt: str | None = None) -> GenerateResult:
        """Prefill (any mode), then decode, through the scheduler the server runs (the same programs and the same
        device sampler: one request and seed give the same tokens through here and over HTTP).

        temperature 0 is greedy; otherwise a draw from the temperature-scaled distribution within the top_k tokens
        (0: all) and the top_p nucleus, seeded (seed None: a fresh seed). stop: strings (need a tokenizer; the text
        ends before the first one, and a special token's text, such as `<|eos|>`, stops at its id) and/or token ids
        (kept as the last token). logprobs k: each token's log-probability and the k likeliest alternatives."""
        from hypic_jax.engine.scheduler import Request, RequestError

        self._check_open()
        params = sampling_params(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                 seed=seed, stop=stop, logprobs=logprobs, vocab_size=self.vocab_size,
                                 tokenizer=self.tokenizer, top_logprobs=self.top_logprobs)
        self._request_options(mode, seam, cache_salt)
        ids = self.reader(segments)
        total = sum(map(len, ids))
        if max_new_tokens > self.max_new_tokens:
            raise ValueError(f"max_new_tokens ({max_new_tokens}) is over the engine's max_new_tokens of "
                             f"{self.max_new_tokens}")
        if total + max_new_tokens > self.max_keys:
            raise ValueError(f"prompt ({total}) + max_new_tokens ({max_new_tokens}) exceeds the engine's context "
                             f"capacity of {self.max_keys} (raise max_new_tokens or max_prompt_tokens)")
        events = []
        request = Request([i.tolist() for i in ids], params, events.append, mode=mode, seam=seam,
                          cache_salt=cache_salt, timeout=self.options.scheduler.request_timeout,
                          tokenizer=self.tokenizer)
        try:
            self.scheduler.run(request)
        except RequestError as error:  # refused at the door: the queue is full, or the engine is closing
            raise RuntimeError(error.message) from error
        end = events[-1]
        if end["type"] == "error":
            error = end["error"]
            raise (ValueError if error.status == 400 else RuntimeError)(error.message) from (
                error if isinstance(error, RequestError) else None)
        tokens = [t for e in events if e["type"] == "delta" for t in e["token_ids"]]
        lps = [lp for e in events if e["type"] == "delta" for lp in (e["logprobs"] or [])]
        first = request.first_token_at or request.ended
        return GenerateResult(text=end["text"] if self.tokenizer is not None else None, tokens=tokens,
                              stats=end["stats"], decode_s=request.ended - first,
                              finish_reason=end["finish_reason"], logprobs=lps if logprobs is not None else None)

    # Batched decoding ------------------------------------------------------------------------------------------------
    def batch_bucket(self, rows: int, full: bool = False) -> int:
        """The smallest batch bucket that holds rows [0, rows) and whose step program (with the truncating sampler
        when `full`) is compiled; while a background warmup is still compiling the smaller ones, a larger compiled
        bucket steps the same rows (rows never mix), else the smallest that holds them."""
        if not 1 <= rows <= self.max_batch:
            raise ValueError(f"rows must lie in [1, {self.max_batch}], got {rows}")
        fitting = [b for b in self.batch_buckets if b >= rows]
        kind = "batch_full" if full else "batch"
        return next((b for b in fitting if ProgramKey(kind, b, self.max_keys) in self.programs), fitting[0])

    def _slot_cache(self):
        """The batched decode cache, allocated on first use (or again after a failed step lost it)."""
        if self._slots is None:
            self._slots = self.programs.get(ProgramKey("slots", self.max_batch, self.max_keys))()
        return self._slots

    def slot_insert(self, row: int, prefill: PrefillResult, sampling: SamplingRows) -> Sampled:
        """Place `prefill`'s decode caches in `row` of the batched cache (whatever the row held is overwritten) and
        sample the request's first token from its logits with `sampling` (one row)."""
        if not 0 <= row < self.max_batch:
            raise ValueError(f"row must lie in [0, {self.max_batch}), got {row}")
        program = self.programs.get(ProgramKey("insert_full" if sampling.full() else "insert", 1, self.max_keys))
        layers = stacked_like(self.params["layers"], prefill.decode)  # the decode program's form (as it comes)
        with self._device_lock:
            slots, self._slots = self._slot_cache(), None  # donated: never left pointing at a deleted buffer
            *out, self._slots = program(slots, np.asarray(row, np.int32), layers,
                                        np.asarray(prefill.logits, np.float32), sampling)
        return Sampled(*out)

    def slot_move(self, source: int, target: int) -> None:
        """Copy row `source` of the batched cache into row `target` (what `target` held is overwritten, `source`
        keeps its copy): the scheduler's move of a stream into a lower free row (`SchedulerOptions.compact_rows`)."""
        for name, row in (("source", source), ("target", target)):
            if not 0 <= row < self.max_batch:
                raise ValueError(f"{name} row must lie in [0, {self.max_batch}), got {row}")
        program = self.programs.get(ProgramKey("move", 1, self.max_keys))
        with self._device_lock:
            slots, self._slots = self._slot_cache(), None
            (self._slots,) = program(slots, np.asarray(source, np.int32), np.asarray(target, np.int32))

    def slot_decode(self, tokens, lengths, sampling: SamplingRows) -> Sampled:
        """One decode step of rows [0, b), b = len(tokens) (a batch bucket): row i takes `tokens[i]` at position
        `lengths[i]` (the tokens its cache already holds). Rows without a request may be passed anything: rows never
        mix, and `slot_insert` overwrites a row whole. `tokens` may be the previous step's `Sampled.device_ids` (a
        step of the same bucket): the step is then dispatched without waiting for that one."""
        rows = len(tokens)
        if rows not in self.batch_buckets:
            raise ValueError(f"{rows} rows is not a batch bucket {self.batch_buckets}")
        program = self.programs.get(ProgramKey("batch_full" if sampling.full() else "batch", rows, self.max_keys))
        with self._device_lock:
            slots, self._slots = self._slot_cache(), None
            tokens = tokens if isinstance(tokens, jax.Array) else np.asarray(tokens, np.int32)
            *out, self._slots = program(self.params, slots, tokens, np.asarray(lengths, np.int32), sampling)
        return Sampled(*out)

    # Diagnostics -------------------------------------------------------------------------------------------------------
    def diagnose(self, segments, mode: str | None = None, seam: float | None = None,
                 cache_salt: str | None = None) -> list[dict]:
        """Per-layer relative deviation of the query tokens' hidden states, `mode` against full recompute:
        ||h_mode - h_full|| / ||h_full|| after every layer, plus the last position's logits. The query is fresh in every mode, so both runs hold its hidden states. Its programs (the
        span programs with every layer's hidden states) are compiled on first use, apart from the serving ladder
        (`stats["programs"]["diagnostic"]`)."""
        full, h_full = self.query_hidden_states(segments, "full_recompute")
        ours, h_ours = self.query_hidden_states(segments, mode, seam, cache_salt)
        h_full, h_ours = np.asarray(h_full, np.float64), np.asarray(h_ours, np.float64)
        rows = []
        kinds = self.layer_kinds
        for layer in range(h_full.shape[0]):
            ref = np.linalg.norm(h_full[layer])
            rows.append(dict(layer=layer, kind=kinds[layer],
                             deviation=float(np.linalg.norm(h_ours[layer] - h_full[layer]) / max(ref, 1e-30))))
        ref = np.linalg.norm(full.logits)
        rows.append(dict(layer="logits", kind="head",
                         deviation=float(np.linalg.norm(ours.logits - full.logits) / max(ref, 1e-30))))
        return rows

    @property
    def layer_kinds(self) -> list[str]:
        """Each layer's kind: "linear" (a linear-attention layer) or "full" (full attention)."""
        return _layer_kinds(self.config)

    def query_hidden_states(self, segments, mode: str | None = None, seam: float | None = None,
                            cache_salt: str | None = None) -> tuple[PrefillResult, np.ndarray]:
        """The prefill of `segments` in `mode` and every layer's output at its query's tokens (the last segment,
        fresh in every mode): float32 [layers, query tokens, hidden]. Runs the diagnostic programs (`diagnose`)."""
        self._check_open()
        segs = self.reader(segments)
        query = len(segs[-1])
        result, hidden, fresh = self._prefill(segs, mode, seam, cache_salt, hidden=True)
        return result, np.asarray(hidden[:, fresh - query:fresh])

    # Lifecycle ---------------------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the scheduler (what it still holds fails with 503) and the background compiles, wait for the
        demotions in flight, and with a disk tier write every entry of the device and host tiers there
        (`persist`), so an engine restarted on the same folder serves them. Idempotent; the engine serves nothing
        afterwards."""
        if self.closed:
            return
        self.closed = True
        _OPEN_ENGINES.discard(self)
        if self._scheduler is not None:
            self._scheduler.stop()
        self.programs.close()
        try:
            if self.tiers.disk is not None:
                log.info("writing the cache to the disk tier %s", self.tiers.disk.folder)
                self.hierarchy.persist()
        finally:
            self.hierarchy.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def clear_cache(self, *, disk: bool = False) -> None:
        """Drop every entry of the device and host tiers (and with `disk`, this model's files)."""
        self.hierarchy.clear(disk=disk)

    # Cache tiers -------------------------------------------------------------------------------------------------------
    @property
    def bandwidths(self) -> tr.Bandwidths:
        """The tiers' bandwidths, measured at warmup where the tiers are on."""
        return self.hierarchy.bandwidths

    @property
    def _promoting(self) -> dict:
        """The running request's promotions not yet written into the pools."""
        return self.hierarchy.promoting

    def demote_all(self, *, sync: bool = True) -> int:
        """Evict every device entry that no request holds into the lower tiers (dropped where they are off);
        returns how many left the device. sync: wait until their demotions have reached their tiers."""
        return self.hierarchy.demote_all(sync=sync)

    def sync_tiers(self) -> None:
        """Wait until every demotion issued so far has reached its tier (stats, `persist` and `clear_cache` do)."""
        self.hierarchy.sync()

    def persist(self) -> int:
        """Write every entry of the device tier (every device of the segment mesh) and the host tier to the disk tier
        (they stay where they are); returns the entries on disk afterwards. A restarted engine on the same
        `disk_cache_dir` finds them."""
        if self.tiers.disk is None:
            raise ValueError("persist needs a disk tier (disk_cache_dir)")
        self._check_open()
        return self.hierarchy.persist()


def _compile_cache_or_none(folder: Path, *, explicit: bool) -> Path | None:
    """The compile cache folder in use. The default folder may be unusable (a read-only home): then None, with a
    warning (a process without one compiles every start, which is slow but correct); a folder named explicitly
    that cannot be used is an error."""
    try:
        return use_compile_cache(folder)
    except ValueError as error:
        if explicit:
            raise
        log.warning("no compile cache (%s); every start compiles", error)
        return None


__all__ = ["Engine", "Plan", "load_tokenizer", "use_compile_cache", "layer_plan", "stack_layers"]
