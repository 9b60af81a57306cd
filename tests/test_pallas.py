"""Pallas kernels (hypic_jax.kernels) in interpret mode on the CPU against their pure-JAX references (each
family's `reference` module), and the references against the transfer-operator core.

Shapes are tiny and few (interpret-mode compilation, not arithmetic, is the cost); they still cover odd lengths,
several chunk sizes, grouped key heads, an initial state, the transfer-operator split into pieces, the emitted
(T_C, S(C|0)), the solve variants, per-key decays and packed segments. The last tests lower every kernel to Triton
IR or Mosaic GPU for the GPU (no GPU needed) so that CPU CI also catches constructs the lowerings reject.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hypic_jax.core import linear_attn as la
from hypic_jax.kernels import attention as pattn
from hypic_jax.kernels import compose as cmp
from hypic_jax.kernels import gdn, platform
from hypic_jax.kernels.gdn import GDNConfig, gdn_forward, mosaic_chunk_local, mosaic_state
from hypic_jax.kernels.gdn import reference as gdn_ref
from hypic_jax.kernels.gdn.chunk import _forward
from hypic_jax.kernels.gdn.chunk_local import chunk_locals, inverse_doubling
from hypic_jax.kernels.gdn.common import chunk_cumsum
from hypic_jax.kernels.gdn.state import state_pass, use_mosaic_transfer
from hypic_jax.kernels.gdn.varlen import _varlen

from helpers import array, core, examples, interpreter_threads_compiled_once, rel_err

TOL32 = 1e-5
TOL16 = 2e-3


@pytest.fixture(autouse=True, scope="module")
def _mosaic_gpu_interpreter_compiles_each_thread_program_once():
    """The Mosaic GPU kernels run in Pallas's GPU interpreter, which would compile a warpgroup's program anew for
    every grid point (`helpers.interpreter_threads_compiled_once`)."""
    with interpreter_threads_compiled_once():
        yield


def inputs(length, key_heads=1, heads=2, dim=16, seed=0, gate=True, delta=True, dtype=jnp.float32):
    """Random q, k (unit rows, as `la.l2_normalize` makes them), v, g, beta, built with NumPy: no compilation per
    shape (the property tests draw their lengths)."""
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    unit = lambda x: x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + np.float32(1e-6))  # noqa: E731
    q = array(unit(f(length, key_heads, dim)), dtype)
    k = array(unit(f(length, key_heads, dim)), dtype)
    v = array(f(length, heads, dim), dtype)
    g = array(-rng.uniform(0.0, 0.3, (length, heads)), np.float32) if gate else None
    beta = array(1 / (1 + np.exp(-f(length, heads))), np.float32) if delta else None
    return q, k, v, g, beta


def reference(q, k, v, g=None, beta=None, init=None, scale=1.0, gk=None):
    """`gdn_forward`'s reference: the token-by-token recurrence in float32 (key heads read by their value heads)."""
    return gdn_ref.gdn_forward_reference(q, k, v, g=g, beta=beta, gk=gk, initial_state=init, scale=scale)


def reference_summary(k, v, g=None, gk=None, beta=None):
    """The zero-start summary (T_C, S(C|0)) of `gdn_forward`'s reference."""
    return gdn_ref.gdn_forward_reference(k, k, v, g=g, gk=gk, beta=beta, emit_summary=True)[2]


@pytest.mark.parametrize("family", ["gdn", "deltanet", "kda", "gla", "decay", "linear"])
def test_gdn_references_match_the_core(family):
    """The kernels' references (`gdn.reference`) against the transfer-operator core: `gdn_forward_reference`
    against `linear_attn.recurrent` and `summarize` (key heads repeated), `gdn_varlen_reference` against
    `linear_attn.varlen_reference`, for every gate combination."""
    length = 45
    q, k, v, g, beta = inputs(length, key_heads=1, seed=51, gate=family in ("gdn", "decay"),
                              delta=family in ("gdn", "deltanet", "kda"))
    gk = per_key_gates(length, 2, 16, seed=52) if family in ("kda", "gla") else None
    init = array(np.random.default_rng(53).standard_normal((2, 16, 16)) * 0.3, np.float32)
    o, s, summary = gdn_ref.gdn_forward_reference(q, k, v, g=g, gk=gk, beta=beta, initial_state=init, scale=0.5,
                                                  emit_summary=True)
    up = lambda x: jnp.repeat(x, 2, 1)  # noqa: E731
    ref_o, ref_s = core.recurrent(up(q), up(k), v, g=g, gk=gk, beta=beta, initial_state=init, scale=0.5)
    ref_sum = core.summarize(up(k), v, g=g, gk=gk, beta=beta, chunk_size=16)
    assert rel_err(o, ref_o) < TOL32 and rel_err(s, ref_s) < TOL32
    assert summary.form == ref_sum.form and rel_err(summary.state, ref_sum.state) < TOL32
    if summary.transfer is not None:
        assert rel_err(summary.transfer, ref_sum.transfer) < TOL32
    cu = [0, 5, 5, 22, 44, 45]
    o, summary = gdn_ref.gdn_varlen_reference(q, k, v, cu, g=g, gk=gk, beta=beta, scale=0.5)
    ref_o, ref_sum = core.varlen_reference(q, k, v, cu, g=g, gk=gk, beta=beta, scale=0.5)
    assert rel_err(o, ref_o) < TOL32 and summary.form == ref_sum.form and rel_err(summary.state, ref_sum.state) < TOL32
    if summary.transfer is not None:
        assert rel_err(summary.transfer, ref_sum.transfer) < TOL32


# (length, chunk, pieces, block_v, with initial state): odd lengths, chunks 16/32/64, direct and split.
CASES = [
    (37, 16, 1, 16, False),
    (100, 32, 3, 16, True),
    (45, 64, 1, 16, True),
]


@pytest.mark.parametrize("length,chunk,pieces,block_v,with_init", CASES)
def test_gated_delta_float32_matches_reference(length, chunk, pieces, block_v, with_init):
    q, k, v, g, beta = inputs(length)
    init = array(np.random.default_rng(9).standard_normal((2, 16, 16)) * 0.3, np.float32) if with_init else None
    config = GDNConfig(chunk=chunk, pieces=pieces, block_v=block_v)
    o, s, summary = gdn_forward(q, k, v, g=g, beta=beta, initial_state=init, scale=0.5, config=config,
                                emit_summary=True, interpret=True)
    ref_o, ref_s = reference(q, k, v, g, beta, init, scale=0.5)
    assert rel_err(o, ref_o) < TOL32 and rel_err(s, ref_s) < TOL32
    ref_sum = reference_summary(k, v, g=g, beta=beta)
    assert summary.form == "dense"
    assert rel_err(summary.transfer, ref_sum.transfer) < TOL32
    assert rel_err(summary.state, ref_sum.state) < TOL32


def test_delta_net_and_decay_only():
    q, k, v, _, beta = inputs(29, key_heads=2, seed=1, gate=False)  # DeltaNet: g = None
    o, s = gdn_forward(q, k, v, beta=beta, config=GDNConfig(chunk=16, block_v=16), interpret=True)
    ref_o, ref_s = reference(q, k, v, None, beta)
    assert rel_err(o, ref_o) < TOL32 and rel_err(s, ref_s) < TOL32
    q, k, v, g, _ = inputs(29, key_heads=2, seed=2, delta=False)  # scalar decay only (RetNet/lightning/Mamba2)
    o, s = gdn_forward(q, k, v, g=g, config=GDNConfig(chunk=16, block_v=16), interpret=True)
    ref_o, ref_s = reference(q, k, v, g, None)
    assert rel_err(o, ref_o) < TOL32 and rel_err(s, ref_s) < TOL32


