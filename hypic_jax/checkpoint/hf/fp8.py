"""Hugging Face's block-wise FP8 checkpoint format (DeepSeek-V3 style, transformers' `FineGrainedFP8`), in NumPy.

A quantized `nn.Linear` weight `X.weight` [..., out, in] is float8_e4m3fn, and `X.weight_scale_inv` [..., ceil(out/B),
ceil(in/B)] (float32, sometimes bf16) holds one scale per B x B block: W = weight * scale_inv per block. config.json
(or its `text_config`) says so in `quantization_config`:

    {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
     "modules_to_not_convert": [...]}

`hypic_jax.kernels.fp8.BlockFP8` keeps the scales expanded along the output axis (one per block of input rows and
column), which is what `expand_out` gives in the checkpoint's [out, in] orientation.
"""

from __future__ import annotations

import numpy as np

from hypic_jax.kernels import fp8

SCALE_SUFFIX = "_scale_inv"
FP8_SAFETENSORS_DTYPE = "F8_E4M3"
SUPPORTED = "block-wise FP8 (quant_method 'fp8', fmt 'e4m3', dynamic activations, square weight_block_size)"


def scale_name(weight: str) -> str:
    """The scale companion of a weight tensor (`X.weight` -> `X.weight_scale_inv`, fused experts' `X.gate_up_proj`
    -> `X.gate_up_proj_scale_inv`)."""
    return weight + SCALE_SUFFIX


def quantization_config(hf_config: dict) -> dict | None:
    """config.json's quantization_config, at the top level or in the multimodal wrapper's text_config."""
    found = hf_config.get("quantization_config")
    if found is None and isinstance(hf_config.get("text_config"), dict):
        found = hf_config["text_config"].get("quantization_config")
    return found


def block_size(hf_config: dict) -> int | None:
    """The block size B of a block-wise FP8 checkpoint's config, None for an unquantized one. Raises ValueError for
    any other quantization (GPTQ, AWQ, compressed-tensors, per-tensor FP8, ...): those weights are not plain
    tensors the converters could read."""
    qc = quantization_config(hf_config)
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method != "fp8":
        raise ValueError(f"unsupported quantization method {method!r} in quantization_config; supported: {SUPPORTED}")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"unsupported FP8 format {fmt!r} (quantization_config.fmt); supported: {SUPPORTED}")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"unsupported FP8 activation_scheme {scheme!r} (static activation scales); "
                         f"supported: {SUPPORTED}")
    blocks = qc.get("weight_block_size")
    if blocks is None:
        raise ValueError(f"FP8 quantization_config without weight_block_size (per-tensor FP8); supported: {SUPPORTED}")
    if len(blocks) != 2 or blocks[0] != blocks[1] or int(blocks[0]) < 1:
        raise ValueError(f"unsupported FP8 weight_block_size {list(blocks)}: only square blocks are supported "
                         f"(e.g. [128, 128])")
    return int(blocks[0])


def config_entry(block: int, not_converted: list[str]) -> dict:
    """The quantization_config a block-wise FP8 folder written here carries."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [block, block],
            "modules_to_not_convert": list(not_converted)}


def scale_shape(shape: tuple[int, ...], block: int) -> tuple[int, ...]:
    """Block-scale shape of a weight [..., out, in]."""
    *lead, out, inner = shape
    return (*lead, -(-out // block), -(-inner // block))


def expand_out(blocks: np.ndarray, block: int, out: int) -> np.ndarray:
    """Block scales [..., ceil(out/B), ceil(in/B)] -> float32 [..., out, ceil(in/B)]: each output row's scales, so
    that a converter's transform rearranges them with the rows (`BlockFP8.scale` once transposed)."""
    return np.repeat(np.asarray(blocks, np.float32), block, axis=-2)[..., :out, :]


def expand_full(blocks: np.ndarray, block: int, shape: tuple[int, ...]) -> np.ndarray:
    """Block scales -> float32 of the weight's full shape [..., out, in]."""
    rows = expand_out(blocks, block, shape[-2])
    return np.repeat(rows, block, axis=-1)[..., : shape[-1]]


def dequantize(value: np.ndarray, blocks: np.ndarray, block: int) -> np.ndarray:
    """A checkpoint weight [..., out, in] in float32: value * its block's scale."""
    return np.asarray(value, np.float32) * expand_full(blocks, block, value.shape)


def quantize(w: np.ndarray, block: int = fp8.BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """A weight [..., out, in] in the checkpoint format: (float8_e4m3fn values, float32 block scales), the scales
    those of `kernels.fp8.block_scales` (block amax / FP8_MAX, 1 for an all-zero block)."""
    w = np.asarray(w, np.float32)
    blocks = np.asarray(fp8.block_scales(w, block), np.float32)
    value = np.clip(w / expand_full(blocks, block, w.shape), -fp8.FP8_MAX, fp8.FP8_MAX)
    return value.astype(fp8.FP8_DTYPE), blocks
