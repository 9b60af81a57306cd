"""The shape-stable PIC engine: request layouts as data, a bounded ladder of compiled programs, fixed pools.

`StableEngine` serves the same requests as `hypic_jax.Engine` (same modes, seams, salts, stats) with a fixed set
of programs, so a workload of new document lengths and orders never compiles after `warmup`:

    program     per token rung     what it runs
    cold        tokens = keys      the missing segments of a request, packed and isolated, recording their entries
    pic         tokens, max keys   a PIC request: cached interiors stitched with fresh seams and the query (it
                                   records nothing, so it returns no writes)
    plain       tokens, max keys   full recompute and prefix cache (fresh spans continue each other's state)
    commit      tokens             the records a span program returns, written into the pools in place
    decode      max keys           one decode step
    insert      max keys           a prefill's decode caches into a row of the batched decode cache, first token
    batch       rows, max keys     one decode step of rows [0, b) of the batched decode cache, sampled per row

Token rungs are the `layout.Ladder`'s (powers of two and 1.5 times them; quarter octaves from 1,024 tokens).
Everything else is data: the layout's arrays (`hypic_jax.layout.LayoutArrays`) and the entries' slots and rows in
the pools (`hypic_jax.pools.Pools`), which hold every entry at their full capacity from the start. A compilation
after `warmup` (a shape outside the ladder) is counted in `stats` and logged with its shapes; a request over the
largest rung fails with an error naming the limit. Which programs exist and how long they took to compile:
`Programs.report()`.

Batched decoding (`max_batch` > 0, what a continuous-batching server uses): the engine keeps a decode cache of
`max_batch` rows on the device. `slot_insert` writes a prefill's decode caches into one row and samples the
request's first token; `slot_decode` runs one step of rows [0, b) for a batch bucket b (powers of two up to
`max_batch`), every row at its own position, and samples each row on the device from its own parameters
(`SamplingRows`), so only the sampled ids (and the log-probabilities, when read) leave the device. The step is the
model's own forward over a batch of one-token rows, each at its own position (`ModelCache.length` per row): rows
never mix, and each row's cache is written one token at a time.

Architectures provide `pool_layout(config, dtype)` and `span_forward_arrays(...)` (see `models/qwen3_5.py`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import threading
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Format, Layout
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hypic_jax import executables
from hypic_jax import layout as lay
from hypic_jax import stitch
from hypic_jax import tiers as tr
from hypic_jax.cache import Entry, SegmentCache, entry_key
from hypic_jax.engine import (MODES, SPAN_OPTIONS, Engine, GenerateResult, PrefillResult, PrefillStats, is_integer,
                              seam_tokens, use_compile_cache)
from hypic_jax.models.base import ModelCache, shard_params
from hypic_jax.models.layer_stack import LayerPlan, LayerStack, stacked_like
from hypic_jax.pools import PoolFull, Pools

log = logging.getLogger("hypic_jax.runtime")

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_compile_events = [0]


def _count_compile(event: str, duration: float, **_) -> None:
    if event == _BACKEND_COMPILE:
        _compile_events[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)


def backend_compiles() -> int:
    """XLA compilations this process has run so far (every program, any caller; a program that JAX's persistent
    cache serves counts too, programs loaded from an `executables.ExecutableStore` do not): what a test or
    benchmark reads before and after serving to prove that nothing compiled."""
    return _compile_events[0]


def layer_plan(model, *, scan: bool = True) -> LayerPlan:
    """How the shape-stable engine runs `model`'s layers (`layer_stack.LayerPlan`): its repeating pattern as one
    scan (layers share a pattern position when their parameters, pools and types have one structure), or with
    `scan=False` every layer unrolled."""
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
    """`model` with its layers stacked by `layer_plan` (a `layer_stack.LayerStack`, which reads like the list of
    layers, so `hypic_jax.Engine` and `Model` run it as well). `StableEngine` stacks a copy itself; with
    `consume=True` the per-layer arrays are deleted as they are stacked, for a model too large for two copies
    (every other holder of them loses them)."""
    layers = LayerStack.build(model.params["layers"], layer_plan(model, scan=scan), consume=consume)
    return type(model)(model.arch, model.config, dict(model.params, layers=layers))


class ProgramKey(NamedTuple):
    # "cold" | "pic" | "plain" | "commit" | "decode" | "insert" | "batch" (tokens: the rows), and "insert_full" /
    # "batch_full", their samplers with truncation and ranking (`SamplingRows.full`)
    kind: str
    tokens: int
    keys: int


TOP_LOGPROBS = 20  # the most alternatives a row's sampler returns (OpenAI's top_logprobs limit)
SLOT_LAYOUTS = ("default", "auto")  # StableEngine(slot_layouts=...): the batched decode cache's memory layouts


class DeviceMemoryError(RuntimeError):
    """The engine's programs do not fit the device memory JAX may use (the message says what it holds)."""


def _out_of_memory(error: Exception) -> bool:
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


class SamplingRows(NamedTuple):
    """Per-row sampling parameters of a batched step (each [rows]; `key` [rows, 2] uint32 threefry key data).
    temperature 0 is greedy; top_k 0 keeps every token; `step` (tokens the row has sampled so far) is folded into
    its key, so a seeded row draws the same numbers whatever batch it runs in; `top`: how many of the most likely
    tokens the row wants with their log-probabilities (0: none). A step where some row truncates or ranks runs the
    sampler that sorts the vocabulary (`full`), the others the one that does not."""

    temperature: Any
    top_p: Any
    top_k: Any
    key: Any
    step: Any
    top: Any

    @staticmethod
    def shapes(rows: int) -> "SamplingRows":
        sds = jax.ShapeDtypeStruct
        return SamplingRows(sds((rows,), jnp.float32), sds((rows,), jnp.float32), sds((rows,), jnp.int32),
                            sds((rows, 2), jnp.uint32), sds((rows,), jnp.int32), sds((rows,), jnp.int32))

    def full(self) -> bool:
        """Whether some row truncates its distribution (top_p < 1 or top_k > 0 at a temperature above 0) or asks
        for its top log-probabilities: the step then runs the sampler that sorts the vocabulary (`_sample_rows`)."""
        temperature, top_p, top_k = (np.asarray(a) for a in (self.temperature, self.top_p, self.top_k))
        truncates = (temperature > 0) & ((top_p < 1) | (top_k > 0))
        return bool(np.any(truncates) or np.any(np.asarray(self.top) > 0))

    @staticmethod
    def build(temperature, top_p, top_k, seed, step, top=None) -> "SamplingRows":
        """Host arrays from per-row lists; seeds are any non-negative integers below 2**64; top None: 0 per row."""
        seed = np.asarray(seed, np.uint64)
        key = np.stack([(seed >> np.uint64(32)).astype(np.uint32), (seed & np.uint64(0xFFFFFFFF)).astype(np.uint32)],
                       axis=-1)
        step = np.asarray(step, np.int32)
        top = np.zeros(step.shape, np.int32) if top is None else np.asarray(top, np.int32)
        return SamplingRows(np.asarray(temperature, np.float32), np.asarray(top_p, np.float32),
                            np.asarray(top_k, np.int32), key, step, top)


