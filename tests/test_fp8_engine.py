"""The engine over block-wise FP8 weights (`kernels.fp8`, `models.quantize_params`), on the tiny Qwen3.5-MoE checkpoint;
the forward of Ring-linear and Kimi-Linear with FP8 weights.

The reference is the same model with the FP8 weights dequantized into float32 arrays: a model that has no FP8 in it,
run through the plain forward. Checked: full recompute equals its forward, a seam of the whole segment and a prefix
hit equal full recompute, a PIC mode equals the naive reference over the dequantized model, greedy generation
decodes like its generate; and FP8 weights are a different model to the cache (its fingerprint).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hypic_jax import models
from hypic_jax.engine import Engine
from hypic_jax.kernels import fp8

from helpers import arch_params, on_worker_of, rel_err
from reference import pic

DOC_LEN, QUERY_LEN, NUM_DOCS = 20, 6, 3


def _dequantized(params):
    return jax.tree.map(lambda w: fp8.dequantize(w, jnp.float32) if fp8.is_fp8(w) else w, params, is_leaf=fp8.is_fp8)


@pytest.fixture(scope="module")
def fp8_engines(tiny_checkpoints):
    made = {}

    def get(arch):
        if arch not in made:
            model, vocab, _ = tiny_checkpoints(arch)
            quantized = model.replace(params=models.quantize_params(model.arch, model.params),
                                      source=model.source + ":fp8")
            reference = model.replace(params=_dequantized(quantized.params))
            engine = Engine(quantized, max_prompt_tokens=1024, max_segments=8, token_rungs=(1024,),
                            cache_bytes=1 << 24, max_new_tokens=8, max_batch=2)
            made[arch] = (engine, quantized, reference, model, vocab)
        return made[arch]

    yield get
    for engine, *_ in made.values():
        engine.close()


@on_worker_of("fp8_engine")
def test_fp8_weights_keep_the_engines_identities(fp8_engines):
    """On the MoE checkpoint: its attention, GDN and shared-expert projections and its routed experts in FP8 (the
    dense MLP's FP8 forward is checked against transformers in tests/test_fp8_checkpoint.py)."""
    engine, quantized, reference, model, vocab = fp8_engines("qwen_moe")
    leaves = jax.tree.leaves(quantized.params, is_leaf=fp8.is_fp8)
    assert any(fp8.is_fp8(w) for w in leaves) and quantized.dtype == model.dtype
    assert sum(fp8.weight_bytes(w) for w in leaves) < 0.6 * sum(fp8.weight_bytes(w) for w in jax.tree.leaves(model.params))

    rng = np.random.default_rng(3)
    segs = [rng.integers(3, vocab, DOC_LEN).tolist() for _ in range(NUM_DOCS)] + [rng.integers(3, vocab, QUERY_LEN).tolist()]
    want = np.asarray(reference.logits(np.concatenate(segs)[None]))[0, -1]
    assert rel_err(np.asarray(model.logits(np.concatenate(segs)[None]))[0, -1], want) > 1e-4  # FP8 changes the model

    full = engine.prefill(segs, mode="full_recompute")
    assert rel_err(full.logits, want) < 1e-5
    assert rel_err(engine.prefill(segs, mode="transition_rope_recompute", seam=1.0).logits, want) < 1e-5
    engine.prefill(segs, mode="prefix_cache")
    warm = engine.prefill(segs, mode="prefix_cache")
    assert warm.stats.hits == NUM_DOCS and rel_err(warm.logits, want) < 1e-5

    shuffled = [segs[i] for i in (2, 0, 1)] + [segs[-1]]
    naive = pic.prefill(reference, shuffled, "transition_rope_recompute", 4)
    for _ in range(2):  # recorded and stitched, then read from the cache
        got = engine.prefill(shuffled, mode="transition_rope_recompute", seam=4, cache_salt="fp8")
        assert rel_err(got.logits, naive) < 1e-5

    expected = np.asarray(reference.generate(np.concatenate(segs)[None], 4))[0].tolist()
    assert engine.generate(segs, max_new_tokens=4, mode="prefix_cache").tokens == expected


@on_worker_of("fp8_engine")
def test_fp8_weights_are_another_model_to_the_cache(fp8_engines, tiny_checkpoints):
    engine, *_ = fp8_engines("qwen_moe")
    model, _, _ = tiny_checkpoints("qwen_moe")
    with Engine(model, max_prompt_tokens=1024, token_rungs=(1024,), cache_bytes=1 << 24, max_batch=1) as plain:
        assert plain.fingerprint != engine.fingerprint


@pytest.mark.parametrize("arch", arch_params("fp8_forward", ("ring", "kimi")))
def test_fp8_forward_and_decode_equal_the_dequantized_model(tiny_checkpoints, arch):
    """Ring-linear and Kimi-Linear with FP8 weights: the forward and the greedy decode (Ring's decode gathers each
    token's chosen experts, FP8 ones dequantized) equal the model whose weights are the dequantized values."""
    model, vocab, _ = tiny_checkpoints(arch)
    quantized = model.replace(params=models.quantize_params(model.arch, model.params))
    reference = model.replace(params=_dequantized(quantized.params))
    tokens = np.random.default_rng(5).integers(3, vocab, 40)[None]
    assert rel_err(quantized.logits(tokens), reference.logits(tokens)) < 1e-5
    assert np.array_equal(quantized.generate(tokens, 6), reference.generate(tokens, 6))
