"""The transfer-operator core against independent references, for every family."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from helpers import (EXPECTED_FORM, FAMILIES, array, core, examples, make_family, method, numpy_recurrence, rel_err,
                      slice_inputs)
from hypic_jax.core import linear_attn as la

SETTINGS = examples(5)
TOL = 1e-5

# Shapes come from small sets so that jitted executables are reused across examples (compilation, not arithmetic,
# is what a CPU test of this code spends its time on); lengths still cover 1, chunk-aligned and ragged cases.
shapes = st.fixed_dictionaries(
    dict(
        seed=st.integers(0, 2**16),
        length=st.sampled_from([1, 2, 7, 16, 33, 64, 70]),
        heads=st.sampled_from([1, 2, 3]),
        key_dim=st.sampled_from([4, 8]),
        value_dim=st.sampled_from([1, 3, 5]),
        chunk_size=st.sampled_from([1, 3, 8, 64]),
    )
)


def transfer_err(actual, expected) -> float:
    """Error of a transfer operator on the scale of the identity it starts from.

    Every A_t is a contraction, so T_C = A_|C| ... A_1 has operator norm <= 1 and can be far smaller (a delta rule
    over more keys than dimensions projects most of the space away). The chunked form obtains T as a difference of
    O(1) terms (decay minus the WY correction), so its absolute error is float32 rounding on the scale of I, and
    that, not ||T||, is what an error in T S0 is proportional to.
    """
    expected = np.asarray(expected)
    return rel_err(actual, expected, floor=np.sqrt(expected.size / expected.shape[-1]))  # ||I|| over the head axes


@functools.lru_cache(maxsize=None)
def _split_program(chunk_size: int, split: int):
    """Everything the split-composition property computes for one example, as one compiled program: the whole
    sequence by `recurrent` and `chunked`, its first `split` tokens' state, the rest's summary, that summary advanced
    from the first part's state (zeros when there is no first part and no initial state) and the rest's outputs
    from there. (One program per example instead of seven: compiling, not running, is what an example costs.)"""

    def run(inputs, init):
        length, heads, key_dim = inputs.k.shape
        first = jax.tree.map(lambda x: x[:split], inputs)
        second = jax.tree.map(lambda x: x[split:], inputs)
        recurrent = inputs.recurrent(init)
        chunked = inputs.chunked(init, chunk_size=chunk_size)
        _, state_first = first.chunked(init, chunk_size=chunk_size)
        summary = second.summarize(chunk_size=chunk_size)
        if init is None and split == 0:
            state_first = jnp.zeros((heads, key_dim, inputs.v.shape[-1]), jnp.float32)
        advanced = la.advance(summary, state_first)
        out_second = second.chunked(state_first, chunk_size=chunk_size)[0] if split < length else None
        return recurrent, chunked, summary, advanced, out_second

    return jax.jit(run)


@functools.lru_cache(maxsize=None)
def _compose_program(bounds: tuple, chunk_size: int):
    """The associativity property's summaries of three consecutive pieces, both bracketings of their composition
    and the whole sequence's summary, with the dense transfers of the three results, as one compiled program."""

    def run(inputs):
        pieces = [jax.tree.map(lambda x: x[lo:hi], inputs) for lo, hi in zip(bounds, bounds[1:])]
        a, b, c = (piece.summarize(chunk_size=chunk_size) for piece in pieces)
        left, right = la.compose(la.compose(a, b), c), la.compose(a, la.compose(b, c))
        whole = inputs.summarize(chunk_size=chunk_size)
        return left, right, whole, [la.dense_transfer(x) for x in (left, right, whole)]

    return jax.jit(run)


def _family(name, s):
    return make_family(name, s["seed"], s["length"], s["heads"], s["key_dim"], s["value_dim"])


def _random_state(seed, heads, key_dim, value_dim):
    return array(np.random.default_rng(seed + 1).standard_normal((heads, key_dim, value_dim)), np.float32)