class Sampled:
    """What a batched step returns, as soon as the step is dispatched: `ids`, the sampled ids on the host (reading
    them waits for the step), `device_ids`, the same on the device (the next step's tokens, with no trip through
    the host), and the log-probabilities (of the model's own distribution, before temperature and truncation),
    left on the device until `logprobs()` asks for them."""

    def __init__(self, ids, chosen, top_ids, top_logprobs):
        ids.copy_to_host_async()  # queued behind the step, so reading `ids` waits for the step alone
        self.device_ids = ids
        self._ids: np.ndarray | None = None
        self._device = (chosen, top_ids, top_logprobs)

    @property
    def ids(self) -> np.ndarray:
        if self._ids is None:
            self._ids = np.asarray(self.device_ids)
        return self._ids

    def logprobs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(log-probability of each sampled id [rows], the top ids [rows, k], their log-probabilities [rows, k]);
        the top ids and log-probabilities are zeros unless some row of the step asked for them (`SamplingRows.top`)."""
        return tuple(np.asarray(a) for a in self._device)


@dataclasses.dataclass
class ProgramStats:
    programs: int = 0
    compile_s: float = 0.0
    serving_compiles: int = 0
    loaded: int = 0  # programs read from the engine's executable store instead of compiled


class Programs:
    """Owns every compiled program of one engine: compiles them ahead of time (`compile`), hands them out
    (`get`), and counts any compilation that happens once `serving` is set."""

    def __init__(self, engine: "StableEngine"):
        self.engine = engine
        self._compiled: dict[ProgramKey, Any] = {}
        self._seconds: dict[ProgramKey, float] = {}
        self._lock = threading.Lock()
        self.serving = False
        self.stats = ProgramStats()
        self._signature = None  # the parameters' and pools' shapes, as text (part of every digest)

    def keys_for(self, max_prompt_tokens: int) -> list[ProgramKey]:
        ladder = self.engine.ladder
        top = ladder.rung(max_prompt_tokens)
        rungs = [r for r in ladder.rungs if r <= top]
        keys = [ProgramKey(kind, r, r if kind == "cold" else self.engine.max_keys)
                for kind in ("cold", "pic", "plain") for r in rungs]
        keys += [ProgramKey("commit", r, 0) for r in rungs]
        keys.append(ProgramKey("decode", 1, self.engine.max_keys))
        if self.engine.max_batch:
            keys += [ProgramKey(kind, 1, self.engine.max_keys) for kind in ("insert", "insert_full")]
            keys += [ProgramKey(kind, b, self.engine.max_keys) for kind in ("batch", "batch_full")
                     for b in self.engine.batch_buckets]
        return keys

    def _lower(self, key: ProgramKey):
        engine = self.engine
        shapes = self._abstract
        jit = self._jit
        if key.kind == "decode":
            fn = jit(functools.partial(_decode, arch=engine.arch, config=engine.config), donate_argnums=2)
            return fn.lower(*shapes((engine.params, jax.ShapeDtypeStruct((), jnp.int32), engine._decode_shapes())))
        if key.kind == "commit":
            fn = jit(_commit, donate_argnums=0, out_shardings=self.pool_shardings())
            return fn.lower(*shapes((engine.pools.arrays, engine._writes_shapes(key.tokens))))
        if key.kind in ("insert", "insert_full"):
            layers = engine._decode_shapes().layers
            args = shapes((engine._slot_shapes(), jax.ShapeDtypeStruct((), jnp.int32), layers,
                           jax.ShapeDtypeStruct((engine.vocab_size,), jnp.float32), SamplingRows.shapes(1)))
            body = functools.partial(_insert, top_n=engine.top_logprobs, full=key.kind == "insert_full")
            return self._slot_jit(body, args, 0, self.slot_formats()).lower(*args)
        if key.kind in ("batch", "batch_full"):
            rows = jax.ShapeDtypeStruct((key.tokens,), jnp.int32)
            args = shapes((engine.params, engine._slot_shapes(), rows, rows, SamplingRows.shapes(key.tokens)))
            body = functools.partial(_batch_decode, arch=engine.arch, config=engine.config, rows=key.tokens,
                                     top_n=engine.top_logprobs, full=key.kind == "batch_full")
            # the largest bucket chooses the cache's layouts (slot_layouts="auto"); the rest take its choice
            chooses = key == self._layout_key()
            formats = Format(Layout.AUTO, engine.placement) if chooses else self.slot_formats()
            return self._slot_jit(body, args, 1, formats).lower(*args)
        capacity = engine._capacity(key)
        fn = jit(functools.partial(_span_program, arch=engine.arch, config=engine.config, capacity=capacity,
                                   isolated=key.kind == "cold", summaries=key.kind != "plain",
                                   want_decode=key.kind != "cold", want_writes=key.kind != "pic",
                                   algorithm=engine.compose_algorithm, linear_impl=engine.linear_impl,
                                   fold_impl=engine.fold_impl),
                 compiler_options=span_options(key.kind))
        packed = jax.ShapeDtypeStruct((lay.packed_size(capacity),), jnp.int32)
        return fn.lower(*shapes((engine.params, packed, engine.pools.arrays)))

    def _tracing_mesh(self):
        """The context a program is traced in: on a model mesh that mesh (`jax.set_mesh`), under which the span
        programs' linear cores and attention run on each device's own heads (`stitch.model_split`)."""
        placement = self.engine.placement
        return contextlib.nullcontext() if placement is None else jax.set_mesh(placement.mesh)

    def _abstract(self, tree):
        """Abstract values of a program's arguments: arrays with their shardings; on a model mesh every value
        without one (layouts, tokens, the decode caches) replicated over it (`StableEngine.placement`)."""
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
        return jax.tree.map(lambda a: a.sharding, self.engine.pools.arrays)

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
        if engine.slot_layouts != "auto" or not engine.batch_buckets:
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

    def _digest(self, key: ProgramKey) -> str:
        """What the program of `key` is made of, without tracing it (`executables.ExecutableStore.digest`)."""
        engine = self.engine
        if self._signature is None:
            self._signature = (executables.describe(engine.params), executables.describe(engine.pools.arrays))
        capacity = engine._capacity(key) if key.kind in ("cold", "pic", "plain") else None
        return engine.executables.digest(
            key, capacity, engine.ladder.max_pieces, engine.ladder.records, engine.ladder.chunk, engine.ladder.conv,
            engine.arch.__name__, repr(engine.config), engine.compose_algorithm, engine.linear_impl,
            engine.fold_impl, engine.top_logprobs, engine.max_batch, engine.max_keys, engine.slot_layouts,
            repr(sorted(span_options(key.kind).items())), *self._signature)

    def _build(self, key: ProgramKey):
        start = time.perf_counter()
        store = self.engine.executables
        placement = self.engine.placement
        devices = None if placement is None else list(placement.mesh.devices.flat)
        compiled = store.load(self._digest(key), devices) if store is not None else None
        if compiled is not None:
            seconds = time.perf_counter() - start
            with self._lock:
                self._compiled[key] = compiled
                self._seconds[key] = seconds
                self.stats.programs = len(self._compiled)
                self.stats.loaded += 1
            return compiled
        while compiled is None:
            try:
                with self._tracing_mesh():
                    lowered = self._lower(key)
                compiled = lowered.compile()
            except Exception as error:  # noqa: BLE001  (a kernel's lowering or compile failed: see below)
                # an automatic choice of Pallas kernels must never cost the engine its programs: fall back to
                # XLA (same results up to rounding; the records keep one form), the fold first (to the blocked
                # fold, which needs no host round trip per piece)
                engine = self.engine
                if key.kind not in ("cold", "pic", "plain"):
                    raise
                if engine.fold_impl == "auto":
                    what, engine.fold_impl = "the fold over the pieces through its Pallas kernel", "blocked"
                elif engine.linear_impl in (None, "auto"):
                    what, engine.linear_impl = "the linear cores through the Pallas kernels", "xla"
                else:
                    raise
                log.warning("the %s program for %d tokens failed to compile with %s (%s: %s); every span program "
                            "compiled from now on runs that part through XLA instead", key.kind, key.tokens, what,
                            type(error).__name__, str(error)[:500])
        if store is not None:
            store.save(self._digest(key), compiled)  # under the choices it compiled with (after any fallback)
        seconds = time.perf_counter() - start
        with self._lock:
            self._compiled[key] = compiled
            self._seconds[key] = seconds
            self.stats.programs = len(self._compiled)
            self.stats.compile_s += seconds
        return compiled

    def get(self, key: ProgramKey):
        compiled = self._compiled.get(key)
        if compiled is None:
            if self.serving:
                self.stats.serving_compiles += 1
                log.warning("compiling while serving: %s program for %d tokens, %d keys (outside the warmed-up "
                            "ladder)", key.kind, key.tokens, key.keys)
            compiled = self._build(key)
        return compiled

    def compile(self, keys: list[ProgramKey], *, progress: bool = True, workers: int | None = None) -> float:
        """Compile `keys` (those not compiled yet), lowering one by one and compiling on a thread pool: XLA
        compiles release the GIL. Returns the wall time."""
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
        workers = workers or min(8, max(1, len(rest)))
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            for _ in pool.map(self._build, rest):
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return time.perf_counter() - start

    def report(self) -> list[dict]:
        return [dict(kind=k.kind, tokens=k.tokens, keys=k.keys, compile_s=round(s, 3))
                for k, s in sorted(self._seconds.items())]


def model_placement(params) -> NamedSharding | None:
    """Where the engine's own arrays (pools, decode caches, layouts) go: None (the default device) for parameters
    on one device, else replicated over the parameters' mesh."""
    for leaf in jax.tree.leaves(params):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and len(sharding.device_set) > 1:
            return NamedSharding(sharding.mesh, PartitionSpec())
    return None


def tensor_parallel_mesh(tensor_parallel) -> Mesh:
    """A ("data", "model") mesh of 1 x M devices for `tensor_parallel`: a count M (this process's first M devices)
    or a sequence of jax devices."""
    from hypic_jax.segment_mesh import resolve_devices

    devices = resolve_devices(tensor_parallel, name="tensor_parallel", local=True)
    return Mesh(np.asarray(devices, dtype=object).reshape(1, len(devices)), ("data", "model"))


