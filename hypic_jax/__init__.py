"""hypic-jax: position-independent caching for hybrid-attention LLMs, in JAX.

Layers, each importing only those below it: the Pallas kernels (`hypic_jax.pallas`, on the shared definitions of
`hypic_jax.summary`), the transfer-operator core (`linear_attn`, `conv`, `rope`, `attention`), the models
(`hypic_jax.models`), their converters (`converters`) and checkpoints (`hypic_jax.checkpoint`), the cache and the
engine (`spans`, `cache`, `pool`, `engine`), training (`hypic_jax.train`), then `cli`, `demo` and `serve`.
tests/test_imports.py checks this.
"""

__version__ = "0.1.0"

from hypic_jax import conv, linear_attn, models, rope  # noqa: F401
from hypic_jax.checkpoint import load

models.load = load  # `hypic_jax.models.load`: the models package cannot define it, as it must not import checkpoint


def __getattr__(name):
    """`hypic_jax.Engine` without importing the engine (and every model) at package import time."""
    if name == "Engine":
        from hypic_jax.engine import Engine

        return Engine
    raise AttributeError(f"module 'hypic_jax' has no attribute {name!r}")
