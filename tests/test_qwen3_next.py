"""Parity of hypic_jax.models.qwen3_next with transformers (float32, tiny random checkpoints)."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import hypic_jax
from hypic_jax.models import qwen3_next
from helpers import prompt, reference_greedy, reference_logits, reference_model, rel_err, save_checkpoint


# the module on one xdist worker (`--dist loadgroup`, pyproject.toml): the checkpoint built once
pytestmark = pytest.mark.xdist_group("qwen3_next")


@pytest.fixture(scope="module")
def next_model(tmp_path_factory):
    reference = reference_model("qwen_next")
    folder = save_checkpoint(reference, tmp_path_factory.mktemp("next"))
    return reference, hypic_jax.load(folder, dtype="float32")


def test_logits_match_transformers(next_model):
    reference, model = next_model
    assert model.arch.__name__.endswith("qwen3_next")
    tokens = prompt(2, 24)
    err = rel_err(model.logits(tokens), reference_logits(reference, tokens), norm="max")
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
    err = rel_err(np.concatenate(pieces, axis=1), full, norm="max")
    assert err < 1e-5, f"cached forward differs from full forward by {err:.2e}"


def test_dense_layers_and_unnormalised_router(tmp_path):
    """mlp_only_layers puts a dense MLP in layer 0; norm_topk_prob=False keeps raw top-k probabilities."""
    reference = reference_model("qwen_next", seed=3, mlp_only_layers=[0], norm_topk_prob=False)
    model = hypic_jax.load(save_checkpoint(reference, tmp_path), dtype="float32")
    assert model.config.mlp_types == ("dense", "moe") and not model.config.norm_topk_prob
    tokens = prompt(1, 16, seed=4)
    err = rel_err(model.logits(tokens), reference_logits(reference, tokens), norm="max")
    assert err < 1e-4, f"max relative logit error {err:.2e}"


def test_zero_width_shared_expert(tmp_path):
    """shared_expert_intermediate_size=0: transformers still writes the empty shared-expert matrices and its gate
    (the expert adds 0); they load as no shared expert."""
    reference = reference_model("qwen_next", seed=5, shared_expert_intermediate_size=0)
    model = hypic_jax.load(save_checkpoint(reference, tmp_path), dtype="float32")
    assert model.config.shared_expert_intermediate_size == 0
    tokens = prompt(1, 16, seed=6)
    err = rel_err(model.logits(tokens), reference_logits(reference, tokens), norm="max")
    assert err < 1e-4, f"max relative logit error {err:.2e}"


@pytest.mark.parametrize(
    "edit, named",
    [
        ({"hidden_act": "gelu"}, "hidden_act"),  # the MLPs' and the GDN conv's activation in transformers
        ({"partial_rotary_factor": 0.75}, "partial_rotary_factor"),  # 9 of head_dim 12: odd
        ({"num_key_value_heads": None}, "num_key_value_heads"),  # transformers' default differs by model type
    ],
)
def test_config_fields_not_computed_are_refused_by_name(edit, named):
    hf = {
        "model_type": "qwen3_next", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12, "partial_rotary_factor": 0.5,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "intermediate_size": 96,
    }  # fmt: skip
    hf.update(edit)
    with pytest.raises(ValueError, match=named):
        qwen3_next.config_from_hf({k: v for k, v in hf.items() if v is not None})
