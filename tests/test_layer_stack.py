"""Layers stacked by their repeating pattern and run as one scan (`hypic_jax.models.layer_stack`).

`LayerPlan.find` on patterns with and without a head, a tail or any repeat; a plan's (part, member) addressing
round-trips; the grouped matmul reads a scanned layer's experts out of the whole bank exactly as from the layer's
own experts. On tiny checkpoints of every architecture whose layers repeat (Qwen3.5-MoE: 2 x [GDN, GDN,
attention]; Kimi: a dense first layer, then 2 x [MLA, KDA], then KDA; Ring: 2 x [linear, linear, full], with a
decay that differs per layer), the shape-stable engine with the layers scanned returns the same logits as with
every layer unrolled (prefix cache, full recompute, addition and transition_rope_recompute; hits and misses;
entries demoted to the host tier and promoted back); and `hypic_jax.Engine` runs a model whose layers are
stacked.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hypic_jax.engine import Engine
from hypic_jax.models import layers as model_layers
from hypic_jax.models.layer_stack import ExpertBank, LayerPlan, LayerStack
from hypic_jax.runtime import StableEngine, stack_layers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

L, F = "linear", "full"


@pytest.mark.parametrize("signatures, expected", [
    ([L, L, L, F] * 10, (0, 4, 10)),
    (["dense"] + [L, F] * 2 + [L], (1, 2, 2)),
    ([L, L, F] * 3 + [L], (0, 3, 3)),
    ([L, F, "moe"], (3, 0, 0)),  # nothing repeats: every layer unrolled
    ([L], (1, 0, 0)),
    ([L] * 6, (0, 1, 6)),
])
def test_find_plan(signatures, expected):
    plan = LayerPlan.find(signatures)
    assert (plan.head, plan.period, plan.repeats) == expected
    assert plan.layers == len(signatures)


@pytest.mark.parametrize("seed", range(6))
def test_plan_addressing_round_trips(seed):
    rng = np.random.default_rng(seed)
    head, period, repeats, tail = (int(x) for x in rng.integers(0, 4, 4))
    period, repeats = (period, repeats) if period and repeats else (0, 0)
    plan = LayerPlan(head + period * repeats + tail, head=head, period=period, repeats=repeats)
    seen = set()
    for layer in range(plan.layers):
        part, member = plan.part(layer)
        assert plan.layer(part, member) == layer
        assert 0 <= member < plan.members(part)
        seen.add((part, member))
    assert sum(plan.members(p) for p in range(plan.parts)) == plan.layers == len(seen)


def test_expert_bank_in_the_grouped_matmul():
    """A scanned layer's experts as rows of the bank (`ExpertBank`), through the Pallas kernel (interpret mode)
    and through ragged_dot, equal the layer's own experts."""
    rng = np.random.default_rng(0)
    repeats, experts, hidden, width, tokens, top = 3, 8, 32, 16, 12, 2
    gate_up = jnp.asarray(rng.normal(size=(repeats, experts, hidden, 2 * width)), jnp.float32)
    down = jnp.asarray(rng.normal(size=(repeats, experts, width, hidden)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(tokens, hidden)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.choice(experts, top, replace=False) for _ in range(tokens)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(size=(tokens, top)), jnp.float32)
    for layer in range(repeats):
        want = model_layers.grouped_swiglu_experts(x, weights, ids, gate_up[layer], down[layer], impl="ragged")
        for impl in ("pallas", "ragged"):
            got = model_layers.grouped_swiglu_experts(x, weights, ids, ExpertBank(gate_up, jnp.int32(layer)),
                                                      ExpertBank(down, jnp.int32(layer)), impl=impl)
            assert _rel(got, want) < 1e-5, (layer, impl)


def _checkpoint(arch: str, folder):
    import hypic_jax

    if arch == "qwen_moe":
        from qwen_helpers import build, save

        save(build("moe", num_hidden_layers=6, layer_types=["linear_attention", "linear_attention",
                                                            "full_attention"] * 2), folder)
        vocab = 128
    elif arch == "kimi":
        from test_kimi_linear import build_reference

        build_reference(folder, num_hidden_layers=6, layer_types=["linear_attention"] + ["full_attention",
                                                                                           "linear_attention"] * 2
                        + ["linear_attention"], mlp_layer_types=["dense"] + ["sparse"] * 5)
        vocab = 128
    else:
        pytest.importorskip("mlx.core")
        from test_ring_linear import TINY_CONFIG, _build_reference, _write_checkpoint

        config = {**TINY_CONFIG, "num_hidden_layers": 6, "first_k_dense_replace": 0}
        _write_checkpoint(_build_reference(config), config, folder)
        vocab = config["vocab_size"]
    return hypic_jax.load(folder, dtype="float32"), vocab


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("arch", ["qwen_moe", "kimi", "ring"])
def test_scanned_layers_equal_unrolled(arch, tmp_path):
    model, vocab = _checkpoint(arch, tmp_path / arch)
    # a host tier: the device entries are demoted midway and promoted back through the stacked pools
    options = dict(max_prompt_tokens=128, max_segments=4, token_rungs=(128,), cache_bytes=1 << 19,
                   mean_entry_tokens=32, max_new_tokens=0, host_cache_bytes=1 << 22, eviction="lru")
    scanned, unrolled = StableEngine(model, **options), StableEngine(model, scan_layers=False, **options)
    assert scanned.plan.scanned and not unrolled.plan.scanned
    rng = np.random.default_rng(0)
    docs = [rng.integers(3, vocab, int(n)).tolist() for n in rng.integers(6, 30, 4)]
    query = rng.integers(3, vocab, 7).tolist()
    requests = [("prefix_cache", [0, 1, 2]), ("transition_rope_recompute", [3, 0, 1]), "demote",
                ("transition_rope_recompute", [0, 1, 3]), ("addition", [2, 3]), ("full_recompute", [1, 3])]
    hits = 0
    for request in requests:
        if request == "demote":
            for engine in (scanned, unrolled):
                with engine._device_lock:
                    while engine.cache.evict_one():
                        pass
            continue
        mode, order = request
        segs = [docs[i] for i in order] + [query]
        a = scanned.prefill(segs, mode=mode, seam=4)
        b = unrolled.prefill(segs, mode=mode, seam=4)
        assert (a.stats.hits, a.stats.misses) == (b.stats.hits, b.stats.misses)
        hits += a.stats.hits
        assert _rel(a.logits, b.logits) < 1e-5, (mode, order)
    assert hits > 0
    assert scanned.stats["tiers"]["promotions"]["host"] > 0  # pieces went to the host and came back
    assert scanned.stats["tiers"]["promotions"] == unrolled.stats["tiers"]["promotions"]


def test_engine_runs_stacked_layers(tmp_path):
    """`hypic_jax.Engine` and `Model` read a `LayerStack` like the list of layers (static slices; experts as
    banks), so one stacked copy serves both engines."""
    model, vocab = _checkpoint("qwen_moe", tmp_path / "qwen")
    stacked = stack_layers(model)
    assert isinstance(stacked.params["layers"], LayerStack) and stacked.params["layers"].plan.repeats == 2
    rng = np.random.default_rng(1)
    segs = [rng.integers(3, vocab, n).tolist() for n in (30, 20, 5)]
    want = Engine(model).prefill(segs, mode="full_recompute").logits
    got = Engine(stacked).prefill(segs, mode="full_recompute").logits
    assert _rel(got, want) < 1e-5
    tokens = np.asarray([segs[0][:12]], np.int32)
    np.testing.assert_allclose(np.asarray(stacked.logits(tokens)), np.asarray(model.logits(tokens)), atol=1e-5)
    # a StableEngine on the stacked model uses its stack (no copy) and its plan
    engine = StableEngine(stacked, max_prompt_tokens=128, max_segments=4, token_rungs=(128,), max_new_tokens=0)
    assert engine.params["layers"] is stacked.params["layers"]
