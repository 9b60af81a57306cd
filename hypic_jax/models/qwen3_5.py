"""Qwen3.5 (dense `qwen3_5_text`, MoE `qwen3_5_moe_text`, multimodal wrappers `qwen3_5` / `qwen3_5_moe`).

A hybrid stack: layer i is Gated DeltaNet ("linear_attention") or gated full attention ("full_attention") as
listed in `layer_types` (by default full iff (i + 1) % 4 == 0); each layer then has a dense SwiGLU MLP or a sparse
MoE. All RMSNorms except the GDN output norm use the zero-centred (1 + w) form. Full attention applies partial
NeoX RoPE to the first `rotary_dim` channels; Qwen3.5's interleaved multi-axis RoPE reduces to 1-D RoPE for text.
Qwen3-Next (`qwen3_next.py`) is the same network (its converter regroups the fused projections), so it reuses
everything here.

Parameters (weights [in, out]):
  embed [V, H], final_norm [H], lm_head [H, V] (absent when tied), layers: list of
  {input_norm [H], post_norm [H], mixer: GDN or attention dict, mlp: dense or MoE dict}.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array
from jax.sharding import PartitionSpec as P

from hypic_jax.core import linear_attn, rope
from hypic_jax.models import mixing, stack as layer_stack, layers
from hypic_jax.models.base import DEFAULT_KERNELS, KernelOptions, KVCache, LinearCache, ModelCache, cache_positions

LINEAR = "linear_attention"
FULL = "full_attention"


@dataclasses.dataclass(frozen=True)
class Config:
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    mlp_types: tuple[str, ...]  # per layer: "dense" or "moe"
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    # full attention
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    rotary_dim: int = 64
    rope_theta: float = 10_000_000.0
    # Gated DeltaNet
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    conv_kernel: int = 4
    # MLPs
    intermediate_size: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim


def text_config(hf_config: dict) -> dict:
    """The language-model part of a HF config (multimodal wrappers keep it under text_config)."""
    return hf_config.get("text_config") or hf_config


def rope_settings(hf: dict, head_dim: int) -> tuple[int, float]:
    """(rotary_dim, theta) from either `rope_parameters` (transformers 5) or top-level keys (older configs)."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ValueError(f"unsupported rope_type {rope_type!r} (only default / text-only mrope are implemented)")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    factor = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    rotary_dim = int(head_dim * factor)
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"partial_rotary_factor {factor} rotates {rotary_dim} of head_dim {head_dim} channels; "
                         "only an even, non-zero number is supported")
    return rotary_dim, float(theta)


def default_layer_types(num_layers: int, interval: int = 4) -> tuple[str, ...]:
    return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers))


def _required(hf: dict, name: str) -> Any:
    """A size the config must state: the defaults of transformers' config classes differ between Qwen3.5 dense,
    Qwen3.5 MoE and Qwen3-Next, so a missing one is refused by name rather than guessed."""
    if hf.get(name) is None:
        raise ValueError(f"config.json does not set {name!r}, which Qwen3.5 / Qwen3-Next need")
    return hf[name]


