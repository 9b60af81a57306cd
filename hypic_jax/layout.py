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


def _rungs(floor: int, ceiling: int, fine_from: int) -> tuple[int, ...]:
    """floor, then powers of two p and 1.5p below `fine_from`, and p, 1.25p, 1.5p, 1.75p from it on, up to the
    first rung >= ceiling."""
    values = {floor}
    p = 1
    while p < 2 * max(ceiling, floor):
        steps = (4, 5, 6, 7) if p >= fine_from else (4, 6)
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

    The geometric rungs step by 1.5x and 1.33x below `fine_from` tokens and by quarter octaves (1.25x at most)
    from it on, where a padded token costs most."""

    max_tokens: int
    max_pieces: int
    min_tokens: int = 64
    chunk: int = 64
    conv: int = 3
    token_rungs: tuple[int, ...] | None = None  # explicit rungs instead of the geometric ones
    fine_from: int = 1024
    max_records: int | None = None  # records per request (None: max_pieces); each is an entry's worth of output

    def __post_init__(self):
        if self.max_tokens < 1 or self.max_pieces < 1:
            raise ValueError(f"the ladder needs max_tokens >= 1 and max_pieces >= 1, got {self.max_tokens}, "
                             f"{self.max_pieces}")
        if self.token_rungs is not None:
            rungs = tuple(int(r) for r in self.token_rungs)
            if not rungs or list(rungs) != sorted(set(rungs)) or rungs[0] < 1 or rungs[-1] < self.max_tokens:
                raise ValueError(f"token_rungs must be increasing positive sizes whose last holds max_tokens="
                                 f"{self.max_tokens}, got {self.token_rungs}")

    @property
    def rungs(self) -> tuple[int, ...]:
        if self.token_rungs is not None:
            return tuple(self.token_rungs)
        return _rungs(self.min_tokens, self.max_tokens, self.fine_from)

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
    (`hypic_jax.models.layer_stack`): "slot" pools shift the cached pieces' and the records' slots, "token" pools
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


def _predecessors(history: list[int], rows: np.ndarray, w1: int) -> np.ndarray:
    """[len(rows), w1]: for each new row the w1 rows before it in `history + rows` (0 = the zero row)."""
    if not w1:
        return np.zeros((len(rows), 0), np.int32)
    seq = np.concatenate([np.asarray(_tail(history, w1), np.int32), rows.astype(np.int32)])
    return seq[np.arange(len(rows))[:, None] + np.arange(w1)[None, :]]


def _tail(history: list[int], w1: int) -> list[int]:
    return ([0] * w1 + history)[-w1:] if w1 else []


def build(spans: Sequence[Span], capacity: Capacity, *, isolated: bool, tokens: np.ndarray,
          summaries: bool, transfer: bool = True, rope: bool = True) -> LayoutArrays:
    """The arrays of one request. `tokens`: the fresh tokens in span order. `summaries`: the program computes
    every fresh piece's own summary (PIC stitching, cold prefill); otherwise a fresh piece that follows another
    fresh piece continues its state instead of loading one (prefix cache, full recompute). `transfer` False drops
    cached transfers; `rope` False keeps cached keys (and RoPE'd linear states) at their canonical phase."""
    cap, c, w1 = capacity, capacity.chunk, capacity.conv
    spans = list(spans)
    num_fresh = int(sum(s.length for s in spans if s.kind == FRESH))
    if len(tokens) != num_fresh:
        raise ValueError(f"{len(tokens)} fresh tokens given for spans holding {num_fresh}")
    if num_fresh == 0:
        raise ValueError("a layout needs at least one fresh token (the query)")
    if num_fresh > cap.tokens:
        raise ValueError(f"{num_fresh} fresh tokens over the capacity of {cap.tokens}")
    if isolated and any(s.kind == CACHED for s in spans):
        raise ValueError("an isolated layout holds fresh spans only")
    F, N, C, P, R = cap.tokens, cap.pieces, cap.chunks, cap.keys, cap.records

    out = dict(
        tokens=np.zeros(F, np.int32), positions=np.zeros(F, np.int32), valid=np.zeros(F, bool),
        token_segment=np.full(F, -1, np.int32), piece_kind=np.zeros(N, np.int32), piece_reset=np.zeros(N, bool),
        piece_slot=np.zeros(N, np.int32), piece_offset=np.zeros(N, np.int32),
        piece_starts=np.zeros(N + 1, np.int32), chunk_rows=np.full((C, c), F, np.int32),
        chunk_piece=np.zeros(C, np.int32), chunk_first=np.zeros(C, bool), chunk_last=np.zeros(C, bool),
        chunk_load=np.zeros(C, bool), token_chunk_row=np.zeros(F, np.int32), conv_rows=np.zeros((F, w1), np.int32),
        conv_records=np.zeros((R, w1), np.int32), key_fresh=np.zeros(P, bool), key_index=np.zeros(P, np.int32),
        key_positions=np.full(P, PAD_POSITION, np.int32), key_offset=np.zeros(P, np.int32),
        key_segment=np.full(P, -2, np.int32), record_piece=np.zeros(R, np.int32), record_slot=np.full(R, DROP, np.int32),
        fresh_dest=np.full(F, DROP, np.int32),
    )
    out["tokens"][:num_fresh] = tokens
    out["valid"][:num_fresh] = True

    piece, chunk, fresh, key, record, position = 0, 0, 0, 0, 0, 0
    history: list[int] = []
    previous_fresh = False
    for index, span in enumerate(spans):
        if span.length <= 0:
            raise ValueError(f"span {index} holds no token")
        start = 0 if isolated else position
        if isolated:
            history = []
        if span.kind == CACHED:
            if piece >= N:
                raise ValueError(f"the request needs more than {N} pieces")
            rows = np.asarray(span.kv_rows if span.kv_rows is not None else np.zeros(span.length), np.int32)
            if rows.shape != (span.length,):
                raise ValueError(f"cached span {index}: {rows.shape[0]} pool rows for {span.length} tokens")
            offset = start - span.canonical_start if rope else 0
            out["piece_kind"][piece], out["piece_slot"][piece] = PIECE_CACHED, span.slot
            out["piece_offset"][piece] = offset
            out["piece_reset"][piece] = piece == 0 or span.snapshot
            keep = min(span.length, w1)  # a later conv window reaches at most w1 rows back
            history = _tail(history, w1) + [1 + F + piece * w1 + w1 - keep + j for j in range(keep)]
            if key + span.length > P:
                raise ValueError(f"the request needs more than {P} keys")
            sl = slice(key, key + span.length)
            out["key_index"][sl], out["key_positions"][sl] = rows, start + np.arange(span.length)
            out["key_offset"][sl], out["key_segment"][sl] = offset, index
            key += span.length
            piece += 1
            previous_fresh = False
        else:
            cut = span.record_from if (isolated and span.record_from) else 0
            if span.record_from is not None and not 0 <= span.record_from < span.length:
                raise ValueError(f"span {index}: record_from must lie in [0, {span.length}), got {span.record_from}")
            bounds = [(0, cut), (cut, span.length)] if cut else [(0, span.length)]
            span_fresh = np.arange(fresh, fresh + span.length)
            sl = slice(fresh, fresh + span.length)
            out["positions"][sl] = start + np.arange(span.length)
            out["token_segment"][sl] = index
            out["conv_rows"][sl] = _predecessors(history, 1 + span_fresh, w1)
            history = _tail(history, w1) + (1 + span_fresh[max(0, len(span_fresh) - w1):]).tolist() if w1 else []
            for lo, hi in bounds:
                if piece >= N:
                    raise ValueError(f"the request needs more than {N} pieces")
                out["piece_kind"][piece] = PIECE_FRESH
                out["piece_starts"][piece + 1] = hi - lo  # a length here; summed into offsets below
                out["piece_reset"][piece] = (isolated and lo == 0) or piece == 0
                n_chunks = -(-(hi - lo) // c)
                if chunk + n_chunks > C:
                    raise ValueError(f"the request needs more than {C} chunks")
                rows = np.full(n_chunks * c, F, np.int32)  # the piece's tokens, chunk after chunk
                rows[: hi - lo] = span_fresh[lo:hi]
                out["chunk_rows"][chunk : chunk + n_chunks] = rows.reshape(n_chunks, c)
                out["token_chunk_row"][span_fresh[lo:hi]] = chunk * c + np.arange(hi - lo)
                out["chunk_piece"][chunk : chunk + n_chunks] = piece
                out["chunk_first"][chunk] = True
                out["chunk_last"][chunk + n_chunks - 1] = True
                loads = summaries or not previous_fresh or (isolated and lo == 0)
                out["chunk_load"][chunk] = loads
                chunk += n_chunks
                previous_fresh = True
                piece += 1
            if span.record_from is not None:
                if record >= R:
                    raise ValueError(f"the request records more than {R} entries")
                out["record_piece"][record] = piece - 1  # the interior (isolated) or the span's last piece
                out["record_slot"][record] = span.record_slot
                out["conv_records"][record] = _tail(history, w1)
                n_rec = span.length - span.record_from
                rows = np.asarray(span.record_rows if span.record_rows is not None else np.zeros(n_rec), np.int32)
                if rows.shape != (n_rec,):
                    raise ValueError(f"span {index}: {rows.shape[0]} record rows for {n_rec} recorded tokens")
                out["fresh_dest"][fresh + span.record_from : fresh + span.length] = rows
                record += 1
            if not isolated:
                if key + span.length > P:
                    raise ValueError(f"the request needs more than {P} keys")
                ks = slice(key, key + span.length)
                out["key_fresh"][ks], out["key_index"][ks] = True, span_fresh
                out["key_positions"][ks], out["key_segment"][ks] = start + np.arange(span.length), index
                key += span.length
            fresh += span.length
        position += span.length
    if isolated:  # keys are the fresh tokens themselves, at their span-relative positions
        out["key_fresh"][:num_fresh], out["key_index"][:num_fresh] = True, np.arange(num_fresh)
        out["key_positions"][:num_fresh] = out["positions"][:num_fresh]
        out["key_segment"][:num_fresh] = out["token_segment"][:num_fresh]
        key = num_fresh
    out["piece_starts"] = np.cumsum(out["piece_starts"], dtype=np.int32)
    out["conv_final"] = np.asarray(_tail(history, w1), np.int32)
    out["last"] = np.asarray(num_fresh - 1, np.int32)
    out["num_pieces"] = np.asarray(piece, np.int32)
    out["num_chunks"] = np.asarray(chunk, np.int32)
    out["num_keys"] = np.asarray(key, np.int32)
    out["drop_transfer"] = np.asarray(not transfer)
    return LayoutArrays(**out)


@functools.lru_cache(maxsize=None)
def _fields(capacity: Capacity) -> tuple[tuple[str, tuple[int, ...], np.dtype], ...]:
    """(name, shape, dtype) of every LayoutArrays field at `capacity`, in field order (they depend on it alone)."""
    arrays = build([Span(FRESH, 1)], capacity, isolated=False, tokens=np.zeros(1, np.int32), summaries=True)
    return tuple((f.name, getattr(arrays, f.name).shape, getattr(arrays, f.name).dtype)
                 for f in dataclasses.fields(LayoutArrays))


def pack(arrays: LayoutArrays) -> np.ndarray:
    """Every field of a host layout in one int32 vector (bools as 0/1), so that a request sends its layout to the
    device as one transfer instead of one per field (a few dozen); `unpack` inside the program splits it again."""
    return np.concatenate([np.asarray(getattr(arrays, f.name)).astype(np.int32, copy=False).reshape(-1)
                           for f in dataclasses.fields(LayoutArrays)])


def packed_size(capacity: Capacity) -> int:
    """The length of `pack`'s vector at `capacity`."""
    return sum(int(np.prod(shape)) for _, shape, _ in _fields(capacity))


def unpack(packed, capacity: Capacity) -> LayoutArrays:
    """`pack`'s inverse for a layout of `capacity` (static slices: free inside a jitted program)."""
    if packed.shape != (packed_size(capacity),):
        raise ValueError(f"a packed layout of {capacity} has {packed_size(capacity)} entries, got {packed.shape}")
    out, at = {}, 0
    for name, shape, dtype in _fields(capacity):
        size = int(np.prod(shape))
        part = packed[at : at + size].reshape(shape)
        out[name] = part != 0 if dtype == np.bool_ else part
        at += size
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

