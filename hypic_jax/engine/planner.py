"""Request planning: what one request runs (`Plan`), from its mode, its segments and what the cache holds.

`plan` looks every segment up (promoting entries from the lower tiers, `hypic_jax.cache.hierarchy`), has the
engine prefill the missing ones (one packed, isolated cold program that records their entries), and lays out the
request's program: its spans (fresh ones, and cached ones read from the pools) and its fresh tokens. A prefix-cache
plan also gives pool room to the entries its own program records (`Plan.stores`).

The steps that run or copy are the engine's own (`Engine._prefill_missing`, `Engine._finish_promotions`), looked
up on the engine at each call; planning itself runs no program.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from hypic_jax.cache.index import Entry, entry_key
from hypic_jax.cache.pools import PoolFull
from hypic_jax.engine.requests import segment_seams
from hypic_jax.stitch import layout as lay

__all__ = ["Plan", "lookup_pic", "plan", "plan_prefix", "plan_pic", "prefix_hits", "seam_span"]


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """What one request runs, and what it found in the cache."""

    kind: str
    """The span program's kind: "plain" (full recompute and prefix cache) or "pic" (stitched)."""
    spans: tuple[lay.Span, ...]
    """The program's layout in prompt order: fresh spans (the seams, the prefixes not cached, the query) and cached
    spans (read from an entry's pool slot and rows)."""
    fresh: np.ndarray
    """The fresh spans' tokens, concatenated (int32)."""
    stores: tuple[Entry, ...]
    """Entries the program records (a prefix cache's new prefixes), stored once the program is issued."""
    cached_tokens: int
    """Prompt tokens read from cache entries."""
    cold_tokens: int
    """Tokens the cold prefill of the missing segments computed."""
    hits: int
    """Segments found in the cache (any tier)."""
    misses: int
    """Segments not found (computed by the cold prefill, or, in a prefix cache, by the program itself)."""


@functools.lru_cache(maxsize=256)
def seam_span(length: int) -> lay.Span:
    """The fresh span of a seam: one shared object per length (spans are frozen), not one per document."""
    return lay.Span(lay.FRESH, length)


def plan(engine, mode: str, ids, seam, salt, pins, total: int) -> Plan:
    """What a request runs. `ids`: the segments' token ids as int32 arrays, which stay arrays throughout (keys hash
    their bytes, lookups compare them, fresh tokens are their slices)."""
    if mode == "full_recompute":
        return Plan("plain", (lay.Span(lay.FRESH, total),), np.concatenate(ids), (), 0, 0, 0, 0)
    if mode == "prefix_cache":
        return plan_prefix(engine, ids, salt, pins)
    return plan_pic(engine, ids, mode, seam, salt, pins)


def prefix_hits(engine, docs, salt, pins) -> tuple[list[str], list[Entry]]:
    """Each leading segment's prefix key (chained through the keys before it) and the pinned entries of the longest
    cached run of them."""
    keys, parent = [], ""
    for doc in docs:
        parent = entry_key(doc, fingerprint=engine.fingerprint, kind="prefix", parent=parent, salt=salt)
        keys.append(parent)
    hits: list[Entry] = []
    for doc, key in zip(docs, keys):
        entry = engine.hierarchy.find(key, doc, pins, kind="prefix", seam=0)
        if entry is None:
            break
        hits.append(entry)
    return keys, hits


def plan_prefix(engine, ids, salt, pins, *, query: bool = True) -> Plan:
    """The longest cached run of leading segments; the rest is computed exactly and recorded as new prefix entries
    (as many as the pools can hold). With query=False every segment is a document (a piece of a prefill spread
    between decode steps: it records entries and its logits are not used)."""
    docs, query = (ids[:-1], ids[-1]) if query else (ids, None)
    keys, hits = prefix_hits(engine, docs, salt, pins)
    engine._finish_promotions()
    spans, fresh, stores, position, full = [], [], [], 0, False
    for j, doc in enumerate(docs):
        if j < len(hits):
            e = hits[j]
            spans.append(lay.Span(lay.CACHED, len(doc), canonical_start=position, slot=e.slot, kv_rows=e.rows,
                                  snapshot=True))
        else:
            try:  # recording is optional here: a prefix the pools cannot hold is computed, not cached
                entry = None if full else engine.hierarchy.new_entry("prefix", keys[j], doc, 0, pins)
            except PoolFull:
                entry, full = None, True
            spans.append(lay.Span(lay.FRESH, len(doc)) if entry is None else
                         lay.Span(lay.FRESH, len(doc), record_from=0, record_slot=entry.slot,
                                  record_rows=entry.rows))
            fresh.append(doc)
            if entry is not None:
                stores.append(entry)
        position += len(doc)
    if query is not None:
        spans.append(lay.Span(lay.FRESH, len(query)))
        fresh.append(query)
    return Plan("plain", tuple(spans), np.concatenate(fresh), tuple(stores), sum(e.length for e in hits), 0,
                len(hits), len(docs) - len(hits))


def lookup_pic(engine, ids, mode, seam, salt, pins):
    """A position-independent request's segments looked up: (documents, each one's seam, each one's entry key or
    None when its seam covers it, the entries found by document index, the missing keys -> first document)."""
    docs = ids[:-1]
    seams = (segment_seams(seam, [len(d) for d in docs]) if mode == "transition_rope_recompute"
             else [0] * len(docs))
    keys = [None if w >= len(doc) else entry_key(doc, fingerprint=engine.fingerprint, kind="pic", seam=w, salt=salt)
            for doc, w in zip(docs, seams)]
    # every entry at once (each distinct key once), before any lookup could evict for a request that cannot fit
    room = {key: len(doc) - w for doc, w, key in zip(docs, seams, keys) if key is not None}
    engine.pools.check_room(room.values())
    entries: dict[int, Entry] = {}
    missing: dict[str, int] = {}
    for i, (doc, w, key) in enumerate(zip(docs, seams, keys)):
        if key is None:
            continue
        entry = engine.hierarchy.find(key, doc, pins, kind="pic", seam=w)
        if entry is None:
            missing.setdefault(key, i)
        else:
            entries[i] = entry
    return docs, seams, keys, entries, missing


def plan_pic(engine, ids, mode, seam, salt, pins) -> Plan:
    """Every segment from its entry (position-independent), the missing ones prefilled first; with the seam window,
    each segment's first tokens are fresh spans recomputed under the true prefix."""
    docs, seams, keys, entries, missing = lookup_pic(engine, ids, mode, seam, salt, pins)
    query = ids[-1]
    hit_indices = set(entries)
    hits = len(entries)
    misses = sum(1 for key in keys if key is not None) - hits
    cold_tokens = 0
    if missing:  # one packed, isolated prefill of every missing segment, recording its entry
        cold_tokens = engine._prefill_missing(missing, docs, seams, pins, entries, keys)
    engine._finish_promotions()  # after the cold prefill was issued: the promotions' copies overlap with it
    spans, fresh = [], []
    for i, (doc, w) in enumerate(zip(docs, seams)):
        if w:
            spans.append(seam_span(w))
            fresh.append(doc[:w])
        if w < len(doc):
            e = entries[i]
            spans.append(lay.Span(lay.CACHED, len(doc) - w, canonical_start=w, slot=e.slot, kv_rows=e.rows))
    cached_tokens = sum(entries[i].length for i in hit_indices)
    spans.append(lay.Span(lay.FRESH, len(query)))
    fresh.append(query)
    return Plan("pic", tuple(spans), np.concatenate(fresh), (), cached_tokens, cold_tokens, hits, misses)
