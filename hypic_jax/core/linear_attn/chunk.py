"""The chunk-parallel form of the recurrence (WY / UT form for delta rules), and the segment summary it yields.

Inside a chunk of c tokens, with b = cumsum(log decays) (per key channel, or one per head) and start state S0:

    delta rule:   the per-token corrected values U satisfy (I + M) U = beta V - beta (K e^b) S0 with
                  M_tj = beta_t k_t^T Diag(e^{b_t - b_j}) k_j (j < t, strictly lower), hence
                  U = U~ - W S0,   U~ = (I + M)^-1 (beta V),   W = (I + M)^-1 (beta K e^b)   (the WY / UT form);
    no delta:     U = V, W = 0.
    outputs:      o = (Q e^b) S0 + P U,            P_tj = q_t^T Diag(e^{b_t - b_j}) k_j   (j <= t)
    chunk state:  S_c = Diag(e^{b_c}) S0 + K^^T U,  K^_j = k_j e^{b_c - b_j}.

Every exponent above is <= 0 (decays are <= 1), so nothing overflows however strong the decay is: the pairwise
factors are formed from differences, never as e^{b_t} / e^{b_j}. The price for per-key decays is a [c, c, K]
tensor per chunk and head, which is why those chunks are mapped in bounded batches (`_map_chunks`).

`chunked` gives a sequence's outputs and final state, `summarize` its pair (T_C, S(C|0)); both run the same chunk
scan (`_chunk_scan`), and both can hand their inputs to the Pallas kernels instead (`impl`, the `kernel` module).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import Array

from hypic_jax.core.linear_attn.common import (_check_chunk_size, _check_inputs, _state_dtype, _ungrouped,
                                               log_decay_of)
from hypic_jax.core.linear_attn.kernel import _kernel_forward, _use_kernel
from hypic_jax.core.summary import Summary, einsum, transfer_form


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
        if per_key:  # one fused multiply-reduce (a 3-operand einsum would lower to a chain of dots)
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
