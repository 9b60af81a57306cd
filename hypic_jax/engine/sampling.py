"""The one sampler: every token the engine produces, through `Engine.generate` or the server, is drawn on the
device by `sample_rows` from per-row parameters (`SamplingRows`), so one request and seed give the same tokens
whichever way they are asked for. A row's key is its seed with the count of tokens it has sampled folded in, so a
seeded row draws the same numbers whatever batch it runs in."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

TOP_LOGPROBS = 20  # the most alternatives a row's sampler returns (OpenAI's top_logprobs limit)


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
        for its top log-probabilities: the step then runs the sampler that sorts the vocabulary (`sample_rows`)."""
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


def sample_rows(logits, sampling: SamplingRows, top_n: int, full: bool):
    """Per row: greedy (temperature 0) or a Gumbel-max draw from the temperature-scaled distribution, restricted
    (with `full`) to the top_k tokens and then to the top_p nucleus of the rows that ask for it (the smallest prefix
    whose mass reaches top_p). Returns (ids, their log-probabilities, top-n ids
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


__all__ = ["SamplingRows", "Sampled", "sample_rows", "TOP_LOGPROBS"]
