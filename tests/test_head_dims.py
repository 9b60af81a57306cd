"""`linear_attn.chunked` and `linear_attn.summarize` with impl="pallas" at head dims the kernels cannot tile.

The kernels tile K and V in powers of two >= 16; other widths are zero-padded inside and sliced back. Each case
runs the kernels in interpret mode on the CPU (float32) against the float64 token-by-token `recurrent`, for a
delta-rule family with a scalar gate and one with per-key gates (dense transfers), a per-key-gate family (diagonal
transfer) and a scalar-decay family, with an initial state. One sequence length and two (K, V) pairs keep the
interpret-mode compiles few.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hypic_jax.core import linear_attn as la
from hypic_jax.core.summary import advance

from helpers import core, rel_err  # the core's functions as compiled programs (the float64 reference: one per shape)

TOL32 = 1e-5  # as tests/test_pallas.py: float32 kernels against a reference
LENGTH, HEADS = 50, 2
DIMS = [(8, 6), (24, 40)]  # both axes padded
FAMILIES = ["gated_delta_net", "kda", "gla", "retnet"]
# every family at both pairs, and one axis padded alone (the other already a kernel width)
CASES = [(name, *dims) for dims in DIMS for name in FAMILIES] + [("gated_delta_net", 16, 12), ("gla", 12, 16)]


def family(name, key_dim, value_dim, seed=0) -> la.LinearInputs:
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    q, k, v = f(LENGTH, HEADS, key_dim), f(LENGTH, HEADS, key_dim), f(LENGTH, HEADS, value_dim)
    if name == "gated_delta_net":
        return la.gated_delta_net(q, k, v, a=f(LENGTH, HEADS), b=f(LENGTH, HEADS),
                                  A_log=jnp.log(jnp.asarray(rng.uniform(0.05, 0.3, HEADS), jnp.float32)),
                                  dt_bias=f(HEADS))
    if name == "kda":  # per-key gates and the delta rule together
        return la.kda(q, k, v, g_raw=f(LENGTH, HEADS, key_dim), A_log=jnp.log(jnp.full((HEADS,), 0.2, jnp.float32)),
                      b=f(LENGTH, HEADS))
    if name == "gla":
        gk = -jnp.asarray(rng.uniform(0.0, 0.5, (LENGTH, HEADS, key_dim)), jnp.float32)
        return la.gla(la.l2_normalize(q), la.l2_normalize(k), v, gk=gk)
    return la.retnet(la.l2_normalize(q), la.l2_normalize(k), v)


def float64(x):
    return None if x is None else np.asarray(x, np.float64)


def recurrent64(inputs: la.LinearInputs, initial_state=None, values=None):
    """`recurrent` in float64 on the same (float32) inputs; `values` replaces v (the transfer's columns)."""
    with jax.enable_x64(True):
        v = inputs.v if values is None else values
        o, s = core.recurrent(float64(inputs.q), float64(inputs.k), float64(v), g=float64(inputs.g),
                              gk=float64(inputs.gk), beta=float64(inputs.beta),
                              initial_state=float64(initial_state), scale=inputs.scale)
        return np.asarray(o), np.asarray(s)


def transfer64(inputs: la.LinearInputs):
    """T_C in float64, in the summary's form: dense from the recurrence run on an identity state with zero values
    (M_t = A_t M_{t-1}); diagonal and scalar as sums of log gates."""
    key_dim = inputs.k.shape[-1]
    if inputs.form == "dense":
        eye = np.broadcast_to(np.eye(key_dim), (HEADS, key_dim, key_dim))
        return recurrent64(inputs, eye, values=np.zeros(inputs.k.shape))[1]
    g = 0.0 if inputs.g is None else np.sum(float64(inputs.g), axis=0)
    if inputs.form == "scalar":
        return g
    return np.sum(float64(inputs.gk), axis=0) + np.asarray(g)[..., None]


@pytest.mark.parametrize("name,key_dim,value_dim", CASES)
def test_pallas_pads_odd_head_dims(name, key_dim, value_dim):
    inputs = family(name, key_dim, value_dim)
    init = jnp.asarray(np.random.default_rng(1).standard_normal((HEADS, key_dim, value_dim)), jnp.float32)
    ref_o, ref_s = recurrent64(inputs, init)

    o, s = la.chunked(**inputs.kwargs(), initial_state=init, impl="pallas")
    assert o.shape == (LENGTH, HEADS, value_dim) and o.dtype == jnp.float32
    assert s.shape == (HEADS, key_dim, value_dim)
    assert rel_err(o, ref_o) < TOL32 and rel_err(s, ref_s) < TOL32

    summary = inputs.summarize(impl="pallas")  # LinearInputs passes impl through
    assert summary.form == {"gated_delta_net": "dense", "kda": "dense", "gla": "diagonal", "retnet": "scalar"}[name]
    assert summary.state.shape == (HEADS, key_dim, value_dim)
    assert rel_err(summary.state, recurrent64(inputs)[1]) < TOL32
    want_t = transfer64(inputs)
    assert summary.transfer.shape == want_t.shape and rel_err(summary.transfer, want_t) < TOL32
    assert rel_err(advance(summary, init), ref_s) < TOL32  # the pair resumes from any state


def test_dispatch_and_refusals():
    inputs = family("retnet", *DIMS[0])
    xla_o, xla_s = la.chunked(**inputs.kwargs(), impl="xla")
    auto_o, auto_s = la.chunked(**inputs.kwargs(), impl="auto")  # off a GPU: the XLA path
    assert rel_err(auto_o, xla_o) == 0.0 and rel_err(auto_s, xla_s) == 0.0
    auto = la.summarize(inputs.k, inputs.v, g=inputs.g, impl="auto")
    xla = la.summarize(inputs.k, inputs.v, g=inputs.g)
    assert rel_err(auto.state, xla.state) == 0.0 and rel_err(auto.transfer, xla.transfer) == 0.0
    empty = jax.tree.map(lambda x: x[:0], inputs)
    with pytest.raises(ValueError, match="sequence is empty"):
        la.chunked(**empty.kwargs(), impl="pallas")
    with pytest.raises(ValueError, match="sequence is empty"):
        la.summarize(empty.k, empty.v, g=empty.g, impl="pallas")
    with pytest.raises(ValueError, match="impl must be"):
        la.summarize(inputs.k, inputs.v, g=inputs.g, impl="triton")
