"""Kimi-Linear (Hugging Face `model_type` "kimi_linear"): KDA linear-attention layers, NoPE MLA layers and MoE MLPs.

Every decoder layer is pre-norm: x + mixer(rmsnorm(x)), then + mlp(rmsnorm(.)). The mixer is either

* KDA (Kimi Delta Attention, `layer_types[i] == "linear_attention"`): q/k/v projections, one depthwise causal
  conv (kernel 4, SiLU) over [q|k|v], l2-normalised q/k, a per-key-channel forget gate
  gk = -exp(A_log_h) softplus(f_b(f_a(x)) + dt_bias) from a low-rank projection, beta = sigmoid(b_proj(x)), the
  recurrence S_t = (I - beta k k^T) Diag(exp(gk)) S_{t-1} + beta k v^T through `hypic_jax.core.linear_attn`, and an
  output norm gated by sigmoid(g_b(g_a(x))) per head;
* MLA without RoPE (`"full_attention"`): DeepSeek-V2 style low-rank q (optional) and kv projections with RMSNorms
  on the latents. The "rope" slice of the key is a single head shared by all heads, but no rotation is ever applied,
  so keys (and the cached latent) do not depend on position at all.

The MLP is a dense SwiGLU for the first layers (`mlp_types[i] == "dense"`) and otherwise a MoE with a sigmoid router,
an expert-score correction bias used for choosing only, group-limited top-k (a group's score is the sum of its top
two biased scores), optional renormalisation, a routed scaling factor and always-on shared experts.

Parameters are a plain dict PyTree with matrices stored [in, out]. All functions are pure and batch-first
([B, L, ...]); the linear-attention core is one-sequence-per-call and is vmapped over the batch.

Caches. `forward(..., cache=None)` is the plain causal forward; it also returns the per-layer caches of the tokens
it saw (KDA: recurrent state [B, H, K, V] float32 and conv tail [B, W-1, 3*H*K]; MLA: the normalised kv latent
[B, L, r] and the shared rope key [B, L, dr]). For decoding, `init_cache` makes fixed-size buffers (MLA latents of
`max_len` tokens, a shared write position) that `forward(..., cache=...)` fills and advances under jit;
`prefill` / `decode_cache` build them from a cache-free forward. Caching the MLA latent instead of expanded K/V
keeps entries ~18x smaller at the released shape and position-independent; single-token decode reads it in the
"absorbed" form (queries mapped into the latent space), so a step never re-expands the whole context.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array
from jax.sharding import PartitionSpec as P

from hypic_jax.core import linear_attn
from hypic_jax.models import base, mixing, stack as layer_stack, layers

MODEL_TYPE = "kimi_linear"
LINEAR, FULL = "linear_attention", "full_attention"
DENSE, SPARSE = "dense", "sparse"

# Latent RMSNorms inside MLA are built without an eps argument in the reference, so they use the class default.
MLA_LATENT_NORM_EPS = 1e-6

# The weights a block-wise FP8 checkpoint holds in FP8 (every `x @ w` projection and the experts); the low-rank
# forget / output gates (f_a, f_b, g_a, g_b), b_proj, MLA's kv_b (reshaped per head, not multiplied as a
# matrix), the router, convs, norms, biases, embedding and head stay unquantized.
FP8_LEAVES = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a", "q_b", "kv_a", "gate", "up", "down", "gate_up")


@dataclasses.dataclass(frozen=True)
class KimiLinearConfig:
    """Architecture numbers (hashable, so it can be a static argument of jit)."""

    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    mlp_types: tuple[str, ...]
    intermediate_size: int
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    # KDA
    linear_num_heads: int = 32
    linear_head_dim: int = 128
    conv_kernel: int = 4
    # MLA
    num_heads: int = 32
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    attention_bias: bool = False
    # MoE
    moe_intermediate_size: int = 1024
    num_experts: int = 256
    num_experts_per_tok: int = 8
    num_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.446

    def __post_init__(self):
        if len(self.layer_types) != len(self.mlp_types):
            raise ValueError(f"{len(self.layer_types)} layer_types but {len(self.mlp_types)} mlp_types")
        for kind in self.layer_types:
            if kind not in (LINEAR, FULL):
                raise ValueError(f"unknown layer type {kind!r} (expected {LINEAR!r} or {FULL!r})")
        for kind in self.mlp_types:
            if kind not in (DENSE, SPARSE):
                raise ValueError(f"unknown mlp type {kind!r} (expected {DENSE!r} or {SPARSE!r})")
        if SPARSE in self.mlp_types and self.num_experts % self.n_group:
            raise ValueError(f"num_experts={self.num_experts} is not divisible by n_group={self.n_group}")

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def linear_dim(self) -> int:
        return self.linear_num_heads * self.linear_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "KimiLinearConfig":
        """From a Hugging Face config.json dict: the transformers layout or the original checkpoint's.

        The original checkpoints keep the KDA numbers in `linear_attn_config` (1-indexed `full_attn_layers` /
        `kda_layers`) and dense layers in `first_k_dense_replace`; transformers writes `layer_types` /
        `mlp_layer_types` and some renamed keys (num_experts, num_experts_per_token, ...). Precedence follows
        transformers: explicit lists, then `linear_attn_config`, then defaults.
        """
        if hf.get("model_type", MODEL_TYPE) != MODEL_TYPE:
            raise ValueError(f"expected model_type {MODEL_TYPE!r}, got {hf.get('model_type')!r}")

        def pick(*names, default=None):
            for name in names:
                if hf.get(name) is not None:
                    return hf[name]
            return default

        act = pick("hidden_act", default="silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"kimi_linear: hidden_act {act!r} is not supported (only silu)")
        router_act = pick("moe_router_activation_func", default="sigmoid")
        if router_act != "sigmoid":
            raise ValueError(f"kimi_linear: moe_router_activation_func {router_act!r} is not supported (only sigmoid)")
        num_layers = int(hf["num_hidden_layers"])
        lin = hf.get("linear_attn_config") or {}
        layer_types = hf.get("layer_types")
        if layer_types is None:
            if "full_attn_layers" in lin and "kda_layers" in lin:
                layer_types = [None] * num_layers
                for i in lin["full_attn_layers"]:
                    layer_types[i - 1] = FULL
                for i in lin["kda_layers"]:
                    layer_types[i - 1] = LINEAR
                if None in layer_types:
                    raise ValueError(f"kimi_linear: linear_attn_config leaves layer {layer_types.index(None)} untyped")
            else:
                layer_types = [FULL if i and i % 4 == 0 else LINEAR for i in range(num_layers)]
        mlp_types = hf.get("mlp_layer_types")
        if mlp_types is None:
            first_dense = int(pick("first_k_dense_replace", default=1))
            mlp_types = [DENSE if i < first_dense else SPARSE for i in range(num_layers)]
        if len(layer_types) != num_layers or len(mlp_types) != num_layers:
            raise ValueError(f"kimi_linear: layer type lists do not have num_hidden_layers={num_layers} entries")
        heads = int(hf.get("num_attention_heads", 32))
        kv_heads = pick("num_key_value_heads", default=heads)
        if kv_heads != heads:  # the reference expands kv_b_proj to all heads; other values break it there too
            raise ValueError(f"kimi_linear: num_key_value_heads={kv_heads} must equal num_attention_heads={heads}")
        return cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            layer_types=tuple(layer_types),
            mlp_types=tuple(mlp_types),
            intermediate_size=int(hf["intermediate_size"]),
            rms_norm_eps=float(pick("rms_norm_eps", default=1e-5)),
            tie_word_embeddings=bool(pick("tie_word_embeddings", default=False)),
            linear_num_heads=int(lin.get("num_heads", pick("linear_num_heads", default=32))),
            linear_head_dim=int(lin.get("head_dim", pick("linear_head_dim", default=128))),
            conv_kernel=int(lin.get("short_conv_kernel_size", pick("linear_conv_kernel_dim", default=4))),
            num_heads=heads,
            q_lora_rank=pick("q_lora_rank"),
            kv_lora_rank=int(pick("kv_lora_rank", default=512)),
            qk_nope_head_dim=int(pick("qk_nope_head_dim", default=128)),
            qk_rope_head_dim=int(pick("qk_rope_head_dim", default=64)),
            v_head_dim=int(pick("v_head_dim", default=128)),
            attention_bias=bool(pick("attention_bias", default=False)),
            moe_intermediate_size=int(pick("moe_intermediate_size", default=1024)),
            num_experts=int(pick("num_local_experts", "num_experts", default=256)),
            num_experts_per_tok=int(pick("num_experts_per_tok", "num_experts_per_token", default=8)),
            num_shared_experts=int(pick("n_shared_experts", "num_shared_experts", default=1)),
            n_group=int(pick("n_group", "num_expert_group", default=1)),
            topk_group=int(pick("topk_group", default=1)),
            norm_topk_prob=bool(pick("norm_topk_prob", "moe_renormalize", default=True)),
            routed_scaling_factor=float(pick("routed_scaling_factor", default=2.446)),
        )


Config = KimiLinearConfig


def config_from_hf(hf_config: dict[str, Any]) -> KimiLinearConfig:
    return KimiLinearConfig.from_hf(hf_config)


# ----------------------------------------------------------------------------------------------------------------
# Parameter layout: shapes (what init, the converter and orbax restore agree on) and sharding specs.


def _kda_shapes(c: KimiLinearConfig) -> dict[str, tuple[int, ...]]:
    d, hk, k = c.hidden_size, c.linear_dim, c.linear_head_dim
    return {
        "q_proj": (d, hk),
        "k_proj": (d, hk),
        "v_proj": (d, hk),
        "conv": (3, hk, c.conv_kernel),  # depthwise taps for q, k, v
        "f_a": (d, k),
        "f_b": (k, hk),
        "dt_bias": (hk,),
        "A_log": (c.linear_num_heads,),
        "b_proj": (d, c.linear_num_heads),
        "g_a": (d, k),
        "g_b": (k, hk),
        "o_norm": (k,),
        "o_proj": (hk, d),
    }


def _mla_shapes(c: KimiLinearConfig) -> dict[str, tuple[int, ...]]:
    d, h = c.hidden_size, c.num_heads
    shapes = {}
    if c.q_lora_rank is None:
        shapes["q_proj"] = (d, h * c.qk_head_dim)
    else:
        shapes.update(q_a=(d, c.q_lora_rank), q_a_norm=(c.q_lora_rank,), q_b=(c.q_lora_rank, h * c.qk_head_dim))
        if c.attention_bias:
            shapes["q_a_bias"] = (c.q_lora_rank,)
    shapes.update(
        kv_a=(d, c.kv_lora_rank + c.qk_rope_head_dim),
        kv_a_norm=(c.kv_lora_rank,),
        kv_b=(c.kv_lora_rank, h * (c.qk_nope_head_dim + c.v_head_dim)),
        o_proj=(h * c.v_head_dim, d),
    )
    if c.attention_bias:
        shapes.update(kv_a_bias=(c.kv_lora_rank + c.qk_rope_head_dim,), o_proj_bias=(d,))
    return shapes


def _mlp_shapes(d: int, inner: int) -> dict[str, tuple[int, ...]]:
    return {"gate": (d, inner), "up": (d, inner), "down": (inner, d)}


def _moe_shapes(c: KimiLinearConfig) -> dict[str, Any]:
    d, e, i = c.hidden_size, c.num_experts, c.moe_intermediate_size
    return {
        "router": (d, e),
        "router_bias": (e,),
        "gate_up": (e, d, 2 * i),  # [gate | up] per expert, the layout of layers.grouped_swiglu_experts
        "down": (e, i, d),
        "shared": _mlp_shapes(d, i * c.num_shared_experts),
    }


def param_shapes(c: KimiLinearConfig) -> dict[str, Any]:
    """The parameter PyTree with a shape tuple at every leaf (layers is a list, one dict per layer)."""
    layers = []
    for kind, mlp in zip(c.layer_types, c.mlp_types):
        layers.append(
            {
                "attn_norm": (c.hidden_size,),
                "mlp_norm": (c.hidden_size,),
                "attn": _kda_shapes(c) if kind == LINEAR else _mla_shapes(c),
                "mlp": _mlp_shapes(c.hidden_size, c.intermediate_size) if mlp == DENSE else _moe_shapes(c),
            }
        )
    shapes = {"embed": (c.vocab_size, c.hidden_size), "final_norm": (c.hidden_size,), "layers": layers}
    if not c.tie_word_embeddings:
        shapes["lm_head"] = (c.hidden_size, c.vocab_size)
    return shapes


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(n, int) for n in x)


def _leaf_name(path) -> str:
    return str(path[-1].key)


# Gate parameters the reference keeps in float32 whatever the model dtype (`_keep_in_fp32_modules_strict`).
FLOAT32_PARAMS = frozenset({"router", "router_bias", "dt_bias", "A_log"})
# Column-parallel (output axis = heads / features) and row-parallel (input axis) matrices.
_COLUMN = {"q_proj", "k_proj", "v_proj", "f_b", "g_b", "b_proj", "q_b", "kv_b", "gate", "up", "lm_head"}
_ROW = {"o_proj", "down"}


def _spec_for(name: str, shape: tuple[int, ...], model: str) -> P:
    if name == "embed":
        return P(None, model)  # hidden-dim sharded: the token gather needs no collective
    if name == "conv":
        return P(None, model, None)
    if name in ("dt_bias", "A_log"):
        return P(model)
    if len(shape) == 3:  # routed experts [E, in, out]: shard each expert's hidden dim (tensor-parallel experts)
        return P(None, None, model) if name == "gate_up" else P(None, model, None)
    if name in _COLUMN:
        return P(None, model)
    if name in _ROW:
        return P(model, None)
    return P()  # norms, biases, router and the small low-rank down projections stay replicated


def param_specs(config: KimiLinearConfig, model_axis: str = "model") -> dict[str, Any]:
    """PartitionSpecs for a ("data", "model") mesh: heads and expert hidden dims over `model`, weights replicated
    over `data`."""
    return jax.tree_util.tree_map_with_path(
        lambda path, shape: _spec_for(_leaf_name(path), shape, model_axis), param_shapes(config), is_leaf=_is_shape
    )


def cache_specs(config: KimiLinearConfig, data_axis: str = "data", model_axis: str = "model") -> base.ModelCache:
    """PartitionSpecs for `init_cache`'s PyTree: batch over `data`, KDA heads over `model`."""
    layers = tuple(
        base.LinearCache(state=P(data_axis, model_axis, None, None), conv=P(data_axis, None, None))
        if kind == LINEAR
        else MLACache(latent=P(data_axis, None, None), k_rope=P(data_axis, None, None))
        for kind in config.layer_types
    )
    return base.ModelCache(layers=layers, length=P())


