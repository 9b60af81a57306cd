"""The linear-attention families in the core's common form (`LinearInputs`): each maps a model's projections and
gates to q, k, v, g, gk, beta and a scale."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array

from hypic_jax.core.linear_attn.chunk import chunked, summarize
from hypic_jax.core.linear_attn.common import _repeat_heads
from hypic_jax.core.linear_attn.naive import recurrent
from hypic_jax.core.linear_attn.span import SpanChunk, chunk_step, span_chunk, span_chunk_outputs
from hypic_jax.core.summary import Summary, transfer_form


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class LinearInputs:
    """A family's inputs in the core's common form; `scale` is static."""

    q: Array
    k: Array
    v: Array
    g: Array | None = None
    gk: Array | None = None
    beta: Array | None = None
    scale: float = 1.0

    def tree_flatten(self):
        return (self.q, self.k, self.v, self.g, self.gk, self.beta), self.scale

    @classmethod
    def tree_unflatten(cls, scale, children):
        return cls(*children, scale=scale)

    @property
    def form(self) -> str:
        return transfer_form(g=self.g, gk=self.gk, beta=self.beta)

    def gates(self) -> dict[str, Array | None]:
        return dict(g=self.g, gk=self.gk, beta=self.beta)

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `recurrent` / `chunked`."""
        return dict(q=self.q, k=self.k, v=self.v, scale=self.scale, **self.gates())

    def recurrent(self, initial_state: Array | None = None):
        return recurrent(**self.kwargs(), initial_state=initial_state)

    def chunked(self, initial_state: Array | None = None, chunk_size: int = 64):
        return chunked(**self.kwargs(), initial_state=initial_state, chunk_size=chunk_size)

    def chunk_step(self) -> tuple[Array, Array, Array, Array]:
        return chunk_step(self.k, self.v, **self.gates())

    def span_chunk(self) -> SpanChunk:
        return span_chunk(self.q, self.k, self.v, **self.gates())

    def span_chunk_outputs(self, chunk: SpanChunk, state: Array) -> tuple[Array, Array]:
        """Outputs and final state as `chunked(initial_state=state)` gives them for a span of one chunk."""
        return span_chunk_outputs(chunk, state, self.scale, self.v.dtype)

    def summarize(self, chunk_size: int = 64, impl: str = "xla") -> Summary:
        return summarize(self.k, self.v, chunk_size=chunk_size, impl=impl, **self.gates())


def _require(family: str, **gates) -> None:
    for name, value in gates.items():
        if value is None:
            raise ValueError(f"{family} requires `{name}`")


def _default_scale(scale: float | None, key_dim: int) -> float:
    return key_dim**-0.5 if scale is None else float(scale)


def l2_normalize(x: Array, eps: float = 1e-6) -> Array:
    """x / sqrt(sum x^2 + eps) over the last axis (the q/k normalisation of delta-rule models).

    Computed and returned in float32 (float64 for float64 inputs): the core upcasts q and k anyway, and rounding
    unit vectors back to bf16 would only add error.
    """
    xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    return xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)


def _opaque(x: Array) -> Array:
    """Hide a compile-time-constant gate from XLA's constant folder: folding the chunk sums of a broadcast constant
    decay over a long sequence costs far more compile time than computing them."""
    return jax.lax.optimization_barrier(jnp.asarray(x, jnp.float32))


def linear_attention(q: Array, k: Array, v: Array, *, scale: float = 1.0) -> LinearInputs:
    """Plain (ungated) linear attention: A_t = I."""
    return LinearInputs(q, k, v, scale=scale)


def retnet_decays(num_heads: int) -> Array:
    """RetNet's fixed per-head decays gamma_h = 1 - 2^(-5-h)."""
    return 1.0 - 2.0 ** (-5.0 - jnp.arange(num_heads, dtype=jnp.float32))


def retnet(q: Array, k: Array, v: Array, *, scale: float | None = None) -> LinearInputs:
    """RetNet retention: A_t = gamma_h I with fixed per-head gamma."""
    length, heads = k.shape[:2]
    g = jnp.broadcast_to(_opaque(jnp.log(retnet_decays(heads))), (length, heads))
    return LinearInputs(q, k, v, g=g, scale=_default_scale(scale, k.shape[-1]))


