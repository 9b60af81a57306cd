"""One forward over the fresh tokens of a request built from spans of fresh and cached tokens.

A request is an ordered list of SPANS. A fresh span holds tokens computed now; a cached span stands for a cache
entry's tokens (their attention K/V, each linear layer's segment summary (T, S) and conv tail). Every reuse mode is
a layout of spans:

    full recompute    one fresh span
    prefix cache      cached prefix spans (exact state snapshots), then fresh spans
    HYPIC             cached interiors, with fresh seams before them and the fresh query at the end
    cold prefill      fresh spans only, `isolated`: every span starts from position 0 with zero state

All fresh tokens of a request are packed into one [F] array and go through every layer once; the span machinery
below only changes how a layer mixes tokens across spans:

* conv: a fresh span's conv window reaches back W-1 rows into whatever precedes it (fresh rows, a cached entry's
  stored tail, or zeros). One gather builds an extended array (each fresh span preceded by its true W-1 preceding
  rows) and one causal conv runs over it.
* linear core: fresh spans are padded per length group (multiples of 8) and vmapped group by group. Each fresh
  span and the cached spans after it form a group whose summary is composed for all groups at once; one prefix
  over the groups (`linear_attn.prefix_states`: associative scan, or the Pallas fold on a GPU) gives every fresh
  span's incoming state; the fresh outputs then come from `chunked(..., initial_state=incoming)`. On the seam fold
  (the PIC request on a GPU) short seams enter the fold as chunk steps read against cached interiors in the entry
  pool, and their outputs come from the same chunk-local pass (`linear_attn.span_chunk`).
* attention: keys are the cached spans' K (re-rotated from their canonical positions to their absolute ones) and
  the fresh K, laid out in absolute order; fresh queries attend with a causal mask on absolute positions
  (block-diagonal by span when isolated; on a GPU the Pallas kernel `pallas.attention.positioned_attention`).

Layouts are static (frozen, hashable dataclasses): every gather index is computed once in NumPy at trace time.
The price is one compilation per distinct layout; two requests whose spans have the same kinds and lengths (for
example the same equal-length documents in another order) share a compilation.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from hypic_jax import linear_attn
from hypic_jax.attention import dot_product_attention
from hypic_jax.conv import causal_conv1d
from hypic_jax.linear_attn import LinearInputs, Summary
from hypic_jax.pallas import compose as pallas_compose
from hypic_jax.pallas.attention import AttentionConfig, positioned_attention

FRESH = "fresh"
CACHED = "cached"

__all__ = [
    "FRESH",
    "CACHED",
    "Span",
    "SpanLayout",
    "SpanMode",
    "LinearEntry",
    "KVEntry",
    "StackedLayers",
    "PoolSlot",
    "PooledSummary",
    "PooledArray",
    "CachedSegments",
    "conv_over_spans",
    "linear_over_spans",
    "attention_over_spans",
    "span_attention",
    "concat_in_order",
    "SpanResult",
    "MODES",
]


# ----------------------------------------------------------------------------------------------------------------
# Static layouts


@dataclasses.dataclass(frozen=True)
class Span:
    """One span of a request.

    kind: FRESH or CACHED.  length: tokens.  start: absolute position of its first token (0 in isolated layouts).
    offset: FRESH -> offset into the packed fresh-token array; CACHED -> index of its entry in the cached tuple.
    canonical_start: CACHED -> the position its first token had when the entry was computed (its seam length w for
      an interior of an isolated prefill, its own absolute start for a prefix snapshot); RoPE correction rotates by
      start - canonical_start.
    record_from: FRESH -> record a cache entry for tokens [record_from, length) of this span (None: do not record).
    carries_state: CACHED -> whether its linear summary takes part in the composition. Prefix-cache snapshots are
      states after the whole prefix, so only the last cached prefix span carries one.
    """

    kind: str
    length: int
    start: int
    offset: int
    canonical_start: int = 0
    record_from: int | None = None
    carries_state: bool = True


@dataclasses.dataclass(frozen=True)
class SpanLayout:
    """An ordered tuple of spans plus the `isolated` flag (packed cold prefill: no mixing across spans)."""

    spans: tuple[Span, ...]
    isolated: bool = False

    # Construction ---------------------------------------------------------------------------------------------------
    @classmethod
    def build(cls, pieces: Sequence[dict], *, isolated: bool = False, merge_fresh: bool = True) -> "SpanLayout":
        """From pieces {kind, length, [record_from], [canonical_start], [carries_state]} in request order.

        Starts and fresh offsets are assigned here; cached spans get entry indices 0, 1, ... in order. Adjacent fresh
        spans that record nothing are merged (fewer, longer spans: less padding and a shorter scan).
        """
        merged: list[dict] = []
        for piece in pieces:
            if piece["length"] <= 0:
                raise ValueError(f"a span must hold at least one token, got {piece}")
            if piece["kind"] not in (FRESH, CACHED):
                raise ValueError(f"span kind must be {FRESH!r} or {CACHED!r}, got {piece['kind']!r}")
            can_merge = (
                merge_fresh and not isolated and merged and piece["kind"] == FRESH and merged[-1]["kind"] == FRESH
                and piece.get("record_from") is None and merged[-1].get("record_from") is None
            )
            if can_merge:
                merged[-1] = {**merged[-1], "length": merged[-1]["length"] + piece["length"]}
            else:
                merged.append(dict(piece))
        spans, position, fresh_offset, entry = [], 0, 0, 0
        for piece in merged:
            start = 0 if isolated else position
            if piece["kind"] == FRESH:
                spans.append(Span(FRESH, piece["length"], start, fresh_offset, record_from=piece.get("record_from")))
                fresh_offset += piece["length"]
            else:
                if isolated:
                    raise ValueError("an isolated layout holds fresh spans only")
                spans.append(Span(CACHED, piece["length"], start, entry, piece.get("canonical_start", start),
                                  carries_state=piece.get("carries_state", True)))
                entry += 1
            position += piece["length"]
        return cls(tuple(spans), isolated)

    # Derived quantities -----------------------------------------------------------------------------------------
    @functools.cached_property
    def fresh(self) -> tuple[Span, ...]:
        return tuple(s for s in self.spans if s.kind == FRESH)

    @functools.cached_property
    def cached(self) -> tuple[Span, ...]:
        return tuple(s for s in self.spans if s.kind == CACHED)

    @property
    def num_fresh_tokens(self) -> int:
        return sum(s.length for s in self.fresh)

    @property
    def num_cached_tokens(self) -> int:
        return sum(s.length for s in self.cached)

    @property
    def total_length(self) -> int:
        """Tokens of the whole request (fresh + cached); for isolated layouts the packed length."""
        return sum(s.length for s in self.spans)

    @functools.cached_property
    def recorded(self) -> tuple[Span, ...]:
        return tuple(s for s in self.fresh if s.record_from is not None)

    def fresh_positions(self) -> np.ndarray:
        """Positions [F] of the packed fresh tokens (absolute; span-relative when isolated)."""
        if not self.fresh:
            return np.zeros((0,), np.int32)
        return np.concatenate([s.start + np.arange(s.length) for s in self.fresh]).astype(np.int32)

    def fresh_span_ids(self) -> np.ndarray:
        """Index of each packed fresh token's span among the fresh spans [F]."""
        if not self.fresh:
            return np.zeros((0,), np.int32)
        return np.concatenate([np.full(s.length, i) for i, s in enumerate(self.fresh)]).astype(np.int32)

    def validate(self, num_cached_entries: int | None = None) -> None:
        if not self.spans:
            raise ValueError("a layout needs at least one span")
        if self.isolated and self.cached:
            raise ValueError("an isolated layout holds fresh spans only")
        if num_cached_entries is not None and num_cached_entries != len(self.cached):
            raise ValueError(f"layout has {len(self.cached)} cached spans but {num_cached_entries} entries were given")
        for s in self.fresh:
            if s.record_from is not None and not 0 <= s.record_from < s.length:
                raise ValueError(f"record_from must lie in [0, {s.length}), got {s.record_from}")