def test_bfloat16_inputs():
    q, k, v, g, beta = inputs(37, seed=3, dtype=jnp.bfloat16)
    config = GDNConfig(chunk=16, block_v=16, locals_precision="ieee", state_precision="ieee", inter_dtype="float32")
    o, s = gdn_forward(q, k, v, g=g, beta=beta, config=config, interpret=True)
    assert o.dtype == jnp.bfloat16
    ref_o, ref_s = reference(q, k, v, g, beta)
    assert rel_err(o, ref_o) < TOL16 and rel_err(s, ref_s) < TOL16


def test_float32_queries_and_keys_follow_the_values_dtype():
    """q, k out of a float32 L2 norm beside bf16 values: the kernel takes them in v's dtype (one tile dtype), so
    the result equals feeding bf16 q, k directly."""
    q, k, v, g, beta = inputs(29, seed=4, dtype=jnp.float32)
    v = v.astype(jnp.bfloat16)
    config = GDNConfig(chunk=16, block_v=16)
    mixed = gdn_forward(q, k, v, g=g, beta=beta, config=config, interpret=True)
    cast = gdn_forward(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v, g=g, beta=beta, config=config,
                       interpret=True)
    assert mixed[0].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(mixed[0], np.float32), np.asarray(cast[0], np.float32))
    np.testing.assert_array_equal(np.asarray(mixed[1]), np.asarray(cast[1]))


def test_vmap_over_batch():
    q, k, v, g, beta = inputs(20, seed=4)
    batch = jax.tree_util.tree_map(lambda x: jnp.stack([x, x[::-1]]), (q, k, v, g, beta))
    fn = lambda q, k, v, g, b: gdn_forward(q, k, v, g=g, beta=b, config=GDNConfig(chunk=16, block_v=16),  # noqa
                                           interpret=True)
    o, s = jax.vmap(fn)(*batch)
    for i in range(2):
        ref_o, ref_s = reference(*(x[i] for x in batch))
        assert rel_err(o[i], ref_o) < TOL32 and rel_err(s[i], ref_s) < TOL32


def test_compose_fold_kernel():
    rng = np.random.default_rng(5)
    n, batch, dim = 7, 3, 16
    t = array(rng.standard_normal((n, batch, dim, dim)) * 0.25, np.float32)
    s = array(rng.standard_normal((n, batch, dim, dim)), np.float32)
    summaries = la.Summary("dense", s, t)
    ref_states = core.prefix_states(summaries)
    ref_t, ref_s = cmp.fold_reference(t, s)
    assert rel_err(ref_s, ref_states[-1]) < TOL32 and rel_err(cmp.prefix_fold_reference(t, s), ref_states) < TOL32
    total_t, total_s = cmp.compose_all(t, s, "f32")
    assert rel_err(total_s, ref_s) < TOL32 and rel_err(total_t, ref_t) < TOL32
    product, none = cmp.compose_all(t, None, "f32")  # the transfers alone: T_7 ... T_1, an odd count
    want = np.eye(dim)
    for i in range(n):
        want = np.asarray(t[i], np.float64) @ want
    assert none is None and rel_err(product, want) < TOL32 and rel_err(ref_t, want) < TOL32
    for with_t in (True, False):
        kt, ks = cmp.fold_pallas(t, s, with_transfer=with_t, config=cmp.FoldConfig(block_w=16, algorithm="f32"),
                                 interpret=True)
        assert rel_err(ks, ref_s) < TOL32
        if with_t:
            assert kt.shape == ref_t.shape and rel_err(kt, ref_t) < TOL32
        else:
            assert kt is None


@pytest.mark.parametrize("n, batch, dim, width, block_w", [(7, 3, 16, 16, 16), (1, 2, 16, 32, 16), (11, 1, 32, 16, 16),
                                                           (3, 2, 16, 48, 32)])  # 48 columns: blocks of 16
def test_prefix_fold_kernel_gives_every_prefix_state(n, batch, dim, width, block_w):
    rng = np.random.default_rng(n + width)
    t = array(rng.standard_normal((n, batch, dim, dim)) / np.sqrt(dim), np.float32)
    s = array(rng.standard_normal((n, batch, dim, width)), np.float32)
    want, state = [], np.zeros((batch, dim, width))
    for i in range(n):  # float64 loop
        state = np.asarray(t[i], np.float64) @ state + np.asarray(s[i], np.float64)
        want.append(state)
    config = cmp.FoldConfig(block_w=block_w, algorithm="f32")
    for block in (None, 0, 2, 3):  # one fold; blocked (sqrt n); blocks dividing n or not (identity padding)
        got = cmp.prefix_fold_pallas(t, s, config=config, block=block, interpret=True)
        assert got.shape == (n, batch, dim, width)
        assert rel_err(got, np.stack(want)) < TOL32, block
    # through the core: the same states as the associative scan, from an initial state too
    summaries = la.Summary("dense", s, t)
    init = array(rng.standard_normal((batch, dim, width)), np.float32)
    for impl in ("fold", "pallas"):
        assert rel_err(la.prefix_states(summaries, init, impl=impl), core.prefix_states(summaries, init)) < TOL32
    with pytest.raises(ValueError, match="impl"):
        la.prefix_states(summaries, impl="sideways")
    # the composed state alone (no transfer, no states in between): every impl, with and without a start state
    for start in (None, init):
        last = core.prefix_states(summaries, start)[-1]
        for impl in la.PREFIX_IMPLS:
            assert rel_err(la.composed_state(summaries, start, impl=impl), last) < TOL32, impl
    with pytest.raises(ValueError, match="impl"):
        la.composed_state(summaries, impl="sideways")