def init_params(config: KimiLinearConfig, key: Array, dtype: Any = jnp.float32, scale: float = 0.02) -> dict[str, Any]:
    """Random parameters (tests, benchmarks, and the abstract structure for restore): normal matrices, unit norms,
    and forget-gate rates drawn like the reference (A in [1, 16], small positive dt)."""
    shapes = param_shapes(config)
    leaves = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=_is_shape)[0]
    keys = iter(jax.random.split(key, len(leaves)))

    def make(path, shape):
        name = _leaf_name(path)
        leaf_dtype = jnp.float32 if name in FLOAT32_PARAMS else dtype
        k = next(keys)
        if "norm" in name:
            return jnp.ones(shape, leaf_dtype)
        if name == "A_log":
            return jnp.log(jax.random.uniform(k, shape, jnp.float32, 1.0, 16.0))
        if name == "dt_bias":  # inverse softplus of dt in [1e-3, 1e-1]
            dt = jnp.exp(jax.random.uniform(k, shape, jnp.float32, jnp.log(1e-3), jnp.log(1e-1)))
            return dt + jnp.log(-jnp.expm1(-dt))
        if name.endswith("bias"):
            return jnp.zeros(shape, leaf_dtype)
        return (scale * jax.random.normal(k, shape, jnp.float32)).astype(leaf_dtype)

    return jax.tree_util.tree_map_with_path(make, shapes, is_leaf=_is_shape)