@dataclasses.dataclass(frozen=True)
class SpanMode:
    """How cached spans are stitched in.

    transfer: compose cached linear summaries with their transfer T (False: HYPIC's `addition`, which adds the
      zero-start states; T is dropped).
    rope: move cached keys (and the linear states of RoPE'd linear layers) from their canonical positions to their
      absolute positions (False: keep the phase they were computed with).
    compose: dot algorithm of the dense transfer products in the scan over spans (None: HIGHEST float32;
      "bf16x3": tensor cores at float32-level accuracy; see `linear_attn.compose`).
    prefix: how the prefix over span groups runs for dense transfers (`linear_attn.prefix_states` impl:
      "associative", "fold", or "pallas", the engine's choice on a GPU); prefix_block: the Pallas fold's block size
      (None: one fold; 0: about sqrt(n)).
    attention_pack_gqa: on a GPU, the fresh queries' attention runs one program per key/value head with the query
      heads that share it packed into its rows (`pallas.attention.AttentionConfig.pack_gqa`: 128 rows, 8 warps),
      where the heads per key/value head are a power of two up to 128 (each K/V tile is loaded once, not once per
      query head; `bench/pic_kernels.py --sections attention` times both).
    attention_programs: on a GPU, split the fresh queries' attention over key ranges until about this many programs
      run (`pallas.attention.AttentionConfig.target_programs`; 1: no split).
    seam_fold: with prefix "pallas" (one fold), a layout whose groups are each a fresh span of at most one chunk and
      one cached interior with a dense transfer (the PIC request) folds the fresh spans in as chunk steps
      (`pallas.compose.span_fold_pallas`) instead of composing every group's pair first.
    seam_precision: dot algorithm of the seams' own rank-c products inside that fold ("auto": single-pass "bf16"
      when the layer's values are bfloat16 and `compose` is a tensor-core algorithm, the precision the GDN kernel
      uses for every token's state update in such a model; otherwise `compose`). The interiors' transfer product
      always runs at `compose`. It trades about 1e-4 of fold-state accuracy for speed (`bench/pic_kernels.py
      --sections span` measures both).
    """

    transfer: bool = True
    rope: bool = True
    compose: str | None = None
    prefix: str = "associative"
    prefix_block: int | None = None
    attention_programs: int = 1
    attention_pack_gqa: bool = True
    seam_fold: bool = True
    seam_precision: str | None = "auto"


# Named modes of the PIC ladder: the stitching flags each one uses (seams are the engine's business).
MODES = {
    "full_recompute": SpanMode(),
    "prefix_cache": SpanMode(),
    "addition": SpanMode(transfer=False, rope=False),
    "transition": SpanMode(transfer=True, rope=False),
    "transition_rope": SpanMode(),
    "transition_rope_recompute": SpanMode(),
}


# ----------------------------------------------------------------------------------------------------------------
# Cache entry pieces (per layer)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LinearEntry:
    """A linear layer's part of a cache entry: the segment summary (T, S) in the family's cheapest exact form, and
    the conv tail (the last W-1 pre-conv inputs, [W-1, D]; [0, 0] for layers without a conv). A prefix-cache
    snapshot is an identity-form summary whose state is the running state after the prefix."""

    summary: Summary
    conv: Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVEntry:
    """A full-attention layer's part of a cache entry: post-RoPE keys at canonical positions and values,
    [n, H_kv, D] each (an architecture may store any other per-token PyTree, e.g. MLA latents)."""

    k: Array
    v: Array


@jax.tree_util.register_pytree_node_class
class StackedLayers:
    """A cache entry's per-layer pieces, with the layers that share one structure and shape stacked.

    Behaves like the tuple of per-layer pieces (`entry[i]`, `len`, iteration) but holds a handful of arrays (one per
    leaf of each kind of layer) instead of one per leaf and layer: a request stitching 64 cached segments of a
    40-layer model hands jit a few hundred arrays rather than about 7,000, which is host dispatch time on every
    request. Inside jit `entry[i]` is a static slice of the stacked arrays, which XLA fuses into its consumer.
    """

    def __init__(self, groups: tuple, index: tuple[tuple[int, int], ...]):
        self.groups = groups  # per kind of layer: its pieces' PyTree with every leaf stacked over those layers
        self.index = index  # per layer: (group, row)

    @classmethod
    def stack(cls, layers: Sequence) -> "StackedLayers":
        if isinstance(layers, StackedLayers):
            return layers
        kinds: dict = {}
        index = []
        for piece in layers:
            leaves, treedef = jax.tree.flatten(piece)
            signature = (treedef, tuple((leaf.shape, str(leaf.dtype)) for leaf in leaves))
            members = kinds.setdefault(signature, [])
            index.append((list(kinds).index(signature), len(members)))
            members.append(leaves)
        groups = tuple(
            jax.tree.unflatten(treedef, _stack_leaves(members)) for (treedef, _), members in kinds.items()
        )
        return cls(groups, tuple(index))

    def __getitem__(self, i: int):
        group, row = self.index[i]
        return jax.tree.map(lambda a: a[row], self.groups[group])

    def __len__(self) -> int:
        return len(self.index)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def tree_flatten(self):
        return (self.groups,), self.index

    @classmethod
    def tree_unflatten(cls, index, children):
        return cls(children[0], index)


