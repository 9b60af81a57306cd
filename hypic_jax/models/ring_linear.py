"""Ring-linear-2.0 (`BailingMoeLinearV2ForCausalLM`, model_type `bailing_moe_linear`) as pure JAX functions.

A stack of decoder layers; layer i is full attention iff (i + 1) % layer_group_size == 0, or i lies past the last
whole group (the layers a short stack leaves over, as mlx-lm does), and linear attention otherwise.

- Linear layer: fused multi-head `query_key_value`, per-head q/k RMSNorm, partial NeoX RoPE, then a lightning
  (constant per-head decay) linear attention with log decay g_h = -slope_h * f_layer (ALiBi slopes), read through a
  group RMSNorm (`g_norm`) gated by sigmoid(`g_proj`(x)), then `dense`.
- Full layer: GQA with fused qkv, q/k RMSNorm, partial NeoX RoPE, `dense`.
- MLP: the first `first_k_dense_replace` layers are dense SwiGLU; the rest are MoE with sigmoid scores, an expert
  bias that only steers selection, group-limited top-k, renormalised weights times `routed_scaling_factor`, plus a
  shared SwiGLU expert.

The decay's layer factor f_layer (l = layer index, L = num_hidden_layers) is read from no tensor, and the
references disagree:
  "mlx"    (default)  f = 1 - max(0, l - 1) / (L - 1) + 1e-5   mlx-lm, our parity reference;
  "remote"            f = 1 - (l - 1) / (L - 1) + 1e-5          the checkpoint's remote code as third-party ports
                                                                quote it (only layer 0 differs from "mlx");
  "vllm"              f = 1 - l / (L - 1) + 1e-5                 vLLM and SGLang's lightning backend.
The default follows mlx-lm, the reference the tests compare against (the remote code is not available to check);
select another with the config field `layer_factor_convention` (the same key in config.json is honoured).

Layout. Parameters are a plain PyTree (nested dicts and a list of layers) with matrices stored [in, out] so that
activations multiply on the left; the converter transposes the Hugging Face [out, in] tensors. Activations are
[B, L, ...]; only the linear-attention core, which takes one sequence, is vmapped over B. Caches are
`base.ModelCache`: per layer a `base.LinearCache` (state [B, H, K, V] float32; empty conv tail) or a `base.KVCache`
(post-RoPE K/V [B, T, KV, D]), plus the number of tokens already absorbed.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array
from jax.sharding import PartitionSpec as P

from hypic_jax.core import linear_attn, rope
from hypic_jax.kernels import fp8
from hypic_jax.models import base, mixing, stack as layer_stack, layers

ARCHITECTURE = "BailingMoeLinearV2ForCausalLM"
MODEL_TYPE = "bailing_moe_linear"

LAYER_FACTOR_CONVENTIONS = ("mlx", "remote", "vllm")

# The weights a block-wise FP8 checkpoint holds in FP8 (the attention projections, the MLPs and the experts); the
# router, its bias, the norms, the embedding and the head stay unquantized.
FP8_LEAVES = ("qkv", "dense", "g_proj", "gate", "up", "down", "gate_up")

Params = dict[str, Any]


# --------------------------------------------------------------------------------------------------------------------
# Configuration


@dataclasses.dataclass(frozen=True)
class RingLinearConfig:
    """The fields of Ring's config.json that change the computation (defaults follow mlx-lm's ModelArgs)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    layer_group_size: int
    group_norm_size: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    use_qk_norm: bool = False
    use_qkv_bias: bool = False
    tie_word_embeddings: bool = False
    first_k_dense_replace: int = 0
    num_experts: int | None = None
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    moe_shared_expert_intermediate_size: int | None = None
    moe_router_enable_shared_expert: bool = True
    moe_router_enable_expert_bias: bool = False
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    score_function: str = "softmax"
    n_group: int = 1
    topk_group: int = 4
    layer_factor_convention: str = "mlx"  # see the module docstring and LAYER_FACTOR_CONVENTIONS

    @classmethod
    def from_hf(cls, hf: dict) -> "RingLinearConfig":
        """Build from a parsed config.json; rejects settings this implementation does not compute."""
        rope_scaling = hf.get("rope_scaling") or {}
        unsupported = {
            "use_bias": bool(hf.get("use_bias", False)),
            "norm_head": bool(hf.get("norm_head", False)),
            "linear_silu": bool(hf.get("linear_silu", hf.get("use_linear_silu", False))),
            "linear_rope=false": not hf.get("linear_rope", True),
            "rope_traditional": bool(hf.get("rope_traditional", False)),
            "rope_scaling": rope_scaling.get("type", rope_scaling.get("rope_type", "default")) != "default",
        }
        bad = [name for name, on in unsupported.items() if on]
        if bad:
            raise ValueError(f"Ring-linear config sets unsupported option(s): {', '.join(bad)}")
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in hf.items() if k in fields}
        if values.get("num_key_value_heads") is None:
            values["num_key_value_heads"] = hf["num_attention_heads"]
        return cls(**values)

    # Derived shapes -------------------------------------------------------------------------------------------------
    @property
    def linear_head_dim(self) -> int:
        """Linear layers ignore `head_dim` (as the references do): hidden_size // heads."""
        return self.hidden_size // self.num_attention_heads

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def conv_kernel(self) -> int:
        """Linear layers have no short conv: width 1, so layouts carry no conv rows."""
        return 1

    def rotary_dim(self, head_dim: int) -> int:
        return int(head_dim * self.partial_rotary_factor)

    @property
    def shared_expert_size(self) -> int:
        per_expert = self.moe_shared_expert_intermediate_size or self.moe_intermediate_size
        return per_expert * self.num_shared_experts

    @property
    def has_shared_expert(self) -> bool:
        return self.num_shared_experts > 0 and self.moe_router_enable_shared_expert

    def is_full_attention(self, layer: int) -> bool:
        group = self.layer_group_size
        past_last_group = layer >= self.num_hidden_layers // group * group
        return (layer + 1) % group == 0 or past_last_group

    def is_moe(self, layer: int) -> bool:
        return self.num_experts is not None and layer >= self.first_k_dense_replace

    def layer_factor(self, layer: int) -> float:
        """f_layer in the linear decay g_h = -slope_h * f_layer (deeper layers forget more slowly)."""
        denom = max(1, self.num_hidden_layers - 1)
        depth = {"mlx": max(0, layer - 1), "remote": layer - 1, "vllm": layer}[self.layer_factor_convention]
        return 1.0 - depth / denom + 1e-5

    def __post_init__(self):
        if self.layer_factor_convention not in LAYER_FACTOR_CONVENTIONS:
            raise ValueError(f"unknown layer_factor_convention {self.layer_factor_convention!r}; "
                             f"use one of {LAYER_FACTOR_CONVENTIONS}")


