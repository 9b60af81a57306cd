"""Kimi-Linear parity against transformers on a tiny random checkpoint built here (torch CPU, float32).

The tiny model has a KDA layer, a NoPE MLA layer (low-rank q), a dense first MLP and group-routed MoE layers with a
non-zero expert-score bias, so every Kimi-specific path is exercised; prompts are longer than one KDA chunk.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

from hypic_jax.checkpoint.hf.base import CheckpointReader  # noqa: E402
from hypic_jax.checkpoint.hf import kimi_linear as kimi_converter  # noqa: E402
from hypic_jax import load  # noqa: E402
from hypic_jax.models import kimi_linear as kimi  # noqa: E402
from helpers import VOCAB, fake_devices_env, reference_logits, reference_model, rel_err, save_checkpoint  # noqa: E402

# the module on one xdist worker (`--dist loadgroup`, pyproject.toml): the checkpoint built once
pytestmark = pytest.mark.xdist_group("kimi_linear")

FIRST_TOKEN = 3  # below: pad / bos ids; generate would mask pad tokens of a prompt


def random_tokens(seed, shape):
    return np.random.default_rng(seed).integers(FIRST_TOKEN, VOCAB, size=shape).astype(np.int32)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    reference = reference_model("kimi")
    return save_checkpoint(reference, tmp_path_factory.mktemp("kimi_linear")), reference


@pytest.fixture(scope="module")
def model(checkpoint):
    return load(checkpoint[0], dtype="float32")


def test_config_parsed_from_checkpoint(model):
    config = model.config
    assert config.layer_types == ("linear_attention", "full_attention", "linear_attention")
    assert config.mlp_types == ("dense", "sparse", "sparse")
    assert (config.num_experts, config.num_experts_per_tok, config.n_group, config.topk_group) == (8, 2, 4, 2)
    assert config.q_lora_rank == 24 and config.conv_kernel == 4


def test_logits_match_transformers(checkpoint, model):
    tokens = random_tokens(1, (2, 80))  # longer than one 64-token KDA chunk
    assert rel_err(model.logits(tokens), reference_logits(checkpoint[1], tokens), norm="max") < 1e-4


def test_greedy_decode_matches_transformers(checkpoint, model):
    prompt = random_tokens(2, (2, 12))
    reference = checkpoint[1]
    generation = transformers.GenerationConfig(do_sample=False, max_new_tokens=16, pad_token_id=0)
    with torch.no_grad():
        expected = reference.generate(
            torch.as_tensor(prompt, dtype=torch.long),
            attention_mask=torch.ones(prompt.shape, dtype=torch.long),
            generation_config=generation,
        )[:, prompt.shape[1] :]
    np.testing.assert_array_equal(np.asarray(model.generate(prompt, 16)), expected.numpy())


def test_prefill_then_decode_equals_full_forward(model):
    """A plain forward's returned caches (KDA state + conv tails, MLA latents), continued by a multi-token chunk
    and then single tokens (the absorbed-MLA / recurrent-KDA decode path), reproduce the full forward's logits."""
    tokens = random_tokens(1, (2, 80))  # the logits test's shape: its compiled forward is reused
    full = np.asarray(model.logits(tokens))
    prefill = jax.jit(lambda params, toks: kimi.forward(params, model.config, toks))
    step = jax.jit(lambda params, toks, cache: kimi.forward(params, model.config, toks, cache))
    out, prefix = prefill(model.params, tokens[:, :70])
    assert rel_err(out, full[:, :70], norm="max") < 1e-4
    cache = kimi.decode_cache(model.config, prefix, tokens.shape[1])
    for begin, end in [(70, 74)] + [(i, i + 1) for i in range(74, 80)]:
        out, cache = step(model.params, tokens[:, begin:end], cache)
        assert rel_err(out, full[:, begin:end], norm="max") < 1e-4
    assert int(cache.length) == tokens.shape[1]


def test_runtime_layout_full_rank_queries(tmp_path):
    """The released models' shape of MLA (q_proj, no q_lora_rank) and router (one group), from a folder in
    transformers' runtime layout (fused conv1d, forget_gate.*, fused experts) instead of save_pretrained's."""
    from safetensors.torch import save_file as save_torch

    reference = reference_model(
        "kimi",
        num_hidden_layers=2,
        layer_types=["full_attention", "linear_attention"],
        mlp_layer_types=["sparse", "sparse"],
        q_lora_rank=None,
        n_group=1,
        topk_group=1,
    )
    save_checkpoint(reference, tmp_path)  # config.json; the weights are written below in the runtime layout
    state = {name: tensor.contiguous() for name, tensor in reference.state_dict().items()}
    assert "model.layers.1.self_attn.conv1d.weight" in state and "model.layers.0.mlp.experts.gate_up_proj" in state
    save_torch(state, tmp_path / "model.safetensors")
    tokens = random_tokens(5, (1, 70))
    logits = load(tmp_path, dtype="float32").logits(tokens)
    assert rel_err(logits, reference_logits(reference, tokens), norm="max") < 1e-4


def test_tied_config_with_untied_head(tmp_path):
    """transformers' Kimi-Linear never ties its head (empty `_tied_weights_keys`): with tie_word_embeddings=True it
    writes and computes with its own lm_head, which the converter then uses instead of the embedding."""
    reference = reference_model(
        "kimi", num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse"], tie_word_embeddings=True,
    )  # fmt: skip
    save_checkpoint(reference, tmp_path)
    assert "lm_head.weight" in load_file(tmp_path / "model.safetensors")
    tokens = random_tokens(6, (1, 20))
    logits = load(tmp_path, dtype="float32").logits(tokens)
    assert rel_err(logits, reference_logits(reference, tokens), norm="max") < 1e-4


