"""Export `hypic_jax.models.qwen3_5` params (dense MLPs) as a Hugging Face folder: model.safetensors,
config.json (model_type qwen3_5_text, which transformers' Qwen3_5ForCausalLM loads), generation_config.json,
tokenizer.json and tokenizer_config.json. The inverse of `hypic_jax.checkpoint.hf.qwen3_5` for text-only checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from hypic_jax.models import qwen3_5 as arch
from hypic_jax.train import tokenizer as tok

MAX_BYTES = 20 * 1024 * 1024
_KEEP_FLOAT32 = ("A_log", "dt_bias")  # stored as the model keeps them: float32, also in a bfloat16 export


def hf_tensors(params: dict, config: arch.Config) -> dict[str, np.ndarray]:
    """Our params -> Hugging Face tensor names and layouts (weights [out, in], depthwise conv [D, 1, W])."""
    if any(t != "dense" for t in config.mlp_types):
        raise ValueError("export handles dense MLPs only")
    t = lambda x: np.asarray(x).T  # noqa: E731
    out = {"model.embed_tokens.weight": np.asarray(params["embed"]), "model.norm.weight": np.asarray(params["final_norm"])}
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = t(params["lm_head"])
    for i, layer in enumerate(params["layers"]):
        src = f"model.layers.{i}."
        out[src + "input_layernorm.weight"] = np.asarray(layer["input_norm"])
        out[src + "post_attention_layernorm.weight"] = np.asarray(layer["post_norm"])
        m = layer["mixer"]
        if config.layer_types[i] == arch.LINEAR:
            p = src + "linear_attn."
            for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
                out[p + name + ".weight"] = t(m[name])
            conv = np.asarray(m["conv_weight"])
            out[p + "conv1d.weight"] = conv.reshape(conv.shape[0], 1, conv.shape[1])
            out[p + "A_log"] = np.asarray(m["A_log"])
            out[p + "dt_bias"] = np.asarray(m["dt_bias"])
            out[p + "norm.weight"] = np.asarray(m["norm"])
        else:
            p = src + "self_attn."
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                out[p + name + ".weight"] = t(m[name])
            out[p + "q_norm.weight"] = np.asarray(m["q_norm"])
            out[p + "k_norm.weight"] = np.asarray(m["k_norm"])
        for name in ("gate_proj", "up_proj", "down_proj"):
            out[src + "mlp." + name + ".weight"] = t(layer["mlp"][name])
    return out


def hf_config(config: arch.Config, dtype: str, special: dict[str, int] | None = None,
              max_position_embeddings: int = 32768) -> dict:
    factor = config.rotary_dim / config.head_dim
    if int(config.head_dim * factor) != config.rotary_dim:  # what converters' rope_settings computes back
        raise ValueError(f"rotary_dim {config.rotary_dim} is not recoverable from head_dim {config.head_dim}")
    special = special or {}
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": special.get(tok.EOS),
        "pad_token_id": special.get(tok.PAD),
        "dtype": dtype,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "layer_types": list(config.layer_types),
        "linear_conv_kernel_dim": config.conv_kernel,
        "linear_key_head_dim": config.linear_key_head_dim,
        "linear_num_key_heads": config.linear_num_key_heads,
        "linear_num_value_heads": config.linear_num_value_heads,
        "linear_value_head_dim": config.linear_value_head_dim,
        "max_position_embeddings": max_position_embeddings,
        "num_attention_heads": config.num_attention_heads,
        "num_hidden_layers": config.num_layers,
        "num_key_value_heads": config.num_key_value_heads,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": {"partial_rotary_factor": factor,
                            "rope_theta": config.rope_theta, "rope_type": "default"},
        "tie_word_embeddings": config.tie_word_embeddings,
        "use_cache": True,
        "vocab_size": config.vocab_size,
    }


def export_folder(params: dict, config: arch.Config, tokenizer, out: str | Path, dtype: str = "bfloat16",
                  max_bytes: int | None = MAX_BYTES, max_position_embeddings: int = 32768) -> Path:
    """Write the folder; raises when the weights exceed max_bytes (the embedded model's budget)."""
    from safetensors.flax import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, value in hf_tensors(params, config).items():
        keep = name.rsplit(".", 1)[-1] in _KEEP_FLOAT32
        tensors[name] = jnp.asarray(value, jnp.float32 if keep else jnp.dtype(dtype))
    size = sum(v.size * v.dtype.itemsize for v in tensors.values())
    if max_bytes is not None and size > max_bytes:
        raise ValueError(f"the weights take {size / 2**20:.1f} MiB, over the budget of {max_bytes / 2**20:.1f} MiB")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    special = tok.special_ids(tokenizer) if tokenizer is not None else {}
    (out / "config.json").write_text(json.dumps(hf_config(config, dtype, special, max_position_embeddings), indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": special.get(tok.EOS), "pad_token_id": special.get(tok.PAD), "do_sample": False}, indent=2))
    if tokenizer is not None:
        tokenizer.save(str(out / "tokenizer.json"))
        (out / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tok.EOS, "pad_token": tok.PAD,
             "additional_special_tokens": [tok.DOC, tok.QUESTION, tok.ANSWER], "chat_template": tok.CHAT_TEMPLATE},
            indent=2))
    return out
