"""Parity of hypic_jax.models.qwen3_5 with transformers (float32, tiny random checkpoints)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import hypic_jax
from hypic_jax.core import attention
from hypic_jax.models import base, layers, qwen3_5
from hypic_jax.models.base import KernelOptions
from helpers import (examples, fake_devices_env, prompt, reference_greedy, reference_logits, reference_model, rel_err,
                     save_checkpoint)

# the module on one xdist worker (`--dist loadgroup`, pyproject.toml): the checkpoints built once
pytestmark = pytest.mark.xdist_group("qwen3_5")

KINDS = ("dense", "moe", "moe_wrapper")
_forward = jax.jit(qwen3_5.forward, static_argnames="config")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """kind -> (folder, transformers model, hypic model)."""
    out = {}
    for kind in KINDS:
        reference = reference_model(f"qwen_{kind}")
        folder = save_checkpoint(reference, tmp_path_factory.mktemp(kind))
        out[kind] = (folder, reference, hypic_jax.load(folder, dtype="float32"))
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers(checkpoints, kind):
    _, reference, model = checkpoints[kind]
    tokens = prompt(2, 24)
    err = rel_err(model.logits(tokens), reference_logits(reference, tokens), norm="max")
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
    err = rel_err(np.concatenate(pieces, axis=1), full, norm="max")
    assert err < 1e-5, f"{kind}: cached forward differs from full forward by {err:.2e}"

    # the fresh-prompt fast path (causal kernel, last-position head) leaves the same caches behind
    last, fresh = jax.jit(qwen3_5.prefill, static_argnames=("config", "max_len"))(
        model.params, model.config, tokens[:, :9], 24
    )
    assert rel_err(last, full[:, 8], norm="max") < 1e-5
    logits, fresh = _forward(model.params, model.config, tokens[:, 9:10], fresh)
    assert rel_err(logits[:, 0], full[:, 9], norm="max") < 1e-5


@pytest.mark.parametrize("kind", ("dense", "moe"))
def test_rows_at_their_own_positions(checkpoints, kind):
    """A batch whose rows sit at different lengths (`ModelCache.length` [B], a batched decode step) gives each row
    the logits and caches of its own batch-of-one forward: keys written at each row's position, attention masked
    per row, nothing mixed across rows."""
    _, _, model = checkpoints[kind]
    tokens = prompt(3, 14, seed=5)
    starts = (9, 4, 12)
    rows, alone = [], []
    for b, start in enumerate(starts):
        cache = model.init_cache(batch=1, max_len=16)
        _, cache = _forward(model.params, model.config, tokens[b:b + 1, :start], cache)
        rows.append(cache)
        alone.append(_forward(model.params, model.config, tokens[b:b + 1, start:start + 2], cache))
    batched = jax.tree.map(lambda *a: np.concatenate(a), *(c.layers for c in rows))
    lengths = np.asarray(starts, np.int32)
    step = np.stack([tokens[b, s:s + 2] for b, s in enumerate(starts)])  # two tokens per row, each at its own start
    logits, cache = _forward(model.params, model.config, step, base.ModelCache(batched, lengths))
    np.testing.assert_array_equal(np.asarray(cache.length), lengths + 2)
    for b, (want_logits, want_cache) in enumerate(alone):
        assert rel_err(logits[b:b + 1], want_logits, norm="max") < 1e-5, b
        for got, want in zip(jax.tree.leaves(cache.layers), jax.tree.leaves(want_cache.layers)):
            assert rel_err(np.asarray(got)[b:b + 1], want, norm="max") < 1e-5, b


@examples(6)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 40), st.sampled_from([(4, 2), (6, 3), (2, 2)]),
       st.integers(0, 2**31 - 1))
def test_few_query_attention_matches_a_float64_reference(batch, q_len, keys, heads, seed):
    """The decode path (a few query rows: products and sums over the cache layout) and whichever path the backend
    takes equal masked GQA softmax attention in float64, with per-row query positions and empty slots (negative
    key positions)."""
    rng = np.random.default_rng(seed)
    hq, hkv = heads
    q = rng.standard_normal((batch, q_len, hq, 8)).astype(np.float32)
    k, v = rng.standard_normal((2, batch, keys, hkv, 8)).astype(np.float32)
    k_pos = np.where(rng.random((batch, keys)) < 0.15, -1, np.arange(keys)[None]).astype(np.int32)
    q_pos = (rng.integers(0, keys, (batch, 1)) + np.arange(q_len)[None]).astype(np.int32)
    few = np.asarray(attention._few_query_attention(q, k, v, 0.3, q_pos, k_pos))
    got = np.asarray(attention.dot_product_attention(q, k, v, scale=0.3, q_positions=q_pos, k_positions=k_pos))
    group = hq // hkv
    want = np.zeros(q.shape)
    for b in range(batch):
        for i in range(q_len):
            seen = (k_pos[b] <= q_pos[b, i]) & (k_pos[b] >= 0)
            for h in range(hq):
                if not seen.any():  # no visible key: a uniform average (no NaN)
                    want[b, i, h] = v[b, :, h // group].astype(np.float64).mean(0)
                    continue
                s = 0.3 * k[b, seen, h // group].astype(np.float64) @ q[b, i, h].astype(np.float64)
                p = np.exp(s - s.max())
                want[b, i, h] = (p / p.sum()) @ v[b, seen, h // group].astype(np.float64)
    np.testing.assert_allclose(few, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)  # the backend's choice of path


def test_masked_attention_in_query_blocks(monkeypatch):
    """Long masked queries run in blocks; the result equals one unblocked masked attention."""
    rng = np.random.RandomState(0)
    q = rng.randn(2, 11, 4, 8).astype(np.float32)
    k, v = rng.randn(2, 2, 16, 2, 8).astype(np.float32)
    q_pos, k_pos = np.arange(5, 16), np.where(np.arange(16) < 14, np.arange(16), -1)
    whole = layers.dot_product_attention(q, k, v, scale=0.3, q_positions=q_pos, k_positions=k_pos)
    monkeypatch.setattr(attention, "MASKED_QUERY_BLOCK", 4)
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


def test_pallas_kernels_match_transformers(checkpoints):
    """KernelOptions(linear="pallas", moe="pallas") route prefill through hypic_jax.kernels.gdn and the Pallas
    grouped matmul (both interpreted on the CPU; "auto" picks the MoE kernel on a GPU)."""
    _, reference, model = checkpoints["moe"]
    tokens = prompt(2, 24)
    kernels = KernelOptions(linear="pallas", moe="pallas")
    logits, _ = jax.jit(qwen3_5.forward, static_argnames=("config", "kernels"))(model.params, model.config, tokens,
                                                                                 kernels=kernels)
    assert rel_err(logits, reference_logits(reference, tokens), norm="max") < 1e-4


_MESH_SCRIPT = r"""
import functools, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from hypic_jax.models import base, qwen3_5 as Q
config = Q.Config(vocab_size=128, hidden_size=64, layer_types=("linear_attention", "full_attention"),
    mlp_types=("moe", "dense"), num_attention_heads=4, num_key_value_heads=2, head_dim=32, rotary_dim=8,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    intermediate_size=96, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=48)
