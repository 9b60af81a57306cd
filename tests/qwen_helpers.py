"""Tiny random Qwen3.5 / Qwen3-Next checkpoints written with transformers, and reference outputs from them.

Sizes are the smallest that still exercise every feature: 2 layers (GDN, then full attention; the multimodal
wrapper keeps the default 4-layer pattern to check `layer_types` defaults), 2 key heads
repeated to 4 value heads, GQA 4/2, partial RoPE (8 of 32 dims), 8 experts top-2 with a shared expert. Every
parameter is perturbed after init so that zero-initialised (1 + w) norms, gates and biases all matter.
"""

from __future__ import annotations

import numpy as np
import torch

VOCAB = 128

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    layer_types=["linear_attention", "full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    initializer_range=0.05,
)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)


def _perturb(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def build(kind: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A random float32 transformers model: dense | moe | moe_wrapper | next."""
    import transformers as tf

    torch.manual_seed(seed)
    if kind == "dense":
        model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(intermediate_size=96, **{**COMMON, **overrides}))
    elif kind == "moe":
        model = tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**{**COMMON, **MOE, **overrides}))
    elif kind == "moe_wrapper":
        config = tf.Qwen3_5MoeConfig(
            text_config={**COMMON, **MOE, "num_hidden_layers": 4, "layer_types": None, **overrides},
            vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64),
        )
        model = tf.Qwen3_5MoeForConditionalGeneration(config)
    elif kind == "next":
        model = tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(intermediate_size=96, **{**COMMON, **MOE, **overrides}))
    else:
        raise ValueError(kind)
    return _perturb(model.float(), seed)


def save(model: torch.nn.Module, path, **kwargs) -> str:
    model.save_pretrained(path, **kwargs)
    return str(path)


def prompt(batch: int = 2, length: int = 24, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, VOCAB, (batch, length)).astype(np.int32)


def reference_logits(model: torch.nn.Module, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


def reference_greedy(model: torch.nn.Module, tokens: np.ndarray, new_tokens: int) -> np.ndarray:
    with torch.no_grad():
        out = model.generate(
            torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.ones(tokens.shape, dtype=torch.long),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[:, tokens.shape[1] :].numpy()


def relative_error(ours, theirs) -> float:
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())
