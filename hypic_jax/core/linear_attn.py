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
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from hypic_jax.kernels import compose as pallas_compose
from hypic_jax.kernels import gdn as pallas_gdn
from hypic_jax.core.rope import rotate_state_keys, rotation_matrix
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


def _state_dtype(*arrays: Array | None) -> jnp.dtype:
    """float32, or float64 when any input is float64 (x64 references)."""
    dtypes = [a.dtype for a in arrays if a is not None]
    return jnp.float64 if any(d == jnp.float64 for d in dtypes) else jnp.float32


# ----------------------------------------------------------------------------------------------------------------
# Argument checks (shapes are static under jit, so these run once at trace time).


def _check_chunk_size(chunk_size: Any) -> int:
    if not isinstance(chunk_size, numbers.Integral) or isinstance(chunk_size, bool) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    return int(chunk_size)


def _check_inputs(q, k, v, g, gk, beta, initial_state) -> tuple[int, int, int, int]:
    """Validate shapes; returns (L, H, K, V)."""
    if k is None or v is None:
        raise ValueError("k and v are required")
    if k.ndim != 3:
        raise ValueError(f"k must be [L, H, K], got shape {k.shape}")
    length, heads, key_dim = k.shape
    if v.ndim != 3 or v.shape[:2] != (length, heads):
        raise ValueError(f"v must be [L={length}, H={heads}, V], got shape {v.shape}")
    value_dim = v.shape[2]
    if q is not None and q.shape != k.shape:
        raise ValueError(f"q must have k's shape {k.shape}, got shape {q.shape}")
    if g is not None and g.shape != (length, heads):
        raise ValueError(f"g must be [L={length}, H={heads}], got shape {g.shape}")
    if gk is not None and gk.shape != k.shape:
        raise ValueError(f"gk must have k's shape {k.shape}, got shape {gk.shape}")
    if beta is not None and beta.shape != (length, heads):
        raise ValueError(f"beta must be [L={length}, H={heads}], got shape {beta.shape}")
    if initial_state is not None and initial_state.shape != (heads, key_dim, value_dim):
        raise ValueError(
            f"initial_state must be [H={heads}, K={key_dim}, V={value_dim}], got shape {initial_state.shape}"
        )
    return length, heads, key_dim, value_dim


# ----------------------------------------------------------------------------------------------------------------
# Token-by-token reference.


def recurrent(
    q: Array,
    k: Array,
    v: Array,
    *,
    g: Array | None = None,
    gk: Array | None = None,
    beta: Array | None = None,
    initial_state: Array | None = None,
    scale: float = 1.0,
) -> tuple[Array, Array]:
    """The recurrence one token at a time (the readable reference every fast path is checked against).

    q, k may have fewer heads than v (grouped key heads, each serving H_v / H_k consecutive value heads; repeated
    here). Returns (o [L, H, V] in the inputs' dtype, final_state [H, K, V] in float32/float64).
    """
    q, k = _ungrouped(q, k, v)
    length, heads, key_dim, value_dim = _check_inputs(q, k, v, g, gk, beta, initial_state)
    acc = _state_dtype(q, k, v, g, gk, beta, initial_state)
    state = (
        jnp.zeros((heads, key_dim, value_dim), acc) if initial_state is None else initial_state.astype(acc)
    )
    xs = dict(
        q=q.astype(acc),
        k=k.astype(acc),
        v=v.astype(acc),
        g=None if g is None else g.astype(acc),
        gk=None if gk is None else gk.astype(acc),
        beta=None if beta is None else beta.astype(acc),
    )

    def step(state, x):
        if x["g"] is not None:
            state = state * jnp.exp(x["g"])[:, None, None]
        if x["gk"] is not None:
            state = state * jnp.exp(x["gk"])[:, :, None]
        k_t, v_t = x["k"], x["v"]
        if x["beta"] is not None:  # S <- (I - b k k^T) S + b k v^T, written as a correction of v
            predicted = einsum("hkv,hk->hv", state, k_t)
            v_t = x["beta"][:, None] * (v_t - predicted)
        state = state + k_t[:, :, None] * v_t[:, None, :]
        out = einsum("hkv,hk->hv", state, x["q"])
        return state, out

    state, out = jax.lax.scan(step, state, xs)
    return (scale * out).astype(v.dtype), state


