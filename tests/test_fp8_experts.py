"""Block-wise FP8 routed experts (`kernels.fp8.BlockFP8`) through the MoE path.

The grouped matmul reading FP8 values and scales (`gmm(scales=)`, interpreted on the CPU) against a float64
product of the dequantized weights and against `gmm_reference`, in every mode (plain, gathered rows, SwiGLU,
chunked weights), with K and N off the 128 grid and K spanning two scale blocks; it still lowers to Triton. The
routed experts (`grouped_swiglu_experts`) with FP8 weights, as arrays, banks and chunked banks, through the
kernel and through ragged_dot, equal the experts dequantized; and a tiny MoE model quantized by
`models.quantize_params` gives the logits of the model holding the dequantized weights, unrolled and with its
layers scanned over expert banks stored whole and in chunks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hypic_jax import models
from hypic_jax.kernels import fp8
from hypic_jax.kernels.grouped_matmul import ChunkedWeights, GMMConfig, block_layout, gmm, gmm_reference
from hypic_jax.kernels.grouped_matmul.matmul import _scale_tile
from hypic_jax.models import base, layers, stack as layer_stack
from hypic_jax.models.stack import ExpertBank, ExpertChunks, LayerStack
from helpers import LONG, primitives_outside_kernels, rel_err

SIZES = np.array([5, 0, 17, 3], np.int32)  # an empty group, partial and exact blocks


def _dequantized64(value, scale, block):
    """The FP8 weights in float64, computed in numpy (independent of `fp8.dequantize` and the reference)."""
    value, scale = np.asarray(value.astype(jnp.float32), np.float64), np.asarray(scale, np.float64)
    return value * np.repeat(scale, block, axis=-2)[..., :value.shape[-2], :]


def _expected(x, sizes, w64, swiglu):
    """Each group's rows times its expert's float64 weights (and the SwiGLU of the halves)."""
    out = np.concatenate([np.asarray(x, np.float64)[a:b] @ w64[e] for e, (a, b)
                          in enumerate(zip(np.cumsum(sizes) - sizes, np.cumsum(sizes)))])
    if swiglu:
        gate, up = np.split(out, 2, axis=-1)
        out = gate / (1 + np.exp(-gate)) * up
    return out


@pytest.mark.parametrize("k_dim, n_dim, block, mode", [
    (64, 96, 128, "plain"),  # K and N off the 128 grid, K inside one scale block
    (256, 64, 128, "plain"),  # K over two scale blocks
    (192, 48, 128, "gather"),  # a partial last scale block
    (256, 96, 128, "swiglu"),  # gate and up tiles with their own scale rows
    (96, 64, 32, "chunked"),  # three scale blocks of 32 rows, chunked weights and scales
])
def test_gmm_reads_fp8_weights(k_dim, n_dim, block, mode):
    rng = np.random.default_rng(k_dim + n_dim)
    experts, rows = len(SIZES), int(SIZES.sum())
    x = jnp.asarray(rng.normal(size=(rows, k_dim)), jnp.float32)
    # column and row blocks of different magnitudes, so a scale read from the wrong block shows
    magnitude = 10.0 ** rng.uniform(-2, 1, size=(experts, -(-k_dim // 32), n_dim))
    dense = rng.normal(size=(experts, k_dim, n_dim)) * np.repeat(magnitude, 32, axis=1)[:, :k_dim]
    w = fp8.quantize(jnp.asarray(dense, jnp.float32), block)
    assert w.scale.shape == (experts, -(-k_dim // block), n_dim)
    layout = block_layout(jnp.asarray(SIZES), rows, block_m=16)
    padded = jnp.zeros((layout.num_padded, k_dim), jnp.float32).at[layout.positions].set(x)
    source = jnp.zeros((layout.num_padded,), jnp.int32).at[layout.positions].set(jnp.arange(rows, dtype=jnp.int32))
    config = GMMConfig(block_m=16, block_n=32, block_k=256)  # block_k wider than a scale block: narrowed
    swiglu = mode == "swiglu"
    kw = dict(swiglu=swiglu, scale_block=block)
    if mode in ("gather", "swiglu"):
        a, kw["rows"] = x, source
    else:
        a = padded
    values, scales = w.value, w.scale
    if mode == "chunked":  # the experts in two chunks: the index reads the second, holding experts 2..3 as 0..1
        other = fp8.quantize(jnp.asarray(rng.normal(size=(2, k_dim, n_dim)), jnp.float32), block)
        values = ChunkedWeights((other.value, w.value[2:]), jnp.int32(1))
        scales = ChunkedWeights((other.scale, w.scale[2:]), jnp.int32(1))
        sizes = np.array([SIZES[2], SIZES[3]], np.int32)
        w64 = _dequantized64(w.value[2:], w.scale[2:], block)
        x_used = x[SIZES[0]:SIZES[0] + int(sizes.sum())]
        layout = block_layout(jnp.asarray(sizes), x_used.shape[0], block_m=16)
        a = jnp.zeros((layout.num_padded, k_dim), jnp.float32).at[layout.positions].set(x_used)
    else:
        sizes, w64, x_used = SIZES, _dequantized64(w.value, w.scale, block), x
    got = gmm(a, layout.block_expert, values, config=config, scales=scales, **kw)[layout.positions]
    want = _expected(x_used, sizes, w64, swiglu)
    assert rel_err(got, want) < 1e-5, mode
    ref = gmm_reference(a, layout.block_expert, values, scales=scales, **kw)[layout.positions]
    assert rel_err(ref, want) < 1e-6, mode
    # without the scales the same values give another product: the scales are applied, not ignored
    plain = gmm(a, layout.block_expert, values, config=config, **{k: v for k, v in kw.items() if k != "scale_block"})
    assert rel_err(plain[layout.positions], want) > 1e-2


def test_gmm_fp8_tiles_and_errors():
    """K tiles lie inside one scale block; scales that do not fit the weights, or a scale block no power-of-two
    tile divides, are refused."""
    assert _scale_tile(256, 512, 128) == 128 and _scale_tile(64, 512, 128) == 64
    assert _scale_tile(256, 96, 128) == 32  # K within one block: the plain tile
    assert _scale_tile(64, 192, 96) == 32  # divides both K and the block
    x = jnp.ones((32, 48), jnp.float32)
    experts = jnp.zeros((2,), jnp.int32)
    w = fp8.quantize(jnp.ones((2, 48, 32), jnp.float32), 16)
    with pytest.raises(ValueError, match="scales"):
        gmm(x, experts, w.value, scales=w.scale[:, :2], scale_block=16)
    with pytest.raises(ValueError, match="scales"):
        gmm(x, experts, w.value, scales=w.scale, scale_block=128)
    with pytest.raises(ValueError, match="scale block"):
        gmm(x, experts, w.value, scales=w.scale[:, :2], scale_block=24)
    with pytest.raises(ValueError, match="chunked"):
        gmm(x, experts, ChunkedWeights((w.value,), jnp.int32(0)), scales=w.scale, scale_block=16)


def test_gmm_fp8_lowers_to_triton():
    """Lowering (not compiling) for CUDA on a CPU-only machine, at the Qwen3.5-35B-A3B expert shapes with FP8
    weights: plain, gathered SwiGLU over chunked weights."""
    sd = jax.ShapeDtypeStruct
    check = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    f8 = fp8.FP8_DTYPE

    def lowered(fn, *args):
        return "xla.gpu.triton" in jax.export.export(jax.jit(fn), platforms=["cuda"],
                                                     disabled_checks=check)(*args).mlir_module()

    assert lowered(lambda x, e, w, s: gmm(x, e, w, scales=s, interpret=False),
                   sd((64 * 40, 512), jnp.bfloat16), sd((40,), jnp.int32), sd((256, 512, 2048), f8),
                   sd((256, 4, 2048), jnp.float32))
    assert lowered(lambda x, e, w0, w1, s0, s1, i, r: gmm(x, e, ChunkedWeights((w0, w1), i), interpret=False,
                                                          scales=ChunkedWeights((s0, s1), i), rows=r, swiglu=True),
                   sd((576, 2048), jnp.bfloat16), sd((400,), jnp.int32), sd((256, 2048, 1024), f8),
                   sd((128, 2048, 1024), f8), sd((256, 16, 1024), jnp.float32), sd((128, 16, 1024), jnp.float32),
                   sd((), jnp.int32), sd((400 * 32,), jnp.int32))


def _moe_case(rng, tokens=23, hidden=160, experts=6, inner=48, top_k=2, repeats=None):
    lead = () if repeats is None else (repeats,)
    x = jnp.asarray(rng.normal(size=(tokens, hidden)), jnp.float32)
    weights = jnp.asarray(rng.uniform(size=(tokens, top_k)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]), jnp.int32)
    gate_up = fp8.quantize(jnp.asarray(0.1 * rng.normal(size=lead + (experts, hidden, 2 * inner)), jnp.float32))
    down = fp8.quantize(jnp.asarray(0.1 * rng.normal(size=lead + (experts, inner, hidden)), jnp.float32))
    return x, weights, ids, gate_up, down


def _dequantized(w):
    return fp8.dequantize(w, jnp.float32)


def test_fp8_experts_equal_the_dequantized_experts():
    """FP8 experts (hidden 160: two scale blocks of gate_up's K) through the kernel and ragged_dot, with and
    without a padding mask, under a map over rows, and in bfloat16, equal the float32 experts dequantized."""
    rng = np.random.default_rng(0)
    x, weights, ids, gate_up, down = _moe_case(rng)
    want = layers.grouped_swiglu_experts(x, weights, ids, _dequantized(gate_up), _dequantized(down), impl="ragged")
    valid = jnp.asarray(rng.uniform(size=x.shape[0]) < 0.7)
    for impl in ("pallas", "ragged"):
        got = layers.grouped_swiglu_experts(x, weights, ids, gate_up, down, impl=impl)
        assert rel_err(got, want, norm="max") < 1e-5, impl
        masked = layers.grouped_swiglu_experts(x, weights, ids, gate_up, down, impl=impl, valid=valid)
        np.testing.assert_allclose(np.asarray(masked), np.where(valid[:, None], want, 0.0), rtol=1e-5, atol=1e-5)
        # rows mapped with the experts shared: the row rule flattens them into one list of tokens
        mapped = jax.vmap(lambda a, w, e: layers.grouped_swiglu_experts(a, w, e, gate_up, down, impl=impl))
        rows = mapped(x[:22].reshape(2, 11, -1), weights[:22].reshape(2, 11, -1), ids[:22].reshape(2, 11, -1))
        assert rel_err(rows.reshape(22, -1), want[:22], norm="max") < 1e-5, impl
    # the FP8 weights in a bfloat16 model: both paths near the float32 product
    xb = x.astype(jnp.bfloat16)
    for impl in ("pallas", "ragged"):
        got = layers.grouped_swiglu_experts(xb, weights, ids, gate_up, down, impl=impl)
        assert got.dtype == jnp.bfloat16 and rel_err(got, want) < 2e-2, impl


def test_fp8_expert_banks_and_chunks():
    """A scanned layer's FP8 experts as banks (values and scales each an `ExpertBank`), whole and in chunks with
    a traced layer index (the kernel chooses the chunk of values and scales), equal the layer's dequantized
    experts."""
    rng = np.random.default_rng(1)
    repeats = 3
    x, weights, ids, gate_up, down = _moe_case(rng, tokens=13, repeats=repeats)
    chunked = [fp8.BlockFP8(ExpertChunks([w.value[:2], w.value[2:]], 2), ExpertChunks([w.scale[:2], w.scale[2:]], 2),
                            w.block, w.dtype) for w in (gate_up, down)]

    def bank(w, layer):
        return fp8.BlockFP8(ExpertBank(w.value, layer), ExpertBank(w.scale, layer), w.block, w.dtype)

    @functools.partial(jax.jit, static_argnames="impl")
    def traced(layer, banks, impl):
        return layers.grouped_swiglu_experts(x, weights, ids, *(bank(b, layer) for b in banks), impl=impl)

    # the kernel chooses the chunk of values and scales itself: no conditional outside the kernel
    closed = jax.make_jaxpr(functools.partial(traced.__wrapped__, impl="pallas"))(jnp.int32(1), chunked)
    outside = primitives_outside_kernels(closed.jaxpr)
    assert "pallas_call" in outside and "cond" not in outside
    wants = []
    for layer in (0, 2):
        want = layers.grouped_swiglu_experts(x, weights, ids, _dequantized(gate_up)[layer],
                                             _dequantized(down)[layer], impl="ragged")
        wants.append(want)
        for impl in ("pallas", "ragged"):
            for name, banks in (("whole", (gate_up, down)), ("chunked", chunked)):
                got = traced(jnp.int32(layer), banks, impl)
                assert rel_err(got, want, norm="max") < 1e-5, (name, layer, impl)
    for impl in ("pallas", "ragged"):  # a static index: the chunk holding the layer, picked before the call
        got = layers.grouped_swiglu_experts(x, weights, ids, *(bank(b, 2) for b in chunked), impl=impl)
        assert rel_err(got, wants[1], norm="max") < 1e-5, ("chunked, static", impl)
    # each row its own layer's FP8 experts (mapped weights: the plain map, not the row flattening)
    pick = jnp.asarray([0, 2])
    per_row = jax.vmap(lambda g, d: layers.grouped_swiglu_experts(x, weights, ids, g, d, impl="pallas"))
    got = per_row(jax.tree.map(lambda a: a[pick], gate_up), jax.tree.map(lambda a: a[pick], down))
    assert rel_err(got, jnp.stack(wants), norm="max") < 1e-5



def _dequantized_params(params):
    return jax.tree.map(lambda w: fp8.dequantize(w, jnp.float32) if fp8.is_fp8(w) else w, params, is_leaf=fp8.is_fp8)


_PALLAS = base.KernelOptions(moe="pallas")
_RAGGED = base.KernelOptions(moe="ragged")


@pytest.mark.parametrize("block", [128, 32])  # 32: gate_up's K (hidden 64) spans two scale blocks
def test_quantized_moe_model_equals_its_dequantized_weights(tiny_checkpoints, block):
    """A tiny Qwen3.5-MoE quantized by `models.quantize_params` (projections and experts FP8) gives, through the
    kernel and ragged_dot, the logits of the model that holds the dequantized weights."""
    model, vocab, _ = tiny_checkpoints("qwen_moe")
    q = models.quantize_params(model.arch, model.params, block)
    assert fp8.is_fp8(q["layers"][0]["mlp"]["gate_up"]) and fp8.is_fp8(q["layers"][0]["mlp"]["down"])
    tokens = jnp.asarray(np.random.default_rng(2).integers(3, vocab, (2, 9)), jnp.int32)
    want = model.replace(params=_dequantized_params(q)).logits(tokens, _RAGGED)
    assert rel_err(want, model.logits(tokens, _RAGGED), norm="max") > 1e-4  # FP8 rounding is there to see
    for kernels in (_RAGGED, _PALLAS):
        got = model.replace(params=q).logits(tokens, kernels)
        assert rel_err(got, want, norm="max") < 1e-5, kernels.moe


@LONG
@pytest.mark.parametrize("chunked", [False, True])
def test_scanned_fp8_model(tmp_path_factory, monkeypatch, chunked):
    """Six layers (2 x [GDN, GDN, attention]) quantized and stacked: the scan reads the FP8 expert banks (whole,
    or one repeat per chunk) and gives the unrolled dequantized model's logits, through the kernel and
    ragged_dot."""
    model, vocab = _deep_model(str(tmp_path_factory.getbasetemp() / "fp8_deep"))
    q = models.quantize_params(model.arch, model.params)
    if chunked:  # one repeat per chunk
        limit = max(w.value.size for w in jax.tree.leaves(q["layers"], is_leaf=fp8.is_fp8)
                    if fp8.is_fp8(w) and w.ndim == 3)
        monkeypatch.setattr(layer_stack, "BANK_MAX_ELEMENTS", limit)
        monkeypatch.setattr(layers, "BANK_MAX_ELEMENTS", limit)
    stacked = LayerStack.build(q["layers"])
    assert stacked.plan.scanned and stacked.plan.period == 3 and stacked.plan.repeats == 2
    mlp = stacked.parts[stacked.plan.head]["mlp"]
    for name in ("gate_up", "down"):
        w = mlp[name]
        assert fp8.is_fp8(w) and w.value.shape[0] == 2 and w.scale.shape[0] == 2
        assert isinstance(w.value, ExpertChunks) == chunked and isinstance(w.scale, ExpertChunks) == chunked
    assert not isinstance(mlp["shared_gate_proj"].value, ExpertChunks)  # a dense FP8 weight is sliced per step
    layer = stacked[stacked.plan.layer(stacked.plan.head, 1)]["mlp"]["gate_up"]
    assert isinstance(layer.value, ExpertBank) and isinstance(layer.scale, ExpertBank)
    tokens = jnp.asarray(np.random.default_rng(3).integers(3, vocab, (1, 11)), jnp.int32)
    want = model.replace(params=_dequantized_params(q)).logits(tokens, _RAGGED)
    scanned = model.replace(params=dict(q, layers=stacked))
    for kernels in (_RAGGED, _PALLAS):
        got = scanned.logits(tokens, kernels)
        assert rel_err(got, want, norm="max") < 1e-5, kernels.moe


@functools.lru_cache(maxsize=None)
def _deep_model(folder: str):
    import hypic_jax
    from helpers import VOCAB, reference_model, save_checkpoint

    pytest.importorskip("torch")
    types = ["linear_attention", "linear_attention", "full_attention"] * 2
    folder = save_checkpoint(reference_model("qwen_moe", num_hidden_layers=6, layer_types=types), folder)
    return hypic_jax.load(folder, dtype="float32"), VOCAB
