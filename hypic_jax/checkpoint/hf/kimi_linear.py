"""Hugging Face Kimi-Linear (`kimi_linear`) checkpoints -> `hypic_jax.models.kimi_linear` parameters.

Accepts both layouts a folder can have:
* the original / `save_pretrained` layout: forget-gate tensors directly under `self_attn` (`f_a_proj`, `f_b_proj`,
  `dt_bias`, `A_log`), separate `q_conv1d` / `k_conv1d` / `v_conv1d`, MLPs under `block_sparse_moe` (or `mlp`)
  with per-expert `experts.{j}.w1/w2/w3` (gate / down / up);
* the transformers runtime layout: `self_attn.forget_gate.*`, one fused `self_attn.conv1d`, MLPs under `mlp` with
  fused `experts.gate_up_proj` [E, 2I, D] and `experts.down_proj` [E, D, I].
The layout is detected per tensor group from the names present; the strict validation in `hypic_jax.checkpoint.hf.base` then
names any missing, unexpected or mis-shaped tensor.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from hypic_jax.checkpoint.hf.base import CheckpointReader, Conversion, Rule, build, linear, vector
from hypic_jax.models import kimi_linear as arch


def _first_present(reader: CheckpointReader, *names: str) -> str:
    """The first of `names` the checkpoint has (or the first one, so a missing tensor is reported by that name)."""
    for name in names:
        if name in reader:
            return name
    return names[0]


def _has_prefix(reader: CheckpointReader, prefix: str) -> bool:
    return any(n.startswith(prefix) for n in reader.names())


def _stack_conv(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Three Conv1d weights [HK, 1, W] -> [3, HK, W]."""
    return np.stack([q[:, 0], k[:, 0], v[:, 0]])


def _stack_experts_gate_up(*tensors: np.ndarray) -> np.ndarray:
    """w1_0, w3_0, w1_1, w3_1, ... each [I, D] -> [E, D, 2I] ([gate | up] per expert)."""
    pairs = zip(tensors[0::2], tensors[1::2])
    return np.stack([np.concatenate([w1.T, w3.T], axis=1) for w1, w3 in pairs])


def _stack_experts_down(*tensors: np.ndarray) -> np.ndarray:
    """w2_j [D, I] -> [E, I, D]."""
    return np.stack([w2.T for w2 in tensors])


def _swap_last(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.swapaxes(x, -1, -2))


def _kda_rules(reader: CheckpointReader, c: arch.KimiLinearConfig, at: tuple, src: str) -> list[Rule]:
    d, hk, k, h, w = c.hidden_size, c.linear_dim, c.linear_head_dim, c.linear_num_heads, c.conv_kernel
    gate_src = src + ("forget_gate." if _has_prefix(reader, src + "forget_gate.") else "")
    rules = [
        linear(at + ("q_proj",), src + "q_proj.weight", hk, d),
        linear(at + ("k_proj",), src + "k_proj.weight", hk, d),
        linear(at + ("v_proj",), src + "v_proj.weight", hk, d),
        linear(at + ("f_a",), gate_src + "f_a_proj.weight", k, d),
        linear(at + ("f_b",), gate_src + "f_b_proj.weight", hk, k),
        vector(at + ("dt_bias",), gate_src + "dt_bias", hk),
        Rule(at + ("A_log",), (gate_src + "A_log",), ((1, 1, h, 1),), lambda a: a.reshape(h)),
        linear(at + ("b_proj",), src + "b_proj.weight", h, d),
        linear(at + ("g_a",), src + "g_a_proj.weight", k, d),
        linear(at + ("g_b",), src + "g_b_proj.weight", hk, k),
        vector(at + ("o_norm",), src + "o_norm.weight", k),
        linear(at + ("o_proj",), src + "o_proj.weight", d, hk),
    ]
    if src + "conv1d.weight" in reader:  # transformers runtime layout: one [3HK, 1, W] conv
        rules.append(Rule(at + ("conv",), (src + "conv1d.weight",), ((3 * hk, 1, w),), lambda x: x.reshape(3, hk, w)))
    else:
        names = tuple(src + f"{p}_conv1d.weight" for p in "qkv")
        rules.append(Rule(at + ("conv",), names, ((hk, 1, w),) * 3, _stack_conv))
    return rules


