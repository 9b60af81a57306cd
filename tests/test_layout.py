"""`layout.build` against a reference copy of its first, span-by-span form: the same arrays, field by field, for
random requests (fresh and cached spans, records, snapshots, isolated and stitched, every flag, conv widths 0 to 3,
several chunk lengths), and the same errors for bad ones. The ladder's padding bound, padding that is inert across
capacities, and the masked attention's kernel against its XLA loop and the dense definition."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import LONG, examples, rel_err
from hypic_jax.stitch import layout as lay
from hypic_jax.stitch.layout import CACHED, DROP, FRESH, PAD_POSITION, PIECE_CACHED, PIECE_FRESH


def _predecessors(history: list[int], rows: np.ndarray, w1: int) -> np.ndarray:
    """[len(rows), w1]: for each new row the w1 rows before it in `history + rows` (0 = the zero row)."""
    if not w1:
        return np.zeros((len(rows), 0), np.int32)
    seq = np.concatenate([np.asarray(_tail(history, w1), np.int32), rows.astype(np.int32)])
    return seq[np.arange(len(rows))[:, None] + np.arange(w1)[None, :]]


def _tail(history: list[int], w1: int) -> list[int]:
    return ([0] * w1 + history)[-w1:] if w1 else []


def reference_build(spans: Sequence[lay.Span], capacity: lay.Capacity, *, isolated: bool, tokens: np.ndarray,
          summaries: bool, transfer: bool = True, rope: bool = True) -> lay.LayoutArrays:
    """The arrays of one request. `tokens`: the fresh tokens in span order. `summaries`: the program computes
    every fresh piece's own summary (PIC stitching, cold prefill); otherwise a fresh piece that follows another
    fresh piece continues its state instead of loading one (prefix cache, full recompute). `transfer` False drops
    cached transfers; `rope` False keeps cached keys (and RoPE'd linear states) at their canonical phase.

    `layout.build` as it was written first, one span at a time: the reference the vectorised one must match."""
    cap, c, w1 = capacity, capacity.chunk, capacity.conv
    spans = list(spans)
    num_fresh = lay.check_request(spans, tokens, cap, isolated=isolated)  # the checks are shared, the layout not
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
    return lay.LayoutArrays(**out)


def differences(a: lay.LayoutArrays, b: lay.LayoutArrays) -> list[str]:
    """The fields where two layouts differ in dtype, shape or any value."""
    out = []
    for field in dataclasses.fields(lay.LayoutArrays):
        x, y = np.asarray(getattr(a, field.name)), np.asarray(getattr(b, field.name))
        if x.dtype != y.dtype or x.shape != y.shape or not np.array_equal(x, y):
            out.append(field.name)
    return out


def outcome(fn, *args, **kwargs):
    """("ok", layout) or (exception type, message)."""
    try:
        return "ok", fn(*args, **kwargs)
    except Exception as error:  # noqa: BLE001  (any failure must be the reference's failure)
        return type(error), str(error)


def assert_same(spans, capacity, **kwargs):
    want, got = outcome(reference_build, spans, capacity, **kwargs), outcome(lay.build, spans, capacity, **kwargs)
    assert want[0] == got[0], (want, got)
    if want[0] == "ok":
        assert differences(want[1], got[1]) == []
    else:
        assert want[1] == got[1]
    return want


def rows_like(rng: np.random.Generator, n: int, kind: int):
    """n pool rows as an int32 array, an int64 array, a list, or None (all zero)."""
    rows = rng.integers(1, 5000, n)
    return [None, rows.astype(np.int32), rows, rows.tolist()][kind]


@st.composite
def requests(draw):
    """(spans, capacity, flags, fresh tokens): a random request, now and then one capacity too small for it."""
    isolated = draw(st.integers(0, 2)) == 0
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    spans = []
    for _ in range(draw(st.integers(1, 9))):
        short = draw(st.booleans())  # spans shorter than a conv window and than a chunk
        length = int(rng.integers(1, 4 if short else 40))
        if not isolated and draw(st.integers(0, 2)) == 0:
            spans.append(lay.Span(CACHED, length, canonical_start=int(rng.integers(0, 60)),
                                  slot=int(rng.integers(0, 9)), kv_rows=rows_like(rng, length, draw(st.integers(0, 3))),
                                  snapshot=draw(st.booleans())))
            continue
        record_from = draw(st.sampled_from([None, None, 0, "inside"]))
        if record_from == "inside":
            record_from = int(rng.integers(0, length))
        rows = None if record_from is None else rows_like(rng, length - record_from, draw(st.integers(0, 3)))
        spans.append(lay.Span(FRESH, length, record_from=record_from, record_slot=int(rng.integers(0, 9)),
                              record_rows=rows))
    fresh = sum(s.length for s in spans if s.kind == FRESH)
    pieces = sum(2 if (isolated and s.record_from) else 1 for s in spans)
    records = sum(s.record_from is not None for s in spans)
    keys = fresh if isolated else sum(s.length for s in spans)
    tight = draw(st.sampled_from([None] * 6 + ["tokens", "pieces", "keys", "records"]))  # one capacity one short
    slack = lambda what: -1 if what == tight else draw(st.integers(0, 4))  # noqa: E731
    tokens = max(fresh + slack("tokens"), 1)
    capacity = lay.Capacity(tokens=tokens, pieces=max(pieces + slack("pieces"), 1),
                            keys=tokens if isolated else max(keys + slack("keys"), 1),
                            records=max(records + slack("records"), 0), chunk=draw(st.sampled_from([1, 2, 3, 4, 16])),
                            conv=draw(st.integers(0, 3)))
    flags = dict(isolated=isolated, summaries=draw(st.booleans()), transfer=draw(st.booleans()),
                 rope=draw(st.booleans()))
    return spans, capacity, flags, rng.integers(0, 1000, fresh).astype(np.int32)


@LONG
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests())
def test_build_matches_the_reference(request):
    spans, capacity, flags, tokens = request
    assert_same(spans, capacity, tokens=tokens, **flags)


@examples(40)  # each new capacity compiles the transport's programs anew: fewer examples than the build's
@given(requests())
def test_the_device_transport_keeps_a_layout_whole(request):
    spans, capacity, flags, tokens = request
    if assert_same(spans, capacity, tokens=tokens, **flags)[0] == "ok":
        arrays = lay.build(spans, capacity, tokens=tokens, **flags)
        assert differences(arrays, lay.unpack(lay.pack(arrays), capacity)) == []


def test_build_matches_the_reference_on_a_stitched_rag_request():
    """The serving case: 64 cached documents of 512 tokens after 8-token seams, and a 64-token query."""
    rng = np.random.default_rng(0)
    spans = []
    for doc in range(64):
        spans.append(lay.Span(FRESH, 8))
        spans.append(lay.Span(CACHED, 504, canonical_start=8, slot=doc + 1,
                              kv_rows=rng.permutation(40000)[:504].astype(np.int32)))
    spans.append(lay.Span(FRESH, 64))
    capacity = lay.Capacity(tokens=768, pieces=130, keys=33792, records=0, chunk=16, conv=3)
    tokens = rng.integers(0, 1000, 64 * 8 + 64).astype(np.int32)
    for rope in (True, False):
        assert assert_same(spans, capacity, isolated=False, tokens=tokens, summaries=True, rope=rope)[0] == "ok"
        arrays = lay.build(spans, capacity, isolated=False, tokens=tokens, summaries=True, rope=rope)
        assert differences(arrays, lay.unpack(lay.pack(arrays), capacity)) == []
    # the per-key fields travel as one run per span: the packed vector is about a quarter of the fields' size
    assert lay.packed_size(capacity) < 0.3 * sum(np.asarray(getattr(arrays, f.name)).size
                                                 for f in dataclasses.fields(lay.LayoutArrays))


def test_build_matches_the_reference_on_a_cold_batch():
    """The cold prefill of missing documents: isolated spans, each recording its interior after a seam."""
    rng = np.random.default_rng(1)
    spans = [lay.Span(FRESH, n, record_from=w, record_slot=i + 1, record_rows=rng.integers(1, 9999, n - w))
             for i, (n, w) in enumerate([(512, 8), (300, 8), (7, 7 - 1), (40, 0)])]
    capacity = lay.Capacity(tokens=1024, pieces=10, keys=1024, records=6, chunk=16, conv=3)
    tokens = rng.integers(0, 1000, sum(s.length for s in spans)).astype(np.int32)
    assert assert_same(spans, capacity, isolated=True, tokens=tokens, summaries=True)[0] == "ok"


def test_the_comparison_sees_one_changed_entry():
    """`differences` names a field when a single entry of it changes (so the property above can fail)."""
    spans = [lay.Span(FRESH, 5, record_from=1, record_slot=2, record_rows=np.arange(4)),
             lay.Span(CACHED, 7, canonical_start=2, slot=3, kv_rows=np.arange(16, 23)), lay.Span(FRESH, 3)]
    capacity = lay.Capacity(tokens=16, pieces=6, keys=32, records=6, chunk=4, conv=3)
    base = lay.build(spans, capacity, isolated=False, tokens=np.arange(8), summaries=True)
    assert differences(base, reference_build(spans, capacity, isolated=False, tokens=np.arange(8),
                                             summaries=True)) == []
    for field in dataclasses.fields(lay.LayoutArrays):
        value = np.array(getattr(base, field.name))
        flat = value.reshape(-1)
        if not flat.size:
            continue
        flat[-1] = ~flat[-1] if value.dtype == bool else flat[-1] + 1
        assert differences(base, dataclasses.replace(base, **{field.name: value})) == [field.name]


@pytest.mark.parametrize("spans,message", [
    ([lay.Span(FRESH, 3), lay.Span(FRESH, 0)], "span 1 holds no token"),
    ([lay.Span(CACHED, 4, kv_rows=np.arange(3)), lay.Span(FRESH, 2)], "cached span 0: 3 pool rows for 4 tokens"),
    ([lay.Span(FRESH, 4, record_from=4)], r"span 0: record_from must lie in \[0, 4\), got 4"),
    ([lay.Span(FRESH, 4, record_from=1, record_rows=np.arange(2))], "span 0: 2 record rows for 3 recorded tokens"),
    ([lay.Span(FRESH, 1)] * 5, "more than 4 pieces"),
    ([lay.Span(FRESH, 2), lay.Span(CACHED, 30)], "more than 24 keys"),
    ([lay.Span(FRESH, 1, record_from=0)] * 4, "records more than 3 entries"),
    ([lay.Span(FRESH, 3)], "3 fresh tokens over the capacity of 2"),
])
def test_bad_spans_raise_the_reference_errors(spans, message):
    capacity = lay.Capacity(tokens=8 if "capacity of 2" not in message else 2, pieces=4, keys=24, records=3,
                            chunk=4, conv=3)
    tokens = np.zeros(sum(s.length for s in spans if s.kind == FRESH), np.int32)
    with pytest.raises(ValueError, match=message):
        lay.build(spans, capacity, isolated=False, tokens=tokens, summaries=True)
    assert assert_same(spans, capacity, isolated=False, tokens=tokens, summaries=True)[0] is ValueError


def test_a_span_of_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="span 1: kind must be 'fresh' or 'cached'"):
        lay.build([lay.Span(FRESH, 2), lay.Span("stale", 3)], lay.Capacity(8, 4, 24, 3, 4, 3), isolated=False,
                  tokens=np.zeros(2, np.int32), summaries=True)


def test_padding_is_inert_across_capacities():
    """One layout built into two capacities gives the same arrays where the smaller one has them."""
    spans = [lay.Span(lay.FRESH, 5), lay.Span(lay.CACHED, 7, canonical_start=2, slot=3, kv_rows=np.arange(16, 23)),
             lay.Span(lay.FRESH, 3)]
    small = lay.Capacity(tokens=16, pieces=6, keys=32, records=6, chunk=4, conv=3)
    large = lay.Capacity(tokens=64, pieces=10, keys=96, records=10, chunk=4, conv=3)
    a = lay.build(spans, small, isolated=False, tokens=np.arange(8), summaries=True)
    b = lay.build(spans, large, isolated=False, tokens=np.arange(8), summaries=True)
    assert int(a.num_pieces) == int(b.num_pieces) == 3 and int(a.num_keys) == int(b.num_keys) == 15
    np.testing.assert_array_equal(a.key_positions[:15], b.key_positions[:15])
    np.testing.assert_array_equal(a.key_offset[:15], np.r_[np.zeros(5), np.full(7, 3), np.zeros(3)])
    assert a.piece_slot[1] == 3 and a.piece_kind.tolist()[:4] == [lay.PIECE_FRESH, lay.PIECE_CACHED, lay.PIECE_FRESH,
                                                                   lay.PIECE_PAD]
    # the kernels' segment offsets: fresh pieces of 5 and 3 tokens, the cached piece and the padding hold none
    assert a.piece_starts.tolist() == [0, 5, 5, 8, 8, 8, 8] and b.piece_starts.tolist()[:4] == [0, 5, 5, 8]
    isolated = lay.build([lay.Span(lay.FRESH, 9, record_from=4, record_slot=1), lay.Span(lay.FRESH, 2)], small,
                         isolated=True, tokens=np.arange(11), summaries=True)
    assert isolated.piece_starts.tolist() == [0, 4, 9, 11, 11, 11, 11]  # a recorded span is a seam and its interior
    # conv predecessors of the first token after the cached span: its stored tail (table rows after F)
    tail = [1 + small.tokens + 1 * 3 + j for j in range(3)]
    assert a.conv_rows[5].tolist() == tail
    with pytest.raises(ValueError, match="capacity"):
        lay.build([lay.Span(lay.FRESH, 17)], small, isolated=False, tokens=np.arange(17), summaries=False)
    # one packed int32 vector per request (`layout.pack`) unpacks to the same fields, dtypes and shapes
    for arrays, cap in ((a, small), (b, large)):
        packed = lay.pack(arrays)
        assert packed.dtype == np.int32 and packed.shape == (lay.packed_size(cap),)
        back = jax.jit(lay.unpack, static_argnums=1)(packed, cap)
        for field in dataclasses.fields(lay.LayoutArrays):
            want, got = np.asarray(getattr(arrays, field.name)), np.asarray(getattr(back, field.name))
            assert got.dtype == want.dtype and got.shape == want.shape, field.name
            np.testing.assert_array_equal(got, want, err_msg=field.name)
    with pytest.raises(ValueError, match="packed layout"):
        lay.unpack(lay.pack(a), large)



@pytest.mark.parametrize("floor,ceiling,fine_from", [(64, 65536, 1024), (50, 5000, 1024), (16, 3000, 256),
                                                     (64, 100, 1024), (1, 1, 1024), (64, 40000, 1 << 20)])
def test_ladder_padding_bound(floor, ceiling, fine_from):
    """Every request size from 1 to the ceiling fits a rung; the padding stays under 1.25x from `fine_from` on
    (1.5x below it), and the rungs are increasing from the floor."""
    ladder = lay.Ladder(max_tokens=ceiling, max_pieces=4, min_tokens=floor, fine_from=fine_from)
    rungs = np.asarray(ladder.rungs)
    assert rungs[0] == floor and np.all(np.diff(rungs) > 0) and rungs[-1] >= ceiling
    sizes = np.arange(1, ceiling + 1)
    fitted = rungs[np.searchsorted(rungs, sizes)]
    sample = sizes[:: max(1, ceiling // 300)]
    assert [ladder.rung(int(n)) for n in sample] == fitted[:: max(1, ceiling // 300)].tolist()
    above = sizes > max(floor, fine_from)
    assert np.all(fitted[above] <= 1.25 * sizes[above])
    below = (sizes > floor) & ~above
    assert np.all(fitted[below] <= 1.5 * sizes[below])
    with pytest.raises(ValueError, match="largest compiled capacity"):
        ladder.rung(int(rungs[-1]) + 1)

@pytest.mark.parametrize("isolated", [True, False])
def test_masked_attention_kernel_matches_the_xla_loop(isolated):
    """The Pallas flash kernel (interpret mode) and the XLA loop read the same mask from a layout: packed isolated
    spans (each query sees only its span) or stitched spans with cached keys and padding."""
    import jax.numpy as jnp

    from hypic_jax import stitch

    rng = np.random.default_rng(int(isolated))
    if isolated:
        spans = [lay.Span(lay.FRESH, n) for n in (7, 33, 1, 20)]
    else:
        spans = [lay.Span(lay.FRESH, 5), lay.Span(lay.CACHED, 40, canonical_start=3, slot=1,
                                                   kv_rows=np.arange(16, 56)), lay.Span(lay.FRESH, 9)]
    fresh = sum(s.length for s in spans if s.kind == lay.FRESH)
    cap = lay.Capacity(tokens=96, pieces=8, keys=96 if isolated else 128, records=8, chunk=16, conv=3)
    arrays = lay.build(spans, cap, isolated=isolated, tokens=np.zeros(fresh, np.int32), summaries=True)
    q = jnp.asarray(rng.standard_normal((cap.tokens, 4, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((cap.keys, 2, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((cap.keys, 2, 16)), jnp.float32)
    xla = stitch.masked_attention(q, k, v, arrays, isolated=isolated, scale=0.25, block_q=16, block_k=32,
                                  use_kernel=False)
    kernel = stitch.masked_attention(q, k, v, arrays, isolated=isolated, scale=0.25, use_kernel=True)
    valid = np.asarray(arrays.valid)
    assert rel_err(np.asarray(kernel)[valid], np.asarray(xla)[valid]) < 1e-5
    # and against the dense definition, query by query
    pos, seg = np.asarray(arrays.positions), np.asarray(arrays.token_segment)
    kpos, kseg = np.asarray(arrays.key_positions), np.asarray(arrays.key_segment)
    for i in np.flatnonzero(valid)[::7]:
        vis = (kpos <= pos[i]) & (np.arange(cap.keys) < int(arrays.num_keys)) & ((kseg == seg[i]) if isolated else True)
        logits = np.einsum("hgd,khd->hgk", np.asarray(q[i]).reshape(2, 2, 16), np.asarray(k)) * 0.25
        logits = np.where(vis, logits, -np.inf)
        w = np.exp(logits - logits.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        want = np.einsum("hgk,khd->hgd", w, np.asarray(v)).reshape(4, 16)
        np.testing.assert_allclose(np.asarray(xla[i]), want, rtol=1e-4, atol=1e-5)
