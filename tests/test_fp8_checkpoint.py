"""Block-wise FP8 checkpoints: `hypic-jax convert --quantize fp8` writes Hugging Face's format, `hypic_jax.load`
reads it into `BlockFP8` weights, quantize-on-load, orbax round trips and the errors.

The references are independent of the converters: the FP8 folders' tensors read with safetensors' torch loader and
dequantized in NumPy (`np.kron` of the block scales), and transformers' forward with those weights."""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import load_file, save_file

import hypic_jax
from hypic_jax import models
from hypic_jax.checkpoint import read_metadata
from hypic_jax.checkpoint.hf import quantize_folder
from hypic_jax.checkpoint.hf import base as converter_base
from hypic_jax.cli import main as cli_main
from hypic_jax.kernels import fp8
from helpers import (copy_folder, prompt, reference_logits, reference_model, rel_err, rewrite_safetensors,
                     save_checkpoint)

pytestmark = pytest.mark.xdist_group("fp8_checkpoint")  # the folders built once, on one worker

B = 128
SCALE = "_scale_inv"
# tensors that must stay unquantized (routers, one-column gates, the GDN's a / b, norms, convs, embedding, head)
KEEP = ("mlp.gate.weight", "shared_expert_gate.weight", "in_proj_a.weight", "in_proj_b.weight", "in_proj_ba.weight",
        "norm.weight", "layernorm.weight", "conv1d.weight", "embed_tokens.weight", "lm_head.weight", "A_log",
        "dt_bias", "word_embeddings.weight", "e_score_correction_bias", "expert_bias", "f_a_proj.weight",
        "f_b_proj.weight", "g_a_proj.weight", "g_b_proj.weight", "kv_b_proj.weight", ".b_proj.weight")
# and some that must be FP8 in each architecture's folder
QUANTIZED = {
    "qwen_dense": ("model.layers.0.linear_attn.in_proj_qkv.weight", "model.layers.1.self_attn.q_proj.weight",
                   "model.layers.0.mlp.down_proj.weight"),
    "qwen_moe": ("model.layers.0.mlp.experts.3.up_proj.weight", "model.layers.1.mlp.shared_expert.down_proj.weight",
                 "model.layers.0.linear_attn.out_proj.weight"),
    "qwen_next": ("model.layers.0.linear_attn.in_proj_qkvz.weight", "model.layers.1.mlp.experts.0.gate_proj.weight"),
    "kimi": ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
             "model.layers.1.self_attn.q_b_proj.weight"),
    "ring": ("model.layers.0.attention.query_key_value.weight", "model.layers.1.mlp.experts.2.down_proj.weight",
             "model.layers.0.attention.g_proj.weight"),
}


@functools.lru_cache(maxsize=None)
def _folders(arch: str, root: str):
    """(bf16-free float32 source folder, its FP8 copy written by the CLI) of a tiny `arch` model."""
    root = Path(root)
    src = save_checkpoint(reference_model(arch, seed=11), root / arch / "src")
    (src / "tokenizer.json").write_text('{"tiny": true}')
    dst = root / arch / "fp8"
    assert cli_main(["convert", str(src), str(dst), "--quantize", "fp8"]) == 0
    return src, dst


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("fp8"))
    return lambda arch: _folders(arch, root)


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _dequantized(folder: Path, block: int = B) -> dict[str, np.ndarray]:
    """Every tensor of an FP8 folder in float32, each FP8 weight times its block x block block's scale."""
    tensors = _tensors(folder)
    out = {}
    for name, t in tensors.items():
        if name.endswith(SCALE):
            continue
        w = t.float().numpy()
        if t.dtype == torch.float8_e4m3fn:
            s = tensors[name + SCALE].float().numpy()
            w = w * np.kron(s, np.ones((block, block), np.float32))[: w.shape[0], : w.shape[1]]
        out[name] = w
    return out


def _plain_folder(fp8_folder: Path, dst: Path, block: int = B) -> Path:
    """The FP8 folder's weights dequantized into an unquantized float32 folder."""
    dst.mkdir(parents=True, exist_ok=True)
    save_numpy(_dequantized(fp8_folder, block), str(dst / "model.safetensors"))
    config = json.loads((fp8_folder / "config.json").read_text())
    config.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _flat(params):
    return jax.tree_util.tree_flatten_with_path(params, is_leaf=fp8.is_fp8)[0]


