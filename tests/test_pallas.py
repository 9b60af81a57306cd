"""Pallas kernels (hypic_jax.pallas) in interpret mode on the CPU against the transfer-operator core.

Shapes are tiny and few (interpret-mode compilation, not arithmetic, is the cost); they still cover odd lengths,
several chunk sizes, grouped key heads, an initial state, the transfer-operator split into pieces and the emitted
(T_C, S(C|0)). A last test lowers the kernels to Triton IR for the GPU (no GPU needed) so that CPU CI also catches
constructs the Triton lowering rejects.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hypic_jax import linear_attn as la
from hypic_jax.pallas import compose as cmp
from hypic_jax.pallas.gdn import GDNConfig, _forward, gdn_forward

TOL32 = 1e-5
TOL16 = 2e-3


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def inputs(length, key_heads=1, heads=2, dim=16, seed=0, gate=True, delta=True, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    q = la.l2_normalize(f(length, key_heads, dim)).astype(dtype)
    k = la.l2_normalize(f(length, key_heads, dim)).astype(dtype)
    v = f(length, heads, dim).astype(dtype)
    g = -jnp.asarray(rng.uniform(0.0, 0.3, (length, heads)), jnp.float32) if gate else None
    beta = jax.nn.sigmoid(f(length, heads)) if delta else None
    return q, k, v, g, beta


def reference(q, k, v, g, beta, init=None, scale=1.0):
    group = v.shape[1] // k.shape[1]
    up = lambda x: jnp.repeat(x.astype(jnp.float32), group, 1)  # noqa: E731
    return la.recurrent(up(q), up(k), v.astype(jnp.float32), g=g, beta=beta, initial_state=init, scale=scale)


# (length, chunk, pieces, block_v, with initial state): odd lengths, chunks 16/32/64, direct and split.
CASES = [
    (37, 16, 1, 16, False),
    (100, 32, 3, 16, True),
    (45, 64, 1, 16, True),
]


@pytest.mark.parametrize("length,chunk,pieces,block_v,with_init", CASES)
def test_gated_delta_float32_matches_recurrent(length, chunk, pieces, block_v, with_init):
    q, k, v, g, beta = inputs(length)
    init = jnp.asarray(np.random.default_rng(9).standard_normal((2, 16, 16)) * 0.3, jnp.float32) if with_init else None
    config = GDNConfig(chunk=chunk, pieces=pieces, block_v=block_v)
    o, s, summary = gdn_forward(q, k, v, g=g, beta=beta, initial_state=init, scale=0.5, config=config,
                                emit_summary=True, interpret=True)
    ref_o, ref_s = reference(q, k, v, g, beta, init, scale=0.5)
    assert rel(o, ref_o) < TOL32 and rel(s, ref_s) < TOL32
    group = v.shape[1] // k.shape[1]
    ref_sum = la.summarize(jnp.repeat(k, group, 1), v, g=g, beta=beta, chunk_size=16)
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
    t = jnp.asarray(rng.standard_normal((n, batch, dim, dim)) * 0.25, jnp.float32)
    s = jnp.asarray(rng.standard_normal((n, batch, dim, dim)), jnp.float32)
    summaries = la.Summary("dense", s, t)
    ref_states = la.prefix_states(summaries)
    total_t, total_s = cmp.compose_all(t, s, "f32")
    assert rel(total_s, ref_states[-1]) < TOL32
    assert rel(cmp.prefix_states(t, s, None, "f32"), ref_states) < TOL32
    pt, ps = cmp.prefix_pairs(t, s, "f32")
    assert rel(ps, ref_states) < TOL32 and rel(pt[-1], total_t) < TOL32
    for with_t in (True, False):
        kt, ks = cmp.fold_pallas(t, s, with_transfer=with_t, config=cmp.FoldConfig(block_w=16, algorithm="f32"),
                                 interpret=True)
        assert rel(ks, total_s) < TOL32
        if with_t:
            assert rel(kt, total_t) < TOL32


def test_kernels_lower_to_triton():
    """Lowering (not compiling) for CUDA works on a CPU-only machine: catches Triton-unsupported constructs."""
    sd = jax.ShapeDtypeStruct
    length, dim = 256, 128
    args = (sd((length, 16, dim), jnp.bfloat16), sd((length, 16, dim), jnp.bfloat16),
            sd((length, 32, dim), jnp.bfloat16), sd((length, 32), jnp.float32), sd((length, 32), jnp.float32), None)
    check = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    for config, emit in ((GDNConfig(), False), (GDNConfig(pieces=2), True)):
        fn = jax.jit(lambda *a, c=config, e=emit: _forward(*a, scale=dim**-0.5, config=c, emit_summary=e,
                                                            interpret=False))
        text = jax.export.export(fn, platforms=["cuda"], disabled_checks=check)(*args).mlir_module()
        assert "xla.gpu.triton" in text
    pairs = sd((4, 2, dim, dim), jnp.float32)
    fold = jax.jit(lambda t, s: cmp.fold_pallas(t, s, config=cmp.FoldConfig(algorithm="bf16x3")))
    assert "xla.gpu.triton" in jax.export.export(fold, platforms=["cuda"], disabled_checks=check)(pairs, pairs) \
        .mlir_module()


def test_linear_attn_impl_dispatch():
    q, k, v, g, beta = inputs(21, key_heads=2, seed=6)
    o, s = la.chunked(q, k, v, g=g, beta=beta, impl="pallas", chunk_size=16)
    ref_o, ref_s = la.chunked(q, k, v, g=g, beta=beta, impl="xla")
    assert rel(o, ref_o) < TOL32 and rel(s, ref_s) < TOL32
    o_auto, _ = la.chunked(q, k, v, g=g, beta=beta, impl="auto")  # CPU: the XLA path
    assert rel(o_auto, ref_o) < TOL32
    with pytest.raises(ValueError):
        la.chunked(q, k, v, gk=jnp.zeros(k.shape), impl="pallas")
