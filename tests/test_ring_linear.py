"""Ring-linear-2.0 parity against mlx-lm's `bailing_moe_linear` (mlx CPU, float32) on a tiny random checkpoint.

The checkpoint is written with the Hugging Face names of the released remote-code model (mlx-lm renames two of
them in `sanitize`; `helpers.save_checkpoint` undoes that), then read back through our converter.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
mlx_ring = pytest.importorskip("mlx_lm.models.bailing_moe_linear")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

import hypic_jax  # noqa: E402
from hypic_jax.core import linear_attn  # noqa: E402
from hypic_jax import cli  # noqa: E402
from hypic_jax.checkpoint.hf import convert_folder  # noqa: E402
from hypic_jax.checkpoint.hf.base import CheckpointReader  # noqa: E402
from helpers import RING_CONFIG, fake_devices_env, reference_model, rel_err, save_checkpoint  # noqa: E402
from hypic_jax.checkpoint.hf import ring_linear as ring_converter  # noqa: E402
from hypic_jax.models import mixing, ring_linear  # noqa: E402

# the module on one xdist worker (`--dist loadgroup`, pyproject.toml): the checkpoint built once
pytestmark = pytest.mark.xdist_group("ring_linear")

def _mlx_logits(model, tokens: np.ndarray) -> np.ndarray:
    return np.array(model(mx.array(tokens)), dtype=np.float32)


def _mlx_greedy(model, prompt: np.ndarray, steps: int) -> list[int]:
    cache = model.make_cache()
    out = model(mx.array(prompt)[None], cache=cache)
    token = int(mx.argmax(out[0, -1]).item())
    generated = [token]
    for _ in range(steps - 1):
        out = model(mx.array([[token]]), cache=cache)
        token = int(mx.argmax(out[0, -1]).item())
        generated.append(token)
    return generated


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    reference = reference_model("ring")
    folder = save_checkpoint(reference, tmp_path_factory.mktemp("ring") / "hf")
    return folder, reference, load_file(str(folder / "model.safetensors"))


@pytest.fixture(scope="module")
def model(checkpoint):
    folder, _, _ = checkpoint
    return hypic_jax.load(folder, dtype="float32")


def _prompt(length: int, seed: int = 0, batch: int | None = None) -> np.ndarray:
    shape = (length,) if batch is None else (batch, length)
    return np.random.default_rng(seed).integers(0, RING_CONFIG["vocab_size"], shape).astype(np.int32)


def test_layer_schedule_and_names(checkpoint):
    config = ring_linear.config_from_hf(RING_CONFIG)
    assert [config.is_full_attention(i) for i in range(6)] == [False, False, True, False, False, True]
    assert [config.is_moe(i) for i in range(6)] == [False] + [True] * 5
    _, _, weights = checkpoint
    assert "model.word_embeddings.weight" in weights
    assert "model.layers.0.attention.g_proj.weight" in weights
    assert "model.layers.1.mlp.gate.expert_bias" in weights
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in weights


def test_layer_factor_conventions():
    config = ring_linear.config_from_hf(RING_CONFIG)  # 6 layers: (L - 1) = 5
    assert config.layer_factor(0) == config.layer_factor(1) == pytest.approx(1 + 1e-5)
    assert config.layer_factor(4) == pytest.approx(1 - 3 / 5 + 1e-5)
    remote = ring_linear.config_from_hf({**RING_CONFIG, "layer_factor_convention": "remote"})
    assert remote.layer_factor(0) == pytest.approx(1 + 1 / 5 + 1e-5)
    assert remote.layer_factor(4) == config.layer_factor(4)
    vllm = ring_linear.config_from_hf({**RING_CONFIG, "layer_factor_convention": "vllm"})
    assert vllm.layer_factor(0) == pytest.approx(1 + 1e-5) and vllm.layer_factor(4) == pytest.approx(1 - 4 / 5 + 1e-5)
    with pytest.raises(ValueError, match="layer_factor_convention 'minimax'"):
        ring_linear.config_from_hf({**RING_CONFIG, "layer_factor_convention": "minimax"})


def test_defaults_follow_mlx():
    """A key left out of config.json means mlx-lm's default, for every field mlx-lm gives one."""
    import dataclasses

    ours = {f.name: f.default for f in dataclasses.fields(ring_linear.RingLinearConfig)}
    theirs = {f.name: f.default for f in dataclasses.fields(mlx_ring.ModelArgs) if f.default is not dataclasses.MISSING}
    assert {k: (ours[k], v) for k, v in theirs.items() if k in ours and ours[k] != v} == {}


