"""The chunked forward of one sequence, `gdn_forward`: the gates, the chunk-local kernel, the state pass and, on
request, the sequence's summary (T_C, S(C|0)).

Pipeline (two launches plus a few cheap XLA ops; a third launch and a product tree when a dense T_C is asked for):

1. gates (XLA): b = chunk-local cumulative sums of the log decays, [H, L] for a scalar gate or [L, H, K] per key.
2. `chunk_local.chunk_locals`, grid (chunks, heads), fully parallel: P, W, U of every chunk (the WY/UT form).
3. `state.state_pass`, grid (state column blocks, heads, pieces): the chunk-to-chunk recurrence
   S <- Diag(e^{b_c}) S + Khat^T (U - W S), each chunk's outputs read from the state entering it.

The summary. For the delta rules T_C is dense (K x K): with pieces = 1 it comes from `state.transfer_pass`
(`GDNConfig.transfer_group` > 0) or from K identity columns widening the single pass (transfer_group = 0), and
S(C|0) is the pass's final state less T_C S_0. For the decay-only families T_C is a sum of log gates (scalar or
per key) and S(C|0) = S_final - T_C S_0.

Pieces (`GDNConfig.pieces` = P > 1, the transfer-operator split): a first pass over the identity-widened state
[S | M] (M_0 = I, zero values in the M columns) gives each piece's (T, S(piece|0)) from zero, all pieces in
parallel; an associative scan in XLA composes the P pairs (`hypic_jax.core.summary.compose`, float32; associative,
so any bracketing gives the same pair); a second pass restarts every piece from its true incoming state and writes
the outputs. The sequential depth drops from L/c to 2 L/(c P) chunk steps for 3x the state-pass arithmetic, and the
sequence's own (T_C, S(C|0)) is the last scan prefix.

A length that is not a multiple of the chunk pads the gates with zero tokens (a zero token has A = I and adds
nothing) while q, k, v and o are read and written in place, the last chunk's rows masked (`GDNConfig.packed_reads`).

Memory between the launches: W, U ([L, H, K] and [L, H, V]) and P ([H, L, c]) in `inter_dtype` (bfloat16 for
bfloat16 inputs, float32 otherwise), plus b ([L, H, K] float32 for per-key gates, with the decayed keys and queries
[L, H, K] in `inter_dtype`). No per-chunk state is ever written; states are float32 always.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax

from hypic_jax.core.summary import Summary, advance, compose, einsum, transfer_form
from hypic_jax.kernels.gdn import mosaic_state
from hypic_jax.kernels.gdn.chunk_local import chunk_local_pass
from hypic_jax.kernels.gdn.config import (GDNConfig, check_inputs, check_per_key_launch, common_dtype,
                                          default_config, default_interpret)
from hypic_jax.kernels.gdn.state import mosaic_state_config, state_pass, transfer_pass, use_mosaic_state

__all__ = ["gdn_forward", "log_transfer", "prefix_tables"]


def prefix_tables(length: int, num_chunks: int, chunk: int) -> tuple[Array, Array]:
    """The (src, cnt) tables of a sequence of `length` tokens laid out as `num_chunks` chunks from token 0: chunk
    n is rows n c .. n c + cnt[n], and the chunks past the tokens are empty."""
    first = np.arange(num_chunks, dtype=np.int64) * chunk
    cnt = np.clip(length - first, 0, chunk)
    return jnp.asarray(np.where(cnt > 0, first, 0), jnp.int32), jnp.asarray(cnt, jnp.int32)


def log_transfer(g, gk, seg_ids=None, n_seg=None):
    """The summary form and log-transfer of a decay-only family: sums of log gates (per segment with seg_ids)."""
    form = transfer_form(g=g, gk=gk)
    if form == "identity":
        return form, None
    total = lambda x: (jnp.sum(x.astype(jnp.float32), axis=0) if seg_ids is None  # noqa: E731
                       else jax.ops.segment_sum(x.astype(jnp.float32), seg_ids, num_segments=n_seg))
    if form == "scalar":
        return form, total(g)
    log = total(gk)
    if g is not None:
        log = log + total(g)[..., None]
    return form, log


@functools.partial(jax.jit, static_argnames=("scale", "config", "emit_summary", "interpret"))
def _forward(q, k, v, g, beta, initial_state, gk=None, *, scale, config, emit_summary, interpret):
    """`gdn_forward` on checked inputs (q, k in v's dtype, config given): (o, final state, summary or None)."""
    length, key_heads, key_dim = k.shape
    heads, value_dim = v.shape[1:]
    config = config.resolved(k.dtype)
    chunk = config.chunk
    num_chunks = -(-length // chunk)
    pieces = max(1, min(config.pieces, num_chunks))
    chunks_per_piece = -(-num_chunks // pieces)
    padded = chunks_per_piece * pieces * chunk
    pad = padded - length

    def pad_tokens(x):  # zero tokens have A = I and add nothing (g = gk = 0, beta = 0, k = v = 0)
        if x is None or pad == 0:
            return x
        return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))

    packed = None
    if pad and config.packed_reads:  # q, k, v, o stay as given: the kernels mask the last chunk's rows
        packed = prefix_tables(length, padded // chunk, chunk)
        g, gk, beta = map(pad_tokens, (g, gk, beta))
    else:
        q, k, v, g, gk, beta = map(pad_tokens, (q, k, v, g, gk, beta))
    out_dtype = jnp.result_type(q, v)
    b, p, w, u, ks, qs = chunk_local_pass(q, k, v, g, gk, beta, scale=scale, config=config, interpret=interpret,
                                          packed=packed)
    state0 = (jnp.zeros((heads, key_dim, value_dim), jnp.float32) if initial_state is None
              else initial_state.astype(jnp.float32))
    eye = jnp.broadcast_to(jnp.eye(key_dim, dtype=jnp.float32), (heads, key_dim, key_dim))
    run = functools.partial(state_pass, chunk=chunk, value_dim=value_dim, out_dtype=out_dtype, scale=scale,
                            config=config, interpret=interpret, packed=packed, packed_length=length)
    dense_summary = emit_summary and beta is not None
    summary = None
    if pieces == 1:
        widen = dense_summary and not config.transfer_group
        init = jnp.concatenate([state0, eye], axis=-1) if widen else state0
        if use_mosaic_state(config, chunk, key_dim, value_dim, w, gk, packed, widen, out_dtype, interpret):
            o, final = mosaic_state.state_pass_mgpu(w, u, ks, b, qs, p, init, chunk=chunk, out_dtype=out_dtype,
                                                    scale=scale, config=mosaic_state_config(config),
                                                    interpret=interpret)
        else:
            o, final = run(w, u, ks, b, qs, p, init[None], pieces=1)
            final = final[0]
        state = final[..., :value_dim]
        if dense_summary:
            if widen:
                transfer = final[..., value_dim:]
            else:
                transfer = transfer_pass(w, ks, b, chunk=chunk, group=config.transfer_group, config=config,
                                         interpret=interpret, packed=packed if gk is None else None)
            zero_start = state if initial_state is None else state - einsum("hkj,hjv->hkv", transfer, state0)
            summary = Summary("dense", zero_start, transfer)
    else:
        if config.state_lowering == "mosaic":
            raise ValueError("pieces > 1 run the Triton state pass only (GDNConfig.state_lowering 'auto' or "
                             "'triton')")
        widened0 = jnp.broadcast_to(jnp.concatenate([jnp.zeros_like(state0), eye], axis=-1),
                                    (pieces, heads, key_dim, value_dim + key_dim))
        _, pairs = run(w, u, ks, b, None, None, widened0, pieces=pieces)
        pairs = Summary("dense", pairs[..., :value_dim], pairs[..., value_dim:])
        prefixes = lax.associative_scan(compose, pairs, axis=0)
        before = jax.tree_util.tree_map(lambda x: x[:-1], prefixes)
        incoming = jnp.concatenate([state0[None], advance(before, jnp.broadcast_to(state0, before.state.shape))])
        o, finals = run(w, u, ks, b, qs, p, incoming, pieces=pieces)
        state = finals[-1]
        if dense_summary:
            summary = jax.tree_util.tree_map(lambda x: x[-1], prefixes)
    if emit_summary and not dense_summary:  # decay-only: T is a sum of log gates, S(C|0) = state - T state0
        form, log = log_transfer(g, gk)
        transfer_only = Summary(form, jnp.zeros_like(state), log)
        summary = Summary(form, state - advance(transfer_only, state0) + 0.0, log)
    return o[:length], state, summary


def gdn_forward(
    q: Array,
    k: Array,
    v: Array,
    *,
    g: Array | None = None,
    beta: Array | None = None,
    gk: Array | None = None,
    initial_state: Array | None = None,
    scale: float = 1.0,
    config: GDNConfig | None = None,
    emit_summary: bool = False,
    interpret: bool | None = None,
):
    """The chunked forward of every linear-attention family, from the state `initial_state`:

        S_t = (I - beta_t k_t k_t^T) Diag(e^{gk_t}) e^{g_t} S_{t-1} + beta_t k_t v_t^T,    o_t = scale S_t^T q_t

    with each gate optional (no beta: S_t = Diag(e^{gk_t}) e^{g_t} S_{t-1} + k_t v_t^T): Gated DeltaNet (g, beta),
    DeltaNet (beta), KDA (gk, beta), GLA (gk), the scalar-decay families (g) and plain linear attention (none).
    `reference.gdn_forward_reference` is the same map token by token in float32.

    Args:
      q, k: [L, Hk, K]; v: [L, H, V] with Hk dividing H (value head h reads key head h // (H / Hk)); q and k are
        cast to v's dtype.
      g: [L, H] log decay (<= 0) or None; gk: [L, H, K] per-key log decay (<= 0; KDA, GLA) or None;
      beta: [L, H] delta-rule strength or None (decay-only family).
      initial_state: [H, K, V] or None (zeros). scale: output scale.
      config: `GDNConfig` (None: `default_config` for the gates given). emit_summary: also return the segment's
        `hypic_jax.core.summary.Summary` (T_C, S(C|0)) from a zero start: dense T_C (K x K, from the same
        kernels, see the module docstring) when beta is given, else the sums of the log gates (form "scalar",
        "diagonal" or "identity").
      interpret: run the kernels in the Pallas interpreter (default: unless the backend is a GPU).

    Returns (o [L, H, V] in the inputs' dtype, final_state [H, K, V] float32) or, with emit_summary,
    (o, final_state, summary).
    """
    _, _, key_dim, heads, value_dim = check_inputs(q, k, v, g, gk, beta)
    config = default_config(gk is not None) if config is None else config
    q, k = common_dtype(q, k, v)
    if initial_state is not None and initial_state.shape != (heads, key_dim, value_dim):
        raise ValueError(f"initial_state must be [{heads}, {key_dim}, {value_dim}], got {initial_state.shape}")
    if interpret is None:
        interpret = default_interpret()
    if gk is not None:
        check_per_key_launch(config, key_dim, bool(interpret))
    o, state, summary = _forward(q, k, v, g, beta, initial_state, gk, scale=float(scale), config=config,
                                 emit_summary=emit_summary, interpret=bool(interpret))
    return (o, state, summary) if emit_summary else (o, state)
