"""Pure-JAX references of the chunked-forward kernels, with the kernels' own signatures: what each computes,
token by token or chunk by chunk in float32 (HIGHEST precision), for the tests and benchmarks that check them.

    gdn_forward_reference       `gdn_forward`: the recurrence token by token, and the summary (T_C, S(C|0))
    gdn_varlen_reference        `gdn_varlen`: the same over packed segments (resets, own initial states, carries)
    chunk_locals_reference      `chunk_local.chunk_locals` / `mosaic_chunk_local.chunk_locals_mgpu`: P, W, U
    state_pass_reference        `mosaic_state.state_pass_mgpu` (and `state.state_pass`, one piece): o and S
    transfer_pass_reference     `mosaic_state.transfer_pass_mgpu`: each group's product of chunk transfers

The recurrence (value head h reads key head h // (H / Hk)):

    S_t = (I - beta_t k_t k_t^T) Diag(e^{gk_t}) e^{g_t} S_{t-1} + beta_t k_t v_t^T,    o_t = scale S_t^T q_t

(no beta: S_t = Diag(e^{gk_t}) e^{g_t} S_{t-1} + k_t v_t^T). A segment's summary is the affine map S -> T_C S +
S(C|0) of its tokens: T_C = A_L ... A_1 with A_t = (I - beta_t k_t k_t^T) Diag(e^{gk_t}) e^{g_t}, which the same
recurrence yields from identity columns with zero values, and S(C|0) its state from zero.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import Array, lax

from hypic_jax.core.summary import Summary, transfer_form

__all__ = ["gdn_forward_reference", "gdn_varlen_reference", "chunk_locals_reference", "state_pass_reference",
           "transfer_pass_reference"]

_HI = lax.Precision.HIGHEST
_f32 = functools.partial(jnp.asarray, dtype=jnp.float32)


def _einsum(spec, *operands):
    return jnp.einsum(spec, *operands, precision=_HI)


def _heads(x, heads: int, axis: int = 1):
    """Key-head operands repeated to the value heads (float32)."""
    return jnp.repeat(_f32(x), heads // x.shape[axis], axis=axis)


def _decays(g, gk, length, heads, key_dim):
    """Per-token log decay per key channel [L, H, K] (zeros for absent gates)."""
    log = jnp.zeros((length, heads, key_dim), jnp.float32)
    if gk is not None:
        log = log + _f32(gk)
    if g is not None:
        log = log + _f32(g)[..., None]
    return log


def _step(state, token, *, delta, scale):
    """One token: the decay, the (delta-rule) write and the read, for every head. state [H, K, W]."""
    q_t, k_t, v_t, log_t, beta_t = token
    state = jnp.exp(log_t)[..., None] * state
    if delta:
        v_t = beta_t[:, None] * (v_t - _einsum("hk,hkw->hw", k_t, state))
    state = state + k_t[..., None] * v_t[:, None, :]
    return state, scale * _einsum("hk,hkw->hw", q_t, state)


def _summary(k, v, log, beta, g, gk, delta):
    """The zero-start summary of one segment (float32 operands at the value heads)."""
    heads, key_dim, value_dim = v.shape[1], k.shape[-1], v.shape[-1]
    if not delta:
        form = transfer_form(g=g, gk=gk)
        state, _ = lax.scan(functools.partial(_step, delta=False, scale=1.0),
                            jnp.zeros((heads, key_dim, value_dim), jnp.float32), (k, k, v, log, beta))
        if form == "identity":
            return Summary(form, state)
        if form == "scalar":
            return Summary(form, state, jnp.sum(_f32(g), axis=0))
        return Summary(form, state, jnp.sum(log, axis=0))
    zero = jnp.zeros((heads, key_dim, key_dim + value_dim), jnp.float32)
    widened = zero.at[:, :, value_dim:].set(jnp.eye(key_dim, dtype=jnp.float32))
    values = jnp.concatenate([v, jnp.zeros(v.shape[:2] + (key_dim,), jnp.float32)], axis=-1)
    final, _ = lax.scan(functools.partial(_step, delta=True, scale=1.0), widened, (k, k, values, log, beta))
    return Summary("dense", final[..., :value_dim], final[..., value_dim:])


@functools.partial(jax.jit, static_argnames=("scale", "emit_summary"))
def gdn_forward_reference(q: Array, k: Array, v: Array, *, g: Array | None = None, beta: Array | None = None,
                          gk: Array | None = None, initial_state: Array | None = None, scale: float = 1.0,
                          emit_summary: bool = False):
    """`gdn_forward`'s arguments and results, token by token in float32: (o [L, H, V] float32, final state
    [H, K, V]) or, with emit_summary, (o, state, the zero-start `Summary` of the sequence)."""
    length, heads, value_dim = v.shape
    key_dim = k.shape[-1]
    qh, kh, vh = _heads(q, heads), _heads(k, heads), _f32(v)
    log = _decays(g, gk, length, heads, key_dim)
    delta = beta is not None
    betas = _f32(beta) if delta else jnp.zeros((length, heads), jnp.float32)
    state0 = (jnp.zeros((heads, key_dim, value_dim), jnp.float32) if initial_state is None
              else _f32(initial_state))
    state, o = lax.scan(functools.partial(_step, delta=delta, scale=scale), state0, (qh, kh, vh, log, betas))
    if not emit_summary:
        return o, state
    return o, state, _summary(kh, vh, log, betas, g, gk, delta)


@functools.partial(jax.jit, static_argnames=("scale", "emit_summary"))
def gdn_varlen_reference(q: Array, k: Array, v: Array, cu_seqlens, *, g: Array | None = None,
                         gk: Array | None = None, beta: Array | None = None, scale: float = 1.0,
                         emit_summary: bool = True, initial_state: Array | None = None,
                         continues: Array | None = None):
    """`gdn_varlen`'s arguments and results, token by token in float32, as one scan over the packed tokens: at a
    segment's first token the state restarts from zero, from the segment's row of `initial_state`, or (where
    `continues`) carries on; an empty segment's end state is its initial state (zero without one), its summary
    (zero state, identity). Returns (o [L, H, V] float32, the segments' `Summary` over N) with emit_summary, else
    (o, end states [N, H, K, V]). Tokens from cu[N] on belong to no segment (their outputs are not defined)."""
    length, heads, value_dim = v.shape
    key_dim = k.shape[-1]
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    n_seg = cu.shape[0] - 1
    tokens = jnp.arange(length, dtype=jnp.int32)
    seg = jnp.minimum(jnp.searchsorted(cu[1:], tokens, side="right").astype(jnp.int32), n_seg - 1)
    first = (tokens == cu[seg]) & (tokens < cu[n_seg])
    lens = cu[1:] - cu[:-1]
    qh, kh, vh = _heads(q, heads), _heads(k, heads), _f32(v)
    log = _decays(g, gk, length, heads, key_dim)
    delta = beta is not None
    betas = _f32(beta) if delta else jnp.zeros((length, heads), jnp.float32)
    zero = jnp.zeros((heads, key_dim, value_dim), jnp.float32)
    inits = jnp.zeros((n_seg, heads, key_dim, value_dim), jnp.float32) if initial_state is None else _f32(
        initial_state)
    carries = jnp.zeros((n_seg,), bool) if continues is None else jnp.asarray(continues, bool)
    step = functools.partial(_step, delta=delta, scale=scale)
    eye = jnp.broadcast_to(jnp.eye(key_dim, dtype=jnp.float32), (heads, key_dim, key_dim))
    no_values = jnp.zeros((heads, key_dim), jnp.float32)

    def token(carry, xs):
        state, transfer = carry
        q_t, k_t, v_t, log_t, beta_t, seg_t, first_t = xs
        state = jnp.where(first_t & ~carries[seg_t], inits[seg_t], state)
        transfer = jnp.where(first_t, eye, transfer)
        state, o_t = step(state, (q_t, k_t, v_t, log_t, beta_t))
        transfer, _ = step(transfer, (q_t, k_t, no_values, log_t, beta_t))
        return (state, transfer), (o_t, state, transfer)

    _, (o, states, transfers) = lax.scan(token, (zero, eye), (qh, kh, vh, log, betas, seg, first))
    last = jnp.clip(cu[1:] - 1, 0, length - 1)
    ends = jnp.where((lens > 0)[:, None, None, None], states[last], inits)
    if not emit_summary:
        return o, ends
    form = transfer_form(g=g, gk=gk, beta=beta)
    if form == "dense":
        return o, Summary(form, ends, jnp.where((lens > 0)[:, None, None, None], transfers[last], eye))
    if form == "identity":
        return o, Summary(form, ends)
    owner = jnp.where(tokens < cu[n_seg], seg, n_seg)
    total = lambda x: jax.ops.segment_sum(x, owner, num_segments=n_seg + 1)[:n_seg]  # noqa: E731
    return o, Summary(form, ends, total(_f32(g)) if form == "scalar" else total(log))


@functools.partial(jax.jit, static_argnames=("chunk", "scale"))
def chunk_locals_reference(q: Array, k: Array, v: Array | None, b: Array, beta: Array | None, *, chunk: int,
                           scale: float):
    """`chunk_locals`' arguments (q, k [L, Hk, K], v [L, H, V], b [H, L] for a scalar gate or [L, H, K] per key,
    beta [H, L] or None; L a whole number of chunks) and token-major results in float32, from the definitions:

        P_tj = scale q_t^T Diag(e^{b_t - b_j}) k_j (j <= t, else 0)        -> p [H, L, c]
        M_tj = beta_t k_t^T Diag(e^{b_t - b_j}) k_j (j < t, else 0),  X = (I + M)^-1 by a triangular solve
        W = X Diag(beta) (k * e^{b}),  U = X Diag(beta) V                    -> w [L, H, K], u [L, H, V]

    Returns [p, w, u] with beta, else [p]; per-key gates append the state pass's decayed keys k e^{b_c - b} and
    queries scale q e^b ([L, H, K] each)."""
    per_key = b.ndim == 3
    length, heads = (b.shape[0], b.shape[1]) if per_key else (b.shape[1], b.shape[0])
    key_dim = k.shape[-1]
    nc = length // chunk
    qh, kh = _heads(q, heads), _heads(k, heads)
    logs = _f32(b) if per_key else jnp.broadcast_to(_f32(b).T[..., None], (length, heads, key_dim))
    blocks = lambda x: x.reshape((nc, chunk) + x.shape[1:])  # noqa: E731  [Nc, c, H, ...]
    qc, kc, bc = blocks(qh), blocks(kh), blocks(logs)
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))
    diff = bc[:, :, None] - bc[:, None, :]  # [Nc, t, j, H, K]: b_t - b_j
    decay = jnp.exp(jnp.where(causal[None, :, :, None, None], diff, -jnp.inf))
    pairs = lambda x, y: _einsum("ntjhk,nthk,njhk->nhtj", decay, x, y)  # noqa: E731
    p = scale * pairs(qc, kc)  # [Nc, H, c, c]
    out = [jnp.moveaxis(p, 1, 0).reshape(heads, length, chunk)]
    if beta is not None:
        bt = blocks(_f32(beta).T)  # [Nc, c, H]
        strict = ~jnp.eye(chunk, dtype=bool)
        m = jnp.where(strict, _einsum("nth,nhtj->nhtj", bt, pairs(kc, kc)), 0.0)
        system = jnp.eye(chunk, dtype=jnp.float32) + m
        solve = lambda rhs: jax.scipy.linalg.solve_triangular(system, rhs, lower=True,  # noqa: E731
                                                               unit_diagonal=True)
        rhs_w = jnp.moveaxis(bt[..., None] * jnp.exp(bc) * kc, 2, 1)  # [Nc, H, c, K]
        rhs_u = jnp.moveaxis(bt[..., None] * blocks(_f32(v)), 2, 1)
        token_major = lambda x: jnp.moveaxis(x, 1, 2).reshape((length, heads) + x.shape[3:])  # noqa: E731
        out += [token_major(solve(rhs_w)), token_major(solve(rhs_u))]
    if per_key:
        end = bc[:, -1:]
        out += [(kc * jnp.exp(end - bc)).reshape(length, heads, key_dim),
                (scale * qc * jnp.exp(bc)).reshape(length, heads, key_dim)]
    return out


def _chunked_decays(b, chunk):
    """Scalar in-chunk cumulative log gates b [H, L] -> (b [Nc, c, H], b at each chunk's last token [Nc, H])."""
    heads, length = b.shape
    bc = _f32(b).T.reshape(length // chunk, chunk, heads)
    return bc, bc[:, -1]


@functools.partial(jax.jit, static_argnames=("chunk", "scale"))
def state_pass_reference(w: Array, u: Array, k: Array, b: Array, q: Array, p: Array, init: Array, *, chunk: int,
                         scale: float):
    """`state_pass_mgpu`'s arguments (w [L, H, K], u [L, H, V], k, q [L, Hk, K], b [H, L] scalar in-chunk log
    gates, p [H, L, c], init [H, K, V]) and results in float32, chunk by chunk:

        o_n = scale (Q_n * e^{b}) S + P_n (U_n - W_n S),    S <- e^{b_c} S + (K_n * e^{b_c - b})^T (U_n - W_n S)

    Returns (o [L, H, V], final [H, K, V])."""
    length, heads, key_dim = w.shape
    nc = length // chunk
    bc, last = _chunked_decays(b, chunk)
    blocks = lambda x: _f32(x).reshape((nc, chunk) + x.shape[1:])  # noqa: E731
    wc, uc, kc, qc = blocks(w), blocks(u), blocks(_heads(k, heads)), blocks(_heads(q, heads))
    pc = jnp.moveaxis(_f32(p).reshape(heads, nc, chunk, chunk), 1, 0)  # [Nc, H, c, c]

    def step(state, xs):
        w_n, u_n, k_n, q_n, p_n, b_n, last_n = xs
        new = u_n - _einsum("chk,hkv->chv", w_n, state)
        o = scale * jnp.exp(b_n)[..., None] * _einsum("chk,hkv->chv", q_n, state) + _einsum("hcj,jhv->chv", p_n, new)
        khat = k_n * jnp.exp(last_n[None] - b_n)[..., None]
        return jnp.exp(last_n)[:, None, None] * state + _einsum("chk,chv->hkv", khat, new), o

    final, o = lax.scan(step, _f32(init), (wc, uc, kc, qc, pc, bc, last))
    return o.reshape(length, heads, -1), final


@functools.partial(jax.jit, static_argnames=("chunk", "group_chunks"))
def transfer_pass_reference(w: Array, k: Array, b: Array, *, chunk: int, group_chunks: int) -> Array:
    """`transfer_pass_mgpu`'s arguments (w [L, H, K], k [L, Hk, K], b [H, L] scalar in-chunk log gates) and result
    in float32: each group's A_last ... A_first with A_n = e^{b_c} I - (K_n * e^{b_c - b})^T W_n, [groups, H, K, K]."""
    length, heads, key_dim = w.shape
    nc = length // chunk
    bc, last = _chunked_decays(b, chunk)
    wc = _f32(w).reshape(nc, chunk, heads, key_dim)
    kc = _heads(k, heads).reshape(nc, chunk, heads, key_dim)
    khat = kc * jnp.exp(last[:, None] - bc)[..., None]
    eye = jnp.eye(key_dim, dtype=jnp.float32)
    a = jnp.exp(last)[..., None, None] * eye - _einsum("nchk,nchj->nhkj", khat, wc)  # [Nc, H, K, K]
    a = a.reshape((nc // group_chunks, group_chunks) + a.shape[1:])

    def product(acc, a_n):
        return _einsum("ghij,ghjk->ghik", a_n, acc), None

    start = jnp.broadcast_to(eye, (a.shape[0], heads, key_dim, key_dim))
    return lax.scan(product, start, jnp.moveaxis(a, 1, 0))[0]
