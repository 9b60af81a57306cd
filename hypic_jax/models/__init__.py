"""Model architectures, their registry, and `load`.

To add an architecture, write two modules and register them in `REGISTRY` below (one line per HF model_type):

An **architecture module** `hypic_jax/models/<name>.py` must provide
  * `Config`: a frozen, hashable dataclass (tuples, not lists) holding every static hyper-parameter;
  * `config_from_hf(hf_config: dict) -> Config` from the Hugging Face config.json dict (already unwrapped: for a
    multimodal wrapper the converter passes the text config);
  * `init_params(config, key, dtype) -> params`: random parameters, a plain PyTree of arrays (used by tests, the
    benchmark, and, through `jax.eval_shape`, as the target structure for orbax restore and converter checks);
  * `param_specs(config) -> PyTree of jax.sharding.PartitionSpec` with the params' structure, for a mesh with
    axes "data" and "model";
  * `init_cache(config, batch, max_len, dtype) -> base.ModelCache` (one entry per layer: `base.KVCache`,
    `base.LinearCache` or any PyTree of the layer's own);
  * `forward(params, config, tokens, cache=None) -> (logits float32 [B, L, vocab], new_cache or None)`:
    a pure function of int32 tokens [B, L]. Without a cache it is a plain causal forward from position 0; with one,
    the tokens continue at position `cache.length` and the returned cache has absorbed them;
  * optionally `cache_specs(config)`: PartitionSpecs with `init_cache`'s structure;
  * optionally `prefill(params, config, tokens, max_len) -> (float32 logits of the last position [B, vocab], cache)`
    for a fresh prompt (fast causal attention, LM head on one position); `Model.generate` uses it when present.

A **converter module** `converters/<name>.py` must provide
  * `convert(reader: converters.base.CheckpointReader, hf_config: dict, dtype) -> (config, params)`, usually by
    listing `converters.base.Rule`s (HF tensor names -> parameter path + transform) and calling
    `converters.base.apply_rules`, which validates missing / unexpected / mis-shaped tensors and streams the data.

Everything else is generic: `hypic_jax.load`, `hypic-jax convert`, orbax save/restore, `Model.logits/generate`.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

import jax

from hypic_jax.models.base import (
    METADATA_FILE,
    Model,
    config_from_dict,
    named_shardings,
    read_metadata,
    resolve_dtype,
    shard_params,
)

# HF model_type -> (architecture module, converter module)
REGISTRY: dict[str, tuple[str, str]] = {
    "qwen3_5_text": ("hypic_jax.models.qwen3_5", "converters.qwen3_5"),
    "qwen3_5_moe_text": ("hypic_jax.models.qwen3_5", "converters.qwen3_5"),
    "qwen3_5": ("hypic_jax.models.qwen3_5", "converters.qwen3_5"),
    "qwen3_5_moe": ("hypic_jax.models.qwen3_5", "converters.qwen3_5"),
    "qwen3_next": ("hypic_jax.models.qwen3_next", "converters.qwen3_next"),
    "kimi_linear": ("hypic_jax.models.kimi_linear", "converters.kimi_linear"),
    "bailing_moe_linear": ("hypic_jax.models.ring_linear", "converters.ring_linear"),
}

# HF `architectures` entries for configs whose model_type is missing or not registered (remote-code models).
ARCHITECTURE_ALIASES: dict[str, str] = {"BailingMoeLinearV2ForCausalLM": "bailing_moe_linear"}


def resolve_model_type(hf_config: dict) -> str:
    """The registered model_type of a HF config dict; raises ValueError naming an unknown type."""
    model_type = hf_config.get("model_type")
    if model_type in REGISTRY:
        return model_type
    for name in hf_config.get("architectures") or ():
        if name in ARCHITECTURE_ALIASES:
            return ARCHITECTURE_ALIASES[name]
    raise ValueError(
        f"unknown model_type {model_type!r} (architectures {hf_config.get('architectures')}); "
        f"supported model types: {sorted(REGISTRY)}"
    )


def architecture(model_type: str) -> ModuleType:
    if model_type not in REGISTRY:
        raise ValueError(f"unknown model_type {model_type!r}; supported model types: {sorted(REGISTRY)}")
    return importlib.import_module(REGISTRY[model_type][0])


def converter(model_type: str) -> ModuleType:
    if model_type not in REGISTRY:
        raise ValueError(f"unknown model_type {model_type!r}; supported model types: {sorted(REGISTRY)}")
    return importlib.import_module(REGISTRY[model_type][1])


def abstract_params(arch: ModuleType, config: Any, dtype: Any) -> Any:
    """ShapeDtypeStruct tree of the architecture's parameters (no memory allocated)."""
    return jax.eval_shape(lambda: arch.init_params(config, jax.random.key(0), dtype))


def load(path: str | Path, dtype: Any = "bfloat16", *, mesh: jax.sharding.Mesh | None = None) -> Model:
    """Load a model from an orbax checkpoint written by `hypic-jax convert`, or directly from a Hugging Face folder.

    With `mesh` (axes "data" and "model") the parameters are placed with the architecture's `param_specs` (an orbax
    checkpoint is restored straight into that sharding). Returns a `Model` with `logits(tokens)` and
    `generate(tokens, max_new_tokens)`.
    """
    path = Path(path)
    dtype = resolve_dtype(dtype)
    if (path / METADATA_FILE).exists():
        from converters.base import restore_params  # converters depend on models, not the reverse, at import time

        meta = read_metadata(path)
        arch = architecture(meta["model_type"])
        config = config_from_dict(arch.Config, meta["config"])
        abstract = abstract_params(arch, config, dtype)
        if mesh is not None:
            shardings = named_shardings(arch.param_specs(config), mesh)
            abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
        return Model(arch, config, restore_params(path, abstract))
    if (path / "config.json").exists():
        from converters.base import convert_folder

        model_type, config, params = convert_folder(path, dtype)
        arch = architecture(model_type)
        if mesh is not None:
            params = shard_params(params, arch.param_specs(config), mesh)
        return Model(arch, config, params)
    raise ValueError(f"{path} holds neither a hypic-jax checkpoint ({METADATA_FILE}) nor a Hugging Face config.json")