# ----------------------------------------------------------------------------------------------------------------
# Chunk-parallel form.
#
# Inside a chunk of c tokens, with b = cumsum(log decays) (per key channel, or one per head) and start state S0:
#   delta rule:   the per-token corrected values U satisfy (I + M) U = beta V - beta (K e^b) S0 with
#                 M_tj = beta_t k_t^T Diag(e^{b_t - b_j}) k_j (j < t, strictly lower), hence
#                 U = U~ - W S0,   U~ = (I + M)^-1 (beta V),   W = (I + M)^-1 (beta K e^b)   (the WY / UT form);
#   no delta:     U = V, W = 0.
#   outputs:      o = (Q e^b) S0 + P U,            P_tj = q_t^T Diag(e^{b_t - b_j}) k_j   (j <= t)
#   chunk state:  S_c = Diag(e^{b_c}) S0 + K^^T U,  K^_j = k_j e^{b_c - b_j}.
# Every exponent above is <= 0 (decays are <= 1), so nothing overflows however strong the decay is: the pairwise
# factors are formed from differences, never as e^{b_t} / e^{b_j}. The price for per-key decays is a [c, c, K]
# tensor per chunk and head, which is why those chunks are mapped in bounded batches (`_map_chunks`).


def _unit_lower_inverse(lower: Array) -> Array:
    """Inverse of small unit lower-triangular matrices [..., b, b], all at once, by recursive doubling.

    The inverses of the diagonal blocks of size s give those of size 2s through
    [[A, 0], [C, B]]^-1 = [[A^-1, 0], [-B^-1 C A^-1, B^-1]]: log2(b) levels of two batched products each. This is
    block forward substitution (the same rounding behaviour, unlike a Neumann series whose terms can be far larger
    than the inverse), with no loop: a row-by-row `fori_loop` would be b tiny kernels per call on a GPU, thousands per
    request, and library triangular solves run one small matrix at a time.
    """
    size = lower.shape[-1]
    padded = 1 << max(0, (size - 1).bit_length())
    if padded != size:  # identity rows and columns: the padded inverse holds the inverse as its leading block
        pad = padded - size
        lower = jnp.pad(lower, [(0, 0)] * (lower.ndim - 2) + [(0, pad), (0, pad)])
        lower = lower + jnp.diag(jnp.arange(padded) >= size).astype(lower.dtype)
    lead = lower.shape[:-2]
    inverse = jnp.ones(lead + (padded, 1, 1), lower.dtype)  # [..., blocks, s, s]: diagonal blocks' inverses
    s = 1
    while s < padded:
        pairs = padded // (2 * s)
        tiles = lower.reshape(lead + (pairs, 2 * s, pairs, 2 * s))
        coupling = jnp.stack([tiles[..., j, s:, j, :s] for j in range(pairs)], axis=-3)  # C of each new block
        first, second = inverse[..., 0::2, :, :], inverse[..., 1::2, :, :]
        corner = -einsum("...ij,...jk,...kl->...il", second, coupling, first)
        top = jnp.concatenate([first, jnp.zeros_like(first)], axis=-1)
        bottom = jnp.concatenate([corner, second], axis=-1)
        inverse = jnp.concatenate([top, bottom], axis=-2)
        s *= 2
    return inverse[..., 0, :size, :size]