def config_from_hf(hf_config: dict) -> Config:
    hf = text_config(hf_config)
    num_layers = _required(hf, "num_hidden_layers")
    layer_types = tuple(hf.get("layer_types") or default_layer_types(num_layers, hf.get("full_attention_interval", 4)))
    if len(layer_types) != num_layers or not set(layer_types) <= {LINEAR, FULL}:
        raise ValueError(f"layer_types must list {num_layers} of {LINEAR!r}/{FULL!r}, got {layer_types}")
    num_experts = hf.get("num_experts", 0) or 0
    if num_experts:
        sparse_step = hf.get("decoder_sparse_step", 1) or 1
        dense_layers = set(hf.get("mlp_only_layers") or ())
        mlp_types = tuple(
            "moe" if i not in dense_layers and (i + 1) % sparse_step == 0 else "dense" for i in range(num_layers)
        )
    else:
        mlp_types = ("dense",) * num_layers
    head_dim = hf.get("head_dim") or _required(hf, "hidden_size") // _required(hf, "num_attention_heads")
    rotary_dim, theta = rope_settings(hf, head_dim)
    if hf.get("attention_bias"):
        raise ValueError("attention_bias=True is not supported for Qwen3.5 / Qwen3-Next")
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):  # the MLPs' and the GDN conv's activation
        raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported for Qwen3.5 / Qwen3-Next (only silu)")
    return Config(
        vocab_size=_required(hf, "vocab_size"),
        hidden_size=_required(hf, "hidden_size"),
        layer_types=layer_types,
        mlp_types=mlp_types,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        # transformers ties by the config of the model class it builds: the wrapper's for multimodal checkpoints
        tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        num_attention_heads=_required(hf, "num_attention_heads"),
        num_key_value_heads=_required(hf, "num_key_value_heads"),
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        rope_theta=theta,
        linear_num_key_heads=_required(hf, "linear_num_key_heads"),
        linear_num_value_heads=_required(hf, "linear_num_value_heads"),
        linear_key_head_dim=_required(hf, "linear_key_head_dim"),
        linear_value_head_dim=_required(hf, "linear_value_head_dim"),
        conv_kernel=hf.get("linear_conv_kernel_dim", 4),
        intermediate_size=hf.get("intermediate_size", 0) or 0,
        num_experts=num_experts,
        num_experts_per_tok=hf.get("num_experts_per_tok", 0) or 0,
        moe_intermediate_size=hf.get("moe_intermediate_size", 0) or 0,
        shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 0) or 0,
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
    )


# ----------------------------------------------------------------------------------------------------------------
# Parameter shapes, init and sharding (one table drives all three)