@jax.tree_util.register_pytree_node_class
class PoolSlot:
    """Stands in a stored cache entry for a layer piece that lives in the engine's entry pool (`hypic_jax.pool`):
    the piece is row `slot` of that layer's pool, where `slot` is the entry's. No leaves: a request hands jit the
    pool once instead of every entry's copy of the piece."""

    def tree_flatten(self):
        return (), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls()

    def __eq__(self, other) -> bool:
        return isinstance(other, PoolSlot)

    def __hash__(self) -> int:
        return hash(PoolSlot)

    def __repr__(self) -> str:
        return "PoolSlot()"


class _PoolRow:
    """Row `index` of `CachedSegments`'s slot vector, in the pool `pool` (any array or PyTree with a leading
    capacity axis). Many rows of one pool are gathered with one op (`_pooled_rows`), never sliced one by one."""

    def __init__(self, pool, slots: Array, index: int):
        self.pool, self.slots, self.index = pool, slots, index

    @property
    def slot(self) -> Array:
        return self.slots[self.index]

    def materialize(self):
        return jax.tree.map(lambda a: a[self.slot], self.pool)


class PooledSummary(_PoolRow):
    """A cached summary that lives in a pool of summaries (`pool`: a `Summary` with a leading capacity axis). Reads
    as a Summary (`form`, `state`, `transfer`, `shape`; arrays sliced on access); `_stack_cached` gathers many of
    them at once and `pallas.compose.span_fold_pallas` reads their rows in place."""

    @property
    def form(self) -> str:
        return self.pool.form

    @property
    def state(self) -> Array:
        return self.pool.state[self.slot]

    @property
    def transfer(self) -> Array | None:
        return None if self.pool.transfer is None else self.pool.transfer[self.slot]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.pool.state.shape[1:])


class PooledArray(_PoolRow):
    """A cached per-entry array (a conv tail) that is a row of a pool array; `shape` / `dtype` are the row's."""

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.pool.shape[1:])

    @property
    def dtype(self):
        return self.pool.dtype


def _pooled_rows(members: Sequence):
    """(pool, slots [n]) when every member is a pool row of one pool (one gather reads them all), else None."""
    if not members or not all(isinstance(m, _PoolRow) for m in members):
        return None
    first = members[0]
    same = lambda a, b: all(x is y for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))  # noqa: E731
    if any(m.slots is not first.slots or not same(m.pool, first.pool) for m in members):
        return None
    return first.pool, first.slots[jnp.asarray(np.asarray([m.index for m in members], np.int32))]


def _stack_rows(members: Sequence):
    """The members (arrays or PyTrees, or pool rows) stacked along a new leading axis: one gather when they are
    rows of one pool."""
    pooled = _pooled_rows(members)
    if pooled is not None:
        pool, slots = pooled
        return jax.tree.map(lambda a: a[slots], pool)
    rows = [m.materialize() if isinstance(m, _PoolRow) else m for m in members]
    return jax.tree.map(lambda *xs: jnp.stack(xs), *rows)


@jax.tree_util.register_pytree_node_class
class CachedSegments:
    """The cached entries of one request as the span forward reads them: `cached[e][layer]` is entry e's piece of
    that layer, exactly as for a plain tuple of entries, except that pieces stored as `PoolSlot` come out of the
    pools as views (`PooledSummary`, `PooledArray`) that the span code gathers once per layer for all entries.

    entries: per entry its per-layer pieces; pools: per layer None or the pool (the piece's PyTree with a leading
    capacity axis); slots: int32 [entries] (-1 for entries that hold no pooled piece). The slots are data, not part
    of the layout: requests over the same layout share one compilation whichever slots their entries occupy.
    """

    def __init__(self, entries: tuple, pools: tuple, slots):
        self.entries, self.pools, self.slots = entries, pools, slots

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, e: int) -> "_EntryView":
        return _EntryView(self, e)

    def __iter__(self):
        return (self[e] for e in range(len(self)))

    def piece(self, e: int, layer: int):
        piece = self.entries[e][layer]
        if not isinstance(piece, PoolSlot):
            return piece
        pool = self.pools[layer]
        if pool is None:
            raise ValueError(f"entry {e} keeps layer {layer} in the pool, but no pool was given for that layer")
        if isinstance(pool, LinearEntry):
            return LinearEntry(summary=PooledSummary(pool.summary, self.slots, e),
                               conv=PooledArray(pool.conv, self.slots, e))
        return _PoolRow(pool, self.slots, e).materialize()

    def tree_flatten(self):
        return (self.entries, self.pools, self.slots), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)


class _EntryView:
    """One entry of `CachedSegments`: indexable by layer like the tuple of per-layer pieces."""

    def __init__(self, segments: CachedSegments, e: int):
        self._segments, self._e = segments, e

    def __getitem__(self, layer: int):
        return self._segments.piece(self._e, layer)

    def __len__(self) -> int:
        return len(self._segments.entries[self._e])

    def __iter__(self):
        return (self[i] for i in range(len(self)))


@jax.jit
def _stack_leaves(members):
    """[layers][leaves] -> [leaves] stacked over layers (one compiled program per entry structure)."""
    return [jnp.stack(column) for column in zip(*members)]


# ----------------------------------------------------------------------------------------------------------------
# Packing helpers


def _pad_index(layout: SpanLayout, spans: Sequence[Span], from_offsets: Sequence[int], length: int) -> np.ndarray:
    """[len(spans), length] indices into the packed fresh array; F (one past the end) marks padding."""
    pad = layout.num_fresh_tokens
    index = np.full((len(spans), length), pad, np.int32)
    for row, (span, skip) in enumerate(zip(spans, from_offsets)):
        n = span.length - skip
        index[row, :n] = span.offset + skip + np.arange(n)
    return index


def _gather_padded(x: Array, index: np.ndarray) -> Array:
    """x [F, ...] -> [rows, length, ...] with zeros where index == F."""
    padded = jnp.concatenate([x, jnp.zeros((1,) + x.shape[1:], x.dtype)], axis=0)
    return padded[jnp.asarray(index)]


# ----------------------------------------------------------------------------------------------------------------
# Causal conv over spans


