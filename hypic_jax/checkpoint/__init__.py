"""Checkpoints: `load` a model from an orbax checkpoint or a Hugging Face folder, and the orbax format itself.

An orbax checkpoint written by `hypic-jax convert` (`save_checkpoint`) is a folder holding the parameters under
`params/` and `hypic_model.json` (`METADATA_FILE`): the HF model_type, the parameter dtype, the architecture's
config as JSON and, for a model with block-wise FP8 weights (`kernels.fp8.BlockFP8`), their block size and the
FP8-able parameters kept unquantized (`fp8_metadata`). `load` restores one straight into the architecture's
parameter structure (and sharding, with a mesh), or converts a Hugging Face folder on the fly through
`hypic_jax.checkpoint.hf.convert_folder`.

This package sits above `hypic_jax.models` (it imports the models; they never import it).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

import hypic_jax.checkpoint.hf
from hypic_jax import models
from hypic_jax.kernels import fp8
from hypic_jax.models.base import Model, named_shardings, resolve_dtype, shard_params

__all__ = ["load", "random_model", "save_checkpoint", "restore_params", "METADATA_FILE", "write_metadata",
           "read_metadata", "fp8_metadata", "config_to_dict", "config_from_dict"]

METADATA_FILE = "hypic_model.json"


def config_to_dict(config: Any) -> dict:
    return dataclasses.asdict(config)


def config_from_dict(config_cls: type, data: dict) -> Any:
    """Rebuild a frozen config dataclass, turning JSON lists back into tuples."""
    fields = {f.name for f in dataclasses.fields(config_cls)}
    clean = {k: (tuple(v) if isinstance(v, list) else v) for k, v in data.items() if k in fields}
    return config_cls(**clean)


def write_metadata(path: str | Path, *, model_type: str, config: Any, dtype: Any,
                   max_context: int | None = None, fp8: dict | None = None) -> None:
    meta = dict(format=1, model_type=model_type, dtype=str(jnp.dtype(dtype)), config=config_to_dict(config))
    if max_context is not None:
        meta["max_context"] = int(max_context)
    if fp8 is not None:
        meta["fp8"] = fp8
    (Path(path) / METADATA_FILE).write_text(json.dumps(meta, indent=1))


def read_metadata(path: str | Path) -> dict:
    return json.loads((Path(path) / METADATA_FILE).read_text())


def _path_text(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def fp8_metadata(arch: Any, params: Any) -> dict | None:
    """What restoring a model with `BlockFP8` weights needs beyond its config: the block size and the parameters
    `FP8_LEAVES` names that are plain arrays (read from tensors a converter could not keep in FP8); None for a
    model without FP8 weights."""
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=fp8.is_fp8)[0]
    blocks = {leaf.block for _, leaf in flat if fp8.is_fp8(leaf)}
    if not blocks:
        return None
    if len(blocks) > 1:
        raise ValueError(f"FP8 weights of several block sizes {sorted(blocks)}")
    plain = [_path_text(path) for path, leaf in flat if models.fp8_leaf(arch, path) and not fp8.is_fp8(leaf)]
    return dict(block=blocks.pop(), plain=plain)


def save_checkpoint(dst: str | Path, *, model_type: str, config: Any, params: Any, dtype: Any,
                    max_context: int | None = None) -> None:
    """Write params with orbax under dst/params and the config metadata next to them (FP8 weights as their values
    and scales, `fp8_metadata`)."""
    import orbax.checkpoint as ocp  # imported on use: slow to import, and only checkpoint I/O needs it

    dst = Path(dst).absolute()
    dst.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(dst / "params", params, force=True)
    write_metadata(dst, model_type=model_type, config=config, dtype=dtype, max_context=max_context,
                   fp8=fp8_metadata(models.architecture(model_type), params))


def restore_params(src: str | Path, abstract: Any) -> Any:
    """Restore params saved by `save_checkpoint` into the structure/dtypes of `abstract` (ShapeDtypeStructs,
    optionally with shardings)."""
    import orbax.checkpoint as ocp  # imported on use, as in save_checkpoint

    src = Path(src).absolute()
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(src / "params", abstract)


def _checkpoint_abstract(arch: Any, config: Any, dtype: Any, meta: dict) -> Any:
    """The parameter structure an orbax checkpoint was saved with: FP8 weights where its metadata says so."""
    if "fp8" not in meta:
        return models.abstract_params(arch, config, dtype)
    plain = set(meta["fp8"].get("plain", ()))
    abstract = models.abstract_params(arch, config, dtype, fp8=True, block=int(meta["fp8"]["block"]))
    if not plain:
        return abstract
    unquantized = models.abstract_params(arch, config, dtype)
    leaves = {_path_text(p): a for p, a in jax.tree_util.tree_flatten_with_path(unquantized)[0]}
    return jax.tree_util.tree_map_with_path(
        lambda p, a: leaves[_path_text(p)] if _path_text(p) in plain else a, abstract, is_leaf=fp8.is_fp8)


def _with_shardings(abstract: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs placed by a NamedSharding tree (one sharding for an FP8 weight's value and scale)."""
    def place(a, s):
        if fp8.is_fp8(a):
            return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), a)
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
    return jax.tree.map(place, abstract, shardings, is_leaf=fp8.is_fp8)


