"""The PIC engine: segment cache + seam window + the six reuse modes, behind `prefill` and `generate`.

A request is a list of segments; the last one is the query (always computed, never cached). Every mode becomes a
`spans.SpanLayout` and one call of the architecture's `span_forward` over the request's fresh tokens:

    full_recompute             one fresh span of the whole prompt (the architecture's own `prefill` when it has one)
    prefix_cache               the longest run of cached leading segments (exact K/V + state snapshots), then fresh
                               spans for the rest (each recorded as a new prefix entry) and the query
    addition                   cached segments whose zero-start states are added (T dropped), keys not re-rotated
    transition                 + composition through the transfer operators T
    transition_rope            + RoPE re-rotation of cached keys (and of RoPE'd linear states)
    transition_rope_recompute  + the seam window: the first w tokens of every segment are recomputed under the true
                               prefix; the cache holds only the interior [w, n)

Segments missing from the cache are first prefilled together in one packed, isolated call (state reset and
block-diagonal attention at segment boundaries), which records their entries. One entry serves a segment in any
position, first included: a segment's seam at position 0 is recomputed from an empty prefix, which reproduces its
isolated prefill exactly, so the first segment is still exact ("cached whole" up to its w recomputed tokens).

Compilation: layouts are static, so each distinct layout (span kinds and lengths) compiles once; the same
equal-length documents in another order reuse the compilation, documents of new lengths compile anew.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
import struct
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hypic_jax import spans
from hypic_jax.cache import Entry, SegmentCache, entry_key, model_fingerprint, tree_nbytes
from hypic_jax.models import layer_stack
from hypic_jax.models.base import LinearCache, ModelCache
from hypic_jax.pool import EntryPool
from hypic_jax.linear_attn import PREFIX_IMPLS
from hypic_jax.pallas.compose import ALGORITHMS

MODES = tuple(spans.MODES)
PIC_MODES = ("addition", "transition", "transition_rope", "transition_rope_recompute")
DEFAULT_SEPARATOR = "<<PIC_SEP>>"


# ----------------------------------------------------------------------------------------------------------------
# Compiled entry points (architecture module, config, layout and mode are static: see the module docstring)


def _span_forward(params, tokens, cached, *, arch, config, layout, mode, want_logits, want_decode, want_hidden):
    return arch.span_forward(params, config, tokens, cached, layout, mode, want_logits=want_logits,
                             want_decode=want_decode, want_hidden=want_hidden)


_SPAN_STATIC = ("arch", "config", "layout", "mode", "want_logits", "want_decode", "want_hidden")
# Without XLA's GPU command buffers (CUDA graphs): a span program runs thousands of small kernels whose argument
# and output buffers move from request to request, so a captured graph is re-patched before every launch (host
# time per PIC request that `bench/pic_ttft.py --variants graphs` measures) and the device waits for all of it; plain
# launches stream out while the device already runs the first kernels.
# Without XLA's dot merger: it joins the products that share an input (a layer's q/k/v or qkv/z projections) into
# one by concatenating their weights, and for a few hundred fresh tokens that copy (50 MB per GDN layer, 28 us on
# the H200) costs more than the second product it saves.
SPAN_OPTIONS = {"xla_disable_hlo_passes": "dot-merger"}
_span_call = jax.jit(_span_forward, static_argnames=_SPAN_STATIC,
                     compiler_options={**SPAN_OPTIONS, "xla_gpu_enable_command_buffer": ""})
_span_call_graphs = jax.jit(_span_forward, static_argnames=_SPAN_STATIC,
                            compiler_options=SPAN_OPTIONS)  # command buffers on (XLA's default)


def _prefill(params, tokens, *, arch, config, max_len):
    return arch.prefill(params, config, tokens, max_len)


_prefill_call = jax.jit(_prefill, static_argnames=("arch", "config", "max_len"),
                        compiler_options={"xla_gpu_enable_command_buffer": ""})
_prefill_call_graphs = jax.jit(_prefill, static_argnames=("arch", "config", "max_len"))


@functools.partial(jax.jit, static_argnames=("arch", "config"))
def _decode_step(params, token, cache, *, arch, config):
    logits, cache = arch.forward(params, config, token.reshape(1, 1), cache=cache)
    return logits[0, -1], cache


# ----------------------------------------------------------------------------------------------------------------
# Results


@dataclasses.dataclass
class PrefillStats:
    """What a prefill did. cached_tokens: tokens served from entries that were already in the cache;
    recomputed_tokens: fresh tokens of the final forward (seams, query, uncached prefix segments);
    cold_tokens: tokens prefilled in isolation to create missing entries. Times: ttft_s the whole call; cold_s
    planning and cold prefills; combine_s the final forward until its logits are on the host, of which dispatch_s
    is host work before everything is enqueued on the device (argument handling, kernel launches)."""

    mode: str
    seam: float
    segments: int
    prompt_tokens: int
    cached_tokens: int
    recomputed_tokens: int
    cold_tokens: int
    hits: int
    misses: int
    ttft_s: float
    cold_s: float
    combine_s: float
    dispatch_s: float = 0.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class PrefillResult:
    logits: np.ndarray  # float32 [vocab] at the last prompt position
    stats: PrefillStats
    tokens: list[int]  # the whole prompt
    decode: Any = dataclasses.field(default=None, repr=False)  # per-layer caches after the prompt (device)
    hidden: Any = dataclasses.field(default=None, repr=False)  # [layers + 1, F, H] fresh-token hidden states


@dataclasses.dataclass
class GenerateResult:
    text: str | None
    tokens: list[int]
    stats: PrefillStats
    decode_s: float
    finish_reason: str  # "length" or "stop"


# ----------------------------------------------------------------------------------------------------------------
# Helpers


def _int32_list(ids) -> np.ndarray | None:
    """A non-empty list or tuple of ints as an int32 array, packed in one C loop (`struct`, which refuses floats,
    nested lists and ids past int32), or None when it holds anything else: NumPy's checks then say what. A list
    that starts with a bool goes to NumPy as well (which refuses a list of bools)."""
    if not isinstance(ids, (list, tuple)) or not ids or isinstance(ids[0], (bool, np.bool_)):
        return None
    out = np.empty(len(ids), np.int32)
    try:
        _int32_struct(len(ids)).pack_into(out, 0, *ids)
    except struct.error:
        return None
    return out


@functools.lru_cache(maxsize=1024)
def _int32_struct(count: int) -> struct.Struct:
    return struct.Struct(f"={count}i")


def seam_tokens(seam: float, length: int) -> int:
    """HYPIC's seam knob for one segment of `length` tokens: 0 -> 0, 0 < x <= 1 -> ceil(x * length), x > 1 -> x.
    A bool is refused (True would silently mean "the whole segment"), and so is NaN or infinity."""
    if not is_number(seam):
        raise TypeError(f"seam must be a number, got {type(seam).__name__} {seam!r}")
    if not math.isfinite(seam):
        raise ValueError(f"seam must be a finite number, got {seam}")
    if seam < 0:
        raise ValueError(f"seam must be >= 0, got {seam}")
    if seam == 0:
        return 0
    if seam <= 1:
        return min(length, math.ceil(seam * length))
    if seam != int(seam):
        raise ValueError(f"a seam above 1 is a token count and must be an integer, got {seam}")
    return min(length, int(seam))


def is_number(x) -> bool:
    """A real number that is not a bool (Python's or NumPy's: numbers.Real counts a bool as one)."""
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def is_integer(x) -> bool:
    """An integer that is not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _load_tokenizer(tokenizer):
    if tokenizer is None or hasattr(tokenizer, "encode"):
        return tokenizer
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer))


