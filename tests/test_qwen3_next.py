"""Parity of hypic_jax.models.qwen3_next with transformers (float32, tiny random checkpoints)."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import hypic_jax
from qwen_helpers import build, prompt, reference_greedy, reference_logits, relative_error, save


# the module on one xdist worker (`--dist loadgroup`, pyproject.toml): the checkpoint built once
pytestmark = pytest.mark.xdist_group("qwen3_next")


@pytest.fixture(scope="module")
def next_model(tmp_path_factory):
    reference = build("next")
    folder = save(reference, tmp_path_factory.mktemp("next"))
    return reference, hypic_jax.load(folder, dtype="float32")


def test_logits_match_transformers(next_model):
    reference, model = next_model
    assert model.arch.__name__.endswith("qwen3_next")
    tokens = prompt(2, 24)
    err = relative_error(model.logits(tokens), reference_logits(reference, tokens))
    assert err < 1e-4, f"max relative logit error {err:.2e}"


def test_greedy_generate_matches_transformers(next_model):
    reference, model = next_model
    tokens = prompt(2, 12, seed=1)
    np.testing.assert_array_equal(np.asarray(model.generate(tokens, 16)), reference_greedy(reference, tokens, 16))


def test_prefill_then_decode_equals_full_forward(next_model):
    _, model = next_model
    tokens = prompt(1, 20, seed=2)
    full = np.asarray(model.logits(tokens))
    step = jax.jit(functools.partial(model.arch.forward, config=model.config))
    cache = model.init_cache(batch=1, max_len=20)
    pieces = []
    for start, stop in ((0, 9), (9, 10), (10, 11), (11, 20)):
        logits, cache = step(model.params, tokens=tokens[:, start:stop], cache=cache)
        pieces.append(np.asarray(logits))
    err = relative_error(np.concatenate(pieces, axis=1), full)
    assert err < 1e-5, f"cached forward differs from full forward by {err:.2e}"


def test_dense_layers_and_unnormalised_router(tmp_path):
    """mlp_only_layers puts a dense MLP in layer 0; norm_topk_prob=False keeps raw top-k probabilities."""
    reference = build("next", seed=3, mlp_only_layers=[0], norm_topk_prob=False)
    model = hypic_jax.load(save(reference, tmp_path), dtype="float32")
    assert model.config.mlp_types == ("dense", "moe") and not model.config.norm_topk_prob
    tokens = prompt(1, 16, seed=4)
    err = relative_error(model.logits(tokens), reference_logits(reference, tokens))
    assert err < 1e-4, f"max relative logit error {err:.2e}"