def _conv_rows(layout: SpanLayout, width: int) -> tuple[np.ndarray, list[np.ndarray], np.ndarray, list[np.ndarray]]:
    """Row indices into the source table [zero row | fresh rows (F) | cached tails (entries x (W-1))].

    Returns (extended-array rows, per fresh span the rows of its block inside the extended array, the final tail's
    rows, per recorded span its tail's rows). The virtual sequence of all spans is walked once; a cached span
    contributes only its last min(length, W-1) rows, which are all a later window can reach.
    """
    w1 = width - 1
    fresh_count = layout.num_fresh_tokens
    history: list[int] = []
    extended: list[int] = []
    blocks: list[np.ndarray] = []
    records: list[np.ndarray] = []

    def last_rows() -> list[int]:
        tail = history[-w1:] if w1 else []
        return [0] * (w1 - len(tail)) + tail

    for span in layout.spans:
        if layout.isolated:
            history = []
        if span.kind == FRESH:
            rows = [1 + span.offset + i for i in range(span.length)]
            start = len(extended) + w1
            extended += last_rows() + rows
            blocks.append(np.arange(start, start + span.length))
            history += rows
            if span.record_from is not None:
                records.append(np.asarray(last_rows(), np.int32))
        else:
            keep = min(span.length, w1)
            base = 1 + fresh_count + span.offset * w1
            history += [base + w1 - keep + j for j in range(keep)]
    return np.asarray(extended, np.int32), blocks, np.asarray(last_rows(), np.int32), records


def conv_over_spans(
    x: Array,
    weight: Array,
    cached_tails: Sequence[Array],
    layout: SpanLayout,
    *,
    activation: str | None = "silu",
) -> tuple[Array, Array, tuple[Array, ...]]:
    """Depthwise causal conv of the packed fresh rows x [F, D] as if every span were laid out in order.

    cached_tails: per cached entry (in entry order) its stored tail [W-1, D]. Returns (y [F, D], the tail after the
    last span [W-1, D], per recorded span the tail after it [W-1, D]: the last W-1 pre-conv inputs, zero-filled at
    the start of an isolated span).
    """
    width = weight.shape[1]
    w1 = width - 1
    if len(cached_tails) != len(layout.cached):
        raise ValueError(f"{len(layout.cached)} cached spans but {len(cached_tails)} conv tails")
    if cached_tails and any(isinstance(t, _PoolRow) for t in cached_tails):  # one gather for every pooled tail
        tails = [_stack_rows(list(cached_tails)).astype(x.dtype).reshape(len(cached_tails) * w1, x.shape[1])]
    else:
        tails = [t.astype(x.dtype).reshape(w1, x.shape[1]) for t in cached_tails]
    table = jnp.concatenate([jnp.zeros((1, x.shape[1]), x.dtype), x] + tails, axis=0)
    extended, blocks, final_rows, record_rows = _conv_rows(layout, width)
    y_ext, _ = causal_conv1d(table[jnp.asarray(extended)], weight, activation=activation)
    y = y_ext[jnp.asarray(np.concatenate(blocks))] if blocks else y_ext[:0]
    return y, table[jnp.asarray(final_rows)], tuple(table[jnp.asarray(r)] for r in record_rows)


# ----------------------------------------------------------------------------------------------------------------
# Linear core over spans


def _mask_padding(inputs: LinearInputs, valid: Array) -> LinearInputs:
    """Padded tokens get A = I and add nothing: q = k = v = 0 and every gate 0 (log decay 0, beta 0)."""

    def zero(x):
        if x is None:
            return None
        mask = valid.reshape(valid.shape + (1,) * (x.ndim - valid.ndim))
        return jnp.where(mask, x, jnp.zeros((), x.dtype))

    return LinearInputs(zero(inputs.q), zero(inputs.k), zero(inputs.v), zero(inputs.g), zero(inputs.gk),
                        zero(inputs.beta), scale=inputs.scale)