def alibi_slopes(num_heads: int) -> Array:
    """ALiBi slopes: a geometric sequence 2^(-8/n) ... for a power of two n; otherwise the slopes of the nearest
    lower power of two followed by every other slope of the next one."""

    def power_of_two(n):
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if num_heads <= 0:
        raise ValueError(f"num_heads must be positive, got {num_heads}")
    if math.log2(num_heads).is_integer():
        slopes = power_of_two(num_heads)
    else:
        closest = 2 ** math.floor(math.log2(num_heads))
        slopes = power_of_two(closest) + power_of_two(2 * closest)[0::2][: num_heads - closest]
    return jnp.asarray(slopes, jnp.float32)


def lightning(
    q: Array,
    k: Array,
    v: Array,
    *,
    layer_factor: float | None,
    slopes: Array | None = None,
    scale: float | None = None,
) -> LinearInputs:
    """Lightning attention / Ring-linear: constant decay exp(-slope_h * layer_factor) per head.

    `slopes` defaults to `alibi_slopes(H)`; `layer_factor` is the model's per-layer multiplier (conventions differ
    between implementations; the model file picks one).
    """
    _require("lightning", layer_factor=layer_factor)
    length, heads = k.shape[:2]
    slopes = alibi_slopes(heads) if slopes is None else jnp.asarray(slopes, jnp.float32)
    if slopes.shape != (heads,):
        raise ValueError(f"slopes must be [H={heads}], got shape {slopes.shape}")
    g = jnp.broadcast_to(_opaque(-slopes * layer_factor), (length, heads))
    return LinearInputs(q, k, v, g=g, scale=_default_scale(scale, k.shape[-1]))


