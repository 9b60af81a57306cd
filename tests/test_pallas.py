"""Pallas kernels (hypic_jax.pallas) in interpret mode on the CPU against the transfer-operator core.

Shapes are tiny and few (interpret-mode compilation, not arithmetic, is the cost); they still cover odd lengths,
several chunk sizes, grouped key heads, an initial state, the transfer-operator split into pieces, the emitted
(T_C, S(C|0)), the solve variants, per-key decays, packed segments and the decode step. A last test lowers every
kernel to Triton IR for the GPU (no GPU needed) so that CPU CI also catches constructs the Triton lowering rejects.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hypic_jax import linear_attn as la
from hypic_jax.pallas import attention as pattn
from hypic_jax.pallas import compose as cmp
from hypic_jax.pallas import decode as dec
from hypic_jax.pallas import gdn
from hypic_jax.pallas.gdn import GDNConfig, _forward, gdn_forward

from families import array, core, examples, interpreter_threads_compiled_once, jitted, method

TOL32 = 1e-5
TOL16 = 2e-3


@pytest.fixture(autouse=True, scope="module")
def _mosaic_gpu_interpreter_compiles_each_thread_program_once():
    """The Mosaic GPU kernels run in Pallas's GPU interpreter, which would compile a warpgroup's program anew for
    every grid point (`families.interpreter_threads_compiled_once`)."""
    with interpreter_threads_compiled_once():
        yield


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


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


# The references below are each one compiled program per argument layout (`families.jitted`): run op by op, the
# core's recurrence and summaries compile every op anew for every shape and cost several times the kernel's run.
@jitted
def reference(q, k, v, g=None, beta=None, init=None, scale=1.0, gk=None):
    """The token-by-token recurrence in float32, key heads repeated over the value heads."""
    group = v.shape[1] // k.shape[1]
    up = lambda x: jnp.repeat(x.astype(jnp.float32), group, 1)  # noqa: E731
    return la.recurrent(up(q), up(k), v.astype(jnp.float32), g=g, gk=gk, beta=beta, initial_state=init, scale=scale)


@jitted
def reference_summary(k, v, g=None, gk=None, beta=None, chunk_size=16):
    """`la.summarize` with key heads repeated over the value heads."""
    return la.summarize(jnp.repeat(k, v.shape[1] // k.shape[1], 1), v, g=g, gk=gk, beta=beta, chunk_size=chunk_size)


# (length, chunk, pieces, block_v, with initial state): odd lengths, chunks 16/32/64, direct and split.
CASES = [
    (37, 16, 1, 16, False),
    (100, 32, 3, 16, True),
    (45, 64, 1, 16, True),
]


@pytest.mark.parametrize("length,chunk,pieces,block_v,with_init", CASES)
def test_gated_delta_float32_matches_recurrent(length, chunk, pieces, block_v, with_init):
    q, k, v, g, beta = inputs(length)
    init = array(np.random.default_rng(9).standard_normal((2, 16, 16)) * 0.3, np.float32) if with_init else None
    config = GDNConfig(chunk=chunk, pieces=pieces, block_v=block_v)
    o, s, summary = gdn_forward(q, k, v, g=g, beta=beta, initial_state=init, scale=0.5, config=config,
                                emit_summary=True, interpret=True)
    ref_o, ref_s = reference(q, k, v, g, beta, init, scale=0.5)
    assert rel(o, ref_o) < TOL32 and rel(s, ref_s) < TOL32
    ref_sum = reference_summary(k, v, g=g, beta=beta, chunk_size=16)
    assert summary.form == "dense"
    assert rel(summary.transfer, ref_sum.transfer) < TOL32
    assert rel(summary.state, ref_sum.state) < TOL32


def test_delta_net_and_decay_only():
    q, k, v, _, beta = inputs(29, key_heads=2, seed=1, gate=False)  # DeltaNet: g = None
    o, s = gdn_forward(q, k, v, beta=beta, config=GDNConfig(chunk=16, block_v=16), interpret=True)
    ref_o, ref_s = reference(q, k, v, None, beta)
    assert rel(o, ref_o) < TOL32 and rel(s, ref_s) < TOL32
    q, k, v, g, _ = inputs(29, key_heads=2, seed=2, delta=False)  # scalar decay only (RetNet/lightning/Mamba2)
    o, s = gdn_forward(q, k, v, g=g, config=GDNConfig(chunk=16, block_v=16), interpret=True)
    ref_o, ref_s = reference(q, k, v, g, None)
    assert rel(o, ref_o) < TOL32 and rel(s, ref_s) < TOL32


def test_bfloat16_inputs():
    q, k, v, g, beta = inputs(37, seed=3, dtype=jnp.bfloat16)
    config = GDNConfig(chunk=16, block_v=16, locals_precision="ieee", state_precision="ieee", inter_dtype="float32")
    o, s = gdn_forward(q, k, v, g=g, beta=beta, config=config, interpret=True)
    assert o.dtype == jnp.bfloat16
    ref_o, ref_s = reference(q, k, v, g, beta)
    assert rel(o, ref_o) < TOL16 and rel(s, ref_s) < TOL16


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
        assert rel(o[i], ref_o) < TOL32 and rel(s[i], ref_s) < TOL32


def test_compose_fold_kernel():
    rng = np.random.default_rng(5)
    n, batch, dim = 7, 3, 16
    t = array(rng.standard_normal((n, batch, dim, dim)) * 0.25, np.float32)
    s = array(rng.standard_normal((n, batch, dim, dim)), np.float32)
    summaries = la.Summary("dense", s, t)
    ref_states = core.prefix_states(summaries)
    total_t, total_s = cmp.compose_all(t, s, "f32")
    assert rel(total_s, ref_states[-1]) < TOL32
    product, none = cmp.compose_all(t, None, "f32")  # the transfers alone: T_7 ... T_1, an odd count
    want = np.eye(dim)
    for i in range(n):
        want = np.asarray(t[i], np.float64) @ want
    assert none is None and rel(product, want) < TOL32
    assert rel(cmp.prefix_states(t, s, None, "f32"), ref_states) < TOL32
    pt, ps = cmp.prefix_pairs(t, s, "f32")
    assert rel(ps, ref_states) < TOL32 and rel(pt[-1], total_t) < TOL32
    for with_t in (True, False):
        kt, ks = cmp.fold_pallas(t, s, with_transfer=with_t, config=cmp.FoldConfig(block_w=16, algorithm="f32"),
                                 interpret=True)
        assert rel(ks, total_s) < TOL32
        if with_t:
            assert kt.shape == total_t.shape and rel(kt, total_t) < TOL32


def _bf16(x):
    """`x` rounded to float32, then to bfloat16 (to nearest even, as XLA does), in float64: on the host."""
    return np.asarray(x, np.float32).astype(jnp.bfloat16).astype(np.float64)


def _split_fold_case(n, batch, key_dim, value_dim, seed):
    """Random pairs, their split operands, the fold's bf16x3 arithmetic emulated in float64 with explicit bfloat16
    roundings (X <- T_hi X_hi + T_hi X_lo + T_lo X_hi + S, the first step a load) and the exact float64 fold:
    (t, s, split operands, (emulated T, S), (exact T, S))."""
    rng = np.random.default_rng(seed)
    t = (rng.standard_normal((n,) + batch + (key_dim, key_dim)) * 0.9 / np.sqrt(key_dim)).astype(np.float32)
    s = rng.standard_normal((n,) + batch + (key_dim, value_dim)).astype(np.float32)
    t_hi, t_lo, s_t = cmp.split_operands(array(t), array(s))
    assert s_t.shape == (n,) + batch + (value_dim, key_dim) and t_hi.dtype == t_lo.dtype == jnp.bfloat16
    th, tl = np.asarray(t_hi, np.float64), np.asarray(t_lo, np.float64)
    exact_t, exact_s = np.broadcast_to(np.eye(key_dim), batch + (key_dim, key_dim)), np.zeros(s.shape[1:])
    emu_t, emu_s = exact_t, exact_s

    def emulate(x, i):
        hi = _bf16(x)
        lo = _bf16(x - hi)
        return th[i] @ hi + th[i] @ lo + tl[i] @ hi

    for i in range(n):
        exact_t, exact_s = t[i] @ exact_t, t[i] @ exact_s + s[i]
        emu_t = th[i] + tl[i] if i == 0 else np.asarray(emulate(emu_t, i), np.float32)  # first step: a load
        emu_s = s[i] if i == 0 else np.asarray(emulate(emu_s, i) + s[i], np.float32)
    return t, s, (t_hi, t_lo, s_t), (emu_t, emu_s), (exact_t, exact_s)


@examples(5)
@given(n=st.integers(1, 6), batch=st.sampled_from([(1,), (3,), (2, 2)]), key_dim=st.sampled_from([16, 32]),
       value_dim=st.sampled_from([16, 32, 48]), block_w=st.sampled_from([16, 32, 128]), with_t=st.booleans(),
       seed=st.integers(0, 2**16))
def test_split_fold_is_bf16x3_of_the_pairs(n, batch, key_dim, value_dim, block_w, with_t, seed):
    """`fold_split_pallas` on `split_operands` equals the same bf16x3 arithmetic done in float64 with explicit
    bfloat16 roundings (X <- T_hi X_hi + T_hi X_lo + T_lo X_hi + S) within 5e-6 (the kernel accumulates in float32,
    and a last-bit difference can flip the next step's rounding of X_lo: 1.8e-6 at worst over 12 random cases), and
    the exact float64 fold to bf16x3's accuracy (1.1e-5 at worst there); the composed transfer likewise. Dropping
    a correction term would be off by ~1e-3."""
    t, s, (t_hi, t_lo, s_t), (emu_t, emu_s), (exact_t, exact_s) = _split_fold_case(n, batch, key_dim, value_dim,
                                                                                   seed)
    config = cmp.FoldConfig(block_w=block_w, num_warps=4, num_stages=2)
    got_t, got_s = cmp.fold_split_pallas(t_hi, t_lo, s_t, with_transfer=with_t, config=config, interpret=True)
    assert got_s.shape == s.shape[1:] and rel(got_s, emu_s) < 5e-6 and rel(got_s, exact_s) < 5e-5
    if with_t:
        assert got_t.shape == t.shape[1:] and rel(got_t, emu_t) < 5e-6 and rel(got_t, exact_t) < 5e-5
    else:
        assert got_t is None


@pytest.mark.parametrize("n, batch, key_dim, value_dim, block_w, with_initial",
                         [(5, (2,), 32, 48, 16, False), (4, (1, 2), 16, 16, 128, True), (1, (3,), 32, 16, 32, True),
                          (1, (2,), 16, 32, 16, False)])
def test_split_prefix_fold_gives_every_state(n, batch, key_dim, value_dim, block_w, with_initial):
    """`prefix_fold_split_pallas`: every state S_i = T_i S_{i-1} + S_i (from an initial state or zeros), transposed
    like its input, within bf16x3's accuracy of the float64 fold, and its last state that of `fold_split_pallas`."""
    rng = np.random.default_rng(n + key_dim + value_dim)
    t = (rng.standard_normal((n,) + batch + (key_dim, key_dim)) * 0.9 / np.sqrt(key_dim)).astype(np.float32)
    s = rng.standard_normal((n,) + batch + (key_dim, value_dim)).astype(np.float32)
    init = rng.standard_normal(batch + (key_dim, value_dim)).astype(np.float32) if with_initial else None
    state = np.zeros(s.shape[1:]) if init is None else init.astype(np.float64)
    want = []
    for i in range(n):
        state = t[i] @ state + s[i]
        want.append(state)
    want = np.stack(want)
    t_hi, t_lo, s_t = cmp.split_operands(array(t), array(s))
    config = cmp.FoldConfig(block_w=block_w, num_warps=4, num_stages=2)
    got = cmp.prefix_fold_split_pallas(t_hi, t_lo, s_t, None if init is None else array(init), config=config,
                                       interpret=True)
    assert got.shape == (n,) + batch + (value_dim, key_dim)
    got = np.swapaxes(np.asarray(got), -1, -2)
    assert max(rel(got[i], want[i]) for i in range(n)) < 5e-5
    if init is None:
        assert rel(got[0], s[0]) == 0.0  # the first state is S_1 itself
        _, last = cmp.fold_split_pallas(t_hi, t_lo, s_t, config=config, interpret=True)
        assert rel(got[-1], last) < 1e-6


def test_split_operands_round_and_keep_the_rest():
    """hi is T rounded to bfloat16, lo carries the rest (a float32 -> bfloat16 -> float32 round trip that a
    compiler simplified away would leave lo = 0), and the pair holds T to about 2^-16 relative."""
    rng = np.random.default_rng(2)
    t = rng.standard_normal((3, 64, 64)).astype(np.float32)
    hi, lo, s_t = cmp.split_operands(array(t), array(t[..., :32]))
    hi, lo = np.asarray(hi, np.float64), np.asarray(lo, np.float64)
    assert np.all(np.abs(hi - t) <= 2.0**-8 * np.abs(t))  # within half a bfloat16 ulp (8 significant bits)
    assert np.mean(lo != 0) > 0.9
    assert np.all(np.abs(hi + lo - t) <= 2.0**-16 * np.abs(t))
    assert np.array_equal(np.asarray(s_t), np.swapaxes(t[..., :32], -1, -2))
    # rounding, not truncation: the split keeps one more bit than cutting the top 16 bits off would
    truncated = (t.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32).astype(np.float64)
    assert np.max(np.abs(hi - t) / np.abs(t)) < np.max(np.abs(truncated - t) / np.abs(t))


@pytest.mark.parametrize("n, batch, value_dim, with_t, stages", [(3, (1,), 128, True, 2), (1, (2,), 128, True, 2),
                                                                  (4, (1,), 256, False, 1), (5, (1,), 128, True, 3)])
def test_split_fold_mosaic_gpu_is_bf16x3_of_the_pairs(n, batch, value_dim, with_t, stages):
    """The Mosaic GPU fold (`compose_mgpu`, Pallas's GPU interpreter: its warpgroups, TMA copies, slots and
    barriers simulated) gives the emulated bf16x3 fold and the exact one like the Triton fold: one step, several
    state blocks, more steps than slots, one slot or three. Its transfer starts from the identity instead of
    loading T_1, which the split reproduces exactly (hi = I, lo = 0)."""
    from hypic_jax.pallas import compose_mgpu

    key_dim = 128
    _, s, operands, (emu_t, emu_s), (exact_t, exact_s) = _split_fold_case(n, batch, key_dim, value_dim, seed=n)
    got_t, got_s = compose_mgpu.fold_split_mgpu(*operands, with_transfer=with_t, interpret=True,
                                                config=compose_mgpu.MosaicFoldConfig(stages=stages))
    assert got_s.shape == s.shape[1:] and rel(got_s, emu_s) < 5e-6 and rel(got_s, exact_s) < 5e-5
    if with_t:
        assert got_t.shape == batch + (key_dim, key_dim)
        assert rel(got_t, emu_t) < 5e-6 and rel(got_t, exact_t) < 5e-5
    else:
        assert got_t is None
    # the dispatcher: "auto" on the CPU is the Triton fold, and both agree
    auto_t, auto_s = cmp.fold_split(*operands, with_transfer=with_t, interpret=True)
    assert rel(auto_s, got_s) < 5e-6 and (not with_t or rel(auto_t, got_t) < 5e-6)


@pytest.mark.parametrize("n, value_dim, with_initial", [(3, 128, False), (4, 256, True), (1, 128, True)])
def test_split_prefix_fold_mosaic_gpu_gives_every_state(n, value_dim, with_initial):
    """The Mosaic GPU prefix fold (GPU interpreter) writes every state S_i = T_i S_{i-1} + S_i, from zeros or an
    initial state, transposed like its input: within bf16x3's accuracy of the float64 fold, and equal to the Triton
    prefix fold's."""
    from hypic_jax.pallas import compose_mgpu

    key_dim, batch = 128, (2,)
    t, s, operands, _, _ = _split_fold_case(n, batch, key_dim, value_dim, seed=10 + n)
    rng = np.random.default_rng(n)
    init = rng.standard_normal(batch + (key_dim, value_dim)).astype(np.float32) if with_initial else None
    got = compose_mgpu.prefix_fold_split_mgpu(*operands, None if init is None else array(init), interpret=True)
    assert got.shape == (n,) + batch + (value_dim, key_dim)
    x = np.zeros(batch + (key_dim, value_dim)) if init is None else init.astype(np.float64)
    for i in range(n):
        x = t[i].astype(np.float64) @ x + s[i]
        assert rel(np.swapaxes(np.asarray(got[i]), -1, -2), x) < 5e-5
    triton = cmp.prefix_fold_split(*operands, None if init is None else array(init), interpret=True)
    assert rel(got, triton) < 5e-6  # "auto" on the CPU: the Triton prefix fold


def test_split_fold_rejects_bad_operands():
    t = jnp.zeros((2, 3, 16, 16), jnp.bfloat16)
    s = jnp.zeros((2, 3, 32, 16), jnp.float32)
    with pytest.raises(ValueError, match="bf16x3"):
        cmp.fold_split_pallas(t, t, s, config=cmp.FoldConfig(algorithm="f32"), interpret=True)
    with pytest.raises(ValueError, match="split operands disagree"):
        cmp.fold_split_pallas(t, t, jnp.zeros((2, 3, 16, 32), jnp.float32), interpret=True)  # S not transposed
    with pytest.raises(ValueError, match="split operands disagree"):
        cmp.fold_split_pallas(t.astype(jnp.float32), t, s, interpret=True)
    from hypic_jax.pallas import compose_mgpu

    with pytest.raises(ValueError, match="multiples of 128"):  # K = 16: no whole 128-row blocks for Mosaic GPU
        compose_mgpu.fold_split_mgpu(t, t, s, interpret=True)
    with pytest.raises(ValueError, match="lowering must be one of"):
        cmp.fold_split(t, t, s, lowering="cuda", interpret=True)
    with pytest.raises(ValueError, match="lowering must be one of"):
        cmp.prefix_fold_split(t, t, s, lowering="cuda", interpret=True)


def _scattered(noise, slots, rows):
    """`noise` as float32 with `rows` written at `slots` (a pool whose other rows hold noise), built on the host."""
    pool = np.asarray(noise, np.float32)
    pool[slots] = np.asarray(rows)
    return array(pool)


# each family with one shape and each shape with one family (the delta rule, whose seams are the kernel's dense
# chunk products, with two): the shapes vary the kernel's loop bounds, the families its gates
@pytest.mark.parametrize("family, n, seam, batch_shape, width", [
    ("gated_delta_net", 5, 3, (2,), 16), ("kda", 1, 8, (1, 2), 32), ("gla", 4, 17, (3,), 16),
    ("gated_delta_net", 1, 8, (1, 2), 32)])
def test_span_fold_kernel_equals_composing_each_seam_with_its_interior(family, n, seam, batch_shape, width):
    """Groups (a fresh seam as one chunk step, then a dense interior) folded by the kernel equal the float64 fold
    of the composed pairs (seam summary, then interior): the seam enters as a chunk step, never as a matrix."""
    from families import make_family

    dim = 16
    rng = np.random.default_rng(n * seam + width)
    heads = int(np.prod(batch_shape))
    seams = [make_family(family, seed=10 * i + n, length=seam, heads=heads, key_dim=dim, value_dim=width)
             for i in range(n)]
    steps = [method.chunk_step(x) for x in seams]  # per group (w [H, c, K], u, k_to_end, decay [H, K])
    stack = lambda j: jnp.stack([st[j] for st in steps]).reshape((n,) + batch_shape + steps[0][j].shape[1:])  # noqa: E731
    w, u, kt, d = (stack(j) for j in range(4))
    t = array(rng.standard_normal((n,) + batch_shape + (dim, dim)) / np.sqrt(dim), np.float32)
    s = array(rng.standard_normal((n,) + batch_shape + (dim, width)), np.float32)
    want, state = [], np.zeros((heads, dim, width))
    for i in range(n):  # float64: the seam's dense summary, then the interior
        summary = method.summarize(seams[i], chunk_size=32)
        ts = np.asarray(core.dense_transfer(summary), np.float64)
        state = ts @ state + np.asarray(summary.state, np.float64)
        state = np.asarray(t[i], np.float64).reshape(heads, dim, dim) @ state + np.asarray(
            s[i], np.float64).reshape(heads, dim, width)
        want.append(state.reshape(batch_shape + (dim, width)))
    want = np.stack(want)
    got = cmp.span_fold_pallas(w, u, kt, d, t, s, config=cmp.FoldConfig(block_w=16, algorithm="f32"), interpret=True)
    assert got.shape == (n,) + batch_shape + (dim, width)
    assert rel(got, want) < TOL32
    assert rel(cmp.span_fold_reference(w, u, kt, d, t, s), want) < TOL32
    # the interiors read in place from an entry pool: scattered over a larger pool whose other rows hold noise
    capacity = n + 3
    slots = rng.permutation(capacity)[:n].astype(np.int32)
    pool_t = _scattered(rng.standard_normal((capacity,) + t.shape[1:]), slots, t)
    pool_s = _scattered(rng.standard_normal((capacity,) + s.shape[1:]), slots, s)
    for step in ("nested", "split"):
        pooled = cmp.span_fold_pallas(w, u, kt, d, pool_t, pool_s, array(slots),
                                      config=cmp.FoldConfig(block_w=16, algorithm="f32", seam_step=step),
                                      interpret=True)
        assert rel(pooled, want) < TOL32
        # incoming=True: the state before each group (zero first) and the state after the last one
        before, final = cmp.span_fold_pallas(w, u, kt, d, pool_t, pool_s, array(slots),
                                             config=cmp.FoldConfig(block_w=16, algorithm="f32", seam_step=step),
                                             interpret=True, incoming=True)
        assert before.shape == want.shape and final.shape == want.shape[1:]
        assert not np.asarray(before[0]).any()
        assert rel(before[1:], want[:-1]) < TOL32 and rel(final, want[-1]) < TOL32
    assert rel(cmp.span_fold_reference(w, u, kt, d, pool_t, pool_s, slots=array(slots)), want) < TOL32
    # in-kernel outputs: each seam's outputs from the state before its group equal `chunked` from that state
    chunks = [method.span_chunk(x) for x in seams]
    q_dec = jnp.stack([ch.q_decayed for ch in chunks]).reshape(w.shape)
    scores = jnp.stack([ch.scores for ch in chunks]).reshape(w.shape[:-1] + (seam,))
    before = [np.zeros((heads, dim, width))] + [x.reshape(heads, dim, width) for x in want[:-1]]
    want_out = np.stack([np.moveaxis(np.asarray(method.chunked(x, initial_state=array(b, np.float32),
                                                               chunk_size=32)[0]), 0, 1) / x.scale
                         for x, b in zip(seams, before)]).reshape((n,) + batch_shape + (seam, width))
    out, final = cmp.span_fold_pallas(w, u, kt, d, pool_t, pool_s, array(slots),
                                      config=cmp.FoldConfig(block_w=16, algorithm="f32"), interpret=True,
                                      q_decayed=q_dec, scores=scores)
    assert out.shape == want_out.shape and rel(out, want_out) < TOL32 and rel(final, want[-1]) < TOL32
    ref_out, ref_final = cmp.span_fold_reference(w, u, kt, d, pool_t, pool_s, slots=array(slots),
                                                 q_decayed=q_dec, scores=scores)
    assert rel(ref_out, want_out) < TOL32 and rel(ref_final, want[-1]) < TOL32
    with pytest.raises(ValueError, match="disagree"):
        cmp.span_fold_pallas(w[..., 1:], u, kt, d, t, s, interpret=True)
    with pytest.raises(ValueError, match="disagree"):
        cmp.span_fold_pallas(w, u, kt, d, pool_t, pool_s, array(slots[:-1]), interpret=True)


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
        assert rel(got, np.stack(want)) < TOL32, block
    # through the core: the same states as the associative scan, from an initial state too
    summaries = la.Summary("dense", s, t)
    init = array(rng.standard_normal((batch, dim, width)), np.float32)
    for impl in ("fold", "pallas"):
        assert rel(la.prefix_states(summaries, init, impl=impl), core.prefix_states(summaries, init)) < TOL32
    with pytest.raises(ValueError, match="impl"):
        la.prefix_states(summaries, impl="sideways")
    # the composed state alone (no transfer, no states in between): every impl, with and without a start state
    for start in (None, init):
        last = core.prefix_states(summaries, start)[-1]
        for impl in la.PREFIX_IMPLS:
            assert rel(la.composed_state(summaries, start, impl=impl), last) < TOL32, impl
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
        assert rel(got, want) < tol
        assert not np.asarray(got[0], np.float32).any()
    if hq // hkv > 1:
        with pytest.raises(ValueError, match="pack_gqa"):
            pattn.positioned_attention(q, k, v, positions, scale=dim**-0.5, interpret=True,
                                       config=pattn.AttentionConfig(block_q=hq // hkv + 1, pack_gqa=True))
    # the same attention as the models' XLA path (positioned GQA attention over keys at positions 0..Lk-1)
    from hypic_jax import attention

    xla = attention.dot_product_attention(q[None, 1:], k[None], v[None], scale=dim**-0.5,
                                          q_positions=np.asarray(positions)[1:], k_positions=np.arange(lk))[0]
    assert rel(got[1:], xla) < tol


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
    ref_o, ref_s = core.recurrent(q, k, v, g=g, beta=beta, scale=0.5)
    assert rel(o, ref_o) < TOL32 and rel(s, ref_s) < TOL32
    assert rel(summary.transfer, core.summarize(k, v, g=g, beta=beta, chunk_size=16).transfer) < TOL32


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
    """Outputs, final state and the emitted summary against the token-by-token recurrence and
    `linear_attn.summarize`, over random families, chunk sizes, solves, diagonal sub-blocks, splits, transfer
    groups (0: the widened pass; small groups: several groups, padded ones and an odd count in the product tree),
    the state pass with and without its prefetched small loads, lengths (odd ones and ones shorter than a chunk
    included) and, for lengths that do not fill the last chunk, q, k, v read in place or zero-padded."""
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
    assert rel(o, ref_o) < TOL32 and rel(s, ref_s) < TOL32
    ref_sum = reference_summary(k, v, g=g, gk=gk, beta=beta, chunk_size=16)
    assert summary.form == ref_sum.form
    assert rel(summary.transfer, ref_sum.transfer) < transfer_tolerance(g, gk, chunk)
    assert rel(summary.state, ref_sum.state) < TOL32


def transfer_tolerance(g, gk, chunk):
    """TOL32, or float32's resolution of the decays where the gates are extreme. A kernel takes e^{b_t - b_j} from
    chunk-local cumulative log decays b, which float32 holds to |b| 2^-24 absolute; T is a product of such decays
    with cancelling low-rank corrections, and per-key gates of -2 per token reach |b| = 80 in a 64-token chunk,
    where T (entries near 1e-29) came out 3.4e-5 from a float64 reference (the chunk-16 reference: 4e-6). The
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
    """`_inverse_doubling` (its first level elementwise, the rest by dots) against numpy's inverse, correlated keys."""
    rng = np.random.default_rng(n)
    keys = rng.standard_normal((n, 8))
    keys = 0.6 * keys / np.linalg.norm(keys, axis=1, keepdims=True) + 0.4 * keys[:1] / np.linalg.norm(keys[0])
    strict = np.tril(0.9 * keys @ keys.T, -1)
    got = gdn._inverse_doubling(array(strict, np.float32), "ieee")
    assert rel(got, np.linalg.inv(np.eye(n) + strict)) < TOL32


def test_transfer_groups_product_tree():
    """Seven chunks in groups of 2 (four groups, the last padded with zero tokens): the tree's product equals the
    summary of the whole sequence, and so does every other grouping."""
    q, k, v, g, beta = inputs(7 * 16 - 5, key_heads=1, seed=41)
    ref = reference_summary(k, v, g=g, beta=beta, chunk_size=16)
    for group in (0, 1, 2, 3, 7, 100):
        config = GDNConfig(chunk=16, block_v=16, transfer_group=group)
        _, _, summary = gdn_forward(q, k, v, g=g, beta=beta, config=config, emit_summary=True, interpret=True)
        assert rel(summary.transfer, ref.transfer) < TOL32 and rel(summary.state, ref.state) < TOL32


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
    assert rel(o, ref_o) < TOL32 and rel(s, ref_s) < TOL32
    ref_sum = reference_summary(k, v, g=g, gk=gk, beta=beta, chunk_size=16)
    assert summary.form == ref_sum.form == ("dense" if delta else "diagonal")
    assert rel(summary.transfer, ref_sum.transfer) < TOL32 and rel(summary.state, ref_sum.state) < TOL32


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
        ref_o, ref_s = core.recurrent(q, k, v, gk=gk, beta=beta, scale=0.5)
        assert rel(o, ref_o) < TOL32 and rel(s, ref_s) < TOL32


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
    assert rel(o, ref_o) < TOL16 and rel(s, ref_s) < TOL16


# ----------------------------------------------------------------------------------------------------------------
# Variable-length packed segments.


@pytest.mark.parametrize("gates,chunk,traced,group,reads", [
    ("gdn", 16, True, 64, "packed"), ("gdn", 16, False, 0, "packed"), ("gdn", 16, True, 1, "packed"),
    ("gdn", 32, False, 0, "gather"), ("gdn", 16, True, 2, "gather"), ("kda", 32, False, 64, "packed"),
    ("kda", 16, False, 2, "packed"), ("kda", 16, True, 0, "gather"), ("decay", 16, False, 64, "packed"),
    ("decay", 32, False, 64, "gather")])
def test_varlen_matches_reference(gates, chunk, traced, group, reads):
    """Packed segments against the vmapped core, T through the transfer pass (group > 0; 1 and 2 put segments
    across several groups) or the widened state (0); q, k, v read in place ("packed", every family) or gathered
    into the chunk-aligned layout."""
    length = 61
    cu = [0, 5, 5, 22, 39, 40, 61]  # an empty segment, a one-token segment, odd lengths
    q, k, v, g, beta = inputs(length, key_heads=1, seed=17, gate=gates != "kda", delta=gates != "decay")
    gk = per_key_gates(length, 2, 16, seed=18) if gates == "kda" else None
    config = GDNConfig(chunk=chunk, block_v=16, transfer_group=group, packed_reads=reads == "packed")
    offsets = array(cu, np.int32) if traced else cu
    o, summary = gdn.gdn_varlen(q, k, v, offsets, g=g, gk=gk, beta=beta, scale=0.5, config=config, interpret=True)
    ref_o, ref_sum = core.varlen_reference(q, k, v, cu, g=g, gk=gk, beta=beta, scale=0.5)
    assert summary.form == ref_sum.form and summary.state.shape == (6, 2, 16, 16)
    assert rel(o, ref_o) < TOL32
    assert rel(summary.state, ref_sum.state) < TOL32 and rel(summary.transfer, ref_sum.transfer) < TOL32
    # The segments' pairs compose into the state of the unsegmented sequence only through T (checks the reset).
    if gates == "gdn":
        _, whole = reference(q, k, v, g, beta)
        assert rel(core.prefix_states(summary)[-1], whole) < TOL32
    if gates == "decay":
        o2, states = gdn.gdn_varlen(q, k, v, offsets, g=g, scale=0.5, config=config, emit_summary=False,
                                    interpret=True)
        assert rel(o2, ref_o) < TOL32 and rel(states, ref_sum.state) < TOL32


def test_varlen_default_config_widens():
    """With no config, packed segments take T from the widened pass (measured faster on the H200 than the transfer
    pass, unlike one long sequence): `default_varlen_config`, checked end to end against the vmapped core."""
    assert gdn.default_varlen_config().transfer_group == 0 and GDNConfig().transfer_group > 0
    length, cu = 70, [0, 9, 9, 70]
    q, k, v, g, beta = inputs(length, key_heads=1, seed=23)
    o, summary = gdn.gdn_varlen(q, k, v, cu, g=g, beta=beta, scale=0.5, interpret=True)
    ref_o, ref_sum = core.varlen_reference(q, k, v, cu, g=g, beta=beta, scale=0.5)
    assert rel(o, ref_o) < TOL32
    assert rel(summary.state, ref_sum.state) < TOL32 and rel(summary.transfer, ref_sum.transfer) < TOL32
    # summary_rows: the rows read are the reference's, the empty segment's (I, 0) included when it is read
    for rows in ([True, True, True], [True, False, True], [False, True, False]):
        _, picked = gdn.gdn_varlen(q, k, v, cu, g=g, beta=beta, scale=0.5, summary_rows=jnp.asarray(rows),
                                   interpret=True)
        read = np.flatnonzero(rows)
        assert rel(picked.state[read], ref_sum.state[read]) < TOL32
        assert rel(picked.transfer[read], ref_sum.transfer[read]) < TOL32
    with pytest.raises(ValueError, match="summary_rows"):
        gdn.gdn_varlen(q, k, v, cu, g=g, beta=beta, summary_rows=jnp.ones(2, bool), interpret=True)


@examples(5)
@given(cuts=st.lists(st.integers(0, 120), min_size=3, max_size=3), group=st.sampled_from([0, 1, 3, 64]),
       prefetch=st.booleans(), reads=st.sampled_from(["packed", "gather"]), grid=st.booleans(),
       seed=st.integers(0, 2**16))
def test_varlen_property(cuts, group, prefetch, reads, grid, seed):
    """Random splits of 120 tokens into 4 segments (empty ones, one-chunk ones, segments across several transfer
    groups): outputs, S(C|0) and T of every segment against the vmapped core. The segment count and the
    reference's row length stay fixed, so examples reuse the compiled functions."""
    length = 120
    cu = [0] + sorted(cuts) + [length]
    q, k, v, g, beta = inputs(length, key_heads=1, seed=seed)
    config = GDNConfig(chunk=16, block_v=16, transfer_group=group, state_prefetch=prefetch,
                       packed_reads=reads == "packed", segment_grid=grid)
    o, summary = gdn.gdn_varlen(q, k, v, cu, g=g, beta=beta, scale=0.5, config=config, interpret=True)
    # the offsets as an array: traced in the reference, one compilation for every split (the kernel takes the list)
    ref_o, ref_sum = core.varlen_reference(q, k, v, np.asarray(cu, np.int32), g=g, beta=beta, scale=0.5,
                                           max_len=length)
    assert rel(o, ref_o) < TOL32
    assert rel(summary.state, ref_sum.state) < TOL32 and rel(summary.transfer, ref_sum.transfer) < TOL32


# ----------------------------------------------------------------------------------------------------------------
# Single-token decode step.


def test_decode_step_matches_recurrent():
    rng = np.random.default_rng(19)
    f = lambda *s: array(rng.standard_normal(s), np.float32)  # noqa: E731
    q, k = la.l2_normalize(f(1, 16)), la.l2_normalize(f(1, 16))
    v, state = f(3, 32), f(3, 16, 32)
    g, gk, beta = -jnp.abs(f(3)), -jnp.abs(f(3, 16)), jax.nn.sigmoid(f(3))
    config = dec.DecodeConfig(block_v=16)
    for gates in (dict(g=g, beta=beta), dict(gk=gk, beta=beta), dict(g=g, gk=gk), dict()):
        o, new = dec.decode_step(q, k, v, state, **gates, scale=0.3, config=config, interpret=True)
        ref_o, ref_new = core.decode_reference(q, k, v, state, **gates, scale=0.3)
        assert rel(o, ref_o) < TOL32 and rel(new, ref_new) < TOL32
    batch = jax.tree_util.tree_map(lambda x: jnp.stack([x, -x]), (q, k, v, state, g, beta))
    o, new = jax.vmap(lambda q, k, v, s, g, b: dec.decode_step(q, k, v, s, g=g, beta=b, config=config, donate=True,
                                                               interpret=True))(*batch)
    for i in range(2):
        args = [x[i] for x in batch]
        ref_o, ref_new = core.decode_reference(*args[:4], g=args[4], beta=args[5])
        assert rel(o[i], ref_o) < TOL32 and rel(new[i], ref_new) < TOL32
    ob, newb = dec.decode_step(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), state,
                               g=g, beta=beta, config=config, interpret=True)
    ref_o, ref_new = core.decode_reference(*(x.astype(jnp.bfloat16).astype(jnp.float32) for x in (q, k, v)), state,
                                          g=g, beta=beta)
    assert ob.dtype == jnp.bfloat16 and rel(ob, ref_o) < TOL16 and rel(newb, ref_new) < TOL16


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
        varlen = lambda q, k, v, cu, g, b, c=config: gdn._varlen(q, k, v, cu, g, None, b, scale=0.1,  # noqa: E731
                                                                 config=c, emit_summary=True, interpret=False)
        lowered.append((varlen, (args[0], args[1], args[2], cu, args[3], args[4])))
    step = lambda q, k, v, s, gk, b: dec._decode(q, k, v, s, None, gk, b, scale=0.1,  # noqa: E731
                                                 config=dec.DecodeConfig(), interpret=False, donate=True)
    lowered.append((step, (sd((16, dim), jnp.bfloat16), sd((16, dim), jnp.bfloat16), sd((32, dim), jnp.bfloat16),
                           sd((32, dim, dim), jnp.float32), sd((32, dim), jnp.float32), sd((32,), jnp.float32))))
    for fn, fn_args in lowered:
        text = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=check)(*fn_args).mlir_module()
        assert "xla.gpu.triton" in text
    pairs = sd((4, 2, dim, dim), jnp.float32)
    fold = jax.jit(lambda t, s: cmp.fold_pallas(t, s, config=cmp.FoldConfig(algorithm="bf16x3")))
    prefix = jax.jit(lambda t, s: cmp.prefix_fold_pallas(t, s, config=cmp.FoldConfig(algorithm="bf16x3"), block=2))
    for fn in (fold, prefix):
        assert "xla.gpu.triton" in jax.export.export(fn, platforms=["cuda"], disabled_checks=check)(pairs, pairs) \
            .mlir_module()
    planes = sd((4, 2, dim, dim), jnp.bfloat16)
    for with_t in (False, True):
        split = jax.jit(lambda a, b, c, w=with_t: cmp.fold_split_pallas(a, b, c, with_transfer=w))
        assert "xla.gpu.triton" in jax.export.export(split, platforms=["cuda"], disabled_checks=check)(
            planes, planes, pairs).mlir_module()
    for init in (None, sd((2, dim, dim), jnp.float32)):
        split_prefix = jax.jit(lambda a, b, c, *i: cmp.prefix_fold_split_pallas(a, b, c, *i))
        assert "xla.gpu.triton" in jax.export.export(split_prefix, platforms=["cuda"], disabled_checks=check)(
            planes, planes, pairs, *([] if init is None else [init])).mlir_module()
    seam = sd((4, 2, 8, dim), jnp.float32)
    span_fold = jax.jit(lambda w, u, kt, d, t, s: cmp.span_fold_pallas(w, u, kt, d, t, s))
    span_args = (seam, seam, seam, sd((4, 2, dim), jnp.float32), pairs, pairs)
    assert "xla.gpu.triton" in jax.export.export(span_fold, platforms=["cuda"], disabled_checks=check)(*span_args) \
        .mlir_module()
    pool = sd((9, 2, dim, dim), jnp.float32)
    for step, seam_algorithm in (("nested", None), ("split", None), ("nested", "bf16")):
        config = cmp.FoldConfig(seam_step=step, seam_algorithm=seam_algorithm)
        pooled = jax.jit(lambda w, u, kt, d, t, s, slots, c=config: cmp.span_fold_pallas(
            w, u, kt, d, t, s, slots, config=c, incoming=c.seam_step == "nested"))
        assert "xla.gpu.triton" in jax.export.export(pooled, platforms=["cuda"], disabled_checks=check)(
            *span_args[:4], pool, pool, sd((4,), jnp.int32)).mlir_module()
    att_args = (sd((100, 16, 256), jnp.bfloat16), sd((700, 2, 256), jnp.bfloat16), sd((700, 2, 256), jnp.bfloat16),
                sd((100,), jnp.int32))
    for config in (pattn.AttentionConfig(), pattn.AttentionConfig(block_q=128, num_warps=8, pack_gqa=True)):
        attend = jax.jit(lambda q, k, v, p, c=config: pattn.positioned_attention(q, k, v, p, scale=0.0625, config=c))
        assert "xla.gpu.triton" in jax.export.export(attend, platforms=["cuda"], disabled_checks=check)(*att_args) \
            .mlir_module()


def test_mosaic_gpu_fold_lowers_for_cuda():
    """The Mosaic GPU folds lower for CUDA on a CPU-only machine (Mosaic GPU compiles its layouts and transfers
    while lowering, so this catches what the GPU interpreter does not run: register operands, transposed views,
    layout casts, the multicast pair's clusters), with and without the transfer, one slot or two, every prefix."""
    from hypic_jax.pallas import compose_mgpu

    sd = jax.ShapeDtypeStruct
    planes, states = sd((4, 2, 128, 128), jnp.bfloat16), sd((4, 2, 128, 128), jnp.float32)  # K = V: the clusters
    for with_t, stages, multicast in ((False, 2, False), (True, 2, False), (True, 1, False), (True, 2, True)):
        fold = jax.jit(lambda a, b, c, w=with_t, st=stages, mc=multicast: compose_mgpu.fold_split_mgpu(
            a, b, c, with_transfer=w, config=compose_mgpu.MosaicFoldConfig(stages=st, multicast=mc)))
        assert "mosaic_gpu" in jax.export.export(fold, platforms=["cuda"])(planes, planes, states).mlir_module()
    for init in (None, sd((2, 128, 128), jnp.float32)):
        prefix = jax.jit(lambda a, b, c, *i: compose_mgpu.prefix_fold_split_mgpu(a, b, c, *i))
        assert "mosaic_gpu" in jax.export.export(prefix, platforms=["cuda"])(
            planes, planes, states, *([] if init is None else [init])).mlir_module()


@pytest.mark.parametrize("length, heads, key_heads, value_dim, block_v, seed",
                         [(128, 2, 1, 128, 64, 0), (192, 2, 2, 64, 32, 1)])
def test_mosaic_gpu_state_pass_equals_the_triton_one(length, heads, key_heads, value_dim, block_v, seed):
    """The state pass under Mosaic GPU (`gdn_mgpu`, Pallas's GPU interpreter) gives the Triton state pass's outputs
    and final state on the same chunk-local operands (bf16 state dots in both: within their rounding), with more
    chunks than slots, grouped key heads, an initial state and both column-block widths (the interpreter's time goes
    with the blocks it runs: 64-wide blocks halve them)."""
    from hypic_jax.pallas import gdn_mgpu

    rng = np.random.default_rng(seed)
    f = lambda *s: array(rng.standard_normal(s) * 0.3, np.float32)  # noqa: E731
    c, key_dim = 64, 128
    w, u = f(length, heads, key_dim).astype(jnp.bfloat16), f(length, heads, value_dim).astype(jnp.bfloat16)
    k, q = (f(length, key_heads, key_dim).astype(jnp.bfloat16) for _ in range(2))
    gates = -rng.uniform(0, 0.1, (heads, length // c, c)).astype(np.float32)
    b = array(np.cumsum(gates, -1).reshape(heads, length))
    p = (f(heads, length, c) * 0.3).astype(jnp.bfloat16)
    init = f(heads, key_dim, value_dim)
    o, final = gdn_mgpu.state_pass_mgpu(w, u, k, b, q, p, init, chunk=c, out_dtype=jnp.bfloat16, scale=0.09,
                                        config=gdn_mgpu.MosaicStateConfig(block_v=block_v), interpret=True)
    config = GDNConfig().resolved(jnp.bfloat16)
    ref_o, ref_final = gdn._state_pass(w, u, k, b, q, p, init[None], chunk=c, pieces=1, value_dim=value_dim,
                                       out_dtype=jnp.bfloat16, scale=0.09, config=config, interpret=True)
    assert o.shape == ref_o.shape and o.dtype == jnp.bfloat16 and rel(o, ref_o) < 1e-3
    assert rel(final, ref_final[0]) < 1e-3


@pytest.mark.parametrize("length, group_chunks, heads, key_heads, block_v, seed",
                         [(512, 4, 2, 1, 32, 0), (128, 2, 4, 2, 64, 1), (64, 1, 2, 1, 32, 2)])
def test_mosaic_gpu_transfer_pass_gives_the_group_products(length, group_chunks, heads, key_heads, block_v, seed):
    """The transfer pass's group products under Mosaic GPU (`gdn_mgpu.transfer_pass_mgpu`, Pallas's GPU
    interpreter) equal Triton's pass over the groups' identity columns within their bf16 rounding, and both are as
    close to a float64 product of the A_n = e^{b_last} I - K_n^T diag(e^{b_last - b}) W_n of each group; down to one
    group of one chunk (a one-chunk segment, fewer chunks than shared-memory slots); both column-block widths."""
    from hypic_jax.pallas import gdn_mgpu

    rng = np.random.default_rng(seed)
    c, key_dim = 64, 128
    f = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.3, jnp.bfloat16)  # noqa: E731
    w, k = f(length, heads, key_dim), f(length, key_heads, key_dim)
    b = array(np.cumsum(-rng.uniform(0, 0.1, (heads, length // c, c)), -1).reshape(heads, length), np.float32)
    ts = gdn_mgpu.transfer_pass_mgpu(w, k, b, chunk=c, group_chunks=group_chunks, interpret=True,
                                     config=gdn_mgpu.MosaicStateConfig(block_v=block_v))
    groups = length // c // group_chunks
    eye = jnp.broadcast_to(jnp.eye(key_dim, dtype=jnp.float32), (groups, heads, key_dim, key_dim))
    _, ref = gdn._state_pass(w, None, k, b, None, None, eye, chunk=c, pieces=groups, value_dim=key_dim,
                             out_dtype=jnp.float32, scale=1.0, config=GDNConfig().resolved(jnp.bfloat16),
                             interpret=True)
    assert ts.shape == (groups, heads, key_dim, key_dim) and ts.dtype == jnp.float32
    assert rel(ts, ref) < 2e-3
    wd, kd, bd = (np.asarray(x, np.float64) for x in (w, k, b))
    for gi in range(groups):
        for h in range(heads):
            prod = np.eye(key_dim)
            for n in range(gi * group_chunks, (gi + 1) * group_chunks):
                r, last = slice(n * c, (n + 1) * c), bd[h, n * c + c - 1]
                kn = kd[r, h // (heads // key_heads)]
                prod = (np.exp(last) * np.eye(key_dim) - kn.T @ (np.exp(last - bd[h, r])[:, None] * wd[r, h])) @ prod
            err, ref_err = rel(ts[gi, h], prod), rel(ref[gi, h], prod)
            assert err < 2e-2 and err < 1.5 * ref_err + 1e-4
    with pytest.raises(ValueError, match="whole groups"):
        gdn_mgpu.transfer_pass_mgpu(w, k, b, chunk=c, group_chunks=5, interpret=True)


def test_gdn_forward_under_vmap_lowers_through_the_mosaic_gpu_kernels(monkeypatch):
    """The models vmap the linear-attention core over the batch: under vmap, `plgpu.kernel` prepends a grid axis,
    so every Mosaic GPU kernel of the forward must keep its own grid within two axes. The batched forward, with and
    without (T, S), lowers for CUDA on the CPU through the chunk-local kernel, the state pass and the transfer pass
    (the Hopper check is patched so that "auto" routes (T, S) there as it would on the GPU)."""
    monkeypatch.setattr(gdn, "is_hopper", lambda: True)
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
    from hypic_jax.pallas import gdn_mgpu

    sd = jax.ShapeDtypeStruct
    args = (sd((512, 4, 128), jnp.bfloat16), sd((512, 2, 128), jnp.bfloat16), sd((4, 512), jnp.float32))
    config = gdn_mgpu.MosaicStateConfig(cluster=cluster)
    fn = jax.jit(lambda *a: gdn_mgpu.transfer_pass_mgpu(*a, chunk=64, group_chunks=4, config=config))
    assert "gdn_mgpu_transfer_pass" in jax.export.export(fn, platforms=["cuda"])(*args).mlir_module()
    b = jnp.zeros((4, 512), jnp.float32)
    assert not gdn._mosaic_transfer(GDNConfig().resolved(jnp.bfloat16), 64, 128, b, None, interpret=False)
    pinned = GDNConfig(state_lowering="mosaic").resolved(jnp.bfloat16)  # follows the state pass's pin, off Hopper too
    assert gdn._mosaic_transfer(pinned, 64, 128, b, None, interpret=False)
    assert not gdn._mosaic_transfer(pinned, 64, 128, b, None, interpret=True)
    assert not gdn._mosaic_transfer(pinned, 64, 128, jnp.zeros((512, 4, 128)), None, interpret=False)  # per-key


@pytest.mark.parametrize("cluster, value_dim", [(1, 128), (2, 128), (4, 128), (2, 32)])
def test_mosaic_gpu_state_pass_lowers_with_clusters(cluster, value_dim):
    """The state pass lowers for CUDA on the CPU with its column blocks in clusters of 1, 2 and 4 (multicast W, K,
    Q, P; the interpreter has no cluster barriers, so only the GPU runs these forms), and a head with a single
    column block falls back to no cluster."""
    from hypic_jax.pallas import gdn_mgpu

    sd = jax.ShapeDtypeStruct
    length, heads, key_heads = 256, 4, 2
    args = (sd((length, heads, 128), jnp.bfloat16), sd((length, heads, value_dim), jnp.bfloat16),
            sd((length, key_heads, 128), jnp.bfloat16), sd((heads, length), jnp.float32),
            sd((length, key_heads, 128), jnp.bfloat16), sd((heads, length, 64), jnp.bfloat16),
            sd((heads, 128, value_dim), jnp.float32))
    config = gdn_mgpu.MosaicStateConfig(cluster=cluster)
    fn = jax.jit(lambda *a: gdn_mgpu.state_pass_mgpu(*a, chunk=64, out_dtype=jnp.bfloat16, scale=0.1,
                                                      config=config))
    assert "mosaic_gpu" in jax.export.export(fn, platforms=["cuda"])(*args).mlir_module()
    with pytest.raises(ValueError, match="cluster must be"):
        gdn_mgpu.MosaicStateConfig(cluster=3)
    with pytest.raises(ValueError, match="semantics must be one of"):
        gdn_mgpu.MosaicStateConfig(semantics="lanes")


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
    """The chunk-local kernel under Mosaic GPU (`gdn_locals_mgpu`, Pallas's GPU interpreter) gives the Triton
    kernel's P (to float32 rounding) and W, U within bf16 rounding, and its W, U are as close to the float32-dot
    kernel's as Triton's are: runs of 8 chunks through 2 slots (a head's chunks in one run), runs of one chunk (2
    runs a head), 5 chunks a head as runs of 3 and 2 (odd turns for two compute warpgroups) and as 2, 2 and 1 (runs
    of 2; a last run shorter than the slots), one or two compute warpgroups, grouped key heads, with and without a
    gate. (The GPU interpreter's time goes with the chunks it runs, hence the few and short sequences.)"""
    from hypic_jax.pallas import gdn_locals_mgpu as glm

    heads, dim, c = 2, 128, 64
    q, k, v, g, beta = inputs(length, key_heads=1, heads=heads, dim=dim, seed=seed, gate=gate, dtype=jnp.bfloat16)
    b = gdn._chunk_cumsum(g, length, heads, c)
    beta_t = beta.astype(jnp.float32).T
    scale = dim**-0.5
    config = GDNConfig().resolved(jnp.bfloat16)
    ref = gdn.chunk_locals(q, k, v, b, beta_t, chunk=c, scale=scale, inter_dtype=jnp.bfloat16, config=config,
                            interpret=True)
    out = glm.chunk_locals_mgpu(q, k, v, b, beta_t, chunk=c, scale=scale,
                                config=glm.MosaicLocalsConfig(blocks=blocks, warpgroups=warpgroups),
                                interpret=True)
    exact = GDNConfig(locals_precision="ieee", solve_precision="ieee").resolved(jnp.float32)
    f32 = gdn.chunk_locals(*(x.astype(jnp.float32) for x in (q, k, v)), b, beta_t, chunk=c, scale=scale,
                            inter_dtype=jnp.float32, config=exact, interpret=True)
    for name, mine, theirs, truth in zip("pwu", out, ref, f32):
        assert mine.shape == theirs.shape and mine.dtype == jnp.bfloat16, name
        assert rel(mine, theirs) < (1e-5 if name == "p" else 1e-2), name
        assert rel(mine, truth) <= 1.25 * rel(theirs, truth) + 1e-4, name


def test_mosaic_gpu_chunk_locals_lower_and_refuse_what_they_cannot_run():
    """The Mosaic GPU chunk-local kernel lowers for CUDA on the CPU (2 and 4 slots, one compute warpgroup, the
    bisecting variants, and inside the forward with `locals_lowering="mosaic"`), and the forward refuses launches it
    does not take instead of running Triton."""
    from hypic_jax.pallas import gdn_locals_mgpu as glm

    sd = jax.ShapeDtypeStruct
    length, dim = 1024, 128
    args = (sd((length, 2, dim), jnp.bfloat16), sd((length, 2, dim), jnp.bfloat16),
            sd((length, 4, dim), jnp.bfloat16), sd((4, length), jnp.float32), sd((4, length), jnp.float32))
    for config in (glm.MosaicLocalsConfig(), glm.MosaicLocalsConfig(stages=2), glm.MosaicLocalsConfig(warpgroups=1),
                   glm.MosaicLocalsConfig(stages=2, smem_operands=True, transposed_keys=True, set_registers=False)):
        fn = jax.jit(lambda *a, c=config: glm.chunk_locals_mgpu(*a, chunk=64, scale=0.1, config=c))
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
        glm.MosaicLocalsConfig(stages=3)
    with pytest.raises(ValueError, match="warpgroups must be 1 or 2"):
        glm.MosaicLocalsConfig(warpgroups=3)
    with pytest.raises(ValueError, match="semantics must be one of"):
        glm.MosaicLocalsConfig(semantics="thread")
    # "auto" (the default) takes Triton where the Mosaic GPU kernel cannot run: interpret mode, and an odd chunk count
    auto = GDNConfig()
    assert auto.locals_lowering == "auto"
    ref_o, ref_s = gdn_forward(q, k, v, g=g, beta=beta, config=GDNConfig(locals_lowering="triton"), interpret=True)
    o, s = gdn_forward(q, k, v, g=g, beta=beta, config=auto, interpret=True)
    assert rel(o, ref_o) == 0.0 and rel(s, ref_s) == 0.0


def test_linear_attn_impl_dispatch():
    q, k, v, g, beta = inputs(21, key_heads=2, seed=6)
    o, s = la.chunked(q, k, v, g=g, beta=beta, impl="pallas", chunk_size=16)
    ref_o, ref_s = core.chunked(q, k, v, g=g, beta=beta, impl="xla")
    assert rel(o, ref_o) < TOL32 and rel(s, ref_s) < TOL32
    o_auto, _ = la.chunked(q, k, v, g=g, beta=beta, impl="auto")  # CPU: the XLA path
    assert rel(o_auto, ref_o) < TOL32
    gk = per_key_gates(21, 2, 16, seed=7)  # KDA through the same dispatch
    o, s = la.chunked(q, k, v, gk=gk, beta=beta, impl="pallas", chunk_size=16)
    ref_o, ref_s = core.recurrent(q, k, v, gk=gk, beta=beta)
    assert rel(o, ref_o) < TOL32 and rel(s, ref_s) < TOL32
    o12, _ = la.chunked(q, k, v[..., :12], g=g, impl="pallas")  # a value width the tiles lack: padded inside
    assert rel(o12, core.chunked(q, k, v[..., :12], g=g, impl="xla")[0]) < TOL32
    with pytest.raises(ValueError, match="empty"):
        la.chunked(q[:0], k[:0], v[:0], g=g[:0], impl="pallas")