@pytest.mark.parametrize("lq, lk, hq, hkv, dim, dtype, block", [
    (37, 101, 4, 2, 16, jnp.float32, 16),  # odd lengths, GQA, several key tiles
    (5, 9, 2, 2, 32, jnp.float32, 16),  # keys shorter than a tile
    (70, 200, 8, 2, 64, jnp.bfloat16, 32),
])
def test_positioned_attention_kernel(lq, lk, hq, hkv, dim, dtype, block):
    rng = np.random.default_rng(lq)
    q = jnp.asarray(rng.standard_normal((lq, hq, dim)), dtype)
    k = jnp.asarray(rng.standard_normal((lk, hkv, dim)), dtype)
    v = jnp.asarray(rng.standard_normal((lk, hkv, dim)), dtype)
    positions = np.sort(rng.integers(0, lk, lq))
    positions[0] = -1  # a padding row: sees nothing, returns zeros
    positions = array(positions, np.int32)
    want = pattn.positioned_attention_reference(q, k, v, positions, scale=dim**-0.5)
    # bfloat16 outputs: both sides are rounded to bf16 (one ulp = 2**-8 relative) and the kernel feeds the softmax
    # weights to the value product in bf16, as flash kernels do; two ulps of the output bound the difference
    tol = TOL32 if dtype == jnp.float32 else 2 * 2.0**-8
    for programs, pack in ((1, False), (10**6, False), (1, True), (10**6, True)):
        # one key range per program row; as many ranges as key tiles; each with the query heads of a kv head packed
        # into one program's rows (block_q rows = block_q / G queries x G heads)
        config = pattn.AttentionConfig(block_q=block, block_k=block, target_programs=programs, pack_gqa=pack)
        got = pattn.positioned_attention(q, k, v, positions, scale=dim**-0.5, config=config, interpret=True)
        assert rel_err(got, want) < tol
        assert not np.asarray(got[0], np.float32).any()
    if hq // hkv > 1:
        with pytest.raises(ValueError, match="pack_gqa"):
            pattn.positioned_attention(q, k, v, positions, scale=dim**-0.5, interpret=True,
                                       config=pattn.AttentionConfig(block_q=hq // hkv + 1, pack_gqa=True))
    # the same attention as the models' XLA path (positioned GQA attention over keys at positions 0..Lk-1)
    from hypic_jax.core import attention

    xla = attention.dot_product_attention(q[None, 1:], k[None], v[None], scale=dim**-0.5,
                                          q_positions=np.asarray(positions)[1:], k_positions=np.arange(lk))[0]
    assert rel_err(got[1:], xla) < tol


def per_key_gates(length, heads, dim, seed, strength=0.5):
    """KDA/GLA log gates in [-strength, 0) per key channel."""
    return array(-np.random.default_rng(seed).uniform(0.0, strength, (length, heads, dim)), np.float32)


# ----------------------------------------------------------------------------------------------------------------
# Solve variants of the chunk-local inverse.


@pytest.mark.parametrize("solve,chunk,length", [("rows", 64, 70), ("doubling", 64, 70), ("tile", 64, 70),
                                                ("tile", 32, 45)])
def test_solve_variants_float32_with_correlated_keys(solve, chunk, length):
    """Every solve stays float32-exact, also when the keys are 90% one vector (the case that breaks Neumann-type
    products); beta near 1 makes M's entries near 1."""
    rng = np.random.default_rng(11)
    f = lambda *s: array(rng.standard_normal(s), np.float32)  # noqa: E731
    k = la.l2_normalize(0.9 * f(1, 2, 16) + 0.1 * f(length, 2, 16))
    q, v = la.l2_normalize(f(length, 2, 16)), f(length, 2, 16)
    g = array(-rng.uniform(0.0, 0.05, (length, 2)), np.float32)
    beta = jax.nn.sigmoid(f(length, 2) + 2.0)
    config = GDNConfig(chunk=chunk, block_v=16, solve=solve)
    o, s, summary = gdn_forward(q, k, v, g=g, beta=beta, scale=0.5, config=config, emit_summary=True, interpret=True)
    ref_o, ref_s = reference(q, k, v, g, beta, scale=0.5)
    assert rel_err(o, ref_o) < TOL32 and rel_err(s, ref_s) < TOL32
    assert rel_err(summary.transfer, reference_summary(k, v, g=g, beta=beta).transfer) < TOL32


# ----------------------------------------------------------------------------------------------------------------
# Property test over families, chunk sizes, solves, sub-blocks, splits and lengths.


@examples(6)
@given(family=st.sampled_from(["gdn", "deltanet", "kda", "kda+g", "gla", "decay"]),
       chunk=st.sampled_from([16, 32, 64]), solve=st.sampled_from(["rows", "doubling", "tile"]),
       sub=st.sampled_from([16, 32]), pieces=st.sampled_from([1, 2]), group=st.sampled_from([0, 1, 2, 3, 64]),
       length=st.integers(1, 150), with_init=st.booleans(), prefetch=st.booleans(), packed=st.booleans(),
       seed=st.integers(0, 2**16))
def test_forward_matches_recurrent_property(family, chunk, solve, sub, pieces, group, length, with_init, prefetch,
                                            packed, seed):
    """Outputs, final state and the emitted summary against the reference (`gdn.reference`: the token-by-token
    recurrence and the zero-start summary), over random families, chunk sizes, solves, diagonal sub-blocks,
    splits, transfer groups (0: the widened pass; small groups: several groups, padded ones and an odd count in the
    product tree), the state pass with and without its prefetched small loads, lengths (odd ones and ones shorter
    than a chunk included) and, for lengths that do not fill the last chunk, q, k, v read in place or
    zero-padded."""
    delta = family not in ("gla", "decay")
    q, k, v, g, beta = inputs(length, key_heads=1, seed=seed, gate=family in ("gdn", "kda+g", "decay"),
                              delta=delta)
    gk = per_key_gates(length, 2, 16, seed=seed + 1, strength=2.0) if family in ("kda", "kda+g", "gla") else None
    rng = np.random.default_rng(seed + 2)
    init = array(rng.standard_normal((2, 16, 16)) * 0.3, np.float32) if with_init else None
    config = GDNConfig(chunk=chunk, solve=solve, sub=sub, pieces=pieces, block_v=16, transfer_group=group,
                       state_prefetch=prefetch, packed_reads=packed)
    o, s, summary = gdn_forward(q, k, v, g=g, gk=gk, beta=beta, initial_state=init, scale=0.5, config=config,
                                emit_summary=True, interpret=True)
    ref_o, ref_s = reference(q, k, v, g, beta, init, scale=0.5, gk=gk)
    assert rel_err(o, ref_o) < TOL32 and rel_err(s, ref_s) < TOL32
    ref_sum = reference_summary(k, v, g=g, gk=gk, beta=beta)
    assert summary.form == ref_sum.form
    assert rel_err(summary.transfer, ref_sum.transfer) < transfer_tolerance(g, gk, chunk)
    assert rel_err(summary.state, ref_sum.state) < TOL32


def transfer_tolerance(g, gk, chunk):
    """TOL32, or float32's resolution of the decays where the gates are extreme. A kernel takes e^{b_t - b_j} from
    chunk-local cumulative log decays b, which float32 holds to |b| 2^-24 absolute; T is a product of such decays
    with cancelling low-rank corrections, and per-key gates of -2 per token reach |b| = 80 in a 64-token chunk,
    where T (entries near 1e-29) came out 3.4e-5 from a float64 reference. The
    bound allows 16 such roundings; real errors (a wrong mask, decay or block) are orders of magnitude larger."""
    log_decay = np.zeros(1) if g is None else np.asarray(g, np.float64)[..., None]
    if gk is not None:
        log_decay = log_decay + np.asarray(gk, np.float64)
    length = log_decay.shape[0]
    pad = -length % chunk
    padded = np.pad(log_decay, [(0, pad)] + [(0, 0)] * (log_decay.ndim - 1))
    span = np.abs(padded.reshape((-1, chunk) + padded.shape[1:]).sum(axis=1)).max()
    return max(TOL32, 16 * span * 2.0**-24)


@pytest.mark.parametrize("n", [2, 4, 16, 64])
def test_doubling_inverse_is_exact(n):
    """`inverse_doubling` (its first level elementwise, the rest by dots) against numpy's inverse, correlated keys."""
    rng = np.random.default_rng(n)
    keys = rng.standard_normal((n, 8))
    keys = 0.6 * keys / np.linalg.norm(keys, axis=1, keepdims=True) + 0.4 * keys[:1] / np.linalg.norm(keys[0])
    strict = np.tril(0.9 * keys @ keys.T, -1)
    got = inverse_doubling(array(strict, np.float32), "ieee")
    assert rel_err(got, np.linalg.inv(np.eye(n) + strict)) < TOL32


def test_transfer_groups_product_tree():
    """Seven chunks in groups of 2 (four groups, the last padded with zero tokens): the tree's product equals the
    summary of the whole sequence, and so does every other grouping."""
    q, k, v, g, beta = inputs(7 * 16 - 5, key_heads=1, seed=41)
    ref = reference_summary(k, v, g=g, beta=beta)
    for group in (0, 1, 2, 3, 7, 100):
        config = GDNConfig(chunk=16, block_v=16, transfer_group=group)
        _, _, summary = gdn_forward(q, k, v, g=g, beta=beta, config=config, emit_summary=True, interpret=True)
        assert rel_err(summary.transfer, ref.transfer) < TOL32 and rel_err(summary.state, ref.state) < TOL32


def test_config_refuses_bad_sub_and_group():
    with pytest.raises(ValueError, match="sub"):
        GDNConfig(sub=8)
    with pytest.raises(ValueError, match="transfer_group"):
        GDNConfig(transfer_group=-1)


# ----------------------------------------------------------------------------------------------------------------
# Per-key (diagonal) decays: KDA (gk and beta), GLA (gk only).


@pytest.mark.parametrize("chunk,length,pieces,delta,with_g", [(16, 37, 1, True, False), (32, 45, 2, True, True),
                                                              (32, 29, 1, False, False)])
def test_per_key_decays_float32(chunk, length, pieces, delta, with_g):
    q, k, v, g, beta = inputs(length, key_heads=1, seed=12, gate=with_g, delta=delta)
    gk = per_key_gates(length, 2, 16, seed=13, strength=3.0)  # strong decays: exponents must stay <= 0
    init = array(np.random.default_rng(14).standard_normal((2, 16, 16)) * 0.3, np.float32)
    config = GDNConfig(chunk=chunk, pieces=pieces, block_v=16)
    o, s, summary = gdn_forward(q, k, v, g=g, gk=gk, beta=beta, initial_state=init, scale=0.5, config=config,
                                emit_summary=True, interpret=True)
    assert np.all(np.isfinite(np.asarray(o)))
    ref_o, ref_s = reference(q, k, v, g, beta, init, scale=0.5, gk=gk)
    assert rel_err(o, ref_o) < TOL32 and rel_err(s, ref_s) < TOL32
    ref_sum = reference_summary(k, v, g=g, gk=gk, beta=beta)
    assert summary.form == ref_sum.form == ("dense" if delta else "diagonal")
    assert rel_err(summary.transfer, ref_sum.transfer) < TOL32 and rel_err(summary.state, ref_sum.state) < TOL32


def test_per_key_diagonal_blocks_take_both_forms():
    """Weak gates in the first half (diagonal blocks in the factored one-dot form), gates so strong in the second
    half that the factored form would overflow (a block's log-decay span far over 88): those blocks must take the
    column loop, and both halves must match the recurrence."""
    length = 64
    q, k, v, _, beta = inputs(length, key_heads=2, seed=31)
    rng = np.random.default_rng(32)
    strength = np.where(np.arange(length)[:, None, None] < 32, 0.1, 14.0)
    gk = array(-rng.uniform(0.0, 1.0, (length, 2, 16)) * strength, np.float32)
    for chunk in (16, 32):
        o, s = gdn_forward(q, k, v, gk=gk, beta=beta, scale=0.5, config=GDNConfig(chunk=chunk, block_v=16),
                           interpret=True)
        assert np.all(np.isfinite(np.asarray(o)))
        ref_o, ref_s = reference(q, k, v, beta=beta, scale=0.5, gk=gk)
        assert rel_err(o, ref_o) < TOL32 and rel_err(s, ref_s) < TOL32


def test_per_key_launch_over_shared_memory_is_refused():
    """Per-key gates at chunk 64 and K = 128 do not fit a GPU's shared memory: a clear error before Triton's."""
    length, dim = 64, 128
    q = k = jnp.zeros((length, 1, dim), jnp.bfloat16)
    v = jnp.zeros((length, 2, dim), jnp.bfloat16)
    gk = jnp.zeros((length, 2, dim), jnp.float32)
    with pytest.raises(ValueError, match="per-key gates"):
        gdn_forward(q, k, v, gk=gk, config=GDNConfig(), interpret=False)
    with pytest.raises(ValueError, match="per-key gates"):
        gdn.gdn_varlen(q, k, v, [0, length], gk=gk, config=GDNConfig(chunk=64, solve="doubling"), interpret=False)


def test_per_key_bfloat16():
    q, k, v, _, beta = inputs(37, seed=15, dtype=jnp.bfloat16)
    gk = per_key_gates(37, 2, 16, seed=16)
    config = GDNConfig(chunk=16, block_v=16, locals_precision="ieee", state_precision="ieee", inter_dtype="float32")
    o, s = gdn_forward(q, k, v, gk=gk, beta=beta, config=config, interpret=True)
    assert o.dtype == jnp.bfloat16
    ref_o, ref_s = reference(q, k, v, beta=beta, gk=gk)
    assert rel_err(o, ref_o) < TOL16 and rel_err(s, ref_s) < TOL16


# ----------------------------------------------------------------------------------------------------------------
# Variable-length packed segments.


@pytest.mark.parametrize("gates,chunk,traced,group,reads", [
    ("gdn", 16, True, 64, "packed"), ("gdn", 16, False, 0, "packed"), ("gdn", 16, True, 1, "packed"),
    ("gdn", 32, False, 0, "gather"), ("gdn", 16, True, 2, "gather"), ("kda", 32, False, 64, "packed"),
    ("kda", 16, False, 2, "packed"), ("kda", 16, True, 0, "gather"), ("decay", 16, False, 64, "packed"),
    ("decay", 32, False, 64, "gather")])
def test_varlen_matches_reference(gates, chunk, traced, group, reads):
    """Packed segments against the reference (`gdn_varlen_reference`), T through the transfer pass (group > 0; 1
    and 2 put segments across several groups) or the widened state (0); q, k, v read in place ("packed", every
    family) or gathered into the chunk-aligned layout."""
    length = 61
    cu = [0, 5, 5, 22, 39, 40, 61]  # an empty segment, a one-token segment, odd lengths
    q, k, v, g, beta = inputs(length, key_heads=1, seed=17, gate=gates != "kda", delta=gates != "decay")
    gk = per_key_gates(length, 2, 16, seed=18) if gates == "kda" else None
    config = GDNConfig(chunk=chunk, block_v=16, transfer_group=group, packed_reads=reads == "packed")
    offsets = array(cu, np.int32) if traced else cu
    o, summary = gdn.gdn_varlen(q, k, v, offsets, g=g, gk=gk, beta=beta, scale=0.5, config=config, interpret=True)
    ref_o, ref_sum = gdn_ref.gdn_varlen_reference(q, k, v, cu, g=g, gk=gk, beta=beta, scale=0.5)
    assert summary.form == ref_sum.form and summary.state.shape == (6, 2, 16, 16)
    assert rel_err(o, ref_o) < TOL32
    assert rel_err(summary.state, ref_sum.state) < TOL32 and rel_err(summary.transfer, ref_sum.transfer) < TOL32
    # The segments' pairs compose into the state of the unsegmented sequence only through T (checks the reset).
    if gates == "gdn":
        _, whole = reference(q, k, v, g, beta)
        assert rel_err(core.prefix_states(summary)[-1], whole) < TOL32
    if gates == "decay":
        o2, states = gdn.gdn_varlen(q, k, v, offsets, g=g, scale=0.5, config=config, emit_summary=False,
                                    interpret=True)
        assert rel_err(o2, ref_o) < TOL32 and rel_err(states, ref_sum.state) < TOL32


def test_varlen_default_config_widens():
    """With no config, packed segments take T from the widened pass (`default_varlen_config`), checked end to end
    against the reference."""
    assert gdn.default_varlen_config().transfer_group == 0 and GDNConfig().transfer_group > 0
    length, cu = 70, [0, 9, 9, 70]
    q, k, v, g, beta = inputs(length, key_heads=1, seed=23)
    o, summary = gdn.gdn_varlen(q, k, v, cu, g=g, beta=beta, scale=0.5, interpret=True)
    ref_o, ref_sum = gdn_ref.gdn_varlen_reference(q, k, v, cu, g=g, beta=beta, scale=0.5)
    assert rel_err(o, ref_o) < TOL32
    assert rel_err(summary.state, ref_sum.state) < TOL32 and rel_err(summary.transfer, ref_sum.transfer) < TOL32
    # summary_rows: the rows read are the reference's, the empty segment's (I, 0) included when it is read
    for rows in ([True, True, True], [True, False, True], [False, True, False]):
        _, picked = gdn.gdn_varlen(q, k, v, cu, g=g, beta=beta, scale=0.5, summary_rows=jnp.asarray(rows),
                                   interpret=True)
        read = np.flatnonzero(rows)
        assert rel_err(picked.state[read], ref_sum.state[read]) < TOL32
        assert rel_err(picked.transfer[read], ref_sum.transfer[read]) < TOL32
    with pytest.raises(ValueError, match="summary_rows"):
        gdn.gdn_varlen(q, k, v, cu, g=g, beta=beta, summary_rows=jnp.ones(2, bool), interpret=True)


@examples(5)
@given(cuts=st.lists(st.integers(0, 120), min_size=3, max_size=3), group=st.sampled_from([0, 1, 3, 64]),
       prefetch=st.booleans(), reads=st.sampled_from(["packed", "gather"]), grid=st.booleans(),
       seed=st.integers(0, 2**16))
def test_varlen_property(cuts, group, prefetch, reads, grid, seed):
    """Random splits of 120 tokens into 4 segments (empty ones, one-chunk ones, segments across several transfer
    groups): outputs, S(C|0) and T of every segment against the reference. The segment count and the length
    stay fixed, so examples reuse the compiled functions."""
    length = 120
    cu = [0] + sorted(cuts) + [length]
    q, k, v, g, beta = inputs(length, key_heads=1, seed=seed)
    config = GDNConfig(chunk=16, block_v=16, transfer_group=group, state_prefetch=prefetch,
                       packed_reads=reads == "packed", segment_grid=grid)
    o, summary = gdn.gdn_varlen(q, k, v, cu, g=g, beta=beta, scale=0.5, config=config, interpret=True)
    # the offsets as an array: traced in the reference, one compilation for every split (the kernel takes the list)
    ref_o, ref_sum = gdn_ref.gdn_varlen_reference(q, k, v, np.asarray(cu, np.int32), g=g, beta=beta, scale=0.5)
    assert rel_err(o, ref_o) < TOL32
    assert rel_err(summary.state, ref_sum.state) < TOL32 and rel_err(summary.transfer, ref_sum.transfer) < TOL32


@pytest.mark.parametrize("continues", [None, (False, True, True, False, True)])
def test_varlen_initial_states_and_continues_match_reference(continues):
    """Packed segments from their own initial states, some carrying on from the segment before (an empty segment
    among them): outputs and every segment's end state against `gdn_varlen_reference`, for the per-segment grid
    and the one program."""
    length, cu = 70, [0, 9, 9, 30, 51, 70]
    q, k, v, g, beta = inputs(length, key_heads=1, seed=61)
    init = array(np.random.default_rng(62).standard_normal((5, 2, 16, 16)) * 0.3, np.float32)
    flags = None if continues is None else jnp.asarray(continues)
    ref_o, ref_states = gdn_ref.gdn_varlen_reference(q, k, v, cu, g=g, beta=beta, scale=0.5, emit_summary=False,
                                                     initial_state=init, continues=flags)
    for grid in (False, True):
        config = GDNConfig(chunk=16, block_v=16, transfer_group=0, segment_grid=grid)
        o, states = gdn.gdn_varlen(q, k, v, cu, g=g, beta=beta, scale=0.5, config=config, emit_summary=False,
                                   initial_state=init, continues=flags, interpret=True)
        assert rel_err(o, ref_o) < TOL32 and rel_err(states, ref_states) < TOL32
        np.testing.assert_array_equal(np.asarray(states[1]), np.asarray(init[1]))  # the empty segment


@pytest.mark.parametrize("family, chunk, solve", [("gdn", 64, "tile"), ("gdn", 32, "doubling"),
                                                  ("deltanet", 16, "rows"), ("kda", 32, "doubling"),
                                                  ("decay", 16, "tile")])
def test_chunk_locals_kernel_matches_reference(family, chunk, solve):
    """The Triton chunk-local kernel alone (`chunk_locals`, float32 dots) against `chunk_locals_reference`: P, W, U
    (and with per-key gates the state pass's decayed keys and queries) from the definitions, the inverse by a
    triangular solve."""
    length = 2 * chunk
    q, k, v, g, beta = inputs(length, key_heads=1, seed=71, gate=family in ("gdn", "decay"),
                              delta=family != "decay")
    if family == "kda":
        b = per_key_gates(length, 2, 16, seed=72, strength=1.0).reshape(2, chunk, 2, 16).cumsum(1).reshape(
            length, 2, 16)
    else:
        b = chunk_cumsum(g, length, 2, chunk)
    beta_t = None if beta is None else beta.T
    config = GDNConfig(chunk=chunk, solve=solve, locals_precision="ieee", solve_precision="ieee")
    got = chunk_locals(q, k, v, b, beta_t, chunk=chunk, scale=0.5, inter_dtype=jnp.float32, config=config,
                       interpret=True)
    want = gdn_ref.chunk_locals_reference(q, k, v, b, beta_t, chunk=chunk, scale=0.5)
    assert len(got) == len(want)
    for mine, theirs in zip(got, want):
        assert mine.shape == theirs.shape and rel_err(mine, theirs) < TOL32


def test_kernels_lower_to_triton():
    """Lowering (not compiling) for CUDA works on a CPU-only machine: catches Triton-unsupported constructs."""
    sd = jax.ShapeDtypeStruct
    length, dim = 256, 128
    args = (sd((length, 16, dim), jnp.bfloat16), sd((length, 16, dim), jnp.bfloat16),
            sd((length, 32, dim), jnp.bfloat16), sd((length, 32), jnp.float32), sd((length, 32), jnp.float32), None)
    check = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    odd = tuple(None if a is None else sd((length - 3,) + a.shape[1:], a.dtype) for a in args)  # packed reads
    for config, emit, fn_args in ((GDNConfig(), False, args), (GDNConfig(), True, args),
                                  (GDNConfig(pieces=2), True, args), (GDNConfig(state_prefetch=False), True, args),
                                  (GDNConfig(), True, odd), (GDNConfig(pieces=2), True, odd),
                                  (GDNConfig(packed_reads=False), True, odd)):
        fn = jax.jit(lambda *a, c=config, e=emit: _forward(*a, scale=dim**-0.5, config=c, emit_summary=e,
                                                           interpret=False))
        text = jax.export.export(fn, platforms=["cuda"], disabled_checks=check)(*fn_args).mlir_module()
        assert "xla.gpu.triton" in text
    per_key = sd((length, 32, dim), jnp.float32)
    lowered = []
    for config in (GDNConfig(solve="doubling"), GDNConfig(solve="rows", chunk=64),
                   GDNConfig(chunk=64, solve="doubling", sub=32)):
        lowered.append((lambda q, k, v, g, b, c=config: _forward(q, k, v, g, b, None, scale=0.1, config=c,
                                                                 emit_summary=False, interpret=False), args[:5]))
    for config in (gdn.default_config(per_key=True), GDNConfig(chunk=32, solve="doubling", sub=32)):
        kda = lambda q, k, v, gk, b, c=config: _forward(q, k, v, None, b, None, gk, scale=0.1,  # noqa: E731
                                                        config=c, emit_summary=True, interpret=False)
        lowered.append((kda, (args[0], args[1], args[2], per_key, args[3])))
    kda = lambda q, k, v, gk, b: _forward(q, k, v, None, b, None, gk, scale=0.1,  # noqa: E731
                                          config=gdn.default_config(per_key=True), emit_summary=True, interpret=False)
    lowered.append((kda, (odd[0], odd[1], odd[2], sd((length - 3, 32, dim), jnp.float32), odd[3])))  # read in place
    for config in (GDNConfig(solve="doubling"), GDNConfig(chunk=32, solve="rows")):  # the other solves, in place
        lowered.append((lambda q, k, v, g, b, c=config: _forward(q, k, v, g, b, None, scale=0.1, config=c,
                                                                 emit_summary=False, interpret=False), odd[:5]))
    cu = sd((6,), jnp.int32)  # 5 segments: the slot-indexed final states need no power-of-two count
    for config in (GDNConfig(), gdn.default_varlen_config(), GDNConfig(packed_reads=False)):
        varlen = lambda q, k, v, cu, g, b, c=config: _varlen(q, k, v, cu, g, None, b, scale=0.1,  # noqa: E731
                                                             config=c, emit_summary=True, interpret=False)
        lowered.append((varlen, (args[0], args[1], args[2], cu, args[3], args[4])))
    for fn, fn_args in lowered:
        text = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=check)(*fn_args).mlir_module()
        assert "xla.gpu.triton" in text
    pairs = sd((4, 2, dim, dim), jnp.float32)
    fold = jax.jit(lambda t, s: cmp.fold_pallas(t, s, config=cmp.FoldConfig(algorithm="bf16x3")))
    prefix = jax.jit(lambda t, s: cmp.prefix_fold_pallas(t, s, config=cmp.FoldConfig(algorithm="bf16x3"), block=2))
    for fn in (fold, prefix):
        assert "xla.gpu.triton" in jax.export.export(fn, platforms=["cuda"], disabled_checks=check)(pairs, pairs) \
            .mlir_module()
    att_args = (sd((100, 16, 256), jnp.bfloat16), sd((700, 2, 256), jnp.bfloat16), sd((700, 2, 256), jnp.bfloat16),
                sd((100,), jnp.int32))
    for config in (pattn.AttentionConfig(), pattn.AttentionConfig(block_q=128, num_warps=8, pack_gqa=True)):
        attend = jax.jit(lambda q, k, v, p, c=config: pattn.positioned_attention(q, k, v, p, scale=0.0625, config=c))
        assert "xla.gpu.triton" in jax.export.export(attend, platforms=["cuda"], disabled_checks=check)(*att_args) \
            .mlir_module()


@pytest.mark.parametrize("length, heads, key_heads, value_dim, block_v, seed",
                         [(128, 2, 1, 128, 64, 0), (192, 2, 2, 64, 32, 1)])
def test_mosaic_gpu_state_pass_equals_the_triton_one(length, heads, key_heads, value_dim, block_v, seed):
    """The state pass under Mosaic GPU (`gdn.mosaic_state`, Pallas's GPU interpreter) and the Triton state pass give
    the reference's outputs and final state (`state_pass_reference`, float32) on the same chunk-local operands within
    their bf16 state dots' rounding, and each other's, with more chunks than slots, grouped key heads, an initial
    state and both column-block widths (the interpreter's time goes with the blocks it runs: 64-wide blocks halve
    them)."""
    rng = np.random.default_rng(seed)
    f = lambda *s: array(rng.standard_normal(s) * 0.3, np.float32)  # noqa: E731
    c, key_dim = 64, 128
    w, u = f(length, heads, key_dim).astype(jnp.bfloat16), f(length, heads, value_dim).astype(jnp.bfloat16)
    k, q = (f(length, key_heads, key_dim).astype(jnp.bfloat16) for _ in range(2))
    gates = -rng.uniform(0, 0.1, (heads, length // c, c)).astype(np.float32)
    b = array(np.cumsum(gates, -1).reshape(heads, length))
    p = (f(heads, length, c) * 0.3).astype(jnp.bfloat16)
    init = f(heads, key_dim, value_dim)
    o, final = mosaic_state.state_pass_mgpu(w, u, k, b, q, p, init, chunk=c, out_dtype=jnp.bfloat16, scale=0.09,
                                            config=mosaic_state.MosaicStateConfig(block_v=block_v), interpret=True)
    config = GDNConfig().resolved(jnp.bfloat16)
    tri_o, tri_final = state_pass(w, u, k, b, q, p, init[None], chunk=c, pieces=1, value_dim=value_dim,
                                  out_dtype=jnp.bfloat16, scale=0.09, config=config, interpret=True)
    assert o.shape == tri_o.shape and o.dtype == jnp.bfloat16 and rel_err(o, tri_o) < 1e-3
    assert rel_err(final, tri_final[0]) < 1e-3
    ref_o, ref_final = gdn_ref.state_pass_reference(w, u, k, b, q, p, init, chunk=c, scale=0.09)
    for got_o, got_final in ((o, final), (tri_o, tri_final[0])):
        assert rel_err(got_o, ref_o) < 1e-2 and rel_err(got_final, ref_final) < 1e-2


@pytest.mark.parametrize("length, group_chunks, heads, key_heads, block_v, seed",
                         [(512, 4, 2, 1, 32, 0), (128, 2, 4, 2, 64, 1), (64, 1, 2, 1, 32, 2)])
def test_mosaic_gpu_transfer_pass_gives_the_group_products(length, group_chunks, heads, key_heads, block_v, seed):
    """The transfer pass's group products under Mosaic GPU (`mosaic_state.transfer_pass_mgpu`, Pallas's GPU
    interpreter) equal Triton's pass over the groups' identity columns within their bf16 rounding, and both are as
    close to the reference (`transfer_pass_reference`, float32) and to a float64 product of the
    A_n = e^{b_last} I - K_n^T diag(e^{b_last - b}) W_n of each group; down to one group of one chunk (a one-chunk
    segment, fewer chunks than shared-memory slots); both column-block widths."""
    rng = np.random.default_rng(seed)
    c, key_dim = 64, 128
    f = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.3, jnp.bfloat16)  # noqa: E731
    w, k = f(length, heads, key_dim), f(length, key_heads, key_dim)
    b = array(np.cumsum(-rng.uniform(0, 0.1, (heads, length // c, c)), -1).reshape(heads, length), np.float32)
    ts = mosaic_state.transfer_pass_mgpu(w, k, b, chunk=c, group_chunks=group_chunks, interpret=True,
                                         config=mosaic_state.MosaicStateConfig(block_v=block_v))
    groups = length // c // group_chunks
    eye = jnp.broadcast_to(jnp.eye(key_dim, dtype=jnp.float32), (groups, heads, key_dim, key_dim))
    _, ref = state_pass(w, None, k, b, None, None, eye, chunk=c, pieces=groups, value_dim=key_dim,
                        out_dtype=jnp.float32, scale=1.0, config=GDNConfig().resolved(jnp.bfloat16), interpret=True)
    assert ts.shape == (groups, heads, key_dim, key_dim) and ts.dtype == jnp.float32
    assert rel_err(ts, ref) < 2e-3
    exact = gdn_ref.transfer_pass_reference(w, k, b, chunk=c, group_chunks=group_chunks)
    assert rel_err(ts, exact) < 2e-2 and rel_err(ts, exact) < 1.5 * rel_err(ref, exact) + 1e-4
    wd, kd, bd = (np.asarray(x, np.float64) for x in (w, k, b))
    for gi in range(groups):
        for h in range(heads):
            prod = np.eye(key_dim)
            for n in range(gi * group_chunks, (gi + 1) * group_chunks):
                r, last = slice(n * c, (n + 1) * c), bd[h, n * c + c - 1]
                kn = kd[r, h // (heads // key_heads)]
                prod = (np.exp(last) * np.eye(key_dim) - kn.T @ (np.exp(last - bd[h, r])[:, None] * wd[r, h])) @ prod
            err, ref_err = rel_err(ts[gi, h], prod), rel_err(ref[gi, h], prod)
            assert err < 2e-2 and err < 1.5 * ref_err + 1e-4
    with pytest.raises(ValueError, match="whole groups"):
        mosaic_state.transfer_pass_mgpu(w, k, b, chunk=c, group_chunks=5, interpret=True)


def test_gdn_forward_under_vmap_lowers_through_the_mosaic_gpu_kernels(monkeypatch):
    """The models vmap the linear-attention core over the batch: under vmap, `plgpu.kernel` prepends a grid axis,
    so every Mosaic GPU kernel of the forward must keep its own grid within two axes. The batched forward, with and
    without (T, S), lowers for CUDA on the CPU through the chunk-local kernel, the state pass and the transfer pass
    (the Hopper check is patched so that "auto" routes (T, S) there as it would on the GPU)."""
    monkeypatch.setattr(platform, "is_hopper", lambda: True)
    sd = jax.ShapeDtypeStruct
    batch, length, dim = 2, 512, 128
    args = (sd((batch, length, 2, dim), jnp.bfloat16), sd((batch, length, 2, dim), jnp.bfloat16),
            sd((batch, length, 4, dim), jnp.bfloat16), sd((batch, length, 4), jnp.float32),
            sd((batch, length, 4), jnp.float32))
    config = GDNConfig(state_lowering="mosaic", locals_lowering="mosaic", transfer_group=2)
    kernels = ("gdn_mgpu_chunk_locals", "gdn_mgpu_state_pass", "gdn_mgpu_transfer_pass")
    for emit in (False, True):
        fn = jax.jit(jax.vmap(lambda q, k, v, g, b, e=emit: _forward(q, k, v, g, b, None, scale=dim**-0.5,
                                                                     config=config, emit_summary=e,
                                                                     interpret=False)))
        text = jax.export.export(fn, platforms=["cuda"])(*args).mlir_module()
        assert [name in text for name in kernels] == [True, True, emit]


@pytest.mark.parametrize("cluster", [1, 2])
def test_mosaic_gpu_transfer_pass_lowers_with_clusters(cluster):
    """The transfer pass lowers for CUDA on the CPU with and without clusters (the multicast form runs only on the
    GPU), and `GDNConfig()` routes the forward's (T, S) through it only on a Hopper GPU."""
    sd = jax.ShapeDtypeStruct
    args = (sd((512, 4, 128), jnp.bfloat16), sd((512, 2, 128), jnp.bfloat16), sd((4, 512), jnp.float32))
    config = mosaic_state.MosaicStateConfig(cluster=cluster)
    fn = jax.jit(lambda *a: mosaic_state.transfer_pass_mgpu(*a, chunk=64, group_chunks=4, config=config))
    assert "gdn_mgpu_transfer_pass" in jax.export.export(fn, platforms=["cuda"])(*args).mlir_module()
    b = jnp.zeros((4, 512), jnp.float32)
    assert not use_mosaic_transfer(GDNConfig().resolved(jnp.bfloat16), 64, 128, b, None, interpret=False)
    pinned = GDNConfig(state_lowering="mosaic").resolved(jnp.bfloat16)  # follows the state pass's pin, off Hopper too
    assert use_mosaic_transfer(pinned, 64, 128, b, None, interpret=False)
    assert not use_mosaic_transfer(pinned, 64, 128, b, None, interpret=True)
    assert not use_mosaic_transfer(pinned, 64, 128, jnp.zeros((512, 4, 128)), None, interpret=False)  # per-key


@pytest.mark.parametrize("cluster, value_dim", [(1, 128), (2, 128), (4, 128), (2, 32)])
def test_mosaic_gpu_state_pass_lowers_with_clusters(cluster, value_dim):
    """The state pass lowers for CUDA on the CPU with its column blocks in clusters of 1, 2 and 4 (multicast W, K,
    Q, P; the interpreter has no cluster barriers, so only the GPU runs these forms), and a head with a single
    column block falls back to no cluster."""
    sd = jax.ShapeDtypeStruct
    length, heads, key_heads = 256, 4, 2
    args = (sd((length, heads, 128), jnp.bfloat16), sd((length, heads, value_dim), jnp.bfloat16),
            sd((length, key_heads, 128), jnp.bfloat16), sd((heads, length), jnp.float32),
            sd((length, key_heads, 128), jnp.bfloat16), sd((heads, length, 64), jnp.bfloat16),
            sd((heads, 128, value_dim), jnp.float32))
    config = mosaic_state.MosaicStateConfig(cluster=cluster)
    fn = jax.jit(lambda *a: mosaic_state.state_pass_mgpu(*a, chunk=64, out_dtype=jnp.bfloat16, scale=0.1,
                                                         config=config))
    assert "mosaic_gpu" in jax.export.export(fn, platforms=["cuda"])(*args).mlir_module()
    with pytest.raises(ValueError, match="cluster must be"):
        mosaic_state.MosaicStateConfig(cluster=3)
    with pytest.raises(ValueError, match="semantics must be one of"):
        mosaic_state.MosaicStateConfig(semantics="lanes")


def test_mosaic_gpu_state_pass_lowers_and_refuses_what_it_cannot_run():
    """`GDNConfig(state_lowering="mosaic")` lowers the forward for CUDA on the CPU (the Mosaic GPU state pass beside
    the Triton chunk-local kernel, with and without (T, S)), and refuses launches the kernel does not take."""
    sd = jax.ShapeDtypeStruct
    length, dim = 256, 128
    args = (sd((length, 16, dim), jnp.bfloat16), sd((length, 16, dim), jnp.bfloat16),
            sd((length, 32, dim), jnp.bfloat16), sd((length, 32), jnp.float32), sd((length, 32), jnp.float32))
    config = GDNConfig(state_lowering="mosaic")
    for emit in (False, True):
        fn = jax.jit(lambda q, k, v, g, b, e=emit: _forward(q, k, v, g, b, None, scale=dim**-0.5, config=config,
                                                            emit_summary=e, interpret=False))
        text = jax.export.export(fn, platforms=["cuda"], disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args).mlir_module()
        assert "mosaic_gpu" in text and "xla.gpu.triton" in text
    q, k, v, g, beta = inputs(100, key_heads=1, heads=2, dim=128, dtype=jnp.bfloat16)
    for bad in (GDNConfig(state_lowering="mosaic", chunk=32), GDNConfig(state_lowering="mosaic", pieces=2)):
        with pytest.raises(ValueError, match="state_lowering|Triton state pass"):
            gdn_forward(q, k, v, g=g, beta=beta, config=bad, interpret=True)
    mosaic = GDNConfig(state_lowering="mosaic")
    with pytest.raises(ValueError, match="bf16 state dots and outputs"):  # float32 inputs: float32 state dots
        gdn_forward(*(x.astype(jnp.float32) for x in (q[:64], k[:64], v[:64])), g=g[:64], beta=beta[:64],
                    config=mosaic, interpret=True)
    with pytest.raises(ValueError, match="interpret mode"):
        gdn_forward(q[:64], k[:64], v[:64], g=g[:64], beta=beta[:64], config=mosaic, interpret=True)
    with pytest.raises(ValueError, match="state_lowering must be one of"):
        GDNConfig(state_lowering="cuda")


@pytest.mark.parametrize("length, blocks, gate, warpgroups, seed",
                         [(512, 2, True, 2, 0), (128, 132, True, 1, 2), (320, 4, True, 2, 3), (320, 6, False, 2, 4)])
def test_mosaic_gpu_chunk_locals_match_the_triton_kernel(length, blocks, gate, warpgroups, seed):
    """The chunk-local kernel under Mosaic GPU (`gdn.mosaic_chunk_local`, Pallas's GPU interpreter) gives the Triton
    kernel's P (to float32 rounding) and W, U within bf16 rounding, and its W, U are as close to the reference
    (`chunk_locals_reference`, float32) as Triton's are: runs of 8 chunks through 2 slots (a head's chunks in one
    run), runs of one chunk (2
    runs a head), 5 chunks a head as runs of 3 and 2 (odd turns for two compute warpgroups) and as 2, 2 and 1 (runs
    of 2; a last run shorter than the slots), one or two compute warpgroups, grouped key heads, with and without a
    gate. (The GPU interpreter's time goes with the chunks it runs, hence the few and short sequences.)"""
    heads, dim, c = 2, 128, 64
    q, k, v, g, beta = inputs(length, key_heads=1, heads=heads, dim=dim, seed=seed, gate=gate, dtype=jnp.bfloat16)
    b = chunk_cumsum(g, length, heads, c)
    beta_t = beta.astype(jnp.float32).T
    scale = dim**-0.5
    config = GDNConfig().resolved(jnp.bfloat16)
    ref = chunk_locals(q, k, v, b, beta_t, chunk=c, scale=scale, inter_dtype=jnp.bfloat16, config=config,
                       interpret=True)
    launch = mosaic_chunk_local.MosaicLocalsConfig(blocks=blocks, warpgroups=warpgroups)
    out = mosaic_chunk_local.chunk_locals_mgpu(q, k, v, b, beta_t, chunk=c, scale=scale, config=launch,
                                               interpret=True)
    exact = gdn_ref.chunk_locals_reference(q, k, v, b, beta_t, chunk=c, scale=scale)
    for name, mine, theirs, truth in zip("pwu", out, ref, exact):
        assert mine.shape == theirs.shape and mine.dtype == jnp.bfloat16, name
        assert rel_err(mine, theirs) < (1e-5 if name == "p" else 1e-2), name
        assert rel_err(mine, truth) <= 1.25 * rel_err(theirs, truth) + 1e-4, name


def test_mosaic_gpu_chunk_locals_lower_and_refuse_what_they_cannot_run():
    """The Mosaic GPU chunk-local kernel lowers for CUDA on the CPU (2 and 4 slots, one compute warpgroup, the
    bisecting variants, and inside the forward with `locals_lowering="mosaic"`), and the forward refuses launches it
    does not take instead of running Triton."""
    sd = jax.ShapeDtypeStruct
    length, dim = 1024, 128
    args = (sd((length, 2, dim), jnp.bfloat16), sd((length, 2, dim), jnp.bfloat16),
            sd((length, 4, dim), jnp.bfloat16), sd((4, length), jnp.float32), sd((4, length), jnp.float32))
    launch = mosaic_chunk_local.MosaicLocalsConfig
    for config in (launch(), launch(stages=2), launch(warpgroups=1),
                   launch(stages=2, smem_operands=True, transposed_keys=True, set_registers=False)):
        fn = jax.jit(lambda *a, c=config: mosaic_chunk_local.chunk_locals_mgpu(*a, chunk=64, scale=0.1, config=c))
        assert "mosaic_gpu" in jax.export.export(fn, platforms=["cuda"])(*args).mlir_module()
    config = GDNConfig(locals_lowering="mosaic")
    fwd = jax.jit(lambda q, k, v, g, b: _forward(q, k, v, g, b, None, scale=dim**-0.5, config=config,
                                                 emit_summary=False, interpret=False))
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")  # the state pass off Hopper
    text = jax.export.export(fwd, platforms=["cuda"], disabled_checks=[triton])(
        *args[:3], sd((length, 4), jnp.float32), sd((length, 4), jnp.float32)).mlir_module()
    assert "gdn_mgpu_chunk_locals" in text
    q, k, v, g, beta = inputs(128, key_heads=1, heads=2, dim=128, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="locals_lowering='mosaic' takes"):
        gdn_forward(q, k, v, g=g, beta=beta, config=dataclasses.replace(config, chunk=32), interpret=True)
    with pytest.raises(ValueError, match="interpret mode"):
        gdn_forward(q, k, v, g=g, beta=beta, config=config, interpret=True)
    with pytest.raises(ValueError, match="locals_lowering must be"):
        GDNConfig(locals_lowering="fast")
    with pytest.raises(ValueError, match="stages must be 2 or 4"):
        mosaic_chunk_local.MosaicLocalsConfig(stages=3)
    with pytest.raises(ValueError, match="warpgroups must be 1 or 2"):
        mosaic_chunk_local.MosaicLocalsConfig(warpgroups=3)
    with pytest.raises(ValueError, match="semantics must be one of"):
        mosaic_chunk_local.MosaicLocalsConfig(semantics="thread")
    # "auto" (the default) takes Triton where the Mosaic GPU kernel cannot run: interpret mode, and an odd chunk count
    auto = GDNConfig()
    assert auto.locals_lowering == "auto"
    ref_o, ref_s = gdn_forward(q, k, v, g=g, beta=beta, config=GDNConfig(locals_lowering="triton"), interpret=True)
    o, s = gdn_forward(q, k, v, g=g, beta=beta, config=auto, interpret=True)
    assert rel_err(o, ref_o) == 0.0 and rel_err(s, ref_s) == 0.0


def test_linear_attn_impl_dispatch():
    q, k, v, g, beta = inputs(21, key_heads=2, seed=6)
    o, s = la.chunked(q, k, v, g=g, beta=beta, impl="pallas", chunk_size=16)
    ref_o, ref_s = core.chunked(q, k, v, g=g, beta=beta, impl="xla")
    assert rel_err(o, ref_o) < TOL32 and rel_err(s, ref_s) < TOL32
    o_auto, _ = la.chunked(q, k, v, g=g, beta=beta, impl="auto")  # CPU: the XLA path
    assert rel_err(o_auto, ref_o) < TOL32
    gk = per_key_gates(21, 2, 16, seed=7)  # KDA through the same dispatch
    o, s = la.chunked(q, k, v, gk=gk, beta=beta, impl="pallas", chunk_size=16)
    ref_o, ref_s = core.recurrent(q, k, v, gk=gk, beta=beta)
    assert rel_err(o, ref_o) < TOL32 and rel_err(s, ref_s) < TOL32
    o12, _ = la.chunked(q, k, v[..., :12], g=g, impl="pallas")  # a value width the tiles lack: padded inside
    assert rel_err(o12, core.chunked(q, k, v[..., :12], g=g, impl="xla")[0]) < TOL32
    with pytest.raises(ValueError, match="empty"):
        la.chunked(q[:0], k[:0], v[:0], g=g[:0], impl="pallas")
