"""An adaptive seam: each document's seam length from how far its first tokens move when it follows other text.

`transition_rope_recompute` is exact in the linear layers (the transfer operators carry the prefix's state through
every cached document) and approximate in one place only: the full-attention layers read the keys and values of a
cached document's tokens as they were computed with the document alone, at the start of a sequence. The seam
recomputes a document's first tokens in context, which is where that approximation is worst. How many tokens that
takes differs per document (a heading that restates its context settles within a token or two; a document that
opens mid-sentence does not), and a fixed seam pays the same everywhere.

`SeamProbe` measures it once per document, when the document is first seen, and keeps the answer:

* the document's first `window` tokens are run twice through the model: alone, and after a fixed probe context
  (`probe`, other text of the same kind; its own prefill is cached once, so a document costs 2 x `window` fresh
  tokens);
* a token's deviation is the largest relative difference, over the inputs of the full-attention layers (the hidden
  states their keys and values are projected from), between its two hidden states: ||h_probe - h_alone|| /
  ||h_probe||. Hidden states carry no position, so the two runs compare at different offsets;
* the document's seam is its first token whose deviation is at most `tol` (the whole window if none): the tokens
  before it are the ones the probe moved most. Past it the deviation settles on a plateau (the linear layers carry
  the probe's state through the whole document, and no seam could recompute that away), so the first crossing,
  not the last, is the signal.

What it costs: two forwards of `window` tokens per new document (memoized by its tokens), against the document's own
cold prefill. What it cannot see: the real prefix, which the request brings later. The probe stands in for it;
`bench/adaptive_seam.py` measures the policy against fixed seams at equal recomputed tokens.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

__all__ = ["SeamProbe", "knob"]


class SeamProbe:
    """Per-document seams for `engine` (an `Engine`): `seams(segments)` is a seam sequence for `Engine.prefill` /
    `generate` / the server's `seam` field (one knob per document, every segment but the query).

    probe: token ids (or text, with the engine's tokenizer) of the context each document is measured after.
    window: the longest seam, and how many of a document's first tokens are measured. tol: the deviation below which a
    document's tokens count as settled (`seam_for` takes another without measuring again); the default is the
    tolerance that recomputed about 4 tokens per segment in `bench/adaptive_seam.py --rechunk`."""

    def __init__(self, engine, probe, *, window: int = 32, tol: float = 0.3):
        if window < 1:
            raise ValueError(f"window must be at least 1 token, got {window}")
        if not tol >= 0:
            raise ValueError(f"tol must be >= 0, got {tol}")
        self.engine, self.window, self.tol = engine, int(window), float(tol)
        self.probe = list(engine.reader([probe])[0])
        if not self.probe:
            raise ValueError("the probe context is empty")
        if len(self.probe) + self.window > engine.max_prompt_tokens:
            raise ValueError(f"the probe ({len(self.probe)} tokens) and the window ({self.window}) exceed the "
                             f"engine's max_prompt_tokens of {engine.max_prompt_tokens}")
        kinds = engine.layer_kinds
        # the layers whose outputs feed a full-attention layer (layer 0's input is the embedding: no deviation)
        self.feeds = [i - 1 for i, kind in enumerate(kinds) if kind == "full" and i > 0]
        self._deviations: dict[str, np.ndarray] = {}

    @staticmethod
    def _key(tokens: Sequence[int]) -> str:
        return hashlib.sha1(np.asarray(tokens, np.int64).tobytes()).hexdigest()

    def deviation(self, document) -> np.ndarray:
        """float64 [min(window, tokens)]: each of the document's first tokens' deviation under the probe (max
        over the full-attention layers' inputs); memoized by the document's tokens."""
        tokens = list(self.engine.reader([document])[0])
        head = tokens[:self.window]
        key = self._key(head)
        if key not in self._deviations:
            if not self.feeds or not head:
                self._deviations[key] = np.zeros(len(head))
            else:
                _, alone = self.engine.query_hidden_states([head], "full_recompute")
                _, after = self.engine.query_hidden_states([self.probe, head], "prefix_cache")
                alone = np.asarray(alone[self.feeds], np.float64)
                after = np.asarray(after[self.feeds], np.float64)
                moved = np.linalg.norm(after - alone, axis=-1) / np.maximum(np.linalg.norm(after, axis=-1), 1e-30)
                self._deviations[key] = moved.max(axis=0)
        return self._deviations[key]

    def seam_for(self, document, tol: float | None = None) -> int:
        """The document's seam in tokens: its first measured token whose deviation is at most `tol` (the whole
        window, or the whole document when shorter, if none)."""
        tol = self.tol if tol is None else float(tol)
        deviation = self.deviation(document)
        settled = np.flatnonzero(deviation <= tol)
        return int(settled[0]) if settled.size else len(deviation)

    def seams(self, segments, tol: float | None = None) -> list[float]:
        """One seam knob per document of a request (`segments`: documents, then the query), for the `seam` of
        `Engine.prefill`: `seam_for`'s token count, except that a seam of one token is the fraction of the
        document that rounds up to one token (the knob 1 means the whole document)."""
        if len(segments) < 2:
            raise ValueError("a request needs at least one document before its query")
        docs = self.engine.reader(segments)[:-1]
        return [knob(self.seam_for(doc, tol), len(doc)) for doc in docs]


def knob(tokens: int, length: int) -> float:
    """The seam knob that means `tokens` tokens of a document of `length` (`requests.seam_tokens` reads x > 1 as a
    token count and 0 < x <= 1 as a fraction, so one token is half a token's share, rounded up)."""
    if tokens == 1 and length > 1:
        return 0.5 / length
    return tokens
