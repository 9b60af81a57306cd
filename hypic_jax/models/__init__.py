"""Model architectures and their registry.

To add an architecture, write two modules and register the first in `REGISTRY` below (one line per HF model_type):

An **architecture module** `hypic_jax/models/<name>.py` must provide
  * `Config`: a frozen, hashable dataclass (tuples, not lists) holding every static hyper-parameter;
  * `config_from_hf(hf_config: dict) -> Config` from the Hugging Face config.json dict (already unwrapped: for a
    multimodal wrapper the converter passes the text config);
  * `init_params(config, key, dtype) -> params`: random parameters, a plain PyTree of arrays (used by tests, the
    benchmarks, and, through `jax.eval_shape`, as the target structure for orbax restore and converter checks);
  * `param_specs(config) -> PyTree of jax.sharding.PartitionSpec` with the params' structure, for a mesh with
    axes "data" and "model";
  * `init_cache(config, batch, max_len, dtype) -> base.ModelCache` (one entry per layer: `base.KVCache`,
    `base.LinearCache` or any PyTree of the layer's own);
  * `forward(params, config, tokens, cache=None, *, kernels) -> (logits float32 [B, L, vocab], new_cache or None)`:
    a pure function of int32 tokens [B, L]. Without a cache it is a plain causal forward from position 0; with one,
    the tokens continue at position `cache.length` and the returned cache has absorbed them. `kernels`
    (`base.KernelOptions`) says how the linear-attention cores and the experts run; it never changes the result
    beyond rounding;
  * for the position-independent engine (`hypic_jax.engine`): `pool_layout(config, dtype)`, per layer the piece a
    cache entry keeps (per slot or per token), and `span_forward_arrays(params, config, layout, pools, ...)`, one
    forward over the fresh tokens of a layout held as data (`hypic_jax.stitch.layout`) that reads cached pieces
    from the pools and returns the rows to write back;
  * optionally `cache_specs(config)`: PartitionSpecs with `init_cache`'s structure;
  * optionally `FP8_LEAVES`: the dict keys of the per-layer weights that block-wise FP8 checkpoints quantize
    (`quantize_params`; the projections and experts, not routers, gates of one column, convs, norms or the
    embedding and head);
  * optionally `prefill(params, config, tokens, max_len, *, kernels) -> (float32 logits of the last position
    [B, vocab], cache)` for a fresh prompt (fast causal attention, LM head on one position); `Model.generate` uses
    it when present.

A **converter module** `hypic_jax/checkpoint/hf/<name>.py`, named like the architecture module, must provide
  * `conversion(reader: hypic_jax.checkpoint.hf.base.CheckpointReader, hf_config: dict) ->
    hypic_jax.checkpoint.hf.base.Conversion`: the architecture module, its config, the `Rule`s (HF tensor names ->
    parameter path + transform) and the tensors deliberately skipped, from the config and the safetensors headers
    alone; `hypic_jax.checkpoint.hf.base.build` validates missing / unexpected / mis-shaped tensors and streams the
    data (block-wise FP8 checkpoints included), and `hypic-jax convert --quantize fp8` reads the rules to find the
    tensors that feed `FP8_LEAVES`;
  * `convert(reader, hf_config, dtype) -> (config, params)`, usually `build` of its `conversion`.

Everything else is generic: `hypic_jax.load`, `hypic-jax convert`, orbax save/restore (`hypic_jax.checkpoint`),
`Model.logits/generate`, the engine's programs.

This package imports neither the converters nor `hypic_jax.checkpoint` (both import it); `load` lives in
`hypic_jax.checkpoint` and is exported as `hypic_jax.load`.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp

from hypic_jax.kernels import fp8 as fp8_weights
from hypic_jax.models.base import Model  # noqa: F401  (the type `load` returns)

# HF model_type -> architecture module (its converter is the `hypic_jax.checkpoint.hf` module of the same name)
REGISTRY: dict[str, str] = {
    "qwen3_5_text": "hypic_jax.models.qwen3_5",
    "qwen3_5_moe_text": "hypic_jax.models.qwen3_5",
    "qwen3_5": "hypic_jax.models.qwen3_5",
    "qwen3_5_moe": "hypic_jax.models.qwen3_5",
    "qwen3_next": "hypic_jax.models.qwen3_next",
    "kimi_linear": "hypic_jax.models.kimi_linear",
    "bailing_moe_linear": "hypic_jax.models.ring_linear",
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
    return importlib.import_module(REGISTRY[model_type])


def abstract_params(arch: ModuleType, config: Any, dtype: Any, *, fp8: bool = False,
                    block: int = fp8_weights.BLOCK) -> Any:
    """ShapeDtypeStruct tree of the architecture's parameters (no memory allocated); fp8: with the architecture's
    `FP8_LEAVES` as block-wise FP8 weights in `block`-row blocks (`quantize_params`)."""
    def make():
        params = arch.init_params(config, jax.random.key(0), dtype)
        return quantize_params(arch, params, block) if fp8 else params
    return jax.eval_shape(make)


def fp8_leaf(arch: ModuleType, path) -> bool:
    """Whether the parameter at `path` (a key path of the parameter tree) is one that block-wise FP8 checkpoints
    quantize: a weight of a layer under one of the architecture's `FP8_LEAVES` keys. `path`: jax key entries or
    the plain keys and indices themselves."""
    keys = [getattr(k, "key", getattr(k, "idx", k)) for k in path]
    return bool(keys) and keys[0] == "layers" and keys[-1] in getattr(arch, "FP8_LEAVES", ())


def random_params(arch: ModuleType, config: Any, key: Any, dtype: Any, *, fp8: bool = False,
                  block: int = fp8_weights.BLOCK) -> Any:
    """The architecture's random parameters (`init_params`); fp8: with its `FP8_LEAVES` as block-wise FP8 weights of
    normal(0, 0.02) values, each made and quantized on its own, so that the model never exists whole in `dtype`
    (the 35B-A3B shape's 69 GB in bfloat16 would not fit beside its FP8 copy on an 80 GB device). The other leaves
    are `init_params`' own (the compiler drops the matrices they leave out)."""
    if not fp8:
        return arch.init_params(config, key, dtype)
    if not getattr(arch, "FP8_LEAVES", ()):
        raise ValueError(f"architecture {arch.__name__} has no FP8 weights (FP8_LEAVES)")

    def rest(key):
        return jax.tree_util.tree_map_with_path(lambda path, leaf: None if fp8_leaf(arch, path) else leaf,
                                                arch.init_params(config, key, dtype))

    @functools.partial(jax.jit, static_argnums=(1,))
    def matrix(key, shape):
        return fp8_weights.quantize(0.02 * jax.random.normal(key, shape, jnp.float32), block, dtype)

    abstract = jax.eval_shape(lambda: arch.init_params(config, key, dtype))
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(abstract)[0]]
    keys = dict(zip(map(tuple, paths), jax.random.split(jax.random.fold_in(key, 1), len(paths))))
    small = jax.jit(rest)(key)
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf, spec: matrix(keys[tuple(path)], tuple(spec.shape)) if fp8_leaf(arch, path) else leaf,
        small, abstract, is_leaf=lambda x: x is None)


def quantize_params(arch: ModuleType, params: Any, block: int = fp8_weights.BLOCK) -> Any:
    """params with every `fp8_leaf` as a block-wise FP8 weight (`kernels.fp8.quantize`, B x B blocks), the rest
    as they are. Raises for an architecture that declares no FP8_LEAVES."""
    if not getattr(arch, "FP8_LEAVES", ()):
        raise ValueError(f"architecture {arch.__name__} has no FP8 weights (FP8_LEAVES)")
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: (fp8_weights.quantize(leaf, block)
                            if fp8_leaf(arch, path) and not fp8_weights.is_fp8(leaf) else leaf),
        params, is_leaf=fp8_weights.is_fp8)
