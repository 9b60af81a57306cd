"""The chunk-local (intra-chunk) kernel of the chunked forward: every chunk's WY/UT operands and scores at once.

For a chunk of c tokens with chunk-local cumulative log decays b_t (b_t = the sum of the chunk's log gates up to
token t: g_t per head, or gk_t (+ g_t) per key channel), the recurrence

    S_t = (I - beta_t k_t k_t^T) Diag(e^{gk_t}) e^{g_t} S_{t-1} + beta_t k_t v_t^T,    o_t = scale S_t^T q_t

unrolls over the chunk, from its incoming state S, into

    S'  = Diag(e^{b_c}) S + Khat^T (U - W S)                    Khat_j = k_j * e^{b_c - b_j}   (keys to the end)
    o   = scale (q * e^{b}) S + P (U - W S)                     P_tj = scale q_t^T Diag(e^{b_t - b_j}) k_j, j <= t
    W   = (I + M)^-1 Diag(beta) (k * e^{b}),  U = (I + M)^-1 Diag(beta) V,
    M_tj = beta_t k_t^T Diag(e^{b_t - b_j}) k_j  for t > j     (strictly lower triangular)

(the WY/UT form: writing each step as S_t = D_t S_{t-1} + k_t u_t^T with D_t = Diag(e^{gk_t}) e^{g_t}, the
corrected values u_t = beta_t (v_t - (D_t S_{t-1})^T k_t) of all the chunk's tokens solve one unit-lower-triangular
system, (I + M) [u_t] = Diag(beta) (V - (k * e^{b}) S), whence [u_t] = U - W S). Everything here depends on the
chunk's own tokens only, so this kernel runs on a grid (chunks, heads) with no dependence between programs; the
state pass (`state`) then steps S through the chunks. Without the delta rule (no beta) M = 0, W = 0 and U = V:
only P is formed.

The inverse X = (I + M)^-1 (`GDNConfig.solve`):
  "rows"      16 x 16 diagonal blocks by row-by-row forward substitution (masked reductions: Triton cannot index
              register tensors), off-diagonal blocks by block forward substitution with 16 x 16 dots.
  "doubling"  the same block substitution, each diagonal block inverted by recursive doubling (`inverse_doubling`):
              X_1 = I, X_2s = X_s - X_s (E_s X_s), where E_s holds the entries of M in the lower-left s x s block
              of every 2s x 2s diagonal block. Exact: with D_s the block-diagonal part of I + M at granularity s
              (X_s = D_s^-1), X_s E_s maps the first half of a 2s block to the second and so squares to zero, hence
              (D_s + E_s)^-1 = (I - X_s E_s) X_s. This is the divide-and-conquer triangular inverse, whose error
              bound is that of substitution (Du Croz and Higham, 1992): every X_s is the inverse of principal blocks
              of I + M, so no intermediate grows the way the powers of M in a Neumann product
              (I - M)(I + M^2)(I + M^4)... do for correlated keys. Its dots run on the tensor cores.
  "tile"      the doubling applied to the whole [c, c] tile (log2 c levels of two c^3 dots, then W and U as one
              [c, c] x [c, K + V] product each): the fewest, largest dots. Scalar gates only (per-key M is formed in
              16 x 16 blocks, below); per-key gates fall back to "doubling".

Per-key decays (KDA, GLA) cannot factor e^{b_t - b_j} into a row and a column factor without a positive exponent
(that is what overflows for strong gates), so a pairwise block takes a reference token r between its two 16-token
blocks: for t in block i > j, q_t^T Diag(e^{b_t - b_j}) k_j = (q_t e^{b_t - b_r})^T (k_j e^{b_r - b_j}) with r the
first token of block i, both exponents <= 0, one 16 x 16 dot (`pair_block_per_key`). A diagonal block takes the
same form with r its own first token when the decay accumulated inside the block is at most `FACTORED_SPAN`, and is
formed one column at a time otherwise (every exponent b_t - b_j <= 0). With per-key gates the kernel also writes the
state pass's keys decayed to the chunk's end and its scaled, decayed queries, so that the sequential pass takes no
per-key exponentials.

On Hopper the kernel runs under Mosaic GPU where it can (`mosaic_chunk_local`, `GDNConfig.locals_lowering`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.experimental import pallas as pl

from hypic_jax.kernels.gdn import mosaic_chunk_local
from hypic_jax.kernels.gdn.common import (PackedChunk, chunk_cumsum, chunk_cumsum_per_key, compiler_params, dot,
                                          eye, iotas)
from hypic_jax.kernels.gdn.config import choose_mosaic

__all__ = ["chunk_locals", "chunk_local_pass", "inverse_rows", "inverse_doubling", "FACTORED_SPAN"]


def inverse_rows(strict: Array) -> Array:
    """(I + strict)^-1 for a strictly lower-triangular [s, s] float32 tile, by forward substitution.

    Row i of X = (I + L)^-1 is e_i - sum_{j<i} L_ij X_j; rows are produced in order with masked reductions (Triton
    has no register-tensor indexing). s - 1 steps of O(s^2) vector work, exact in float32.
    """
    s = strict.shape[0]
    rows, _ = iotas(s)
    identity = eye(s)

    def step(i, x):
        l_i = jnp.sum(jnp.where(rows == i, strict, 0.0), axis=0)  # L[i, :] as a vector over j
        row = -jnp.sum(l_i[:, None] * x, axis=0)  # -(L[i, :] @ X), a vector over columns
        return jnp.where(rows == i, row[None, :] + identity, x)  # + e_i (the identity's row i)

    return lax.fori_loop(1, s, step, identity)


def inverse_doubling(strict: Array, precision: str) -> Array:
    """(I + strict)^-1 for a strictly lower-triangular [n, n] float32 tile (n a power of two) by recursive doubling.

    X_s = inverse of the block-diagonal part of I + strict at granularity s (X_1 = I). With E_s the entries of
    `strict` in the lower-left s x s block of each 2s x 2s diagonal block, X_2s = X_s - X_s (E_s X_s) (exact: see
    the module docstring). The first level is elementwise (X_2 = I - E_1), then log2(n) - 1 levels of two [n, n]
    dots; the block masks come from iotas, so no register tensor is ever sliced. The kernel's time follows the
    number of its dots rather than their flops, hence the elementwise first level and whole-tile dots at every
    level (`bench/kernels.py --all --sections locals` times the solves; bench/RESULTS.md, "kernels.py").
    """
    n = strict.shape[0]
    rows, cols = iotas(n)
    x = eye(n) - jnp.where(jnp.logical_and((rows >> 1) == (cols >> 1), rows != cols), strict, 0.0)
    s = 2
    while s < n:
        shift = int(math.log2(s))
        same_pair = (rows >> (shift + 1)) == (cols >> (shift + 1))
        lower_left = (rows >> shift) != (cols >> shift)  # rows in the pair's second half, columns in its first
        e = jnp.where(jnp.logical_and(same_pair, lower_left), strict, 0.0)
        x = x - dot(x, dot(e, x, precision), precision)
        s *= 2
    return x


FACTORED_SPAN = 40.0  # largest log-decay inside one diagonal block that the factored pair form takes


def pair_block_per_key(x_ref, k_ref, b_ref, i, j, sub, strict, precision):
    """[sub, sub] block (i, j) of x_t^T Diag(e^{b_t - b_j}) k_j for rows of block i, columns of block j <= i.

    Off-diagonal blocks: one dot of both sides decayed to the first token r of block i (b_t - b_r <= 0 and
    b_r - b_j <= 0 since j < r <= t). Diagonal block: the same with r the block's own first token, where the key
    side's exponent b_r - b_j >= 0 is bounded by the decay accumulated inside the block; when that exceeds
    `FACTORED_SPAN` the block is formed one column per step instead ([sub, K] elementwise with exponents
    b_t - b_j, t >= j). Zero above the diagonal (or on it, `strict`). The column loop costs sub x sub x K
    exponentials against the factored form's 2 sub x K and one tensor-core dot, so it is taken only where the
    factored form could overflow.
    """
    rows_i = pl.ds(i * sub, sub)
    x = x_ref[rows_i, :].astype(jnp.float32)
    b_i = b_ref[rows_i, :]
    if i > j:
        rows_j = pl.ds(j * sub, sub)
        b_r = b_ref[pl.ds(i * sub, 1), :]  # [1, K]
        k_j = k_ref[rows_j, :].astype(jnp.float32) * jnp.exp(b_r - b_ref[rows_j, :])
        return dot(x * jnp.exp(b_i - b_r), k_j, precision, trans_b=True)
    rows, cols = iotas(sub)
    token = lax.iota(jnp.int32, sub)
    b_r = b_ref[pl.ds(i * sub, 1), :]  # [1, K]: the block's first token

    def factored():  # one dot, both sides decayed against the first token: e^{b_t - b_r} <= 1 <= e^{b_r - b_j}
        k_i = k_ref[rows_i, :].astype(jnp.float32)
        blk = dot(x * jnp.exp(b_i - b_r), k_i * jnp.exp(b_r - b_i), precision, trans_b=True)
        return jnp.where(rows > cols if strict else rows >= cols, blk, 0.0)

    def columns():  # one key column at a time, every exponent b_t - b_j <= 0 (any gate strength)

        def column(col, acc):
            row = pl.ds(i * sub + col, 1)
            k_c, b_c = k_ref[row, :].astype(jnp.float32), b_ref[row, :]  # [1, K]
            keep = token > col if strict else token >= col
            decay = jnp.exp(jnp.where(keep[:, None], b_i - b_c, 0.0))
            value = jnp.where(keep, jnp.sum(x * k_c * decay, axis=1), 0.0)
            return acc + jnp.where(cols == col, value[:, None], 0.0)

        return lax.fori_loop(0, sub, column, jnp.zeros((sub, sub), jnp.float32))

    # The factored form needs e^{span} representable in float32 with room to spare for the products (e^40 is about
    # 2e17, float32's range ends near e^88); stronger decays inside one block take the column loop.
    span = jnp.max(jnp.abs(b_r - b_i))
    return lax.cond(span <= FACTORED_SPAN, factored, columns)


def _locals_kernel(*refs, chunk, sub, delta, per_key, scale, prec, solve, solve_prec, packed=False,
                   skip_empty=False, decayed=None, keys_t=False):
    """One (chunk, head): P = scale mask(Q K^T e^{b_t - b_j}) and, for the delta rule, W and U (WY/UT form).

    Refs (head axis squeezed by the BlockSpecs): q, k [c, K]; v [c, V]; b [c] or [c, K] (per key), beta [c]
    (float32); outputs p [c, c], w [c, K], u [c, V], and with per-key gates (or `decayed`) the state pass's
    decayed keys k e^{b_c - b} and queries scale q e^b [c, K] (per value head; with `keys_t` the keys as [K, c]).
    Every exponent is a difference b_t - b_j with t >= j (or split at a reference token between them), so <= 0
    for decaying gates.
    With `packed` two int32 tables src, cnt [Nc] come first and q, k, v are the whole packed sequence [L, D]:
    chunk n is rows src[n] .. src[n] + cnt[n] (`PackedChunk`). With `skip_empty` (packed only) a chunk of no
    tokens writes nothing: its outputs are left undefined, for a state pass that never reads such chunks
    (`gdn_varlen` bounds its pass by the chunks that hold tokens).
    """
    body = functools.partial(_locals_body, chunk=chunk, sub=sub, delta=delta, per_key=per_key, scale=scale,
                             prec=prec, solve=solve, solve_prec=solve_prec,
                             decayed=per_key if decayed is None else decayed, keys_t=keys_t)
    if not packed:
        body(refs)
        return
    (src_ref, cnt_ref), refs = refs[:2], refs[2:]
    n = pl.program_id(0)
    cnt = cnt_ref[n]
    chunk_rows = functools.partial(PackedChunk, src=src_ref[n], cnt=cnt, chunk=chunk)
    refs = tuple(chunk_rows(r) for r in refs[:3 if delta else 2]) + tuple(refs[3 if delta else 2:])
    if skip_empty:
        pl.when(cnt > 0)(lambda: body(refs))
    else:
        body(refs)


def _locals_body(refs, *, chunk, sub, delta, per_key, scale, prec, solve, solve_prec, decayed=False, keys_t=False):
    """`_locals_kernel`'s work on one chunk, its q, k, v refs already resolved to the chunk's rows."""
    def store_keys(tile):  # [c, K], or transposed into a [K, c] block
        kd_ref[...] = (tile.T if keys_t else tile).astype(kd_ref.dtype)

    if decayed:  # the state pass's keys and queries, decayed here once instead of in every state step
        refs, (kd_ref, qd_ref) = refs[:-2], refs[-2:]
    if delta:
        q_ref, k_ref, v_ref, b_ref, beta_ref, p_ref, w_ref, u_ref = refs
    else:
        q_ref, k_ref, b_ref, p_ref = refs
    c = chunk
    nb = c // sub
    if decayed and not per_key:  # a scalar gate per token: b [c]
        b_chunk = b_ref[...]
        b_end = b_ref[pl.ds(c - 1, 1)]  # [1]
        store_keys(k_ref[...].astype(jnp.float32) * jnp.exp(b_end - b_chunk)[:, None])
        qd_ref[...] = (scale * q_ref[...].astype(jnp.float32) * jnp.exp(b_chunk)[:, None]).astype(qd_ref.dtype)
    if per_key:
        b_chunk = b_ref[...]
        b_end = b_ref[pl.ds(c - 1, 1), :]  # [1, K]
        store_keys(k_ref[...].astype(jnp.float32) * jnp.exp(b_end - b_chunk))
        qd_ref[...] = (scale * q_ref[...].astype(jnp.float32) * jnp.exp(b_chunk)).astype(qd_ref.dtype)
    if per_key:  # scores by 16 x 16 blocks (zeros above the diagonal)
        for i in range(nb):
            for j in range(nb):
                if j <= i:
                    blk = scale * pair_block_per_key(q_ref, k_ref, b_ref, i, j, sub, False, prec)
                else:
                    blk = jnp.zeros((sub, sub), jnp.float32)
                p_ref[pl.ds(i * sub, sub), pl.ds(j * sub, sub)] = blk.astype(p_ref.dtype)
    else:  # scores against the full chunk (one [c, K] x [K, c] dot)
        b_all = b_ref[...]
        rows, cols = iotas(c)
        causal = rows >= cols
        diff = jnp.where(causal, b_all[:, None] - b_all[None, :], 0.0)
        k_all = k_ref[...]
        scores = dot(q_ref[...], k_all, prec, trans_b=True) * jnp.where(causal, jnp.exp(diff), 0.0)
        p_ref[...] = (scale * scores).astype(p_ref.dtype)
    if not delta:
        return

    if solve == "tile" and not per_key:  # the whole [c, c] inverse by doubling, then W, U as one dot each
        beta_all = beta_ref[...]
        strict = rows > cols
        kk = dot(k_all, k_all, prec, trans_b=True)
        m = jnp.where(strict, beta_all[:, None] * kk * jnp.exp(jnp.where(strict, diff, 0.0)), 0.0)
        x = inverse_doubling(m, solve_prec)
        rhs_k = (beta_all * jnp.exp(b_all))[:, None] * k_all.astype(jnp.float32)
        w_ref[...] = dot(x, rhs_k, prec).astype(w_ref.dtype)
        u_ref[...] = dot(x, beta_all[:, None] * v_ref[...].astype(jnp.float32), prec).astype(u_ref.dtype)
        return

    srows, scols = iotas(sub)
    ks, bs, betas, rhs_k, rhs_v = [], [], [], [], []
    for i in range(nb):
        blk = pl.ds(i * sub, sub)
        k_i, beta_i = k_ref[blk, :], beta_ref[blk]
        b_i = b_ref[blk, :] if per_key else b_ref[blk]
        ks.append(k_i)
        bs.append(b_i)
        betas.append(beta_i)
        decay_i = jnp.exp(b_i) if per_key else jnp.exp(b_i)[:, None]
        rhs_k.append(beta_i[:, None] * decay_i * k_i.astype(jnp.float32))
        rhs_v.append(beta_i[:, None] * v_ref[blk, :].astype(jnp.float32))

    # Blocks of M (strictly lower): M_tj = beta_t k_t^T Diag(e^{b_t - b_j}) k_j, t > j.
    m = {}
    for i in range(nb):
        for j in range(i + 1):
            if per_key:
                pair = pair_block_per_key(k_ref, k_ref, b_ref, i, j, sub, True, prec)
            else:
                kk = dot(ks[i], ks[j], prec, trans_b=True)
                d = bs[i][:, None] - bs[j][None, :]
                if i == j:
                    strict = srows > scols
                    pair = jnp.where(strict, kk * jnp.exp(jnp.where(strict, d, 0.0)), 0.0)
                else:
                    pair = kk * jnp.exp(d)
            m[i, j] = betas[i][:, None] * pair

    # X = (I + M)^-1 by blocks: X_ii = (I + M_ii)^-1, X_ij = -X_ii sum_{j<=m<i} M_im X_mj.
    x = {}
    for i in range(nb):
        x[i, i] = inverse_rows(m[i, i]) if solve == "rows" else inverse_doubling(m[i, i], solve_prec)
        for j in range(i - 1, -1, -1):
            acc = dot(m[i, j], x[j, j], prec)
            for mid in range(j + 1, i):
                acc = acc + dot(m[i, mid], x[mid, j], prec)
            x[i, j] = -dot(x[i, i], acc, prec)

    for i in range(nb):
        w_i = dot(x[i, 0], rhs_k[0], prec)
        u_i = dot(x[i, 0], rhs_v[0], prec)
        for j in range(1, i + 1):
            w_i = w_i + dot(x[i, j], rhs_k[j], prec)
            u_i = u_i + dot(x[i, j], rhs_v[j], prec)
        blk = pl.ds(i * sub, sub)
        w_ref[blk, :] = w_i.astype(w_ref.dtype)
        u_ref[blk, :] = u_i.astype(u_ref.dtype)


def chunk_locals(q, k, v, b, beta, *, chunk, scale, inter_dtype, config, interpret, packed=None,
                 skip_empty=False, head_major=False):
    """P, W, U for every (chunk, head). b: [H, L] (scalar gate) or [L, H, K] (per key); beta [H, L] or None.
    packed: None, or the int32 tables (src, cnt) [Nc] of a chunk-aligned layout whose q, k, v stay packed
    (`_locals_kernel`); L is then the layout's length (b's), not q's. skip_empty (packed only): chunks of no
    tokens write nothing (their outputs are undefined).

    Outputs are token-major (P [H, L, c], W, U and decayed keys and queries [L, H, D]), or with `head_major` chunk
    by chunk and head by head ([Nc, H, c, c] and [Nc, H, c, D], the decayed keys transposed: [Nc, H, K, c]), the
    layouts `hypic_jax.kernels.piece_fold.chunk_fold` reads, so that no transpose of these arrays runs between the
    kernels;
    head_major also returns the decayed keys and queries of a scalar gate (float32), which the fold's chunk steps
    take."""
    key_heads, key_dim = k.shape[1:]
    per_key = b.ndim == 3
    heads = b.shape[1] if per_key else b.shape[0]
    length = b.shape[0] if per_key else b.shape[1]
    group = heads // key_heads
    num_chunks = length // chunk
    delta = beta is not None
    config = config.resolved(k.dtype)
    if packed is not None:  # whole packed sequences; the kernel reads each chunk's rows through the tables
        qk_spec = pl.BlockSpec((k.shape[0], None, key_dim), lambda n, h: (0, h // group, 0))
        v_spec = None if v is None else pl.BlockSpec((v.shape[0], None, v.shape[-1]), lambda n, h: (0, h, 0))
        table = pl.BlockSpec((num_chunks,), lambda n, h: (0,))
    else:
        qk_spec = pl.BlockSpec((chunk, None, key_dim), lambda n, h: (n, h // group, 0))
        v_spec = None if v is None else pl.BlockSpec((chunk, None, v.shape[-1]), lambda n, h: (n, h, 0))
    beta_spec = pl.BlockSpec((None, chunk), lambda n, h: (h, n))
    b_spec = pl.BlockSpec((chunk, None, key_dim), lambda n, h: (n, h, 0)) if per_key else beta_spec

    def rows_out(width, dtype):  # one (chunk, head) block of rows of `width`: its spec and the whole output
        if head_major:
            return (pl.BlockSpec((None, None, chunk, width), lambda n, h: (n, h, 0, 0)),
                    jax.ShapeDtypeStruct((num_chunks, heads, chunk, width), dtype))
        return (pl.BlockSpec((chunk, None, width), lambda n, h: (n, h, 0)),
                jax.ShapeDtypeStruct((length, heads, width), dtype))

    if head_major:
        p_spec, p_shape = rows_out(chunk, inter_dtype)
    else:
        p_spec = pl.BlockSpec((None, chunk, chunk), lambda n, h: (h, n, 0))
        p_shape = jax.ShapeDtypeStruct((heads, length, chunk), inter_dtype)
    if delta:
        value_dim = v.shape[-1]
        in_specs = [qk_spec, qk_spec, v_spec, b_spec, beta_spec]
        args = (q, k, v, b, beta)
        (w_spec, w_shape), (u_spec, u_shape) = rows_out(key_dim, inter_dtype), rows_out(value_dim, inter_dtype)
        out_specs, out_shape = [p_spec, w_spec, u_spec], [p_shape, w_shape, u_shape]
    else:
        in_specs, args = [qk_spec, qk_spec, b_spec], (q, k, b)
        out_specs, out_shape = [p_spec], [p_shape]
    decayed = per_key or head_major
    if decayed:  # decayed keys and queries for the state pass, per value head
        dtype = inter_dtype if per_key else jnp.float32
        q_spec, q_shape = rows_out(key_dim, dtype)
        k_spec, k_shape = q_spec, q_shape
        if head_major:  # keys transposed, [K, c] per block
            k_spec = pl.BlockSpec((None, None, key_dim, chunk), lambda n, h: (n, h, 0, 0))
            k_shape = jax.ShapeDtypeStruct((num_chunks, heads, key_dim, chunk), dtype)
        out_specs += [k_spec, q_spec]
        out_shape += [k_shape, q_shape]
    if packed is not None:
        in_specs, args = [table, table] + list(in_specs), tuple(packed) + tuple(args)
    kernel = functools.partial(_locals_kernel, chunk=chunk, sub=min(config.sub, chunk), delta=delta, per_key=per_key,
                               decayed=decayed, keys_t=head_major, scale=scale, prec=config.locals_precision,
                               solve=config.solve, solve_prec=config.solve_precision, packed=packed is not None,
                               skip_empty=skip_empty and packed is not None)
    return pl.pallas_call(
        kernel,
        grid=(num_chunks, heads),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params(config.locals_warps, config.locals_stages),
        interpret=interpret,
        name="gdn_chunk_locals",
    )(*args)


def chunk_local_pass(q, k, v, g, gk, beta, *, scale, config, interpret, packed=None, skip_empty=False,
                     head_major=False):
    """The gates and the chunk-local kernel on a chunk-aligned sequence: the first step of `gdn_forward` and
    `gdn_varlen`, and with `head_major` the chunk-local work of a stitched request (`hypic_jax.stitch`, which calls
    it as `gdn._locals`).

    q, k [L, Hk, K], v [L, H, V], g, beta [L, H], gk [L, H, K] or None, L a whole number of chunks; config a
    `GDNConfig`. packed: None, or the tables (src, cnt) of `chunk_locals`: q, k, v then stay packed while the gates
    come chunk-aligned. Returns (b, p, w, u, ks, qs): b the chunk-local cumulative log decays ([H, L] float32, or
    [L, H, K] per key), p, w, u as `chunk_locals` writes them (w None and u = v without the delta rule), and ks, qs
    the keys and queries the state pass reads: k and q, or with per-key gates the decayed k e^{b_c - b} and
    scale q e^b per value head. head_major (delta rule only): p, w, u, ks, qs in `chunk_locals`' head-major layout,
    ks and qs decayed for either gate (ks transposed, [Nc, H, K, c]).
    """
    if head_major and beta is None:
        raise ValueError("head_major outputs need the delta rule (beta)")
    length = k.shape[0] if packed is None else packed[0].shape[0] * config.chunk
    heads = v.shape[1]
    if config.inter_dtype is None:
        inter = jnp.bfloat16 if k.dtype == jnp.bfloat16 else jnp.float32
    else:
        inter = jnp.dtype(config.inter_dtype)
    if gk is not None:
        b = chunk_cumsum_per_key(g, gk, config.chunk)
    else:
        b = chunk_cumsum(g, length, heads, config.chunk)
    beta_t = None if beta is None else beta.astype(jnp.float32).T
    if not head_major and use_mosaic_locals(config, q, k, v, gk, beta, inter, packed, interpret):
        p, w, u = mosaic_chunk_local.chunk_locals_mgpu(q, k, v, b, beta_t, chunk=config.chunk, scale=scale)
        return b, p, w, u, k, q
    res = chunk_locals(q, k, v, b, beta_t, chunk=config.chunk, scale=scale, inter_dtype=inter, config=config,
                       interpret=interpret, packed=packed, skip_empty=skip_empty, head_major=head_major)
    ks, qs = k, q
    if gk is not None or head_major:  # the decayed keys and queries are the kernel's last two outputs
        res, (ks, qs) = res[:-2], res[-2:]
    if beta is not None:
        p, w, u = res
    else:
        (p,), w, u = res, None, v
    return b, p, w, u, ks, qs


def use_mosaic_locals(config, q, k, v, gk, beta, inter, packed, interpret) -> bool:
    """Whether the chunk-local kernel runs under Mosaic GPU (`GDNConfig.locals_lowering`, config resolved;
    `choose_mosaic`)."""
    if config.locals_lowering == "triton":
        return False
    bf16 = all(x.dtype == jnp.bfloat16 for x in (q, k, v)) and jnp.dtype(inter) == jnp.bfloat16
    fits = (gk is None and beta is not None and packed is None and config.solve == "tile" and bf16
            and config.locals_precision == "bf16" and config.solve_precision == "bf16"
            and mosaic_chunk_local.supported(config.chunk, k.shape[-1], v.shape[-1], k.shape[0]))
    return choose_mosaic(
        "locals_lowering", config.locals_lowering, fits, interpret, "mosaic_chunk_local.chunk_locals_mgpu",
        takes="the 'tile' solve with a scalar gate or none, the delta rule, bf16 inputs and dots, chunk 64, K = V = "
              "128, whole chunks and no packed segments",
        got=f"solve {config.solve!r}, chunk {config.chunk}, K {k.shape[-1]}, V {v.shape[-1]}, {k.shape[0]} tokens, "
            f"inputs {k.dtype.name}")
