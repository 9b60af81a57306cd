"""Qwen3.5 Hugging Face checkpoints (qwen3_5_text, qwen3_5_moe_text and the multimodal wrappers qwen3_5,
qwen3_5_moe whose language model lives under `model.language_model.*`) -> `hypic_jax.models.qwen3_5` params.

Handled layouts: per-expert MoE weights (`mlp.experts.{e}.gate_proj/up_proj/down_proj`, what transformers'
save_pretrained writes) and fused ones (`mlp.experts.gate_up_proj [E, 2I, H]`, `mlp.experts.down_proj [E, H, I]`).
Skipped on purpose: the vision tower (`model.visual.*`) and multi-token-prediction heads (`mtp.*`), which a
text-only forward never uses.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import numpy as np

from hypic_jax.checkpoint.hf.base import (CheckpointReader, Conversion, Rule, build, linear, skip_prefixes, transpose,
                                          vector)
from hypic_jax.models import qwen3_5 as arch

log = logging.getLogger(__name__)

SKIPPED = ("model.visual.", "mtp.", "model.mtp.")


def language_model_prefix(reader: CheckpointReader) -> str:
    """`model.language_model.` for multimodal wrappers, `model.` for text-only checkpoints."""
    if "model.language_model.embed_tokens.weight" in reader:
        return "model.language_model."
    return "model."


def conv_weight(w: np.ndarray) -> np.ndarray:
    """nn.Conv1d depthwise weight [D, 1, W] -> [D, W]."""
    return w.reshape(w.shape[0], w.shape[2])


def gdn_rules(config: arch.Config, target: tuple, src: str, reader: CheckpointReader) -> list[Rule]:
    """Qwen3.5 GDN: separate in_proj_qkv / in_proj_z / in_proj_b / in_proj_a."""
    h, hv = config.hidden_size, config.linear_num_value_heads
    return [
        linear(target + ("in_proj_qkv",), src + "in_proj_qkv.weight", config.conv_dim, h),
        linear(target + ("in_proj_z",), src + "in_proj_z.weight", config.linear_value_dim, h),
        linear(target + ("in_proj_b",), src + "in_proj_b.weight", hv, h),
        linear(target + ("in_proj_a",), src + "in_proj_a.weight", hv, h),
        *gdn_common_rules(config, target, src),
    ]


def gdn_common_rules(config: arch.Config, target: tuple, src: str) -> list[Rule]:
    hv = config.linear_num_value_heads
    return [
        Rule(target + ("conv_weight",), (src + "conv1d.weight",), ((config.conv_dim, 1, config.conv_kernel),), conv_weight),
        vector(target + ("A_log",), src + "A_log", hv),
        vector(target + ("dt_bias",), src + "dt_bias", hv),
        vector(target + ("norm",), src + "norm.weight", config.linear_value_head_dim),
        linear(target + ("out_proj",), src + "out_proj.weight", config.hidden_size, config.linear_value_dim),
    ]


def attention_rules(config: arch.Config, target: tuple, src: str) -> list[Rule]:
    h, d = config.hidden_size, config.head_dim
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    return [
        linear(target + ("q_proj",), src + "q_proj.weight", hq * 2 * d, h),
        linear(target + ("k_proj",), src + "k_proj.weight", hkv * d, h),
        linear(target + ("v_proj",), src + "v_proj.weight", hkv * d, h),
        linear(target + ("o_proj",), src + "o_proj.weight", h, hq * d),
        vector(target + ("q_norm",), src + "q_norm.weight", d),
        vector(target + ("k_norm",), src + "k_norm.weight", d),
    ]


def _stack_gate_up(*weights: np.ndarray) -> np.ndarray:
    """Per-expert gate [I, H] and up [I, H] (interleaved gate0, up0, gate1, up1, ...) -> [E, H, 2I]."""
    gates, ups = weights[0::2], weights[1::2]
    return np.stack([np.concatenate([g.T, u.T], axis=1) for g, u in zip(gates, ups)])


def _stack_down(*weights: np.ndarray) -> np.ndarray:
    """Per-expert down [H, I] -> [E, I, H]."""
    return np.stack([w.T for w in weights])


def _fused_transpose(w: np.ndarray) -> np.ndarray:
    """Fused experts [E, out, in] -> [E, in, out]."""
    return np.ascontiguousarray(np.swapaxes(w, 1, 2))


def mlp_rules(config: arch.Config, mlp_type: str, target: tuple, src: str, reader: CheckpointReader) -> list[Rule]:
    h = config.hidden_size
    if mlp_type == "dense":
        i = config.intermediate_size
        return [
            linear(target + ("gate_proj",), src + "gate_proj.weight", i, h),
            linear(target + ("up_proj",), src + "up_proj.weight", i, h),
            linear(target + ("down_proj",), src + "down_proj.weight", h, i),
        ]
    e, i, s = config.num_experts, config.moe_intermediate_size, config.shared_expert_intermediate_size
    rules = [linear(target + ("router",), src + "gate.weight", e, h)]
    if src + "experts.gate_up_proj" in reader or src + "experts.0.gate_proj.weight" not in reader:
        rules += [
            Rule(target + ("gate_up",), (src + "experts.gate_up_proj",), ((e, 2 * i, h),), _fused_transpose),
            Rule(target + ("down",), (src + "experts.down_proj",), ((e, h, i),), _fused_transpose),
        ]
    else:
        gate_up_names = [src + f"experts.{x}.{kind}_proj.weight" for x in range(e) for kind in ("gate", "up")]
        down_names = [src + f"experts.{x}.down_proj.weight" for x in range(e)]
        rules += [
            Rule(target + ("gate_up",), tuple(gate_up_names), ((i, h),) * (2 * e), _stack_gate_up),
            Rule(target + ("down",), tuple(down_names), ((h, i),) * e, _stack_down),
        ]
    if s:
        rules += [
            linear(target + ("shared_gate_proj",), src + "shared_expert.gate_proj.weight", s, h),
            linear(target + ("shared_up_proj",), src + "shared_expert.up_proj.weight", s, h),
            linear(target + ("shared_down_proj",), src + "shared_expert.down_proj.weight", h, s),
            linear(target + ("shared_expert_gate",), src + "shared_expert_gate.weight", 1, h),
        ]
    return rules


GdnRules = Callable[[arch.Config, tuple, str, CheckpointReader], list[Rule]]


def model_rules(config: arch.Config, reader: CheckpointReader, prefix: str, gdn: GdnRules = gdn_rules) -> list[Rule]:
    """All rules of a Qwen3.5-family checkpoint; `gdn` builds the linear-attention projections' rules."""
    h, v = config.hidden_size, config.vocab_size
    rules = [
        Rule(("embed",), (prefix + "embed_tokens.weight",), ((v, h),)),
        vector(("final_norm",), prefix + "norm.weight", h),
    ]
    if not config.tie_word_embeddings:
        rules.append(linear(("lm_head",), "lm_head.weight", v, h))
    for i in range(config.num_layers):
        src = f"{prefix}layers.{i}."
        target = ("layers", i)
        rules += [
            vector(target + ("input_norm",), src + "input_layernorm.weight", h),
            vector(target + ("post_norm",), src + "post_attention_layernorm.weight", h),
        ]
        if config.layer_types[i] == arch.LINEAR:
            rules += gdn(config, target + ("mixer",), src + "linear_attn.", reader)
        else:
            rules += attention_rules(config, target + ("mixer",), src + "self_attn.")
        rules += mlp_rules(config, config.mlp_types[i], target + ("mlp",), src + "mlp.", reader)
    return rules


