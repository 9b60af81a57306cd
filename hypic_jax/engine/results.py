"""What the engine returns: a prefill's logits and statistics, a generation's text and tokens."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass
class PrefillStats:
    """What a prefill did. cached_tokens: tokens served from entries that were already in the cache;
    recomputed_tokens: fresh tokens of the final forward (seams, query, uncached prefix segments);
    cold_tokens: tokens prefilled in isolation to create missing entries. Times: ttft_s the whole call; cold_s
    planning and cold prefills; combine_s the final forward until its logits are on the host."""

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

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class PrefillPiece:
    """One piece of a cold prefill spread between decode steps (`Engine.prefill_piece`)."""

    tokens: int
    """Tokens prefilled by this piece."""
    left: int
    """Tokens of the request's segments still missing after it."""
    segments: int
    """The request's segments (each occurrence) whose entries it stored."""
    cached_tokens: int
    """Of those segments, the tokens the request's prefill will read from the entries (their seams excluded)."""

    def as_stats(self, stats: PrefillStats) -> PrefillStats:
        """`stats` of the request's prefill with this piece's segments counted as computed by the request, not
        found in the cache."""
        return dataclasses.replace(stats, cached_tokens=max(0, stats.cached_tokens - self.cached_tokens),
                                   cold_tokens=stats.cold_tokens + self.tokens,
                                   hits=max(0, stats.hits - self.segments), misses=stats.misses + self.segments)


@dataclasses.dataclass
class PrefillResult:
    logits: Any  # float32 [vocab] at the last prompt position (numpy; a device array from prefill(wait=False))
    stats: PrefillStats
    tokens: list[int]  # the whole prompt
    decode: Any = dataclasses.field(default=None, repr=False)  # per-layer caches after the prompt (device)


@dataclasses.dataclass
class GenerateResult:
    """text: the generated text (None without a tokenizer), ending before a stop string; tokens: the generated ids
    (a stop token id included); finish_reason: "stop" or "length"; logprobs: per token (id, its log-probability,
    [(id, log-probability) of the likeliest]) when asked for."""

    text: str | None
    tokens: list[int]
    stats: PrefillStats
    decode_s: float
    finish_reason: str
    logprobs: list | None = None
