"""Hugging Face checkpoint -> hypic-jax parameter converters (one module per source architecture; see
`hypic_jax.models` for the contract and the registry)."""