def _empty_shared_expert(reader: CheckpointReader, name: str) -> bool:
    """Whether `name` belongs to a zero-width shared expert (shared_expert_intermediate_size 0: transformers still
    writes its empty matrices and its gate, and the expert adds 0)."""
    cut = name.find(".mlp.shared_expert")
    probe = name[:cut] + ".mlp.shared_expert.gate_proj.weight"
    return cut >= 0 and probe in reader and 0 in reader.shape(probe)


def ignored(
    config: arch.Config, skipped: tuple[str, ...] = SKIPPED, reader: CheckpointReader | None = None
) -> Callable[[str], bool]:
    skip = skip_prefixes(*skipped)
    tied = config.tie_word_embeddings  # a tied head duplicated in the file is redundant, not an error
    no_shared = reader is not None and config.num_experts and not config.shared_expert_intermediate_size
    return lambda name: (skip(name) or (tied and name == "lm_head.weight")
                         or bool(no_shared and _empty_shared_expert(reader, name)))


def conversion_with(
    arch_module: Any, reader: CheckpointReader, hf_config: dict, gdn: GdnRules, skipped=SKIPPED
) -> Conversion:
    config = arch_module.config_from_hf(hf_config)
    rules = model_rules(config, reader, language_model_prefix(reader), gdn)
    skipped_names = [n for n in reader.names() if n.startswith(skipped)]
    if skipped_names:
        log.info("skipping %d tensors not used by the text model (%s...)", len(skipped_names), skipped_names[0])
    return Conversion(arch_module, config, rules, ignored(config, skipped, reader))


def conversion(reader: CheckpointReader, hf_config: dict) -> Conversion:
    return conversion_with(arch, reader, hf_config, gdn_rules)


def convert(reader: CheckpointReader, hf_config: dict, dtype: Any) -> tuple[arch.Config, dict]:
    plan = conversion(reader, hf_config)
    return plan.config, build(plan, reader, dtype)