# --------------------------------------------------------------------------------------------------------------------
# Parameter shapes, random init and sharding


def param_shapes(config: RingLinearConfig) -> Params:
    """The PyTree of parameter shapes (tuples); the converter and init both follow it."""
    d = config.hidden_size
    stack = []
    for i in range(config.num_hidden_layers):
        if config.is_full_attention(i):
            hd, h, kv = config.attention_head_dim, config.num_attention_heads, config.num_key_value_heads
            attn = {"qkv": (d, (h + 2 * kv) * hd), "dense": (h * hd, d)}
            if config.use_qkv_bias:
                attn["qkv_bias"] = ((h + 2 * kv) * hd,)
        else:
            hd, h = config.linear_head_dim, config.num_attention_heads
            attn = {"qkv": (d, 3 * h * hd), "g_proj": (d, h * hd), "g_norm": (h * hd,), "dense": (h * hd, d)}
            if config.use_qkv_bias:
                attn["qkv_bias"] = (3 * h * hd,)
        if config.use_qk_norm:
            attn["q_norm"] = (hd,)
            attn["k_norm"] = (hd,)
        if config.is_moe(i):
            e, m = config.num_experts, config.moe_intermediate_size
            mlp = {"router": (d, e), "gate_up": (e, d, 2 * m), "down": (e, m, d)}
            if config.moe_router_enable_expert_bias:
                mlp["expert_bias"] = (e,)
            if config.has_shared_expert:
                s = config.shared_expert_size
                mlp["shared"] = {"gate": (d, s), "up": (d, s), "down": (s, d)}
        else:
            f = config.intermediate_size
            mlp = {"gate": (d, f), "up": (d, f), "down": (f, d)}
        stack.append({"input_norm": (d,), "attn": attn, "post_norm": (d,), "mlp": mlp})
    shapes = {"embed": (config.vocab_size, d), "layers": stack, "norm": (d,)}
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (d, config.vocab_size)
    return shapes


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(n, int) for n in x)


