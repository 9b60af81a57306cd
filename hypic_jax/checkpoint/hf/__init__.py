"""Hugging Face checkpoint -> hypic-jax parameter converters: one module per architecture, named like its
architecture module in `hypic_jax.models` (see there for the contract and the registry), on the helpers of
`hypic_jax.checkpoint.hf.base`.

`convert_folder` converts a whole Hugging Face folder through the registered architecture's converter (block-wise
FP8 folders included, `hypic_jax.checkpoint.hf.fp8`); `quantize_folder` writes a copy of a folder in that FP8
format (`hypic-jax convert --quantize fp8`).
"""

from __future__ import annotations

import importlib
import json
import logging
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

from hypic_jax import models
from hypic_jax.checkpoint.hf import fp8 as fp8_format
from hypic_jax.checkpoint.hf import base
from hypic_jax.checkpoint.hf.base import (MAX_SHARD_BYTES, CheckpointReader, Conversion, Tensor, build, read_hf_config,
                                          validate, write_safetensors)
from hypic_jax.kernels.fp8 import BLOCK

__all__ = ["converter", "conversion", "convert_folder", "quantize_folder"]

log = logging.getLogger(__name__)

# files of a folder that are weights (never copied by `quantize_folder`: it writes the weights itself)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5", ".gguf", ".ckpt")


def converter(model_type: str) -> ModuleType:
    """The converter module of a registered HF model_type: `hypic_jax.checkpoint.hf.<name>` for
    `hypic_jax.models.<name>`."""
    name = models.architecture(model_type).__name__.rsplit(".", 1)[1]
    return importlib.import_module(f"{__name__}.{name}")


def conversion(folder: str | Path) -> tuple[str, dict, CheckpointReader, Conversion, int | None]:
    """(model_type, config.json dict, reader, the converter's `Conversion`, FP8 block size or None) of a folder,
    from its config and safetensors headers alone. Raises ValueError for a quantization other than block-wise FP8
    before anything else."""
    hf_config = read_hf_config(folder)
    block = fp8_format.block_size(hf_config)
    model_type = models.resolve_model_type(hf_config)
    reader = CheckpointReader(folder)
    return model_type, hf_config, reader, converter(model_type).conversion(reader, hf_config), block


def convert_folder(folder: str | Path, dtype: Any = "bfloat16", *, quantize: str | None = None) -> tuple[str, Any, Any]:
    """HF folder -> (model_type, config, params) through the registered converter. A block-wise FP8 folder gives
    `kernels.fp8.BlockFP8` weights (whatever `quantize` says); quantize="fp8" quantizes an unquantized folder's
    FP8 weights as they load, as `quantize_folder` would write them."""
    model_type, _, reader, plan, block = conversion(folder)
    return model_type, plan.config, build(plan, reader, dtype, block=block, quantize=quantize)


def quantize_folder(src: str | Path, dst: str | Path, *, block: int = BLOCK,
                    max_shard_bytes: int = MAX_SHARD_BYTES) -> str:
    """Write `dst` as the Hugging Face folder `src` in the block-wise FP8 format (`hypic_jax.checkpoint.hf.fp8`):
    exactly the tensors that feed the architecture's FP8 weights (`Conversion.fp8_sources`) quantized per B x B
    block of their [out, in] orientation, every other tensor (those the converter skips included) as it is, the
    config with a `quantization_config` whose `modules_to_not_convert` names the linear layers left unquantized,
    and the other files of `src` (tokenizer, generation config, ...) copied. Returns the model_type."""
    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        raise ValueError(f"quantize_folder: the destination {dst} is the source folder")
    model_type, hf_config, reader, plan, src_block = conversion(src)
    if src_block is not None:
        raise ValueError(f"{src} is already a block-wise FP8 checkpoint")
    if not getattr(plan.arch, "FP8_LEAVES", ()):
        raise ValueError(f"architecture {plan.arch.__name__} has no FP8 weights (FP8_LEAVES)")
    validate(reader, plan.rules, plan.ignore)  # a folder the converter cannot read is not worth writing
    quantized = plan.fp8_sources(reader)
    embeddings = {n for rule in plan.rules if rule.target[:1] == ("embed",) for n in rule.sources}
    not_converted = [n[: -len(".weight")] for n in reader.names()
                     if n not in quantized and n.endswith(".weight") and len(reader.shape(n)) == 2
                     and n not in embeddings and "embed" not in n.rsplit(".", 2)[-2]]
    pending: dict[str, Any] = {}

    def quantized_value(name):
        value, pending[name] = fp8_format.quantize(reader.get(name), block)
        return value

    tensors = []
    for name in reader.names():
        shape = tuple(reader.shape(name))
        if name in quantized:
            tensors.append(Tensor(name, shape, fp8_format.FP8_SAFETENSORS_DTYPE, lambda n=name: quantized_value(n)))
            tensors.append(Tensor(fp8_format.scale_name(name), fp8_format.scale_shape(shape, block), "F32",
                                  lambda n=name: pending.pop(n)))
        else:
            tensors.append(Tensor(name, shape, reader.dtype(name), lambda n=name: reader.get(n)))
    dst.mkdir(parents=True, exist_ok=True)
    for stale in [*dst.glob("*.safetensors"), dst / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    total = sum(reader.nbytes(n) for n in reader.names())
    bar = None
    if total >= base.PROGRESS_BYTES:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"quantizing {src.name}")
    sizes = {n: reader.nbytes(n) for n in reader.names()}
    try:
        write_safetensors(dst, tensors, max_shard_bytes,
                          on_written=lambda t: bar is not None and bar.update(sizes.get(t.name, 0)))
    finally:
        if bar is not None:
            bar.close()
    config = dict(hf_config, quantization_config=fp8_format.config_entry(block, not_converted))
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for path in src.iterdir():
        if (path.is_file() and path.name not in ("config.json", "model.safetensors.index.json")
                and not path.name.endswith(WEIGHT_SUFFIXES)):
            shutil.copy2(path, dst / path.name)
    log.info("quantized %d of %d tensors of %s to block-wise FP8 in %s", len(quantized), len(sizes), src, dst)
    return model_type
