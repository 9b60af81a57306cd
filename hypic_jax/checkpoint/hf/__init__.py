"""Hugging Face checkpoint -> hypic-jax parameter converters: one module per architecture, named like its
architecture module in `hypic_jax.models` (see there for the contract and the registry), on the helpers of
`hypic_jax.checkpoint.hf.base`.

`convert_folder` converts a whole Hugging Face folder through the registered architecture's converter.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

from hypic_jax import models
from hypic_jax.checkpoint.hf.base import CheckpointReader, read_hf_config

__all__ = ["converter", "convert_folder"]


def converter(model_type: str) -> ModuleType:
    """The converter module of a registered HF model_type: `hypic_jax.checkpoint.hf.<name>` for
    `hypic_jax.models.<name>`."""
    name = models.architecture(model_type).__name__.rsplit(".", 1)[1]
    return importlib.import_module(f"{__name__}.{name}")


def convert_folder(folder: str | Path, dtype: Any = "bfloat16") -> tuple[str, Any, Any]:
    """HF folder -> (model_type, config, params) through the registered converter."""
    hf_config = read_hf_config(folder)
    model_type = models.resolve_model_type(hf_config)
    config, params = converter(model_type).convert(CheckpointReader(folder), hf_config, dtype)
    return model_type, config, params