def mamba2(
    x: Array,
    dt: Array,
    *,
    A_log: Array | None,
    B: Array | None,
    C: Array | None,
    dt_bias: Array | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> LinearInputs:
    """Mamba2 / SSD as a linear recurrence: key = B, query = C, value = dt * x, A_t = exp(dt_t * A_h) I.

    Shapes: x [L, H, P], dt [L, H], A_log and dt_bias [H], B and C [L, G, N] with G groups dividing H (head h reads
    group h // (H / G)). The D * x skip connection is outside the recurrence and is left to the model.
    """
    _require("mamba2", A_log=A_log, B=B, C=C)
    length, heads = x.shape[:2]
    if dt.shape != (length, heads):
        raise ValueError(f"dt must be [L={length}, H={heads}], got shape {dt.shape}")
    if A_log.shape != (heads,):
        raise ValueError(f"A_log must be [H={heads}], got shape {A_log.shape}")
    if B.shape != C.shape or B.ndim != 3 or B.shape[0] != length:
        raise ValueError(f"B and C must both be [L={length}, G, N], got shapes {B.shape} and {C.shape}")
    dt = dt.astype(jnp.float32)
    if dt_bias is not None:
        dt = dt + dt_bias.astype(jnp.float32)
    if dt_softplus:
        dt = jax.nn.softplus(dt)
    dt = jnp.clip(dt, *dt_limit)
    g = dt * -jnp.exp(A_log.astype(jnp.float32))
    key = _repeat_heads(B, heads, "B")
    query = _repeat_heads(C, heads, "C")
    value = (x.astype(jnp.float32) * dt[..., None]).astype(x.dtype)
    return LinearInputs(query, key, value, g=g, scale=1.0)


def gla(q: Array, k: Array, v: Array, *, gk: Array | None, scale: float | None = None) -> LinearInputs:
    """Gated linear attention: A_t = Diag(exp(gk_t)) with gk the per-key log forget gate."""
    _require("gla", gk=gk)
    return LinearInputs(q, k, v, gk=gk, scale=_default_scale(scale, k.shape[-1]))


def delta_net(
    q: Array, k: Array, v: Array, *, beta: Array | None, use_qk_l2norm: bool = True, scale: float | None = None
) -> LinearInputs:
    """DeltaNet: A_t = I - beta_t k_t k_t^T (beta already in (0, 1), e.g. sigmoid of a projection)."""
    _require("delta_net", beta=beta)
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    return LinearInputs(q, k, v, beta=beta, scale=_default_scale(scale, k.shape[-1]))


def gated_delta_net(
    q: Array,
    k: Array,
    v: Array,
    *,
    a: Array | None,
    b: Array | None,
    A_log: Array | None,
    dt_bias: Array | None,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
    repeat_heads: bool = True,
) -> LinearInputs:
    """Gated DeltaNet with Qwen3.5 / Qwen3-Next gates: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b).

    q, k may have fewer (key) heads than v; each key head serves H_v / H_k consecutive value heads. a, b: [L, H_v];
    A_log, dt_bias: [H_v]. repeat_heads False keeps q, k at their H_k key heads (for consumers that read them
    grouped, like the Pallas kernels and `stitch.linear_over_layout`; the core here needs them repeated).
    """
    _require("gated_delta_net", a=a, b=b, A_log=A_log, dt_bias=dt_bias)
    heads = v.shape[1]
    if a.shape != (v.shape[0], heads) or b.shape != (v.shape[0], heads):
        raise ValueError(f"a and b must be [L, H_v] = {(v.shape[0], heads)}, got shapes {a.shape} and {b.shape}")
    if A_log.shape != (heads,) or dt_bias.shape != (heads,):
        raise ValueError(f"A_log and dt_bias must be [H_v={heads}], got shapes {A_log.shape} and {dt_bias.shape}")
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    if repeat_heads:
        q, k = _repeat_heads(q, heads, "q"), _repeat_heads(k, heads, "k")
    elif heads % k.shape[1] or q.shape[1] != k.shape[1]:
        raise ValueError(f"q, k have {q.shape[1]}, {k.shape[1]} heads, which do not divide the {heads} value heads")
    g = -jnp.exp(A_log.astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    beta = jax.nn.sigmoid(b.astype(jnp.float32))
    return LinearInputs(q, k, v, g=g, beta=beta, scale=_default_scale(scale, k.shape[-1]))


def kda(
    q: Array,
    k: Array,
    v: Array,
    *,
    g_raw: Array | None,
    A_log: Array | None,
    b: Array | None,
    dt_bias: Array | None = None,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
) -> LinearInputs:
    """Kimi Delta Attention: A_t = (I - beta_t k_t k_t^T) Diag(exp(gk_t)), decay first, then the delta rule.

    gk = -exp(A_log_h) softplus(g_raw + dt_bias) per key channel, beta = sigmoid(b). Shapes: g_raw [L, H, K],
    A_log [H] (one rate per head), dt_bias [H, K] or [H * K], b [L, H].
    """
    _require("kda", g_raw=g_raw, A_log=A_log, b=b)
    length, heads, key_dim = k.shape
    if g_raw.shape != k.shape:
        raise ValueError(f"g_raw must have k's shape {k.shape}, got shape {g_raw.shape}")
    if b.shape != (length, heads):
        raise ValueError(f"b must be [L={length}, H={heads}], got shape {b.shape}")
    rate = jnp.exp(A_log.astype(jnp.float32)).reshape(-1)
    if rate.shape[0] not in (1, heads):
        raise ValueError(f"A_log must have H={heads} entries, got shape {A_log.shape}")
    gate = g_raw.astype(jnp.float32)
    if dt_bias is not None:
        if dt_bias.size != heads * key_dim:
            raise ValueError(f"dt_bias must have H*K={heads * key_dim} entries, got shape {dt_bias.shape}")
        gate = gate + dt_bias.astype(jnp.float32).reshape(heads, key_dim)
    gk = -rate[:, None] * jax.nn.softplus(gate)
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    beta = jax.nn.sigmoid(b.astype(jnp.float32))
    return LinearInputs(q, k, v, gk=gk, beta=beta, scale=_default_scale(scale, key_dim))