def _unit_lower_solve(lower: Array, rhs: Array, block: int = 16) -> Array:
    """Solve L X = B for unit lower-triangular L [..., c, c] and B [..., c, n].

    Blocked: the diagonal b x b blocks are inverted in parallel (`_unit_lower_inverse`), then block forward
    substitution X_i = D_i^-1 (B_i - L[i, :i] X[:i]) takes c / b matmul steps. Sequential depth b + c / b instead
    of c. Not `lax.linalg.triangular_solve`: on the CPU its LAPACK kernel splits batches over XLA's intra-op
    thread pool and waits for them, so two solves running at once on a 2-thread pool can deadlock.
    """
    size = lower.shape[-1]
    if size <= block:
        return einsum("...ij,...jn->...in", _unit_lower_inverse(lower), rhs)
    blocks = -(-size // block)
    padded = blocks * block
    if padded != size:  # pad with identity rows / zero right-hand sides; the extra unknowns are zero
        pad = padded - size
        lower = jnp.pad(lower, [(0, 0)] * (lower.ndim - 2) + [(0, pad), (0, pad)])
        lower = lower + jnp.diag(jnp.arange(padded) >= size).astype(lower.dtype)
        rhs = jnp.pad(rhs, [(0, 0)] * (rhs.ndim - 2) + [(0, pad), (0, 0)])
    lead = lower.shape[:-2]
    tiles = lower.reshape(lead + (blocks, block, blocks, block))
    diagonal = jnp.stack([tiles[..., i, :, i, :] for i in range(blocks)], axis=-3)  # [..., nb, b, b]
    diagonal_inverse = _unit_lower_inverse(diagonal)
    solved = []
    for i in range(blocks):
        b_i = rhs[..., i * block : (i + 1) * block, :]
        if i:
            b_i = b_i - einsum("...ij,...jn->...in", lower[..., i * block : (i + 1) * block, : i * block],
                                jnp.concatenate(solved, axis=-2))
        solved.append(einsum("...ij,...jn->...in", diagonal_inverse[..., i, :, :], b_i))
    return jnp.concatenate(solved, axis=-2)[..., :size, :]


def chunk_locals(q, k, v, log_decay, beta, acc):
    """Everything a chunk needs that does not depend on its start state. Head-major inputs:

    q, k: [H, c, K] (q may be None), v: [H, c, V], log_decay: [H, c, D] with D = 1 (scalar) or K (per key) or
    None, beta: [H, c] or None.
    """
    heads, c, key_dim = k.shape
    causal = jnp.tril(jnp.ones((c, c), bool))
    if log_decay is None:
        b = jnp.zeros((heads, c, 1), acc)
    else:
        b = jnp.cumsum(log_decay, axis=1)
    b_last = b[:, -1]  # [H, D]
    diff = b[:, :, None, :] - b[:, None, :, :]  # [H, c(t), c(j), D]
    pair_decay = jnp.where(causal[None, :, :, None], jnp.exp(jnp.where(causal[None, :, :, None], diff, 0.0)), 0.0)
    per_key = b.shape[-1] > 1

    def pairwise(x):  # x_t^T Diag(e^{b_t - b_j}) k_j for j <= t
        if per_key:  # one fused multiply-reduce; a 3-operand einsum lowers to slower dot chains here
            return jnp.sum(x[:, :, None, :] * k[:, None, :, :] * pair_decay, axis=-1)
        return einsum("htk,hjk->htj", x, k) * pair_decay[..., 0]

    k_to_end = k * jnp.exp(b_last[:, None, :] - b)  # [H, c, K]
    if beta is not None:
        strict = pairwise(k) * (~jnp.eye(c, dtype=bool))
        lower = jnp.eye(c, dtype=acc) + beta[:, :, None] * strict
        rhs = jnp.concatenate([beta[:, :, None] * v, beta[:, :, None] * k * jnp.exp(b)], axis=-1)
        solved = _unit_lower_solve(lower, rhs)
        u, w = solved[..., : v.shape[-1]], solved[..., v.shape[-1] :]
    else:
        u, w = v, None
    locals_ = dict(u=u, w=w, k_to_end=k_to_end, chunk_decay=jnp.exp(b_last))
    if q is not None:
        locals_["q_decayed"] = q * jnp.exp(b)
        locals_["scores"] = pairwise(q)
    return locals_


def _map_chunks(fn: Callable, xs, per_chunk_elements: int, num_chunks: int):
    """vmap over chunks, in batches small enough that the per-chunk temporaries stay under ~2^27 elements."""
    budget = 1 << 27
    batch = max(1, min(num_chunks, budget // max(per_chunk_elements, 1)))
    if batch >= num_chunks:
        return jax.vmap(fn)(*xs)
    return jax.lax.map(lambda args: fn(*args), xs, batch_size=batch)


def log_decay_of(g: Array | None, gk: Array | None, acc) -> Array | None:
    """Per-token log decay [L, H, D] from a scalar gate g [L, H] (D = 1) and/or per-key gates gk [L, H, K] (D = K)."""
    if gk is not None:
        return gk.astype(acc) + (0.0 if g is None else g.astype(acc)[..., None])
    return None if g is None else g.astype(acc)[..., None]


def _chunk_scan(q, k, v, g, gk, beta, state, chunk_size, acc):
    """Shared engine of `chunked` and `summarize`: returns (outputs [L, H, Vs] or None, final state [H, K, Vs]).

    `v` may be narrower than the state (Vs >= V): extra state columns get zero values, which is how `summarize`
    carries the identity block that becomes T_C.
    """
    length, heads, key_dim = k.shape
    num_chunks = -(-length // chunk_size)
    padded = num_chunks * chunk_size
    state_width = state.shape[-1]

    def to_chunks(x):  # [L, H, ...] -> [N, H, c, ...], zero padded: padded tokens have A = I and add nothing
        if x is None:
            return None
        x = jnp.pad(x.astype(acc), [(0, padded - length)] + [(0, 0)] * (x.ndim - 1))
        x = x.reshape((num_chunks, chunk_size) + x.shape[1:])
        return jnp.moveaxis(x, 1, 2)

    if v.shape[-1] < state_width:
        v = jnp.pad(v, [(0, 0), (0, 0), (0, state_width - v.shape[-1])])
    log_decay = log_decay_of(g, gk, acc)
    chunks = (to_chunks(q), to_chunks(k), to_chunks(v), to_chunks(log_decay), to_chunks(beta))
    decay_width = 1 if log_decay is None else log_decay.shape[-1]
    per_chunk = heads * chunk_size * chunk_size * max(decay_width, 1)
    # absent inputs are None: empty PyTrees, which vmap and lax.map pass through untouched
    locals_ = _map_chunks(lambda *xs: chunk_locals(*xs, acc), chunks, per_chunk, num_chunks)

    def step(state, loc):
        u = loc["u"]
        if loc["w"] is not None:
            u = u - einsum("hck,hkv->hcv", loc["w"], state)
        out = None
        if "q_decayed" in loc:
            out = einsum("hck,hkv->hcv", loc["q_decayed"], state) + einsum("hcj,hjv->hcv", loc["scores"], u)
        state = loc["chunk_decay"][:, :, None] * state + einsum("hck,hcv->hkv", loc["k_to_end"], u)
        return state, out

    state, outs = jax.lax.scan(step, state, locals_)
    if outs is None:
        return None, state
    outs = jnp.moveaxis(outs, 1, 2).reshape(padded, heads, state_width)[:length]
    return outs, state


def chunk_step(k: Array, v: Array, *, g: Array | None = None, gk: Array | None = None,
               beta: Array | None = None) -> tuple[Array, Array, Array, Array]:
    """A span of L tokens taken as one chunk: the operands of its state map
    state -> Diag(decay) state + k_to_end^T (u - w state), the step `chunked` takes per chunk.

    k [L, H, K], v [L, H, V] and the family's gates. Returns float32 (w [H, L, K] (zeros without a delta rule),
    u [H, L, V], k_to_end [H, L, K], decay [H, K]). This is how the PIC engine feeds a short fresh seam into the
    fold over cached interiors (`hypic_jax.kernels.piece_fold`) without forming its dense transfer.
    """
    return span_chunk(None, k, v, g=g, gk=gk, beta=beta)[:4]


class SpanChunk(NamedTuple):
    """One span taken as one chunk (`span_chunk`): the state map's operands (as `chunk_step`) and, when the
    queries were given, what the span's outputs need: q_decayed [H, L, K] and the causal scores [H, L, L]."""

    w: Array
    u: Array
    k_to_end: Array
    decay: Array
    q_decayed: Array | None = None
    scores: Array | None = None


def span_chunk(q: Array | None, k: Array, v: Array, *, g: Array | None = None, gk: Array | None = None,
               beta: Array | None = None) -> SpanChunk:
    """`chunk_step`, plus the output operands when q [L, H, K] is given: one chunk-local pass (the unit-lower
    solve included) serves both the span's state map and, through `span_chunk_outputs`, its outputs from any
    incoming state. The PIC engine computes each short seam this way once, feeds the state map to the fold and
    then reads the seam's outputs from the state the fold gives it (instead of a second `chunked` pass)."""
    length, heads, key_dim = k.shape
    acc = _state_dtype(q, k, v, g, gk, beta)
    log_decay = log_decay_of(g, gk, acc)
    head_major = lambda x: None if x is None else jnp.moveaxis(x.astype(acc), 0, 1)  # noqa: E731
    loc = chunk_locals(head_major(q), head_major(k), head_major(v), head_major(log_decay), head_major(beta), acc)
    w = loc["w"] if loc["w"] is not None else jnp.zeros((heads, length, key_dim), acc)
    decay = jnp.broadcast_to(loc["chunk_decay"], (heads, key_dim))
    return SpanChunk(w, loc["u"], loc["k_to_end"], decay, loc.get("q_decayed"), loc.get("scores"))


def span_chunk_outputs(chunk: SpanChunk, state: Array, scale: float = 1.0,
                       out_dtype=None) -> tuple[Array, Array]:
    """The span's outputs [L, H, V] (scaled, in `out_dtype`) and its final state [H, K, V] from `state`: the
    per-chunk step of `chunked` for a span that is one chunk."""
    if chunk.q_decayed is None:
        raise ValueError("span_chunk_outputs needs a SpanChunk built with the queries (span_chunk(q, ...))")
    state = state.astype(chunk.u.dtype)
    u = chunk.u - einsum("hck,hkv->hcv", chunk.w, state)
    out = einsum("hck,hkv->hcv", chunk.q_decayed, state) + einsum("hcj,hjv->hcv", chunk.scores, u)
    final = chunk.decay[:, :, None] * state + einsum("hck,hcv->hkv", chunk.k_to_end, u)
    out = scale * jnp.moveaxis(out, 0, 1)
    return (out if out_dtype is None else out.astype(out_dtype)), final


def _kernel_width(dim: int) -> int:
    """The smallest power of two >= 16 holding `dim`: the tile width the Pallas kernels need."""
    return max(16, 1 << max(0, dim - 1).bit_length())


def _kernel_problem(q, k, v, gk) -> str | None:
    """Why the Pallas kernels cannot take these inputs even after padding K and V, or None when they can."""
    if q is None:
        return "the kernels need q"
    if k.shape[0] == 0:
        return "the sequence is empty"
    if v.shape[1] % k.shape[1]:
        return f"key heads {k.shape[1]} do not divide value heads {v.shape[1]}"
    if gk is not None and gk.shape != (k.shape[0], v.shape[1], k.shape[2]):
        return f"gk must be [L, H, K] = {(k.shape[0], v.shape[1], k.shape[2])}, got shape {gk.shape}"
    return None


def _use_kernel(impl: str, q, k, v, gk) -> bool:
    """The dispatch of `chunked` and `summarize`: "pallas" always (a ValueError naming the problem when the
    kernels cannot take the inputs), "auto" for bfloat16 inputs on a GPU when they can, "xla" never."""
    if impl not in ("xla", "pallas", "auto"):
        raise ValueError(f"impl must be 'xla', 'pallas' or 'auto', got {impl!r}")
    if impl == "xla":
        return False
    problem = _kernel_problem(q, k, v, gk)
    if impl == "pallas":
        if problem is not None:
            raise ValueError(f"impl='pallas' cannot take these inputs: {problem}")
        return True
    return problem is None and k.dtype == jnp.bfloat16 and not pallas_gdn.default_interpret()


def _kernel_forward(q, k, v, g, gk, beta, initial_state, scale, emit_summary):
    """`pallas.gdn.gdn_forward` at any K and V: zero-padded to the kernels' tile widths, sliced back.

    Padding is exact for every family. Padded key channels have zero q and k entries and log gate gk = 0, so their
    state rows start at zero and stay there, the delta rule's k k^T is block-diagonal (the real block unchanged)
    and the transfer's real block is the unpadded T. Padded value channels have zero values, so their output and
    state columns stay zero. The initial state is padded with zeros.
    """
    key_dim, value_dim = k.shape[-1], v.shape[-1]
    pad_k, pad_v = _kernel_width(key_dim) - key_dim, _kernel_width(value_dim) - value_dim
    if pad_k or pad_v:
        def widen(x, n):  # zeros at the end of the last axis
            return x if x is None or not n else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, n)])

        q, k, gk, v = widen(q, pad_k), widen(k, pad_k), widen(gk, pad_k), widen(v, pad_v)
        if initial_state is not None:
            initial_state = jnp.pad(initial_state, [(0, 0), (0, pad_k), (0, pad_v)])
    result = pallas_gdn.gdn_forward(q, k, v, g=g, gk=gk, beta=beta, initial_state=initial_state, scale=scale,
                                    emit_summary=emit_summary)
    if not (pad_k or pad_v):
        return result
    o, state = result[0][..., :value_dim], result[1][:, :key_dim, :value_dim]
    if not emit_summary:
        return o, state
    summary = result[2]
    transfer = summary.transfer
    if summary.form == "dense":
        transfer = transfer[:, :key_dim, :key_dim]
    elif summary.form == "diagonal":
        transfer = transfer[:, :key_dim]
    return o, state, Summary(summary.form, summary.state[:, :key_dim, :value_dim], transfer)


def chunked(
    q: Array,
    k: Array,
    v: Array,
    *,
    g: Array | None = None,
    gk: Array | None = None,
    beta: Array | None = None,
    initial_state: Array | None = None,
    scale: float = 1.0,
    chunk_size: int = 64,
    impl: str = "xla",
) -> tuple[Array, Array]:
    """Chunk-parallel form of `recurrent` (WY/UT form for delta rules); any length L.

    Intra-chunk work is one batch of small matmuls over all chunks; only the [H, K, V] state crosses chunks, in a
    `lax.scan` of two matmuls per chunk. Returns (o [L, H, V], final_state [H, K, V]).

    impl: "xla" (this pure-JAX path), "pallas" (the `hypic_jax.kernels.gdn` kernels: every family, scalar or
    per-key gates; interpret mode off a GPU) or "auto" (the kernels on a GPU for bfloat16 inputs, where they run at
    flash-linear-attention's precision, else this path). The kernels tile K and V in powers of two >= 16; other
    widths are zero-padded up to one and the results sliced back, which is exact (`_kernel_forward`). They refuse
    an empty sequence (a ValueError for "pallas"; "auto" takes this path). The kernels use their own tiling
    (`pallas.gdn.default_config`); `chunk_size` is this path's (results agree up to rounding). q, k may have fewer
    heads than v (grouped key heads, as in `recurrent`): the kernels read them grouped, this path repeats them.
    """
    chunk_size = _check_chunk_size(chunk_size)
    if k is not None and v is not None and k.ndim == v.ndim == 3 and k.shape[1] != v.shape[1] \
            and _use_kernel(impl, q, k, v, gk):
        return _kernel_forward(q, k, v, g, gk, beta, initial_state, scale, emit_summary=False)
    q, k = _ungrouped(q, k, v)
    length, heads, key_dim, value_dim = _check_inputs(q, k, v, g, gk, beta, initial_state)
    if _use_kernel(impl, q, k, v, gk):
        return _kernel_forward(q, k, v, g, gk, beta, initial_state, scale, emit_summary=False)
    acc = _state_dtype(q, k, v, g, gk, beta, initial_state)
    state = (
        jnp.zeros((heads, key_dim, value_dim), acc) if initial_state is None else initial_state.astype(acc)
    )
    out_dtype = v.dtype
    if length == 0:
        return jnp.zeros((0, heads, value_dim), out_dtype), state
    out, state = _chunk_scan(q, k, v, g, gk, beta, state, chunk_size, acc)
    return (scale * out).astype(out_dtype), state


def summarize(
    k: Array,
    v: Array,
    *,
    g: Array | None = None,
    gk: Array | None = None,
    beta: Array | None = None,
    chunk_size: int = 64,
    impl: str = "xla",
) -> Summary:
    """The segment's pair (T_C, S(C|0)).

    Scalar and diagonal transfers are sums of log gates. The dense transfer of a delta rule comes from the same
    chunked pass with the state widened by an identity block, [S | M] with M_0 = I and zero values in the extra
    columns: M evolves as M_t = A_t M_{t-1}, so one pass returns [S(C|0) | T_C] (a second pass from identity would
    redo the intra-chunk solves).

    impl: as in `chunked`. "pallas" runs `pallas.gdn.gdn_forward(..., emit_summary=True)` with zero queries (the
    summary does not read them; the outputs are discarded), K and V padded as there; its summary is float32.
    """
    chunk_size = _check_chunk_size(chunk_size)
    length, heads, key_dim, value_dim = _check_inputs(None, k, v, g, gk, beta, None)
    q = None if impl == "xla" else jnp.zeros(k.shape, k.dtype)  # the kernels take queries; the summary reads none
    if _use_kernel(impl, q, k, v, gk):
        return _kernel_forward(q, k, v, g, gk, beta, None, 1.0, emit_summary=True)[2]
    acc = _state_dtype(k, v, g, gk, beta)
    form = transfer_form(g=g, gk=gk, beta=beta)
    zeros = jnp.zeros((heads, key_dim, value_dim), acc)
    if form == "dense":
        eye = jnp.broadcast_to(jnp.eye(key_dim, dtype=acc), (heads, key_dim, key_dim))
        widened = jnp.concatenate([zeros, eye], axis=-1)
        if length == 0:
            final = widened
        else:
            _, final = _chunk_scan(None, k, v, g, gk, beta, widened, chunk_size, acc)
        return Summary("dense", final[..., :value_dim], final[..., value_dim:])
    state = zeros if length == 0 else _chunk_scan(None, k, v, g, gk, beta, zeros, chunk_size, acc)[1]
    if form == "identity":
        return Summary("identity", state, None)
    if form == "scalar":
        return Summary("scalar", state, jnp.sum(g.astype(acc), axis=0))
    log_diag = jnp.sum(gk.astype(acc), axis=0)
    if g is not None:
        log_diag = log_diag + jnp.sum(g.astype(acc), axis=0)[:, None]
    return Summary("diagonal", state, log_diag)


# ----------------------------------------------------------------------------------------------------------------
# Many summaries: the states at every boundary, the state after all of them, rotation.

PREFIX_IMPLS = ("associative", "fold", "pallas")


def prefix_states(summaries: Summary, initial_state: Array | None = None, *, algorithm: str | None = None,
                  impl: str = "associative", block: int | None = None) -> Array:
    """The state after each of n stacked summaries (leading axis n), from `initial_state` (zeros if None).

    impl:
      "associative"  one `jax.lax.associative_scan` of `compose` (depth O(log n)) builds every prefix pair, then
                     each is applied to the initial state. Any form.
      "fold"         for dense transfers, a sequential `lax.scan` of S_i = T_i S_{i-1} + S_i: n state products
                     instead of the ~2n pair compositions (each two products) of the scan, at depth n.
      "pallas"       for dense transfers, the fold in Pallas (`pallas.compose.prefix_fold_pallas`; GPU, or
                     interpret mode; `block` cuts it into blocks of that size, 0 about sqrt(n)): the PIC engine's
                     choice on a GPU, where the scan's 2 log2 n levels of small launches and its
                     transfer-by-transfer products cost more. State widths that Triton cannot tile (not powers of
                     two >= 16) take "fold" on a GPU.
    Non-dense forms always use the scan (their compositions are elementwise). Returns [n, ..., H, K, V].
    `algorithm`: the dense products' dot algorithm (see `compose`).
    """
    if summaries.state.ndim < 4:
        raise ValueError(f"summaries must be stacked along a leading axis, got state shape {summaries.state.shape}")
    if impl not in PREFIX_IMPLS:
        raise ValueError(f"impl must be one of {PREFIX_IMPLS}, got {impl!r}")
    if impl != "associative" and summaries.form == "dense":
        tiles_ok = all(n >= 16 and not n & (n - 1) for n in summaries.state.shape[-2:])
        if impl == "pallas" and (tiles_ok or jax.default_backend() != "gpu"):  # else the XLA fold below
            config = pallas_compose.FoldConfig(algorithm=algorithm or "f32")
            interpret = jax.default_backend() != "gpu"
            return pallas_compose.prefix_fold_pallas(summaries.transfer, summaries.state, initial_state, config=config,
                                      block=block, interpret=interpret)
        states = summaries.state
        if initial_state is not None:  # fold the initial state into the first segment's zero-start state
            first = advance(jax.tree.map(lambda a: a[0], summaries), initial_state)
            states = states.at[0].set(first)

        def step(state, pair):
            transfer, zero_start = pair
            state = dense_product(transfer, state, algorithm) + zero_start
            return state, state

        return jax.lax.scan(step, jnp.zeros_like(states[0]), (summaries.transfer, states))[1]
    prefixes = jax.lax.associative_scan(functools.partial(compose, algorithm=algorithm), summaries, axis=0)
    if initial_state is None:
        return prefixes.state
    return advance(prefixes, jnp.broadcast_to(initial_state, summaries.state.shape[1:]))


def composed_state(summaries: Summary, initial_state: Array | None = None, *, algorithm: str | None = None,
                   impl: str = "associative") -> Array:
    """The state after all n stacked summaries (leading axis n), from `initial_state` (zeros if None): what
    resuming after n cached segments needs, without the composed transfer or the states in between.

    impl as in `prefix_states`; "pallas" (dense transfers) runs `pallas.compose.fold_pallas` without the transfer
    columns, one program per whole state, every batch entry (layers, heads) in one launch, which costs less than
    every prefix state (bench/kernels.py measures both; see bench/RESULTS.md). Returns [..., H, K, V].
    """
    if summaries.state.ndim < 4:
        raise ValueError(f"summaries must be stacked along a leading axis, got state shape {summaries.state.shape}")
    if impl not in PREFIX_IMPLS:
        raise ValueError(f"impl must be one of {PREFIX_IMPLS}, got {impl!r}")
    tiles_ok = all(n >= 16 and not n & (n - 1) for n in summaries.state.shape[-2:])
    if impl == "pallas" and summaries.form == "dense" and (tiles_ok or jax.default_backend() != "gpu"):
        states = summaries.state
        if initial_state is not None:  # fold the initial state into the first segment's zero-start state
            states = states.at[0].set(advance(jax.tree.map(lambda a: a[0], summaries), initial_state))
        config = dataclasses.replace(pallas_compose.FINAL_STATE_CONFIG, algorithm=algorithm or "f32")
        return pallas_compose.fold_pallas(summaries.transfer, states, with_transfer=False, config=config,
                                          interpret=jax.default_backend() != "gpu")[1]
    return prefix_states(summaries, initial_state, algorithm=algorithm, impl=impl)[-1]


def rotate_summary(summary: Summary, offset, *, rotary_dim: int | None = None, base: float = 10000.0) -> Summary:
    """Move a summary built from RoPE'd keys at canonical position 0 to position `offset`.

    Keys rotated by R(offset) turn every A_t into R A_t R^T, so the pair becomes (R T R^T, R S). Identity and
    scalar transfers commute with R and stay as they are; diagonal and dense ones become dense.
    """
    state = rotate_state_keys(summary.state, offset, rotary_dim=rotary_dim, base=base)
    if summary.form in ("identity", "scalar"):
        return Summary(summary.form, state, summary.transfer)
    rot = rotation_matrix(offset, summary.state.shape[-2], rotary_dim=rotary_dim, base=base)
    transfer = einsum("kj,...jn,mn->...km", rot, dense_transfer(summary), rot)
    return Summary("dense", state, transfer)


# ----------------------------------------------------------------------------------------------------------------
# References of the Pallas entry points that have no single-sequence counterpart here (tests and benchmarks check
# the kernels against them).


def varlen_reference(q, k, v, cu_seqlens, *, g=None, gk=None, beta=None, scale=1.0, max_len: int | None = None,
                     chunk_size: int = 16):
    """`pallas.gdn.gdn_varlen` through the core: segments gathered into [N, max_len] rows (zero padded at the end,
    which adds nothing), `chunked` and `summarize` vmapped over them, outputs scattered back. Key heads are
    repeated to the value heads. Returns (o [L, H, V] float32, Summary over N)."""
    length, heads = v.shape[:2]
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    n_seg = cu.shape[0] - 1
    if max_len is None:
        max_len = int(np.max(np.diff(np.asarray(cu_seqlens)))) if n_seg else 1
    max_len = max(max_len, 1)
    group = heads // k.shape[1]
    up = lambda x: None if x is None else x.astype(jnp.float32)  # noqa: E731
    q, k = jnp.repeat(up(q), group, 1), jnp.repeat(up(k), group, 1)
    v, g, gk, beta = up(v), up(g), up(gk), up(beta)
    lens = cu[1:] - cu[:-1]
    offs = jnp.arange(max_len, dtype=jnp.int32)
    idx = jnp.where(offs[None, :] < lens[:, None], cu[:-1, None] + offs[None, :], length)  # [N, max_len]

    def rows(x):
        if x is None:
            return None
        return jnp.concatenate([x, jnp.zeros((1,) + x.shape[1:], x.dtype)])[idx]

    def one(q, k, v, g, gk, beta):
        o, _ = chunked(q, k, v, g=g, gk=gk, beta=beta, scale=scale, chunk_size=chunk_size)
        return o, summarize(k, v, g=g, gk=gk, beta=beta, chunk_size=chunk_size)

    o_rows, summary = jax.vmap(one)(*map(rows, (q, k, v, g, gk, beta)))
    tokens = jnp.arange(length, dtype=jnp.int32)
    seg = jnp.minimum(jnp.searchsorted(cu[1:], tokens, side="right"), n_seg - 1)
    return o_rows[seg, tokens - cu[seg]], summary


# ----------------------------------------------------------------------------------------------------------------
# Families.


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


def _ungrouped(q: Array | None, k: Array | None, v: Array | None) -> tuple[Array | None, Array | None]:
    """q, k repeated to v's heads when they hold fewer (grouped key heads); as they are otherwise (also when the
    shapes are wrong: `_check_inputs` names the problem)."""
    if k is None or v is None or k.ndim != 3 or v.ndim != 3 or k.shape[1] == v.shape[1] or v.shape[1] % k.shape[1]:
        return q, k
    heads = v.shape[1]
    return (None if q is None else _repeat_heads(q, heads, "q")), _repeat_heads(k, heads, "k")


def _repeat_heads(x: Array, heads: int, name: str) -> Array:
    """Repeat each of x's head groups [L, Hg, ...] to `heads` consecutive heads (repeat_interleave)."""
    groups = x.shape[1]
    if heads % groups:
        raise ValueError(f"{name} has {groups} heads, which does not divide the {heads} value heads")
    return jnp.repeat(x, heads // groups, axis=1) if groups != heads else x


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
