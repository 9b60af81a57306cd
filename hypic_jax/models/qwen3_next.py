"""Qwen3-Next (`qwen3_next`): the Qwen3.5 hybrid network with a different checkpoint layout.

The network is identical to `qwen3_5` (Gated DeltaNet + gated full attention, (1 + w) norms, partial RoPE, MoE with
a gated shared expert, optional dense layers through `mlp_only_layers` / `decoder_sparse_step`, and the
`norm_topk_prob` switch). What differs is the checkpoint: the GDN projections are fused and grouped per key head
(`in_proj_qkvz`, `in_proj_ba`); `hypic_jax.checkpoint.hf.qwen3_next` regroups them into this module's separate projections once
at conversion time, so the forward pays nothing for the grouping.
"""

from __future__ import annotations

from hypic_jax.models.qwen3_5 import (  # noqa: F401  (the architecture-module contract, re-exported)
    FP8_LEAVES,
    FULL,
    LINEAR,
    Config,
    cache_specs,
    config_from_hf,
    final_logits,
    forward,
    hidden_states,
    init_cache,
    init_params,
    lm_head,
    mixer_block,
    mlp_block,
    param_specs,
    pool_layout,
    prefill,
    span_forward_arrays,
)