def _mixer_shapes(config: Config, layer_type: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, kind) with kind in matrix / zeros (1+w norm) / ones / A_log / dt_bias."""
    h = config.hidden_size
    if layer_type == LINEAR:
        hv = config.linear_num_value_heads
        return {
            "in_proj_qkv": ((h, config.conv_dim), "col"),
            "in_proj_z": ((h, config.linear_value_dim), "col"),
            "in_proj_b": ((h, hv), "col"),
            "in_proj_a": ((h, hv), "col"),
            "conv_weight": ((config.conv_dim, config.conv_kernel), "conv"),
            "A_log": ((hv,), "A_log"),
            "dt_bias": ((hv,), "dt_bias"),
            "norm": ((config.linear_value_head_dim,), "ones"),
            "out_proj": ((config.linear_value_dim, h), "row"),
        }
    d = config.head_dim
    return {
        "q_proj": ((h, config.num_attention_heads * 2 * d), "col"),
        "k_proj": ((h, config.num_key_value_heads * d), "col"),
        "v_proj": ((h, config.num_key_value_heads * d), "col"),
        "o_proj": ((config.num_attention_heads * d, h), "row"),
        "q_norm": ((d,), "zeros"),
        "k_norm": ((d,), "zeros"),
    }


# The weights Qwen's block-wise FP8 checkpoints quantize (the projections, the experts and the shared expert); the
# GDN's a / b projections, the router, the shared expert's gate, the convs, norms, embedding and head stay bf16.
FP8_LEAVES = ("in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
              "down_proj", "gate_up", "down", "shared_gate_proj", "shared_up_proj", "shared_down_proj")


def _mlp_shapes(config: Config, mlp_type: str) -> dict[str, tuple[tuple[int, ...], str]]:
    h = config.hidden_size
    if mlp_type == "dense":
        i = config.intermediate_size
        return {"gate_proj": ((h, i), "col"), "up_proj": ((h, i), "col"), "down_proj": ((i, h), "row")}
    e, i, s = config.num_experts, config.moe_intermediate_size, config.shared_expert_intermediate_size
    shapes = {
        "router": ((h, e), "replicated"),
        "gate_up": ((e, h, 2 * i), "experts"),
        "down": ((e, i, h), "experts"),
    }
    if s:
        shapes.update(
            shared_gate_proj=((h, s), "col"),
            shared_up_proj=((h, s), "col"),
            shared_down_proj=((s, h), "row"),
            shared_expert_gate=((h, 1), "replicated"),
        )
    return shapes


def _shape_table(config: Config) -> dict:
    h, v = config.hidden_size, config.vocab_size
    table = {"embed": ((v, h), "embed"), "final_norm": ((h,), "zeros")}
    if not config.tie_word_embeddings:
        table["lm_head"] = ((h, v), "col")
    table["layers"] = [
        {
            "input_norm": ((h,), "zeros"),
            "post_norm": ((h,), "zeros"),
            "mixer": _mixer_shapes(config, config.layer_types[i]),
            "mlp": _mlp_shapes(config, config.mlp_types[i]),
        }
        for i in range(config.num_layers)
    ]
    return table


def _is_entry(x) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], str)


_FLOAT32_KINDS = ("A_log", "dt_bias")


def init_params(config: Config, key: Array, dtype: Any = jnp.bfloat16) -> dict:
    """Random parameters (normal(0, 0.02) matrices, reference-style gates and norms). A_log, dt_bias stay float32."""
    table = _shape_table(config)
    entries, treedef = jax.tree.flatten(table, is_leaf=_is_entry)
    keys = jax.random.split(key, len(entries))

    def make(k, entry):
        shape, kind = entry
        if kind == "zeros":
            return jnp.zeros(shape, dtype)
        if kind == "ones":
            return jnp.ones(shape, dtype)
        if kind == "A_log":
            return jnp.log(jax.random.uniform(k, shape, jnp.float32, 1.0, 16.0))
        if kind == "dt_bias":
            return jnp.ones(shape, jnp.float32)
        if kind == "conv":
            return (jax.random.normal(k, shape, jnp.float32) / math.sqrt(shape[1])).astype(dtype)
        return (0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype)

    return jax.tree.unflatten(treedef, [make(k, e) for k, e in zip(keys, entries)])


_SPECS = {
    "col": P(None, "model"),
    "row": P("model", None),
    "embed": P(None, "model"),
    "conv": P("model", None),
    "experts": P("model", None, None),
    "A_log": P("model"),
    "dt_bias": P("model"),
    "zeros": P(),
    "ones": P(),
    "replicated": P(),
}


def param_specs(config: Config) -> dict:
    """PartitionSpecs for a ("data", "model") mesh: Megatron-style column/row splits of projections over "model",
    experts split over "model" (expert parallel), norms and routers replicated, everything replicated over "data"."""
    return jax.tree.map(lambda e: _SPECS[e[1]], _shape_table(config), is_leaf=_is_entry)


def cache_specs(config: Config) -> ModelCache:
    """PartitionSpecs of `init_cache`'s tree: batch over "data"; linear states and conv tails split by value head /
    channel over "model" (like the projections that produce them); KV replicated over "model" (2 KV heads)."""
    entries = []
    for layer_type in config.layer_types:
        if layer_type == LINEAR:
            entries.append(LinearCache(state=P("data", "model"), conv=P("data", None, "model")))
        else:
            entries.append(KVCache(k=P("data"), v=P("data")))
    return ModelCache(layers=tuple(entries), length=P())


# ----------------------------------------------------------------------------------------------------------------
# Layers


def gdn_projections(x: Array, p: dict, config: Config) -> tuple[Array, Array, Array, Array]:
    """The GDN input projections of x [..., H]: (pre-conv [q|k|v] [..., conv_dim], z [..., Hv, Dv], a, b [..., Hv])."""
    mixed = x @ p["in_proj_qkv"]  # conv runs over q, k, v only
    z = (x @ p["in_proj_z"]).reshape(*x.shape[:-1], config.linear_num_value_heads, config.linear_value_head_dim)
    # a and b (one value per head each) as one product: two [H, Hv] products would be two launches of a few
    # microseconds' work each (the span program is compiled without XLA's dot merger, see hypic_jax.engine)
    a, b = jnp.split(x @ jnp.concatenate([p["in_proj_a"], p["in_proj_b"]], axis=1), 2, axis=-1)
    return mixed, z, a, b


def gdn_inputs(conv_out: Array, a: Array, b: Array, p: dict, config: Config,
               repeat_heads: bool = True) -> linear_attn.LinearInputs:
    """One sequence's recurrence inputs from the post-conv [q|k|v] [L, conv_dim] and the gates' a, b [L, Hv]
    (q, k repeated to the value heads unless `repeat_heads` is False)."""
    length = conv_out.shape[0]
    q, k, v = jnp.split(conv_out, [config.linear_key_dim, 2 * config.linear_key_dim], axis=-1)
    hk, dk = config.linear_num_key_heads, config.linear_key_head_dim
    q, k = q.reshape(length, hk, dk), k.reshape(length, hk, dk)
    v = v.reshape(length, config.linear_num_value_heads, config.linear_value_head_dim)
    return linear_attn.gated_delta_net(q, k, v, a=a, b=b, A_log=p["A_log"], dt_bias=p["dt_bias"],
                                       repeat_heads=repeat_heads)


def gdn_output(core: Array, z: Array, p: dict, config: Config) -> Array:
    """Core outputs [..., Hv, Dv] -> mixer output [..., H]: gated RMSNorm with z, then out_proj."""
    normed = layers.gated_rms_norm(core, z, p["norm"], config.rms_norm_eps)
    return normed.reshape(*core.shape[:-2], config.linear_value_dim) @ p["out_proj"]


def gdn_mixer(x: Array, p: dict, config: Config, mix) -> Array:
    """The Gated DeltaNet mixer on x [B, L, H] (normed) in a `mixing` context: projections, short conv, the delta
    rule's core, gated RMSNorm and out_proj."""
    mixed, z, a, b = gdn_projections(x, p, config)
    mixed = mix.conv(mixed, p["conv_weight"])
    inputs = jax.vmap(lambda m, a, b: gdn_inputs(m, a, b, p, config, repeat_heads=False))(mixed, a, b)
    return gdn_output(mix.linear(inputs).astype(x.dtype), z, p, config)