def _checkpoint_config(path: Path) -> tuple[Any, Any]:
    """(architecture module, config) of an orbax checkpoint's metadata."""
    meta = read_metadata(path)
    arch = models.architecture(meta["model_type"])
    return arch, config_from_dict(arch.Config, meta["config"])


def max_context(path: str | Path) -> int | None:
    """The longest sequence a model folder was made for: `max_position_embeddings` of its config.json (of the text
    config, for a multimodal wrapper), or of the Hugging Face config an orbax checkpoint recorded; None when it
    states none."""
    path = Path(path)
    for name, key in (("config.json", "max_position_embeddings"), (METADATA_FILE, "max_context")):
        if (path / name).exists():
            data = json.loads((path / name).read_text())
            data = data.get("text_config") or data
            value = data.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def load(path: str | Path, dtype: Any = "bfloat16", *, mesh: jax.sharding.Mesh | None = None,
         quantize: str | None = None) -> Model:
    """Load a model from an orbax checkpoint written by `hypic-jax convert`, or directly from a Hugging Face folder.

    With `mesh` (axes "data" and "model") the parameters are placed with the architecture's `param_specs` (an orbax
    checkpoint is restored straight into that sharding). A block-wise FP8 checkpoint (a Hugging Face "-FP8"
    folder, or an orbax checkpoint of one) loads with its FP8 weights as `kernels.fp8.BlockFP8` whatever
    `quantize` says; quantize="fp8" quantizes an unquantized one's FP8 weights (`FP8_LEAVES`) as it loads. Returns
    a `Model` with `logits(tokens)` and `generate(tokens, max_new_tokens)`, its context length (`max_context`) and
    its `source` (the folder, dtype and ":fp8" for FP8 weights, part of every cache key's model fingerprint).
    """
    if quantize not in (None, "fp8"):
        raise ValueError(f"unsupported quantize={quantize!r}; supported: None, 'fp8'")
    path = Path(path)
    dtype = resolve_dtype(dtype)
    if (path / METADATA_FILE).exists():
        arch, config = _checkpoint_config(path)
        meta = read_metadata(path)
        abstract = _checkpoint_abstract(arch, config, dtype, meta)
        if mesh is not None:
            abstract = _with_shardings(abstract, named_shardings(arch.param_specs(config), mesh))
        params = restore_params(path, abstract)
        if quantize == "fp8" and "fp8" not in meta:
            params = models.quantize_params(arch, params)
            if mesh is not None:
                params = shard_params(params, arch.param_specs(config), mesh)
    elif (path / "config.json").exists():
        model_type, config, params = hypic_jax.checkpoint.hf.convert_folder(path, dtype, quantize=quantize)
        arch = models.architecture(model_type)
        if mesh is not None:
            params = shard_params(params, arch.param_specs(config), mesh)
    else:
        raise ValueError(f"{path} holds neither a hypic-jax checkpoint ({METADATA_FILE}) nor a Hugging Face "
                         f"config.json")
    quantized = any(fp8.is_fp8(leaf) for leaf in jax.tree.leaves(params, is_leaf=fp8.is_fp8))
    source = f"{path.resolve()}:{dtype}" + (":fp8" if quantized else "")
    return Model(arch, config, params, max_context=max_context(path), source=source)


def random_model(path: str | Path, dtype: Any = "bfloat16", seed: int = 0, *,
                 mesh: jax.sharding.Mesh | None = None, quantize: str | None = None) -> Model:
    """A model of a folder's architecture and config with random weights (the architecture's `init_params`), for
    measuring shapes whose weights are not at hand (vLLM's `--load-format dummy`). The folder needs only its
    `METADATA_FILE` (`write_metadata`) or a Hugging Face config.json; nothing else in it is read. With `mesh`
    (axes "data" and "model") the weights are made where the architecture's `param_specs` place them, so a model
    larger than one device never exists whole on one (the values of the unsplit model up to rounding).
    quantize "fp8": the architecture's FP8_LEAVES as block-wise FP8 weights, made one at a time
    (`models.random_params`)."""
    if quantize not in (None, "fp8"):
        raise ValueError(f"quantize must be None or 'fp8', got {quantize!r}")
    path = Path(path)
    dtype = resolve_dtype(dtype)
    if (path / METADATA_FILE).exists():
        arch, config = _checkpoint_config(path)
    elif (path / "config.json").exists():
        hf_config = json.loads((path / "config.json").read_text())
        arch = models.architecture(models.resolve_model_type(hf_config))
        config = arch.config_from_hf(hf_config)
    else:
        raise ValueError(f"{path} holds neither a hypic-jax checkpoint ({METADATA_FILE}) nor a Hugging Face "
                         f"config.json")
    if not hasattr(arch, "init_params"):
        raise ValueError(f"architecture {arch.__name__} has no init_params: it cannot be given random weights")
    quantized = quantize == "fp8"
    found = dict(max_context=max_context(path),
                 source=f"{path.resolve()}:{dtype}:random{seed}" + (":fp8" if quantized else ""))
    if quantized and mesh is not None:
        raise ValueError("random FP8 weights are made on one device; tensor parallelism takes bf16 or FP8 folders")
    if mesh is None:
        params = models.random_params(arch, config, jax.random.key(seed), dtype, fp8=quantized)
        return Model(arch, config, params, **found)
    make = jax.jit(lambda key: arch.init_params(config, key, dtype),
                   out_shardings=named_shardings(arch.param_specs(config), mesh))
    return Model(arch, config, make(jax.random.key(seed)), **found)