params = Q.init_params(config, jax.random.key(0), jnp.float32)
tokens = np.random.RandomState(0).randint(0, 128, (2, 12)).astype(np.int32)
forward = jax.jit(Q.forward, static_argnames="config")
expected, _ = forward(params, config, tokens)
mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
sharded = base.shard_params(params, Q.param_specs(config), mesh)
assert len(sharded["layers"][0]["mlp"]["gate_up"].sharding.device_set) == 8
rows = jax.device_put(tokens, NamedSharding(mesh, P("data", None)))
cache = jax.device_put(Q.init_cache(config, 2, 16, jnp.float32), base.named_shardings(Q.cache_specs(config), mesh))
first, cache = forward(sharded, config, rows[:, :11], cache)
last, cache = forward(sharded, config, rows[:, 11:], cache)
np.testing.assert_allclose(np.asarray(first), np.asarray(expected[:, :11]), rtol=2e-5, atol=2e-5)
np.testing.assert_allclose(np.asarray(last[:, 0]), np.asarray(expected[:, 11]), rtol=2e-5, atol=2e-5)
print("ok")
"""


def test_sharded_forward_and_decode_on_fake_mesh():
    """Params and caches placed with param_specs / cache_specs on a 2 x 4 ("data", "model") mesh of fake CPU devices
    give the single-device logits through prefill + decode (subprocess: the device count is fixed when jax starts)."""
    import subprocess
    import sys

    env = fake_devices_env(8)
    done = subprocess.run([sys.executable, "-c", _MESH_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
