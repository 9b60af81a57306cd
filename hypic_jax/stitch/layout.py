"""Request layouts as data: fixed-capacity int32 arrays, and the ladder of capacities that keys compilation.

A request is an ordered list of spans: fresh spans (tokens computed now) and cached spans (a cache entry's tokens,
read from the entry pools by slot and row). `build` turns one request into a `LayoutArrays`, a PyTree of arrays
whose shapes depend only on a few capacities (`Capacity`): fresh tokens, pieces (spans, with a recorded span cut
at its `record_from`), keys. Everything that varies from request to request (lengths, positions, slots, what to
record) is data, so two requests that fit the same capacities run the same compiled program.

The capacities come from a `Ladder`: powers of two and 1.5 times them from a floor, quarter octaves (1.25, 1.5,
1.75 times a power of two) from `fine_from` (1,024 tokens) up to a ceiling, so a long request pays at most 1.25x
padding on its fresh tokens and the number of programs stays a few dozen. Padding is inert by construction:

* padded fresh tokens have `valid` False: no key sees them, their conv rows and linear-core rows are never read,
  their K/V writes are dropped (destination `DROP`) and their logits are never taken;
* padded pieces lie past `num_pieces`, where the state fold stops;
* padded chunks lie past `num_chunks`, where the chunk loops stop;
* padded keys lie past `num_keys` with position `PAD_POSITION`, beyond every query.

Writes that record nothing (padded tokens, tokens of unrecorded spans, unused records) go to row `DROP`, past
every pool, and are dropped: sending them all to one real row would serialise the GPU scatter on that row.
Padded reads (never used) read row 0 of a pool, which no entry owns.

Conventions of the linear core (see `hypic_jax.stitch.linear_over_layout`): fresh pieces are laid out in chunks
of `chunk` tokens, each piece starting a new chunk, so a piece's state before and after is a chunk boundary.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

FRESH = "fresh"
CACHED = "cached"

PIECE_PAD, PIECE_FRESH, PIECE_CACHED = 0, 1, 2
PAD_POSITION = np.iinfo(np.int32).max // 2  # beyond every real position: a padded key is never visible
DROP = np.iinfo(np.int32).max // 2  # a pool row past every pool: writes there are dropped (`stitch.apply_row_writes`)

__all__ = ["FRESH", "CACHED", "Span", "Capacity", "Ladder", "LayoutArrays", "build", "pack", "unpack",
           "PAD_POSITION", "DROP", "shift_pool_rows"]


@dataclasses.dataclass(frozen=True)
class Span:
    """One span of a request (host side).

    kind: FRESH or CACHED. length: its tokens. canonical_start (CACHED): the position its first token had when the
    entry was computed (RoPE moves it by start - canonical_start). slot (CACHED): the entry's row in the linear
    pools. kv_rows (CACHED): int array [length], the rows of its tokens in the per-token pools.
    record_from (FRESH): record tokens [record_from, length) as an entry (None: record nothing); record_slot and
    record_rows: where the record goes (linear slot; per-token pool rows [length - record_from]).
    """

    kind: str
    length: int
    canonical_start: int = 0
    slot: int = 0
    kv_rows: np.ndarray | None = None
    record_from: int | None = None
    record_slot: int = 0
    record_rows: np.ndarray | None = None
    snapshot: bool = False


@dataclasses.dataclass(frozen=True, order=True)
class Capacity:
    """The static shape of a layout: fresh tokens, pieces, keys (context), records. `chunk` is the linear core's
    chunk length and `conv` the causal conv's width minus one (both fixed by the model)."""

    tokens: int
    pieces: int
    keys: int
    records: int
    chunk: int
    conv: int

    @property
    def chunks(self) -> int:
        """Chunks that any layout of this capacity can need: every piece may start a partial chunk."""
        return -(-self.tokens // self.chunk) + self.pieces


def _rungs(floor: int, ceiling: int, fine_from: int, octaves: bool = False) -> tuple[int, ...]:
    """floor, then powers of two p and 1.5p below `fine_from`, and p, 1.25p, 1.5p, 1.75p from it on, up to the
    first rung >= ceiling; with `octaves`, floor and the powers of two above it."""
    values = {floor}
    p = 1
    while p < 2 * max(ceiling, floor):
        steps = (4,) if octaves else (4, 5, 6, 7) if p >= fine_from else (4, 6)
        values.update(v for v in (p * s // 4 for s in steps) if v >= floor)
        p *= 2
    out = sorted(values)
    keep = [v for v in out if v < ceiling]
    keep.append(min(v for v in out if v >= ceiling))
    return tuple(keep)


@dataclasses.dataclass(frozen=True)
class Ladder:
    """The capacities an engine compiles: token rungs from `min_tokens` to `max_tokens` (fresh tokens and keys
    share them), a fixed number of pieces and records. `fit` picks the smallest rung that holds a request.

    The geometric rungs ("fine" steps) step by 1.5x and 1.33x below `fine_from` tokens and by quarter octaves
    (1.25x at most) from it on, where a padded token costs most; "octaves" steps by 2x (fewer programs to compile,
    up to 2x padding: the CPU's choice, where compiling costs more than padding)."""

    max_tokens: int
    max_pieces: int
    min_tokens: int = 64
    chunk: int = 64
    conv: int = 3
    token_rungs: tuple[int, ...] | None = None  # explicit rungs instead of the geometric ones
    fine_from: int = 1024
    steps: str = "fine"  # "fine" or "octaves"
    max_records: int | None = None  # records per request (None: max_pieces); each is an entry's worth of output

    def __post_init__(self):
        if self.max_tokens < 1 or self.max_pieces < 1:
            raise ValueError(f"the ladder needs max_tokens >= 1 and max_pieces >= 1, got {self.max_tokens}, "
                             f"{self.max_pieces}")
        if self.steps not in ("fine", "octaves"):
            raise ValueError(f"steps must be 'fine' or 'octaves', got {self.steps!r}")
        if self.token_rungs is None and self.min_tokens < 1:  # the geometric rungs start there: a rung of 0 tokens
            raise ValueError(f"min_tokens must be >= 1, got {self.min_tokens}")
        if self.token_rungs is not None:
            rungs = tuple(int(r) for r in self.token_rungs)
            if not rungs or list(rungs) != sorted(set(rungs)) or rungs[0] < 1 or rungs[-1] < self.max_tokens:
                raise ValueError(f"token_rungs must be increasing positive sizes whose last holds max_tokens="
                                 f"{self.max_tokens}, got {self.token_rungs}")

    @property
    def rungs(self) -> tuple[int, ...]:
        if self.token_rungs is not None:
            return tuple(self.token_rungs)
        return _rungs(self.min_tokens, self.max_tokens, self.fine_from, octaves=self.steps == "octaves")

    def rung(self, n: int, what: str = "tokens") -> int:
        for r in self.rungs:
            if r >= n:
                return r
        raise ValueError(f"the request needs {n} {what}, over the largest compiled capacity of {self.rungs[-1]} "
                         f"(raise max_prompt_tokens)")

    def fit(self, fresh_tokens: int, keys: int, pieces: int, records: int, *, isolated: bool) -> Capacity:
        if pieces > self.max_pieces:
            raise ValueError(f"the request needs {pieces} spans, over the compiled limit of {self.max_pieces} "
                             f"(raise max_segments)")
        tokens = self.rung(fresh_tokens)
        if records > self.records:
            raise ValueError(f"the request records {records} entries, over the compiled limit of {self.records} "
                             f"(raise max_segments)")
        return Capacity(tokens=tokens, pieces=self.max_pieces, keys=tokens if isolated else self.rung(keys, "keys"),
                        records=self.records, chunk=self.chunk, conv=self.conv)

    @property
    def records(self) -> int:
        return self.max_pieces if self.max_records is None else self.max_records


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayoutArrays:
    """One request's layout as device arrays. Shapes: F fresh tokens, N pieces, C chunks of c tokens, P keys,
    R records, W1 = conv width - 1 (all from its `Capacity`)."""

    # fresh tokens [F]
    tokens: np.ndarray  # int32 token ids (0 where padded)
    positions: np.ndarray  # int32 absolute positions (span-relative when isolated; 0 where padded)
    valid: np.ndarray  # bool
    token_segment: np.ndarray  # int32 span index (isolated masks); -1 where padded
    last: np.ndarray  # int32 [] index of the last real fresh token (its logits are the request's)
    # pieces [N]
    piece_kind: np.ndarray  # int32 PIECE_PAD / PIECE_FRESH / PIECE_CACHED
    piece_reset: np.ndarray  # bool: the state before this piece is zero (a new isolated span)
    piece_slot: np.ndarray  # int32 linear-pool slot of a cached piece (0 otherwise)
    piece_offset: np.ndarray  # int32 RoPE offset of a cached piece: start - canonical_start
    num_pieces: np.ndarray  # int32 []
    piece_starts: np.ndarray  # int32 [N + 1] each piece's first fresh token (fresh tokens are packed in piece
    # order; cached and padded pieces hold none), and last the number of fresh tokens: the linear kernels' offsets
    drop_transfer: np.ndarray  # bool []: cached transfers are dropped (HYPIC's `addition`)
    # linear-core chunks [C, c] / [C]
    chunk_rows: np.ndarray  # int32 [C, c] packed fresh index of each chunk row, F where padded
    chunk_piece: np.ndarray  # int32 [C] the chunk's piece
    chunk_first: np.ndarray  # bool [C] the chunk starts its piece
    chunk_last: np.ndarray  # bool [C] the chunk ends its piece
    chunk_load: np.ndarray  # bool [C] the chunk starts from its piece's incoming state (else it continues)
    num_chunks: np.ndarray  # int32 []
    token_chunk_row: np.ndarray  # int32 [F] flat index into [C * c] of each fresh token (0 where padded)
    # conv [F, W1] / [W1] / [R, W1]: sources in [zero row | fresh rows (F) | cached tails (N x W1)]
    conv_rows: np.ndarray
    conv_final: np.ndarray
    conv_records: np.ndarray
    # keys [P]
    key_fresh: np.ndarray  # bool: the key is a fresh token's (else a pool row)
    key_index: np.ndarray  # int32 fresh index or pool row
    key_positions: np.ndarray  # int32 (PAD_POSITION where padded)
    key_offset: np.ndarray  # int32 RoPE offset of a cached key
    key_segment: np.ndarray  # int32 span index (isolated masks)
    num_keys: np.ndarray  # int32 []
    # records [R]
    record_piece: np.ndarray  # int32 piece whose summary (isolated) or end state (stitched) is recorded
    record_slot: np.ndarray  # int32 linear-pool slot it is written to (DROP: no record)
    fresh_dest: np.ndarray  # int32 [F] per-token pool row a fresh token's K/V is written to (DROP: not recorded)


def shift_pool_rows(layout: LayoutArrays, kind: str, base) -> LayoutArrays:
    """The layout as one layer whose pool rows start at `base` in a shared pool reads and writes it
    (`hypic_jax.models.stack`): "slot" pools shift the cached pieces' and the records' slots, "token" pools
    the cached keys' rows and the fresh tokens' destinations. DROP stays past every pool (pools hold fewer than
    DROP rows), and fresh keys keep their fresh indices."""
    if isinstance(base, int) and base == 0:
        return layout
    if kind == "slot":
        return dataclasses.replace(layout, piece_slot=layout.piece_slot + base, record_slot=layout.record_slot + base)
    if kind == "token":
        return dataclasses.replace(layout, key_index=jnp.where(layout.key_fresh, layout.key_index,
                                                               layout.key_index + base),
                                   fresh_dest=layout.fresh_dest + base)
    raise ValueError(f"pool kind must be 'slot' or 'token', got {kind!r}")


@dataclasses.dataclass
class _Scan:
    """What `build` reads off the spans in one pass, as rows of Python values that the fills turn into columns."""

    spans: list[tuple[int, bool, int, int]]  # (length, cached, first piece, RoPE offset of a cached span)
    pieces: list[tuple[int, int, int, bool, int, bool]]  # (kind, slot, offset, reset, fresh tokens, loads)
    records: list[tuple[int, int, int, int]]  # (piece, slot, span, record_from)
    kv_rows: list[np.ndarray]  # the cached spans' pool rows, in span order
    record_rows: list[np.ndarray]


def _scan(spans: list[Span], cap: Capacity, *, isolated: bool, summaries: bool, rope: bool) -> _Scan:
    """Check the spans in request order, so that the first problem is the one reported, and read off their pieces
    and records. A fresh piece loads its incoming state (rather than continuing the previous piece's) when the
    program computes summaries, after a cached piece, or at the start of an isolated span."""
    N, C, P, R, c = cap.pieces, cap.chunks, cap.keys, cap.records, cap.chunk
    s = _Scan([], [], [], [], [])
    chunk = key = position = 0
    previous_fresh = False
    for index, span in enumerate(spans):
        length = span.length
        if length <= 0:
            raise ValueError(f"span {index} holds no token")
        cached = span.kind == CACHED
        if not cached and span.kind != FRESH:
            raise ValueError(f"span {index}: kind must be {FRESH!r} or {CACHED!r}, got {span.kind!r}")
        piece = len(s.pieces)
        if cached:
            if piece >= N:
                raise ValueError(f"the request needs more than {N} pieces")
            rows = np.asarray(span.kv_rows if span.kv_rows is not None else np.zeros(length), np.int32)
            if rows.shape != (length,):
                raise ValueError(f"cached span {index}: {rows.shape[0]} pool rows for {length} tokens")
            if key + length > P:
                raise ValueError(f"the request needs more than {P} keys")
            offset = position - span.canonical_start if rope else 0
            s.spans.append((length, True, piece, offset))
            s.pieces.append((PIECE_CACHED, span.slot, offset, piece == 0 or span.snapshot, 0, False))
            s.kv_rows.append(rows)
            key += length
            previous_fresh = False
        else:
            s.spans.append((length, False, piece, 0))
            record_from = span.record_from
            cut = record_from if (isolated and record_from) else 0
            if record_from is not None and not 0 <= record_from < length:
                raise ValueError(f"span {index}: record_from must lie in [0, {length}), got {record_from}")
            for lo, hi in ((0, cut), (cut, length)) if cut else ((0, length),):
                piece = len(s.pieces)
                if piece >= N:
                    raise ValueError(f"the request needs more than {N} pieces")
                chunk += -(-(hi - lo) // c)
                if chunk > C:
                    raise ValueError(f"the request needs more than {C} chunks")
                starts = isolated and lo == 0
                s.pieces.append((PIECE_FRESH, 0, 0, starts or piece == 0, hi - lo,
                                 summaries or not previous_fresh or starts))
                previous_fresh = True
            if record_from is not None:
                if len(s.records) >= R:
                    raise ValueError(f"the request records more than {R} entries")
                n_rec = length - record_from
                rows = np.asarray(span.record_rows if span.record_rows is not None else np.zeros(n_rec), np.int32)
                if rows.shape != (n_rec,):
                    raise ValueError(f"span {index}: {rows.shape[0]} record rows for {n_rec} recorded tokens")
                # the interior (isolated) or the span's last piece
                s.records.append((len(s.pieces) - 1, span.record_slot, index, record_from))
                s.record_rows.append(rows)
            if not isolated:
                if key + length > P:
                    raise ValueError(f"the request needs more than {P} keys")
                key += length
        position += length
    return s


def _exclusive(counts: np.ndarray) -> np.ndarray:
    """Where each run starts when runs of `counts` items are laid end to end."""
    return np.cumsum(counts) - counts


def _runs(firsts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """firsts[i] + j for j in range(counts[i]), run after run: consecutive ranges laid end to end, at once."""
    return np.repeat(firsts - _exclusive(counts), counts) + np.arange(int(counts.sum()))


def _padded(values, counts: np.ndarray, size: int, pad, dtype) -> np.ndarray:
    """[size]: values[i] repeated counts[i] times, run after run, then `pad` up to `size` (one allocation)."""
    return np.repeat(np.append(np.asarray(values, dtype), np.asarray(pad, dtype)),
                     np.append(counts, size - counts.sum()))


def check_request(spans, tokens, capacity: Capacity, *, isolated: bool) -> int:
    """The checks every layout of `spans` with fresh `tokens` must pass (a clear ValueError each); returns the
    number of fresh tokens."""
    num_fresh = int(sum(s.length for s in spans if s.kind == FRESH))
    if len(tokens) != num_fresh:
        raise ValueError(f"{len(tokens)} fresh tokens given for spans holding {num_fresh}")
    if num_fresh == 0:
        raise ValueError("a layout needs at least one fresh token (the query)")
    if num_fresh > capacity.tokens:
        raise ValueError(f"{num_fresh} fresh tokens over the capacity of {capacity.tokens}")
    if isolated and any(s.kind == CACHED for s in spans):
        raise ValueError("an isolated layout holds fresh spans only")
    return num_fresh


def build(spans: Sequence[Span], capacity: Capacity, *, isolated: bool, tokens: np.ndarray,
          summaries: bool, transfer: bool = True, rope: bool = True) -> LayoutArrays:
    """The arrays of one request. `tokens`: the fresh tokens in span order. `summaries`: the program computes
    every fresh piece's own summary (PIC stitching, cold prefill); otherwise a fresh piece that follows another
    fresh piece continues its state instead of loading one (prefix cache, full recompute). `transfer` False drops
    cached transfers; `rope` False keeps cached keys (and RoPE'd linear states) at their canonical phase.

    The spans are read in one pass and the arrays then filled for all spans at once: a request of a hundred
    cached documents is laid out in well under a millisecond."""
    cap = capacity
    spans = list(spans)
    num_fresh = check_request(spans, tokens, cap, isolated=isolated)
    s = _scan(spans, cap, isolated=isolated, summaries=summaries, rope=rope)
    lengths, cached, first_piece, offsets = (np.asarray(column) for column in zip(*s.spans))
    fresh_lengths = np.where(cached, 0, lengths)
    fresh_start = _exclusive(fresh_lengths)
    stream, ends = _conv_stream(lengths, cached, first_piece, fresh_start, cap, isolated=isolated)
    out = _fresh_fields(tokens, lengths, cached, stream, ends - fresh_lengths, cap, isolated=isolated)
    out.update(_piece_fields(s, cap))
    out.update(_record_fields(s, lengths, fresh_start, stream, ends, cap))
    if isolated:  # keys are the fresh tokens themselves, at their span-relative positions
        out.update(_fresh_keys(out, num_fresh, cap.keys))
    else:
        out.update(_stitched_keys(s, lengths, cached, offsets, fresh_start, num_fresh, cap.keys))
    out["drop_transfer"] = np.asarray(not transfer)
    return LayoutArrays(**out)


def _conv_stream(lengths: np.ndarray, cached: np.ndarray, first_piece: np.ndarray, fresh_start: np.ndarray,
                 cap: Capacity, *, isolated: bool) -> tuple[np.ndarray, np.ndarray]:
    """The conv sources of the request in token order, keeping only what a window of w1 rows can reach: a fresh
    span's rows (1 + fresh index), a cached span's stored tail (its last min(length, w1) tokens, rows after the
    F fresh ones), and w1 zero rows before the first span (before every span when isolated: its history starts
    empty). Returns the stream and where each span's tokens end in it."""
    w1 = cap.conv
    pad = np.full(len(lengths), w1) if isolated else np.zeros(len(lengths), np.int64)
    pad[0] = w1
    n = np.where(cached, np.minimum(lengths, w1), lengths)
    base = np.where(cached, 1 + cap.tokens + (first_piece + 1) * w1 - n, 1 + fresh_start)
    size = pad + n
    ends = np.cumsum(size)
    local = np.arange(ends[-1]) - np.repeat(ends - size, size)  # each item's place in its span's run
    stream = np.repeat(base - pad, size) + local
    stream[local < np.repeat(pad, size)] = 0
    return stream, ends


def _fresh_fields(tokens, lengths: np.ndarray, cached: np.ndarray, stream: np.ndarray, stream_starts: np.ndarray,
                  cap: Capacity, *, isolated: bool) -> dict:
    """The fresh tokens' ids, positions, spans and conv windows (their w1 predecessors in the stream)."""
    F, w1 = cap.tokens, cap.conv
    fresh = np.flatnonzero(~cached)
    count, n = len(tokens), lengths[fresh]
    out = dict(tokens=np.zeros(F, np.int32), positions=np.zeros(F, np.int32), valid=np.zeros(F, bool),
               token_segment=np.full(F, -1, np.int32), conv_rows=np.zeros((F, w1), np.int32))
    out["tokens"][:count] = tokens
    out["valid"][:count] = True
    out["positions"][:count] = _runs(np.zeros_like(n) if isolated else _exclusive(lengths)[fresh], n)
    out["token_segment"][:count] = np.repeat(fresh, n)
    out["conv_rows"][:count] = stream[_runs(stream_starts[fresh], n)[:, None] + np.arange(-w1, 0)]
    out["conv_final"] = stream[len(stream) - w1 :].astype(np.int32)
    out["last"] = np.asarray(count - 1, np.int32)
    return out


def _piece_fields(s: _Scan, cap: Capacity) -> dict:
    """The pieces, and the linear core's chunks: each fresh piece's tokens, chunk after chunk."""
    N, C, c, F = cap.pieces, cap.chunks, cap.chunk, cap.tokens
    kind, slot, offset, reset, fresh_tokens, loads = (np.asarray(column) for column in zip(*s.pieces))
    pieces = len(kind)
    out = dict(piece_kind=np.zeros(N, np.int32), piece_reset=np.zeros(N, bool), piece_slot=np.zeros(N, np.int32),
               piece_offset=np.zeros(N, np.int32), chunk_rows=np.full((C, c), F, np.int32),
               chunk_piece=np.zeros(C, np.int32), chunk_first=np.zeros(C, bool), chunk_last=np.zeros(C, bool),
               chunk_load=np.zeros(C, bool), token_chunk_row=np.zeros(F, np.int32))
    out["piece_kind"][:pieces], out["piece_slot"][:pieces] = kind, slot
    out["piece_offset"][:pieces], out["piece_reset"][:pieces] = offset, reset
    starts = np.zeros(N + 1, np.int64)
    starts[1 : pieces + 1] = fresh_tokens  # lengths, summed into each piece's first fresh token
    out["piece_starts"] = np.cumsum(starts, dtype=np.int32)
    fresh = np.flatnonzero(kind == PIECE_FRESH)
    tokens = fresh_tokens[fresh]
    chunks = -(-tokens // c)
    first = _exclusive(chunks)
    row = _runs(first * c, tokens)  # fresh pieces hold the fresh tokens in order
    out["token_chunk_row"][: len(row)] = row
    out["chunk_rows"].reshape(-1)[row] = np.arange(len(row))
    out["chunk_piece"][: int(chunks.sum())] = np.repeat(fresh, chunks)
    out["chunk_first"][first] = True
    out["chunk_last"][first + chunks - 1] = True
    out["chunk_load"][first] = loads[fresh]
    out["num_pieces"] = np.asarray(pieces, np.int32)
    out["num_chunks"] = np.asarray(chunks.sum(), np.int32)
    return out


def _record_fields(s: _Scan, lengths: np.ndarray, fresh_start: np.ndarray, stream: np.ndarray, ends: np.ndarray,
                   cap: Capacity) -> dict:
    """What each recording span writes: its piece's summary or state, its conv tail, its tokens' K/V rows."""
    R, w1 = cap.records, cap.conv
    out = dict(record_piece=np.zeros(R, np.int32), record_slot=np.full(R, DROP, np.int32),
               conv_records=np.zeros((R, w1), np.int32), fresh_dest=np.full(cap.tokens, DROP, np.int32))
    if not s.records:
        return out
    piece, slot, span, record_from = (np.asarray(column) for column in zip(*s.records))
    count = len(piece)
    out["record_piece"][:count], out["record_slot"][:count] = piece, slot
    out["conv_records"][:count] = stream[ends[span][:, None] + np.arange(-w1, 0)]
    out["fresh_dest"][_runs(fresh_start[span] + record_from, lengths[span] - record_from)] = np.concatenate(
        s.record_rows)
    return out


def _fresh_keys(out: dict, num_fresh: int, P: int) -> dict:
    """The keys of an isolated request: the fresh tokens, at their span-relative positions."""
    keys = dict(key_fresh=np.zeros(P, bool), key_index=np.zeros(P, np.int32),
                key_positions=np.full(P, PAD_POSITION, np.int32), key_offset=np.zeros(P, np.int32),
                key_segment=np.full(P, -2, np.int32))
    keys["key_fresh"][:num_fresh], keys["key_index"][:num_fresh] = True, np.arange(num_fresh)
    keys["key_positions"][:num_fresh] = out["positions"][:num_fresh]
    keys["key_segment"][:num_fresh] = out["token_segment"][:num_fresh]
    keys["num_keys"] = np.asarray(num_fresh, np.int32)
    return keys


def _stitched_keys(s: _Scan, lengths: np.ndarray, cached: np.ndarray, offsets: np.ndarray, fresh_start: np.ndarray,
                   num_fresh: int, P: int) -> dict:
    """The keys of a stitched request: every span's tokens at their absolute positions, a fresh token's by its
    fresh index and a cached token's by its pool row (each array allocated once: P is the context's length)."""
    count = int(lengths.sum())
    positions = np.arange(P, dtype=np.int32)
    positions[count:] = PAD_POSITION
    fresh, rows = np.arange(num_fresh, dtype=np.int32), iter(s.kv_rows)
    index = [next(rows) if is_cached else fresh[f : f + n]
             for is_cached, f, n in zip(cached.tolist(), fresh_start.tolist(), lengths.tolist())]
    return dict(key_fresh=_padded(~cached, lengths, P, False, bool),
                key_index=np.concatenate(index + [np.zeros(P - count, np.int32)]), key_positions=positions,
                key_offset=_padded(offsets, lengths, P, 0, np.int32),
                key_segment=_padded(np.arange(len(lengths)), lengths, P, -2, np.int32),
                num_keys=np.asarray(count, np.int32))


# The per-key fields that `pack` sends as runs, one per key span, instead of key by key: `build` gives every span's
# keys one kind, RoPE offset and segment, and consecutive positions. key_index (fresh indices and pool rows) goes
# key by key: about a quarter of the bytes at the headline's capacity (`bench/investigations/host_time.py` prints it).
_KEY_RUN_FIELDS = ("key_fresh", "key_positions", "key_offset", "key_segment")


@functools.lru_cache(maxsize=None)
def _fields(capacity: Capacity) -> tuple[tuple[str, tuple[int, ...], np.dtype], ...]:
    """(name, shape, dtype) of every LayoutArrays field at `capacity`, in field order (they depend on it alone)."""
    arrays = build([Span(FRESH, 1)], capacity, isolated=False, tokens=np.zeros(1, np.int32), summaries=True)
    return tuple((f.name, getattr(arrays, f.name).shape, getattr(arrays, f.name).dtype)
                 for f in dataclasses.fields(LayoutArrays))


def _key_runs(arrays: LayoutArrays, runs: int) -> np.ndarray:
    """[5, runs] int32: each key span's end (the key after its last), kind (1: fresh), position shift (its keys'
    positions minus their indices), RoPE offset and segment; runs past the last end at num_keys and hold no key."""
    n = int(arrays.num_keys)
    segment = np.asarray(arrays.key_segment)[:n]
    first = np.flatnonzero(np.r_[True, segment[1:] != segment[:-1]]) if n else np.zeros(0, np.int64)
    if len(first) > runs:
        raise ValueError(f"the layout's {n} keys lie in {len(first)} spans, over the {runs} it can send")
    out = np.full((5, runs), n, np.int32)
    out[1:] = 0
    count = len(first)
    out[0, :count] = np.r_[first[1:], n]
    out[1, :count] = np.asarray(arrays.key_fresh)[first]
    out[2, :count] = np.asarray(arrays.key_positions)[first] - first
    out[3, :count] = np.asarray(arrays.key_offset)[first]
    out[4, :count] = segment[first]
    return out


def _expand_key_runs(runs, num_keys, keys: int) -> dict:
    """`_key_runs`' inverse: the four per-key fields of `keys` keys (a [keys, runs] comparison, which XLA fuses
    into one reduction, finds each key's run)."""
    end, fresh, shift, offset, segment = (runs[i] for i in range(5))
    j = jnp.arange(keys, dtype=jnp.int32)
    run = jnp.minimum(jnp.sum(end[None, :] <= j[:, None], axis=1), runs.shape[1] - 1)
    valid = j < num_keys
    return dict(key_fresh=valid & (fresh[run] != 0),
                key_positions=jnp.where(valid, j + shift[run], PAD_POSITION).astype(jnp.int32),
                key_offset=jnp.where(valid, offset[run], 0).astype(jnp.int32),
                key_segment=jnp.where(valid, segment[run], -2).astype(jnp.int32))


def pack(arrays: LayoutArrays) -> np.ndarray:
    """A host layout in one int32 vector (bools as 0/1), so that a request sends its layout to the device as one
    transfer instead of one per field (a few dozen), with the per-key fields of `_KEY_RUN_FIELDS` as one run per
    key span; `unpack` inside the program splits it again. Takes layouts as `build` makes them."""
    parts = [np.asarray(getattr(arrays, f.name)).astype(np.int32, copy=False).reshape(-1)
             for f in dataclasses.fields(LayoutArrays) if f.name not in _KEY_RUN_FIELDS]
    parts.append(_key_runs(arrays, arrays.piece_kind.shape[0]).reshape(-1))
    return np.concatenate(parts)


def packed_size(capacity: Capacity) -> int:
    """The length of `pack`'s vector at `capacity`."""
    return (sum(int(np.prod(shape)) for name, shape, _ in _fields(capacity) if name not in _KEY_RUN_FIELDS)
            + 5 * capacity.pieces)


def unpack(packed, capacity: Capacity) -> LayoutArrays:
    """`pack`'s inverse for a layout of `capacity` (static slices, and the per-key fields expanded from their runs:
    cheap inside a jitted program)."""
    if packed.shape != (packed_size(capacity),):
        raise ValueError(f"a packed layout of {capacity} has {packed_size(capacity)} entries, got {packed.shape}")
    out, at = {}, 0
    for name, shape, dtype in _fields(capacity):
        if name in _KEY_RUN_FIELDS:
            continue
        size = int(np.prod(shape))
        part = packed[at : at + size].reshape(shape)
        out[name] = part != 0 if dtype == np.bool_ else part
        at += size
    runs = packed[at : at + 5 * capacity.pieces].reshape(5, capacity.pieces)
    out.update(_expand_key_runs(runs, out["num_keys"], capacity.keys))
    return LayoutArrays(**out)


def count_pieces(spans: Sequence[Span], *, isolated: bool) -> tuple[int, int]:
    """(pieces, records) that `build` will lay out for these spans."""
    pieces = records = 0
    for s in spans:
        if s.kind == CACHED:
            pieces += 1
        else:
            pieces += 2 if (isolated and s.record_from) else 1
            records += s.record_from is not None
    return pieces, records


def chunk_for(kind: str, model_chunk: int, backend: str | None = None) -> int:
    """The linear core's chunk length per program kind. Stitched programs hold short seams and a query, so a chunk
    of 16 keeps their per-piece padding small. Cold and prefix programs hold whole documents: on a GPU they take
    the model's chunk (fewer sequential state steps); on the CPU a chunk of 16 as well, because there the
    chunk-local work (pairwise decays, c^2 K per chunk, and the triangular solves) outweighs the state steps that
    a longer chunk saves."""
    backend = backend or jax.default_backend()
    return min(16, model_chunk) if kind == "pic" or backend == "cpu" else model_chunk