def test_group_routing_without_topk_group_matches_mlx(tmp_path):
    """n_group 8 and no topk_group: mlx-lm keeps its default 4 of the 8 groups."""
    reference = reference_model("ring", num_hidden_layers=2, layer_group_size=2, first_k_dense_replace=0,
                                num_experts=16, num_experts_per_tok=4, n_group=8, without=("topk_group",))
    save_checkpoint(reference, tmp_path)
    tokens = _prompt(20, seed=3, batch=1)
    ours = hypic_jax.load(tmp_path, dtype="float32").logits(tokens)
    assert rel_err(ours, _mlx_logits(reference, tokens), norm="max") < 1e-4


@pytest.fixture(scope="module")
def batch_logits(model):
    """A batch of two 80-token prompts (longer than one 64-token chunk) and our causal logits for it."""
    tokens = _prompt(80, seed=1, batch=2)
    return tokens, np.asarray(model.logits(tokens))


@pytest.fixture(scope="module")
def step(model):
    """One jitted forward with an optional cache, shared by the cache tests to keep compilations few."""
    return jax.jit(functools.partial(ring_linear.forward, config=model.config))


def test_logits_match_mlx(checkpoint, batch_logits):
    _, reference, _ = checkpoint
    tokens, ours = batch_logits
    expected = _mlx_logits(reference, tokens)
    assert ours.shape == expected.shape == (2, 80, RING_CONFIG["vocab_size"])
    assert rel_err(ours, expected, norm="max") < 1e-4


def test_greedy_decode_matches_mlx(checkpoint, model):
    _, reference, _ = checkpoint
    prompt = _prompt(12, seed=2)
    ours = np.asarray(model.generate(prompt[None], 16))[0].tolist()  # through `prefill`, then cached steps
    assert ours == _mlx_greedy(reference, prompt, 16)


PREFILL, DECODE, MAX_LEN = 13, 3, 24


def test_prefill_then_decode_equals_full_forward(model, batch_logits, step):
    tokens, full = batch_logits
    cache = model.init_cache(batch=2, max_len=MAX_LEN)
    out, cache = step(model.params, tokens=tokens[:, :PREFILL], cache=cache)
    pieces = [np.asarray(out)]
    for t in range(PREFILL, PREFILL + DECODE):
        out, cache = step(model.params, tokens=tokens[:, t:t + 1], cache=cache)
        pieces.append(np.asarray(out))
    assert int(cache.length) == PREFILL + DECODE
    assert rel_err(np.concatenate(pieces, axis=1), full[:, :PREFILL + DECODE], norm="max") < 1e-5


def test_uncached_forward_returns_states_that_continue(model, batch_logits, step):
    """The cache a plain forward returns (K/V of its tokens, final linear states) is the true running state."""
    tokens, full = batch_logits
    _, prefix = step(model.params, tokens=tokens[:, :PREFILL])
    assert int(prefix.length) == PREFILL
    cache = ring_linear.decode_cache(model.config, prefix, MAX_LEN)
    out, _ = step(model.params, tokens=tokens[:, PREFILL:PREFILL + 1], cache=cache)
    assert rel_err(np.asarray(out)[:, 0], full[:, PREFILL], norm="max") < 1e-5