def _padded_inputs(inputs: LinearInputs, layout: SpanLayout, spans: Sequence[Span], skips: Sequence[int]) -> LinearInputs:
    length = max(s.length - k for s, k in zip(spans, skips))
    length = -(-length // 8) * 8
    index = _pad_index(layout, spans, skips, length)
    gathered = jax.tree.map(lambda a: _gather_padded(a, index), inputs)
    return _mask_padding(gathered, jnp.asarray(index < layout.num_fresh_tokens))


def _padded_len(fresh: Sequence[Span], rows: Sequence[int]) -> int:
    return -(-max(fresh[i].length for i in rows) // 8) * 8


def _length_groups(fresh: Sequence[Span]) -> list[list[int]]:
    """Fresh span indices grouped by padded length (a multiple of 8), groups in order of first appearance."""
    groups: dict[int, list[int]] = {}
    for i, span in enumerate(fresh):
        groups.setdefault(-(-span.length // 8) * 8, []).append(i)
    return list(groups.values())


def _unpadded_rows(fresh: Sequence[Span], groups: Sequence[Sequence[int]], lengths: Sequence[int]) -> np.ndarray:
    """Packed fresh token -> its row in the concatenation of the per-length-group padded outputs ([rows x Lp_g]
    each, groups in order), static. Fresh offsets follow span order, so this undoes `_padded_inputs`."""
    base = np.cumsum([0] + [len(rows) * n for rows, n in zip(groups, lengths)])
    where = {i: (g, j) for g, rows in enumerate(groups) for j, i in enumerate(rows)}
    pieces = [base[where[i][0]] + where[i][1] * lengths[where[i][0]] + np.arange(span.length)
              for i, span in enumerate(fresh)]
    return np.concatenate(pieces).astype(np.int32)


def _runs(rows: Sequence[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive rows as (first, stop); a run of -1 rows is (-1, count)."""
    runs: list[list[int]] = []
    for r in rows:
        if runs and ((r == -1 and runs[-1][0] == -1) or (r != -1 and runs[-1][0] != -1 and r == runs[-1][1])):
            runs[-1][1] += 1
        else:
            runs.append([r, 1] if r == -1 else [r, r + 1])
    return [(first, stop) for first, stop in runs]


def _rows(x: Array, rows: Sequence[int]) -> Array:
    """x[rows] for static rows, a row of -1 giving zeros. Contiguous runs become slices and the pieces one
    concatenation, so the regular layouts of PIC requests copy nothing they do not need (a gather of stacked
    128 x 128 transfers costs a full read and write of them)."""
    rows = [int(r) for r in rows]
    if rows == list(range(x.shape[0])):
        return x
    runs = _runs(rows)
    if len(runs) > 8:  # irregular: one gather (a zero row appended for the -1 rows)
        if min(rows) < 0:
            x = jnp.concatenate([x, jnp.zeros((1,) + x.shape[1:], x.dtype)])
        return x[jnp.asarray(np.asarray(rows, np.int32))]
    pieces = [jnp.zeros((stop,) + x.shape[1:], x.dtype) if first == -1 else x[first:stop] for first, stop in runs]
    return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces)


def _select(tree, rows: Sequence[int]):
    return jax.tree.map(lambda a: _rows(a, rows), tree)


def _scan_groups(layout: SpanLayout) -> list[list[int]]:
    """Span indices grouped for the scan: every fresh span opens a group and the state-carrying cached spans after
    it join it (a leading cached span opens group 0). Every fresh span's incoming state is then the state after
    the groups before its own."""
    groups: list[list[int]] = []
    for i, span in enumerate(layout.spans):
        if span.kind == FRESH:
            groups.append([i])
        elif span.carries_state:
            if not groups:
                groups.append([])
            groups[-1].append(i)
    return [g for g in groups if g]


def linear_over_spans(
    inputs: LinearInputs,
    cached: Sequence[Summary],
    layout: SpanLayout,
    mode: SpanMode = SpanMode(),
    *,
    chunk_size: int = 64,
    rotate: Callable[[Summary, int], Summary] | None = None,
) -> tuple[Array, Array, tuple[Summary, ...]]:
    """A linear layer's core over the spans of `layout`.

    inputs: the family's LinearInputs of the packed fresh tokens ([F, H, ...], gates included).
    cached: per cached entry its summary (T, S), computed at canonical positions.
    rotate: for RoPE'd linear layers, summary -> summary moved by `offset` positions (`linear_attn.rotate_summary`
      with the layer's rotary settings); applied to cached summaries when mode.rope.
    Returns (outputs [F, H, V], the state after the last span [H, K, V] float32, per recorded span its record:
    the summary of tokens [record_from, length) in an isolated layout, else the running state after the span as an
    identity-form summary (a prefix-cache snapshot)).

    The incoming states come in three steps, each a fixed number of batched ops however many segments there are:
    (1) every fresh span that precedes another span is summarised (T, S) from its own tokens (one vmapped pass per
    length group, chunks no longer than the span); (2) each group of a fresh span and the cached spans after it is
    composed into one pair, all groups at once (a seam followed by a cached interior: one batched product); (3) a
    prefix over the groups' pairs (`linear_attn.prefix_states`: associative scan, or on a GPU the sequential fold
    kernel, which needs half the products and one launch) gives the state before every fresh span.
    """
    layout.validate(len(cached))
    fresh = layout.fresh
    heads, key_dim, value_dim = inputs.k.shape[1], inputs.k.shape[2], inputs.v.shape[2]
    zero_state = jnp.zeros((heads, key_dim, value_dim), jnp.float32)
    # Fresh spans are padded per group of equal padded length (seams of 8 tokens are not padded to the query's 64):
    # one vmapped pass per group, chunks no longer than the group's length, so padding stays proportional to each
    # span's own length.
    groups = _length_groups(fresh)
    lengths = [_padded_len(fresh, rows) for rows in groups]
    chunks = [min(chunk_size, n) for n in lengths]
    padded = [_padded_inputs(inputs, layout, [fresh[i] for i in rows], [0] * len(rows)) for rows in groups]
    where = {i: (g, j) for g, rows in enumerate(groups) for j, i in enumerate(rows)}  # fresh index -> (group, row)
    fresh_index = {id(s): i for i, s in enumerate(fresh)}

    incoming_rows = None  # per fresh span its row of `prefix` (-1: zero state); None: every span starts at zero
    prefix = None
    reuse = None  # a _SeamPass when the seam fold already ran a length group's chunk-local pass
    if not layout.isolated and len(layout.spans) > 1:
        scan = _scan_groups(layout)
        last = len(layout.spans) - 1
        if scan and scan[-1] == [last] and layout.spans[last].kind == FRESH:
            needed = scan[:-1]  # a trailing fresh span alone: nothing after it needs its summary
        else:
            needed = scan
        group_of = {id(layout.spans[i]): g for g, members in enumerate(scan) for i in members}
        incoming_rows = [group_of[id(s)] - 1 for s in fresh]
        if needed:
            with jax.named_scope("span_prefix"):
                prefix, reuse = _group_prefix(inputs, cached, layout, mode, needed, padded, groups, chunks, where,
                                              fresh_index, rotate)

    outs, finals_by_group = [], []
    for g, rows in enumerate(groups):
        if reuse is not None and reuse.group == g and reuse.outputs is not None:  # the seam fold's own outputs
            o = jnp.moveaxis(reuse.outputs, -2, 1) * padded[g].scale  # [rows, H, Lp, V] -> [rows, Lp, H, V]
            o, f = o.astype(padded[g].v.dtype), None  # no final state of these spans is read (see _seam_fold)
        elif reuse is not None and reuse.group == g:  # outputs from the seam fold's chunk-local pass, no second one
            start = prefix.rows([incoming_rows[i] for i in rows])
            o, f = jax.vmap(lambda one, chunk, s0: one.span_chunk_outputs(chunk, s0))(padded[g], reuse.chunks, start)
        elif incoming_rows is None or all(incoming_rows[i] == -1 for i in rows):
            o, f = jax.vmap(lambda one: one.chunked(chunk_size=chunks[g]))(padded[g])
        else:
            start = prefix.rows([incoming_rows[i] for i in rows])
            o, f = jax.vmap(lambda one, s0: one.chunked(initial_state=s0, chunk_size=chunks[g]))(padded[g], start)
        outs.append(o.reshape((-1,) + o.shape[2:]))  # [rows * Lp_g, H, V]
        finals_by_group.append(f)
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs)
    out = out[jnp.asarray(_unpadded_rows(fresh, groups, lengths))]

    def final_of(span):
        g, row = where[fresh_index[id(span)]]
        return finals_by_group[g][row]

    if layout.spans[-1].kind == FRESH:
        final_state = final_of(layout.spans[-1])
    elif prefix is not None:
        final_state = prefix.final
    else:
        final_state = zero_state

    records: list[Summary] = []
    if layout.recorded:
        if layout.isolated:
            recorded = layout.recorded
            interiors = _padded_inputs(inputs, layout, recorded, [s.record_from for s in recorded])
            summaries = jax.vmap(lambda one: one.summarize(chunk_size=chunk_size))(interiors)
            records = [jax.tree.map(lambda a: a[j], summaries) for j in range(len(recorded))]
        else:
            for span in layout.recorded:
                records.append(Summary("identity", final_of(span), None))
    return out, final_state, tuple(records)


def _splice(old, new, members: Sequence[int]):
    """`old` (stacked PyTree) with rows `members` replaced by the rows of `new` in order: runs of untouched and of
    replaced rows become slices, joined by one concatenation per leaf."""
    position = {j: r for r, j in enumerate(members)}
    pieces: list[list] = []  # [source, first, stop]
    for j in range(jax.tree.leaves(old)[0].shape[0]):
        source, row = ("new", position[j]) if j in position else ("old", j)
        if pieces and pieces[-1][0] == source and pieces[-1][2] == row:
            pieces[-1][2] += 1
        else:
            pieces.append([source, row, row + 1])
    return jax.tree.map(
        lambda o, n: jnp.concatenate([(n if src == "new" else o)[a:b] for src, a, b in pieces]), old, new)


def _stack_cached(cached, cached_in: Sequence[Span], mode: SpanMode, rotate):
    """The summaries of the cached spans `cached_in`, stacked in that order, as this mode stitches them (transfer
    dropped for `addition`, moved to their absolute positions for RoPE'd linear layers)."""
    members = [cached[s.offset] for s in cached_in]
    if all(isinstance(m, PooledSummary) for m in members):  # one pool per layer: one gather, one form
        stacked = _stack_rows(members)
    else:
        stacked = linear_attn.stack_summaries(
            [m.materialize() if isinstance(m, PooledSummary) else m for m in members])
    if not mode.transfer:
        stacked = Summary("identity", stacked.state, None)
    offsets = np.asarray([s.start - s.canonical_start for s in cached_in], np.int32)
    if mode.rope and rotate is not None and offsets.any():
        stacked = jax.vmap(rotate)(stacked, jnp.asarray(offsets))
    return stacked


def _seam_fold(cached, layout, mode, needed, padded, groups, chunks, where, fresh_index, rotate):
    """The PIC request's regular case on the Pallas fold: every group is one fresh span that fits one chunk, then
    one cached interior with a dense transfer. The fresh spans enter the fold as chunk steps
    (`pallas.compose.span_fold_pallas`), so no group pair is formed. Returns None when the layout is not of this
    shape (the general path composes the groups), else (states after the groups, a `_SeamPass`): one chunk-local
    pass over the seams' length group serves the fold and the seams' outputs. When the fold's seams are that whole length group and none of
    them is the last span or recorded (the PIC request), the fold computes their outputs itself from the state each
    starts from (`span_fold_pallas(q_decayed=, scores=)`), and no incoming state is written or read back."""
    spans_ = layout.spans
    if not mode.seam_fold or mode.prefix != "pallas" or not mode.transfer or mode.prefix_block is not None:
        return None
    if any(len(g) != 2 or spans_[g[0]].kind != FRESH or spans_[g[1]].kind != CACHED for g in needed):
        return None
    fresh_rows = [where[fresh_index[id(spans_[g[0]])]] for g in needed]
    group = fresh_rows[0][0]
    length = padded[group].k.shape[1]
    if any(g != group for g, _ in fresh_rows) or chunks[group] != length:
        return None
    interior_spans = [spans_[g[1]] for g in needed]
    if any(cached[s.offset].form != "dense" for s in interior_spans):
        return None  # scalar / diagonal transfers compose elementwise: the general path is cheap for them
    on_gpu = jax.default_backend() == "gpu"
    if on_gpu and not all(n >= 16 and not n & (n - 1) for n in cached[interior_spans[0].offset].shape[-2:]):
        return None  # Triton tiles need power-of-two widths of at least 16
    span_chunks = jax.vmap(lambda one: one.span_chunk())(padded[group])  # every span of the length group
    w, u, k_to_end, decay = _select(tuple(span_chunks[:4]), [row for _, row in fresh_rows])
    algorithm = mode.compose or "f32"
    seam_precision = mode.seam_precision
    if seam_precision == "auto":
        low = padded[group].v.dtype == jnp.bfloat16 and algorithm in ("bf16x3", "bf16x6", "bf16x9")  # v: model dtype
        seam_precision = "bf16" if low else None
    config = pallas_compose.FoldConfig(algorithm=algorithm, seam_algorithm=seam_precision)
    pooled = _pooled_rows([cached[s.offset] for s in interior_spans])
    moved = mode.rope and rotate is not None and any(s.start != s.canonical_start for s in interior_spans)
    if pooled is not None and not moved:  # the kernel reads every interior where it lies in the pool
        pool, slots = pooled
        transfers, states = pool.transfer, pool.state
    else:
        interiors = _stack_cached(cached, interior_spans, mode, rotate)
        transfers, states, slots = interiors.transfer, interiors.state, None
    rows = [row for _, row in fresh_rows]
    finals_needed = {id(layout.spans[-1])} | {id(s) for s in layout.recorded}
    if rows == list(range(padded[group].k.shape[0])) and not any(id(spans_[g[0]]) in finals_needed for g in needed):
        q_decayed, scores = _select(tuple(span_chunks[4:6]), rows)
        outs, final = pallas_compose.span_fold_pallas(w, u, k_to_end, decay, transfers, states, slots, config=config,
                                                      interpret=not on_gpu, q_decayed=q_decayed, scores=scores)
        return _FoldStates(None, final, len(needed)), _SeamPass(group, span_chunks, outs)
    before, final = pallas_compose.span_fold_pallas(w, u, k_to_end, decay, transfers, states, slots, config=config,
                                                    interpret=not on_gpu, incoming=True)
    return _FoldStates(before, final, len(needed)), _SeamPass(group, span_chunks, None)


class _SeamPass(NamedTuple):
    """What the seam fold leaves for the seams' outputs: their length group, its spans' `linear_attn.SpanChunk`s,
    and the outputs the fold computed itself ([rows, H, Lp, V] unscaled), or None when they are still to be read
    from the incoming states."""

    group: int
    chunks: Any
    outputs: Array | None


class _GroupStates(NamedTuple):
    """The states after the scan groups, stacked ([n, H, K, V], from `linear_attn.prefix_states`)."""

    after: Array

    @property
    def final(self) -> Array:
        return self.after[-1]

    def rows(self, rows: Sequence[int]) -> Array:
        """The states after groups `rows`, stacked; -1 is the zero state."""
        return _rows(self.after, rows)


class _FoldStates(NamedTuple):
    """The seam fold's states, read like `_GroupStates`: `before` [n, H, K, V] the state before each group (zero
    first), `final` the state after the last. Group i's outgoing state is before[i + 1] (final for the last), so
    the seams' incoming states are `before` itself, not a shifted copy of the outgoing ones. `before` is None when
    the fold computed the seams' outputs itself: then only the state after the last group can be read."""

    before: Array | None
    final: Array
    groups: int

    def rows(self, rows: Sequence[int]) -> Array:
        """The states after groups `rows` (-1: the zero state), like `_rows` on the stacked outgoing states."""
        n = self.groups
        shifted = [r + 1 for r in rows]
        if all(r == n for r in shifted):
            return jnp.broadcast_to(self.final, (len(rows),) + self.final.shape)
        if self.before is None:  # _seam_fold keeps only the final state when no other is read
            raise AssertionError(f"the seam fold kept only its final state; groups {rows} were asked for")
        if all(r < n for r in shifted):
            return _rows(self.before, shifted)
        return _rows(jnp.concatenate([self.before, self.final[None]]), shifted)


def _group_prefix(inputs, cached, layout, mode, needed, padded, groups, chunks, where, fresh_index, rotate):
    """(the states after the scan groups (see `linear_over_spans`): `_GroupStates`, or the seam fold's
    `_FoldStates`; None or the seam fold's (length group, `SpanChunk`s) for that group's outputs)."""
    folded = _seam_fold(cached, layout, mode, needed, padded, groups, chunks, where, fresh_index, rotate)
    if folded is not None:
        return folded
    spans_ = layout.spans
    fresh_in = [fresh_index[id(spans_[i])] for g in needed for i in g if spans_[i].kind == FRESH]
    cached_in = [spans_[i] for g in needed for i in g if spans_[i].kind == CACHED]
    parts = {}
    if fresh_in:
        by_group, flat = [], []  # summaries of the needed fresh spans, length group by length group
        for g, rows in enumerate(groups):
            picked = [i for i in fresh_in if where[i][0] == g]
            if picked:
                chunk = chunks[g]
                by_group.append(jax.vmap(lambda one: one.summarize(chunk_size=chunk))(
                    _select(padded[g], [where[i][1] for i in picked])))
                flat += picked
        stacked = by_group[0] if len(by_group) == 1 else jax.tree.map(lambda *xs: jnp.concatenate(xs), *by_group)
        parts[FRESH] = (stacked, {i: r for r, i in enumerate(flat)})
    if cached_in:
        stacked = _stack_cached(cached, cached_in, mode, rotate)
        parts[CACHED] = (stacked, {s.offset: r for r, s in enumerate(cached_in)})
    form = max((p.form for p, _ in parts.values()), key=linear_attn.FORMS.index)  # the widest form present
    parts = {kind: (linear_attn.promote(p, form), rows) for kind, (p, rows) in parts.items()}

    def source(i):
        span = spans_[i]
        return (FRESH, parts[FRESH][1][fresh_index[id(span)]]) if span.kind == FRESH else (
            CACHED, parts[CACHED][1][span.offset])

    def take(refs):
        """Stacked summaries of `refs` [(kind, row)], as slices of the per-kind stacks where rows run on."""
        pieces, run_kind, run_rows = [], None, []
        for kind, row in refs + [(None, None)]:
            if kind != run_kind and run_rows:
                pieces.append(_select(parts[run_kind][0], run_rows))
                run_rows = []
            run_kind = kind
            if kind is not None:
                run_rows.append(row)
        return pieces[0] if len(pieces) == 1 else jax.tree.map(lambda *xs: jnp.concatenate(xs), *pieces)

    # Compose each group left to right, all groups with a p-th member at once.
    acc = take([source(g[0]) for g in needed])
    for p in range(1, max(len(g) for g in needed)):
        members = [j for j, g in enumerate(needed) if len(g) > p]
        nxt = take([source(needed[j][p]) for j in members])
        if len(members) == len(needed):
            acc = linear_attn.compose(acc, nxt, algorithm=mode.compose)
            continue
        acc = _splice(acc, linear_attn.compose(_select(acc, members), nxt, algorithm=mode.compose), members)
    states = linear_attn.prefix_states(acc, algorithm=mode.compose, impl=mode.prefix, block=mode.prefix_block)
    return _GroupStates(states), None


# ----------------------------------------------------------------------------------------------------------------
# Attention over spans


def concat_in_order(fresh, cached: Sequence, layout: SpanLayout):
    """The per-token PyTree of the whole request in absolute order [P, ...]: the packed fresh tree [F, ...] cut at
    span boundaries, interleaved with the cached spans' trees (per cached entry, entry order)."""
    if layout.isolated or not layout.cached:
        return fresh  # fresh offsets follow span order: the packed array is already in absolute order
    return _interleave(fresh, _concat_cached(cached, layout), layout)


def _concat_cached(cached: Sequence, layout: SpanLayout):
    """The cached spans' per-token trees concatenated in entry order (one concatenation per leaf)."""
    trees = [cached[s.offset] for s in layout.cached]
    return trees[0] if len(trees) == 1 else jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *trees)


def _interleave(fresh, cached_cat, layout: SpanLayout):
    """Absolute order from the packed fresh rows and the concatenated cached rows: one static gather per leaf."""
    fresh_count = layout.num_fresh_tokens
    index, cached_start = [], 0
    for span in layout.spans:
        if span.kind == FRESH:
            index.append(span.offset + np.arange(span.length))
        else:
            index.append(fresh_count + cached_start + np.arange(span.length))
            cached_start += span.length
    index = jnp.asarray(np.concatenate(index).astype(np.int32))
    return jax.tree.map(lambda f, c: jnp.concatenate([f, c.astype(f.dtype)], axis=0)[index], fresh, cached_cat)


def span_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    scale: float,
    q_positions: np.ndarray,
    k_positions: np.ndarray,
    q_segments: np.ndarray | None = None,
    k_segments: np.ndarray | None = None,
    block: int = 512,
) -> Array:
    """GQA attention of q [Lq, Hq, D] over k, v [Lk, Hkv, D]: key j visible to query i iff
    k_pos[j] <= q_pos[i] (and, with segment ids, same segment). Query blocks of `block` rows bound the logits."""
    same_width = max(q.shape[-1], v.shape[-1])
    value_dim = v.shape[-1]
    if v.shape[-1] != same_width:
        v = jnp.pad(v, [(0, 0), (0, 0), (0, same_width - v.shape[-1])])
    if q.shape[-1] != same_width:
        q = jnp.pad(q, [(0, 0), (0, 0), (0, same_width - q.shape[-1])])
        k = jnp.pad(k, [(0, 0), (0, 0), (0, same_width - k.shape[-1])])
    k_positions = np.asarray(k_positions)
    k_segments = None if k_segments is None else np.asarray(k_segments)

    def attend(start, stop):
        q_pos = np.asarray(q_positions[start:stop])
        q_seg = None if q_segments is None else np.asarray(q_segments[start:stop])
        # The keys any query of this block can see (static): a block of an isolated layout needs only its own
        # segments' keys and a causal block only keys up to its last position, so logits stay [block, reach].
        reachable = k_positions <= q_pos.max()
        if q_seg is not None:
            reachable &= np.isin(k_segments, q_seg)
        hits = np.flatnonzero(reachable)
        if hits.size == 0:  # every query of the block sees nothing (cannot happen for causal layouts)
            return jnp.zeros((stop - start,) + q.shape[1:-1] + (v.shape[-1],), q.dtype)
        lo, hi = int(hits[0]), int(hits[-1]) + 1
        visible = jnp.asarray(k_positions[lo:hi])[None, :] <= jnp.asarray(q_pos)[:, None]
        if q_seg is not None:
            visible = visible & (jnp.asarray(k_segments[lo:hi])[None, :] == jnp.asarray(q_seg)[:, None])
        out = jax.nn.dot_product_attention(q[None, start:stop], k[None, lo:hi], v[None, lo:hi], scale=scale,
                                           mask=visible[None, None], implementation="xla")
        return out[0]

    q_len = q.shape[0]
    pieces = []
    for start in range(0, q_len, block):  # static blocks: the layout is static, so is the number of blocks
        pieces.append(attend(start, min(q_len, start + block)))
    out = jnp.concatenate(pieces, axis=0) if len(pieces) > 1 else pieces[0]
    return out[..., :value_dim]


def attention_over_spans(
    q: Array,
    k: Array,
    v: Array,
    cached: Sequence[tuple[Array, Array]],
    layout: SpanLayout,
    mode: SpanMode = SpanMode(),
    *,
    scale: float,
    rotate_keys: Callable[[Array, int], Array] | None = None,
) -> tuple[Array, Array, Array, tuple[tuple[Array, Array], ...]]:
    """Full attention from the packed fresh queries q [F, Hq, D] to all keys of the request.

    k, v: fresh keys (post-RoPE at their positions) and values [F, Hkv, ...]. cached: per cached entry (K, V) with K
    at canonical positions; rotate_keys(K, offset) moves them (applied when mode.rope). Returns (outputs [F, Hq, Dv],
    keys and values of the whole request in absolute order [P, Hkv, ...] (for a decode cache; the packed fresh K/V in
    an isolated layout), per recorded span its (K, V) from record_from on).
    """
    layout.validate(len(cached))
    positions = layout.fresh_positions()
    records = tuple(
        (k[s.offset + s.record_from : s.offset + s.length], v[s.offset + s.record_from : s.offset + s.length])
        for s in layout.recorded
    )
    if layout.isolated:
        if v.shape[-1] == q.shape[-1]:
            return _isolated_attention(q, k, v, layout, scale), k, v, records
        segments = layout.fresh_span_ids()
        out = span_attention(q, k, v, scale=scale, q_positions=positions, k_positions=positions,
                             q_segments=segments, k_segments=segments)
        return out, k, v, records
    if not layout.cached:  # fresh tokens only, from position 0: plain causal attention (flash kernel on a GPU)
        if v.shape[-1] == q.shape[-1]:
            return dot_product_attention(q[None], k[None], v[None], scale=scale)[0], k, v, records
    if layout.cached:
        with jax.named_scope("span_keys"):
            ck, cv = _concat_cached([tuple(c) for c in cached], layout)
            offsets = np.concatenate([np.full(s.length, s.start - s.canonical_start) for s in layout.cached])
            if mode.rope and rotate_keys is not None and offsets.any():
                ck = rotate_keys(ck, jnp.asarray(offsets.astype(np.int32)))  # every cached key moved in one rotation
            keys, values = _interleave((k, v), (ck, cv), layout)
    else:  # fresh spans only (and values narrower than queries, so not the flash path above)
        keys, values = k, v
    if _positioned_kernel_fits(q, keys, values):  # GPU: flash attention over the positions, no logits in memory
        with jax.named_scope("span_flash"):
            config = AttentionConfig(target_programs=mode.attention_programs)
            group = q.shape[1] // keys.shape[1]
            if mode.attention_pack_gqa and group > 1 and not group & (group - 1) and group <= 128:
                config = dataclasses.replace(config, block_q=128, num_warps=8, pack_gqa=True)
            out = positioned_attention(q, keys, values, jnp.asarray(positions), scale=scale, config=config)
        return out, keys, values, records
    key_positions = np.arange(layout.total_length, dtype=np.int32)
    out = span_attention(q, keys, values, scale=scale, q_positions=positions, k_positions=key_positions)
    return out, keys, values, records


def _isolated_attention(q: Array, k: Array, v: Array, layout: SpanLayout, scale: float) -> Array:
    """Causal attention inside each span of an isolated layout: spans are padded per length group (as in the linear
    core) and each group is one batched causal attention (cuDNN flash on a GPU). One op per group instead of one
    per span keeps the cold prefill of many segments small to compile; padding sits after each span's tokens, where
    no real query can see it."""
    fresh = layout.fresh
    groups = _length_groups(fresh)
    outs, lengths = [], []
    for rows in groups:
        length = _padded_len(fresh, rows)
        index = _pad_index(layout, [fresh[i] for i in rows], [0] * len(rows), length)
        qg, kg, vg = (_gather_padded(x, index) for x in (q, k, v))
        outs.append(dot_product_attention(qg, kg, vg, scale=scale).reshape((-1,) + q.shape[1:]))
        lengths.append(length)
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs)
    return out[jnp.asarray(_unpadded_rows(fresh, groups, lengths))]


def _positioned_kernel_fits(q: Array, k: Array, v: Array) -> bool:
    """Whether `pallas.attention.positioned_attention` runs this attention: on a GPU, 16-bit inputs, and head
    widths that are powers of two from 16 to 256 (Triton tile shapes)."""
    widths_ok = all(w >= 16 and w <= 256 and not w & (w - 1) for w in (q.shape[-1], v.shape[-1]))
    return (jax.default_backend() == "gpu" and widths_ok and q.shape[-1] == k.shape[-1]
            and q.dtype in (jnp.bfloat16, jnp.float16) and k.dtype == q.dtype and v.dtype == q.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpanResult:
    """What an architecture's `span_forward` returns.

    logits: float32 [vocab] of the last fresh token (None if not asked for).
    records: per recorded span (layout order) a tuple with one cache-entry piece per layer.
    decode: per layer the layer's cache after the whole request, batch 1 (linear state and conv tail; K/V or
      latents of all P tokens in absolute order), for continuing with the ordinary decode step (None if not asked).
    hidden: [num_layers + 1, F, H] the residual stream of the fresh tokens after the embedding and after every
      layer (None if not asked): what `hypic-jax diag` compares across modes.
    """

    logits: Array | None
    records: tuple
    decode: tuple | None
    hidden: Array | None
