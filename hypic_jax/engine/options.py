"""The engine's options: one frozen dataclass per group of knobs, shared by `Engine`, `hypic-jax serve` and the
other command-line verbs (every flag is one field here, with its one default, help text and check).

    limits     the largest prompt, generation and request; the ladder of compiled token capacities; decode rows
    pools      the device entry pools
    tiers      the host, disk and peer tiers below the pools
    parallel   segment parallelism over devices, tensor parallelism
    kernels    how the programs compute (`models.base.KernelOptions`; never part of a cache key or checkpoint)
    requests   the defaults a request may override: mode, seam, separator
    scheduler  the continuous-batching scheduler's queue, deadline and overlap
    compile    the compile cache

`Engine(model, max_prompt_tokens=..., cache_bytes=...)` takes any field by name; `EngineOptions.from_kwargs`
routes each to its group. A field left at None is derived from the model and the machine when the engine is built
(`resolve`): the prompt and generation limits from the model's context, the decode rows, ladder floor and step from
the backend, the pools from the device memory left after the weights.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from pathlib import Path
from typing import Any

from hypic_jax.models.base import KernelOptions
from hypic_jax.options import GIB, OptionGroup, boolean, choice, folder, is_number, number, option, rungs, whole
from hypic_jax.options import devices as device_list

MODES = ("full_recompute", "prefix_cache", "addition", "transition", "transition_rope", "transition_rope_recompute")
PIC_MODES = MODES[2:]
DEFAULT_SEPARATOR = "<<PIC_SEP>>"
POLICIES = ("lpt", "rr")
LADDERS = ("fine", "octaves")

# derived limits (see `EngineOptions.resolve`)
DEFAULT_MAX_PROMPT_TOKENS = 4096
DEFAULT_MAX_NEW_TOKENS = 256
CPU_CACHE_BYTES = 1 * GIB


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


def check_seam(seam):
    """A request's seam, checked: one knob for every document (a number, `seam_tokens`), or a sequence of one knob
    per document (each checked alike; returned as a tuple of numbers), whose count `segment_seams` checks against
    the documents."""
    if isinstance(seam, (list, tuple)) or (hasattr(seam, "ndim") and getattr(seam, "ndim", 0) == 1):
        knobs = tuple(seam.tolist() if hasattr(seam, "tolist") else seam)
        for knob in knobs:
            seam_tokens(knob, 1)
        return knobs
    seam_tokens(seam, 1)
    return seam


def segment_seams(seam, lengths) -> list[int]:
    """Each document's seam in tokens, for documents of `lengths`: `seam` one knob for all, or one per document
    (a sequence of as many knobs as documents; `check_seam`)."""
    seam = check_seam(seam)
    if isinstance(seam, tuple):
        if len(seam) != len(lengths):
            raise ValueError(f"a seam per document needs one knob for each of the {len(lengths)} documents "
                             f"(every segment but the query), got {len(seam)}")
        return [seam_tokens(knob, n) for knob, n in zip(seam, lengths)]
    return [seam_tokens(seam, n) for n in lengths]


def _seam(what, value):
    try:
        seam_tokens(value, 1)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{what}: {error}") from None
    return value


_seam.kind = float


@dataclasses.dataclass(frozen=True)
class LimitOptions(OptionGroup):
    """Request limits and the compiled capacities: what `warmup` compiles, what a request may not exceed."""

    max_prompt_tokens: int | None = option(
        None, "the longest prompt; larger ones are refused naming the limit (derived: 4096, or less to fit the "
        "model's context beside max_new_tokens)", check=whole(1, optional=True), derived=True)
    max_new_tokens: int | None = option(
        None, "the most tokens one request may generate (derived: 256, or half the model's context when that is "
        "less)", check=whole(0, optional=True), derived=True)
    max_segments: int = option(64, "the most segments before a request's query", check=whole(1))
    max_batch: int | None = option(
        None, "requests decoding at once: rows of the preallocated batched decode cache (derived: 64 on an "
        "accelerator, 8 on the CPU)", check=whole(1, optional=True), derived=True)
    min_batch_bucket: int | None = option(
        None, "the smallest decode batch bucket: one stream steps in a program of this many rows (derived: 2 on an "
        "accelerator, where the one-row step was never faster than the two-row one (bench/RESULTS.md, "
        "decode_step.py), 1 on the CPU)", check=whole(1, optional=True), derived=True)
    min_tokens: int | None = option(
        None, "the smallest compiled token capacity (derived: 64 on an accelerator, 256 on the CPU)",
        check=whole(1, optional=True), derived=True)
    ladder: str | None = option(
        None, "the steps between compiled token capacities: fine (x1.5 and x1.33, quarter octaves from 1024 "
        "tokens: at most 1.25x padding) or octaves (powers of two: fewer programs); derived: fine on an "
        "accelerator, octaves on the CPU", check=choice(*LADDERS, optional=True), derived=True)
    fused_prefill_tokens: int = option(
        0, "run a stitched PIC request of at most this many fresh tokens (seams and query; its token rung) in one "
        "program with a decode step, each layer's MLP and experts read once for both (one program per batch bucket "
        "and rung up to it; 0: never)", check=whole(0))
    token_rungs: tuple[int, ...] | None = option(
        None, "explicit token capacities instead of the ladder, comma-separated (the last must hold "
        "max_prompt_tokens)", check=rungs(), metavar="N,N,...")


@dataclasses.dataclass(frozen=True)
class PoolOptions(OptionGroup):
    """The device entry pools, allocated up front."""

    cache_bytes: int | None = option(
        None, "the entry pools' budget (derived: on an accelerator, a share of the memory left after the weights "
        "and the decode rows; 1 GiB on the CPU)", check=whole(0, optional=True), flag="--cache-gb", scale=GIB,
        unit="GiB", derived=True)
    mean_entry_tokens: int = option(
        512, "the mean segment length the pools are shaped for (slots for linear states per page of token rows)",
        check=whole(1))


@dataclasses.dataclass(frozen=True)
class TierOptions(OptionGroup):
    """Tiers below the device pools: evicted entries are kept there, and promoted back on a hit."""

    host_cache_bytes: int = option(0, "host-memory tier (0: off)", check=whole(0), flag="--host-cache-gb",
                                   scale=GIB, unit="GiB")
    disk_cache_dir: str | None = option(
        None, "disk tier folder (one checksummed file per entry): entries evicted below the host tier, and every "
        "entry when the engine closes, so a restarted engine serves them", check=folder(), metavar="DIR")
    disk_cache_bytes: int | None = option(None, "disk tier budget (none: unbounded)",
                                          check=whole(0, optional=True), flag="--disk-cache-gb", scale=GIB,
                                          unit="GiB")
    disk_write_through: bool = option(
        False, "write every new entry to the disk tier when it is stored (it then survives a crash), not only when "
        "it is evicted or the engine closes", check=boolean())
    eviction: str = option(
        "cost", "tier eviction: cost (recompute time saved per byte; entries cheaper to recompute than to load are "
        "not kept) or lru", check=choice("cost", "lru"))
    tier_dtype: str | None = option(
        None, "store float32 pieces of entries below the device (T, S) in this dtype", check=choice(
            "bfloat16", optional=True))
    tier_transfer_tol: float | None = option(
        None, "store a dense transfer's heads only where their largest entry exceeds this (0: drop heads that "
        "decayed to exactly zero)", check=number(0, optional=True))
    host_memory: str = option(
        "pinned", "the host tier's memory: pinned (page-locked, where the device has it) or pageable",
        check=choice("pinned", "pageable"))
    peer_cache_bytes: int = option(
        0, "with devices >= 2: a tier of this size on each other device, between the first device's pools and the "
        "host tier (0: off)", check=whole(0), flag="--peer-cache-gb", scale=GIB, unit="GiB")
    host_bandwidth: float | None = option(None, "host tier bandwidth in bytes/s for the cost model (none: "
                                          "measured at warmup)", check=number(0, optional=True, above=True))
    disk_bandwidth: float | None = option(None, "disk tier bandwidth in bytes/s for the cost model (none: "
                                          "measured at warmup)", check=number(0, optional=True, above=True))


@dataclasses.dataclass(frozen=True)
class ParallelOptions(OptionGroup):
    """Segment parallelism (cold segments prefilled over several devices) and tensor parallelism."""

    devices: Any = option(
        None, "prefill a request's cold segments over this many devices (or, from Python, these devices), one bin "
        "per device; none: one device", check=device_list(), metavar="N")
    policy: str = option("lpt", "how the cold segments are split over the devices: lpt (costliest first onto the "
                         "least-loaded device) or rr (round-robin)", check=choice(*POLICIES))
    tensor_parallel: Any = option(
        None, "split the model, the entry pools and every program over this many devices (or these devices); not "
        "with the host, disk or peer tiers", check=device_list(), flag="--tensor-parallel-size", aliases=("--tp",),
        metavar="M")


@dataclasses.dataclass(frozen=True)
class RequestOptions(OptionGroup):
    """Defaults of every request (each may override them)."""

    mode: str = option("transition_rope_recompute", "reuse mode (per request: pic_mode)", check=choice(*MODES))
    seam: float = option(8, "seam knob of transition_rope_recompute: 0 reuses whole segments, 0 < x <= 1 "
                         "recomputes that fraction of each segment, an integer x > 1 that many tokens (per "
                         "request: seam)", check=_seam)
    separator: str = option(DEFAULT_SEPARATOR, "segment separator in prompt text", check=None)

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.separator, str) or not self.separator:
            raise ValueError(f"separator must be a non-empty string, got {self.separator!r}")


@dataclasses.dataclass(frozen=True)
class SchedulerOptions(OptionGroup):
    """The continuous-batching scheduler (`hypic_jax.engine.scheduler`)."""

    max_queue: int = option(256, "requests waiting for a row before new ones are refused (HTTP 429)",
                            check=whole(1))
    request_timeout: float = option(600.0, "per-request deadline, seconds", check=number(0, above=True))
    max_queue_wait: float | None = option(
        None, "refuse (HTTP 429 with Retry-After) a request whose predicted time to its first token is longer, in "
        "seconds: the requests ahead of it and itself times the measured time between admissions, scaled by what "
        "the last accepted requests waited against their prediction; a queued request whose wait plus the measured "
        "time from admission to first token passes it is refused the same way instead of its prefill (derived: its "
        "deadline, request_timeout)", check=number(0, optional=True, above=True), metavar="SECONDS")
    overlap: bool | None = option(
        None, "dispatch each decode step before reading the previous one's ids back (derived: on where the device is "
        "not the CPU, on which the host and the device share the cores)", check=boolean(optional=True))
    prefill_chunk: int | None = option(
        None, "while streams are decoding, prefill a queued request's missing segments in pieces of at most this "
        "many tokens (whole segments), one piece between two decode steps, so no stream waits on a long cold "
        "prefill (derived: one piece per admission)", check=whole(1, optional=True), metavar="TOKENS")
    compact_rows: bool = option(
        False, "when streams end, move the highest running rows into free lower ones whenever that lets the decode "
        "steps take a smaller batch bucket (one copy of a row's caches per move)", check=boolean())


def default_compile_cache() -> str:
    """The per-user compile cache: $HYPIC_JAX_CACHE, else $XDG_CACHE_HOME/hypic-jax, else ~/.cache/hypic-jax."""
    if os.environ.get("HYPIC_JAX_CACHE"):
        return os.environ["HYPIC_JAX_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hypic-jax")


def _compile_cache(what, value):
    if value is None or value in ("auto", "none"):
        return value
    return folder(optional=False)(what, value)


_compile_cache.kind = str


@dataclasses.dataclass(frozen=True)
class CompileOptions(OptionGroup):
    """Where compiled programs are kept across processes."""

    compile_cache: Any = option(
        "auto", "folder for compiled programs (stored whole, and JAX's persistent compilation cache): a restarted "
        "process loads them instead of compiling. auto: $HYPIC_JAX_CACHE, else $XDG_CACHE_HOME/hypic-jax, else "
        "~/.cache/hypic-jax; none: compile every start. Whoever can write the folder can make the process run "
        "code: keep it private", check=_compile_cache, metavar="DIR|auto|none")
    compile_workers: int | None = option(
        None, "threads that compile programs at warmup (derived: the machine's cores, at most 8)",
        check=whole(1, optional=True), derived=True)
    compile_guard: str = option(
        "count", "a program outside the warmed-up ladder needed while serving: count (compile it, count it in "
        "stats and log it) or refuse (the request fails with CompileWhileServing)", check=choice("count", "refuse"))

    def folder(self) -> Path | None:
        """The compile cache folder, or None for none."""
        if self.compile_cache in (None, "none"):
            return None
        if self.compile_cache == "auto":
            return Path(default_compile_cache())
        return Path(self.compile_cache).expanduser()


GROUPS = dict(limits=LimitOptions, pools=PoolOptions, tiers=TierOptions, parallel=ParallelOptions,
              kernels=KernelOptions, requests=RequestOptions, scheduler=SchedulerOptions, compile=CompileOptions)


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """Every option of an `Engine`, by group (see the module docstring)."""

    limits: LimitOptions = LimitOptions()
    pools: PoolOptions = PoolOptions()
    tiers: TierOptions = TierOptions()
    parallel: ParallelOptions = ParallelOptions()
    kernels: KernelOptions = KernelOptions()
    requests: RequestOptions = RequestOptions()
    scheduler: SchedulerOptions = SchedulerOptions()
    compile: CompileOptions = CompileOptions()

    def __post_init__(self):
        for name, group in GROUPS.items():
            if not isinstance(getattr(self, name), group):
                raise TypeError(f"EngineOptions.{name} must be a {group.__name__}, got "
                                f"{type(getattr(self, name)).__name__}")
        tiers, parallel = self.tiers, self.parallel
        if tiers.peer_cache_bytes and not _several(parallel.devices):
            raise ValueError("peer_cache_bytes needs the engine's other devices (devices=N with N >= 2)")
        if parallel.tensor_parallel is not None and _several(parallel.tensor_parallel):
            used = [name for name in ("host_cache_bytes", "disk_cache_dir", "peer_cache_bytes")
                    if getattr(tiers, name)]
            if used:
                raise ValueError(f"{', '.join(used)}: the host, disk and peer tiers need the model on one device; "
                                 f"with tensor parallelism the engine keeps its entries in the device pools only")
        limits = self.limits
        if limits.token_rungs is not None and limits.max_prompt_tokens is not None and (
                limits.token_rungs[-1] < limits.max_prompt_tokens):
            raise ValueError(f"token_rungs must end at a capacity that holds max_prompt_tokens="
                             f"{limits.max_prompt_tokens}, got {limits.token_rungs}")

    @staticmethod
    def field_group(name: str) -> str:
        """The group holding the field `name`; TypeError naming close matches when none does."""
        for group, group_type in GROUPS.items():
            if name in {f.name for f in dataclasses.fields(group_type)}:
                return group
        every = [f.name for g in GROUPS.values() for f in dataclasses.fields(g)]
        close = difflib.get_close_matches(name, every, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise TypeError(f"unknown engine option {name!r}{hint}; the options are the fields of "
                        f"hypic_jax.engine.options ({', '.join(GROUPS)})")

    def replace(self, **fields) -> "EngineOptions":
        """These options with fields changed by name (`max_prompt_tokens=...`), or whole groups (`kernels=...`)."""
        groups = {name: fields.pop(name) for name in list(fields) if name in GROUPS}
        changes: dict[str, dict] = {}
        for name, value in fields.items():
            changes.setdefault(self.field_group(name), {})[name] = value
        for name, group in groups.items():
            if isinstance(group, dict):
                changes.setdefault(name, {}).update(group)
            else:
                if name in changes:
                    raise TypeError(f"both the {name} group and some of its fields given: {sorted(changes[name])}")
                changes[name] = group
        out = {}
        for name, change in changes.items():
            out[name] = change if not isinstance(change, dict) else dataclasses.replace(getattr(self, name), **change)
        return dataclasses.replace(self, **out)

    @classmethod
    def from_kwargs(cls, **fields) -> "EngineOptions":
        return cls().replace(**fields)

    def as_dict(self) -> dict:
        return {name: getattr(self, name).as_dict() for name in GROUPS}

    def resolve(self, *, max_context: int | None, backend: str) -> "EngineOptions":
        """These options with the derived limits filled in (the pools' budget is derived by the engine, which knows
        what the device holds). Raises ValueError when given limits do not fit the model's context."""
        limits = self.limits
        accelerator = backend != "cpu"
        max_new, max_prompt = limits.max_new_tokens, limits.max_prompt_tokens
        if max_context is not None:
            if max_new is None:
                max_new = min(DEFAULT_MAX_NEW_TOKENS, max_context // 2)
            if max_prompt is None:
                max_prompt = min(DEFAULT_MAX_PROMPT_TOKENS, max_context - max_new)
            if max_prompt + max_new > max_context:
                raise ValueError(f"max_prompt_tokens + max_new_tokens ({max_prompt} + {max_new} = "
                                 f"{max_prompt + max_new}) exceeds the model's context of {max_context}")
        else:
            max_new = DEFAULT_MAX_NEW_TOKENS if max_new is None else max_new
            max_prompt = DEFAULT_MAX_PROMPT_TOKENS if max_prompt is None else max_prompt
        if max_prompt < 1:
            raise ValueError(f"the model's context of {max_context} leaves no room for a prompt beside "
                             f"max_new_tokens={max_new}")
        resolved = dataclasses.replace(
            limits, max_prompt_tokens=max_prompt, max_new_tokens=max_new,
            max_batch=limits.max_batch or (64 if accelerator else 8),
            min_batch_bucket=limits.min_batch_bucket or (2 if accelerator else 1),
            min_tokens=limits.min_tokens or (64 if accelerator else 256),
            ladder=limits.ladder or ("fine" if accelerator else "octaves"))
        if resolved.token_rungs is not None and resolved.token_rungs[-1] < max_prompt:
            raise ValueError(f"token_rungs must end at a capacity that holds max_prompt_tokens={max_prompt}, got "
                             f"{resolved.token_rungs}")
        return dataclasses.replace(self, limits=resolved)


def _several(devices) -> bool:
    """Whether a devices option names more than one device."""
    if devices is None:
        return False
    return (devices if isinstance(devices, int) else len(devices)) > 1


__all__ = ["EngineOptions", "LimitOptions", "PoolOptions", "TierOptions", "ParallelOptions", "KernelOptions",
           "RequestOptions", "SchedulerOptions", "CompileOptions", "GROUPS", "MODES", "PIC_MODES", "POLICIES",
           "DEFAULT_SEPARATOR", "default_compile_cache"]
