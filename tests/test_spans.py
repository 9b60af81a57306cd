"""Property tests of hypic_jax.spans against the core: any span layout of a sequence gives the whole sequence's
results (conv, linear core, attention), whether its spans are fresh or cached from their own summaries."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hypic_jax import linear_attn as la
from hypic_jax import rope, spans
from hypic_jax.conv import causal_conv1d
from families import array, examples, make_family, method, slice_inputs

# Every new layout is a new compilation (layouts are static), so the linear-core properties run few examples each;
# together they still cover identity-free scalar, diagonal and dense transfers and every span arrangement kind.
SETTINGS = examples(4)
FEW = examples(3)
CHUNK = 8


@st.composite
def span_plans(draw, max_spans: int = 5, max_len: int = 13, allow_cached: bool = True):
    """[(kind, length)] with the last span fresh (a request always ends with its fresh query)."""
    count = draw(st.integers(1, max_spans))
    lengths = [draw(st.integers(1, max_len)) for _ in range(count)]
    kinds = [draw(st.sampled_from([spans.FRESH, spans.CACHED])) if allow_cached else spans.FRESH for _ in lengths]
    kinds[-1] = spans.FRESH
    return list(zip(kinds, lengths))


def _layout(plan, merge=False):
    pieces = [dict(kind=kind, length=n, canonical_start=0) for kind, n in plan]  # entries computed from position 0
    return spans.SpanLayout.build(pieces, merge_fresh=merge)


def _fresh_index(layout) -> np.ndarray:
    return np.concatenate([s.start + np.arange(s.length) for s in layout.fresh])


def _take(tree, index):
    """Rows `index` of every array of a pytree (the layout's fresh tokens), gathered on the host (`array`): a
    gather on the device compiles a program for every new index length a property test draws."""
    return jax.tree.map(lambda a: array(np.asarray(a)[index]), tree)


# The reference causal conv, one compiled program per shape (run op by op, it compiles every op anew for every
# shape a property test draws).
_causal_conv = jax.jit(causal_conv1d)


@given(span_plans(), st.integers(1, 4), st.integers(0, 2**31 - 1))
@SETTINGS
def test_conv_over_spans_equals_conv_over_the_concatenation(plan, width, seed):
    rng = np.random.default_rng(seed)
    layout = _layout(plan)
    total, dim = layout.total_length, 3
    x = rng.standard_normal((total, dim)).astype(np.float32)
    weight = array(rng.standard_normal((dim, width)), np.float32)
    whole, final = _causal_conv(array(x), weight)
    padded = np.concatenate([np.zeros((width - 1, dim), np.float32), x])
    tails = [array(padded[s.start + s.length : s.start + s.length + width - 1]) for s in layout.cached]  # true tails
    fresh = array(x[_fresh_index(layout)])
    y, tail, _ = spans.conv_over_spans(fresh, weight, tails, layout)
    np.testing.assert_allclose(np.asarray(y), np.asarray(whole)[_fresh_index(layout)], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(tail), np.asarray(final), rtol=1e-6, atol=1e-6)


@functools.partial(jax.jit, static_argnames=("layout", "mode", "rotary"))
def _linear(inputs, cached, *, layout, mode=spans.SpanMode(), rotary=None):
    turn = None if rotary is None else (lambda summary, offset: la.rotate_summary(summary, offset, rotary_dim=rotary))
    return spans.linear_over_spans(inputs, cached, layout, mode, chunk_size=CHUNK, rotate=turn)


FAMILIES = ("lightning", "gla", "gated_delta_net", "kda")


@pytest.mark.parametrize("family", ("gated_delta_net",))
@given(plan=span_plans(allow_cached=False))
@FEW
def test_linear_over_all_fresh_spans_equals_chunked_over_the_whole(family, plan):
    layout = _layout(plan)
    inputs = make_family(family, seed=len(plan), length=layout.total_length, heads=2, key_dim=4, value_dim=3)
    out, state = method.chunked(inputs, chunk_size=CHUNK)
    got, got_state, _ = _linear(inputs, (), layout=layout)
    np.testing.assert_allclose(np.asarray(got), np.asarray(out), rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(np.asarray(got_state), np.asarray(state), rtol=2e-4, atol=2e-5)


def _check_cached_spans_equal_the_whole(family, plan, seed, mode=spans.SpanMode()):
    """Cached spans served from their own summaries (computed from position 0 with zero state), fresh spans
    computed: the layout's outputs and final state equal the whole sequence's."""
    layout = _layout(plan)
    inputs = make_family(family, seed=seed, length=layout.total_length, heads=2, key_dim=4, value_dim=3)
    out, state = method.chunked(inputs, chunk_size=CHUNK)
    cut = lambda s: slice_inputs(inputs, s.start, s.start + s.length)  # noqa: E731
    cached = tuple(method.summarize(cut(s), chunk_size=CHUNK) for s in layout.cached)
    fresh = _take(inputs, _fresh_index(layout))
    got, got_state, _ = _linear(fresh, cached, layout=layout, mode=mode)
    np.testing.assert_allclose(np.asarray(got), np.asarray(out)[_fresh_index(layout)], rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(np.asarray(got_state), np.asarray(state), rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("family", FAMILIES)
@given(plan=span_plans())
@FEW
def test_cached_spans_from_their_summaries_equal_the_whole(family, plan):
    _check_cached_spans_equal_the_whole(family, plan, seed=len(plan) + 7)


@pytest.mark.parametrize("prefix", ("fold", "pallas"))
@pytest.mark.parametrize("family", ("gated_delta_net", "kda"))
@given(plan=span_plans(max_spans=6))
@FEW
def test_prefix_over_span_groups_by_fold_equals_the_whole(family, prefix, plan):
    """The sequential fold (XLA, and the Pallas kernel in interpret mode, blocked or not) over the groups of a
    layout (dense transfers: the only form the fold handles itself)."""
    block = 2 if len(plan) > 4 else None
    _check_cached_spans_equal_the_whole(family, plan, seed=len(plan) + 11,
                                        mode=spans.SpanMode(prefix=prefix, prefix_block=block))


@pytest.mark.parametrize("prefix", ("associative", "pallas"))
def test_groups_of_unequal_size_compose_in_place(prefix):
    """A leading cached span (a group without a fresh span), groups of one, two and three members: the in-place
    composition of the groups that have a p-th member (`_splice`) keeps every other group's pair."""
    plan = [(spans.CACHED, 5), (spans.FRESH, 3), (spans.CACHED, 4), (spans.CACHED, 6), (spans.FRESH, 2),
            (spans.FRESH, 7), (spans.CACHED, 3), (spans.FRESH, 4)]
    _check_cached_spans_equal_the_whole("gated_delta_net", plan, seed=5, mode=spans.SpanMode(prefix=prefix))


@pytest.mark.parametrize("family, folds", [("gated_delta_net", True), ("kda", True), ("gla", False)])
def test_seams_before_cached_interiors_enter_the_fold_as_chunk_steps(family, folds, monkeypatch):
    """The PIC request's layout (short fresh seams, each followed by a cached interior, then the query) on the
    Pallas path folds the seams in as chunk steps (`span_fold_pallas`, dense transfers only) and still gives the
    whole sequence's outputs and state."""
    from hypic_jax.pallas import compose

    calls = []
    original = compose.span_fold_pallas
    monkeypatch.setattr(compose, "span_fold_pallas",
                        lambda *a, **k: calls.append(k.get("q_decayed") is not None) or original(*a, **k))
    # the query pads to the seams' length: the fold hands back incoming states and the seams' outputs come after it
    plan = [(spans.FRESH, 3), (spans.CACHED, 6), (spans.FRESH, 5), (spans.CACHED, 4), (spans.FRESH, 2),
            (spans.CACHED, 9), (spans.FRESH, 4)]
    _check_cached_spans_equal_the_whole(family, plan, seed=3, mode=spans.SpanMode(prefix="pallas"))
    assert calls == ([False] if folds else [])
    # a longer query: the seams are a length group of their own and the fold computes their outputs itself
    calls.clear()
    plan = plan[:-1] + [(spans.FRESH, 11)]
    _check_cached_spans_equal_the_whole(family, plan, seed=4, mode=spans.SpanMode(prefix="pallas"))
    assert calls == ([True] if folds else [])


def test_rows_takes_runs_and_zero_rows():
    x = jnp.arange(6.0)[:, None] + 1
    for rows in ([0, 1, 2, 3, 4, 5], [2, 3, -1, 0], [-1, -1], [5, 4, 3, 2, 1, 0, 1, 2, 3, 4, 5, -1, 0]):
        want = np.asarray([[0.0] if r == -1 else [r + 1.0] for r in rows])
        np.testing.assert_array_equal(np.asarray(spans._rows(x, rows)), want)


@given(plan=span_plans(max_spans=4))
@FEW
def test_rope_linear_summaries_rotate_to_their_absolute_positions(plan):
    """Lightning with RoPE'd keys: summaries computed at canonical position 0 and rotated equal the whole."""
    layout = _layout(plan)
    total, rotary = layout.total_length, 4
    base = make_family("lightning", seed=3, length=total, heads=2, key_dim=6, value_dim=3)
    whole = _roped_from_zero(base, rotary)
    out, state = method.chunked(whole, chunk_size=CHUNK)
    cached = []
    for s in layout.cached:  # the entry was computed in isolation, positions 0..n-1
        piece = _roped_from_zero(slice_inputs(base, s.start, s.start + s.length), rotary)
        cached.append(method.summarize(piece, chunk_size=CHUNK))
    fresh = _take(whole, _fresh_index(layout))
    got, got_state, _ = _linear(fresh, tuple(cached), layout=layout, rotary=rotary)
    np.testing.assert_allclose(np.asarray(got), np.asarray(out)[_fresh_index(layout)], rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(np.asarray(got_state), np.asarray(state), rtol=2e-4, atol=2e-5)


def dataclass_replace(inputs, **changes):
    import dataclasses

    return dataclasses.replace(inputs, **changes)


@functools.partial(jax.jit, static_argnames="rotary")
def _roped_from_zero(inputs, rotary):
    """The inputs with q and k RoPE'd at positions 0..n-1."""
    positions = np.arange(inputs.k.shape[0])
    rotate = lambda x: rope.apply_rope(x, positions, rotary_dim=rotary)  # noqa: E731
    return dataclass_replace(inputs, q=rotate(inputs.q), k=rotate(inputs.k))


@functools.partial(jax.jit, static_argnames="rotary")
def _causal_attention(q, k_raw, v, rotary):
    """q and k RoPE'd at their positions, and causal attention over the whole sequence."""
    positions = np.arange(q.shape[0])
    q_rot = rope.apply_rope(q, positions, rotary_dim=rotary)
    k_rot = rope.apply_rope(k_raw, positions, rotary_dim=rotary)
    return q_rot, k_rot, jax.nn.dot_product_attention(q_rot[None], k_rot[None], v[None], scale=0.3, is_causal=True)[0]


@functools.partial(jax.jit, static_argnames="rotary")
def _roped_keys(k, rotary):
    """Keys RoPE'd at positions 0..n-1 (an entry computed in isolation)."""
    return rope.apply_rope(k, np.arange(k.shape[0]), rotary_dim=rotary)


@given(span_plans(), st.integers(0, 2**31 - 1))
@FEW
def test_attention_over_spans_equals_causal_attention(plan, seed):
    """Cached K stored at canonical positions and re-rotated == causal attention over the whole sequence."""
    rng = np.random.default_rng(seed)
    layout = _layout(plan)
    total, rotary = layout.total_length, 4
    q = rng.standard_normal((total, 4, 8)).astype(np.float32)
    k_raw = rng.standard_normal((total, 2, 8)).astype(np.float32)
    v = rng.standard_normal((total, 2, 8)).astype(np.float32)
    q_rot, k_rot, expected = map(np.asarray, _causal_attention(array(q), array(k_raw), array(v), rotary))
    cached = [(_roped_keys(array(k_raw[s.start : s.start + s.length]), rotary), array(v[s.start : s.start + s.length]))
              for s in layout.cached]
    idx = _fresh_index(layout)
    attend = jax.jit(lambda q, k, v, cached: spans.attention_over_spans(
        q, k, v, cached, layout, scale=0.3, rotate_keys=lambda x, offset: rope.rotate_keys(x, offset, rotary_dim=rotary)))
    out, keys, _, _ = attend(array(q_rot[idx]), array(k_rot[idx]), array(v[idx]), cached)
    np.testing.assert_allclose(np.asarray(out), expected[idx], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(keys), np.asarray(k_rot), rtol=1e-4, atol=1e-5)


def test_isolated_layout_runs_every_span_from_scratch():
    """Packed isolated spans == each span run alone (conv, linear, attention), and records cover [record_from, n)."""
    rng = np.random.default_rng(0)
    lengths, record_from = (5, 9, 3), (0, 2, 1)
    layout = spans.SpanLayout.build(
        [dict(kind=spans.FRESH, length=n, record_from=w) for n, w in zip(lengths, record_from)], isolated=True
    )
    total = sum(lengths)
    x = rng.standard_normal((total, 3)).astype(np.float32)
    weight = array(rng.standard_normal((3, 4)), np.float32)
    inputs = make_family("gated_delta_net", seed=1, length=total, heads=2, key_dim=4, value_dim=3)
    q = rng.standard_normal((total, 2, 4)).astype(np.float32)

    @jax.jit
    def run(x, inputs, q):
        conv = spans.conv_over_spans(x, weight, [], layout)
        linear = spans.linear_over_spans(inputs, [], layout, chunk_size=CHUNK)
        return conv, linear, spans.attention_over_spans(q, q, q, [], layout, scale=0.5)

    (y, _, tails), (out, _, summaries), (att, _, _, kv) = run(array(x), inputs, array(q))
    y, out, att = np.asarray(y), np.asarray(out), np.asarray(att)
    self_attention = jax.jit(lambda q: jax.nn.dot_product_attention(q[None], q[None], q[None], scale=0.5,
                                                                    is_causal=True)[0])
    start = 0
    for n, w, tail, summary, (rk, _) in zip(lengths, record_from, tails, summaries, kv):
        piece = slice(start, start + n)
        ref_y, ref_tail = _causal_conv(array(x[piece]), weight)
        np.testing.assert_allclose(y[piece], np.asarray(ref_y), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(tail), np.asarray(ref_tail), rtol=1e-6, atol=1e-6)
        alone = slice_inputs(inputs, start, start + n)
        np.testing.assert_allclose(out[piece], np.asarray(method.chunked(alone, chunk_size=CHUNK)[0]),
                                   rtol=2e-4, atol=2e-5)
        interior = method.summarize(slice_inputs(inputs, start + w, start + n), chunk_size=CHUNK)
        np.testing.assert_allclose(np.asarray(summary.transfer), np.asarray(interior.transfer), rtol=2e-4, atol=2e-5)
        ref_att = self_attention(array(q[piece]))
        np.testing.assert_allclose(att[piece], np.asarray(ref_att), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(rk), q[start + w : start + n])
        start += n


def test_addition_mode_drops_the_transfer():
    """addition composes cached states as plain sums: the result equals summing zero-start states."""
    inputs = make_family("gated_delta_net", seed=2, length=20, heads=2, key_dim=4, value_dim=3)
    layout = spans.SpanLayout.build([dict(kind=spans.CACHED, length=8), dict(kind=spans.CACHED, length=7),
                                     dict(kind=spans.FRESH, length=5)])
    pieces = [slice_inputs(inputs, s.start, s.start + s.length) for s in layout.spans]
    cached = tuple(method.summarize(p, chunk_size=CHUNK) for p in pieces[:2])
    _, state, _ = spans.linear_over_spans(pieces[2], cached, layout, spans.MODES["addition"], chunk_size=CHUNK)
    expected = method.chunked(pieces[2], initial_state=cached[0].state + cached[1].state, chunk_size=CHUNK)[1]
    np.testing.assert_allclose(np.asarray(state), np.asarray(expected), rtol=1e-5, atol=1e-6)


def test_layout_validation():
    with pytest.raises(ValueError, match="at least one token"):
        spans.SpanLayout.build([dict(kind=spans.FRESH, length=0)])
    with pytest.raises(ValueError, match="fresh spans only"):
        spans.SpanLayout.build([dict(kind=spans.CACHED, length=3)], isolated=True)
    merged = spans.SpanLayout.build([dict(kind=spans.FRESH, length=3), dict(kind=spans.FRESH, length=4)])
    assert len(merged.spans) == 1 and merged.num_fresh_tokens == 7


@examples(8)
@given(lengths=st.lists(st.integers(1, 9), min_size=1, max_size=5), block=st.integers(1, 8),
       isolated=st.booleans(), seed=st.integers(0, 2**16))
def test_span_attention_blocks_equal_one_dense_masked_attention(lengths, block, isolated, seed):
    """Query blocks see only the keys they can reach (own segments, causal horizon): the result must equal one
    dense masked softmax over all keys, whatever the block size and however the blocks cut the segments."""
    rng = np.random.default_rng(seed)
    n = sum(lengths)
    seg = np.concatenate([np.full(m, i) for i, m in enumerate(lengths)]).astype(np.int32)
    pos = np.concatenate([np.arange(m) for m in lengths]) if isolated else np.arange(n)
    pos = pos.astype(np.int32)
    q = rng.standard_normal((n, 4, 8)).astype(np.float32)
    k = rng.standard_normal((n, 2, 8)).astype(np.float32)
    v = rng.standard_normal((n, 2, 8)).astype(np.float32)
    segments = dict(q_segments=seg, k_segments=seg) if isolated else {}
    attend = jax.jit(lambda q, k, v: spans.span_attention(q, k, v, scale=0.3, q_positions=pos, k_positions=pos,
                                                          block=block, **segments))  # one compile, not one per op
    out = attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    visible = pos[None, :] <= pos[:, None]
    if isolated:
        visible &= seg[None, :] == seg[:, None]
    kk, vv = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)  # GQA: query head h reads kv head h // 2
    logits = np.einsum("qhd,khd->hqk", q.astype(np.float64), kk) * 0.3
    logits = np.where(visible[None], logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ref = np.einsum("hqk,khd->qhd", probs, vv)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)