def _mla_rules(c: arch.KimiLinearConfig, at: tuple, src: str) -> list[Rule]:
    d, h = c.hidden_size, c.num_heads
    rules = []
    if c.q_lora_rank is None:
        rules.append(linear(at + ("q_proj",), src + "q_proj.weight", h * c.qk_head_dim, d))
    else:
        rules += [
            linear(at + ("q_a",), src + "q_a_proj.weight", c.q_lora_rank, d),
            vector(at + ("q_a_norm",), src + "q_a_layernorm.weight", c.q_lora_rank),
            linear(at + ("q_b",), src + "q_b_proj.weight", h * c.qk_head_dim, c.q_lora_rank),
        ]
        if c.attention_bias:
            rules.append(vector(at + ("q_a_bias",), src + "q_a_proj.bias", c.q_lora_rank))
    kv_a_out = c.kv_lora_rank + c.qk_rope_head_dim
    rules += [
        linear(at + ("kv_a",), src + "kv_a_proj_with_mqa.weight", kv_a_out, d),
        vector(at + ("kv_a_norm",), src + "kv_a_layernorm.weight", c.kv_lora_rank),
        linear(at + ("kv_b",), src + "kv_b_proj.weight", h * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
        linear(at + ("o_proj",), src + "o_proj.weight", d, h * c.v_head_dim),
    ]
    if c.attention_bias:
        rules += [
            vector(at + ("kv_a_bias",), src + "kv_a_proj_with_mqa.bias", kv_a_out),
            vector(at + ("o_proj_bias",), src + "o_proj.bias", d),
        ]
    return rules


def _swiglu_rules(at: tuple, src: str, d: int, inner: int) -> list[Rule]:
    return [
        linear(at + ("gate",), src + "gate_proj.weight", inner, d),
        linear(at + ("up",), src + "up_proj.weight", inner, d),
        linear(at + ("down",), src + "down_proj.weight", d, inner),
    ]


def _moe_rules(reader: CheckpointReader, c: arch.KimiLinearConfig, at: tuple, src: str) -> list[Rule]:
    d, e, i = c.hidden_size, c.num_experts, c.moe_intermediate_size
    rules = [
        linear(at + ("router",), src + "gate.weight", e, d),
        vector(at + ("router_bias",), src + "gate.e_score_correction_bias", e),
        *_swiglu_rules(at + ("shared",), src + "shared_experts.", d, i * c.num_shared_experts),
    ]
    if src + "experts.gate_up_proj" in reader:  # transformers runtime layout (fused, [out, in] per expert)
        rules += [
            Rule(at + ("gate_up",), (src + "experts.gate_up_proj",), ((e, 2 * i, d),), _swap_last),
            Rule(at + ("down",), (src + "experts.down_proj",), ((e, d, i),), _swap_last),
        ]
    else:
        gate_up = tuple(src + f"experts.{j}.{w}.weight" for j in range(e) for w in ("w1", "w3"))
        down = tuple(src + f"experts.{j}.w2.weight" for j in range(e))
        rules += [
            Rule(at + ("gate_up",), gate_up, ((i, d),) * (2 * e), _stack_experts_gate_up),
            Rule(at + ("down",), down, ((d, i),) * e, _stack_experts_down),
        ]
    return rules


def rules_for(reader: CheckpointReader, c: arch.KimiLinearConfig) -> list[Rule]:
    """Every HF tensor -> parameter mapping for this checkpoint."""
    d = c.hidden_size
    rules = [
        Rule(("embed",), ("model.embed_tokens.weight",), ((c.vocab_size, d),)),
        vector(("final_norm",), "model.norm.weight", d),
    ]
    if not c.tie_word_embeddings:
        rules.append(linear(("lm_head",), "lm_head.weight", c.vocab_size, d))
    for idx, (kind, mlp_kind) in enumerate(zip(c.layer_types, c.mlp_types)):
        at, src = ("layers", idx), f"model.layers.{idx}."
        rules += [
            vector(at + ("attn_norm",), src + "input_layernorm.weight", d),
            vector(at + ("mlp_norm",), src + "post_attention_layernorm.weight", d),
        ]
        if kind == arch.LINEAR:
            rules += _kda_rules(reader, c, at + ("attn",), src + "self_attn.")
        else:
            rules += _mla_rules(c, at + ("attn",), src + "self_attn.")
        # save_pretrained writes every MLP (dense ones too) under block_sparse_moe; transformers runs them as mlp.
        mlp_src = src + ("block_sparse_moe." if _has_prefix(reader, src + "block_sparse_moe.") else "mlp.")
        if mlp_kind == arch.DENSE:
            rules += _swiglu_rules(at + ("mlp",), mlp_src, d, c.intermediate_size)
        else:
            rules += _moe_rules(reader, c, at + ("mlp",), mlp_src)
    return rules


def conversion(reader: CheckpointReader, hf_config: dict[str, Any]) -> Conversion:
    config = arch.config_from_hf(hf_config)
    if config.tie_word_embeddings and "lm_head.weight" in reader:
        # transformers' KimiLinearForCausalLM never ties (its `_tied_weights_keys` is empty): with
        # tie_word_embeddings it still writes and reads its own lm_head, so a file that holds one is read untied
        config = dataclasses.replace(config, tie_word_embeddings=False)
    return Conversion(arch, config, rules_for(reader, config))  # gate params stay float32 (see init_params)


def convert(reader: CheckpointReader, hf_config: dict[str, Any], dtype: Any) -> tuple[arch.KimiLinearConfig, Any]:
    """HF folder reader + config.json dict -> (Config, params). Raises ValueError naming any bad tensor."""
    plan = conversion(reader, hf_config)
    return plan.config, build(plan, reader, dtype)
