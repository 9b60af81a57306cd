"""Qwen3-Next Hugging Face checkpoints -> `hypic_jax.models.qwen3_next` params.

Qwen3-Next fuses the GDN input projections and groups them per key head: for each of the H_k key heads,
`in_proj_qkvz` rows are [q (Dk) | k (Dk) | v (r Dv) | z (r Dv)] and `in_proj_ba` rows are [b (r) | a (r)], with
r = H_v / H_k value heads per key head. Ungrouping gives exactly Qwen3.5's separate in_proj_qkv ([all q | all k |
all v]), in_proj_z, in_proj_b, in_proj_a, with value heads in the same order (key head g owns value heads
g r .. g r + r - 1), which is also the order of the conv1d channels.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hypic_jax.checkpoint.hf import qwen3_5 as base_qwen
from hypic_jax.checkpoint.hf.base import CheckpointReader, Conversion, Rule, build, transpose
from hypic_jax.models import qwen3_next as arch


def _split_groups(config: arch.Config, qkvz: np.ndarray) -> tuple[np.ndarray, ...]:
    """Grouped in_proj_qkvz [H_k (2 Dk + 2 r Dv), H] -> q, k [H_k Dk, H] and v, z [H_v Dv, H]."""
    hk, dk, dv = config.linear_num_key_heads, config.linear_key_head_dim, config.linear_value_head_dim
    r = config.linear_num_value_heads // hk
    grouped = qkvz.reshape(hk, 2 * dk + 2 * r * dv, qkvz.shape[-1])
    cuts = np.cumsum([dk, dk, r * dv])
    q, k, v, z = np.split(grouped, cuts, axis=1)
    return tuple(part.reshape(-1, qkvz.shape[-1]) for part in (q, k, v, z))


def gdn_rules(config: arch.Config, target: tuple, src: str, reader: CheckpointReader) -> list[Rule]:
    h, hv, hk = config.hidden_size, config.linear_num_value_heads, config.linear_num_key_heads
    r = hv // hk
    qkvz_shape = (2 * config.linear_key_dim + 2 * config.linear_value_dim, h)
    qkvz, ba = src + "in_proj_qkvz.weight", src + "in_proj_ba.weight"

    def qkv(w):
        q, k, v, _ = _split_groups(config, w)
        return transpose(np.concatenate([q, k, v], axis=0))

    def z(w):
        return transpose(_split_groups(config, w)[3])

    def b(w):
        return transpose(w.reshape(hk, 2 * r, h)[:, :r].reshape(hv, h))

    def a(w):
        return transpose(w.reshape(hk, 2 * r, h)[:, r:].reshape(hv, h))

    return [
        Rule(target + ("in_proj_qkv",), (qkvz,), (qkvz_shape,), qkv),
        Rule(target + ("in_proj_z",), (qkvz,), (qkvz_shape,), z),
        Rule(target + ("in_proj_b",), (ba,), ((2 * hv, h),), b),
        Rule(target + ("in_proj_a",), (ba,), ((2 * hv, h),), a),
        *base_qwen.gdn_common_rules(config, target, src),
    ]


def conversion(reader: CheckpointReader, hf_config: dict) -> Conversion:
    return base_qwen.conversion_with(arch, reader, hf_config, gdn_rules)


def convert(reader: CheckpointReader, hf_config: dict, dtype: Any) -> tuple[arch.Config, dict]:
    plan = conversion(reader, hf_config)
    return plan.config, build(plan, reader, dtype)
