"""Parity of hypic_jax.models.qwen3_5 with transformers (float32, tiny random checkpoints)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import hypic_jax
from hypic_jax.models import layers, qwen3_5
from qwen_helpers import build, prompt, reference_greedy, reference_logits, relative_error, save

KINDS = ("dense", "moe", "moe_wrapper")
_forward = jax.jit(qwen3_5.forward, static_argnames="config")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """kind -> (folder, transformers model, hypic model)."""
    out = {}
    for kind in KINDS:
        reference = build(kind)
        folder = save(reference, tmp_path_factory.mktemp(kind))
        out[kind] = (folder, reference, hypic_jax.load(folder, dtype="float32"))
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers(checkpoints, kind):
    _, reference, model = checkpoints[kind]
    tokens = prompt(2, 24)
    err = relative_error(model.logits(tokens), reference_logits(reference, tokens))
    assert err < 1e-4, f"{kind}: max relative logit error {err:.2e}"


@pytest.mark.parametrize("kind", ("dense", "moe"))
def test_greedy_generate_matches_transformers(checkpoints, kind):
    _, reference, model = checkpoints[kind]
    tokens = prompt(2, 12, seed=1)
    ours = np.asarray(model.generate(tokens, 16))
    np.testing.assert_array_equal(ours, reference_greedy(reference, tokens, 16))


@pytest.mark.parametrize("kind", ("dense", "moe"))
def test_prefill_then_decode_equals_full_forward(checkpoints, kind):
    """Prefill 9 tokens, decode 2 single tokens, then a 9-token chunk: every logit equals the plain forward."""
    _, _, model = checkpoints[kind]
    tokens = prompt(2, 20, seed=2)
    full = np.asarray(model.logits(tokens))
    cache = model.init_cache(batch=2, max_len=24)
    pieces = []
    for start, stop in ((0, 9), (9, 10), (10, 11), (11, 20)):
        logits, cache = _forward(model.params, model.config, tokens[:, start:stop], cache)
        pieces.append(np.asarray(logits))
    assert int(cache.length) == 20
    err = relative_error(np.concatenate(pieces, axis=1), full)
    assert err < 1e-5, f"{kind}: cached forward differs from full forward by {err:.2e}"

    # the fresh-prompt fast path (causal kernel, last-position head) leaves the same caches behind
    last, fresh = jax.jit(qwen3_5.prefill, static_argnames=("config", "max_len"))(
        model.params, model.config, tokens[:, :9], 24
    )
    assert relative_error(last, full[:, 8]) < 1e-5
    logits, fresh = _forward(model.params, model.config, tokens[:, 9:10], fresh)
    assert relative_error(logits[:, 0], full[:, 9]) < 1e-5


def test_masked_attention_in_query_blocks(monkeypatch):
    """Long masked queries run in blocks; the result equals one unblocked masked attention."""
    rng = np.random.RandomState(0)
    q = rng.randn(2, 11, 4, 8).astype(np.float32)
    k, v = rng.randn(2, 2, 16, 2, 8).astype(np.float32)
    q_pos, k_pos = np.arange(5, 16), np.where(np.arange(16) < 14, np.arange(16), -1)
    whole = layers.dot_product_attention(q, k, v, scale=0.3, q_positions=q_pos, k_positions=k_pos)
    monkeypatch.setattr(layers, "MASKED_QUERY_BLOCK", 4)
    blocked = layers.dot_product_attention(q, k, v, scale=0.3, q_positions=q_pos, k_positions=k_pos)
    np.testing.assert_allclose(np.asarray(blocked), np.asarray(whole), rtol=1e-6, atol=1e-6)


def test_config_reads_hf_layout(checkpoints):
    model = checkpoints["moe_wrapper"][2]
    config = model.config
    assert config.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert config.mlp_types == ("moe",) * 4
    assert config.rotary_dim == 8 and config.num_experts == 8


def test_param_specs_cover_params(checkpoints):
    model = checkpoints["moe"][2]
    specs = model.arch.param_specs(model.config)
    assert jax.tree.structure(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)) == (
        jax.tree.structure(model.params)
    )
    for spec, leaf in zip(
        jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)),
        jax.tree.leaves(model.params),
    ):
        assert len(spec) <= leaf.ndim


def test_pallas_gdn_kernel_matches_xla_core(checkpoints):
    """config.gdn_kernel="pallas" routes prefill through hypic_jax.pallas.gdn (interpreted on the CPU)."""
    _, reference, model = checkpoints["moe"]
    tokens = prompt(2, 24)
    config = dataclasses.replace(model.config, gdn_kernel="pallas")
    logits, _ = jax.jit(qwen3_5.forward, static_argnames="config")(model.params, config, tokens)
    assert relative_error(logits, reference_logits(reference, tokens)) < 1e-4
