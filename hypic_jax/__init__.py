"""hypic-jax: position-independent caching for hybrid-attention LLMs, in JAX."""

__version__ = "0.1.0"

from hypic_jax import conv, linear_attn, rope  # noqa: F401  (the core: kernels <- core <- models <- engine)


def load(path, dtype="bfloat16", *, mesh=None):
    """Load a model (orbax checkpoint from `hypic-jax convert`, or a Hugging Face folder); see hypic_jax.models.load."""
    from hypic_jax.models import load as _load

    return _load(path, dtype, mesh=mesh)


def __getattr__(name):
    """`hypic_jax.Engine` without importing the engine (and every model) at package import time."""
    if name == "Engine":
        from hypic_jax.engine import Engine

        return Engine
    raise AttributeError(f"module 'hypic_jax' has no attribute {name!r}")