def place_tensor_parallel(arch, config, params, tensor_parallel):
    """`params` split over a tensor-parallel mesh (`tensor_parallel_mesh`) by the architecture's `param_specs`
    (Megatron-style column and row splits of the projections, experts over "model")."""
    mesh = tensor_parallel_mesh(tensor_parallel)
    if mesh.size == 1:  # one device: where the engine's arrays go by default, or refused
        if mesh.devices.flat[0] != jax.devices()[0]:
            raise ValueError(f"tensor_parallel={tensor_parallel}: a split over one device other than the default "
                             f"one; place the model there instead")
        return params
    specs = arch.param_specs(config)
    if isinstance(params["layers"], LayerStack):
        specs = dict(specs, layers=_stacked_specs(params["layers"], specs["layers"]))
    try:
        return shard_params(params, specs, mesh)
    except ValueError as error:
        raise ValueError(f"tensor_parallel={mesh.shape['model']}: the parameters of {arch.__name__} do not split "
                         f"evenly over {mesh.shape['model']} devices (each split axis, such as the heads, must be "
                         f"divisible by it): {error}") from error


def _stacked_specs(stack: LayerStack, layer_specs) -> LayerStack:
    """The per-layer PartitionSpecs `layer_specs` for the layers stacked in `stack`: a stacked part's leaves (or
    chunks of experts) take their layer's spec behind the new leading axis."""
    is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
    parts = []
    for part, tree in enumerate(stack.parts):
        spec = layer_specs[stack.plan.layer(part)]
        if stack.plan.members(part) == 1:
            parts.append(spec)
        else:
            parts.append(jax.tree.map(lambda p, sub: jax.tree.map(lambda _: PartitionSpec(None, *p), sub),
                                      spec, tree, is_leaf=is_spec))
    return LayerStack(tuple(parts), stack.plan)


def _check_model_mesh_options(host_cache_bytes, disk_cache_dir, peer_cache_bytes) -> None:
    """The tiers below the pools move entries between one device and the host; over a model mesh the engine
    keeps its entries in the pools only."""
    used = [name for name, on in (("host_cache_bytes", host_cache_bytes), ("disk_cache_dir", disk_cache_dir),
                                  ("peer_cache_bytes", peer_cache_bytes)) if on]
    if used:
        raise ValueError(f"{', '.join(used)}: the host, disk and peer tiers need the model on one device; with "
                         f"tensor parallelism the engine keeps its entries in the device pools only")


def span_options(kind: str) -> dict:
    """XLA options of the span program of `kind`: without the dot merger (`engine.SPAN_OPTIONS`), and the stitched
    (pic) program also without XLA's Triton GEMMs. Inside the scan over the layers those take their weights as
    copies sliced out of the stacked arrays (eight per layer and request: 1.3 ms at 20 layers of the 35B-A3B shape
    on an H100), where cuBLAS reads them in place (bench/RESULTS.md, "The weights' copies and the logits"). The
    cold and plain programs keep them: they are measured faster with them (same section)."""
    return {**SPAN_OPTIONS, "xla_gpu_enable_triton_gemm": False} if kind == "pic" else SPAN_OPTIONS


def _span_program(params, packed, pools, *, arch, config, capacity, isolated, summaries, want_decode, algorithm,
                  linear_impl=None, fold_impl="auto", want_writes=True):
    """A span program: the request's layout arrives packed in one int32 vector (`layout.pack`). Without
    `want_writes` (a stitched PIC request stores nothing) it returns None for the writes, and the rows it would
    write are never computed."""
    arrays = lay.unpack(packed, capacity)
    extra = {} if linear_impl is None else dict(linear_impl=linear_impl)  # None: the architecture's own choice
    logits, writes, decode = arch.span_forward_arrays(params, config, arrays, pools, isolated=isolated,
                                                      summaries=summaries, want_decode=want_decode,
                                                      algorithm=algorithm, fold_impl=fold_impl, **extra)
    return logits, (writes if want_writes else None), decode


def _commit(pools, writes):
    """Write a span program's records into the pools (donated: in place; see `stitch.row_writes` for why this is
    a program of its own)."""
    from hypic_jax import stitch

    return pools.replace(stitch.apply_row_writes(pool, w) for pool, w in zip(pools.parts, writes))


def _decode(params, token, cache, *, arch, config):
    logits, cache = arch.forward(params, config, token.reshape(1, 1), cache=cache)
    return logits[0, -1], cache


def _sample_rows(logits, sampling: SamplingRows, top_n: int, full: bool):
    """Per row: greedy (temperature 0) or a Gumbel-max draw from the temperature-scaled distribution, restricted
    (with `full`) to the top_k tokens and then to the top_p nucleus of the rows that ask for it (the smallest prefix
    whose mass reaches top_p, as `hypic_jax.engine`'s host sampler). Returns (ids, their log-probabilities, top-n ids
    and log-probabilities; the top are zeros without `full`).

    `full` is static, one program each (`SamplingRows.full` chooses): a sort of every row's vocabulary is the costly
    part of truncation and ranking, and choosing it on the device (a conditional) would make the host wait for the
    whole step to reach the choice before it could issue anything after it."""
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.maximum(sampling.temperature, 1e-6)[:, None]
    if full:
        ordered = -jnp.sort(-scaled, axis=-1)  # descending
        rank = jnp.arange(vocab)[None]
        k = jnp.where(sampling.top_k > 0, jnp.minimum(sampling.top_k, vocab), vocab)[:, None]
        ordered_k = jnp.where(rank < k, ordered, -jnp.inf)
        probs = jax.nn.softmax(ordered_k, axis=-1)
        keep = (jnp.cumsum(probs, axis=-1) - probs < sampling.top_p[:, None]) & (rank < k)
        kept = jnp.maximum(jnp.sum(keep, axis=-1), 1)
        threshold = jnp.take_along_axis(ordered, (kept - 1)[:, None], axis=-1)
        truncates = (sampling.top_p < 1) | (sampling.top_k > 0)  # per row: the others draw from all tokens
        scaled = jnp.where(truncates[:, None] & (scaled < threshold), -jnp.inf, scaled)

    def gumbel(key, step):
        key = jax.random.fold_in(jax.random.wrap_key_data(key, impl="threefry2x32"), step)
        return jax.random.gumbel(key, (vocab,), jnp.float32)

    drawn = jnp.argmax(scaled + jax.vmap(gumbel)(sampling.key, sampling.step), axis=-1).astype(jnp.int32)
    ids = jnp.where(sampling.temperature > 0, drawn, greedy)
    chosen = jnp.take_along_axis(logprobs, ids[:, None], axis=-1)[:, 0]
    if full:
        top_logprobs, top_ids = jax.lax.top_k(logprobs, top_n)
        top_ids = top_ids.astype(jnp.int32)
    else:
        top_logprobs = jnp.zeros((logprobs.shape[0], top_n), logprobs.dtype)
        top_ids = jnp.zeros((logprobs.shape[0], top_n), jnp.int32)
    return ids, chosen, top_ids, top_logprobs


def _row_axes(layers):
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
                         slots, layers, _row_axes(slots))
    return (*_sample_rows(logits[None], sampling, top_n, full), slots)


def _batch_decode(params, slots, tokens, lengths, sampling, *, arch, config, rows, top_n, full):
    """One decode step of rows [0, rows) of the batched cache, each at its own length: the model's forward over a
    batch of `rows` one-token rows with per-row positions (`ModelCache.length` of shape [rows]: keys and values
    are written by a scatter of one token per row), then per-row sampling. Rows never mix: every operation is per
    row or per token."""
    axes = _row_axes(slots)
    capacity = jax.tree.leaves(slots)[0].shape[jax.tree.leaves(axes)[0]]  # max_batch
    part = slots if rows == capacity else jax.tree.map(lambda a, axis: jax.lax.slice_in_dim(a, 0, rows, axis=axis),
                                                       slots, axes)
    logits, cache = arch.forward(params, config, tokens[:, None], cache=ModelCache(part, lengths))
    slots = jax.tree.map(lambda full, new, axis: jax.lax.dynamic_update_slice_in_dim(full, new.astype(full.dtype),
                                                                                     0, axis=axis),
                         slots, cache.layers, axes)
    return (*_sample_rows(logits[:, -1], sampling, top_n, full), slots)


@functools.lru_cache(maxsize=256)
def _seam_span(length: int) -> lay.Span:
    """The fresh span of a seam: one shared object per length (spans are frozen), not one per document."""
    return lay.Span(lay.FRESH, length)


def _token_tuple(tokens) -> tuple[int, ...]:
    """Token ids as the tuple of ints an entry keeps."""
    return tuple(tokens.tolist()) if isinstance(tokens, np.ndarray) else tuple(int(t) for t in tokens)