def init_params(config: RingLinearConfig, key: Array, dtype=jnp.float32) -> Params:
    """Random parameters (norm weights 1, expert bias 0, matrices ~ N(0, 0.02)); for tests and benchmarks.
    The router and the expert bias stay float32 (Ring routes in float32), everything else is `dtype`."""
    shapes = param_shapes(config)
    leaves, treedef = jax.tree.flatten_with_path(shapes, is_leaf=_is_shape)
    keys = jax.random.split(key, len(leaves))
    out = []
    for (path, shape), k in zip(leaves, keys):
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            out.append(jnp.ones(shape, dtype))
        elif "expert_bias" in name:
            out.append(jnp.zeros(shape, jnp.float32))
        elif "router" in name:
            out.append(0.02 * jax.random.normal(k, shape, jnp.float32))
        else:
            out.append((0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype))
    return jax.tree.unflatten(treedef, out)


def partition_specs(config: RingLinearConfig) -> Params:
    """PartitionSpecs for a ("data", "model") mesh: Megatron-style column/row splits, experts split over "model".

    Fused qkv is split by columns like any column-parallel matrix; XLA reshards where the head split needs it.
    """

    def spec(path, shape) -> P:
        name = getattr(path[-1], "key", None)
        if len(shape) == 1 or name == "router":
            return P()
        if name == "embed":  # split the hidden dim: the token gather stays local
            return P(None, "model")
        if len(shape) == 3:  # routed experts [E, in, out]
            return P("model", None, None)
        if name in ("dense", "down"):
            return P("model", None)
        return P(None, "model")  # qkv, g_proj, gate, up, lm_head

    return jax.tree_util.tree_map_with_path(spec, param_shapes(config), is_leaf=_is_shape)


def shardings(config: RingLinearConfig, mesh: jax.sharding.Mesh) -> Params:
    """NamedShardings of the parameter PyTree on `mesh` (axes "data" and "model")."""
    return base.named_shardings(partition_specs(config), mesh)


# --------------------------------------------------------------------------------------------------------------------
# Building blocks (activations [B, L, ...]; positions [L] shared by the rows, or [B, L] one per row)


