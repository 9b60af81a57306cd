"""The transfer-operator core: one recurrence for every linear-attention family, and its segment summaries.

Every family runs

    S_t = A_t S_{t-1} + b_t k_t v_t^T,    A_t = (I - beta_t k_t k_t^T) Diag(exp(gk_t)) exp(g_t),
    o_t = scale * S_t^T q_t                (read after the update)

with b_t = beta_t when the delta rule is on (beta given) and 1 otherwise. Per head the state S is [K, V].

Because the map S_0 -> S_|C| is affine, a segment C is fully described by the pair

    (T_C, S(C|0)),    T_C = A_|C| ... A_1,    S(C|S_0) = T_C S_0 + S(C|0),

which depends on the segment's own tokens only. Pairs compose associatively, (T2, S2) o (T1, S1) =
(T2 T1, T2 S1 + S2), so the states at all segment boundaries come from one `jax.lax.associative_scan`.
T_C is kept in the cheapest exact form: identity (plain linear attention), one scalar per head (RetNet,
lightning, Mamba2), a diagonal (GLA) or a dense [K, K] matrix (delta rules). Scalar and diagonal forms are stored
as logs, so composing them is an exact sum and no dense matrix is ever built for them.

Conventions: one sequence per call (`q, k: [L, H, K]`, `v: [L, H, V]`, `g, beta: [L, H]`, `gk: [L, H, K]`,
state `[H, K, V]`); batch with `jax.vmap`. States and transfers are float32 (float64 when the inputs are float64
and x64 is on); outputs come back in v's dtype.

Modules: `naive` (the token-by-token reference), `chunk` (the chunk-parallel form and `summarize`), `kernel` (its
dispatch to the Pallas kernels), `span` (a span as one chunk: state-map operands and outputs), `prefix` (many
summaries: boundary states, rotation), `families` (each family's gates in the common form), `varlen` (references
of the packed-segment kernels), `common` (checks and helpers they share).
"""

from hypic_jax.core.linear_attn.chunk import chunk_locals, chunked, summarize
from hypic_jax.core.linear_attn.common import log_decay_of
from hypic_jax.core.linear_attn.families import (LinearInputs, alibi_slopes, delta_net, gated_delta_net, gla, kda,
                                                 l2_normalize, lightning, linear_attention, mamba2, retnet,
                                                 retnet_decays)
from hypic_jax.core.linear_attn.naive import recurrent
from hypic_jax.core.linear_attn.prefix import PREFIX_IMPLS, composed_state, prefix_states, rotate_summary
from hypic_jax.core.linear_attn.span import SpanChunk, chunk_step, span_chunk, span_chunk_outputs
from hypic_jax.core.linear_attn.varlen import varlen_reference
from hypic_jax.core.rope import rotate_state_keys
from hypic_jax.core.summary import (FORMS, Summary, advance, compose, dense_product, dense_transfer, einsum, promote,
                                    stack_summaries, transfer_form)

__all__ = [
    "Summary",
    "LinearInputs",
    "SpanChunk",
    "span_chunk",
    "span_chunk_outputs",
    "chunk_step",
    "recurrent",
    "chunked",
    "summarize",
    "dense_transfer",
    "advance",
    "compose",
    "prefix_states",
    "composed_state",
    "PREFIX_IMPLS",
    "promote",
    "stack_summaries",
    "rotate_summary",
    "transfer_form",
    "linear_attention",
    "retnet",
    "retnet_decays",
    "lightning",
    "alibi_slopes",
    "mamba2",
    "gla",
    "delta_net",
    "gated_delta_net",
    "kda",
    "l2_normalize",
    "rotate_state_keys",
    "varlen_reference",
]
