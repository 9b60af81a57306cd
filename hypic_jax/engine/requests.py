"""A request's inputs, checked before any device work: its segments as int32 token ids, its mode and seam, its
sampling parameters. A bad input raises TypeError or ValueError naming the problem; nothing has been run or
changed by then."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import struct
from typing import Sequence

import numpy as np

from hypic_jax.engine.options import MODES, check_seam, seam_tokens, segment_seams
from hypic_jax.options import is_integer, is_number

__all__ = ["seam_tokens", "check_seam", "segment_seams", "check_mode", "SamplingParams", "sampling_params", "SegmentReader", "is_number",
           "is_integer"]


def check_mode(mode) -> str:
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {MODES}")
    return mode


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples (the same for `Engine.generate` and the server). temperature 0 is greedy; top_k 0
    and top_p 1 keep every token; seed None draws a fresh one; stop strings end the text before them; a stop token
    id ends it after that token; logprobs None returns none, k >= 0 the sampled token's and the k likeliest."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    logprobs: int | None = None


def sampling_params(*, max_new_tokens, temperature, top_p, top_k, seed, stop, logprobs, vocab_size: int,
                    tokenizer, top_logprobs: int) -> SamplingParams:
    """`Engine.generate`'s sampling arguments, checked, as `SamplingParams`. stop: strings (need a tokenizer; one
    that is a special token's text, such as `<|eos|>`, also stops at its id, since special tokens never show in the
    text) and/or token ids."""
    if not is_integer(max_new_tokens):
        raise TypeError(f"max_new_tokens must be an integer, got {type(max_new_tokens).__name__}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not is_number(top_p):
        raise TypeError(f"top_p must be a number, got {type(top_p).__name__}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must lie in (0, 1], got {top_p}")
    if not is_integer(top_k):
        raise TypeError(f"top_k must be an integer, got {type(top_k).__name__}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0: off), got {top_k}")
    if not is_number(temperature):
        raise TypeError(f"temperature must be a number, got {type(temperature).__name__}")
    if not 0 <= temperature < math.inf:  # NaN fails too
        raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature}")
    if seed is not None and not is_integer(seed):
        raise TypeError(f"seed must be an integer or None, got {type(seed).__name__}")
    if seed is not None and not 0 <= seed < (1 << 64):
        raise ValueError(f"seed must lie in [0, 2**64), got {seed}")
    if logprobs is not None and (not is_integer(logprobs) or not 0 <= logprobs <= top_logprobs):
        raise ValueError(f"logprobs must be None or an integer in [0, {top_logprobs}], got {logprobs!r}")
    single = isinstance(stop, str) or not hasattr(stop, "__iter__")
    stops = [] if stop is None else ([stop] if single else list(stop))
    for s in stops:
        if not (isinstance(s, str) or is_integer(s)):
            raise TypeError(f"stop must be strings or token ids, got {type(s).__name__} {s!r}")
        if isinstance(s, str) and not s:
            raise ValueError("stop strings must not be empty (an empty string would stop at the first token)")
        if not isinstance(s, str) and not 0 <= s < vocab_size:
            raise ValueError(f"stop token id {s} lies outside the vocabulary [0, {vocab_size})")
    stop_texts = tuple(s for s in stops if isinstance(s, str))
    if stop_texts and tokenizer is None:
        raise ValueError("stop strings need a tokenizer; pass token ids instead")
    stop_ids = {int(s) for s in stops if not isinstance(s, str)}
    if stop_texts:
        added = getattr(tokenizer, "get_added_tokens_decoder", dict)()
        special = {a.content: i for i, a in added.items() if a.special}
        stop_ids |= {special[s] for s in stop_texts if s in special}
    return SamplingParams(max_tokens=int(max_new_tokens), temperature=float(temperature), top_p=float(top_p),
                          top_k=min(int(top_k), vocab_size), seed=None if seed is None else int(seed),
                          stop=stop_texts, stop_token_ids=frozenset(stop_ids), logprobs=logprobs)


# ------------------------------------------------------------------------------------------------------------------
# Segments


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


@dataclasses.dataclass
class SegmentReader:
    """Turns a request's segments into validated int32 token-id arrays: a list of strings or of token-id lists, or
    one string split on `separator`. Each text segment is tokenized alone, exactly as written."""

    vocab_size: int
    tokenizer: object = None
    separator: str = "<<PIC_SEP>>"
    max_context: int | None = None

    def __call__(self, segments) -> list[np.ndarray]:
        """Segments are checked in order: the first problem is the one reported."""
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
                out.append(self._array(i, segment))
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

    def _array(self, i: int, segment) -> np.ndarray:
        """Segment i's token ids as an int32 array. A list of ints converts in one C loop, its vocabulary check left
        to `_check_vocabulary` (one pass over every segment); anything else goes through NumPy's checks."""
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

    def _check_vocabulary(self, ids: Sequence[np.ndarray], first: int = 0) -> None:
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