def attention_projections(x: Array, p: dict, config: Config, positions: Array) -> tuple[Array, Array, Array, Array]:
    """q, k (normed, RoPE'd at `positions` [L]), v [B, L, H, D] and the output gate [B, L, Hq*D] of x [B, L, H]."""
    q, k, v, gate = layers.gated_attention_projections(
        x, p, num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim, eps=config.rms_norm_eps, norm_offset=1.0,
    )
    q = layers.rope_batch(q, positions, rotary_dim=config.rotary_dim, base=config.rope_theta)
    k = layers.rope_batch(k, positions, rotary_dim=config.rotary_dim, base=config.rope_theta)
    return q, k, v, gate


def attention_output(attended: Array, gate: Array, p: dict) -> Array:
    """Attention outputs [..., Hq, D] -> mixer output: sigmoid output gate, then o_proj."""
    attended = attended.reshape(*attended.shape[:-2], -1) * jax.nn.sigmoid(gate)
    return attended @ p["o_proj"]


def attention_mixer(x: Array, p: dict, config: Config, mix) -> Array:
    """Gated full attention on x [B, L, H] (normed) in a `mixing` context: q/k norm, partial RoPE at the fresh
    tokens' positions, GQA over the keys the context gives (cached keys moved by their pieces' offsets), sigmoid
    output gate."""
    q, k, v, gate = attention_projections(x, p, config, mix.positions)
    rotate = lambda kv, offset: KVCache(  # noqa: E731
        rope.rotate_keys(kv.k, offset, rotary_dim=config.rotary_dim, base=config.rope_theta), kv.v)
    keys = mix.keys(KVCache(k=k, v=v), rotate=rotate)
    return attention_output(mix.attend(q, keys.k, keys.v, scale=config.head_dim**-0.5), gate, p)


def feed_forward(x: Array, p: dict, config: Config, mlp_type: str, valid: Array | None = None,
                 kernels: KernelOptions = DEFAULT_KERNELS) -> Array:
    """The layer's MLP; valid (a mask of x's leading axes, or None): the MoE skips routed work outside it."""
    if mlp_type == "dense":
        return layers.swiglu(x, p["gate_proj"], p["up_proj"], p["down_proj"])
    return layers.qwen_moe(
        x, p, top_k=config.num_experts_per_tok, renormalize=config.norm_topk_prob, impl=kernels.moe,
        valid=valid,
    )


