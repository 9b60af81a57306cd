"""Conv-tail carry and RoPE re-rotation: the two position corrections a cache relies on, checked to be exact."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from helpers import core, examples, make_family, method, rel_err, slice_inputs
from hypic_jax.core import linear_attn as la
from hypic_jax.core.conv import causal_conv1d
from hypic_jax.core.rope import apply_rope, rotate_keys, rotate_state_keys

SETTINGS = examples(6)


def numpy_conv(x, weight, bias):
    """Zero-padded causal depthwise conv + SiLU in float64."""
    x, weight = np.asarray(x, np.float64), np.asarray(weight, np.float64)
    width = weight.shape[1]
    padded = np.concatenate([np.zeros((width - 1, x.shape[1])), x])
    y = np.stack([(padded[t : t + width] * weight.T).sum(0) for t in range(x.shape[0])]) + np.asarray(bias)
    return y / (1 + np.exp(-y))


@SETTINGS
@given(
    length=st.sampled_from([1, 2, 5, 13, 30]),
    channels=st.sampled_from([1, 3, 6]),
    width=st.sampled_from([1, 2, 4, 5]),
    data=st.data(),
)
def test_conv_tail_carry_is_exact(length, channels, width, data):
    split = data.draw(st.integers(0, length), label="split")
    ks = jax.random.split(jax.random.PRNGKey(length * 31 + channels), 3)
    x = jax.random.normal(ks[0], (length, channels))
    weight = jax.random.normal(ks[1], (channels, width))
    bias = jax.random.normal(ks[2], (channels,))
    whole, whole_state = causal_conv1d(x, weight, bias)
    assert rel_err(whole, numpy_conv(x, weight, bias)) <= 1e-6
    first, tail = causal_conv1d(x[:split], weight, bias)
    second, second_state = causal_conv1d(x[split:], weight, bias, conv_state=tail)
    np.testing.assert_array_equal(np.concatenate([first, second]), whole)
    np.testing.assert_array_equal(second_state, whole_state)
    assert tail.shape == (width - 1, channels)


def test_conv_rejects_bad_shapes():
    x = jnp.ones((5, 3))
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d(x, jnp.ones((4, 4)))
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d(x, jnp.ones((3, 4)), conv_state=jnp.ones((2, 3)))
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d(x, jnp.ones((3, 4)), activation="gelu")


def test_rope_is_a_composable_rotation():
    x = jax.random.normal(jax.random.PRNGKey(0), (7, 2, 16))
    positions = jnp.arange(7) + 3
    shifted = rotate_keys(apply_rope(x, jnp.arange(7), rotary_dim=8), 3, rotary_dim=8)
    assert rel_err(shifted, apply_rope(x, positions, rotary_dim=8)) <= 1e-6
    np.testing.assert_array_equal(apply_rope(x, positions, rotary_dim=8)[..., 8:], x[..., 8:])
    assert rel_err(jnp.linalg.norm(apply_rope(x, positions), axis=-1), jnp.linalg.norm(x, axis=-1)) <= 1e-6
    with pytest.raises(ValueError, match="rotary_dim"):
        apply_rope(x, positions, rotary_dim=5)


def test_rotate_keys_with_one_offset_per_key_equals_rotating_each_segment():
    """Many cached segments concatenated and moved by one per-key offset array = each moved by its own scalar."""
    x = jax.random.normal(jax.random.PRNGKey(1), (9, 2, 16))
    pieces, offsets = [x[:4], x[4:6], x[6:]], [5, -2, 11]
    one_by_one = jnp.concatenate([rotate_keys(p, o, rotary_dim=8) for p, o in zip(pieces, offsets)])
    per_key = np.repeat(offsets, [len(p) for p in pieces])
    np.testing.assert_array_equal(np.asarray(rotate_keys(x, jnp.asarray(per_key), rotary_dim=8)),
                                  np.asarray(one_by_one))


@pytest.mark.parametrize("family", ["linear", "lightning", "retnet"])
@pytest.mark.parametrize("rotary_dim", [4, 8])
def test_rope_rerotation_of_a_scalar_decay_state_is_exact(family, rotary_dim):
    """Segment C2 cached with keys rotated from position 0, reused at offset p: R_p S(C2|0) composes exactly."""
    length, split, kd = 40, 13, 8
    raw = make_family(family, 3, length, 2, kd, 5)
    positions = jnp.arange(length)
    roped = raw.__class__(
        apply_rope(raw.q, positions, rotary_dim=rotary_dim),
        apply_rope(raw.k, positions, rotary_dim=rotary_dim),
        raw.v,
        raw.g,
        raw.gk,
        raw.beta,
        raw.scale,
    )
    _, state_whole = method.recurrent(roped)  # the references: one compiled program each
    _, state_first = method.recurrent(slice_inputs(roped, 0, split))
    second_raw = slice_inputs(raw, split, length)
    canonical_keys = apply_rope(second_raw.k, jnp.arange(length - split), rotary_dim=rotary_dim)
    cached = la.summarize(canonical_keys, second_raw.v, **second_raw.gates())
    moved = la.rotate_summary(cached, split, rotary_dim=rotary_dim)
    assert rel_err(la.advance(moved, state_first), state_whole) <= 1e-5
    assert rel_err(moved.state, rotate_state_keys(cached.state, split, rotary_dim=rotary_dim)) == 0.0
    # without the re-rotation the composed state is wrong
    assert rel_err(la.advance(cached, state_first), state_whole) > 1e-2


@pytest.mark.parametrize("family", ["delta_net", "gla"])
def test_rope_rerotation_of_dense_and_diagonal_transfers_is_exact(family):
    """For delta rules (and per-key decays) the rotated pair is (R T R^T, R S): still exact."""
    length, split, kd, rd = 30, 11, 8, 8
    raw = make_family(family, 4, length, 2, kd, 3)
    k_abs = apply_rope(raw.k, jnp.arange(length), rotary_dim=rd)
    gates = raw.gates()
    if family == "gla":  # decays must be equal within each rotary pair to commute with the rotation
        gk = raw.gk
        gates["gk"] = jnp.concatenate([gk[..., : kd // 2], gk[..., : kd // 2]], axis=-1)
    _, state_whole = core.recurrent(raw.q, k_abs, raw.v, **gates)  # the references: one compiled program each
    first_gates = {n: None if x is None else x[:split] for n, x in gates.items()}
    second_gates = {n: None if x is None else x[split:] for n, x in gates.items()}
    _, state_first = core.recurrent(raw.q[:split], k_abs[:split], raw.v[:split], **first_gates)
    k_canonical = apply_rope(raw.k[split:], jnp.arange(length - split), rotary_dim=rd)
    cached = la.summarize(k_canonical, raw.v[split:], **second_gates)
    moved = la.rotate_summary(cached, split, rotary_dim=rd)
    assert moved.form == "dense"
    assert rel_err(la.advance(moved, state_first), state_whole) <= 1e-5
