"""Ring-linear-2.0 (`BailingMoeLinearV2ForCausalLM`, remote code) Hugging Face checkpoint -> `ring_linear` params.

Tensor names are those of the released checkpoints (the remote-code module tree), not mlx-lm's renamed ones:

    model.word_embeddings.weight                        model.norm.weight            lm_head.weight
    model.layers.{i}.input_layernorm.weight             model.layers.{i}.post_attention_layernorm.weight
    model.layers.{i}.attention.query_key_value.weight   (+ .bias with use_qkv_bias)
    model.layers.{i}.attention.dense.weight
    model.layers.{i}.attention.query_layernorm.weight   model.layers.{i}.attention.key_layernorm.weight
    model.layers.{i}.attention.g_proj.weight            model.layers.{i}.attention.g_norm.weight  (linear layers)
    model.layers.{i}.mlp.{gate,up,down}_proj.weight                                               (dense layers)
    model.layers.{i}.mlp.gate.weight                    model.layers.{i}.mlp.gate.expert_bias
    model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight
    model.layers.{i}.mlp.shared_experts.{gate,up,down}_proj.weight                                (MoE layers)

Multi-token-prediction layers (`model.layers.{i}` with i >= num_hidden_layers, present when
num_nextn_predict_layers > 0) are not part of the causal LM and are skipped.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hypic_jax.checkpoint.hf.base import CheckpointReader, Conversion, Rule, build, linear, transpose, vector
from hypic_jax.models import ring_linear as arch


def _attention_rules(i: int, config: arch.RingLinearConfig) -> list[Rule]:
    d, h = config.hidden_size, config.num_attention_heads
    src, dst = f"model.layers.{i}.attention", ("layers", i, "attn")
    if config.is_full_attention(i):
        hd, kvh = config.attention_head_dim, config.num_key_value_heads
        qkv_out = (h + 2 * kvh) * hd
        rules = [linear(dst + ("qkv",), f"{src}.query_key_value.weight", qkv_out, d)]
    else:
        hd = config.linear_head_dim
        qkv_out = 3 * h * hd
        rules = [
            linear(dst + ("qkv",), f"{src}.query_key_value.weight", qkv_out, d),
            linear(dst + ("g_proj",), f"{src}.g_proj.weight", h * hd, d),
            vector(dst + ("g_norm",), f"{src}.g_norm.weight", h * hd),
        ]
    rules.append(linear(dst + ("dense",), f"{src}.dense.weight", d, h * hd))
    if config.use_qkv_bias:
        rules.append(vector(dst + ("qkv_bias",), f"{src}.query_key_value.bias", qkv_out))
    if config.use_qk_norm:
        rules.append(vector(dst + ("q_norm",), f"{src}.query_layernorm.weight", hd))
        rules.append(vector(dst + ("k_norm",), f"{src}.key_layernorm.weight", hd))
    return rules


def _swiglu_rules(src: str, dst: tuple, d: int, f: int) -> list[Rule]:
    return [
        linear(dst + ("gate",), f"{src}.gate_proj.weight", f, d),
        linear(dst + ("up",), f"{src}.up_proj.weight", f, d),
        linear(dst + ("down",), f"{src}.down_proj.weight", d, f),
    ]


def _stack_gate_up(*weights: np.ndarray) -> np.ndarray:
    """E gate_proj then E up_proj HF weights [I, D] -> fused [E, D, 2I] ([gate | up] per expert)."""
    half = len(weights) // 2
    gate = np.stack([w.T for w in weights[:half]])
    up = np.stack([w.T for w in weights[half:]])
    return np.concatenate([gate, up], axis=-1)


def _stack_down(*weights: np.ndarray) -> np.ndarray:
    """E down_proj HF weights [D, I] -> [E, I, D]."""
    return np.stack([w.T for w in weights])


def _mlp_rules(i: int, config: arch.RingLinearConfig) -> list[Rule]:
    d = config.hidden_size
    src, dst = f"model.layers.{i}.mlp", ("layers", i, "mlp")
    if not config.is_moe(i):
        return _swiglu_rules(src, dst, d, config.intermediate_size)
    e, m = config.num_experts, config.moe_intermediate_size
    experts = [f"{src}.experts.{j}" for j in range(e)]
    rules = [
        linear(dst + ("router",), f"{src}.gate.weight", e, d),
        Rule(dst + ("gate_up",),
             tuple(f"{x}.gate_proj.weight" for x in experts) + tuple(f"{x}.up_proj.weight" for x in experts),
             ((m, d),) * (2 * e), _stack_gate_up),
        Rule(dst + ("down",), tuple(f"{x}.down_proj.weight" for x in experts), ((d, m),) * e, _stack_down),
    ]
    if config.moe_router_enable_expert_bias:
        rules.append(vector(dst + ("expert_bias",), f"{src}.gate.expert_bias", e))
    if config.has_shared_expert:
        rules += _swiglu_rules(f"{src}.shared_experts", dst + ("shared",), d, config.shared_expert_size)
    return rules


def rules(config: arch.RingLinearConfig) -> list[Rule]:
    """Every HF tensor of the checkpoint, with its expected shape and where it goes."""
    d, v = config.hidden_size, config.vocab_size
    out = [
        Rule(("embed",), ("model.word_embeddings.weight",), ((v, d),)),
        vector(("norm",), "model.norm.weight", d),
    ]
    if not config.tie_word_embeddings:
        out.append(Rule(("lm_head",), ("lm_head.weight",), ((v, d),), transpose))
    for i in range(config.num_hidden_layers):
        out.append(vector(("layers", i, "input_norm"), f"model.layers.{i}.input_layernorm.weight", d))
        out.append(vector(("layers", i, "post_norm"), f"model.layers.{i}.post_attention_layernorm.weight", d))
        out += _attention_rules(i, config)
        out += _mlp_rules(i, config)
    return out


def _is_extra_layer(config: arch.RingLinearConfig):
    """Tensors deliberately left out: MTP layers past the causal stack, and a tied head's duplicate."""

    def ignore(name: str) -> bool:
        if name.startswith("model.layers."):
            return int(name.split(".")[2]) >= config.num_hidden_layers
        return config.tie_word_embeddings and name == "lm_head.weight"

    return ignore


def conversion(reader: CheckpointReader, hf_config: dict) -> Conversion:
    """Ring's layout (names and shapes) for this config; refuses a config of another model."""
    architectures = hf_config.get("architectures") or []
    if hf_config.get("model_type") != arch.MODEL_TYPE and arch.ARCHITECTURE not in architectures:
        raise ValueError(
            f"not a Ring-linear checkpoint: model_type {hf_config.get('model_type')!r}, architectures {architectures}"
        )
    config = arch.config_from_hf(hf_config)
    return Conversion(arch, config, rules(config), _is_extra_layer(config))


def convert(reader: CheckpointReader, hf_config: dict, dtype: Any) -> tuple[arch.RingLinearConfig, Any]:
    """Validate the whole checkpoint against Ring's layout (names and shapes), then stream it into params."""
    plan = conversion(reader, hf_config)
    return plan.config, build(plan, reader, dtype)