def group_rms_norm(x: Array, weight: Array, groups: int, eps: float) -> Array:
    """RMSNorm of each of `groups` equal slices of the last axis, then one weight over the whole axis (`g_norm`)."""
    grouped = x.reshape(*x.shape[:-1], groups, x.shape[-1] // groups)
    ones = jnp.ones((grouped.shape[-1],), jnp.float32)
    return layers.rms_norm(grouped, ones, eps).reshape(x.shape) * weight.astype(x.dtype)


def swiglu_mlp(p: Params, x: Array) -> Array:
    return layers.swiglu(x, p["gate"], p["up"], p["down"])


def _fused_projection(p: Params, x: Array) -> Array:
    y = x @ p["qkv"]
    return y + p["qkv_bias"] if "qkv_bias" in p else y


def _norm_and_rotate(p: Params, q: Array, k: Array, positions: Array, config: RingLinearConfig) -> tuple[Array, Array]:
    """Per-head q/k RMSNorm, then partial NeoX RoPE on the first rotary_dim channels."""
    if config.use_qk_norm:
        q = layers.rms_norm(q, p["q_norm"], config.rms_norm_eps)
        k = layers.rms_norm(k, p["k_norm"], config.rms_norm_eps)
    rotary_dim = config.rotary_dim(q.shape[-1])
    q = layers.rope_batch(q, positions, rotary_dim=rotary_dim, base=config.rope_theta)
    k = layers.rope_batch(k, positions, rotary_dim=rotary_dim, base=config.rope_theta)
    return q, k


def linear_inputs(p: Params, x: Array, positions: Array, layer: int,
                  config: RingLinearConfig) -> linear_attn.LinearInputs:
    """The core's view of a linear layer for x [B, L, D]: normed, rotated q, k and v [B, L, H, K] with the layer's
    constant decay (a batched LinearInputs; vmap its methods over B). A PIC engine summarises segments from this.
    layer: the layer's index, an int or (in a scan over layers) a traced int32."""
    batch, length, _ = x.shape
    h, hd = config.num_attention_heads, config.linear_head_dim
    qkv = _fused_projection(p, x).reshape(batch, length, 3 * h, hd)
    q, k, v = qkv[:, :, :h], qkv[:, :, h:2 * h], qkv[:, :, 2 * h:]
    q, k = _norm_and_rotate(p, q, k, positions, config)
    if isinstance(layer, int):
        factor = config.layer_factor(layer)
    else:  # a traced layer index (a scanned group of layers, `layer_stack.run`)
        table = [config.layer_factor(i) for i in range(config.num_hidden_layers)]
        factor = jnp.asarray(table, jnp.float32)[layer]
    # The decay is a compile-time constant; the barrier keeps XLA from constant-folding its per-chunk cumulative
    # sums (tens of seconds of compile at 32k tokens on a GPU).
    slopes = jax.lax.optimization_barrier(linear_attn.alibi_slopes(h))
    return jax.vmap(lambda q, k, v: linear_attn.lightning(q, k, v, slopes=slopes, layer_factor=factor,
                                                          scale=hd ** -0.5))(q, k, v)


def linear_output(p: Params, x: Array, o: Array, config: RingLinearConfig) -> Array:
    """Core output o [B, L, H, V] -> layer output [B, L, D]: group RMSNorm, sigmoid gate from x, `dense`."""
    o = o.reshape(*o.shape[:2], -1).astype(x.dtype)
    gate = jax.nn.sigmoid(x @ p["g_proj"])
    return (group_rms_norm(o, p["g_norm"], config.group_norm_size, config.rms_norm_eps) * gate) @ p["dense"]


def summary_rotation(config: RingLinearConfig):
    """`rotate(summary, offset)` for the linear layers' summaries: their keys carry RoPE, so a cached summary
    moves with its piece (`linear_attn.rotate_summary`)."""
    rotary_dim = config.rotary_dim(config.linear_head_dim)
    return lambda summary, offset: linear_attn.rotate_summary(summary, offset, rotary_dim=rotary_dim,
                                                              base=config.rope_theta)


def linear_mixer(p: Params, x: Array, layer, config: RingLinearConfig, mix) -> Array:
    """Ring's lightning attention layer on x [B, L, D] (normed) in a `mixing` context. layer: the layer's index
    (its decay), an int or a traced int32."""
    inputs = linear_inputs(p, x, mix.positions, layer, config)
    return linear_output(p, x, mix.linear(inputs, rotate=summary_rotation(config)), config)


def attention_projections(p: Params, x: Array, positions: Array, config: RingLinearConfig) -> tuple[Array, Array, Array]:
    """Full-attention q [B, L, H, D], k, v [B, L, KV, D] of x [B, L, D]: fused qkv, q/k norm, RoPE at `positions`."""
    batch, length, _ = x.shape
    h, kvh, hd = config.num_attention_heads, config.num_key_value_heads, config.attention_head_dim
    qkv = _fused_projection(p, x)
    q = qkv[..., : h * hd].reshape(batch, length, h, hd)
    k = qkv[..., h * hd:(h + kvh) * hd].reshape(batch, length, kvh, hd)
    v = qkv[..., (h + kvh) * hd:].reshape(batch, length, kvh, hd)
    q, k = _norm_and_rotate(p, q, k, positions, config)
    return q, k, v


def attention_mixer(p: Params, x: Array, config: RingLinearConfig, mix) -> Array:
    """GQA softmax attention on x [B, L, D] (normed) in a `mixing` context, keys RoPE'd at their positions (cached
    ones moved by their pieces' offsets)."""
    batch, length, _ = x.shape
    h, hd = config.num_attention_heads, config.attention_head_dim
    q, k, v = attention_projections(p, x, mix.positions, config)
    rotary_dim = config.rotary_dim(hd)
    rotate = lambda kv, offset: base.KVCache(  # noqa: E731
        rope.rotate_keys(kv.k, offset, rotary_dim=rotary_dim, base=config.rope_theta), kv.v)
    keys = mix.keys(base.KVCache(k=k, v=v), rotate=rotate)
    o = mix.attend(q, keys.k, keys.v, scale=hd ** -0.5)
    return o.reshape(batch, length, h * hd) @ p["dense"]


def route(p: Params, x: Array, config: RingLinearConfig) -> tuple[Array, Array]:
    """Expert choice for tokens x [T, D]: (weights [T, k] float32, expert ids [T, k]).

    Scores are sigmoid (or softmax) of the router logits in float32. The expert bias and the group limit (keep the
    `topk_group` groups whose two best biased scores sum highest; zero the rest; all of them where topk_group >=
    n_group, as in mlx-lm) only decide *which* experts; the weights are the unbiased scores of the chosen ones,
    renormalised, times `routed_scaling_factor`.
    """
    logits = x.astype(jnp.float32) @ p["router"].astype(jnp.float32)
    if config.score_function == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        scores = jax.nn.softmax(logits, axis=-1)
    choice = scores + p["expert_bias"].astype(jnp.float32) if "expert_bias" in p else scores
    if config.n_group > 1:
        tokens = choice.shape[0]
        grouped = choice.reshape(tokens, config.n_group, -1)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [T, G]
        _, kept = jax.lax.top_k(group_scores, min(config.topk_group, config.n_group))
        keep = jnp.zeros(group_scores.shape, bool).at[jnp.arange(tokens)[:, None], kept].set(True)
        choice = jnp.where(keep[..., None], grouped, 0.0).reshape(choice.shape)
    _, experts = jax.lax.top_k(choice, config.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if config.num_experts_per_tok > 1 and config.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdims=True)
    return weights * config.routed_scaling_factor, experts


def gathered_swiglu_experts(x: Array, weights: Array, experts: Array, gate_up: Array, down: Array) -> Array:
    """Routed SwiGLU experts for a few tokens (decode): gather each token's k experts' weights and multiply.

    Reads only the chosen experts, where a grouped matmul over all E groups streams every expert's weights.
    x [T, D], weights / experts [T, k], gate_up [E, D, 2I], down [E, I, D] -> [T, D] in x's dtype.
    """
    def multiply(gate_up, down):  # each token's k experts' weights [T, k, ...]
        hidden = jnp.einsum("td,tkdi->tki", x, gate_up, preferred_element_type=jnp.float32)
        gate, up = jnp.split(hidden, 2, axis=-1)
        activated = (jax.nn.silu(gate) * up).astype(x.dtype)
        return jnp.einsum("tki,tkid->tkd", activated, down, preferred_element_type=jnp.float32)

    def chosen(gate_up, down, first):  # a scanned layer's experts are rows of a bank, from `first` on
        return multiply(gate_up[experts + first], down[experts + first])

    def chosen_fp8(gate_up, down, gate_up_scale, down_scale, first):  # FP8: the chosen experts dequantized
        rows = experts + first
        return multiply(*(fp8.dequantize(fp8.BlockFP8(v[rows], s[rows], block), x.dtype)
                          for v, s in ((gate_up, gate_up_scale), (down, down_scale))))

    if fp8.is_fp8(gate_up):
        block = gate_up.block
        out = layer_stack.with_experts(chosen_fp8, gate_up.value, down.value, gate_up.scale, down.scale)
    else:
        out = layer_stack.with_experts(chosen, gate_up, down)
    return jnp.einsum("tkd,tk->td", out, weights.astype(jnp.float32)).astype(x.dtype)


def moe(p: Params, x: Array, config: RingLinearConfig, valid: Array | None = None) -> Array:
    """Ring's MoE block on x [..., D]: routed SwiGLU experts plus the shared expert. Grouped matmuls when there
    are at least as many (token, expert) pairs as experts, else (decode) a gather of the chosen experts only.
    valid: None or a bool mask of x's leading axes; the grouped path skips routed work outside it (a bucket's
    padding, see `layers.grouped_swiglu_experts`)."""
    tokens = x.reshape(-1, x.shape[-1])
    weights, experts = route(p, tokens, config)
    few_pairs = tokens.shape[0] * config.num_experts_per_tok < config.num_experts
    if few_pairs:
        out = gathered_swiglu_experts(tokens, weights, experts, p["gate_up"], p["down"])
    else:
        out = layers.grouped_swiglu_experts(tokens, weights, experts, p["gate_up"], p["down"],
                                            valid=None if valid is None else valid.reshape(-1))
    if "shared" in p:
        out = out + swiglu_mlp(p["shared"], tokens)
    return out.reshape(x.shape)


# --------------------------------------------------------------------------------------------------------------------
# The model


def block(i: int, layer, lp: Params, x: Array, mix, config: RingLinearConfig) -> Array:
    """Layer `i` (its static structure) on x [B, L, D] in a `mixing` context: x + mixer(norm(x)), then
    + mlp(norm(.)). layer: the layer's own index (its linear decay), an int or a traced int32 in a scan. Every
    forward of the model runs this body."""
    x = mixer_block(i, layer, lp, x, mix, config)
    return mlp_block(i, lp, x, mix.valid, mix.kernels, config)


def mixer_block(i: int, layer, lp: Params, x: Array, mix, config: RingLinearConfig) -> Array:
    """The first half of layer `i` on x [B, L, D] in a `mixing` context: x + mixer(norm(x))."""
    h = layers.rms_norm(x, lp["input_norm"], config.rms_norm_eps)
    if config.is_full_attention(i):
        return x + attention_mixer(lp["attn"], h, config, mix)
    return x + linear_mixer(lp["attn"], h, layer, config, mix)


def mlp_block(i: int, lp: Params, x: Array, valid: Array | None, kernels, config: RingLinearConfig) -> Array:
    """The second half of layer `i`, token by token: x + mlp(norm(x)) (`valid`: the MoE's real tokens)."""
    del kernels  # the experts run as XLA's grouped products
    h = layers.rms_norm(x, lp["post_norm"], config.rms_norm_eps)
    return x + (moe(lp["mlp"], h, config, valid) if config.is_moe(i) else swiglu_mlp(lp["mlp"], h))


def final_logits(params: Params, config: RingLinearConfig, x: Array) -> Array:
    """float32 logits of the last layer's outputs x [..., D]: the final norm, then the unembedding."""
    return unembed(params, layers.rms_norm(x, params["norm"], config.rms_norm_eps))


def unembed(params: Params, x: Array) -> Array:
    head = params["lm_head"] if "lm_head" in params else params["embed"].T
    return layers.logits(x, head)


def hidden_states(params: Params, config: RingLinearConfig, tokens: Array,
                  cache: base.ModelCache | None = None, *,
                  kernels: base.KernelOptions = base.DEFAULT_KERNELS) -> tuple[Array, base.ModelCache]:
    """The final-norm hidden states [B, L, D] of int32 tokens [B, L], and the cache after them (see `forward`; its
    layers in the form `cache.layers` has, or for no cache the form a forward over `params["layers"]` keeps, see
    `layer_stack.run`)."""
    x, new_caches = mixing.run_causal(
        functools.partial(block, config=config), params["embed"][tokens], params["layers"],
        None if cache is None else cache.layers, positions=base.cache_positions(cache, tokens.shape[1]),
        start=None if cache is None else cache.length, kernels=kernels)
    x = layers.rms_norm(x, params["norm"], config.rms_norm_eps)
    length = jnp.int32(tokens.shape[1]) + (0 if cache is None else cache.length)
    return x, base.ModelCache(layers=new_caches, length=length)


def forward(params: Params, config: RingLinearConfig, tokens: Array,
            cache: base.ModelCache | None = None, *,
            kernels: base.KernelOptions = base.DEFAULT_KERNELS) -> tuple[Array, base.ModelCache]:
    """tokens int32 [B, L] -> (logits float32 [B, L, V], cache after these tokens).

    Without `cache` this is the plain causal forward from position 0; it still returns each layer's cache of these
    tokens (linear state, K/V of length L; `decode_cache` makes decode buffers of them). With `cache` (from
    `init_cache` or a previous call) the tokens continue at position cache.length, K/V are written into the cache's
    buffers and the states carried on.
    """
    x, new_cache = hidden_states(params, config, tokens, cache, kernels=kernels)
    return unembed(params, x), new_cache


def decode_cache(config: RingLinearConfig, caches: base.ModelCache, max_len: int) -> base.ModelCache:
    """The caches of a cache-free forward with their K/V placed in `max_len`-slot decode buffers (stacked caches
    stay stacked)."""
    def pad(a: Array) -> Array:
        return jnp.pad(a, [(0, 0), (0, max_len - a.shape[1]), (0, 0), (0, 0)])

    padded = layer_stack.map_layers(lambda i, c: jax.tree.map(pad, c) if isinstance(c, base.KVCache) else c,
                                    caches.layers)
    return base.ModelCache(layers=padded, length=caches.length)


def prefill(params: Params, config: RingLinearConfig, tokens: Array,
            max_len: int, *, kernels: base.KernelOptions = base.DEFAULT_KERNELS) -> tuple[Array, base.ModelCache]:
    """A fresh prompt: (float32 logits of its last position [B, V], caches sized for `max_len` tokens).

    Full attention runs the causal kernel instead of attending into empty buffers, and only the last position goes
    through the LM head."""
    x, caches = hidden_states(params, config, tokens, kernels=kernels)
    return unembed(params, x[:, -1]), decode_cache(config, caches, max_len)


def init_cache(config: RingLinearConfig, batch: int, max_len: int, dtype=jnp.float32) -> base.ModelCache:
    """Empty decoding cache: zero linear states (float32) and K/V buffers of `max_len` positions."""
    caches = []
    for i in range(config.num_hidden_layers):
        if config.is_full_attention(i):
            shape = (batch, max_len, config.num_key_value_heads, config.attention_head_dim)
            caches.append(base.KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype)))
        else:
            hd = config.linear_head_dim
            state = jnp.zeros((batch, config.num_attention_heads, hd, hd), jnp.float32)
            caches.append(base.LinearCache(state=state, conv=jnp.zeros((batch, 0, 0), dtype)))  # no short conv
    return base.ModelCache(layers=tuple(caches), length=jnp.int32(0))


