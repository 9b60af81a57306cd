"""hypic-jax: position-independent caching for hybrid-attention LLMs, in JAX.

`hypic_jax.Engine` serves a model (`Engine.from_pretrained(path)`, or the model embedded in the package with no
path); `hypic_jax.load` reads a checkpoint. Layers, each importing only those below it: the Pallas kernels
(`hypic_jax.pallas`, on the shared definitions of `hypic_jax.summary`), the transfer-operator core (`linear_attn`,
`conv`, `rope`, `attention`), the models (`hypic_jax.models`), their converters (`converters`) and checkpoints
(`hypic_jax.checkpoint`), the cache and the engine (`cache`, `pools`, `tiers`, `hypic_jax.engine`), training
(`hypic_jax.train`), then `cli`, `demo` and `serve`. tests/test_imports.py checks this.
"""

__version__ = "0.1.0"

from hypic_jax import conv, linear_attn, models, rope  # noqa: F401
from hypic_jax.checkpoint import load

models.load = load  # `hypic_jax.models.load`: the models package cannot define it, as it must not import checkpoint

_ENGINE_NAMES = ("Engine", "EngineOptions", "LimitOptions", "PoolOptions", "TierOptions", "ParallelOptions",
                 "KernelOptions", "RequestOptions", "SchedulerOptions", "CompileOptions")


def __getattr__(name):
    """`hypic_jax.Engine` and its options without importing the engine (and every model) at package import time."""
    if name in _ENGINE_NAMES:
        from hypic_jax import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'hypic_jax' has no attribute {name!r}")
