"""The Pallas grouped matmul for MoE experts (interpreted on the CPU) against its reference (`grouped_matmul.
reference`) and jax.lax.ragged_dot, and the routed-experts block around it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hypic_jax.models import layers
from hypic_jax.kernels.grouped_matmul import ChunkedWeights, GMMConfig, block_layout, gmm, gmm_reference

from helpers import examples, primitives_outside_kernels


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_gmm_matches_ragged_dot_with_empty_and_partial_groups(dtype):
    rng = np.random.RandomState(0)
    sizes = np.array([5, 0, 17, 16, 1, 0, 33, 2], np.int32)  # empty groups, exact and partial blocks
    rows = int(sizes.sum())
    x = jnp.asarray(rng.randn(rows, 64), dtype)
    w = jnp.asarray(rng.randn(8, 64, 32), dtype)
    layout = block_layout(jnp.asarray(sizes), rows, block_m=16)
    assert layout.num_padded >= rows and int((layout.block_expert >= 0).sum()) == 9  # 1+2+1+1+3+1 blocks
    padded = jnp.zeros((layout.num_padded, 64), dtype).at[layout.positions].set(x)
    out = gmm(padded, layout.block_expert, w, config=GMMConfig(block_n=16, block_k=32))[layout.positions]
    ref = jax.lax.ragged_dot(x, w, jnp.asarray(sizes), preferred_element_type=jnp.float32)
    tol = 1e-5 if dtype == np.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), rtol=tol, atol=tol * 8)
    want = gmm_reference(padded, layout.block_expert, w)[layout.positions]
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), rtol=tol, atol=tol * 8)
    # the kernel gathering the rows itself (rows of padding blocks read row 0): the same products, bit for bit
    source = jnp.zeros((layout.num_padded,), jnp.int32).at[layout.positions].set(jnp.arange(rows, dtype=jnp.int32))
    gathered = gmm(x, layout.block_expert, w, config=GMMConfig(block_n=16, block_k=32), rows=source)
    np.testing.assert_array_equal(np.asarray(gathered[layout.positions], np.float32), np.asarray(out, np.float32))
    np.testing.assert_allclose(np.asarray(gmm_reference(x, layout.block_expert, w, rows=source)[layout.positions]),
                               np.asarray(want), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="rows"):
        gmm(x, layout.block_expert, w, rows=source[:, None])
    # the fused activation: silu(x W_gate) * (x W_up) from the accumulators, against the two halves' products
    act = gmm(x, layout.block_expert, w, config=GMMConfig(block_n=16, block_k=32), rows=source, swiglu=True)
    gate, up = np.split(np.asarray(ref, np.float64), 2, axis=-1)
    np.testing.assert_allclose(np.asarray(act[layout.positions], np.float32), gate / (1 + np.exp(-gate)) * up,
                               rtol=tol, atol=tol * 8)
    want_act = gmm_reference(x, layout.block_expert, w, rows=source, swiglu=True)[layout.positions]
    np.testing.assert_allclose(np.asarray(act[layout.positions], np.float32), np.asarray(want_act), rtol=tol,
                               atol=tol * 8)
    with pytest.raises(ValueError, match="even width"):
        gmm(x, layout.block_expert, w[..., 1:], swiglu=True)


@pytest.mark.parametrize("seed", range(6))
def test_block_layout_against_a_numpy_walk(seed):
    """Positions and block owners for random group sizes (empty groups anywhere, trailing ones included) equal a
    plain walk over the groups."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 40, rng.integers(1, 12)) * (rng.random(1) < 0.9)
    sizes[-1] = 0 if seed % 2 else sizes[-1]  # a trailing empty group on odd seeds
    rows, block_m = int(sizes.sum()), 16
    if rows == 0:
        sizes[0], rows = 3, 3
    layout = block_layout(jnp.asarray(sizes, jnp.int32), rows, block_m)
    positions, owners, start = [], [], 0
    for expert, size in enumerate(sizes):
        positions += list(range(start, start + size))
        blocks = -(-size // block_m)
        owners += [expert] * blocks
        start += blocks * block_m
    np.testing.assert_array_equal(np.asarray(layout.positions), positions)
    block_expert = np.asarray(layout.block_expert)
    np.testing.assert_array_equal(block_expert[: len(owners)], owners)
    assert (block_expert[len(owners):] == -1).all()


def test_moe_pallas_and_ragged_paths_agree():
    rng = np.random.RandomState(1)
    tokens, hidden, experts, inner, top_k = 37, 64, 8, 32, 2
    x = rng.randn(tokens, hidden).astype(np.float32)
    weights = rng.rand(tokens, top_k).astype(np.float32)
    ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    gate_up = 0.1 * rng.randn(experts, hidden, 2 * inner).astype(np.float32)
    down = 0.1 * rng.randn(experts, inner, hidden).astype(np.float32)
    ragged = layers.grouped_swiglu_experts(x, weights, ids, gate_up, down, impl="ragged")
    pallas = layers.grouped_swiglu_experts(x, weights, ids, gate_up, down, impl="pallas")
    # float32 dots run as TF32 on a GPU (both paths, differently blocked): 1e-5 holds on the CPU only
    tol = 1e-5 if jax.default_backend() == "cpu" else 5e-3
    np.testing.assert_allclose(np.asarray(pallas), np.asarray(ragged), rtol=tol, atol=tol)
    # a padding mask: masked tokens get zeros (Pallas: their copies go to a skipped null expert), the rest agree
    valid = rng.rand(tokens) < 0.6
    for impl in ("ragged", "pallas"):
        masked = np.asarray(layers.grouped_swiglu_experts(x, weights, ids, gate_up, down, impl=impl, valid=valid))
        assert not masked[~valid].any(), impl
        np.testing.assert_allclose(masked[valid], np.asarray(ragged)[valid], rtol=tol, atol=tol, err_msg=impl)


@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_few_copies_one_block_each_equal_the_sorted_layout(tokens, monkeypatch):
    """A decode step's few copies, laid out one block each (`copy_blocks`, no ranking by expert), give what the
    expert-sorted layout and ragged_dot give, with a padding mask too; the layout is the copy order, invalid copies'
    blocks are -1 (skipped), and tracing it needs no cumulative sum, sort or scatter."""
    import hypic_jax.kernels.grouped_matmul as gm

    rng = np.random.RandomState(tokens)
    x, weights, ids, gate_up, down = _moe_case(rng, 1, tokens, experts=16, top_k=4)
    x, weights, ids = x[0], weights[0], ids[0]
    valid = np.arange(tokens) % 3 != 1
    tol = 1e-5 if jax.default_backend() == "cpu" else 5e-3
    want = np.asarray(layers.grouped_swiglu_experts(x, weights, ids, gate_up, down, impl="ragged"))
    out = {}
    for bound in (0, 64):
        monkeypatch.setattr(gm.layout, "COPY_BLOCKS_MAX", bound)
        out[bound] = [np.asarray(layers.grouped_swiglu_experts(x, weights, ids, gate_up, down, impl="pallas", valid=v))
                      for v in (None, valid)]
    for bound, (whole, masked) in out.items():
        np.testing.assert_allclose(whole, want, rtol=tol, atol=tol, err_msg=str(bound))
        assert not masked[~valid].any()
        np.testing.assert_allclose(masked[valid], want[valid], rtol=tol, atol=tol, err_msg=str(bound))
    slot_rows, layout, padded_token = gm.copy_blocks(jnp.asarray(ids), 16, jnp.asarray(valid))
    assert np.array_equal(slot_rows, 16 * np.arange(tokens * 4))
    assert np.array_equal(layout.block_expert, np.where(np.repeat(valid, 4), ids.reshape(-1), -1))
    assert np.array_equal(padded_token, np.repeat(np.arange(tokens), 4 * 16))

    monkeypatch.setattr(gm.layout, "COPY_BLOCKS_MAX", 64)
    traced = jax.make_jaxpr(lambda *a: layers._grouped_swiglu_experts(*a, impl="pallas"))(
        x, weights, ids, gate_up, down)
    assert not primitives_outside_kernels(traced.jaxpr) & {"cumsum", "sort", "scatter", "scatter-add", "argsort"}


def _moe_case(rng, rows, tokens, hidden=32, experts=8, inner=16, top_k=2):
    x = rng.randn(rows, tokens, hidden).astype(np.float32)
    weights = rng.rand(rows, tokens, top_k).astype(np.float32)
    ids = np.stack([[rng.choice(experts, top_k, replace=False) for _ in range(tokens)] for _ in range(rows)])
    gate_up = 0.1 * rng.randn(experts, hidden, 2 * inner).astype(np.float32)
    down = 0.1 * rng.randn(experts, inner, hidden).astype(np.float32)
    return x, weights, ids.astype(np.int32), gate_up, down


@pytest.mark.parametrize("impl", ["ragged", "pallas"])
@pytest.mark.parametrize("rows, tokens", [(1, 1), (3, 1), (4, 5)])
def test_moe_mapped_over_rows_equals_each_row(impl, rows, tokens):
    """Mapped over rows with the experts shared (the batched decode), the routed experts run as one list of tokens
    and give each row's own result; with a padding mask mapped too; and nested maps."""
    rng = np.random.RandomState(rows * 10 + tokens)
    x, weights, ids, gate_up, down = _moe_case(rng, rows, tokens)
    valid = rng.rand(rows, tokens) < 0.7
    tol = 1e-5 if jax.default_backend() == "cpu" else 5e-3
    each = np.stack([layers.grouped_swiglu_experts(x[r], weights[r], ids[r], gate_up, down, impl=impl)
                     for r in range(rows)])
    mapped = jax.jit(jax.vmap(lambda a, w, e: layers.grouped_swiglu_experts(a, w, e, gate_up, down, impl=impl)))
    np.testing.assert_allclose(np.asarray(mapped(x, weights, ids)), each, rtol=tol, atol=tol)
    masked = jax.vmap(lambda a, w, e, v: layers.grouped_swiglu_experts(a, w, e, gate_up, down, impl=impl, valid=v))
    np.testing.assert_allclose(np.asarray(masked(x, weights, ids, valid)), np.where(valid[..., None], each, 0.0),
                               rtol=tol, atol=tol)
    nested = jax.vmap(jax.vmap(lambda a, w, e: layers.grouped_swiglu_experts(a[None], w[None], e[None], gate_up, down,
                                                                              impl=impl)[0]))
    np.testing.assert_allclose(np.asarray(nested(x, weights, ids)), each, rtol=tol, atol=tol)
    if impl == "pallas":  # the experts mapped too (each row its own): the plain map (ragged_dot has no rule)
        per_row = jax.vmap(lambda a, w, e, g, d: layers.grouped_swiglu_experts(a, w, e, g, d, impl=impl))
        stacked = per_row(x, weights, ids, np.stack([gate_up] * rows), np.stack([down] * rows))
        np.testing.assert_allclose(np.asarray(stacked), each, rtol=tol, atol=tol)


def test_moe_gradient_unchanged_by_the_row_rule():
    """Training differentiates the routed experts: the gradient through `grouped_swiglu_experts` (with its mapping
    rule) equals the gradient of the plain function, with respect to the tokens, the router weights and the
    experts."""
    rng = np.random.RandomState(7)
    x, weights, ids, gate_up, down = _moe_case(rng, 1, 9)
    x, weights, ids = x[0], weights[0], ids[0]

    def loss(fn, x, weights, gate_up, down):
        return jnp.sum(jnp.sin(fn(x, weights, ids, gate_up, down, impl="ragged")))

    args = (x, weights, gate_up, down)
    wrapped = jax.grad(lambda *a: loss(layers.grouped_swiglu_experts, *a), argnums=(0, 1, 2, 3))(*args)
    plain = jax.grad(lambda *a: loss(layers._grouped_swiglu_experts, *a), argnums=(0, 1, 2, 3))(*args)
    for a, b in zip(wrapped, plain):
        assert np.abs(np.asarray(a)).max() > 0
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_gmm_lowers_to_triton():
    """Lowering (not compiling) for CUDA works on a CPU-only machine: catches constructs Triton rejects, at the
    Qwen3.5-35B-A3B expert shapes (256 experts, hidden 2048, 2 x 512 gate|up)."""
    sd = jax.ShapeDtypeStruct
    check = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    fn = jax.jit(lambda x, e, w: gmm(x, e, w, interpret=False))
    for k_dim, n_dim in ((2048, 1024), (512, 2048)):
        args = (sd((64 * 40, k_dim), jnp.bfloat16), sd((40,), jnp.int32), sd((256, k_dim, n_dim), jnp.bfloat16))
        text = jax.export.export(fn, platforms=["cuda"], disabled_checks=check)(*args).mlir_module()
        assert "xla.gpu.triton" in text
    gather = jax.jit(lambda x, e, w, r: gmm(x, e, w, interpret=False, rows=r, swiglu=True))  # gathered rows, SwiGLU
    args = (sd((576, 2048), jnp.bfloat16), sd((400,), jnp.int32), sd((256, 2048, 1024), jnp.bfloat16),
            sd((400 * 32,), jnp.int32))
    assert "xla.gpu.triton" in jax.export.export(gather, platforms=["cuda"], disabled_checks=check)(*args).mlir_module()


@examples(10)
@given(tokens=st.integers(1, 60), top_k=st.integers(1, 4), experts=st.integers(2, 20),
       block_m=st.sampled_from([8, 16, 32]), seed=st.integers(0, 2**31 - 1))
def test_copy_layout_one_hot_equals_the_stable_sort(tokens, top_k, experts, block_m, seed):
    """The sort-free copy layout (one-hot running counts) and the sorted one place every (token, slot) copy in the
    same padded row and give every block the same owner, for skewed routings with unused experts; both equal a
    plain walk over the experts."""
    from hypic_jax.kernels import grouped_matmul as gm

    rng = np.random.default_rng(seed)
    top_k = min(top_k, experts)
    popular = rng.random(experts) ** 3  # skewed: some experts own many copies, some none
    ids = np.stack([rng.choice(experts, top_k, replace=False, p=popular / popular.sum()) for _ in range(tokens)])
    ids = jnp.asarray(ids, jnp.int32)
    # each path compiled as one program (two distinct functions: the threshold is read while tracing)
    rows_one_hot, layout_one_hot = jax.jit(lambda ids: gm.copy_layout(ids, experts, block_m))(ids)
    saved = gm.layout.ONE_HOT_ROUTING_MAX  # the bound `copy_layout` reads, in its own module
    try:
        gm.layout.ONE_HOT_ROUTING_MAX = 0
        rows_sorted, layout_sorted = jax.jit(lambda ids: gm.copy_layout(ids, experts, block_m))(ids)
    finally:
        gm.layout.ONE_HOT_ROUTING_MAX = saved
    np.testing.assert_array_equal(np.asarray(rows_one_hot), np.asarray(rows_sorted))
    np.testing.assert_array_equal(np.asarray(layout_one_hot.block_expert), np.asarray(layout_sorted.block_expert))
    np.testing.assert_array_equal(np.asarray(layout_one_hot.positions), np.asarray(layout_sorted.positions))
    flat = np.asarray(ids).reshape(-1)
    start, expected = 0, np.zeros_like(flat)
    for e in range(experts):
        members = np.flatnonzero(flat == e)
        expected[members] = start + np.arange(members.size)
        start += -(-members.size // block_m) * block_m
    np.testing.assert_array_equal(np.asarray(rows_one_hot), expected)


def test_gmm_narrows_its_tile_to_widths_the_config_does_not_divide():
    """A launch tuned for one model (256-wide weight tiles) still runs another model's widths: N = 96 and K = 48
    take 32- and 16-wide tiles and match ragged_dot; tile edges stay powers of two."""
    from hypic_jax.kernels import grouped_matmul as gm
    from hypic_jax.kernels.grouped_matmul.matmul import _tile

    assert [_tile(256, d) for d in (2048, 1536, 384, 96, 8)] == [256, 256, 128, 32, 8]
    rng = np.random.RandomState(3)
    sizes = np.array([7, 0, 20, 3], np.int32)
    rows = int(sizes.sum())
    x = jnp.asarray(rng.randn(rows, 48), jnp.float32)
    w = jnp.asarray(rng.randn(4, 48, 96), jnp.float32)
    layout = block_layout(jnp.asarray(sizes), rows, block_m=gm.FEW_ROWS_CONFIG.block_m)
    padded = jnp.zeros((layout.num_padded, 48), jnp.float32).at[layout.positions].set(x)
    out = gmm(padded, layout.block_expert, w, config=gm.FEW_ROWS_CONFIG)[layout.positions]
    ref = jax.lax.ragged_dot(x, w, jnp.asarray(sizes), preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-4)


def test_gmm_reads_the_indexed_chunk_of_chunked_weights():
    """`ChunkedWeights`: the block experts index the chunk `index` (a traced scalar), and only that chunk is read;
    each chunk against the reference."""
    rng = np.random.RandomState(4)
    sizes = np.array([6, 0, 11, 3], np.int32)
    rows = int(sizes.sum())
    x = jnp.asarray(rng.randn(rows, 32), jnp.float32)
    chunks = tuple(jnp.asarray(rng.randn(4, 32, 48), jnp.float32) for _ in range(3))
    layout = block_layout(jnp.asarray(sizes), rows, block_m=16)
    padded = jnp.zeros((layout.num_padded, 32), jnp.float32).at[layout.positions].set(x)
    run = jax.jit(lambda a, e, i: gmm(a, e, ChunkedWeights(chunks, i), config=GMMConfig(block_n=16, block_k=16)))
    for index in (0, 2):
        got = run(padded, layout.block_expert, jnp.int32(index))[layout.positions]
        want = gmm_reference(padded, layout.block_expert, ChunkedWeights(chunks, jnp.int32(index)))[layout.positions]
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(got), np.asarray(gmm_reference(padded, layout.block_expert,
                                                                              chunks[index])[layout.positions]),
                                   rtol=1e-5, atol=1e-5)
