"""hypic-jax: position-independent caching for hybrid-attention LLMs, in JAX."""

__version__ = "0.1.0"

from hypic_jax import conv, linear_attn, rope  # noqa: F401  (the core: kernels <- core <- models <- engine)