def _pad_decode(layer_cache, length: int, max_len: int):
    """Place one layer's prompt cache into `max_len`-slot decode buffers (per-token leaves have axis 1 = length)."""
    if isinstance(layer_cache, LinearCache):
        return layer_cache
    return jax.tree.map(lambda a: jnp.pad(a, [(0, 0), (0, max_len - length)] + [(0, 0)] * (a.ndim - 2)), layer_cache)


# ----------------------------------------------------------------------------------------------------------------
# Engine


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


class Engine:
    """Position-independent caching on one model.

    Engine(model) wraps a loaded `hypic_jax.models.base.Model`; `Engine.from_pretrained(path)` loads one (and a
    tokenizer.json next to it, if any), `Engine.from_pretrained()` the model embedded in the package. `mode` and
    `seam` are defaults that every request may override.
    `compose_algorithm` is the dot algorithm of the dense transfer products when cached segments are stitched
    ("auto": "bf16x3" on a GPU, three bfloat16 tensor-core passes at float32-level accuracy; HIGHEST elsewhere).
    `prefix_impl` is how each linear layer's states at the segment boundaries are formed (`linear_attn.prefix_states`:
    "auto": the Pallas fold kernel on a GPU, the associative scan elsewhere).

    Tuning knobs change speed, never results (each is tested on the CPU against the default path; `bench/pic_ttft.py
    --variants` times them on a GPU, see bench/RESULTS.md): `seam_fold` (short seams enter the Pallas fold as chunk
    steps instead of being composed with their interiors first, `spans.SpanMode.seam_fold`), `attention_programs`
    (the fresh queries' attention split over key ranges), `prefix_block` (a blocked fold; off by default, slower per
    layer), `stack_entries` (an entry's pieces outside the pool, the full-attention K/V, stored with the layers
    stacked, `spans.StackedLayers`: a few arrays per entry to pass instead of one per layer), `pool_entries` (the
    linear layers' pieces of PIC entries live in one device pool per layer, `hypic_jax.pool`: a request passes the
    pools and a vector of slots, and the seam fold reads the cached interiors in place), `command_buffers` (XLA's
    CUDA-graph capture; off: re-patching the graph per request costs more than it saves), `seam_precision`
    (`spans.SpanMode.seam_precision`: "auto" runs the seams' own products inside the seam fold at single-pass bf16
    for bfloat16 models, the precision the model's GDN kernel uses for every token), `attention_pack_gqa` (the
    query heads of a key/value head share one attention program, so each K/V tile is loaded once).

    compile_cache: a folder where compiled programs are kept across processes (`use_compile_cache`): each new
    request layout compiles for minutes at the 35B-A3B shape, and a restarted engine would pay that again.
    """

    def __init__(
        self,
        model,
        *,
        tokenizer=None,
        cache_bytes: int | None = None,
        mode: str = "transition_rope_recompute",
        seam: float = 8,
        separator: str = DEFAULT_SEPARATOR,
        max_context: int | None = None,
        source: str | None = None,
        compose_algorithm: str | None = "auto",
        prefix_impl: str = "auto",
        prefix_block: int | None = None,
        attention_programs: int = 1024,
        attention_pack_gqa: bool = True,
        stack_entries: bool = True,
        seam_fold: bool = True,
        pool_entries: bool = True,
        command_buffers: bool = False,
        seam_precision: str | None = "auto",
        compile_cache: str | Path | None = None,
    ):
        if not hasattr(model.arch, "span_forward"):
            raise ValueError(f"architecture {model.arch.__name__} has no span_forward; the engine cannot run it")
        self.model = model
        self.arch, self.config, self.params = model.arch, model.config, model.params
        self.tokenizer = _load_tokenizer(tokenizer)
        if cache_bytes is not None and cache_bytes < 0:
            raise ValueError(f"cache_bytes must be >= 0 or None, got {cache_bytes}")
        self.pool = EntryPool()
        self.pool_entries = bool(pool_entries)
        self.cache = SegmentCache(cache_bytes, on_drop=lambda entry: self.pool.release(entry.slot))
        self.mode = self._check_mode(mode)
        seam_tokens(seam, 1)  # validates
        self.seam = seam
        self.separator = separator
        self.max_context = max_context
        if compose_algorithm == "auto":  # tensor cores where they exist: bf16x3 keeps float32-level accuracy
            compose_algorithm = "bf16x3" if jax.default_backend() == "gpu" else None
        if compose_algorithm is not None and compose_algorithm not in ALGORITHMS:
            raise ValueError(f"compose_algorithm must be 'auto', None or one of {ALGORITHMS}, got {compose_algorithm!r}")
        self.compose_algorithm = compose_algorithm
        if prefix_impl == "auto":
            prefix_impl = "pallas" if jax.default_backend() == "gpu" else "associative"
        if prefix_impl not in PREFIX_IMPLS:
            raise ValueError(f"prefix_impl must be 'auto' or one of {PREFIX_IMPLS}, got {prefix_impl!r}")
        self.prefix_impl = prefix_impl
        if prefix_block is not None and (not isinstance(prefix_block, int) or prefix_block < 0 or prefix_block == 1):
            raise ValueError(f"prefix_block must be None, 0 (about sqrt(n)) or a block size >= 2, got {prefix_block!r}")
        if not isinstance(attention_programs, int) or attention_programs < 1:
            raise ValueError(f"attention_programs must be a positive integer, got {attention_programs!r}")
        self.prefix_block, self.attention_programs, self.stack_entries = prefix_block, attention_programs, stack_entries
        self.attention_pack_gqa = bool(attention_pack_gqa)
        self.seam_fold = bool(seam_fold)
        if seam_precision not in ("auto", None) and seam_precision not in ALGORITHMS + ("bf16",):
            raise ValueError(f"seam_precision must be 'auto', None, 'bf16' or one of {ALGORITHMS}, got "
                             f"{seam_precision!r}")
        self.seam_precision = seam_precision
        self.command_buffers = bool(command_buffers)
        self.compile_cache = None if compile_cache is None else use_compile_cache(compile_cache)
        self.vocab_size = int(self.config.vocab_size)
        self.fingerprint = model_fingerprint(self.arch.__name__, self.config, self.params, source)

    @classmethod
    def from_pretrained(cls, path=None, dtype: Any = "bfloat16", *, tokenizer=None, **kwargs) -> "Engine":
        """Load a model folder (orbax checkpoint or Hugging Face folder); picks up tokenizer.json and the context
        length (max_position_embeddings of config.json) when present. Without a path: the model embedded in the
        package (`hypic_jax.embedded`); FileNotFoundError naming its folder when none is installed."""
        from hypic_jax.models import load

        if path is None:
            from hypic_jax.embedded import require_embedded_model

            path = require_embedded_model()
        path = Path(path)
        model = load(path, dtype)
        if tokenizer is None and (path / "tokenizer.json").exists():
            tokenizer = path / "tokenizer.json"
        if kwargs.get("max_context") is None and (path / "config.json").exists():
            hf = json.loads((path / "config.json").read_text())
            hf = hf.get("text_config") or hf
            if hf.get("max_position_embeddings"):
                kwargs["max_context"] = int(hf["max_position_embeddings"])
        return cls(model, tokenizer=tokenizer, source=f"{path.resolve()}:{jnp.dtype(dtype)}", **kwargs)

    def clear_cache(self) -> None:
        """Drop every cache entry and give the entry pool's device memory back (entries held by a running request
        stay usable until it ends; the pool is kept then, and trimmed by a later call)."""
        self.cache.clear()
        self.pool.trim()

    # Inputs -------------------------------------------------------------------------------------------------------
    @staticmethod
    def _check_mode(mode: str) -> str:
        if not isinstance(mode, str) or mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {MODES}")
        return mode

    def _request_options(self, mode, seam, cache_salt) -> tuple[str, float]:
        """A request's mode and seam (None: the engine's), checked with its salt before any work: only None means
        the default (an empty or zero mode is refused, not read as the engine's), and a salt must be a string
        (`str(salt)` would let 5 and "5" share entries)."""
        mode = self._check_mode(self.mode if mode is None else mode)
        seam = self.seam if seam is None else seam
        seam_tokens(seam, 1)  # validates
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt must be a string or None, got {type(cache_salt).__name__}")
        return mode, seam

    def segment_tokens(self, segments) -> list[list[int]]:
        """Token ids of each segment: a list of strings or of token-id lists, or one string split on the separator."""
        return [ids.tolist() for ids in self._segment_ids(segments)]

    def _segment_ids(self, segments) -> list[np.ndarray]:
        """`segment_tokens` as validated int32 arrays (the cache keys hash their bytes without another conversion).
        Segments are checked in order: the first problem is the one reported."""
        if isinstance(segments, str):
            segments = segments.split(self.separator)
        if isinstance(segments, np.ndarray) and segments.ndim:
            segments = [segments] if segments.ndim == 1 else list(segments)
        if isinstance(segments, (bytes, bytearray, dict, set, frozenset)) or (
                segments is not None and not hasattr(segments, "__iter__")) or (
                isinstance(segments, np.ndarray) and not segments.ndim):
            # bytes would iterate as ints, a dict as its keys, a set in no fixed order
            raise TypeError(f"segments must be a string or a list of segments, got {type(segments).__name__}")
        segments = list(segments) if segments is not None else []
        if not segments:
            raise ValueError("segments must hold at least one segment (the last one is the query)")
        out, failure = [], None
        for i, segment in enumerate(segments):
            try:
                out.append(self._segment_array(i, segment))
            except Exception as error:  # noqa: BLE001  (raised below, after an earlier segment's bad id)
                failure = error
                break
        self._check_vocabulary(out)
        if failure is not None:
            raise failure
        total = sum(map(len, out))
        if self.max_context is not None and total > self.max_context:
            raise ValueError(f"the prompt has {total} tokens, over the model's context of {self.max_context}")
        return out

    def _segment_array(self, i: int, segment) -> np.ndarray:
        """Segment i's token ids as an int32 array. A list of ints converts in one C loop, its vocabulary check
        left to `_check_vocabulary` (one pass over every segment); anything else goes through NumPy's checks."""
        if isinstance(segment, str):
            if self.tokenizer is None:
                raise ValueError("text segments need a tokenizer: pass tokenizer= or give token-id lists")
            ids = self.tokenizer.encode(segment, add_special_tokens=False).ids
        elif isinstance(segment, (numbers.Number, np.generic)) or (
                isinstance(segment, np.ndarray) and not segment.ndim):
            # a flat list of ids would otherwise become one one-token segment per id, the last one the query
            raise TypeError(f"segment {i} is a single value ({segment!r}), not a list of token ids: segments is a "
                            f"list of segments (one segment of ids is [[id, ...]])")
        else:
            ids = segment
        fast = _int32_list(ids)
        if fast is not None:
            return fast
        try:  # vectorised checks: a 32k-token prompt is validated in microseconds
            ids = np.asarray(ids)
        except ValueError as error:  # ragged nesting
            raise ValueError(f"segment {i} holds token ids that are not integers: {error}") from None
        if sum(n > 1 for n in ids.shape) > 1:  # [[1, 2], [3, 4]] would silently become one segment of four ids
            raise ValueError(f"segment {i} is a nested list or array of shape {ids.shape}, not one list of token "
                             f"ids (each segment is its own list)")
        ids = ids.reshape(-1)  # a [1, n] array (a tokenizer's batch of one) is its n ids
        if not ids.size:
            raise ValueError(f"segment {i} is empty (every segment, the query included, needs at least one token)")
        if ids.dtype.kind not in "iu":
            if ids.dtype.kind != "f" or not np.array_equal(ids, np.floor(ids)):
                raise ValueError(f"segment {i} holds token ids that are not integers (dtype {ids.dtype})")
        # before any integer cast, which could wrap an id into range (or an infinite float to any integer)
        self._check_vocabulary([ids], first=i)
        return ids.astype(np.int32)

    def _check_vocabulary(self, ids: list[np.ndarray], first: int = 0) -> None:
        """Raise on the first token id outside the vocabulary (segments numbered from `first`): one pass over them
        all, then over each while looking for the culprit."""
        if not ids:
            return
        flat = np.concatenate(ids) if len(ids) > 1 else ids[0]
        if flat.min() >= 0 and flat.max() < self.vocab_size:
            return
        for i, segment in enumerate(ids, first):
            bad = (segment < 0) | (segment >= self.vocab_size)
            if bad.any():
                raise ValueError(f"segment {i} holds token id {segment[bad][0]} outside the vocabulary "
                                 f"[0, {self.vocab_size})")

    # Prefill ------------------------------------------------------------------------------------------------------
    def prefill(self, segments, mode: str | None = None, seam: float | None = None, cache_salt: str | None = None,
                *, _want_hidden: bool = False) -> PrefillResult:
        """Prefill a request; returns the last position's logits, the stats (see `PrefillStats`) and the per-layer
        caches after the prompt (`decode`, on device: what `generate` continues from; the K/V concatenation they
        hold is built for the attention anyway, so returning it costs no extra compute)."""
        mode, seam = self._request_options(mode, seam, cache_salt)
        ids = self._segment_ids(segments)
        segs = [i.tolist() for i in ids]
        start = time.perf_counter()
        with self.cache.pinned() as pins:
            if mode == "full_recompute":
                plan = self._plan_full(segs)
            elif mode == "prefix_cache":
                plan = self._plan_prefix(segs, ids, cache_salt, pins)
            else:
                plan = self._plan_pic(segs, ids, mode, seam, cache_salt, pins)
            cold_s = time.perf_counter() - start
            combine_start = time.perf_counter()
            if mode == "full_recompute" and not _want_hidden and hasattr(self.arch, "prefill"):
                # nothing to stitch: the architecture's own prefill (flash attention, its fastest linear kernels)
                result = self._run_prefill(plan["fresh"])
            else:
                result = self._run(plan["fresh"], plan["cached"], plan["layout"], self._span_mode(mode),
                                   want_logits=True, want_decode=True, want_hidden=_want_hidden,
                                   slots=plan.get("slots"))
            result.logits.copy_to_host_async()  # queue the copy now, not once the host has seen the device finish
            dispatch_s = time.perf_counter() - combine_start
            logits = np.asarray(result.logits)
            self._store_records(plan.get("record_as", []), result.records, pins)
        end = time.perf_counter()
        stats = PrefillStats(
            mode=mode, seam=float(seam) if mode == "transition_rope_recompute" else 0.0, segments=len(segs),
            prompt_tokens=sum(map(len, segs)), cached_tokens=plan["cached_tokens"],
            recomputed_tokens=plan["layout"].num_fresh_tokens, cold_tokens=plan["cold_tokens"], hits=plan["hits"],
            misses=plan["misses"], ttft_s=end - start, cold_s=cold_s, combine_s=end - combine_start,
            dispatch_s=dispatch_s,
        )
        return PrefillResult(logits=logits, stats=stats, tokens=[t for s in segs for t in s], decode=result.decode,
                             hidden=result.hidden)

    def _run_prefill(self, tokens) -> spans.SpanResult:
        """A whole prompt through `arch.prefill`, returned in the span forward's result form."""
        tokens = np.asarray(tokens, np.int32)[None]  # a host array: it goes to the device inside the jit call
        call = _prefill_call_graphs if self.command_buffers else _prefill_call
        logits, cache = call(self.params, tokens, arch=self.arch, config=self.config, max_len=tokens.shape[1])
        return spans.SpanResult(logits=logits[0], records=(), decode=cache.layers, hidden=None)

    def _span_mode(self, mode: str) -> spans.SpanMode:
        return dataclasses.replace(spans.MODES[mode], compose=self.compose_algorithm, prefix=self.prefix_impl,
                                   prefix_block=self.prefix_block, attention_programs=self.attention_programs,
                                   attention_pack_gqa=self.attention_pack_gqa,
                                   seam_fold=self.seam_fold, seam_precision=self.seam_precision)

    def _run(self, fresh_tokens, cached, layout, mode, *, want_logits, want_decode=False, want_hidden=False,
             slots=None):
        """One span forward. `cached`: per cached span its entry's layers; `slots`: their pool slots (None or -1
        for entries without pooled pieces)."""
        tokens = np.asarray(fresh_tokens, np.int32)  # host arrays go to the device inside the jit call (one step)
        with self.pool.lock:  # the pools handed to this dispatch are not donated to a write before it is enqueued
            cached = self._cached_arg(cached, slots)
            call = _span_call_graphs if self.command_buffers else _span_call
            return call(self.params, tokens, cached, arch=self.arch, config=self.config, layout=layout, mode=mode,
                        want_logits=want_logits, want_decode=want_decode, want_hidden=want_hidden)

    def _cached_arg(self, cached, slots=None):
        """What the span forward takes for the request's cached entries: their layers as a tuple, wrapped with the
        pools and the entries' slots when any of them keeps pieces in the pool (hold `pool.lock` until dispatch)."""
        cached = tuple(cached)
        if slots is not None and any(s is not None for s in slots):
            cached = spans.CachedSegments(cached, self.pool.pools,
                                          np.asarray([-1 if s is None else s for s in slots], np.int32))
        return cached

    def _plan_full(self, segs):
        tokens = [t for s in segs for t in s]
        layout = spans.SpanLayout.build([dict(kind=spans.FRESH, length=len(tokens))])
        return dict(layout=layout, fresh=tokens, cached=[], cached_tokens=0, cold_tokens=0, hits=0, misses=0)

    def _prefix_hits(self, docs, ids, salt, pins) -> tuple[list[str], list[Entry]]:
        """Each leading segment's prefix key (chained through the keys before it) and the pinned entries of the
        longest cached run of them."""
        keys, parent = [], ""
        for doc in ids[:-1]:
            parent = entry_key(doc, fingerprint=self.fingerprint, kind="prefix", parent=parent, salt=salt)
            keys.append(parent)
        hits: list[Entry] = []
        for doc, key in zip(docs, keys):
            entry = self._find(key, doc, pins, kind="prefix", seam=0)
            if entry is None:
                break
            hits.append(entry)
        return keys, hits

    def _find(self, key: str, tokens, pins, *, kind: str, seam: int) -> Entry | None:
        """The cached entry under `key`, pinned for the request, or None."""
        return self.cache.lookup(key, tokens, pins=pins)

    def _plan_prefix(self, segs, ids, salt, pins):
        """Longest cached run of leading segments; the rest is computed exactly and recorded as new prefix entries."""
        docs, query = segs[:-1], segs[-1]
        keys, hits = self._prefix_hits(docs, ids, salt, pins)
        pieces, fresh, record_as, position = [], [], [], 0
        for j, doc in enumerate(docs):
            if j < len(hits):
                pieces.append(dict(kind=spans.CACHED, length=len(doc), canonical_start=position,
                                   carries_state=j == len(hits) - 1))
            else:
                pieces.append(dict(kind=spans.FRESH, length=len(doc), record_from=0))
                fresh += doc
                record_as.append(("prefix", keys[j], doc, 0))
            position += len(doc)
        pieces.append(dict(kind=spans.FRESH, length=len(query)))
        fresh += query
        return dict(layout=spans.SpanLayout.build(pieces), fresh=fresh, cached=[e.layers for e in hits],
                    record_as=record_as, cached_tokens=sum(e.length for e in hits), cold_tokens=0,
                    hits=len(hits), misses=len(docs) - len(hits))

    def _plan_pic(self, segs, ids, mode, seam, salt, pins):
        docs, query = segs[:-1], segs[-1]
        seams = [seam_tokens(seam, len(d)) if mode == "transition_rope_recompute" else 0 for d in docs]
        entries: dict[int, Entry] = {}
        missing: list[tuple[int, str]] = []
        hits = 0
        for i, (doc, w) in enumerate(zip(docs, seams)):
            if w >= len(doc):
                continue  # recomputed whole: nothing to cache
            key = entry_key(ids[i], fingerprint=self.fingerprint, kind="pic", seam=w, salt=salt)
            entry = self.cache.lookup(key, doc, pins=pins)
            if entry is None:
                missing.append((i, key))
            else:
                entries[i] = entry
                hits += 1
        cached_tokens = sum(e.length for e in entries.values())
        cold_tokens = 0
        if missing:  # one packed, isolated prefill of every missing segment
            unique = {}
            for i, key in missing:
                unique.setdefault(key, i)
            order = list(unique.items())
            layout = spans.SpanLayout.build(
                [dict(kind=spans.FRESH, length=len(docs[i]), record_from=seams[i]) for _, i in order], isolated=True
            )
            fresh = [t for _, i in order for t in docs[i]]
            cold_tokens = len(fresh)
            # an isolated layout never stitches, so every PIC mode shares its compilation (one canonical mode flag)
            result = self._run(fresh, [], layout, spans.SpanMode(), want_logits=False)
            stored = self._store_records([("pic", key, docs[i], seams[i]) for key, i in order], result.records, pins)
            by_key = {entry.key: entry for entry in stored}
            for i, key in missing:
                entries[i] = by_key[key]
        pieces, fresh, cached, slots = [], [], [], []
        for i, (doc, w) in enumerate(zip(docs, seams)):
            if w:
                pieces.append(dict(kind=spans.FRESH, length=w))
                fresh += doc[:w]
            if w < len(doc):
                pieces.append(dict(kind=spans.CACHED, length=len(doc) - w, canonical_start=w))
                cached.append(entries[i].layers)
                slots.append(entries[i].slot)
        pieces.append(dict(kind=spans.FRESH, length=len(query)))
        fresh += query
        return dict(layout=spans.SpanLayout.build(pieces), fresh=fresh, cached=cached, slots=slots,
                    cached_tokens=cached_tokens, cold_tokens=cold_tokens, hits=hits, misses=len(missing))

    def _store_records(self, record_as, records, pins) -> list[Entry]:
        stored = []
        pooled = [layers_ for (kind, *_), layers_ in zip(record_as, records) if kind == "pic" and self.pool_entries]
        budget = None
        if pooled:  # linear pieces into the device pool (one growth for all of them); each entry keeps its slot
            if self.cache.capacity_bytes is not None:
                budget = max(1, self.cache.capacity_bytes // max(1, tree_nbytes(pooled[0])))
            self.pool.reserve(pooled[0], len(pooled), budget)
        for (kind, key, doc, w), layers_ in zip(record_as, records):
            nbytes, slot = tree_nbytes(layers_), None
            if kind == "pic" and self.pool_entries:
                slot, layers_ = self.pool.store(layers_, budget)
            if self.stack_entries:  # few arrays per entry: cheap to pass to every request
                layers_ = spans.StackedLayers.stack(layers_)
            entry = Entry(key=key, tokens=tuple(doc), kind=kind, seam=w, layers=layers_, nbytes=nbytes, slot=slot)
            stored.append(self.cache.insert(pins.add(entry)))  # pinned first: never evicted before this request ends
        return stored

    # Generation ---------------------------------------------------------------------------------------------------
    def generate(
        self,
        segments,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: str | int | Sequence[str | int] | None = None,
        seed: int = 0,
        mode: str | None = None,
        seam: float | None = None,
        cache_salt: str | None = None,
    ) -> GenerateResult:
        """Prefill (any mode), then decode from the caches the span forward left behind.

        temperature 0 is greedy; otherwise softmax sampling at that temperature within the top-p nucleus, seeded.
        stop: strings (need a tokenizer; a special token's text, such as `<|eos|>`, stops at its id) and/or token ids
        that end generation (the stop token is kept in `tokens`).
        """
        stop_ids, stop_texts = self._check_generation(max_new_tokens, top_p, stop, temperature, seed)
        self._request_options(mode, seam, cache_salt)
        segs = self.segment_tokens(segments)
        total = sum(map(len, segs))
        if self.max_context is not None and total + max_new_tokens > self.max_context:
            raise ValueError(f"prompt ({total}) + max_new_tokens ({max_new_tokens}) exceeds the model's context "
                             f"of {self.max_context}")
        pre = self.prefill(segs, mode=mode, seam=seam, cache_salt=cache_salt)
        start = time.perf_counter()
        max_len = total + max(max_new_tokens, 1)
        # stacked like a stacked model's layers, so that each step scans them as they are
        layers = layer_stack.stacked_like(self.params["layers"], [_pad_decode(c, total, max_len) for c in pre.decode])
        cache = ModelCache(layers=layers, length=jnp.asarray(total, jnp.int32))

        def step(token, cache):
            logits, cache = _decode_step(self.params, jnp.asarray(token, jnp.int32), cache, arch=self.arch,
                                         config=self.config)
            return np.asarray(logits), cache

        return self._decode_loop(pre, step, cache, max_new_tokens, temperature, top_p, seed, stop_ids, stop_texts,
                                 start)

    def _check_generation(self, max_new_tokens: int, top_p: float, stop, temperature: float,
                          seed: int | None) -> tuple[set[int], list[str]]:
        """Validated sampling arguments: (stop token ids, stop strings). Checked before the prefill, so a bad one
        costs no device work (the sampler would otherwise fail only after it)."""
        if not is_integer(max_new_tokens):
            raise TypeError(f"max_new_tokens must be an integer, got {type(max_new_tokens).__name__}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if not is_number(top_p):
            raise TypeError(f"top_p must be a number, got {type(top_p).__name__}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {top_p}")
        if not is_number(temperature):
            raise TypeError(f"temperature must be a number, got {type(temperature).__name__}")
        if not 0 <= temperature < math.inf:  # NaN fails too
            raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature}")
        if seed is not None and not is_integer(seed):
            raise TypeError(f"seed must be an integer or None, got {type(seed).__name__}")
        if seed is not None and seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        single = isinstance(stop, str) or not hasattr(stop, "__iter__")
        stops = [] if stop is None else ([stop] if single else list(stop))
        for s in stops:
            if not (isinstance(s, str) or is_integer(s)):
                raise TypeError(f"stop must be strings or token ids, got {type(s).__name__} {s!r}")
            if isinstance(s, str) and not s:
                raise ValueError("stop strings must not be empty (an empty string would stop at the first token)")
            if not isinstance(s, str) and not 0 <= s < self.vocab_size:
                raise ValueError(f"stop token id {s} lies outside the vocabulary [0, {self.vocab_size})")
        stop_texts = [s for s in stops if isinstance(s, str)]
        if stop_texts and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; pass token ids instead")
        stop_ids = {int(s) for s in stops if not isinstance(s, str)}
        if stop_texts:  # a special token never shows in decoded text: it stops by its id
            added = getattr(self.tokenizer, "get_added_tokens_decoder", dict)()
            special = {a.content: i for i, a in added.items() if a.special}
            stop_ids |= {special[s] for s in stop_texts if s in special}
        return stop_ids, stop_texts

    def _decode_loop(self, pre, step, cache, max_new_tokens, temperature, top_p, seed, stop_ids, stop_texts,
                     start) -> GenerateResult:
        """Sample from the prefill's logits, then `step(token, cache) -> (logits, cache)` until a stop or the
        length."""
        rng = np.random.default_rng(seed)
        logits, out, reason = pre.logits, [], "length"
        for i in range(max_new_tokens):
            token = _sample(logits, temperature, top_p, rng)
            out.append(token)
            if token in stop_ids or (stop_texts and any(s in self.tokenizer.decode(out) for s in stop_texts)):
                reason = "stop"
                break
            if i + 1 < max_new_tokens:
                logits, cache = step(token, cache)
        text = self.tokenizer.decode(out) if self.tokenizer is not None else None
        return GenerateResult(text=text, tokens=out, stats=pre.stats, decode_s=time.perf_counter() - start,
                              finish_reason=reason)

    # Diagnostics --------------------------------------------------------------------------------------------------
    def diagnose(self, segments, mode: str | None = None, seam: float | None = None,
                 cache_salt: str | None = None) -> list[dict]:
        """Per-layer relative deviation of the query tokens' hidden states, `mode` vs full recompute:
        ||h_mode - h_full|| / ||h_full|| after the embedding (row "embed") and after every layer, plus
        the last position's logits. The query is fresh in every mode, so both runs hold its hidden states."""
        segs = self.segment_tokens(segments)
        query = len(segs[-1])
        full = self.prefill(segs, mode="full_recompute", _want_hidden=True)
        ours = self.prefill(segs, mode=mode, seam=seam, cache_salt=cache_salt, _want_hidden=True)
        h_full = np.asarray(full.hidden[:, -query:], np.float64)
        h_ours = np.asarray(ours.hidden[:, -query:], np.float64)
        rows = []
        kinds = _layer_kinds(self.config)
        for layer in range(h_full.shape[0]):
            ref = np.linalg.norm(h_full[layer])
            rows.append(dict(layer="embed" if layer == 0 else layer - 1,
                             kind="embed" if layer == 0 else kinds[layer - 1],
                             deviation=float(np.linalg.norm(h_ours[layer] - h_full[layer]) / max(ref, 1e-30))))
        ref = np.linalg.norm(full.logits)
        rows.append(dict(layer="logits", kind="head",
                         deviation=float(np.linalg.norm(ours.logits - full.logits) / max(ref, 1e-30))))
        return rows


def _layer_kinds(config) -> list[str]:
    if hasattr(config, "layer_types"):
        return ["linear" if t == "linear_attention" else "full" for t in config.layer_types]
    return ["full" if config.is_full_attention(i) else "linear" for i in range(config.num_hidden_layers)]


def _sample(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator) -> int:
    if temperature <= 0:
        return int(np.argmax(logits))
    scaled = np.asarray(logits, np.float64) / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if top_p < 1:
        order = np.argsort(-probs)
        keep = np.cumsum(probs[order]) - probs[order] < top_p  # the smallest prefix whose mass reaches top_p
        mask = np.zeros_like(probs, bool)
        mask[order[keep]] = True
        probs = np.where(mask, probs, 0.0)
        probs /= probs.sum()
    return int(rng.choice(len(probs), p=probs))