# ----------------------------------------------------------------------------------------------------------------
# Caches


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MLACache:
    """An MLA layer's per-token cache: normalised kv latent [B, T, r] and shared rope-slot key [B, T, dr].

    No RoPE is applied anywhere, so these are position-independent: a cached segment can be reused at any offset.
    """

    latent: Array
    k_rope: Array


def init_cache(config: KimiLinearConfig, batch: int, max_len: int, dtype: Any = jnp.float32) -> base.ModelCache:
    """Empty decode cache: KDA state (float32) and conv tail per linear layer, `max_len`-slot latents per MLA layer."""
    c = config
    layers = []
    for kind in c.layer_types:
        if kind == LINEAR:
            state = jnp.zeros((batch, c.linear_num_heads, c.linear_head_dim, c.linear_head_dim), jnp.float32)
            conv = jnp.zeros((batch, c.conv_kernel - 1, 3 * c.linear_dim), dtype)
            layers.append(base.LinearCache(state=state, conv=conv))
        else:
            layers.append(
                MLACache(
                    latent=jnp.zeros((batch, max_len, c.kv_lora_rank), dtype),
                    k_rope=jnp.zeros((batch, max_len, c.qk_rope_head_dim), dtype),
                )
            )
    return base.ModelCache(layers=tuple(layers), length=jnp.zeros((), jnp.int32))