def test_original_config_layout():
    """The released checkpoints' config: linear_attn_config with 1-indexed layers, first_k_dense_replace, aliases."""
    hf = {
        "model_type": "kimi_linear",
        "vocab_size": 100,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "num_experts": 16,
        "num_experts_per_token": 4,
        "num_shared_experts": 2,
        "moe_renormalize": False,
        "num_expert_group": 4,
        "first_k_dense_replace": 2,
        "moe_router_activation_func": "sigmoid",
        "linear_attn_config": {
            "full_attn_layers": [2, 4],
            "kda_layers": [1, 3],
            "num_heads": 2,
            "head_dim": 8,
            "short_conv_kernel_size": 3,
        },
    }
    config = kimi.config_from_hf(hf)
    assert config.layer_types == ("linear_attention", "full_attention", "linear_attention", "full_attention")
    assert config.mlp_types == ("dense", "dense", "sparse", "sparse")
    assert (config.num_experts, config.num_experts_per_tok, config.num_shared_experts) == (16, 4, 2)
    assert (config.n_group, config.norm_topk_prob) == (4, False)
    assert (config.linear_num_heads, config.linear_head_dim, config.conv_kernel) == (2, 8, 3)
    with pytest.raises(ValueError, match="softmax"):
        kimi.config_from_hf({**hf, "moe_router_activation_func": "softmax"})


def test_param_specs_match_params(model):
    specs = kimi.param_specs(model.config)
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731
    assert jax.tree.structure(specs, is_leaf=is_spec) == jax.tree.structure(model.params)
    for spec, param in zip(jax.tree.leaves(specs, is_leaf=is_spec), jax.tree.leaves(model.params)):
        assert len(spec) <= param.ndim


def _corrupted_copy(src, dst, edit):
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


@pytest.mark.parametrize(
    "case, pattern",
    [
        ("missing", r"missing tensor 'model\.layers\.1\.self_attn\.kv_b_proj\.weight'"),
        ("shape", r"'model\.layers\.0\.self_attn\.q_conv1d\.weight' has shape \(64, 1, 3\), expected \(64, 1, 4\)"),
        ("extra", r"unexpected tensor 'model\.layers\.2\.self_attn\.bogus\.weight'"),
        ("expert", r"missing tensor 'model\.layers\.2\.block_sparse_moe\.experts\.5\.w3\.weight'"),
    ],
)
def test_converter_names_bad_tensors(checkpoint, tmp_path, case, pattern):
    def edit(tensors):
        if case == "missing":
            del tensors["model.layers.1.self_attn.kv_b_proj.weight"]
        elif case == "shape":
            name = "model.layers.0.self_attn.q_conv1d.weight"
            tensors[name] = tensors[name][..., :3].copy()
        elif case == "extra":
            tensors["model.layers.2.self_attn.bogus.weight"] = np.zeros((2, 2), np.float32)
        else:
            del tensors["model.layers.2.block_sparse_moe.experts.5.w3.weight"]

    folder = _corrupted_copy(checkpoint[0], tmp_path / case, edit)
    with pytest.raises(ValueError, match=pattern):
        kimi_converter.convert(CheckpointReader(folder), json.loads((folder / "config.json").read_text()), "float32")


def test_unknown_model_type_is_named(checkpoint, tmp_path):
    folder = tmp_path / "unknown"
    shutil.copytree(checkpoint[0], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "kimi_nonlinear"}))
    with pytest.raises(ValueError, match="kimi_nonlinear"):
        load(folder, dtype="float32")


def test_bfloat16_load_keeps_gates_float32(checkpoint):
    bf16 = load(checkpoint[0], dtype="bfloat16")
    layer = bf16.params["layers"][1]["mlp"]
    assert layer["router"].dtype == jnp.float32 and layer["gate_up"].dtype == jnp.bfloat16
    assert bf16.params["layers"][0]["attn"]["A_log"].dtype == jnp.float32


_MESH_SCRIPT = """
import sys
import numpy as np, jax, jax.numpy as jnp
from hypic_jax import load
from hypic_jax.models import base, kimi_linear as kimi
folder, tokens_file, out_file = sys.argv[1:]
tokens = np.load(tokens_file)
mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
model = load(folder, dtype="float32", mesh=mesh)  # placed with kimi.param_specs
params = model.params
rows = jax.device_put(tokens, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", None)))
empty = kimi.init_cache(model.config, *tokens.shape, jnp.float32)
cache = jax.device_put(empty, base.named_shardings(kimi.cache_specs(model.config), mesh))
logits, _ = jax.jit(lambda p, t, c: kimi.forward(p, model.config, t, c))(params, rows, cache)
np.save(out_file, np.asarray(logits))
"""


def test_sharded_forward_on_fake_mesh(checkpoint, model, tmp_path):
    """Parameters and caches placed with `param_specs` / `cache_specs` on a 2 x 4 ("data", "model") mesh of fake
    CPU devices give the single-device logits (in a subprocess: the device count is fixed when jax starts)."""
    import subprocess
    import sys

    tokens = random_tokens(1, (2, 80))
    np.save(tmp_path / "tokens.npy", tokens)
    env = fake_devices_env(8)
    args = [str(checkpoint[0]), str(tmp_path / "tokens.npy"), str(tmp_path / "logits.npy")]
    done = subprocess.run([sys.executable, "-c", _MESH_SCRIPT, *args], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert rel_err(np.load(tmp_path / "logits.npy"), np.asarray(model.logits(tokens)), norm="max") < 1e-5