# The names the model registry expects.
Config = RingLinearConfig
config_from_hf = RingLinearConfig.from_hf
param_specs = partition_specs


# --------------------------------------------------------------------------------------------------------------------
# Span forward over a layout held as data (hypic_jax.stitch.layout, hypic_jax.stitch): one program per capacity


def pool_layout(config: RingLinearConfig, dtype: Any) -> list[tuple[str, Any]]:
    """Per layer the piece a cache entry keeps in the pools (`hypic_jax.cache.pools.Pools`): a linear layer's scalar
    summary per slot (constant per-head decay: the transfer is one log decay per head; no conv tail), a
    full-attention layer's canonical post-RoPE K and V per token."""
    sds = jax.ShapeDtypeStruct
    out = []
    for i in range(config.num_hidden_layers):
        if config.is_full_attention(i):
            kv = sds((config.num_key_value_heads, config.attention_head_dim), dtype)
            out.append(("token", dict(k=kv, v=kv)))
        else:
            h, hd = config.num_attention_heads, config.linear_head_dim
            summary = linear_attn.Summary("scalar", sds((h, hd, hd), jnp.float32), sds((h,), jnp.float32))
            out.append(("slot", dict(summary=summary)))
    return out


def span_forward_arrays(params: Params, config: RingLinearConfig, layout, pools: tuple, *, isolated: bool,
                        summaries: bool, want_decode: bool = False,
                        kernels: base.KernelOptions = base.DEFAULT_KERNELS, want_hidden: bool = False):
    """One forward over the fresh tokens of `layout` (a `hypic_jax.stitch.layout.LayoutArrays`), reading cached entries
    from `pools` (a `layer_stack.PoolStack` of `pool_layout`'s pieces, or per layer its pool) and returning the
    layout's records as writes into them; see `qwen3_5.span_forward_arrays`. Linear layers RoPE their keys, so
    cached summaries are moved by their pieces' offsets (zero where the mode keeps them at their canonical
    phase). kernels: how the lightning cores, their fold over the pieces and the transfer products run
    (`base.KernelOptions`)."""
    x, writes, decode, hidden = mixing.run_layout(
        functools.partial(block, config=config), params["embed"][layout.tokens], params["layers"], layout, pools,
        isolated=isolated, summaries=summaries, want_decode=want_decode, want_hidden=want_hidden, kernels=kernels)
    last = layers.rms_norm(x[layout.last], params["norm"], config.rms_norm_eps)
    out = (unembed(params, last), writes, decode)
    return out + (hidden,) if want_hidden else out