# ----------------------------------------------------------------------------------------------------------------
# Model


def init_cache(config: Config, batch: int, max_len: int, dtype: Any = jnp.bfloat16) -> ModelCache:
    entries = []
    for layer_type in config.layer_types:
        if layer_type == LINEAR:
            state = jnp.zeros(
                (batch, config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim),
                jnp.float32,
            )
            entries.append(LinearCache(state, jnp.zeros((batch, config.conv_kernel - 1, config.conv_dim), dtype)))
        else:
            shape = (batch, max_len, config.num_key_value_heads, config.head_dim)
            entries.append(KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)))
    return ModelCache(layers=tuple(entries), length=jnp.zeros((), jnp.int32))


def mixer_block(i: int, layer, lp: dict, x: Array, mix, config: Config) -> Array:
    """The first half of layer `i` on x [B, L, H] in a `mixing` context: x + mixer(norm(x))."""
    h = layers.rms_norm(x, lp["input_norm"], config.rms_norm_eps, offset=1.0)
    mixer = gdn_mixer if config.layer_types[i] == LINEAR else attention_mixer
    return x + mixer(h, lp["mixer"], config, mix)


def mlp_block(i: int, lp: dict, x: Array, valid: Array | None, kernels: KernelOptions, config: Config) -> Array:
    """The second half of layer `i`, token by token: x + mlp(norm(x)) (`valid`: the MoE's real tokens)."""
    h = layers.rms_norm(x, lp["post_norm"], config.rms_norm_eps, offset=1.0)
    return x + feed_forward(h, lp["mlp"], config, config.mlp_types[i], valid, kernels)


def block(i: int, layer, lp: dict, x: Array, mix, config: Config) -> Array:
    """Layer `i` (its static structure; `layer` its own index, unused here) on x [B, L, H] in a `mixing` context:
    x + mixer(norm(x)), then + mlp(norm(.)). Every forward of the model runs this body."""
    x = mixer_block(i, layer, lp, x, mix, config)
    return mlp_block(i, lp, x, mix.valid, mix.kernels, config)


def final_logits(params: dict, config: Config, x: Array) -> Array:
    """float32 logits of the last layer's outputs x [..., H]: the final norm, then the LM head."""
    return lm_head(params, config, layers.rms_norm(x, params["final_norm"], config.rms_norm_eps, offset=1.0))


def hidden_states(
    params: dict, config: Config, tokens: Array, cache: ModelCache | None = None, *, fresh: bool = False,
    kernels: KernelOptions = DEFAULT_KERNELS,
) -> tuple[Array, ModelCache | None]:
    """Final-normed hidden states [B, L, H] (before the LM head) and the updated cache (its layers in the form
    given: a `layer_stack.LayerStack` for a stacked model's decode caches, see `layer_stack.run`).

    fresh=True promises that `cache` is empty (length 0), which lets full attention use the causal kernel.
    """
    length = tokens.shape[1]
    x, new_layers = mixing.run_causal(
        functools.partial(block, config=config), params["embed"][tokens], params["layers"],
        None if cache is None else cache.layers, positions=cache_positions(cache, length),
        start=None if cache is None else cache.length, fresh=fresh, kernels=kernels, keep=cache is not None)
    x = layers.rms_norm(x, params["final_norm"], config.rms_norm_eps, offset=1.0)
    new_cache = None if cache is None else ModelCache(new_layers, cache.length + length)
    return x, new_cache


def lm_head(params: dict, config: Config, x: Array) -> Array:
    """float32 logits of hidden states x [..., H] (`layers.logits`)."""
    return layers.logits(x, params["embed"].T if config.tie_word_embeddings else params["lm_head"])


