"""What the tests share: one builder of tiny checkpoints of every architecture, one relative-error helper, and the
markers that keep the tests of one checkpoint on one xdist worker.

`tiny_checkpoint(arch, folder)` writes a random checkpoint with the architecture's reference library (transformers
for Qwen3.5, Qwen3-Next and Kimi-Linear, mlx-lm for Ring-linear) into `folder`, loads it with `hypic_jax.load`
(float32), and slows every linear layer's decay (random-init gates forget within a few tokens, which would hide a
dropped transfer operator). Results are cached per (arch, folder) in the process."""

from __future__ import annotations

import functools
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

ARCHS = ("qwen_dense", "qwen_moe", "ring", "kimi")
SLOW_DECAY = float(np.log(0.05))  # A_log of linear layers: long memory, so a dropped transfer T shows


def rel(a, b) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def on_worker_of(group: str):
    """Tests of one tiny checkpoint share it and their compiled programs (module-scoped, and JAX's caches): under
    xdist (`--dist loadgroup`, pyproject.toml) they run on one worker, which builds and compiles them once."""
    return pytest.mark.xdist_group(group)


def arch_params(module: str, archs=ARCHS) -> list:
    """`archs` as parameters, each architecture's tests in a group of their own (`on_worker_of`)."""
    return [pytest.param(arch, marks=on_worker_of(f"{module}-{arch}")) for arch in archs]


def slow_decay(params):
    """Every linear layer's A_log set to a slow decay."""

    def visit(tree):
        if isinstance(tree, dict):
            return {k: (jnp.full_like(v, SLOW_DECAY) if k == "A_log" else visit(v)) for k, v in tree.items()}
        if isinstance(tree, (list, tuple)):
            return type(tree)(visit(v) for v in tree)
        return tree

    return visit(params)


@functools.lru_cache(maxsize=None)
def tiny_checkpoint(arch: str, folder: str):
    """(model with slow decays, vocabulary size, folder) of a tiny random checkpoint of `arch` (ARCHS)."""
    folder = Path(folder)
    if arch.startswith("qwen"):
        pytest.importorskip("transformers")
        from qwen_helpers import VOCAB, build, save

        save(build(arch.split("_")[1]), folder)
        vocab = VOCAB
    elif arch == "ring":
        pytest.importorskip("mlx.core")
        from test_ring_linear import TINY_CONFIG, _build_reference, _write_checkpoint

        config = {**TINY_CONFIG, "num_hidden_layers": 3}  # linear, linear, full attention
        _write_checkpoint(_build_reference(config), config, folder)
        vocab = config["vocab_size"]
    elif arch == "kimi":
        pytest.importorskip("transformers")
        from test_kimi_linear import build_reference

        build_reference(folder)
        vocab = 128
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {ARCHS}")
    import hypic_jax

    model = hypic_jax.load(folder, dtype="float32")
    return model.replace(params=slow_decay(model.params)), vocab, folder