class StableEngine(Engine):
    """Position-independent caching with a bounded set of compiled programs (see the module docstring).

    max_prompt_tokens: the largest prompt `warmup` compiles for (longer ones fail with a clear error).
    max_segments: the most segments of one request. max_new_tokens: room left for generation after the longest
    prompt (the keys capacity holds both). token_rungs: explicit token capacities instead of the geometric
    ladder from `min_tokens`. cache_bytes: the pools' byte budget (allocated up
    front). max_batch: rows of the batched decode cache (0: none; see the module docstring). Other arguments as
    `hypic_jax.Engine`.

    Tiers (`hypic_jax.tiers`): host_cache_bytes (0: off) and disk_cache_dir with disk_cache_bytes (None:
    unbounded, 0: off) keep entries evicted from the pools; eviction: "cost" or "lru"; host_bandwidth and
    disk_bandwidth (bytes/s) override what `warmup` measures; disk_write_through writes every new entry to disk
    when it is stored (else entries reach the disk when evicted, or through `persist()`). Compact entries off the
    device (`tiers.Mover`): tier_dtype="bfloat16" stores every float32 piece (T, S, float32 K/V and conv tails)
    in bfloat16 (promoted entries are the rounded values, widened back); tier_transfer_tol stores a dense T's heads
    only where their largest |entry| exceeds it (0: drops the heads whose T decayed to exactly zero).
    peer_cache_bytes (0: off): the peer tier, a budget on each of the engine's other devices (`devices=N`) that
    holds entries demoted from the first device before the host tier does; a hit there is one copy between devices
    (over NVLink on a GPU host) instead of one from host memory. host_memory:
    "pinned" (the default) keeps the host tier's entries in page-locked memory where the device has it (demotions
    are written there by the gather program, promotions are one DMA each), "pageable" in numpy arrays.

    devices (None: one device): a count or a list of jax devices over which a PIC request's missing segments are
    prefilled in one program, split into one bin per device by `policy` ("lpt" or "rr"; `hypic_jax.segment_mesh`).
    In one process each of those devices holds entry pools of `cache_bytes` of its own, where the entries its bins
    compute stay; the stitched program reads copies of them on the first device (`hypic_jax.mesh_pools`).

    tensor_parallel (None: one device): a count M or a list of jax devices over which the parameters (by the
    architecture's `param_specs`), the pools (`pools.split_spec`) and every program are split, a ("data", "model")
    mesh of 1 x M; a model loaded with `hypic_jax.load(mesh=...)` is followed without it. With `devices=` beside it
    the cold bins' records come back gathered into the split pools (`segment_mesh`). The host, disk and peer tiers
    are refused with it (docs/api.md, "Tensor parallelism").

    scan_layers: run the model's repeating layers as one scan in the span and decode programs (`layer_stack`; a
    program then compiles one period of the pattern instead of every layer: `bench/layer_scan.py`). The engine
    keeps a stacked copy of the layers unless the model's are stacked already (`stack_layers`), and the decode
    caches stacked by the same plan (`PrefillResult.decode` is then a `LayerStack`, which reads like the tuple of
    per-layer caches); False unrolls them.

    linear_impl: how the span programs run the linear layers' cores (`stitch.linear_over_layout`): "auto" (the
    default), the Pallas kernels (`pallas.gdn.gdn_varlen`) where `stitch.linear_kernel_fits` says they fit (a GPU,
    bfloat16 values) and the chunk loops elsewhere; "xla", the chunk loops everywhere; "pallas", the kernels
    everywhere (in the Pallas interpreter off a GPU); None, the architecture's own choice (Qwen3.5 / Qwen3-Next
    follow `gdn_kernel`, Kimi and Ring the XLA loops). The kernel path equals the loops in interpret mode
    (tests/test_stable_kernels.py); on the H200 it is what every `bench/rag_trace.py` row of bench/RESULTS.md ran
    (`--linear-impl pallas`). A kernel that fails to compile under "auto" falls back to the loops.

    slot_layouts: the memory layouts of the batched decode cache. "auto" (the default): the compiler picks them
    for the largest batch program and every program that reads or writes the cache (the other batch buckets, the
    insert, the cache's allocation) uses the same ones. A step whose layers run as a scan then reads each layer's
    keys, values and states in the layout its products want instead of transposing whole stacks of them on the way
    into the scan and back, as the row-major "default" makes a GPU do (`bench/decode_step.py --slot-layouts default
    auto` times both). Results are the same either way.

    fold_impl: how the span programs fold the pieces (the state entering each; `stitch.linear_over_layout`):
    "auto" (one Pallas kernel per layer on a GPU, `pallas.piece_fold`; the blocked fold on a GPU where the
    kernel does not fit or fails to compile; the XLA loop elsewhere), "pallas", "xla" (a loop over the pieces in
    use) or "blocked" (batched products in blocks, no loop bound by data: `stitch._blocked_fold`).
    """

    def __init__(self, model, *, tokenizer=None, cache_bytes: int | None = None,
                 mode: str = "transition_rope_recompute", seam: float = 8, separator: str = "<<PIC_SEP>>",
                 max_context: int | None = None, source: str | None = None, compose_algorithm: str | None = "auto",
                 max_prompt_tokens: int = 4096, max_segments: int = 64, max_new_tokens: int = 256,
                 min_tokens: int = 64, token_rungs: tuple[int, ...] | None = None, compile_cache=None,
                 mean_entry_tokens: int = 512, max_batch: int = 0, host_cache_bytes: int = 0,
                 disk_cache_dir=None, disk_cache_bytes: int | None = None, eviction: str = "cost",
                 host_bandwidth: float | None = None, disk_bandwidth: float | None = None,
                 disk_write_through: bool = False, tier_dtype: str | None = None,
                 tier_transfer_tol: float | None = None, host_memory: str = "pinned", peer_cache_bytes: int = 0,
                 devices=None, tensor_parallel=None,
                 policy: str = "lpt", linear_impl: str | None = "auto", scan_layers: bool = True,
                 fold_impl: str = "auto", slot_layouts: str = "auto"):
        if not hasattr(model.arch, "span_forward_arrays"):
            raise ValueError(f"architecture {model.arch.__name__} has no span_forward_arrays; the shape-stable "
                             f"engine cannot run it")
        super().__init__(model, tokenizer=tokenizer, cache_bytes=cache_bytes, mode=mode, seam=seam,
                         separator=separator, max_context=max_context, source=source,
                         compose_algorithm=compose_algorithm, compile_cache=compile_cache, pool_entries=False)
        if linear_impl not in (None, "xla", "pallas", "auto"):
            raise ValueError(f"linear_impl must be None, 'xla', 'pallas' or 'auto', got {linear_impl!r}")
        self.linear_impl = linear_impl
        if fold_impl not in stitch.FOLD_IMPLS:
            raise ValueError(f"fold_impl must be one of {stitch.FOLD_IMPLS}, got {fold_impl!r}")
        self.fold_impl = fold_impl  # the span programs' fold over the pieces (`stitch.linear_over_layout`)
        for name, value, least in (("max_prompt_tokens", max_prompt_tokens, 1), ("max_segments", max_segments, 1),
                                   ("max_new_tokens", max_new_tokens, 0), ("min_tokens", min_tokens, 1),
                                   ("mean_entry_tokens", mean_entry_tokens, 1), ("max_batch", max_batch, 0)):
            if not is_integer(value) or value < least:  # a float or a bool would reach the shapes of programs
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        self.max_prompt_tokens, self.max_segments, self.max_new_tokens = max_prompt_tokens, max_segments, max_new_tokens
        chunk = int(getattr(self.config, "chunk_size", 64))
        conv = int(getattr(self.config, "conv_kernel", 4)) - 1
        # a request records at most one entry per segment; a record is an entry's worth of program output
        # (4.2 MB per linear layer at the 35B-A3B shape), so records get their own, smaller capacity
        self.ladder = lay.Ladder(max_tokens=max_prompt_tokens, max_pieces=2 * max_segments + 2,
                                 max_records=max_segments + 1, min_tokens=min_tokens, chunk=chunk, conv=conv,
                                 token_rungs=token_rungs)
        self.max_keys = max_prompt_tokens + max_new_tokens
        pieces = self.arch.pool_layout(self.config, self.model.dtype)
        self.plan = layer_plan(self.model, scan=scan_layers)
        # the span programs scan the repeating layers: stacked parameters (a copy, unless the model's are stacked
        # already: `stack_layers`) and pools stored by the same plan
        if tensor_parallel is not None:
            self.params = place_tensor_parallel(self.arch, self.config, self.params, tensor_parallel)
        self.placement = model_placement(self.params)
        if self.placement is not None:
            _check_model_mesh_options(host_cache_bytes, disk_cache_dir, peer_cache_bytes)
        self.params = dict(self.params, layers=LayerStack.build(self.params["layers"], self.plan))
        budget = cache_bytes if cache_bytes is not None else 1 << 30
        self.pools = Pools.for_budget(pieces, budget, mean_tokens=mean_entry_tokens, plan=self.plan,
                                      device=self.placement)
        self._init_tiers(host_cache_bytes, disk_cache_dir, disk_cache_bytes, eviction, host_bandwidth,
                         disk_bandwidth, disk_write_through, tier_dtype, tier_transfer_tol, host_memory,
                         peer_cache_bytes, devices)
        self.cache = SegmentCache(cache_bytes, on_drop=self._dropped,
                                  policy=tr.DevicePolicy(self.policy) if eviction == "cost" else None)
        self.max_batch = int(max_batch)
        if slot_layouts not in SLOT_LAYOUTS:
            raise ValueError(f"slot_layouts must be one of {SLOT_LAYOUTS}, got {slot_layouts!r}")
        self.slot_layouts = slot_layouts
        # powers of two below max_batch, then max_batch: a step pays for at most twice its busy rows
        max_batch = self.max_batch
        self.batch_buckets = tuple(b for b in (1 << i for i in range(max_batch.bit_length())) if b < max_batch) + (
            (max_batch,) if max_batch else ())
        self.top_logprobs = min(TOP_LOGPROBS, self.vocab_size)
        self._slots = None  # the batched decode cache, made on first use
        self._fill_slots = None
        # compiled programs kept whole next to JAX's cache: a restarted process loads them without lowering
        self.executables = (None if self.compile_cache is None
                            else executables.ExecutableStore(self.compile_cache / "hypic-programs"))
        self.programs = Programs(self)
        self._device_lock = threading.RLock()
        self._unstored: list[Entry] = []
        # key -> (entry, tr.Transfer, tr.Pieces, tier): this request's promotions not yet written into the pools;
        # tier "device": a copy from another device's pools (`mesh_pools`), whose pieces are None
        self._promoting: dict[str, tuple] = {}
        self._fetching: list = []  # this request's copies from other devices' pools, not yet issued (`mesh_pools`)
        self.segment_mesh = None  # segment-parallel cold prefills (`hypic_jax.segment_mesh`); None: one device
        if devices is not None:
            from hypic_jax.segment_mesh import SegmentMesh

            self.segment_mesh = SegmentMesh(self, devices, policy)

    # Programs -------------------------------------------------------------------------------------------------------
    def _capacity(self, key: ProgramKey) -> lay.Capacity:
        kind_chunk = lay.chunk_for(key.kind, self.ladder.chunk)
        records = 0 if key.kind == "pic" else self.ladder.records  # stitched PIC requests record nothing
        return lay.Capacity(tokens=key.tokens, pieces=self.ladder.max_pieces, keys=key.keys,
                            records=records, chunk=kind_chunk, conv=self.ladder.conv)

    def _dummy_layout(self, key: ProgramKey) -> lay.LayoutArrays:
        return lay.build([lay.Span(lay.FRESH, 1)], self._capacity(key), isolated=key.kind == "cold",
                         tokens=np.zeros(1, np.int32), summaries=key.kind != "plain")

    def _decode_shapes(self):
        """The decode cache a stitched program returns (shapes only): the decode program's input. With the layers
        scanned its layers are a `LayerStack` by the engine's plan, so the decode step scans them as they are."""
        key = ProgramKey("plain", self.ladder.rungs[0], self.max_keys)
        fn = functools.partial(_span_program, arch=self.arch, config=self.config, capacity=self._capacity(key),
                               isolated=False, summaries=False, want_decode=True, algorithm=self.compose_algorithm,
                               linear_impl=self.linear_impl, fold_impl=self.fold_impl)
        decode = jax.eval_shape(fn, self.params, lay.pack(self._dummy_layout(key)), self.pools.arrays)[2]
        return ModelCache(layers=decode, length=jax.ShapeDtypeStruct((), jnp.int32))

    def _slot_shapes(self):
        """The batched decode cache: a request's decode caches (stacked ones too) with `max_batch` rows on each
        leaf's batch axis (`_row_axes`)."""
        layers = self._decode_shapes().layers

        def widen(s, axis):
            shape = list(s.shape)
            shape[axis] = self.max_batch
            return jax.ShapeDtypeStruct(tuple(shape), s.dtype)

        return jax.tree.map(widen, layers, _row_axes(layers))

    def warmup(self, max_prompt_tokens: int | None = None, max_segments: int | None = None, *,
               progress: bool = True) -> dict:
        """Compile every program a prompt of up to `max_prompt_tokens` tokens can use, ahead of time; with
        `compile_cache=` a restarted process loads them instead (each program whole, `executables.ExecutableStore`,
        and JAX's persistent compilation cache for the programs that cannot be stored whole). Afterwards a
        compilation counts as one while serving. Returns the programs, the seconds it took, XLA compilations and
        programs loaded from the store."""
        if max_segments is not None and max_segments > self.max_segments:
            raise ValueError(f"max_segments {max_segments} exceeds the engine's {self.max_segments}")
        limit = self.max_prompt_tokens if max_prompt_tokens is None else max_prompt_tokens
        if not is_integer(limit) or limit < 1:
            raise ValueError(f"max_prompt_tokens must be an integer >= 1, got {limit!r}")
        if limit > self.max_prompt_tokens:
            raise ValueError(f"max_prompt_tokens {limit} exceeds the engine's {self.max_prompt_tokens}")
        try:
            return self._warmup(limit, progress)
        except Exception as error:
            if _out_of_memory(error):
                raise DeviceMemoryError(self._memory_advice(error)) from error
            raise

    def _memory_advice(self, error: Exception) -> str:
        """What a warmup that ran out of device memory should say: what the engine holds, what JAX may use, and
        what to change."""
        from hypic_jax.cache import tree_nbytes

        gb = lambda n: f"{n / 1e9:.1f} GB"  # noqa: E731
        held = [f"{gb(tree_nbytes(self.params))} of weights",
                f"{gb(self.pools.nbytes)} of entry pools (cache_bytes)"]
        if self.max_batch:
            held.append(f"{gb(sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(self._slot_shapes())))} of "
                        f"batched decode rows (max_batch={self.max_batch})")
        stats = jax.devices()[0].memory_stats() or {}
        limit = (f"; JAX may use {gb(stats['bytes_limit'])} of the device (XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75 of "
                 f"it unless set)" if "bytes_limit" in stats else "")
        first = str(error).strip().splitlines()[0][:300]
        return (f"warmup ran out of device memory ({first}). The engine holds {', '.join(held)}{limit}. Lower "
                f"cache_bytes (--cache-gb), max_batch or max_prompt_tokens, or let JAX use more of the device "
                f"(XLA_PYTHON_CLIENT_MEM_FRACTION before the process starts; hypic-jax serve --gpu-memory-fraction).")

    def _warmup(self, limit: int, progress: bool) -> dict:
        before = backend_compiles()
        keys = self.programs.keys_for(limit)
        spans = [k for k in keys if k.kind in ("cold", "pic", "plain")]
        seconds = self.programs.compile(spans, progress=progress)
        seconds += self.programs.compile([k for k in keys if k not in spans], progress=False)
        if self.segment_mesh is not None:
            seconds += self._warm_mesh(limit)
        if self.max_batch:
            self._slot_cache()  # allocating it compiles its fill programs: here, not while serving
        tiers = self._warm_tiers(limit)
        self.programs.serving = True
        return dict(programs=len(keys), seconds=seconds, backend_compiles=backend_compiles() - before,
                    loaded=self.programs.stats.loaded, **tiers)

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
                   pool_slots_free=self.pools.free_slots(), tiers=self._tier_stats())
        if self.segment_mesh is not None:
            out["segment_parallel"] = self.segment_mesh.as_dict()
        return out

    # Running ---------------------------------------------------------------------------------------------------------
    def _run(self, kind: str, spans, fresh_tokens, *, transfer=True, rope=True):
        fresh_tokens = np.asarray(fresh_tokens, np.int32)
        pieces, records = lay.count_pieces(spans, isolated=kind == "cold")
        keys = len(fresh_tokens) if kind == "cold" else sum(s.length for s in spans)
        capacity = self.ladder.fit(len(fresh_tokens), keys, pieces, records, isolated=kind == "cold")
        key = ProgramKey(kind, capacity.tokens, capacity.tokens if kind == "cold" else self.max_keys)
        if keys > key.keys:
            raise ValueError(f"the request needs {keys} keys, over the engine's capacity of {key.keys}")
        arrays = lay.build(spans, self._capacity(key), isolated=kind == "cold", tokens=fresh_tokens,
                           summaries=kind != "plain", transfer=transfer, rope=rope)
        program = self.programs.get(key)
        # a stitched PIC request records nothing: its program returns no writes, and no commit runs
        commit = None if kind == "pic" else self.programs.get(ProgramKey("commit", key.tokens, 0))
        with self.pools.lock:
            logits, writes, decode = program(self.params, lay.pack(arrays), self._pool_arrays())
            logits.copy_to_host_async()  # queued behind the program: no host round trip once it ends
            if commit is not None:
                self._write_pools(commit, writes)
        return logits, decode

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

    def _writes_shapes(self, tokens: int):
        """What the span programs of a token rung write (shapes only): per pool part, for each of its layers the
        rows of the records capacity (linear layers' slots) or of the fresh tokens (attention layers' token rows),
        in the pools' own forms."""
        from hypic_jax import stitch

        capacity = self._capacity(ProgramKey("plain", tokens, self.max_keys))  # cold programs write the same
        out = []
        for spec, pool in zip(self.pools.arrays.specs, self.pools.arrays.parts):
            n = spec.members * (capacity.records if spec.kind == "slot" else capacity.tokens)
            out.append(stitch.RowWrites(jax.ShapeDtypeStruct((n,), jnp.int32),
                                        jax.tree.map(lambda a: jax.ShapeDtypeStruct((n,) + a.shape[1:], a.dtype),
                                                     pool)))
        return tuple(out)

    def _allocate(self, tokens: int):
        return self.pools.allocate(tokens, self.cache.evict_one)

    def _new_entry(self, kind: str, key: str, doc, seam: int, pins, device: int | None = None) -> Entry:
        """A pinned entry given room in the engine's pools, or with `device` in the pools of that device of the
        segment mesh (`mesh_pools`; the home device's are the engine's own)."""
        n = len(doc) - seam
        mesh_pools = self._mesh_pools
        if mesh_pools is None or not mesh_pools.remote(device):
            device = None
        slot, rows = self._allocate(n) if device is None else mesh_pools.allocate(device, n)
        entry = Entry(key=key, tokens=_token_tuple(doc), kind=kind, seam=seam, layers=None,
                      nbytes=self.pools.entry_bytes(n), slot=slot, rows=rows, device=device)
        self._unstored.append(entry)
        return pins.add(entry)

    @property
    def _mesh_pools(self):
        """The pools of the segment mesh's devices (`mesh_pools.MeshPools`), or None."""
        return None if self.segment_mesh is None else self.segment_mesh.pools

    def _free(self, entry: Entry) -> None:
        """Give an entry's pool room back (in whichever device's pools it has it)."""
        if entry.device is None:
            self.pools.free(entry.slot, entry.rows)
        else:
            self._mesh_pools.free(entry)

    def _store(self, entry: Entry) -> None:
        self.cache.insert(entry)
        self._unstored.remove(entry)
        if self.disk_write_through and self.tiers.disk is not None:
            self._persist_entry(entry)

    def prefill(self, segments, mode: str | None = None, seam: float | None = None, cache_salt: str | None = None,
                *, _want_hidden: bool = False) -> PrefillResult:
        if _want_hidden:
            raise ValueError("the shape-stable engine does not return hidden states; use hypic_jax.Engine.diagnose")
        mode, seam = self._request_options(mode, seam, cache_salt)
        ids = self._segment_ids(segments)
        total = sum(map(len, ids))
        if total > self.max_prompt_tokens:
            raise ValueError(f"the prompt has {total} tokens, over the engine's max_prompt_tokens of "
                             f"{self.max_prompt_tokens}")
        if len(ids) > self.max_segments + 1:
            raise ValueError(f"the request has {len(ids) - 1} segments before its query, over the engine's "
                             f"max_segments of {self.max_segments}")
        start = time.perf_counter()
        with self._device_lock, self.cache.pinned() as pins:
            self._unstored = []  # given pool room by this request; freed if it fails before storing
            self._promoting = {}
            self._fetching = []
            try:
                plan = self._plan(mode, ids, seam, cache_salt, pins, total)
                cold_s = time.perf_counter() - start
                combine_start = time.perf_counter()
                logits, decode = self._run(plan["kind"], plan["spans"], plan["fresh"], transfer=mode != "addition",
                                           rope=mode not in ("addition", "transition"))
                for entry in plan["stores"]:
                    self._store(entry)
                tokens = np.concatenate(ids).tolist()  # while the program runs
                logits = np.asarray(logits)
            finally:
                for _, _, pieces, tier in self._promoting.values():  # a failed request's promotions go back
                    if tier != "device":  # another device's pools still hold those
                        self.tiers.give_back(pieces, tier)
                self._promoting = {}
                self._fetching = []
                for entry in self._unstored:
                    self._free(entry)
                self._unstored = []
        end = time.perf_counter()
        stats = PrefillStats(
            mode=mode, seam=float(seam) if mode == "transition_rope_recompute" else 0.0, segments=len(ids),
            prompt_tokens=total, cached_tokens=plan["cached_tokens"], recomputed_tokens=len(plan["fresh"]),
            cold_tokens=plan["cold_tokens"], hits=plan["hits"], misses=plan["misses"], ttft_s=end - start,
            cold_s=cold_s, combine_s=end - combine_start)
        return PrefillResult(logits=logits, stats=stats, tokens=tokens, decode=decode)

    def _plan(self, mode, ids, seam, salt, pins, total):
        """What a request runs: its spans, fresh tokens (an int32 array) and the entries it stores. `ids`: the
        segments' token ids as int32 arrays, which stay arrays throughout (keys hash their bytes, lookups compare
        them, fresh tokens are their slices)."""
        if mode == "full_recompute":
            return dict(kind="plain", spans=[lay.Span(lay.FRESH, total)], fresh=np.concatenate(ids), cached_tokens=0,
                        cold_tokens=0, hits=0, misses=0, stores=[])
        if mode == "prefix_cache":
            return self._plan_prefix_stable(ids, salt, pins)
        return self._plan_pic_stable(ids, mode, seam, salt, pins)

    def _plan_prefix_stable(self, ids, salt, pins):
        docs, query = ids[:-1], ids[-1]
        keys, hits = self._prefix_hits(docs, ids, salt, pins)
        self._finish_promotions()
        spans, fresh, stores, position, full = [], [], [], 0, False
        for j, doc in enumerate(docs):
            if j < len(hits):
                e = hits[j]
                spans.append(lay.Span(lay.CACHED, len(doc), canonical_start=position, slot=e.slot, kv_rows=e.rows,
                                      snapshot=True))
            else:
                try:  # recording is optional here: a prefix the pools cannot hold is computed, not cached
                    entry = None if full else self._new_entry("prefix", keys[j], doc, 0, pins)
                except PoolFull:
                    entry, full = None, True
                spans.append(lay.Span(lay.FRESH, len(doc)) if entry is None else
                             lay.Span(lay.FRESH, len(doc), record_from=0, record_slot=entry.slot,
                                      record_rows=entry.rows))
                fresh.append(doc)
                if entry is not None:
                    stores.append(entry)
            position += len(doc)
        spans.append(lay.Span(lay.FRESH, len(query)))
        fresh.append(query)
        return dict(kind="plain", spans=spans, fresh=np.concatenate(fresh), stores=stores,
                    cached_tokens=sum(e.length for e in hits), cold_tokens=0, hits=len(hits),
                    misses=len(docs) - len(hits))

    def _plan_pic_stable(self, ids, mode, seam, salt, pins):
        docs, query = ids[:-1], ids[-1]
        seams = [seam_tokens(seam, len(d)) if mode == "transition_rope_recompute" else 0 for d in docs]
        keys = [None if w >= len(doc) else entry_key(doc, fingerprint=self.fingerprint, kind="pic", seam=w, salt=salt)
                for doc, w in zip(docs, seams)]
        # every entry at once (each distinct key once), before any lookup could evict for a request that cannot fit
        room = {key: len(doc) - w for doc, w, key in zip(docs, seams, keys) if key is not None}
        self.pools.check_room(room.values())
        entries: dict[int, Entry] = {}
        missing: dict[str, int] = {}
        for i, (doc, w, key) in enumerate(zip(docs, seams, keys)):
            if key is None:
                continue
            entry = self._find(key, doc, pins, kind="pic", seam=w)
            if entry is None:
                missing.setdefault(key, i)
            else:
                entries[i] = entry
        hit_indices = set(entries)
        hits = len(entries)
        misses = sum(1 for key in keys if key is not None) - hits
        cold_tokens = 0
        if missing:  # one packed, isolated prefill of every missing segment, recording its entry
            cold_tokens = self._prefill_missing(missing, docs, seams, pins, entries, keys)
        self._finish_promotions()  # after the cold prefill was issued: the promotions' copies overlap with it
        spans, fresh = [], []
        for i, (doc, w) in enumerate(zip(docs, seams)):
            if w:
                spans.append(_seam_span(w))
                fresh.append(doc[:w])
            if w < len(doc):
                e = entries[i]
                spans.append(lay.Span(lay.CACHED, len(doc) - w, canonical_start=w, slot=e.slot, kv_rows=e.rows))
        cached_tokens = sum(entries[i].length for i in hit_indices)
        spans.append(lay.Span(lay.FRESH, len(query)))
        fresh.append(query)
        return dict(kind="pic", spans=spans, fresh=np.concatenate(fresh), stores=[], cached_tokens=cached_tokens,
                    cold_tokens=cold_tokens, hits=hits, misses=misses)

    def _prefill_missing(self, missing: dict[str, int], docs, seams, pins, entries: dict[int, Entry], keys) -> int:
        """Prefill the documents under `missing` (key -> first document) in one packed, isolated program that
        records their entries; every document under a missing key then reads its entry (into `entries`). Returns
        the tokens computed."""
        mesh = self.segment_mesh
        bins, device_of = None, {}
        if mesh is not None and mesh.pools is not None:  # each entry in the pools of the device that computes it
            bins = mesh.bins([len(docs[i]) for i in missing.values()])
            device_of = {j: k for k, b in enumerate(bins) for j in b}
            self._issue_fetches()  # this request's hits on other devices: their gathers go before the bins
        spans, stored = [], {}
        for j, (key, i) in enumerate(missing.items()):
            entry = self._new_entry("pic", key, docs[i], seams[i], pins, device=device_of.get(j))
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
                self._store(entry)
            else:  # kept where it was computed; the request reads a home copy (`_finish_promotions` writes it)
                mesh.pools.caches[entry.device].insert(entry)
                self._unstored.remove(entry)
                if self.disk_write_through and self.tiers.disk is not None:
                    self.tiers.persist(self._remote_pieces(entry))
                stored[key] = self._fetch_home(entry, pins)
        for i, key in enumerate(keys):
            if key is not None and i not in entries:
                entries[i] = stored[key]
        return sum(map(len, cold))

    # Generation -------------------------------------------------------------------------------------------------------
    def generate(self, segments, max_new_tokens: int = 32, temperature: float = 0.0, top_p: float = 1.0,
                 stop=None, seed: int = 0, mode: str | None = None, seam: float | None = None,
                 cache_salt: str | None = None) -> GenerateResult:
        """As `hypic_jax.Engine.generate`; decoding runs the one decode program over the keys capacity."""
        stop_ids, stop_texts = self._check_generation(max_new_tokens, top_p, stop, temperature, seed)
        self._request_options(mode, seam, cache_salt)
        segs = self.segment_tokens(segments)
        total = sum(map(len, segs))
        if total + max_new_tokens > self.max_keys:
            raise ValueError(f"prompt ({total}) + max_new_tokens ({max_new_tokens}) exceeds the engine's context "
                             f"capacity of {self.max_keys} (raise max_new_tokens or max_prompt_tokens)")
        pre = self.prefill(segs, mode=mode, seam=seam, cache_salt=cache_salt)
        start = time.perf_counter()
        cache = ModelCache(layers=stacked_like(self.params["layers"], pre.decode), length=np.asarray(total, np.int32))
        program = self.programs.get(ProgramKey("decode", 1, self.max_keys))

        def step(token, cache):
            with self._device_lock:
                logits, cache = program(self.params, np.asarray(token, np.int32), cache)
            return np.asarray(logits), cache

        return self._decode_loop(pre, step, cache, max_new_tokens, temperature, top_p, seed, stop_ids, stop_texts,
                                 start)

    # Batched decoding -------------------------------------------------------------------------------------------------
    def batch_bucket(self, rows: int) -> int:
        """The smallest batch bucket that holds rows [0, rows)."""
        if not self.max_batch:
            raise ValueError("this engine has no batched decode cache (max_batch=0)")
        if not 1 <= rows <= self.max_batch:
            raise ValueError(f"rows must lie in [1, {self.max_batch}], got {rows}")
        return next(b for b in self.batch_buckets if b >= rows)

    def _slot_cache(self):
        if self._slots is None:
            if self._fill_slots is None:  # kept: a cache lost to a failed step is remade without compiling
                shapes = self._slot_shapes()
                self._fill_slots = jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes),
                                           out_shardings=self.programs.slot_formats() or self.placement)
            self._slots = self._fill_slots()
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

    def clear_cache(self, *, disk: bool = False) -> None:
        """Drop every entry of the device and host tiers (and with `disk`, this model's files)."""
        self._clearing = True
        try:
            self.cache.clear()
            if self._mesh_pools is not None:
                self._mesh_pools.clear()
        finally:
            self._clearing = False
        self.sync_tiers()
        self.tiers.clear(disk=disk)

    # Tiers -----------------------------------------------------------------------------------------------------------
    def _init_tiers(self, host_bytes, disk_dir, disk_bytes, eviction, host_bandwidth, disk_bandwidth,
                    write_through, tier_dtype, tier_transfer_tol, host_memory, peer_bytes=0, devices=None) -> None:
        self.eviction = eviction
        self.cost = tr.CostModel()
        self.bandwidths = tr.Bandwidths(host=host_bandwidth or tr.DEFAULT_HOST_BANDWIDTH,
                                        disk=disk_bandwidth or tr.DEFAULT_DISK_BANDWIDTH)
        self._bandwidth_overrides = (host_bandwidth, disk_bandwidth)
        self.policy = tr.Policy(eviction, self.cost, lambda: self.bandwidths)
        if tier_dtype not in (None, "bfloat16"):
            raise ValueError(f"tier_dtype must be None or 'bfloat16', got {tier_dtype!r}")
        self.mover = tr.Mover(self.pools, self.max_prompt_tokens, compact=tier_dtype, transfer_tol=tier_transfer_tol,
                              host_memory=host_memory)
        peers = ()
        if peer_bytes:  # the peer tier: the engine's other devices (this process's), a budget on each
            if devices is None:
                raise ValueError("peer_cache_bytes needs the engine's other devices (devices=N with N >= 2)")
            from hypic_jax.segment_mesh import resolve_devices

            home = self.mover.device
            peers = tuple(d for d in resolve_devices(devices) if d != home and d.process_index == jax.process_index())
        self.tiers = tr.Tiers(leaves=self.mover.leaves, fingerprint=self.fingerprint, policy=self.policy,
                              host_bytes=host_bytes or 0, disk_dir=disk_dir, disk_bytes=disk_bytes,
                              form=tr.compact_form(tier_dtype, tier_transfer_tol), droppable=self.mover.droppable,
                              peers=peers, peer_bytes=peer_bytes or 0, mover=self.mover)
        self.disk_write_through = bool(write_through)
        self._clearing = False
        self._demote_errors = 0
        # seconds a request spent on the tiers' copies (where a tiered request's time goes, `bench/cache_tiers.py`):
        # issuing demotions and waiting for the ones in flight, issuing promotions, writing them into the pools
        self.tier_seconds = dict(demote_issue=0.0, demote_wait=0.0, promote_issue=0.0, promote_write=0.0)
        # demotions finish off the request's path: the copy out of the pools is issued at eviction (so the pool room
        # is free at once), its transfer to the host and the tier's bookkeeping run on this one thread
        self._demoter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hypic-demote")
        self._demoting: dict[str, concurrent.futures.Future] = {}
        self._demoting_lock = threading.Lock()

    def _warm_tiers(self, limit: int) -> dict:
        """Compile the promote/demote programs, measure the tiers' bandwidths, calibrate the cost model."""
        out = dict(tier_programs=0)
        if self.tiers.enabled:
            out["tier_programs"] = self.mover.compile(self.pools.arrays)
            host, disk = self._bandwidth_overrides
            folder = self.tiers.disk.folder if self.tiers.disk is not None else None
            self.bandwidths = tr.Bandwidths.measure(folder, host=host, disk=disk, staging=self.mover.host_sharding,
                                                    device=self.mover.device_sharding,
                                                    peers=[p.device for p in self.tiers.peers])
        if self.eviction == "cost":
            self._calibrate(limit)
        return out

    def _calibrate(self, limit: int) -> None:
        """Time cold prefills of the top rung and of one a quarter of its size, as one segment and as four (records
        nothing): the cost model's first samples."""
        rungs = [r for r in self.ladder.rungs if r <= self.ladder.rung(limit)]
        chosen = sorted({rungs[-1], min(rungs, key=lambda r: abs(r - rungs[-1] / 4))})
        rng = np.random.default_rng(0)
        vocab = int(getattr(self.config, "vocab_size", 2))
        for rung in chosen:
            for lengths in ([rung], [max(1, rung // 4)] * min(4, self.max_segments)):
                spans = [lay.Span(lay.FRESH, n) for n in lengths]
                tokens = rng.integers(0, vocab, sum(lengths))
                for attempt in range(2):  # the first run of a program pays one-time costs
                    start = time.perf_counter()
                    logits, _ = self._run("cold", spans, tokens)
                    jax.block_until_ready(logits)
                    if attempt:
                        self.cost.observe(lengths, time.perf_counter() - start)

    def _find(self, key: str, tokens, pins, *, kind: str, seam: int) -> Entry | None:
        """The pinned device entry under `key`, promoted from the host or disk tier when it is there. A promotion's
        copy is issued here and written into the pools by `_finish_promotions`, which the request calls after it
        issued its cold prefill (so the copy overlaps with it); until then the entry is this request's alone."""
        promoting = self._promoting.get(key)
        if promoting is not None:
            return pins.add(promoting[0])
        entry = self.cache.lookup(key, tokens, pins=pins)
        if entry is not None:
            return entry
        mesh_pools = self._mesh_pools
        if mesh_pools is not None:
            source = mesh_pools.lookup(key, tokens, pins)
            if source is not None:  # on another device: a home copy, issued with this request's other copies
                return self._fetch_home(source, pins)
        if not self.tiers.enabled:
            return None
        waited = time.perf_counter()
        self._await_demotion(key)
        self.tier_seconds["demote_wait"] += time.perf_counter() - waited
        found = self.tiers.take(key, _token_tuple(tokens))
        if found is None:
            return None
        pieces, tier = found
        if pieces.kind != kind or pieces.seam != seam:  # the key covers both; a mismatch is never served
            return None
        try:
            slot, rows = self._allocate(pieces.length)
        except PoolFull:
            self.tiers.give_back(pieces, tier)
            if kind == "prefix":  # a prefix cache computes what it cannot hold: a miss from here on
                return None
            raise
        entry = Entry(key=key, tokens=pieces.tokens, kind=kind, seam=seam, layers=None,
                      nbytes=self.pools.entry_bytes(pieces.length), slot=slot, rows=rows, uses=pieces.uses)
        self._unstored.append(entry)
        pins.add(entry)
        issued = time.perf_counter()
        try:
            transfer = self.mover.transfer(self.mover.stage(pieces), slot, rows)
            self.tier_seconds["promote_issue"] += time.perf_counter() - issued
        except Exception:
            self.tiers.give_back(pieces, tier)
            raise
        self._promoting[key] = (entry, transfer, pieces, tier)
        return entry

    def _fetch_home(self, source: Entry, pins) -> Entry:
        """A home entry for `source`, an entry in another device's pools: its copy is issued with the request's
        other copies (`_issue_fetches`) and written like a promotion; `source` stays where it is."""
        from hypic_jax.mesh_pools import Fetch

        doc = np.asarray(source.tokens, np.int32)
        target = self._new_entry(source.kind, source.key, doc, source.seam, pins)
        target.uses = source.uses
        self._fetching.append(Fetch(source.device, source, target))
        self._promoting[source.key] = (target, None, None, "device")
        return target

    def _issue_fetches(self) -> None:
        """Issue the copies `_fetch_home` queued (`MeshPools.fetch`: at most one gather per device and bucket)."""
        if not self._fetching:
            return
        fetching, self._fetching = self._fetching, []
        for fetch, transfer in self._mesh_pools.fetch(fetching):
            key = fetch.target.key
            self._promoting[key] = (fetch.target, transfer, None, "device")

    def _finish_promotions(self) -> None:
        """Write the promotions `_find` issued (and the copies from other devices) into the pools and make their
        entries visible to later requests."""
        self._issue_fetches()
        while self._promoting:  # one at a time: a failure leaves the rest to `prefill`, which gives them back
            key = next(iter(self._promoting))
            entry, transfer, pieces, tier = self._promoting[key]
            written = time.perf_counter()
            with self.pools.lock:
                programs = (self._mesh_pools.scatter_programs(transfer) if tier == "device"
                            else self.mover.scatter_programs(self._pool_arrays(), transfer))
                for program, args in programs:
                    self._write_pools(program, *args)
            self.tier_seconds["promote_write"] += time.perf_counter() - written
            del self._promoting[key]
            self.cache.insert(entry)
            self._unstored.remove(entry)
            if self.disk_write_through and pieces is not None:
                self.tiers.persist(pieces)

    def _pieces(self, entry: Entry) -> tr.Pieces:
        with self.pools.lock:
            started = self.mover.gather_start(self._pool_arrays(), entry.slot, entry.rows)
        return self._stored_pieces(entry, started)

    def _stored_pieces(self, entry: Entry, started) -> tr.Pieces:
        """`entry` off the device, from `Mover.gather_start`'s handle (waits for the transfer)."""
        return tr.Pieces(key=entry.key, tokens=entry.tokens, kind=entry.kind, seam=entry.seam, uses=entry.uses,
                         staged=self.mover.gather_finish(started))

    # at most this many demotions in flight (each holds its entry's copy, in device memory when the host tier is
    # pageable, until the host tier has it)
    MAX_PENDING_DEMOTIONS = 8

    def _dropped(self, entry: Entry) -> None:
        """`entry` left the device tier (no request holds it): issue its copy out of the pools, free its pool room,
        and let the demotion thread bring it to the host tier. An entry that another device of the segment mesh
        still holds is not demoted (that device keeps it); one evicted from another device's pools is dropped."""
        if entry.device is not None:
            self._free(entry)
            return
        mesh_pools = self._mesh_pools
        try:
            if (self.tiers.enabled and not self._clearing and entry.slot is not None and entry.key not in self.cache
                    and not (mesh_pools is not None and mesh_pools.holds(entry.key))):
                issued = time.perf_counter()
                with self.pools.lock:
                    started = self.mover.gather_start(self._pool_arrays(), entry.slot, entry.rows)
                waited = time.perf_counter()
                self.tier_seconds["demote_issue"] += waited - issued
                with self._demoting_lock:
                    pending = list(self._demoting.values())
                if len(pending) >= self.MAX_PENDING_DEMOTIONS:
                    concurrent.futures.wait(pending[: len(pending) - self.MAX_PENDING_DEMOTIONS + 1])
                self.tier_seconds["demote_wait"] += time.perf_counter() - waited
                with self._demoting_lock:
                    future = self._demoter.submit(self._finish_demotion, entry, started)
                    self._demoting[entry.key] = future
                future.add_done_callback(functools.partial(self._forget_demotion, entry.key))
        except Exception:  # a failed copy loses the entry, never the request
            self._demote_errors += 1
            log.exception("demoting a cache entry failed; it is dropped")
        finally:
            self.pools.free(entry.slot, entry.rows)

    def _finish_demotion(self, entry: Entry, started) -> None:
        try:
            self.tiers.put(self._stored_pieces(entry, started))
        except Exception:
            self._demote_errors += 1
            log.exception("demoting a cache entry failed; it is dropped")

    def _forget_demotion(self, key: str, future) -> None:
        with self._demoting_lock:
            if self._demoting.get(key) is future:
                del self._demoting[key]

    def _await_demotion(self, key: str) -> None:
        """Wait for `key`'s demotion if one is in flight (so that a lookup finds it in its tier)."""
        with self._demoting_lock:
            future = self._demoting.get(key)
        if future is not None:
            concurrent.futures.wait([future])

    def demote_all(self, *, sync: bool = True) -> int:
        """Evict every device entry that no request holds into the lower tiers (dropped where they are off);
        returns how many left the device. sync: wait until their demotions have reached their tiers."""
        count = 0
        with self._device_lock:
            while self.cache.evict_one():
                count += 1
        if sync:
            self.sync_tiers()
        return count

    def sync_tiers(self) -> None:
        """Wait until every demotion issued so far has reached its tier (stats, `persist` and `clear_cache` do)."""
        with self._demoting_lock:
            pending = list(self._demoting.values())
        concurrent.futures.wait(pending)

    def _persist_entry(self, entry: Entry) -> bool:
        if entry.key in self.tiers.disk:
            return True
        return self.tiers.persist(self._pieces(entry))

    def _remote_pieces(self, entry: Entry) -> tr.Pieces:
        """An entry of another device's pools off the device, in the tiers' stored form (its dtypes; every head)."""
        arrays = [a.astype(dtype) for a, (_, _, dtype) in zip(self._mesh_pools.pieces(entry), self.mover.leaves)]
        return tr.Pieces(key=entry.key, tokens=entry.tokens, kind=entry.kind, seam=entry.seam, arrays=arrays,
                         uses=entry.uses)

    def persist(self) -> int:
        """Write every entry of the device tier (every device of the segment mesh) and the host tier to the disk tier
        (they stay where they are); returns the entries on disk afterwards. A restarted engine on the same
        `disk_cache_dir` finds them."""
        if self.tiers.disk is None:
            raise ValueError("persist needs a disk tier (disk_cache_dir)")
        self.sync_tiers()
        with self._device_lock:
            for entry in self.cache.entries():
                self._persist_entry(entry)
            for entry in self._mesh_pools.entries() if self._mesh_pools is not None else ():
                if entry.key not in self.tiers.disk:  # held on another device only
                    self.tiers.persist(self._remote_pieces(entry))
            if self.tiers.host is not None:
                for pieces in self.tiers.host.values():
                    self.tiers.persist(pieces)
        return self.tiers.disk.stats.entries

    def _tier_stats(self) -> dict:
        self.sync_tiers()
        return dict(eviction=self.eviction, **self.tiers.stats(), demote_errors=self._demote_errors,
                    cost=self.cost.as_dict(), bandwidths=dataclasses.asdict(self.bandwidths),
                    host_memory="pinned" if self.mover.host_sharding is not None else "pageable",
                    demote_copy=self.mover.demote_copy,
                    seconds={k: round(v, 6) for k, v in self.tier_seconds.items()})


__all__ = ["StableEngine", "Programs", "ProgramKey", "SamplingRows", "Sampled", "backend_compiles", "MODES",
           "DeviceMemoryError",
           "use_compile_cache"]
