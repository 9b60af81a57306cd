"""Pallas (Triton lowering) chunked forward of the gated delta rule, with the transfer-operator split.

Scope: the recurrence of `hypic_jax.linear_attn` for the scalar-gate families,

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = scale * S_t^T q_t,

i.e. Gated DeltaNet (g and beta), DeltaNet (g=None) and, with beta=None, the decay-only families with one scalar
gate per head (RetNet, lightning, Mamba2; no gate at all is plain linear attention). One sequence per call, q and k
may have fewer (key) heads than v (each key head serves H / Hk consecutive value heads, as in Qwen3.5), and the
head repeat is never materialised. A leading batch axis goes through `jax.vmap` (the pallas_call batching rule
adds a grid axis).

Pipeline (three launches plus a few tiny XLA ops):

1. gates (XLA): b = chunk-local cumsum of g, transposed to [H, L] (L x H floats: negligible).
2. `_locals_kernel`, grid (chunks, heads), fully parallel: the WY/UT chunk form of `linear_attn._chunk_locals`,
   W = (I + M)^-1 (beta e^b K), U = (I + M)^-1 (beta V), and the masked decayed scores P = scale (Q K^T * e^{b_t-b_j}).
   The unit-lower-triangular inverse is built from 16 x 16 blocks: diagonal blocks by forward substitution (row by
   row, stable for any keys, unlike a Neumann/doubling product whose intermediate powers grow binomially when keys
   are correlated), off-diagonal blocks by block forward substitution with small matmuls. Triton cannot slice
   register tensors, so the blocks are formed from 16-row loads of the chunk rather than cut out of a [c, c] tile.
3. `_state_kernel`, grid (state column blocks, heads, pieces): the chunk-to-chunk recurrence
   S <- e^{b_c} S + K^T (U - W S). Columns of the state are independent (every operation left-multiplies S), so
   the state is split into column blocks of `block_v`: that alone gives heads x V / block_v programs at batch 1
   instead of heads. On top of that the sequence is cut into `pieces`: each piece's (T, S(piece|0)) comes from a
   first pass over the identity-widened state [S | M] (M_0 = I, zero values in the M columns), the pieces' pairs
   are composed by an associative scan in XLA (`linear_attn.compose`, float32 HIGHEST; P pairs only), and a second
   pass restarts every piece from its true incoming state and writes the outputs. The sequential depth drops from
   L/c to 2 L/(c P) chunk steps at the price of 3x the state-pass arithmetic; the segment's own (T_C, S(C|0)) is
   the last scan prefix, so emitting it is free in this mode. With pieces = 1 (direct mode) emitting (T_C, S) widens
   the single pass by K columns (K / block_v more programs, same depth).

Memory between launches: W, U ([L, H, K] and [L, H, V]) and P ([H, L, c]) in `inter_dtype` (bfloat16 for
bfloat16 inputs, like the inputs themselves; float32 otherwise). Nothing per chunk of state size is ever written:
the per-chunk states that a two-kernel (state pass, then outputs) design stores ([L/c, H, K, V] float32, 1 GB at
L = 32k) are kept in registers because the output read is fused into the state pass. States are float32 always.

Measured on the H200 at L = 32k, 32 value heads (bench/RESULTS.md): 2.2 to 2.6 ms against fla's 1.92 ms; the
chunk-local kernel (1.4 to 1.7 ms, bound by the serial reductions of the 16 x 16 forward substitution) and not the
state pass (0.94 ms with fused outputs) is the bottleneck, and at 32 heads the pieces split costs more state work
than the depth it saves. Lowering: Triton, because it compiled and ran first time through Pallas at both jax 0.10
(interpret/lowering checks on the CPU) and 0.11 (the H200); Mosaic GPU was not tried.

Precision knobs (`GDNConfig.locals_precision`, `state_precision`) choose the dot algorithm of float32 operands:
"ieee" (exact float32 FMA), "tf32", "bf16x3" (three bfloat16 passes, about float32 accuracy on tensor cores) or
"bf16" (operands rounded to bfloat16, as flash-linear-attention does for the state). Interpret mode on the CPU
runs "ieee" exactly; the GPU numbers of every variant are in bench/RESULTS.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hypic_jax import linear_attn as la

__all__ = ["GDNConfig", "gdn_forward", "default_interpret", "flops", "supports"]

_SUB = 16  # sub-block edge of the chunk-local inverse (Triton's smallest dot edge)
_PRECISIONS = ("ieee", "tf32", "bf16x3", "bf16")


@dataclasses.dataclass(frozen=True)
class GDNConfig:
    """Tuning knobs of the chunked gated-delta forward (hashable: it is a static argument).

    chunk: tokens per chunk (16, 32 or 64); the chunk-local [chunk, chunk] work grows as chunk^2, the number of
      sequential state steps as 1 / chunk.
    block_v: state columns per program of the state pass (16 ... V, power of two): more, narrower programs at
      batch 1; each re-reads the chunk's W, K, Q (L2 serves the repeats when column blocks run side by side, which
      is why the column block is the fastest-varying grid axis).
    pieces: sequence pieces summarised in parallel (the transfer-operator split); 1 runs a single direct pass.
    inter_dtype: dtype of W, U, P between the launches ("bfloat16" | "float32" | None = bfloat16 iff the inputs are).
    locals_precision / state_precision: dot algorithm for float32 operands (see the module docstring); None picks
      "bf16" for bfloat16 inputs (flash-linear-attention's precision) and "ieee" otherwise.
    *_warps / *_stages: Triton launch parameters of the two kernels.

    Defaults are the fastest measured on the H200 at L = 32k (bench/RESULTS.md): locals with 2 warps (1.40 ms vs
    1.66 with 4 and 3.18 with 8), state pass with 32 columns per program and 3 pipeline stages (0.94 ms).
    """

    chunk: int = 64
    block_v: int = 32
    pieces: int = 1
    inter_dtype: str | None = None
    locals_precision: str | None = None
    state_precision: str | None = None
    locals_warps: int = 2
    locals_stages: int = 1
    state_warps: int = 4
    state_stages: int = 3

    def __post_init__(self):
        if self.chunk not in (16, 32, 64, 128):
            raise ValueError(f"chunk must be 16, 32, 64 or 128, got {self.chunk}")
        if self.block_v < 16 or self.block_v & (self.block_v - 1):
            raise ValueError(f"block_v must be a power of two >= 16, got {self.block_v}")
        if self.pieces < 1:
            raise ValueError(f"pieces must be >= 1, got {self.pieces}")
        for name in ("locals_precision", "state_precision"):
            if getattr(self, name) not in _PRECISIONS + (None,):
                raise ValueError(f"{name} must be one of {_PRECISIONS}, got {getattr(self, name)!r}")


def supports(q, k, v, *, gk=None) -> bool:
    """Whether `gdn_forward` handles these inputs (scalar or no gate, K and V powers of two >= 16, L > 0)."""
    if gk is not None or q is None or k.ndim != 3 or v.ndim != 3 or k.shape[0] == 0:
        return False
    if v.shape[1] % k.shape[1]:
        return False
    return all(d >= 16 and not d & (d - 1) for d in (k.shape[-1], v.shape[-1]))


def default_interpret() -> bool:
    """Interpret mode unless a GPU is the default backend (CPU CI runs the kernels through the interpreter)."""
    return jax.default_backend() not in ("gpu", "cuda", "rocm")


# ----------------------------------------------------------------------------------------------------------------
# In-kernel helpers.


def _dot(a: Array, b: Array, precision: str, *, trans_a: bool = False, trans_b: bool = False) -> Array:
    """a @ b (optionally transposed) accumulated in float32, with the dot algorithm named by `precision`.

    Operands of different dtypes are both promoted to float32. bfloat16 x bfloat16 always runs on the tensor cores
    in bfloat16 (exact products, float32 sums) whatever `precision` says.
    """
    if precision == "bf16":
        a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    elif a.dtype != b.dtype:
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    if a.dtype == jnp.bfloat16:
        prec = None
    elif precision == "ieee":
        prec = lax.Precision.HIGHEST
    elif precision == "tf32":
        prec = lax.Precision.DEFAULT
    else:  # bf16x3
        prec = lax.DotAlgorithmPreset.BF16_BF16_F32_X3
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=prec, preferred_element_type=jnp.float32)


def _unit_lower_inverse(strict: Array) -> Array:
    """(I + strict)^-1 for a strictly lower-triangular [s, s] float32 tile, by forward substitution.

    Row i of X = (I + L)^-1 is e_i - sum_{j<i} L_ij X_j; rows are produced in order with masked reductions (Triton
    has no register-tensor indexing). s - 1 steps of O(s^2) vector work, exact in float32.
    """
    s = strict.shape[0]
    rows = lax.broadcasted_iota(jnp.int32, (s, s), 0)
    cols = lax.broadcasted_iota(jnp.int32, (s, s), 1)
    eye = jnp.where(rows == cols, 1.0, 0.0).astype(jnp.float32)

    def step(i, x):
        l_i = jnp.sum(jnp.where(rows == i, strict, 0.0), axis=0)  # L[i, :] as a vector over j
        row = -jnp.sum(l_i[:, None] * x, axis=0)  # -(L[i, :] @ X), a vector over columns
        return jnp.where(rows == i, row[None, :] + eye, x)  # + e_i (eye's row i)

    return lax.fori_loop(1, s, step, eye)


def _last(x: Array) -> Array:
    """The last entry of a 1-D tile as a scalar (a masked sum: no register indexing in Triton)."""
    n = x.shape[0]
    return jnp.sum(jnp.where(lax.iota(jnp.int32, n) == n - 1, x, 0.0))


# ----------------------------------------------------------------------------------------------------------------
# Kernel 1: chunk-local quantities (parallel over chunks and heads).


def _locals_kernel(*refs, chunk, sub, delta, scale, prec):
    """One (chunk, head): P = scale mask(Q K^T e^{b_t - b_j}) and, for the delta rule, W and U (WY/UT form).

    Refs (head axis squeezed by the BlockSpecs): q, k [c, K]; v [c, V]; b, beta [c] (float32); outputs w [c, K],
    u [c, V], p [c, c]. Every exponent is a difference b_t - b_j with t >= j, so <= 0 for decaying gates.
    """
    if delta:
        q_ref, k_ref, v_ref, b_ref, beta_ref, p_ref, w_ref, u_ref = refs
    else:
        q_ref, k_ref, b_ref, p_ref = refs
    c = chunk
    # Scores against the full chunk (one [c, K] x [K, c] dot).
    q_all, k_all, b_all = q_ref[...], k_ref[...], b_ref[...]
    rows = lax.broadcasted_iota(jnp.int32, (c, c), 0)
    cols = lax.broadcasted_iota(jnp.int32, (c, c), 1)
    causal = rows >= cols
    diff = jnp.where(causal, b_all[:, None] - b_all[None, :], 0.0)
    scores = _dot(q_all, k_all, prec, trans_b=True) * jnp.where(causal, jnp.exp(diff), 0.0)
    p_ref[...] = (scale * scores).astype(p_ref.dtype)
    if not delta:
        return

    nb = c // sub
    srows = lax.broadcasted_iota(jnp.int32, (sub, sub), 0)
    scols = lax.broadcasted_iota(jnp.int32, (sub, sub), 1)
    ks, bs, betas, rhs_k, rhs_v = [], [], [], [], []
    for i in range(nb):
        blk = pl.ds(i * sub, sub)
        k_i, b_i, beta_i = k_ref[blk, :], b_ref[blk], beta_ref[blk]
        ks.append(k_i)
        bs.append(b_i)
        betas.append(beta_i)
        rhs_k.append((beta_i * jnp.exp(b_i))[:, None] * k_i.astype(jnp.float32))
        rhs_v.append(beta_i[:, None] * v_ref[blk, :].astype(jnp.float32))

    # Blocks of M (strictly lower): M_tj = beta_t k_t . k_j e^{b_t - b_j}, t > j.
    m = {}
    for i in range(nb):
        for j in range(i + 1):
            kk = _dot(ks[i], ks[j], prec, trans_b=True)
            d = bs[i][:, None] - bs[j][None, :]
            if i == j:
                strict = srows > scols
                blk = jnp.where(strict, betas[i][:, None] * kk * jnp.exp(jnp.where(strict, d, 0.0)), 0.0)
            else:
                blk = betas[i][:, None] * kk * jnp.exp(d)
            m[i, j] = blk

    # X = (I + M)^-1 by blocks: X_ii = (I + M_ii)^-1, X_ij = -X_ii sum_{j<=m<i} M_im X_mj.
    x = {}
    for i in range(nb):
        x[i, i] = _unit_lower_inverse(m[i, i])
        for j in range(i - 1, -1, -1):
            acc = _dot(m[i, j], x[j, j], prec)
            for mid in range(j + 1, i):
                acc = acc + _dot(m[i, mid], x[mid, j], prec)
            x[i, j] = -_dot(x[i, i], acc, prec)

    for i in range(nb):
        w_i = _dot(x[i, 0], rhs_k[0], prec)
        u_i = _dot(x[i, 0], rhs_v[0], prec)
        for j in range(1, i + 1):
            w_i = w_i + _dot(x[i, j], rhs_k[j], prec)
            u_i = u_i + _dot(x[i, j], rhs_v[j], prec)
        blk = pl.ds(i * sub, sub)
        w_ref[blk, :] = w_i.astype(w_ref.dtype)
        u_ref[blk, :] = u_i.astype(u_ref.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Kernel 2: the state pass over the chunks of one piece (parallel over state column blocks, heads and pieces).


def _state_kernel(*refs, chunk, num_chunks, delta, outputs, value_blocks, scale, prec):
    """One (column block j, head, piece): S <- e^{b_c} S + Khat^T (U - W S) over the piece's chunks.

    Refs: w, k, q [Lp, K]; u [Lp, BV]; p [Lp, c]; b [Lp]; init [K, BV]; outputs o [Lp, BV], final [K, BV]. Column
    blocks j >= value_blocks are identity-widened columns (their values are zero) and write no outputs.
    The output read o = (scale Q e^b) S + P (U - W S) is fused into the same step, so per-chunk states never
    leave registers.
    """
    it = iter(refs)
    w_ref = next(it) if delta else None
    u_ref, k_ref, b_ref = next(it), next(it), next(it)
    q_ref, p_ref = (next(it), next(it)) if outputs else (None, None)
    init_ref = next(it)
    o_ref = next(it) if outputs else None
    final_ref = next(it)
    c = chunk
    is_value = None if value_blocks is None else pl.program_id(0) < value_blocks

    def body(n, state):
        rows = pl.ds(pl.multiple_of(n * c, c), c)
        k = k_ref[rows, :]
        b = b_ref[rows]
        u = u_ref[rows, :].astype(jnp.float32)
        if value_blocks is not None:
            u = jnp.where(is_value, u, 0.0)
        if delta:
            u = u - _dot(w_ref[rows, :], state, prec)
        if outputs:

            def write():
                qd = q_ref[rows, :].astype(jnp.float32) * (scale * jnp.exp(b))[:, None]
                o = _dot(qd, state, prec) + _dot(p_ref[rows, :], u, prec)
                o_ref[rows, :] = o.astype(o_ref.dtype)

            if value_blocks is None:
                write()
            else:
                pl.when(is_value)(write)
        b_last = _last(b)
        k_hat = k.astype(jnp.float32) * jnp.exp(b_last - b)[:, None]
        return jnp.exp(b_last) * state + _dot(k_hat, u, prec, trans_a=True)

    state = lax.fori_loop(0, num_chunks, body, init_ref[...].astype(jnp.float32))
    final_ref[...] = state


# ----------------------------------------------------------------------------------------------------------------
# Launch wrappers.


def _compiler_params(warps, stages):
    return pltriton.CompilerParams(num_warps=warps, num_stages=stages)


def _chunk_locals(q, k, v, b, beta, *, chunk, scale, inter_dtype, config, interpret):
    length, key_heads, key_dim = k.shape
    heads = b.shape[0]
    group = heads // key_heads
    num_chunks = length // chunk
    delta = beta is not None
    qk_spec = pl.BlockSpec((chunk, None, key_dim), lambda n, h: (n, h // group, 0))
    gate_spec = pl.BlockSpec((None, chunk), lambda n, h: (h, n))
    p_spec = pl.BlockSpec((None, chunk, chunk), lambda n, h: (h, n, 0))
    p_shape = jax.ShapeDtypeStruct((heads, length, chunk), inter_dtype)
    if delta:
        value_dim = v.shape[-1]
        in_specs = [qk_spec, qk_spec, pl.BlockSpec((chunk, None, value_dim), lambda n, h: (n, h, 0)), gate_spec,
                    gate_spec]
        args = (q, k, v, b, beta)
        out_specs = [p_spec, pl.BlockSpec((chunk, None, key_dim), lambda n, h: (n, h, 0)),
                     pl.BlockSpec((chunk, None, value_dim), lambda n, h: (n, h, 0))]
        out_shape = [p_shape, jax.ShapeDtypeStruct((length, heads, key_dim), inter_dtype),
                     jax.ShapeDtypeStruct((length, heads, value_dim), inter_dtype)]
    else:
        in_specs, args = [qk_spec, qk_spec, gate_spec], (q, k, b)
        out_specs, out_shape = [p_spec], [p_shape]
    kernel = functools.partial(_locals_kernel, chunk=chunk, sub=min(_SUB, chunk), delta=delta, scale=scale,
                               prec=config.locals_precision)
    return pl.pallas_call(
        kernel,
        grid=(num_chunks, heads),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_compiler_params(config.locals_warps, config.locals_stages),
        interpret=interpret,
        name="gdn_chunk_locals",
    )(*args)


def _state_pass(w, u, k, b, q, p, init, *, chunk, pieces, value_dim, out_dtype, scale, config, interpret):
    """Run the state recurrence over `pieces` equal pieces from init [pieces, H, K, Wd] (Wd = V or V + K).

    Returns (o [L, H, V] or None, final [pieces, H, K, Wd]). q, p None -> no outputs.
    """
    length, key_heads, key_dim = k.shape
    heads, width = init.shape[1], init.shape[-1]
    group = heads // key_heads
    piece_len = length // pieces
    block_v = min(config.block_v, value_dim)
    if value_dim % block_v or width % block_v:
        raise ValueError(f"block_v={block_v} must divide V={value_dim} and the state width {width}")
    value_blocks = value_dim // block_v
    col_blocks = width // block_v
    widened = col_blocks > value_blocks
    outputs = q is not None
    delta = w is not None

    def vcol(j):  # value column block of program j (identity-widened programs read block 0 and mask it)
        return jnp.minimum(j, value_blocks - 1) if widened else j

    in_specs, args = [], []
    if delta:
        in_specs.append(pl.BlockSpec((piece_len, None, key_dim), lambda j, h, s: (s, h, 0)))
        args.append(w)
    in_specs += [
        pl.BlockSpec((piece_len, None, block_v), lambda j, h, s: (s, h, vcol(j))),
        pl.BlockSpec((piece_len, None, key_dim), lambda j, h, s: (s, h // group, 0)),
        pl.BlockSpec((None, piece_len), lambda j, h, s: (h, s)),
    ]
    args += [u, k, b]
    if outputs:
        in_specs += [pl.BlockSpec((piece_len, None, key_dim), lambda j, h, s: (s, h // group, 0)),
                     pl.BlockSpec((None, piece_len, chunk), lambda j, h, s: (h, s, 0))]
        args += [q, p]
    state_spec = pl.BlockSpec((None, None, key_dim, block_v), lambda j, h, s: (s, h, 0, j))
    in_specs.append(state_spec)
    args.append(init)
    out_specs, out_shape = [], []
    if outputs:
        out_specs.append(pl.BlockSpec((piece_len, None, block_v), lambda j, h, s: (s, h, vcol(j))))
        out_shape.append(jax.ShapeDtypeStruct((length, heads, value_dim), out_dtype))
    out_specs.append(state_spec)
    out_shape.append(jax.ShapeDtypeStruct(init.shape, jnp.float32))
    kernel = functools.partial(
        _state_kernel,
        chunk=chunk,
        num_chunks=piece_len // chunk,
        delta=delta,
        outputs=outputs,
        value_blocks=value_blocks if widened else None,
        scale=scale,
        prec=config.state_precision,
    )
    res = pl.pallas_call(
        kernel,
        grid=(col_blocks, heads, pieces),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_compiler_params(config.state_warps, config.state_stages),
        interpret=interpret,
        name="gdn_state_pass",
    )(*args)
    return (res[0], res[1]) if outputs else (None, res[0])


def _chunk_cumsum(g: Array | None, length: int, heads: int, chunk: int) -> Array:
    """b = cumsum of the log gates inside each chunk, as [H, L] float32 (zeros without a gate)."""
    if g is None:
        return jnp.zeros((heads, length), jnp.float32)
    gc = g.astype(jnp.float32).reshape(length // chunk, chunk, heads)
    return jnp.cumsum(gc, axis=1).reshape(length, heads).T


@functools.partial(jax.jit, static_argnames=("scale", "config", "emit_summary", "interpret"))
def _forward(q, k, v, g, beta, initial_state, *, scale, config, emit_summary, interpret):
    length, key_heads, key_dim = k.shape
    heads, value_dim = v.shape[1:]
    chunk = config.chunk
    num_chunks = -(-length // chunk)
    pieces = max(1, min(config.pieces, num_chunks))
    chunks_per_piece = -(-num_chunks // pieces)
    padded = chunks_per_piece * pieces * chunk
    pad = padded - length

    def pad_tokens(x):  # zero tokens have A = I and add nothing (g = 0, beta = 0, k = v = 0)
        if x is None or pad == 0:
            return x
        return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))

    q, k, v, g, beta = map(pad_tokens, (q, k, v, g, beta))
    auto = "bf16" if k.dtype == jnp.bfloat16 else "ieee"
    config = dataclasses.replace(config, locals_precision=config.locals_precision or auto,
                                 state_precision=config.state_precision or auto)
    if config.inter_dtype is None:
        inter = jnp.bfloat16 if k.dtype == jnp.bfloat16 else jnp.float32
    else:
        inter = jnp.dtype(config.inter_dtype)
    out_dtype = jnp.result_type(q, v)
    b = _chunk_cumsum(g, padded, heads, chunk)
    beta_t = None if beta is None else beta.astype(jnp.float32).T
    locals_ = _chunk_locals(q, k, v, b, beta_t, chunk=chunk, scale=scale, inter_dtype=inter, config=config,
                            interpret=interpret)
    if beta is not None:
        p, w, u = locals_
    else:
        (p,), w, u = locals_, None, v
    state0 = (jnp.zeros((heads, key_dim, value_dim), jnp.float32) if initial_state is None
              else initial_state.astype(jnp.float32))
    eye = jnp.broadcast_to(jnp.eye(key_dim, dtype=jnp.float32), (heads, key_dim, key_dim))
    run = functools.partial(_state_pass, chunk=chunk, value_dim=value_dim, out_dtype=out_dtype, scale=scale, config=config,
                            interpret=interpret)
    summary = None
    if pieces == 1:
        init = jnp.concatenate([state0, eye], axis=-1) if emit_summary else state0
        o, final = run(w, u, k, b, q, p, init[None], pieces=1)
        final = final[0]
        state = final[..., :value_dim]
        if emit_summary:
            transfer = final[..., value_dim:]
            zero_start = state if initial_state is None else state - la._einsum("hkj,hjv->hkv", transfer, state0)
            summary = la.Summary("dense", zero_start, transfer)
    else:
        widened0 = jnp.broadcast_to(jnp.concatenate([jnp.zeros_like(state0), eye], axis=-1),
                                    (pieces, heads, key_dim, value_dim + key_dim))
        _, pairs = run(w, u, k, b, None, None, widened0, pieces=pieces)
        pairs = la.Summary("dense", pairs[..., :value_dim], pairs[..., value_dim:])
        prefixes = lax.associative_scan(la.compose, pairs, axis=0)
        before = jax.tree_util.tree_map(lambda x: x[:-1], prefixes)
        incoming = jnp.concatenate([state0[None], la.advance(before, jnp.broadcast_to(state0, before.state.shape))])
        o, finals = run(w, u, k, b, q, p, incoming, pieces=pieces)
        state = finals[-1]
        if emit_summary:
            summary = jax.tree_util.tree_map(lambda x: x[-1], prefixes)
    return o[:length], state, summary


def gdn_forward(
    q: Array,
    k: Array,
    v: Array,
    *,
    g: Array | None = None,
    beta: Array | None = None,
    initial_state: Array | None = None,
    scale: float = 1.0,
    config: GDNConfig = GDNConfig(),
    emit_summary: bool = False,
    interpret: bool | None = None,
):
    """Chunked forward of the scalar-gate (gated) delta rule with Pallas kernels; matches `linear_attn.chunked`.

    Args:
      q, k: [L, Hk, K]; v: [L, H, V] with Hk dividing H (value head h reads key head h // (H / Hk)).
      g: [L, H] log decay (<= 0) or None; beta: [L, H] delta-rule strength or None (decay-only family).
      initial_state: [H, K, V] or None (zeros). scale: output scale.
      config: `GDNConfig`. emit_summary: also return the segment's `linear_attn.Summary` (dense, K x K transfer
        when beta is given; T_C from the same kernels, see the module docstring).
      interpret: run the kernels in the Pallas interpreter (default: unless the backend is a GPU).

    Returns (o [L, H, V] in the inputs' dtype, final_state [H, K, V] float32) or, with emit_summary,
    (o, final_state, summary).
    """
    if k.ndim != 3 or q.shape != k.shape or v.ndim != 3 or v.shape[0] != k.shape[0]:
        raise ValueError(f"expected q, k [L, Hk, K] and v [L, H, V], got {q.shape}, {k.shape}, {v.shape}")
    length, key_heads, key_dim = k.shape
    heads, value_dim = v.shape[1:]
    if heads % key_heads:
        raise ValueError(f"key heads {key_heads} must divide value heads {heads}")
    for name, x in (("g", g), ("beta", beta)):
        if x is not None and x.shape != (length, heads):
            raise ValueError(f"{name} must be [L={length}, H={heads}], got {x.shape}")
    if initial_state is not None and initial_state.shape != (heads, key_dim, value_dim):
        raise ValueError(f"initial_state must be [{heads}, {key_dim}, {value_dim}], got {initial_state.shape}")
    for dim in (key_dim, value_dim):
        if dim & (dim - 1) or dim < 16:
            raise ValueError(f"K and V must be powers of two >= 16 (Triton tiles), got K={key_dim}, V={value_dim}")
    if emit_summary and beta is None:
        raise ValueError("emit_summary here is for delta rules; decay-only summaries are sums of log gates "
                         "(linear_attn.summarize)")
    if interpret is None:
        interpret = default_interpret()
    if length == 0:
        raise ValueError("empty sequence")
    o, state, summary = _forward(q, k, v, g, beta, initial_state, scale=float(scale), config=config,
                                 emit_summary=emit_summary, interpret=bool(interpret))
    return (o, state, summary) if emit_summary else (o, state)


def flops(length: int, heads: int, key_dim: int, value_dim: int, chunk: int, *, emit: bool = False,
          pieces: int = 1) -> float:
    """Matmul FLOPs of the pipeline (for achieved-rate reports; elementwise work not counted)."""
    per_chunk_locals = 2 * chunk * chunk * key_dim * 2 + 2 * chunk * chunk * (key_dim + value_dim) / 2
    width = value_dim + (key_dim if emit or pieces > 1 else 0)
    step = lambda cols, out: 2 * chunk * key_dim * cols * 2 + (2 * chunk * key_dim * cols + 2 * chunk * chunk * cols
                                                               if out else 0)  # noqa: E731
    per_chunk_state = step(width, True) if pieces == 1 else step(width, False) + step(value_dim, True)
    return heads * (length / chunk) * (per_chunk_locals + per_chunk_state)

