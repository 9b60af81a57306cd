"""Flash attention for queries at arbitrary absolute positions over keys in order, the attention of a stitched
request's fresh tokens (`positioned`), and its pure-JAX reference (`reference`)."""

from hypic_jax.kernels.attention.positioned import AttentionConfig, positioned_attention
from hypic_jax.kernels.attention.reference import positioned_attention_reference

__all__ = ["AttentionConfig", "positioned_attention", "positioned_attention_reference"]