def forward(
    params: dict, config: Config, tokens: Array, cache: ModelCache | None = None, *,
    kernels: KernelOptions = DEFAULT_KERNELS,
) -> tuple[Array, ModelCache | None]:
    """Logits float32 [B, L, vocab] for int32 tokens [B, L] (continuing `cache` when given) and the new cache."""
    x, new_cache = hidden_states(params, config, tokens, cache, kernels=kernels)
    return lm_head(params, config, x), new_cache


def prefill(params: dict, config: Config, tokens: Array, max_len: int, *,
            kernels: KernelOptions = DEFAULT_KERNELS) -> tuple[Array, ModelCache]:
    """Prefill a fresh prompt: (logits of the last position, float32 [B, vocab]; caches sized for max_len tokens).

    Only the last position goes through the LM head (a full [B, L, vocab] float32 logit tensor would be GBs at long
    L), and full attention runs the causal kernel instead of attending to an empty cache.
    """
    batch = tokens.shape[0]
    dtype = params["embed"].dtype
    empty = init_cache(config, batch, max_len, dtype)
    cache = ModelCache(layer_stack.stacked_like(params["layers"], empty.layers), empty.length)
    x, cache = hidden_states(params, config, tokens, cache, fresh=True, kernels=kernels)
    return lm_head(params, config, x[:, -1]), cache


# ----------------------------------------------------------------------------------------------------------------
# Span forward over a layout held as data (hypic_jax.stitch.layout, hypic_jax.stitch): one program per capacity


def pool_layout(config: Config, dtype: Any) -> list[tuple[str, Any]]:
    """Per layer the piece a cache entry keeps in the pools (`hypic_jax.cache.pools.Pools`): a GDN layer's dense
    summary and conv tail per slot, a full-attention layer's canonical K and V per token."""
    sds = jax.ShapeDtypeStruct
    out = []
    for layer_type in config.layer_types:
        if layer_type == LINEAR:
            hv, dk, dv = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
            summary = linear_attn.Summary("dense", sds((hv, dk, dv), jnp.float32), sds((hv, dk, dk), jnp.float32))
            out.append(("slot", dict(summary=summary, conv=sds((config.conv_kernel - 1, config.conv_dim), dtype))))
        else:
            kv = sds((config.num_key_value_heads, config.head_dim), dtype)
            out.append(("token", dict(k=kv, v=kv)))
    return out


def span_forward_arrays(params: dict, config: Config, layout, pools: tuple, *, isolated: bool, summaries: bool,
                        want_decode: bool = False, kernels: KernelOptions = DEFAULT_KERNELS,
                        want_hidden: bool = False):
    """One forward over the fresh tokens of `layout` (a `hypic_jax.stitch.layout.LayoutArrays`), reading cached entries
    from `pools` (a `layer_stack.PoolStack` of `pool_layout`'s pieces, or per layer its pool) and returning the
    layout's records as writes into them (`mixing.run_layout`). With `params["layers"]` a `layer_stack.LayerStack`,
    the repeating layers run as one scan.

    isolated: a cold prefill (every span from position 0, no mixing across spans). summaries: compute each fresh
    piece's own summary (PIC stitching and cold prefills). HYPIC's ladder (dropped transfers, keys left at their
    canonical phase) is data of the layout. kernels: how the GDN cores, their fold over the pieces, the
    transfer products and the experts run (`base.KernelOptions`). Returns (float32 logits [vocab] of the last fresh
    token, per pool part the rows to write into it (`stitch.RowWrites`, applied by the caller), the decode caches
    of the whole request (per layer; stacked as `layer_stack.run` returns them, the form the decode step takes) or
    None), and with want_hidden every layer's output [layers, F, H] (`Engine.diagnose`).
    """
    x, writes, decode, hidden = mixing.run_layout(
        functools.partial(block, config=config), params["embed"][layout.tokens], params["layers"], layout, pools,
        isolated=isolated, summaries=summaries, want_decode=want_decode, want_hidden=want_hidden, kernels=kernels)
    last = layers.rms_norm(x[layout.last], params["final_norm"], config.rms_norm_eps, offset=1.0)
    out = (lm_head(params, config, last), writes, decode)
    return out + (hidden,) if want_hidden else out
