"""Building blocks shared by the hybrid architectures: norms, MLPs, MoE, gated full attention.

Every function is pure and works on one batch `[B, L, ...]` of activations. Weights are stored `[in, out]` so a
projection is `x @ w`. Reductions that decide numerics (norm statistics, softmax, router probabilities) run in
float32; results come back in the activation dtype, matching the Hugging Face reference implementations.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import Array
from jax import custom_batching

# causal / position-masked attention lives below the models so the span machinery can share it; re-exported here
from hypic_jax.core.attention import MASKED_QUERY_BLOCK, dot_product_attention  # noqa: F401
from hypic_jax.models.stack import BANK_MAX_ELEMENTS, ExpertBank, with_experts
from hypic_jax.kernels import fp8, grouped_matmul as gm
from hypic_jax.core.rope import apply_rope


# ----------------------------------------------------------------------------------------------------------------
# Logits


def logits(x: Array, weight: Array) -> Array:
    """float32 logits of hidden states x [..., H] through the head weight [H, V], multiplied in x's dtype.

    One row (a span program's last token) is multiplied as two rows, the second zero. Where XLA's GPU backend
    takes its products to cuBLAS (the stitched program: `engine.programs.span_options`), a one-row product would
    become a gemv fed float32 operands, the whole head converted to float32 once per request (`bench/rag_trace.py
    --profile-dir` profiles it, bench/RESULTS.md); as a two-row product it stays a bfloat16 product with float32
    results."""
    weight = weight.astype(x.dtype)
    if x.ndim == 1:
        rows = jnp.stack([x, jnp.zeros_like(x)])
        return jnp.dot(rows, weight, preferred_element_type=jnp.float32)[0]
    return jnp.dot(x, weight, preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------------------------------------------
# Norms


def rms_norm(x: Array, weight: Array, eps: float = 1e-6, *, offset: float = 0.0) -> Array:
    """RMSNorm over the last axis: x / rms(x) * (offset + weight), statistics in float32.

    offset=1.0 gives the zero-centred "(1 + w)" variant of Qwen3.5 / Qwen3-Next (weights initialised to zero); the
    product is taken in float32 and cast once, as those references do.
    """
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (normed * (offset + weight.astype(jnp.float32))).astype(x.dtype)


def rms_norm_plain(x: Array, weight: Array, eps: float = 1e-6) -> Array:
    """Llama-style RMSNorm: normalise in float32, cast back, then scale by the weight in the activation dtype."""
    xf = x.astype(jnp.float32)
    normed = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return weight.astype(x.dtype) * normed


def gated_rms_norm(x: Array, gate: Array, weight: Array, eps: float = 1e-6) -> Array:
    """rmsnorm(x) * w * silu(gate) (norm before gate), the output norm of Gated DeltaNet layers."""
    xf = x.astype(jnp.float32)
    normed = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    scaled = weight.astype(x.dtype) * normed
    return (scaled.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Feed-forward


def swiglu(x: Array, gate_proj: Array, up_proj: Array, down_proj: Array) -> Array:
    """Dense SwiGLU MLP: down(silu(x @ gate) * (x @ up))."""
    return (jax.nn.silu(x @ gate_proj) * (x @ up_proj)) @ down_proj


def softmax_topk_router(
    x: Array, router: Array, top_k: int, *, renormalize: bool = True
) -> tuple[Array, Array]:
    """Softmax over all experts in float32, keep the top-k, optionally renormalise them to sum to one.

    Returns (weights [T, k] float32, expert ids [T, k] int32).
    """
    logits = jnp.dot(x, router.astype(x.dtype), preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


# Rows (token copies) from which the Pallas grouped matmul replaces ragged_dot on a GPU under impl="auto". XLA's GPU
# ragged_dot multiplies every row by every expert (E times the work: 256x at the 35B-A3B shape), so even a few
# rows (decode, a PIC request's seams and query) are better served by the kernel, which reads only the experts
# that own rows.
PALLAS_MOE_MIN_ROWS = 1
# The Pallas grouped matmul's tiling on the MoE path: None picks the benchmarked launch for the row count
# (`grouped_matmul.default_config`); a GMMConfig forces one.
MOE_GMM_CONFIG: gm.GMMConfig | None = None
MOE_IMPLS = ("auto", "ragged", "pallas")


def _use_pallas_moe(impl: str, num_rows: int) -> bool:
    if impl not in MOE_IMPLS:
        raise ValueError(f"MoE impl must be one of {MOE_IMPLS}, got {impl!r}")
    if impl == "auto":
        return jax.default_backend() == "gpu" and num_rows >= PALLAS_MOE_MIN_ROWS
    return impl == "pallas"


def grouped_swiglu_experts(
    x: Array, weights: Array, experts: Array, gate_up: Array, down: Array, *, impl: str = "auto",
    valid: Array | None = None,
) -> Array:
    """Routed SwiGLU experts as two grouped matmuls over expert-sorted token copies (`_grouped_swiglu_experts`).

    Under `jax.vmap` over tokens (a forward mapped over rows of requests) every row's tokens go through one grouped
    matmul as one list of tokens: an expert that several rows pick is read once per step, not
    once per row, and `ragged_dot` (no batching rule but over axis 0) never sees a batch axis. The tokens are
    independent, so this is the mapped function's own result; differentiation goes through the plain function.
    """
    flattening = _row_flattening(impl, valid is not None)
    return flattening(x, weights, experts, gate_up, down, *(() if valid is None else (valid,)))


@functools.lru_cache(maxsize=None)
def _row_flattening(impl: str, has_valid: bool):
    def plain(x, weights, experts, gate_up, down, *valid):
        return _grouped_swiglu_experts(x, weights, experts, gate_up, down, impl=impl, valid=valid[0] if valid else None)

    mapped = custom_batching.custom_vmap(plain)

    @mapped.def_vmap
    def rule(axis_size, in_batched, x, weights, experts, gate_up, down, *valid):
        if any(jax.tree.leaves(in_batched[3:5])):  # experts of each row's own: nothing to share
            axes = jax.tree.map(lambda b: 0 if b else None, tuple(in_batched))
            return jax.vmap(plain, in_axes=axes)(x, weights, experts, gate_up, down, *valid), True
        per_token = (x, weights, experts, *valid)
        batched = (in_batched[0], in_batched[1], in_batched[2], *in_batched[5:])
        rows = [(a if b else jnp.broadcast_to(a, (axis_size,) + a.shape)) for a, b in zip(per_token, batched)]
        tokens = x.shape[-2] if in_batched[0] else x.shape[0]
        flat = [a.reshape((axis_size * tokens,) + a.shape[2:]) for a in rows]
        out = mapped(flat[0], flat[1], flat[2], gate_up, down, *flat[3:])  # an outer map comes back here
        return out.reshape((axis_size, tokens) + out.shape[1:]), True

    smooth = jax.custom_jvp(mapped)
    smooth.defjvp(lambda primals, tangents: jax.jvp(plain, primals, tangents))
    return smooth


def _grouped_swiglu_experts(
    x: Array, weights: Array, experts: Array, gate_up: Array, down: Array, *, impl: str = "auto",
    valid: Array | None = None,
) -> Array:
    """Routed SwiGLU experts as two grouped matmuls over expert-sorted token copies.

    Each token is copied once per chosen expert and the copies are sorted by expert, so every expert sees one
    contiguous row group; no dense loop over experts. The grouped matmul is `jax.lax.ragged_dot` ("ragged") or, for
    long inputs on a GPU, the Pallas kernel of `hypic_jax.kernels.grouped_matmul` ("pallas"; XLA's GPU ragged_dot
    lowers to a dense dot over all experts). "auto" picks Pallas on a GPU from PALLAS_MOE_MIN_ROWS copies up. With
    Pallas, up to `grouped_matmul.layout.COPY_BLOCKS_MAX` copies (a decode step of a few rows; 0, off, by default)
    are not sorted: each gets a row block of its own (`copy_blocks`; bench/decode_step.py --moe-copy-blocks times
    both).
    Outputs are gathered back per (token, slot) and combined with the router weights in float32.

    Args:
      x: [T, H] tokens.  weights, experts: [T, k] router weights and expert ids.
      gate_up: [E, H, 2I] fused [gate | up] projections.  down: [E, I, H]. Either may be an `ExpertBank` (a
        scanned layer's experts in its pattern position's bank): the kernel then reads the bank in place
        (`layer_stack.with_experts`), ragged_dot takes a copy of the layer's experts. Either may be block-wise FP8
        (`fp8.BlockFP8`, its value and scale arrays or banks alike): the kernel reads values and scales
        (`grouped_matmul.gmm(scales=)`), ragged_dot takes the layer's experts dequantized into x's dtype.
      valid: [T] bool or None: tokens outside it (a bucket's padding) get zero outputs; with the Pallas kernel
        their copies go to a null expert whose row blocks are skipped, so padding costs no expert work.
    Returns:
      [T, H] in x's dtype.
    """
    num_tokens, top_k = experts.shape
    num_experts = gate_up.shape[0]
    num_rows = num_tokens * top_k
    if _use_pallas_moe(impl, num_rows):
        if num_rows <= gm.layout.COPY_BLOCKS_MAX:  # a decode step's few copies: one block each, no ranking
            config = MOE_GMM_CONFIG or gm.COPY_BLOCKS_CONFIG
            slot_rows, layout, padded_token = gm.copy_blocks(experts, config.block_m, valid)
        else:
            config = MOE_GMM_CONFIG or gm.default_config(num_rows)
            # padded row of each (token, slot) copy; a one-hot running count rather than two sorts for few copies
            if valid is None:
                slot_rows, layout = gm.copy_layout(experts, num_experts, config.block_m)
            else:  # expert id num_experts: the null expert, sorted last, its blocks marked -1 (never computed)
                null = jnp.where(valid[:, None], experts, num_experts)
                slot_rows, layout = gm.copy_layout(null, num_experts + 1, config.block_m)
                layout = layout._replace(block_expert=jnp.where(layout.block_expert == num_experts, -1,
                                                                layout.block_expert))
            padded_token = jnp.zeros((layout.num_padded,), jnp.int32).at[slot_rows].set(
                jnp.arange(num_rows, dtype=jnp.int32) // top_k
            )  # rows of padding blocks read token 0; their outputs are never gathered

        split = len(_expert_arrays(gate_up))

        def product(a, block_expert, arrays, like, **kw):  # arrays: (weights,), or FP8 (values, scales)
            scaled = dict(scales=arrays[1], scale_block=like.block) if fp8.is_fp8(like) else {}
            return gm.gmm(a, block_expert, arrays[0], config=config, **scaled, **kw)

        def routed(*flat):  # arrays, or `gm.ChunkedWeights` (the kernel picks the chunk); then the expert offset
            *flat, first = flat
            gate_ups, downs = flat[:split], flat[split:]
            block_expert = jnp.where(layout.block_expert >= 0, layout.block_expert + first, -1)
            if num_rows <= gm.FEW_ROWS_MAX:  # few copies (a PIC request's seams and query): the kernel gathers
                # each block's token rows and applies the activation itself (long prefills keep the separate
                # steps, the launch FEW_ROWS_CONFIG was not chosen for)
                act = product(x, block_expert, gate_ups, gate_up, rows=padded_token, swiglu=True)
            else:
                gate, up = jnp.split(product(x[padded_token], block_expert, gate_ups, gate_up), 2, axis=-1)
                act = jax.nn.silu(gate) * up
            return product(act, block_expert, downs, down)[slot_rows]

        def routed_chunks(*flat):
            *flat, chunk, first = flat
            return routed(*(gm.ChunkedWeights(chunks, chunk) for chunks in flat), first)

        per_slot = with_experts(routed, *_expert_arrays(gate_up), *_expert_arrays(down),
                                max_elements=BANK_MAX_ELEMENTS, chunked_fn=routed_chunks)
    else:
        gate_up, down = _layer_experts(gate_up, x.dtype), _layer_experts(down, x.dtype)
        order, inverse, group_sizes = gm.sorted_copies(experts.reshape(-1), num_experts)
        # outputs in the activation dtype (accumulation is float32 inside): the form XLA's cuDNN grouped GEMM takes
        rows = x[order // top_k]  # [T*k, H], grouped by expert
        hidden = jax.lax.ragged_dot(rows, gate_up, group_sizes, preferred_element_type=x.dtype)
        gate, up = jnp.split(hidden, 2, axis=-1)
        out_rows = jax.lax.ragged_dot(jax.nn.silu(gate) * up, down, group_sizes, preferred_element_type=x.dtype)
        per_slot = out_rows[inverse]
    per_slot = per_slot.reshape(num_tokens, top_k, -1)
    combined = jnp.einsum("tkh,tk->th", per_slot.astype(jnp.float32), weights.astype(jnp.float32))
    if valid is not None:  # skipped blocks hold whatever memory held: where, not a multiply
        combined = jnp.where(valid[:, None], combined, 0.0)
    return combined.astype(x.dtype)


def _expert_arrays(w) -> tuple:
    """The arrays (or banks) the grouped matmul reads of routed experts `w`: (w,), or for block-wise FP8 (values,
    scales), which `with_experts` then hands over alike."""
    return (w.value, w.scale) if fp8.is_fp8(w) else (w,)


def _layer_experts(w, dtype) -> Array:
    """A layer's routed experts as one array in `dtype`: a bank's copied out (`ExpertBank.materialize`), FP8
    dequantized (ragged_dot takes no scales)."""
    def own(a):
        return a.materialize() if isinstance(a, ExpertBank) else a

    if fp8.is_fp8(w):
        return fp8.dequantize(fp8.BlockFP8(own(w.value), own(w.scale), w.block, w.dtype), dtype)
    return own(w).astype(dtype)


def qwen_moe(x: Array, p: dict, *, top_k: int, renormalize: bool = True, impl: str = "auto",
             valid: Array | None = None) -> Array:
    """Qwen-style sparse MoE block: softmax top-k router, SwiGLU experts, sigmoid-gated shared expert.

    `p` holds router [H, E], gate_up [E, H, 2I], down [E, I, H], and optionally shared_gate_proj / shared_up_proj /
    shared_down_proj and shared_expert_gate [H, 1]. x is [..., H]; leading axes are flattened into tokens. valid:
    None or a bool mask of x's leading axes; the routed experts skip the tokens outside it (their routed part is
    zero; see `grouped_swiglu_experts`).
    """
    shape = x.shape
    tokens = x.reshape(-1, shape[-1])
    weights, experts = softmax_topk_router(tokens, p["router"], top_k, renormalize=renormalize)
    routed = grouped_swiglu_experts(tokens, weights, experts, p["gate_up"], p["down"], impl=impl,
                                    valid=None if valid is None else valid.reshape(-1))
    if "shared_gate_proj" in p:
        shared = swiglu(tokens, p["shared_gate_proj"], p["shared_up_proj"], p["shared_down_proj"])
        shared = jax.nn.sigmoid(tokens @ p["shared_expert_gate"]) * shared
        routed = routed + shared
    return routed.reshape(shape)


# ----------------------------------------------------------------------------------------------------------------
# Full attention


def gated_attention_projections(
    x: Array, p: dict, *, num_heads: int, num_kv_heads: int, head_dim: int, eps: float, norm_offset: float
) -> tuple[Array, Array, Array, Array]:
    """q/k/v/gate of Qwen's gated attention before RoPE: q_proj yields per head [query | gate]; q, k are RMS-normed."""
    batch, length, _ = x.shape
    q_and_gate = (x @ p["q_proj"]).reshape(batch, length, num_heads, 2 * head_dim)
    q, gate = q_and_gate[..., :head_dim], q_and_gate[..., head_dim:]
    k = (x @ p["k_proj"]).reshape(batch, length, num_kv_heads, head_dim)
    v = (x @ p["v_proj"]).reshape(batch, length, num_kv_heads, head_dim)
    q = rms_norm(q, p["q_norm"], eps, offset=norm_offset)
    k = rms_norm(k, p["k_norm"], eps, offset=norm_offset)
    return q, k, v, gate.reshape(batch, length, num_heads * head_dim)


def rope_batch(x: Array, positions: Array, *, rotary_dim: int, base: float) -> Array:
    """Apply NeoX partial RoPE to x [B, L, H, D] at positions [L] or [B, L]."""
    positions = jnp.broadcast_to(positions, x.shape[:2])
    return jax.vmap(lambda xb, pb: apply_rope(xb, pb, rotary_dim=rotary_dim, base=base))(x, positions)