# ----------------------------------------------------------------------------------------------------------------
# KDA layer.


def gated_rms_norm(x: Array, gate: Array, weight: Array, eps: float) -> Array:
    """KDA's output norm: rmsnorm(x) * w * sigmoid(gate), all in float32 (the reference's "strict fp32" norm; note
    sigmoid, not the silu of Gated DeltaNet's norm)."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (normed * weight.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(x.dtype)


def kda_inputs(p: dict[str, Array], q: Array, k: Array, v: Array, g_raw: Array, b: Array) -> linear_attn.LinearInputs:
    """One sequence's KDA recurrence inputs. q, k go in as float32 so their l2 normalisation stays float32, as in
    the reference kernel (a bf16 model would otherwise round the normalised q, k back to bf16)."""
    return linear_attn.kda(
        q.astype(jnp.float32), k.astype(jnp.float32), v,
        g_raw=g_raw, A_log=p["A_log"], b=b, dt_bias=p["dt_bias"], use_qk_l2norm=True,
    )  # fmt: skip


def kda_projections(p: dict[str, Array], c: KimiLinearConfig, x: Array) -> tuple[Array, Array, Array]:
    """KDA projections of x [..., D]: (pre-conv [q|k|v] [..., 3HK], gate logits g_raw [..., H, K], b [..., H])."""
    qkv = jnp.concatenate([x @ p["q_proj"], x @ p["k_proj"], x @ p["v_proj"]], axis=-1)
    g_raw = (x @ p["f_a"] @ p["f_b"]).reshape(*x.shape[:-1], c.linear_num_heads, c.linear_head_dim)
    return qkv, g_raw, x @ p["b_proj"]


def kda_conv_taps(p: dict[str, Array], c: KimiLinearConfig) -> Array:
    """The q, k, v short convs as one depthwise conv over [q|k|v]: taps [3HK, W]."""
    return p["conv"].reshape(3 * c.linear_dim, c.conv_kernel)


def kda_output(p: dict[str, Array], c: KimiLinearConfig, x: Array, o: Array) -> Array:
    """Core outputs o [..., H, K] -> mixer output [..., D]: sigmoid-gated RMSNorm (gate from x), then o_proj."""
    gate = (x @ p["g_a"] @ p["g_b"]).reshape(*x.shape[:-1], c.linear_num_heads, c.linear_head_dim)
    o = gated_rms_norm(o.astype(x.dtype), gate, p["o_norm"], c.rms_norm_eps).reshape(*x.shape[:-1], c.linear_dim)
    return o @ p["o_proj"]


def kda_mixer(p: dict[str, Array], c: KimiLinearConfig, x: Array, mix) -> Array:
    """One KDA mixer over x [B, L, D] (already normed) in a `mixing` context: projections, the q, k, v short convs,
    the per-key-gated delta rule, sigmoid-gated RMSNorm and o_proj."""
    qkv, g_raw, b = kda_projections(p, c, x)
    qkv = mix.conv(qkv, kda_conv_taps(p, c))
    q, k, v = (t.reshape(*t.shape[:2], c.linear_num_heads, c.linear_head_dim) for t in jnp.split(qkv, 3, axis=-1))
    inputs = jax.vmap(lambda q, k, v, g_raw, b: kda_inputs(p, q, k, v, g_raw, b))(q, k, v, g_raw, b)
    return kda_output(p, c, x, mix.linear(inputs))


# ----------------------------------------------------------------------------------------------------------------
# MLA layer (no RoPE).


def _linear(x: Array, w: Array, b: Array | None = None) -> Array:
    y = x @ w
    return y if b is None else y + b


def _mla_queries(p, c: KimiLinearConfig, x: Array) -> Array:
    """Queries [B, L, H, dn + dr]."""
    if c.q_lora_rank is None:
        q = x @ p["q_proj"]
    else:
        q_latent = _linear(x, p["q_a"], p.get("q_a_bias"))
        q = layers.rms_norm_plain(q_latent, p["q_a_norm"], MLA_LATENT_NORM_EPS) @ p["q_b"]
    return q.reshape(*x.shape[:2], c.num_heads, c.qk_head_dim)


def mla_latents(p, c: KimiLinearConfig, x: Array) -> MLACache:
    """This call's per-token MLA cache: normalised kv latent [B, L, r] and the shared rope-slot key [B, L, dr]."""
    ckv = _linear(x, p["kv_a"], p.get("kv_a_bias"))
    latent, k_rope = ckv[..., : c.kv_lora_rank], ckv[..., c.kv_lora_rank :]
    return MLACache(latent=layers.rms_norm_plain(latent, p["kv_a_norm"], MLA_LATENT_NORM_EPS), k_rope=k_rope)