def _assert_same_params(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_segment_summaries_compose_with_rope(model):
    """DESIGN 2.3 on a real Ring linear layer: a segment summarised at position 0 and moved to offset p by rotating
    its state's key axis composes with the previous segment's summary into the true running state."""
    config, attn = model.config, model.params["layers"][1]["attn"]
    rotary_dim = config.rotary_dim(config.linear_head_dim)
    summarize = jax.vmap(lambda inputs: inputs.summarize())

    @jax.jit
    def true_and_composed(attn, x):
        mix = mixing.CausalMixing(None, jnp.arange(20), None)
        ring_linear.linear_mixer(attn, x, 1, config, mix)
        true_state = mix.emitted().state
        first = summarize(ring_linear.linear_inputs(attn, x[:, :10], jnp.arange(10), 1, config))
        second = summarize(ring_linear.linear_inputs(attn, x[:, 10:], jnp.arange(10), 1, config))
        moved = jax.vmap(lambda s: linear_attn.rotate_summary(s, 10, rotary_dim=rotary_dim, base=config.rope_theta))(
            second)
        return true_state, jax.vmap(linear_attn.advance)(moved, first.state)

    x = jax.random.normal(jax.random.key(0), (1, 20, config.hidden_size), jnp.float32)
    true_state, composed = true_and_composed(attn, x)
    assert rel_err(composed, true_state, norm="max") < 1e-5


def test_cli_convert_round_trip(checkpoint, model, tmp_path):
    folder, _, _ = checkpoint
    assert cli.main(["convert", str(folder), str(tmp_path / "ckpt"), "--dtype", "float32"]) == 0
    reloaded = hypic_jax.load(tmp_path / "ckpt", dtype="float32")
    assert reloaded.config == model.config
    _assert_same_params(reloaded.params, model.params)


def test_sharded_checkpoint(checkpoint, model, tmp_path):
    """Shards listed in model.safetensors.index.json convert to the same parameters."""
    folder, _, weights = checkpoint
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, members in shards.items():
        save_file({n: weights[n] for n in members}, str(tmp_path / file))
    index = {"metadata": {}, "weight_map": {n: f for f, members in shards.items() for n in members}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(json.dumps(RING_CONFIG))
    _, config, params = convert_folder(tmp_path, jnp.float32)
    assert config == model.config
    _assert_same_params(params, model.params)


def test_param_specs_match_params(model):
    specs = ring_linear.param_specs(model.config)
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731
    assert jax.tree.structure(specs, is_leaf=is_spec) == jax.tree.structure(model.params)
    for spec, param in zip(jax.tree.leaves(specs, is_leaf=is_spec), jax.tree.leaves(model.params)):
        assert len(spec) in (0, param.ndim)
    mesh = jax.make_mesh((1, 1), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    sharded = jax.device_put(model.params, ring_linear.shardings(model.config, mesh))
    assert sharded["layers"][1]["mlp"]["gate_up"].sharding.spec == jax.sharding.PartitionSpec("model", None, None)


_MESH_SCRIPT = """
import sys
import jax, numpy as np
import hypic_jax
mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
sharded = hypic_jax.load(sys.argv[1], dtype="float32", mesh=mesh)
plain = hypic_jax.load(sys.argv[1], dtype="float32")
assert sharded.params["layers"][1]["mlp"]["gate_up"].sharding.spec == jax.sharding.PartitionSpec("model", None, None)
tokens = np.random.default_rng(0).integers(0, sharded.config.vocab_size, (2, 12)).astype(np.int32)
print(float(np.abs(np.asarray(sharded.logits(tokens)) - np.asarray(plain.logits(tokens))).max()))
"""


def test_sharded_load_on_eight_devices(checkpoint):
    """`hypic_jax.load(..., mesh=)` places the parameters with `param_specs` on a 2 x 4 ("data", "model") mesh of
    fake CPU devices and gives the single-device logits."""
    folder, _, _ = checkpoint
    env = fake_devices_env(8)
    done = subprocess.run([sys.executable, "-c", _MESH_SCRIPT, str(folder)], env=env, capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.strip().splitlines()[-1]) < 1e-5


def test_bfloat16_load_runs(checkpoint):
    folder, _, _ = checkpoint
    model = hypic_jax.load(folder, dtype="bfloat16")
    assert model.params["layers"][1]["mlp"]["expert_bias"].dtype == jnp.float32
    assert model.params["layers"][0]["attn"]["qkv"].dtype == jnp.bfloat16
    out = model.logits(_prompt(8, seed=7, batch=1))
    assert out.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(out)))


# ---------------------------------------------------------------------------------------------------------------
# Converter errors


def _variant(checkpoint, tmp_path, edit=None, config_edit=None):
    folder, _, weights = checkpoint
    weights = dict(weights)
    if edit:
        edit(weights)
    config = {**RING_CONFIG, **(config_edit or {})}
    out = tmp_path / "variant"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    save_file(weights, str(out / "model.safetensors"))
    return out


def test_missing_tensor_is_named(checkpoint, tmp_path):
    name = "model.layers.3.attention.g_norm.weight"
    folder = _variant(checkpoint, tmp_path, edit=lambda w: w.pop(name))
    with pytest.raises(ValueError, match=f"missing tensor '{name}'"):
        convert_folder(folder, jnp.float32)


def test_misshaped_tensor_is_named(checkpoint, tmp_path):
    name = "model.layers.2.attention.query_key_value.weight"

    def edit(w):
        w[name] = w[name][:-1]

    folder = _variant(checkpoint, tmp_path, edit=edit)
    with pytest.raises(ValueError, match=rf"'{name}' has shape \(127, 64\), expected \(128, 64\)"):
        convert_folder(folder, jnp.float32)


def test_unexpected_tensor_is_named(checkpoint, tmp_path):
    name = "model.layers.0.attention.rotary_emb.inv_freq"

    def edit(w):
        w[name] = np.zeros(4, np.float32)

    folder = _variant(checkpoint, tmp_path, edit=edit)
    with pytest.raises(ValueError, match=f"unexpected tensor '{name}'"):
        convert_folder(folder, jnp.float32)


def test_unknown_model_type_is_named(checkpoint, tmp_path):
    folder = _variant(checkpoint, tmp_path, config_edit={"model_type": "ring_xl", "architectures": ["RingXL"]})
    with pytest.raises(ValueError, match="unknown model_type 'ring_xl'"):
        convert_folder(folder, jnp.float32)


def test_unsupported_option_is_named(checkpoint, tmp_path):
    folder = _variant(checkpoint, tmp_path, config_edit={"norm_head": True})
    with pytest.raises(ValueError, match="norm_head"):
        ring_converter.convert(CheckpointReader(folder), {**RING_CONFIG, "norm_head": True}, jnp.float32)