def _assert_same_params(actual, expected, exact_fp8=True):
    """Equal trees: FP8 weights with equal values, scales and blocks, the rest equal."""
    a, e = _flat(actual), _flat(expected)
    assert [p for p, _ in a] == [p for p, _ in e]
    for (path, x), (_, y) in zip(a, e):
        assert fp8.is_fp8(x) == fp8.is_fp8(y), jax.tree_util.keystr(path)
        if fp8.is_fp8(x):
            assert x.block == y.block and x.dtype == y.dtype
            np.testing.assert_array_equal(np.asarray(x.value, np.float32), np.asarray(y.value, np.float32))
            np.testing.assert_array_equal(np.asarray(x.scale), np.asarray(y.scale))
        else:
            assert x.dtype == y.dtype, jax.tree_util.keystr(path)
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ----------------------------------------------------------------------------------------------------------------
# The written folder


@pytest.mark.parametrize("arch", ["qwen_dense", "qwen_moe", "qwen_next", "kimi", "ring"])
def test_convert_quantizes_exactly_the_fp8_weights(folders, arch):
    src, dst = folders(arch)
    original = {k: v.float().numpy() for k, v in _tensors(src).items()}
    written = _tensors(dst)
    config = json.loads((dst / "config.json").read_text())
    qc = config["quantization_config"]
    assert {k: qc[k] for k in ("quant_method", "fmt", "activation_scheme", "weight_block_size")} == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [B, B]}
    assert (dst / "tokenizer.json").read_text() == '{"tiny": true}'
    assert set(written) - {n for n in written if n.endswith(SCALE)} == set(original)
    fp8_names = {n for n, t in written.items() if t.dtype == torch.float8_e4m3fn}
    assert set(QUANTIZED[arch]) <= fp8_names
    assert not [n for n in fp8_names if n.endswith(KEEP)]
    assert {n + SCALE for n in fp8_names} == {n for n in written if n.endswith(SCALE)}
    for name, t in written.items():
        if name.endswith(SCALE):
            continue
        if name not in fp8_names:
            np.testing.assert_array_equal(t.float().numpy(), original[name])
            continue
        w = original[name]
        out, inner = w.shape
        padded = np.zeros((-(-out // B) * B, -(-inner // B) * B), np.float32)
        padded[:out, :inner] = np.abs(w)
        amax = padded.reshape(padded.shape[0] // B, B, padded.shape[1] // B, B).max(axis=(1, 3))
        np.testing.assert_allclose(written[name + SCALE].numpy(), np.where(amax > 0, amax / 448.0, 1.0), rtol=1e-6)
        error = np.abs(_dequantized_one(t, written[name + SCALE]) - w)
        assert np.all(error <= np.kron(amax, np.ones((B, B)))[:out, :inner] / 16 + 1e-12), name
    # every linear layer left unquantized is named, nothing else
    linears = {n[: -len(".weight")] for n, v in original.items()
               if n.endswith(".weight") and v.ndim == 2 and n not in fp8_names and "embed" not in n}
    assert set(qc["modules_to_not_convert"]) == linears


def _dequantized_one(value: torch.Tensor, scale: torch.Tensor) -> np.ndarray:
    w = value.float().numpy()
    return w * np.kron(scale.float().numpy(), np.ones((B, B), np.float32))[: w.shape[0], : w.shape[1]]


# ----------------------------------------------------------------------------------------------------------------
# Loading


@pytest.mark.parametrize("arch", ["qwen_dense", "qwen_moe", "qwen_next", "kimi", "ring"])
def test_load_gives_fp8_leaves_equal_to_the_dequantized_checkpoint(folders, arch, tmp_path):
    _, dst = folders(arch)
    model = hypic_jax.load(dst, "float32")
    plain = hypic_jax.load(_plain_folder(dst, tmp_path / "plain"), "float32")
    got, expected = _flat(model.params), _flat(plain.params)
    assert [p for p, _ in got] == [p for p, _ in expected]
    assert sum(fp8.is_fp8(leaf) for _, leaf in got) > 5
    for (path, leaf), (_, want) in zip(got, expected):
        assert fp8.is_fp8(leaf) == models.fp8_leaf(model.arch, path), jax.tree_util.keystr(path)
        if fp8.is_fp8(leaf):
            *lead, k, n = leaf.shape
            assert leaf.value.dtype == fp8.FP8_DTYPE and leaf.scale.shape == (*lead, -(-k // B), n)
            assert leaf.dtype == np.float32 and leaf.block == B
            leaf = fp8.dequantize(leaf, np.float32)
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(want), err_msg=jax.tree_util.keystr(path))
    assert model.source.endswith(":float32:fp8") and not plain.source.endswith(":fp8")


@pytest.mark.parametrize("arch", ["qwen_dense", "qwen_moe", "qwen_next", "kimi"])
def test_fp8_logits_match_transformers_with_dequantized_weights(folders, arch, tmp_path):
    _, dst = folders(arch)
    # transformers' own loader (it fuses per-expert tensors as its modules hold them) on the dequantized weights
    reference = type(reference_model(arch, seed=11)).from_pretrained(_plain_folder(dst, tmp_path / "plain"),
                                                                     dtype=torch.float32).eval()
    tokens = prompt(2, 12, seed=3)
    model = hypic_jax.load(dst, "float32")
    assert rel_err(model.logits(tokens), reference_logits(reference, tokens), norm="max") < 1e-4
    # bfloat16 activations: within transformers' own bfloat16 error of the same weights
    low = hypic_jax.load(dst, "bfloat16")
    assert low.dtype == np.dtype("bfloat16")
    expected = reference_logits(reference, tokens)
    bound = 1.5 * rel_err(reference_logits(reference.to(torch.bfloat16), tokens), expected, norm="max") + 1e-2
    assert rel_err(low.logits(tokens), expected, norm="max") <= bound


@pytest.mark.parametrize("arch", ["qwen_moe", "qwen_next"])
def test_small_blocks_split_every_axis(folders, arch, tmp_path):
    """Blocks of 16 rows and columns: several scale rows per weight, and fused or regrouped output columns (gate |
    up of the experts, Qwen3-Next's grouped qkvz) whose blocks straddle the parts; orbax keeps the block size."""
    src, _ = folders(arch)
    small = tmp_path / "small"
    quantize_folder(src, small, block=16)
    assert json.loads((small / "config.json").read_text())["quantization_config"]["weight_block_size"] == [16, 16]
    model = hypic_jax.load(small, "float32")
    plain = hypic_jax.load(_plain_folder(small, tmp_path / "plain", 16), "float32")
    blocks = {leaf.block for _, leaf in _flat(model.params) if fp8.is_fp8(leaf)}
    assert blocks == {16}
    assert max(leaf.scale.shape[-2] for _, leaf in _flat(model.params) if fp8.is_fp8(leaf)) >= 4
    for (path, leaf), (_, want) in zip(_flat(model.params), _flat(plain.params)):
        got = fp8.dequantize(leaf, np.float32) if fp8.is_fp8(leaf) else leaf
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=jax.tree_util.keystr(path))
    orbax = tmp_path / "orbax"
    assert cli_main(["convert", str(small), str(orbax), "--dtype", "float32"]) == 0
    _assert_same_params(hypic_jax.load(orbax, "float32").params, model.params)


def test_quantize_on_load_equals_convert_then_load(folders):
    src, dst = folders("qwen_moe")
    on_load = hypic_jax.load(src, "float32", quantize="fp8")
    _assert_same_params(on_load.params, hypic_jax.load(dst, "float32").params)
    assert on_load.source.endswith(":fp8")
    # an FP8 folder stays FP8 whatever quantize says
    _assert_same_params(hypic_jax.load(dst, "float32", quantize="fp8").params, on_load.params)


def test_bf16_source_sharded_output_and_progress_bar(folders, tmp_path, monkeypatch, capsys):
    """A bfloat16 folder (the usual source) quantizes from its bfloat16 values, keeps the other tensors bfloat16
    bit for bit, and writes shards of at most max_shard_bytes with transformers' index."""
    src = copy_folder(folders("qwen_dense")[0], tmp_path / "bf16")
    rewrite_safetensors(src, lambda t: t.update({k: v.to(torch.bfloat16) for k, v in t.items()}), framework="pt")
    monkeypatch.setattr(converter_base, "PROGRESS_BYTES", 0)
    sharded = tmp_path / "sharded"
    quantize_folder(src, sharded, max_shard_bytes=40_000)
    assert "quantizing" in capsys.readouterr().err
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1 and all((sharded / f).stat().st_size <= 40_000 + 4096 for f in files)
    original, written = _tensors(src), _tensors(sharded)
    assert set(index["weight_map"]) == set(written)
    for name, t in written.items():
        if t.dtype == torch.float8_e4m3fn:
            w = original[name].float().numpy()
            assert rel_err(_dequantized_one(t, written[name + SCALE]), w) < 0.05
        elif not name.endswith(SCALE):
            assert t.dtype == torch.bfloat16 and torch.equal(t, original[name]), name
    single = tmp_path / "single"
    quantize_folder(src, single)
    assert not (single / "model.safetensors.index.json").exists()
    _assert_same_params(hypic_jax.load(sharded, "float32").params, hypic_jax.load(single, "float32").params)


KEPT, BA = "model.layers.1.self_attn.k_proj.weight", "model.layers.0.linear_attn.in_proj_ba.weight"


def _mixed_folder(fp8_folder: Path, dst: Path) -> Path:
    """A Qwen3-Next FP8 folder with one FP8 weight unquantized (KEPT) and in_proj_ba (BA) in FP8."""
    mixed = copy_folder(fp8_folder, dst)
    keep, ba = KEPT, BA

    def edit(tensors):
        tensors[keep] = torch.from_numpy(_dequantized_one(tensors[keep], tensors.pop(keep + SCALE)))
        w = tensors[ba].float().numpy()
        blocks = np.abs(np.pad(w, [(0, -w.shape[0] % B), (0, -w.shape[1] % B)])).reshape(1, B, 1, B).max((1, 3)) / 448
        tensors[ba] = torch.from_numpy(w / blocks[0, 0]).to(torch.float8_e4m3fn)
        tensors[ba + SCALE] = torch.from_numpy(blocks.astype(np.float32))

    rewrite_safetensors(mixed, edit, framework="pt")
    return mixed


def test_unquantized_fp8_weights_and_dequantized_sources(folders, tmp_path, caplog):
    """A folder that keeps one FP8-able projection unquantized loads it as a plain array; an FP8 tensor feeding a
    parameter that is not an FP8 weight (Qwen3-Next's in_proj_ba) loads dequantized, logged."""
    mixed = _mixed_folder(folders("qwen_next")[1], tmp_path / "mixed")
    keep, ba = KEPT, BA
    with caplog.at_level(logging.INFO, logger="hypic_jax.checkpoint.hf.base"):
        model = hypic_jax.load(mixed, "float32")
    assert "layers/0/mixer/in_proj_b" in caplog.text and "layers/0/mixer/in_proj_a" in caplog.text
    leaves = dict((jax.tree_util.keystr(p), x) for p, x in _flat(model.params))
    assert not fp8.is_fp8(leaves["['layers'][1]['mixer']['k_proj']"])
    assert fp8.is_fp8(leaves["['layers'][1]['mixer']['q_proj']"])
    expected = _dequantized(mixed)
    np.testing.assert_array_equal(leaves["['layers'][1]['mixer']['k_proj']"], expected[keep].T)
    b = expected[ba].reshape(2, 4, -1)[:, :2].reshape(4, -1).T  # [b (r) | a (r)] per key head, r = 2
    np.testing.assert_array_equal(leaves["['layers'][0]['mixer']['in_proj_b']"], b)


def test_transform_mixing_input_blocks_dequantizes(caplog, tmp_path):
    """A rule whose transform reshapes the input axis cannot carry the scales: the parameter is stored
    dequantized in the model dtype."""
    from hypic_jax.checkpoint.hf import fp8 as fp8_format

    w = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    value, blocks = fp8_format.quantize(w, B)
    save_file({"w": torch.from_numpy(value.astype(np.float32)).to(torch.float8_e4m3fn),
               "w" + SCALE: torch.from_numpy(blocks.copy())}, str(tmp_path / "model.safetensors"))
    reader = converter_base.CheckpointReader(tmp_path)
    abstract = {"layers": [{"q": jax.ShapeDtypeStruct((128, 128), np.float32),
                            "k": jax.ShapeDtypeStruct((256, 64), np.float32)}]}
    rules = [converter_base.Rule(("layers", 0, "q"), ("w",), ((64, 256),), lambda x: x.T.reshape(128, 128)),
             converter_base.Rule(("layers", 0, "k"), ("w",), ((64, 256),), converter_base.transpose)]
    with caplog.at_level(logging.INFO, logger="hypic_jax.checkpoint.hf.base"):
        params = converter_base.apply_rules(reader, rules, abstract, block=B, fp8_target=lambda path: True)
    q, k = params["layers"][0]["q"], params["layers"][0]["k"]
    assert not fp8.is_fp8(q) and q.dtype == np.float32 and fp8.is_fp8(k)
    deq = value.astype(np.float32) * np.kron(blocks, np.ones((B, B), np.float32))[:64, :256]
    np.testing.assert_array_equal(q, deq.T.reshape(128, 128))
    np.testing.assert_array_equal(fp8.dequantize(k, np.float32), deq.T)
    assert "layers/0/q" in caplog.text


# ----------------------------------------------------------------------------------------------------------------
# Orbax


def test_orbax_round_trip_of_fp8(folders, tmp_path):
    _, dst = folders("qwen_moe")
    orbax = tmp_path / "orbax"
    assert cli_main(["convert", str(dst), str(orbax), "--dtype", "float32"]) == 0
    assert read_metadata(orbax)["fp8"] == {"block": B, "plain": []}
    model, restored = hypic_jax.load(dst, "float32"), hypic_jax.load(orbax, "float32")
    _assert_same_params(restored.params, model.params)
    assert restored.source.endswith(":fp8")
    tokens = prompt(1, 8, seed=4)
    np.testing.assert_array_equal(restored.logits(tokens), model.logits(tokens))


def test_orbax_round_trip_keeps_unquantized_fp8_weights(folders, tmp_path):
    mixed = _mixed_folder(folders("qwen_next")[1], tmp_path / "mixed")
    orbax = tmp_path / "orbax"
    assert cli_main(["convert", str(mixed), str(orbax), "--dtype", "float32"]) == 0
    assert read_metadata(orbax)["fp8"] == {"block": B, "plain": ["layers/1/mixer/k_proj"]}
    _assert_same_params(hypic_jax.load(orbax, "float32").params, hypic_jax.load(mixed, "float32").params)


def test_orbax_quantize_on_load(folders, tmp_path):
    src, _ = folders("qwen_dense")
    orbax = tmp_path / "orbax"
    assert cli_main(["convert", str(src), str(orbax), "--dtype", "float32"]) == 0
    assert "fp8" not in read_metadata(orbax)
    plain = hypic_jax.load(orbax, "float32")
    quantized = hypic_jax.load(orbax, "float32", quantize="fp8")
    _assert_same_params(quantized.params, models.quantize_params(plain.arch, plain.params))
    assert quantized.source.endswith(":fp8") and not plain.source.endswith(":fp8")


# ----------------------------------------------------------------------------------------------------------------
# Errors




def _edit_config(folder: Path, edit) -> None:
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))


def _expect_error(folder: Path, *fragments: str, **load_args) -> str:
    with pytest.raises(ValueError) as info:
        hypic_jax.load(folder, "float32", **load_args)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    return message


@pytest.mark.parametrize("method", ["gptq", "awq", "compressed-tensors"])
def test_other_quantization_methods_are_refused(folders, tmp_path, capsys, method):
    broken = copy_folder(folders("qwen_dense")[0], tmp_path / "q")
    _edit_config(broken, lambda c: c.__setitem__("quantization_config", {"quant_method": method, "bits": 4}))
    _expect_error(broken, repr(method), "supported", "fp8")
    assert cli_main(["convert", str(broken), str(tmp_path / "out")]) == 2
    assert method in capsys.readouterr().err


def test_quantization_config_in_text_config_is_read(folders, tmp_path):
    broken = copy_folder(folders("qwen_dense")[1], tmp_path / "q")

    def move(config):
        config["text_config"] = {"quantization_config": dict(config.pop("quantization_config"), quant_method="awq")}

    _edit_config(broken, move)
    _expect_error(broken, "'awq'")


@pytest.mark.parametrize("field, value, fragment", [
    ("weight_block_size", [128, 64], "square"), ("fmt", "e5m2", "'e5m2'"), ("activation_scheme", "static", "static")])
def test_unsupported_fp8_settings(folders, tmp_path, field, value, fragment):
    broken = copy_folder(folders("qwen_dense")[1], tmp_path / "q")
    _edit_config(broken, lambda c: c["quantization_config"].__setitem__(field, value))
    _expect_error(broken, fragment)


def test_fp8_tensor_without_its_scale(folders, tmp_path):
    broken = copy_folder(folders("qwen_dense")[1], tmp_path / "q")
    name = "model.layers.1.self_attn.o_proj.weight"
    rewrite_safetensors(broken, lambda t: t.pop(name + SCALE), framework="pt")
    _expect_error(broken, "without its scale", repr(name), repr(name + SCALE))


def test_scale_without_its_weight(folders, tmp_path):
    broken = copy_folder(folders("qwen_dense")[1], tmp_path / "q")
    bf16, nothing = "model.layers.0.linear_attn.in_proj_a.weight", "model.layers.0.mlp.surprise.weight"

    def edit(t):
        t[bf16 + SCALE] = torch.ones((1, 1))
        t[nothing + SCALE] = torch.ones((1, 1))

    rewrite_safetensors(broken, edit, framework="pt")
    message = _expect_error(broken, "without its weight", repr(bf16 + SCALE), repr(nothing + SCALE), "not FP8")
    assert "unexpected tensor" not in message


def test_scale_of_the_wrong_shape(folders, tmp_path):
    broken = copy_folder(folders("qwen_dense")[1], tmp_path / "q")
    name = "model.layers.1.self_attn.q_proj.weight"  # [256, 64]: 2 x 1 blocks
    rewrite_safetensors(broken, lambda t: t.__setitem__(name + SCALE, torch.ones((1, 1))), framework="pt")
    _expect_error(broken, repr(name + SCALE), "(1, 1)", "(2, 1)", "(256, 64)")


def test_fp8_tensors_without_quantization_config(folders, tmp_path):
    broken = copy_folder(folders("qwen_dense")[1], tmp_path / "q")
    _edit_config(broken, lambda c: c.pop("quantization_config"))
    _expect_error(broken, "no block-wise FP8 quantization_config", "model.layers.0.mlp.up_proj.weight")


def test_bad_quantize_arguments(folders, tmp_path):
    src, dst = folders("qwen_dense")
    _expect_error(src, "unsupported quantize='int4'", quantize="int4")
    with pytest.raises(ValueError, match="already a block-wise FP8"):
        quantize_folder(dst, tmp_path / "again")


def test_the_server_and_the_engine_load_fp8_folders_and_quantize_on_load(folders, tmp_path):
    """`hypic-jax serve MODEL` on an FP8 folder and `--quantize fp8` on an unquantized one build an engine over FP8
    weights (`serve.app.build`, what the command runs, before its warmup); the two are one model to the cache."""
    from hypic_jax.cli import parser
    from hypic_jax.serve.app import build

    src, dst = (copy_folder(f, tmp_path / f.name) for f in folders("qwen_moe"))
    for folder in (src, dst):  # the fixture's tokenizer.json is a stand-in, not a tokenizer
        (folder / "tokenizer.json").unlink(missing_ok=True)
    limits = dict(max_prompt_tokens=64, token_rungs=(64,), cache_bytes=1 << 22, max_batch=1)
    args = parser().parse_args(["serve", str(src), "--quantize", "fp8", "--dtype", "float32"])
    servers = [build(str(dst), dtype="float32", **limits),
               build(args.model, dtype=args.dtype, quantize=args.quantize, **limits)]
    for server in servers:
        engine = server.engine
        leaves = jax.tree.leaves(engine.params, is_leaf=fp8.is_fp8)
        assert any(fp8.is_fp8(leaf) for leaf in leaves) and engine.model.source.endswith(":fp8")
    tokens = [[5, 6, 7, 8], [9, 10, 11]]
    first, second = (server.engine.prefill(tokens, mode="full_recompute").logits for server in servers)
    assert rel_err(first, second) < 1e-6
    for server in servers:
        server.engine.close()