@pytest.mark.parametrize("family", FAMILIES)
@SETTINGS
@given(s=shapes, with_state=st.booleans(), data=st.data())
def test_chunked_recurrent_and_split_composition(family, s, with_state, data):
    """chunked == recurrent == float64 NumPy loop; advance(summarize(C2), state after C1) == state after C1 C2,
    and C2's outputs from that state match the whole sequence's."""
    inputs = _family(family, s)
    cs = s["chunk_size"]
    init = _random_state(s["seed"], s["heads"], s["key_dim"], s["value_dim"]) if with_state else None
    split = data.draw(st.sampled_from(sorted({0, 1, s["length"] // 2, s["length"] - 1, s["length"]})), label="split")
    (out_rec, state_rec), (out_chk, state_chk), summary, advanced, out_second = _split_program(cs, split)(inputs, init)
    out_ref, state_ref, sizes = numpy_recurrence(inputs, init, magnitude=True)
    # outputs on the scale of the terms they sum: one or two output rows can be a cancellation, whose own relative
    # error in float32 says nothing about the recurrence (the state, which sums nothing away, keeps its own scale)
    out_scale = np.linalg.norm(sizes)
    assert inputs.form == EXPECTED_FORM[family]
    assert rel_err(out_rec, out_ref, floor=out_scale) <= TOL and rel_err(state_rec, state_ref) <= TOL
    assert rel_err(out_chk, out_ref, floor=out_scale) <= TOL and rel_err(state_chk, state_ref) <= TOL
    assert state_chk.dtype == jnp.float32

    # the state after the first `split` tokens advanced through the rest's summary
    assert summary.form == EXPECTED_FORM[family]
    assert rel_err(advanced, state_ref) <= TOL
    if split < s["length"]:
        assert rel_err(out_second, out_ref[split:], floor=np.linalg.norm(sizes[split:])) <= TOL


@pytest.mark.parametrize("family", FAMILIES)
@SETTINGS
@given(s=shapes, data=st.data())
def test_compose_is_associative_and_matches_whole(family, s, data):
    cut_points = sorted({0, 1, s["length"] // 3, s["length"] // 2, s["length"]})
    cuts = sorted(data.draw(st.lists(st.sampled_from(cut_points), min_size=2, max_size=2), label="cuts"))
    inputs = _family(family, s)
    bounds = (0, *cuts, s["length"])
    left, right, whole, (left_t, right_t, whole_t) = _compose_program(bounds, s["chunk_size"])(inputs)
    assert left.form == right.form == whole.form
    assert transfer_err(left_t, right_t) <= TOL
    assert rel_err(left.state, right.state) <= TOL
    assert transfer_err(left_t, whole_t) <= TOL
    assert rel_err(left.state, whole.state) <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_states_equal_sequential_loop(family):
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 20, size=7).tolist()
    inputs = make_family(family, 11, sum(lengths), 2, 4, 3)
    bounds = np.cumsum([0] + lengths)
    summaries = [method.summarize(slice_inputs(inputs, lo, hi), chunk_size=8) for lo, hi in zip(bounds, bounds[1:])]
    init = _random_state(0, 2, 4, 3)
    states = core.prefix_states(core.stack_summaries(summaries), init)
    expected, state = [], init
    for summary in summaries:
        state = core.advance(summary, state)
        expected.append(state)
    assert states.shape == (len(lengths), 2, 4, 3)
    assert rel_err(states, np.stack(expected)) <= TOL
    _, final = method.recurrent(inputs, init)
    assert rel_err(states[-1], final) <= TOL


@pytest.mark.parametrize("algorithm", ["f32", "bf16x3"])
def test_prefix_states_with_a_tensor_core_algorithm_stay_float32_accurate(algorithm):
    """The engine composes with bf16x3 on a GPU: three bfloat16 passes must keep the states at float32 level
    (on the CPU the preset computes in float32, so this checks the plumbing and the broadcasting of batch axes)."""
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 20, size=9).tolist()
    inputs = make_family("gated_delta_net", 12, sum(lengths), 2, 8, 4)
    bounds = np.cumsum([0] + lengths)
    summaries = [method.summarize(slice_inputs(inputs, lo, hi), chunk_size=8) for lo, hi in zip(bounds, bounds[1:])]
    init = _random_state(1, 2, 8, 4)
    states = core.prefix_states(core.stack_summaries(summaries), init, algorithm=algorithm)
    _, final = method.recurrent(inputs, init)
    assert rel_err(states[-1], final) <= 1e-5
    # batch axes that differ only by broadcasting, and a non-square right operand ([K, K] times [K, N])
    a = jax.random.normal(jax.random.PRNGKey(2), (1, 3, 8, 8))
    b = jax.random.normal(jax.random.PRNGKey(3), (4, 1, 8, 5))
    expected = np.einsum("...kj,...jn->...kn", np.asarray(a, np.float64), np.asarray(b, np.float64))
    assert rel_err(core.dense_product(a, b, algorithm), expected) <= 1e-5


def test_compose_mixes_forms_exactly():
    """A scalar-decay segment followed by a dense one (and the reverse) composes through promotion."""
    scalar = method.summarize(make_family("retnet", 1, 9, 2, 4, 3))
    dense = method.summarize(make_family("gated_delta_net", 2, 7, 2, 4, 3))
    diag = method.summarize(make_family("gla", 3, 5, 2, 4, 3))
    init = _random_state(5, 2, 4, 3)
    for first, second in [(scalar, dense), (dense, scalar), (diag, scalar), (scalar, diag)]:
        combined = core.compose(first, second)
        assert rel_err(core.advance(combined, init), core.advance(second, core.advance(first, init))) <= TOL
    assert core.compose(scalar, diag).form == "diagonal" and core.compose(diag, dense).form == "dense"


@pytest.mark.parametrize("family", FAMILIES)
def test_jit_and_vmap(family):
    batch, length, heads, kd, vd = 3, 24, 2, 4, 3
    seqs = [make_family(family, 20 + i, length, heads, kd, vd) for i in range(batch)]
    stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *seqs)
    run = jax.jit(jax.vmap(lambda inp: inp.chunked(chunk_size=8)))
    out, state = run(stacked)
    for i, seq in enumerate(seqs):
        out_i, state_i = method.recurrent(seq)
        assert rel_err(out[i], out_i) <= TOL and rel_err(state[i], state_i) <= TOL
    # vmapped over equal-length segments of one sequence, then a jitted prefix scan
    segments = jax.tree_util.tree_map(lambda x: x.reshape((4, length // 4) + x.shape[1:]), seqs[0])
    summaries = jax.jit(jax.vmap(lambda seg: seg.summarize(chunk_size=4)))(segments)
    states = jax.jit(la.prefix_states)(summaries, None)
    assert rel_err(states[-1], method.recurrent(seqs[0])[1]) <= TOL


@pytest.mark.parametrize("family", ["retnet", "gla", "gated_delta_net", "kda"])
def test_grad_flows_through_compose_and_advance(family):
    inputs = make_family(family, 7, 12, 2, 4, 3)
    first, second = method.summarize(slice_inputs(inputs, 0, 5)), method.summarize(slice_inputs(inputs, 5, 12))
    init = _random_state(2, 2, 4, 3)
    weights = jax.random.normal(jax.random.PRNGKey(9), init.shape)

    def loss(state, first, second):
        return jnp.sum(weights * la.advance(la.compose(first, second), state))

    d_state, d_first, d_second = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(init, first, second)
    transfer = core.dense_transfer(core.compose(first, second))
    # d/dS0 sum(W * (T S0 + S)) = T^T W
    assert rel_err(d_state, jnp.einsum("hkj,hkv->hjv", transfer, weights)) <= TOL
    # d/dS(second) = W exactly, and S(first) enters through T(second)
    assert rel_err(d_second.state, weights) <= TOL
    assert rel_err(d_first.state, jnp.einsum("hkj,hkv->hjv", core.dense_transfer(second), weights)) <= TOL
    assert d_first.transfer is not None and bool(jnp.all(jnp.isfinite(d_first.transfer)))
    # and through the chunked pass into the gates
    grad_v = jax.jit(jax.grad(lambda v: jnp.sum(la.summarize(inputs.k, v, **inputs.gates()).state)))(inputs.v)
    assert bool(jnp.all(jnp.isfinite(grad_v))) and float(jnp.abs(grad_v).sum()) > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_naive_addition_is_wrong_except_for_plain_linear(family):
    inputs = make_family(family, 4, 128, 2, 8, 4)
    first, second = slice_inputs(inputs, 0, 64), slice_inputs(inputs, 64, 128)
    _, state_first = method.recurrent(first)
    _, state_whole = method.recurrent(inputs)
    summary = method.summarize(second, chunk_size=16)
    transfer_err = rel_err(core.advance(summary, state_first), state_whole)
    naive_err = rel_err(state_first + summary.state, state_whole)
    assert transfer_err <= TOL
    if family == "linear":
        assert naive_err <= TOL
    else:
        assert naive_err > 1e-2, naive_err


def test_retnet_slow_decay_head_naive_error_is_about_22_percent():
    """RetNet head 5 (gamma = 1 - 2^-10): after 256 more tokens, dropping T leaves (1 - gamma^256) ~ 22% of the
    earlier state in place."""
    heads = 6
    inputs = make_family("retnet", 8, 512, heads, 8, 8)
    first, second = slice_inputs(inputs, 0, 256), slice_inputs(inputs, 256, 512)
    _, state_first = method.recurrent(first)
    summary = method.summarize(second)
    naive = state_first + summary.state
    exact = core.advance(summary, state_first)
    head = heads - 1
    err = float(jnp.linalg.norm(naive[head] - exact[head]) / jnp.linalg.norm(state_first[head]))
    assert abs(err - (1 - (1 - 2.0**-10) ** 256)) < 1e-4
    assert 0.21 < err < 0.23
    assert rel_err(exact, method.recurrent(inputs)[1]) <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_composition_in_float64_is_exact_to_1e10(family):
    with jax.enable_x64(True):
        inputs = make_family(family, 5, 40, 2, 4, 3, dtype=jnp.float64)
        first, second = slice_inputs(inputs, 0, 17), slice_inputs(inputs, 17, 40)
        _, state_first = method.chunked(first, chunk_size=8)
        summary = method.summarize(second, chunk_size=8)
        _, state_whole = numpy_recurrence(inputs)
        composed = core.advance(summary, state_first)
        assert composed.dtype == jnp.float64
        assert rel_err(composed, state_whole) <= 1e-10
        assert rel_err(method.chunked(inputs, chunk_size=8)[0], numpy_recurrence(inputs)[0]) <= 1e-10


def test_bf16_inputs_keep_float32_state():
    inputs = make_family("gated_delta_net", 1, 50, 2, 8, 8, dtype=jnp.bfloat16)
    out, state = method.chunked(inputs, chunk_size=16)
    assert out.dtype == jnp.bfloat16 and state.dtype == jnp.float32
    assert method.summarize(inputs).transfer.dtype == jnp.float32
    assert rel_err(out, numpy_recurrence(inputs)[0]) <= 2e-2


def test_empty_segment_is_the_identity():
    inputs = make_family("kda", 1, 0, 2, 4, 3)
    summary = method.summarize(inputs)
    init = _random_state(1, 2, 4, 3)
    assert rel_err(core.advance(summary, init), init) == 0.0
    out, state = method.chunked(inputs, init)
    assert out.shape == (0, 2, 3) and rel_err(state, init) == 0.0


def test_bad_arguments_raise_value_errors_naming_them():
    q = jnp.ones((5, 2, 4))
    v = jnp.ones((5, 2, 3))
    with pytest.raises(ValueError, match="chunk_size"):
        la.chunked(q, q, v, chunk_size=0)
    with pytest.raises(ValueError, match="chunk_size"):
        la.summarize(q, v, chunk_size=-3)
    with pytest.raises(ValueError, match="^v must"):
        la.chunked(q, q, jnp.ones((4, 2, 3)))
    with pytest.raises(ValueError, match="^q must"):
        la.recurrent(jnp.ones((5, 2, 3)), q, v)
    with pytest.raises(ValueError, match="^g must"):
        la.chunked(q, q, v, g=jnp.ones((5, 3)))
    with pytest.raises(ValueError, match="^gk must"):
        la.chunked(q, q, v, gk=jnp.ones((5, 2)))
    with pytest.raises(ValueError, match="^beta must"):
        la.recurrent(q, q, v, beta=jnp.ones((5,)))
    with pytest.raises(ValueError, match="^initial_state must"):
        la.chunked(q, q, v, initial_state=jnp.ones((2, 3, 4)))
    with pytest.raises(ValueError, match="`beta`"):
        la.delta_net(q, q, v, beta=None)
    with pytest.raises(ValueError, match="`a`"):
        la.gated_delta_net(q, q, v, a=None, b=jnp.ones((5, 2)), A_log=jnp.ones(2), dt_bias=jnp.ones(2))
    with pytest.raises(ValueError, match="`gk`"):
        la.gla(q, q, v, gk=None)
    with pytest.raises(ValueError, match="`g_raw`"):
        la.kda(q, q, v, g_raw=None, A_log=jnp.ones(2), b=jnp.ones((5, 2)))
    with pytest.raises(ValueError, match="`layer_factor`"):
        la.lightning(q, q, v, layer_factor=None)
    with pytest.raises(ValueError, match="`A_log`"):
        la.mamba2(v, jnp.ones((5, 2)), A_log=None, B=q, C=q)
    with pytest.raises(ValueError, match="^state must"):
        la.advance(la.summarize(q, v), jnp.ones((2, 4, 4)))
    with pytest.raises(ValueError, match="non-empty"):
        la.stack_summaries([])


@examples(8)
@given(family=st.sampled_from(FAMILIES), length=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_span_chunk_outputs_equal_the_float64_recurrence_from_any_state(family, length, seed):
    """One chunk-local pass (`span_chunk`) gives a short span's state map (the `chunk_step` the seam fold takes)
    and its outputs and final state from any incoming state, as the token-by-token float64 recurrence does."""
    inputs = make_family(family, seed=seed, length=length, heads=2, key_dim=8, value_dim=4)
    state = np.random.default_rng(seed + 1).standard_normal((2, 8, 4))
    want_o, want_s = numpy_recurrence(inputs, initial_state=state)
    chunk = method.span_chunk(inputs)
    out, final = method.span_chunk_outputs(inputs, chunk, array(state, np.float32))
    assert out.shape == inputs.v.shape and out.dtype == inputs.v.dtype
    assert rel_err(out, want_o) < 1e-4 and rel_err(final, want_s) < 1e-4
    for got, step in zip(chunk[:4], method.chunk_step(inputs)):  # the fold's operands are chunk_step's
        np.testing.assert_array_equal(np.asarray(got), np.asarray(step))
    with pytest.raises(ValueError, match="queries"):
        la.span_chunk_outputs(core.span_chunk(None, inputs.k, inputs.v, **inputs.gates()), array(state))