def _split_kv_b(p, c: KimiLinearConfig) -> tuple[Array, Array]:
    """kv_b as per-head key [r, H, dn] and value [r, H, dv] up-projections."""
    w = p["kv_b"].reshape(c.kv_lora_rank, c.num_heads, c.qk_nope_head_dim + c.v_head_dim)
    return w[..., : c.qk_nope_head_dim], w[..., c.qk_nope_head_dim :]


def mla_expand(p, c: KimiLinearConfig, kv: MLACache) -> tuple[Array, Array]:
    """Per-head keys [..., T, H, dn + dr] and values [..., T, H, dv] from latents [..., T, r] and k_rope [..., T, dr]."""
    w_k, w_v = _split_kv_b(p, c)
    k_nope = jnp.einsum("...tr,rhd->...thd", kv.latent, w_k)
    values = jnp.einsum("...tr,rhd->...thd", kv.latent, w_v)
    k_rope = jnp.broadcast_to(kv.k_rope[..., None, :], (*k_nope.shape[:-1], c.qk_rope_head_dim))
    return jnp.concatenate([k_nope, k_rope], axis=-1), values


def _attend_absorbed(p, c: KimiLinearConfig, q: Array, kv: MLACache, positions: tuple[Array, Array]) -> Array:
    """The same attention with kv_b folded into the queries and the output: a decode step reads the cached latent
    once instead of re-expanding every cached token to per-head keys and values."""
    w_k, w_v = _split_kv_b(p, c)
    q_nope, q_rope = q[..., : c.qk_nope_head_dim], q[..., c.qk_nope_head_dim :]
    q_latent = jnp.einsum("blhd,rhd->blhr", q_nope, w_k)
    scores = jnp.einsum("blhr,btr->bhlt", q_latent, kv.latent, preferred_element_type=jnp.float32)
    scores += jnp.einsum("blhd,btd->bhlt", q_rope, kv.k_rope, preferred_element_type=jnp.float32)
    q_pos, k_pos = positions  # q_pos [L] or [B, L] (one start per row)
    visible = (k_pos[None, :] <= q_pos[..., None])[..., None, :, :]  # [1 or B, 1, L, T]
    scores = jnp.where(visible, scores * c.qk_head_dim**-0.5, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    context = jnp.einsum("bhlt,btr->blhr", probs, kv.latent)
    return jnp.einsum("blhr,rhd->blhd", context, w_v)


def mla_mixer(p: dict[str, Array], c: KimiLinearConfig, x: Array, mix) -> Array:
    """One NoPE MLA mixer over x [B, L, D] (already normed) in a `mixing` context. The context gives the latents of
    every visible token (nothing is RoPE'd, so cached latents are used as stored); they are expanded to per-head
    keys and values, except in a decode step, which folds kv_b into the queries and the output instead of
    re-expanding every cached token."""
    q = _mla_queries(p, c, x)
    kv = jax.tree.map(lambda a: a.astype(x.dtype), mix.keys(mla_latents(p, c, x)))
    if mix.single_step:
        out = _attend_absorbed(p, c, q, kv, (mix.positions, mix.key_positions))
    else:
        keys, values = mla_expand(p, c, kv)
        out = mix.attend(q, keys, values, scale=c.qk_head_dim**-0.5)
    out = out.reshape(*x.shape[:2], c.num_heads * c.v_head_dim)
    return _linear(out, p["o_proj"], p.get("o_proj_bias"))


# ----------------------------------------------------------------------------------------------------------------
# MoE.


def route(p: dict[str, Array], c: KimiLinearConfig, x: Array) -> tuple[Array, Array]:
    """Kimi's router for tokens x [N, D]: (weights [N, k] float32, expert ids [N, k] int32).

    Sigmoid scores in float32. The choice uses scores + correction bias, restricted to the `topk_group` groups whose
    two best biased scores sum highest; the weights are the unbiased scores of the chosen experts, renormalised (if
    configured, with the reference's +1e-20) and multiplied by the routed scaling factor.
    """
    router_logits = x.astype(jnp.float32) @ p["router"].astype(jnp.float32)
    scores = jax.nn.sigmoid(router_logits)
    biased = scores + p["router_bias"].astype(jnp.float32)
    if c.topk_group < c.n_group:
        per_group = c.num_experts // c.n_group
        group_scores = jax.lax.top_k(biased.reshape(-1, c.n_group, per_group), 2)[0].sum(-1)  # [N, G]
        _, kept = jax.lax.top_k(group_scores, c.topk_group)
        group_mask = jnp.any(kept[:, :, None] == jnp.arange(c.n_group)[None, None, :], axis=1)  # [N, G]
        biased = jnp.where(jnp.repeat(group_mask, per_group, axis=1), biased, -jnp.inf)
    _, ids = jax.lax.top_k(biased, c.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, ids, axis=1)
    if c.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * c.routed_scaling_factor, ids.astype(jnp.int32)


def _swiglu(p: dict[str, Array], x: Array) -> Array:
    return layers.swiglu(x, p["gate"], p["up"], p["down"])


def moe(p: dict[str, Any], c: KimiLinearConfig, x: Array, valid: Array | None = None) -> Array:
    """Kimi MoE over x [B, L, D]: routed SwiGLU experts plus the shared experts (always on, unscaled). valid: None
    or a bool mask of x's leading axes; the routed experts skip the tokens outside it (a bucket's padding)."""
    tokens = x.reshape(-1, x.shape[-1])
    weights, ids = route(p, c, tokens)
    routed = layers.grouped_swiglu_experts(tokens, weights, ids, p["gate_up"], p["down"],
                                           valid=None if valid is None else valid.reshape(-1))
    return (routed + _swiglu(p["shared"], tokens)).reshape(x.shape)


# ----------------------------------------------------------------------------------------------------------------
# Model.


def mixer_block(i: int, layer, lp: dict[str, Any], x: Array, mix, config: KimiLinearConfig) -> Array:
    """The first half of layer `i` on x [B, L, D] in a `mixing` context: x + mixer(norm(x))."""
    h = layers.rms_norm_plain(x, lp["attn_norm"], config.rms_norm_eps)
    mixer = kda_mixer if config.layer_types[i] == LINEAR else mla_mixer
    return x + mixer(lp["attn"], config, h, mix)


def mlp_block(i: int, lp: dict[str, Any], x: Array, valid: Array | None, kernels: base.KernelOptions,
              config: KimiLinearConfig) -> Array:
    """The second half of layer `i`, token by token: x + mlp(norm(x)) (`valid`: the MoE's real tokens)."""
    del kernels  # the experts run as XLA's grouped products
    h = layers.rms_norm_plain(x, lp["mlp_norm"], config.rms_norm_eps)
    return x + (_swiglu(lp["mlp"], h) if config.mlp_types[i] == DENSE else moe(lp["mlp"], config, h, valid))


def block(i: int, layer, lp: dict[str, Any], x: Array, mix, config: KimiLinearConfig) -> Array:
    """Layer `i` (its static structure; `layer` its own index, unused here) on x [B, L, D] in a `mixing` context:
    x + mixer(norm(x)), then + mlp(norm(.)). Every forward of the model runs this body."""
    x = mixer_block(i, layer, lp, x, mix, config)
    return mlp_block(i, lp, x, mix.valid, mix.kernels, config)


def final_logits(params: dict[str, Any], config: KimiLinearConfig, x: Array) -> Array:
    """float32 logits of the last layer's outputs x [..., D]: the final norm, then the LM head."""
    return lm_head(params, config, layers.rms_norm_plain(x, params["final_norm"], config.rms_norm_eps))


def hidden_states(
    params: dict[str, Any], config: KimiLinearConfig, tokens: Array, cache: base.ModelCache | None = None, *,
    kernels: base.KernelOptions = base.DEFAULT_KERNELS,
) -> tuple[Array, base.ModelCache]:
    """The decoder stack: tokens [B, L] -> (final-normed hidden states [B, L, D], per-layer caches: in the form
    `cache.layers` has, or for no cache the form a forward over `params["layers"]` keeps, see `layer_stack.run`)."""
    c = config
    start = jnp.zeros((), jnp.int32) if cache is None else cache.length
    x, new_layers = mixing.run_causal(
        functools.partial(block, config=c), params["embed"][tokens], params["layers"],
        None if cache is None else cache.layers, positions=base.cache_positions(cache, tokens.shape[1]),
        start=None if cache is None else cache.length, kernels=kernels)
    x = layers.rms_norm_plain(x, params["final_norm"], c.rms_norm_eps)
    return x, base.ModelCache(layers=new_layers, length=start + tokens.shape[1])


def lm_head(params: dict[str, Any], config: KimiLinearConfig, x: Array) -> Array:
    """Hidden states [..., D] -> float32 logits [..., vocab]."""
    head = params["embed"].T if config.tie_word_embeddings else params["lm_head"]
    return layers.logits(x.astype(jnp.result_type(x, head)), head)


def forward(
    params: dict[str, Any], config: KimiLinearConfig, tokens: Array, cache: base.ModelCache | None = None, *,
    kernels: base.KernelOptions = base.DEFAULT_KERNELS,
) -> tuple[Array, base.ModelCache]:
    """Causal forward of int32 tokens [B, L] -> (logits [B, L, vocab] float32, caches).

    cache=None: a plain forward from position 0; the returned ModelCache holds this call's per-layer caches (KDA
    state and conv tail, MLA latents of just these L tokens; `decode_cache` turns them into decode buffers). With a
    cache (from `init_cache` or a previous call) the tokens continue at `cache.length`, and the returned cache has
    absorbed them; its buffers need room for them.
    """
    x, new_cache = hidden_states(params, config, tokens, cache, kernels=kernels)
    return lm_head(params, config, x), new_cache


def decode_cache(config: KimiLinearConfig, caches: base.ModelCache, max_len: int) -> base.ModelCache:
    """The caches of a cache-free forward, with the MLA latents placed in `max_len`-slot decode buffers (stacked
    caches stay stacked)."""
    def pad(i, got):
        if config.layer_types[i] != FULL:
            return got
        return jax.tree.map(lambda a: jnp.pad(a, [(0, 0), (0, max_len - a.shape[1]), (0, 0)]), got)

    return base.ModelCache(layers=layer_stack.map_layers(pad, caches.layers), length=caches.length)


def prefill(
    params: dict[str, Any], config: KimiLinearConfig, tokens: Array, max_len: int, *,
    kernels: base.KernelOptions = base.DEFAULT_KERNELS,
) -> tuple[Array, base.ModelCache]:
    """Prefill a fresh prompt: (float32 logits of the last position [B, vocab], caches sized for max_len tokens).

    MLA runs the causal kernel over the prompt instead of attending into empty buffers, and only the last position
    goes through the LM head.
    """
    x, caches = hidden_states(params, config, tokens, kernels=kernels)
    return lm_head(params, config, x[:, -1]), decode_cache(config, caches, max_len)


# ----------------------------------------------------------------------------------------------------------------
# Span forward over a layout held as data (hypic_jax.stitch.layout, hypic_jax.stitch): one program per capacity


def pool_layout(config: KimiLinearConfig, dtype: Any) -> list[tuple[str, Any]]:
    """Per layer the piece a cache entry keeps in the pools (`hypic_jax.cache.pools.Pools`): a KDA layer's dense
    summary and conv tail per slot, an MLA layer's latents per token (position-independent: MLA has no RoPE)."""
    sds = jax.ShapeDtypeStruct
    c = config
    out = []
    for kind in c.layer_types:
        if kind == LINEAR:
            h, k = c.linear_num_heads, c.linear_head_dim
            summary = linear_attn.Summary("dense", sds((h, k, k), jnp.float32), sds((h, k, k), jnp.float32))
            out.append(("slot", dict(summary=summary, conv=sds((c.conv_kernel - 1, 3 * c.linear_dim), dtype))))
        else:
            out.append(("token", MLACache(latent=sds((c.kv_lora_rank,), dtype), k_rope=sds((c.qk_rope_head_dim,),
                                                                                             dtype))))
    return out


def span_forward_arrays(params: dict[str, Any], config: KimiLinearConfig, layout, pools: tuple, *, isolated: bool,
                        summaries: bool, want_decode: bool = False,
                        kernels: base.KernelOptions = base.DEFAULT_KERNELS, want_hidden: bool = False):
    """One forward over the fresh tokens of `layout` (a `hypic_jax.stitch.layout.LayoutArrays`), reading cached entries
    from `pools` (a `layer_stack.PoolStack` of `pool_layout`'s pieces, or per layer its pool) and returning the
    layout's records as writes into them; see `qwen3_5.span_forward_arrays`. Nothing here is RoPE'd, so cached
    pieces are used as stored; the decode cache keeps the MLA latents.
    kernels: how the KDA cores (kernels.linear "pallas": the per-key-gate kernels), their fold over the pieces and
    the transfer products run (`base.KernelOptions`)."""
    x, writes, decode, hidden = mixing.run_layout(
        functools.partial(block, config=config), params["embed"][layout.tokens], params["layers"], layout, pools,
        isolated=isolated, summaries=summaries, want_decode=want_decode, want_hidden=want_hidden, kernels=kernels)
    last = layers.rms_norm_plain(x[layout.last], params["final_norm"], config.rms_norm_eps)
    out = (lm_head(params, config, last), writes, decode)
    return out + (hidden,) if want_hidden else out
