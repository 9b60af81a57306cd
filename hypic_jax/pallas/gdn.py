"""Pallas (Triton lowering) chunked forward of the (gated) delta rule and the decay families, with the
transfer-operator split and variable-length packed segments.

Scope: the recurrence of `hypic_jax.linear_attn`,

    S_t = (I - beta_t k_t k_t^T) Diag(exp(gk_t)) exp(g_t) S_{t-1} + beta_t k_t v_t^T,    o_t = scale * S_t^T q_t,

i.e. Gated DeltaNet (g and beta), DeltaNet (beta only), KDA (gk and beta), GLA (gk only) and the scalar-gate
decay families (g only: RetNet, lightning, Mamba2; no gate at all is plain linear attention). One sequence per
call, q and k may have fewer (key) heads than v (each key head serves H / Hk consecutive value heads, as in
Qwen3.5), and the head repeat is never materialised. A leading batch axis goes through `jax.vmap` (the
pallas_call batching rule adds a grid axis); many segments packed in one sequence go through `gdn_varlen`.

Pipeline (two launches plus a few cheap XLA ops; a third launch and a product tree when T_C is asked for):

1. gates (XLA): b = chunk-local cumsum of the log decays, [H, L] for a scalar gate or [L, H, K] per key.
2. `_locals_kernel`, grid (chunks, heads), fully parallel: the WY/UT chunk form of `linear_attn.chunk_locals`,
   W = (I + M)^-1 (beta e^b K), U = (I + M)^-1 (beta V), and the masked decayed scores
   P_tj = scale q_t^T Diag(e^{b_t - b_j}) k_j (j <= t). `GDNConfig.solve` picks how (I + M)^-1 is built:
     "rows"      16 x 16 diagonal blocks by row-by-row forward substitution (masked reductions: Triton cannot index
                 register tensors), off-diagonal blocks by block forward substitution with 16 x 16 dots. The simplest
                 form; its serial reductions make this kernel the bottleneck on a GPU.
     "doubling"  the same block substitution, but each 16 x 16 diagonal block inverted by recursive doubling:
                 X_1 = I, X_2s = X_s - X_s (E_s X_s), where E_s holds the entries of M in the lower-left s x s
                 block of every 2s x 2s diagonal block. Exact because X_s E_s maps the first half of a 2s block to
                 the second and so squares to zero: (D_s + E_s)^-1 = (I - X_s E_s) X_s. Four levels of two 16^3
                 dots on the tensor cores instead of 15 serial reduction steps. This is the recursive
                 (divide-and-conquer) triangular inverse, whose error bound is that of substitution (Du Croz and
                 Higham, 1992): every X_s is the inverse of principal blocks of I + M, so no intermediate grows the
                 way the powers of M in a Neumann product X = (I - M)(I + M^2)(I + M^4)... do for correlated keys.
     "tile"      the doubling applied to the whole [c, c] tile (log2 c levels of two c^3 dots, then W and U as
                 one [c, c] x [c, K + V] product each): fewest, largest dots, 3x the solve arithmetic. Scalar gates
                 only (per-key M is formed in 16 x 16 blocks, see below); per-key gates fall back to "doubling".
   Per-key decays (KDA, GLA) cannot factor e^{b_t - b_j} into a row and a column factor without a positive
   exponent (that is what overflows for strong gates), so the pairwise blocks use a reference point r between
   the two 16-token blocks: for t in block i > j, q_t^T Diag(e^{b_t - b_j}) k_j = (q_t e^{b_t - b_r})^T
   (k_j e^{b_r - b_j}) with r the first token of block i, both exponents <= 0 and one 16 x 16 dot. A diagonal
   block takes the same one-dot form with r its own first token when the decay accumulated inside the block is
   at most 40 (then e^{b_r - b_j} <= e^40 cannot overflow); stronger decays form it one column at a time
   ([16, K] elementwise, exponents b_t - b_j, t >= j), sub x sub x K exponentials instead of 2 sub x K. With
   per-key gates the kernel also writes the state pass's keys decayed to the chunk's end and its scaled, decayed
   queries, so that the sequential pass does no per-key exponentials.
3. `_state_kernel`, grid (state column blocks, heads, pieces): the chunk-to-chunk recurrence
   S <- Diag(e^{b_c}) S + Khat^T (U - W S). Columns of the state are independent (every operation left-multiplies
   S), so the state is split into column blocks of `block_v`: that alone gives heads x V / block_v programs at
   batch 1 instead of heads. A scalar gate's decays scale the [c, block_v] tiles (the new values before the
   Khat^T product, the outputs after the query product) rather than the [c, K] keys and queries: a quarter of the
   elementwise work per step at K = 128, block_v = 32, and that work sits on the sequential chain.
   On top of that the sequence is cut into `pieces`: each piece's (T, S(piece|0)) comes
   from a first pass over the identity-widened state [S | M] (M_0 = I, zero values in the M columns), the pieces'
   pairs are composed by an associative scan in XLA (`linear_attn.compose`, float32 HIGHEST; P pairs only), and a
   second pass restarts every piece from its true incoming state and writes the outputs. The sequential depth
   drops from L/c to 2 L/(c P) chunk steps at the price of 3x the state-pass arithmetic; the segment's own
   (T_C, S(C|0)) is the last scan prefix, so emitting it is free in this mode. With pieces = 1 (direct mode)
   S(C|0) is the pass's own final state and T_C comes from `_transfer_pass` (`GDNConfig.transfer_group`): the
   same kernel steps identity columns with zero values through groups of chunks, all groups at once, and a
   log-depth tree multiplies the groups' products; or, with transfer_group = 0, from K identity columns that
   widen the single pass (K / block_v more programs at the full depth L / c).
   Packed segments (`gdn_varlen`) use the same kernel with two int32 per-chunk tables: reset the state at a
   segment's first chunk, store it to the segment's slot after its last chunk. Their dense T comes from the
   widened packed pass by default (`default_varlen_config`, the faster there), or with transfer_group > 0
   from the transfer pass, resetting identity columns at segment starts within each group, and a segmented
   product scan over the groups joins the segments that span several (`_varlen_transfer`). Every segment is
   padded to whole chunks so that no chunk straddles a boundary, but only in the index space: two more tables
   (each chunk's first packed token and its count of real tokens) let both kernels read q, k, v and write o in
   place in the packed arrays with masked loads and stores (`GDNConfig.packed_reads`), so the only XLA copies are
   the gates'. That is faster than gathering, with and without each segment's dense (T, S) (`bench/kernels.py --all
   --sections varlen` times it beside fla's varlen chunk_gated_delta_rule). `gdn_forward` uses the same tables when
   L is not a multiple of the chunk (the last chunk partly empty) instead of zero-padding q, k, v, which brings such
   lengths close to the time of the aligned ones.

Memory between launches: W, U ([L, H, K] and [L, H, V]) and P ([H, L, c]) in `inter_dtype` (bfloat16 for
bfloat16 inputs, like the inputs themselves; float32 otherwise), plus b ([L, H, K] float32 for per-key gates, with
the decayed keys and queries [L, H, K] in `inter_dtype`).
Nothing per chunk of state size is ever written: the per-chunk states that a two-kernel (state pass, then outputs)
design stores ([L/c, H, K, V] float32, 1 GB at L = 32k) are kept in registers because the output read is fused
into the state pass. States are float32 always.

Performance: bench/kernels.py times the forward at L = 32k, batch 1, 16 key -> 32 value heads of 128, bf16 inputs,
beside flash-linear-attention's chunk_gated_delta_rule and chunk_kda; bench/ncu_gdn.py profiles it under Nsight
Compute; bench/RESULTS.md holds the numbers. Both Triton kernels are latency-bound: the chunk-local kernel holds 232
registers a thread, so two programs share an SM, and many of its warp stalls wait on global loads; the state pass is
one 4-warp program per SM (166 registers, 189 KB of shared memory for its load pipeline), stalled on barriers and
loads. The chunk-local kernel's time follows its number of dots rather than their flops (see `_inverse_doubling`).
Both kernels already issue Hopper's warpgroup MMA. Slower alternatives, hence not used (bench/RESULTS.md has their
times): a chunk step on materialised [K, K] transfer operators; the outputs' intra-chunk term folded into the
chunk-local kernel; one chunk-local program per key head; the doubling's low levels on stacked blocks; several
chunks per chunk-local program as a software-pipelined loop; P formed in the state pass from the q and k tiles it
loads; the state held transposed, [BV, K], so that the chain's dots read it from registers; 8 warps in either
kernel; the next piece's chunk-local kernel on a second GPU stream (bench/overlap_gdn.py: XLA does not overlap the
two, with or without its latency-hiding scheduler); the chunk-local kernel launched heads-first, so that value
heads sharing a key head read its tile together; chunk 128 (only one state-pass stage fits the shared memory, and
unpipelined steps are several times slower).
Lowering on Hopper: the state pass of direct launches runs under Mosaic GPU (`gdn_mgpu`, `GDNConfig.state_lowering`),
and so does the chunk-local kernel wherever its Mosaic GPU version takes the launch (`gdn_locals_mgpu`,
`GDNConfig.locals_lowering`: a block streams a run of chunks through TMA while two warpgroups solve alternate
chunks, where a Triton program waits on each chunk's loads); both are faster than their Triton versions
(bench/forward_lowerings.py). Everything else here is Triton, the decode step included (see `pallas.decode`).

Precision knobs (`GDNConfig.locals_precision`, `state_precision`, `solve_precision`) choose the dot algorithm of
float32 operands: "ieee" (exact float32 FMA), "tf32", "bf16x3" (three bfloat16 passes, about float32 accuracy on
tensor cores) or "bf16" (operands rounded to bfloat16, as flash-linear-attention does for the state). Interpret
mode on the CPU runs "ieee" exactly and emulates "bf16" by rounding the operands.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hypic_jax.pallas import gdn_locals_mgpu, gdn_mgpu
from hypic_jax.pallas.compose import compose_all
from hypic_jax.pallas.platform import is_hopper
from hypic_jax.summary import Summary, advance, compose, einsum, transfer_form

__all__ = ["GDNConfig", "gdn_forward", "gdn_varlen", "default_config", "default_varlen_config",
           "default_interpret", "flops", "supports"]

_PRECISIONS = ("ieee", "tf32", "bf16x3", "bf16")
_SOLVES = ("rows", "doubling", "tile")


_STATE_LOWERINGS = ("auto", "triton", "mosaic")


@dataclasses.dataclass(frozen=True)
class GDNConfig:
    """Tuning knobs of the chunked forward (hashable: it is a static argument).

    chunk: tokens per chunk (16, 32, 64 or 128); the chunk-local [chunk, chunk] work grows as chunk^2, the number
      of sequential state steps as 1 / chunk.
    block_v: state columns per program of the state pass (16 ... V, power of two): more, narrower programs at
      batch 1; each re-reads the chunk's W, K, Q (L2 serves the repeats when column blocks run side by side, which
      is why the column block is the fastest-varying grid axis).
    pieces: sequence pieces summarised in parallel (the transfer-operator split); 1 runs a single direct pass.
    inter_dtype: dtype of W, U, P between the launches ("bfloat16" | "float32" | None = bfloat16 iff the inputs are).
    solve: how the chunk-local (I + M)^-1 is built: "rows", "doubling" or "tile" (module docstring).
    sub: diagonal block edge of the "rows" and "doubling" solves (16, 32 or 64; at most the chunk): larger blocks
      mean fewer, larger dots in the block substitution and a deeper diagonal inverse.
    transfer_group: how a direct launch (pieces = 1) emits a delta rule's dense T_C, and `gdn_varlen` each packed
      segment's: 0 widens the state by K identity columns; N > 0 runs a separate launch over groups of N chunks in
      parallel and multiplies the groups' products (`_transfer_pass`, `_varlen_transfer`). The transfer pass costs
      less than widening for `gdn_forward` and more for packed segments, so `default_varlen_config` widens
      (bench/kernels.py; bench/transfer_pass.py times the pass alone). Where the state pass may run under Mosaic
      GPU, so do the group products (`gdn_mgpu.transfer_pass_mgpu`, scalar gates, keys chunk-aligned), which are
      faster than Triton's.
    locals_precision / state_precision: dot algorithm for float32 operands (see the module docstring); None picks
      "bf16" for bfloat16 inputs (flash-linear-attention's precision) and "ieee" otherwise.
    solve_precision: dot algorithm of the inverse's own dots ("doubling": the diagonal blocks; "tile": all of it).
      None follows locals_precision ("bf16" for bfloat16 inputs, "ieee" otherwise): in interpret mode (L = 128,
      chunk 64, bf16 inputs, bf16 locals and state dots) a one-pass bfloat16 inverse changes the output error by a
      few percent of itself, for random keys and for keys 90% correlated: the inverse's precision is lost in that
      of the other bf16 dots.
    *_warps / *_stages: Triton launch parameters of the two kernels.
    state_lowering: "mosaic" runs the state pass as `gdn_mgpu.state_pass_mgpu` (Hopper; a direct launch with
      scalar gates, the delta rule, chunk 64, K = 128, whole chunks, (T, S) not widened; anything else is refused),
      "triton" as `_state_kernel`, "auto" (default) picks Mosaic GPU on a Hopper GPU for the launches it takes and
      Triton otherwise (other families and layouts, packed segments, pieces, interpret mode). The Mosaic GPU pass
      is the faster, with and without (T, S), and more so in clusters (`state_cluster`; bench/state_pass.py,
      bench/forward_lowerings.py).
    locals_lowering: "mosaic" runs the chunk-local kernel as `gdn_locals_mgpu.chunk_locals_mgpu` (Hopper; the
      "tile" solve with a scalar gate or none, the delta rule, bf16 inputs and dots, chunk 64, K = V = 128, whole
      chunks, no packed segments or partial last chunk; anything else is refused), "triton" as `_locals_kernel`, "auto"
      (default) picks Mosaic GPU on a Hopper GPU for the launches it takes and Triton otherwise. The Mosaic GPU
      kernel is the faster, also when a head's chunks do not split evenly into runs (bench/locals_mgpu.py). A
      length that leaves the last chunk partial runs Triton's (it reads q, k, v in place there).
    state_cluster: under Mosaic GPU, column blocks of one head launched as a cluster that receives the head's W, K,
      Q and P through one multicast copy (1: no clusters; used where it divides the head's V / block_v blocks).
      The pass is bound by the bytes the SMs draw from L2 (about 6.6 TB/s in all), and the multicast halves the
      L2 reads of those operands: clusters of 2 speed the pass up, clusters of 4 slow it down (bench/state_pass.py).
    state_prefetch: the state pass issues each step's decay and segment-table loads one step ahead, carried in the
      loop. Triton's software pipeline prefetches the tiles that feed dots; these small loads feed only
      elementwise work, and without the carry each step may wait on one before its first product. The carry
      speeds packed segments up by a few percent, with and without T, and leaves the single-sequence forward
      within its run-to-run spread (bench/kernels.py).
    packed_reads: how the kernels see a chunk-aligned layout that the tokens do not fill (packed segments in
      `gdn_varlen`; a length that is not a multiple of the chunk in `gdn_forward`). True: they read q, k, v and
      write o in place in the given arrays, chunk n being rows src[n] .. src[n] + cnt[n] (masked loads and stores,
      two int32 tables), and only the gates are copied into the layout; False: q, k, v are copied (gathered or
      zero-padded) into the layout and o back out of it in XLA, one extra read and write of each. Every family
      and solve reads in place (per-key gates: q, k, v in the chunk-local kernel, o in the state pass, which
      takes that kernel's decayed keys and queries).
    segment_grid: `gdn_varlen` runs segments that each start from their own state (from zero, or from
      initial_state without continues) as separate programs, a third grid axis over the segments, so the state
      pass's sequential depth is the longest segment's chunks instead of all of them (segments that continue one
      another always run as one program). Off by default: on the H200, at a stitched request's shape (68 segment
      slots, 33 fresh pieces of one or a few chunks, 32 heads), the passes of 30 layers took 14.9 ms with it
      against 6.4 ms without (`bench/rag_trace.py`, bench/RESULTS.md): thousands of programs of one step each
      cost more than the sequential steps they replace. Long packed segments (cold prefills) are not measured.

    Defaults: the fastest Gated DeltaNet forward at L = 32k, 16 key -> 32 value heads of 128, bf16 inputs, on the
    H200 (bench/kernels.py times the variants beside fla's chunk_gated_delta_rule; see bench/RESULTS.md): solve
    "tile" at chunk 64 with a 4-warp chunk-local kernel, and a 4-warp, 3-stage state pass at block_v 32; chunk 32,
    the "doubling" solve, 8 warps in either kernel, block_v 16 or 64, 2 state stages and 2 state warps are all
    slower. (T, S) come from the transfer pass over 64-chunk groups (smaller groups and the widened pass cost
    more). The state pass's prefetched small loads (`state_prefetch`) are on for packed segments' sake. On Hopper
    both kernels run under Mosaic GPU where they can (`state_lowering` and `locals_lowering` "auto"), the state
    pass in clusters of two (`state_cluster`).
    Per-key gates (KDA) take `default_config(per_key=True)`; with them, "rows"/"doubling" at chunk 64 exceed the
    H200's shared memory, and `gdn_forward` refuses such a launch with a ValueError.
    """

    chunk: int = 64
    block_v: int = 32
    pieces: int = 1
    inter_dtype: str | None = None
    solve: str = "tile"
    sub: int = 16
    transfer_group: int = 64
    locals_precision: str | None = None
    state_precision: str | None = None
    solve_precision: str | None = None
    locals_warps: int = 4
    locals_stages: int = 1
    state_warps: int = 4
    state_stages: int = 3
    state_prefetch: bool = True
    packed_reads: bool = True
    segment_grid: bool = False
    state_lowering: str = "auto"
    state_cluster: int = 2
    locals_lowering: str = "auto"

    def __post_init__(self):
        if self.chunk not in (16, 32, 64, 128):
            raise ValueError(f"chunk must be 16, 32, 64 or 128, got {self.chunk}")
        if self.block_v < 16 or self.block_v & (self.block_v - 1):
            raise ValueError(f"block_v must be a power of two >= 16, got {self.block_v}")
        if self.pieces < 1:
            raise ValueError(f"pieces must be >= 1, got {self.pieces}")
        if self.solve not in _SOLVES:
            raise ValueError(f"solve must be one of {_SOLVES}, got {self.solve!r}")
        if self.sub not in (16, 32, 64):
            raise ValueError(f"sub must be 16, 32 or 64, got {self.sub}")
        if self.transfer_group < 0:
            raise ValueError(f"transfer_group must be >= 0, got {self.transfer_group}")
        if self.state_cluster not in (1, 2, 4):
            raise ValueError(f"state_cluster must be 1, 2 or 4, got {self.state_cluster}")
        if self.state_lowering not in _STATE_LOWERINGS:
            raise ValueError(f"state_lowering must be one of {_STATE_LOWERINGS}, got {self.state_lowering!r}")
        if self.locals_lowering not in _STATE_LOWERINGS:
            raise ValueError(f"locals_lowering must be one of {_STATE_LOWERINGS}, got {self.locals_lowering!r}")
        for name in ("locals_precision", "state_precision", "solve_precision"):
            if getattr(self, name) not in _PRECISIONS + (None,):
                raise ValueError(f"{name} must be one of {_PRECISIONS}, got {getattr(self, name)!r}")

    def resolved(self, dtype) -> "GDNConfig":
        """The config with every None precision replaced by its default for inputs of `dtype`."""
        low = jnp.dtype(dtype) == jnp.bfloat16
        return dataclasses.replace(
            self,
            locals_precision=self.locals_precision or ("bf16" if low else "ieee"),
            state_precision=self.state_precision or ("bf16" if low else "ieee"),
            solve_precision=self.solve_precision or self.locals_precision or ("bf16" if low else "ieee"),
        )


def default_config(per_key: bool = False) -> GDNConfig:
    """The default launch. per_key (KDA, GLA: per-key decays): chunk 16 (one 16 x 16 diagonal block, so
    "doubling" is one doubling inverse), about twice as fast as chunk 32 for KDA at L = 32k (bench/kernels.py);
    "rows" and "doubling" at chunk 64 request 233,472 bytes of shared memory with per-key gates, over the H200's
    232,448, and "tile" takes scalar gates only. Scalar gates: `GDNConfig()`."""
    return GDNConfig(chunk=16, solve="doubling", locals_warps=2) if per_key else GDNConfig()


def default_varlen_config(per_key: bool = False) -> GDNConfig:
    """`default_config` with each packed segment's T from the widened state (transfer_group = 0): for 64 segments
    in 32k tokens the widened pass is faster than the transfer pass over groups of any size, with or without packed
    reads (`bench/kernels.py --all --sections varlen`), the reverse of `gdn_forward`'s ranking on one 32k
    sequence. No profile says where the packed transfer pass loses (its launch, or the segmented product scan and
    slot gathers in XLA after it)."""
    return dataclasses.replace(default_config(per_key), transfer_group=0)


def _pow2(d: int) -> bool:
    return d >= 16 and not d & (d - 1)


def supports(q, k, v, *, gk=None) -> bool:
    """Whether `gdn_forward` handles these inputs (K and V powers of two >= 16, L > 0, key heads dividing value
    heads; any of the gates g, gk, beta)."""
    if q is None or k.ndim != 3 or v.ndim != 3 or k.shape[0] == 0:
        return False
    if v.shape[1] % k.shape[1]:
        return False
    if gk is not None and gk.shape != (k.shape[0], v.shape[1], k.shape[2]):
        return False
    return _pow2(k.shape[-1]) and _pow2(v.shape[-1])


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


def _iotas(n: int, m: int | None = None) -> tuple[Array, Array]:
    m = n if m is None else m
    return lax.broadcasted_iota(jnp.int32, (n, m), 0), lax.broadcasted_iota(jnp.int32, (n, m), 1)


def _eye(n: int) -> Array:
    rows, cols = _iotas(n)
    return jnp.where(rows == cols, 1.0, 0.0).astype(jnp.float32)


def _inverse_rows(strict: Array) -> Array:
    """(I + strict)^-1 for a strictly lower-triangular [s, s] float32 tile, by forward substitution.

    Row i of X = (I + L)^-1 is e_i - sum_{j<i} L_ij X_j; rows are produced in order with masked reductions (Triton
    has no register-tensor indexing). s - 1 steps of O(s^2) vector work, exact in float32.
    """
    s = strict.shape[0]
    rows, _ = _iotas(s)
    eye = _eye(s)

    def step(i, x):
        l_i = jnp.sum(jnp.where(rows == i, strict, 0.0), axis=0)  # L[i, :] as a vector over j
        row = -jnp.sum(l_i[:, None] * x, axis=0)  # -(L[i, :] @ X), a vector over columns
        return jnp.where(rows == i, row[None, :] + eye, x)  # + e_i (eye's row i)

    return lax.fori_loop(1, s, step, eye)


def _inverse_doubling(strict: Array, precision: str) -> Array:
    """(I + strict)^-1 for a strictly lower-triangular [n, n] float32 tile (n a power of two) by recursive doubling.

    X_s = inverse of the block-diagonal part of I + strict at granularity s (X_1 = I). With E_s the entries of
    `strict` in the lower-left s x s block of each 2s x 2s diagonal block, X_2s = X_s - X_s (E_s X_s) (exact: see
    the module docstring). The first level is elementwise (X_2 = I - E_1), then log2(n) - 1 levels of two [n, n]
    dots; the block masks come from iotas, so no register tensor is ever sliced. The chunk-local kernel's time
    follows the number of these dots, not their size: hence the elementwise first level, and levels 2 to 8 as
    [64, 64] x [64, 16] dots on stacked diagonal blocks (fewer flops, more dots) are slower (bench/kernels.py; see
    bench/RESULTS.md).
    """
    n = strict.shape[0]
    rows, cols = _iotas(n)
    x = _eye(n) - jnp.where(jnp.logical_and((rows >> 1) == (cols >> 1), rows != cols), strict, 0.0)
    s = 2
    while s < n:
        shift = int(math.log2(s))
        same_pair = (rows >> (shift + 1)) == (cols >> (shift + 1))
        lower_left = (rows >> shift) != (cols >> shift)  # rows in the pair's second half, columns in its first
        e = jnp.where(jnp.logical_and(same_pair, lower_left), strict, 0.0)
        x = x - _dot(x, _dot(e, x, precision), precision)
        s *= 2
    return x


def _last_row(x: Array) -> Array:
    """The last row of a [c, K] tile (or last entry of a [c] tile) as [K] (a scalar): a masked sum."""
    n = x.shape[0]
    if x.ndim == 1:
        return jnp.sum(jnp.where(lax.iota(jnp.int32, n) == n - 1, x, 0.0))
    rows, _ = _iotas(n, x.shape[1])
    return jnp.sum(jnp.where(rows == n - 1, x, 0.0), axis=0)


_FACTORED_SPAN = 40.0  # largest log-decay inside one diagonal block that the factored pair form takes


def _pair_block_per_key(x_ref, k_ref, b_ref, i, j, sub, strict, precision):
    """[sub, sub] block (i, j) of x_t^T Diag(e^{b_t - b_j}) k_j for rows of block i, columns of block j <= i.

    Off-diagonal blocks: one dot of both sides decayed to the first token r of block i (b_t - b_r <= 0 and
    b_r - b_j <= 0 since j < r <= t). Diagonal block: the same with r the block's own first token, where the key
    side's exponent b_r - b_j >= 0 is bounded by the decay accumulated inside the block; when that exceeds
    `_FACTORED_SPAN` the block is formed one column per step instead ([sub, K] elementwise with exponents
    b_t - b_j, t >= j). Zero above the diagonal (or on it, `strict`). The column loop costs sub x sub x K
    exponentials against the factored form's 2 sub x K and one tensor-core dot.
    """
    rows_i = pl.ds(i * sub, sub)
    x = x_ref[rows_i, :].astype(jnp.float32)
    b_i = b_ref[rows_i, :]
    if i > j:
        rows_j = pl.ds(j * sub, sub)
        b_r = b_ref[pl.ds(i * sub, 1), :]  # [1, K]
        k_j = k_ref[rows_j, :].astype(jnp.float32) * jnp.exp(b_r - b_ref[rows_j, :])
        return _dot(x * jnp.exp(b_i - b_r), k_j, precision, trans_b=True)
    rows, cols = _iotas(sub)
    token = lax.iota(jnp.int32, sub)
    b_r = b_ref[pl.ds(i * sub, 1), :]  # [1, K]: the block's first token

    def factored():  # one dot, both sides decayed against the first token: e^{b_t - b_r} <= 1 <= e^{b_r - b_j}
        k_i = k_ref[rows_i, :].astype(jnp.float32)
        blk = _dot(x * jnp.exp(b_i - b_r), k_i * jnp.exp(b_r - b_i), precision, trans_b=True)
        return jnp.where(rows > cols if strict else rows >= cols, blk, 0.0)

    def columns():  # one key column at a time, every exponent b_t - b_j <= 0 (any gate strength)

        def column(col, acc):  # a loop, not unrolled: unrolled, the whole kernel is slower
            row = pl.ds(i * sub + col, 1)
            k_c, b_c = k_ref[row, :].astype(jnp.float32), b_ref[row, :]  # [1, K]
            keep = token > col if strict else token >= col
            decay = jnp.exp(jnp.where(keep[:, None], b_i - b_c, 0.0))
            value = jnp.where(keep, jnp.sum(x * k_c * decay, axis=1), 0.0)
            return acc + jnp.where(cols == col, value[:, None], 0.0)

        return lax.fori_loop(0, sub, column, jnp.zeros((sub, sub), jnp.float32))

    # The factored form needs e^{span} representable with room to spare (e^40 ~ 2e17); stronger decays inside one
    # block take the column loop.
    span = jnp.max(jnp.abs(b_r - b_i))
    return lax.cond(span <= _FACTORED_SPAN, factored, columns)


# ----------------------------------------------------------------------------------------------------------------
# Kernel 1: chunk-local quantities (parallel over chunks and heads).


class _PackedChunk:
    """One chunk of a packed sequence ref [L, D], indexed like the chunk's own [chunk, D] block: rows src .. src +
    cnt are the chunk's tokens, rows past cnt read as zeros (zero tokens: A = I, nothing added), so the kernels
    need no chunk-aligned copy of the sequence. Supports `x[...]`, `x[pl.ds(start, size), :]` and `x.store(tile)`
    (the chunk's real rows only)."""

    def __init__(self, ref, src, cnt, chunk):
        self.ref, self.src, self.cnt, self.chunk = ref, src, cnt, chunk

    def _rows(self, start, size):
        valid = start + lax.broadcasted_iota(jnp.int32, (size, self.ref.shape[-1]), 0) < self.cnt
        return self.ref.at[pl.ds(self.src + start, size), :], valid

    def __getitem__(self, idx):
        rows, valid = self._rows(*((0, self.chunk) if idx is Ellipsis else (idx[0].start, idx[0].size)))
        return pltriton.load(rows, mask=valid, other=0)

    def store(self, tile):
        rows, valid = self._rows(0, self.chunk)
        pltriton.store(rows, tile, mask=valid)


def _locals_kernel(*refs, chunk, sub, delta, per_key, scale, prec, solve, solve_prec, packed=False,
                   skip_empty=False, decayed=None, keys_t=False):
    """One (chunk, head): P = scale mask(Q K^T e^{b_t - b_j}) and, for the delta rule, W and U (WY/UT form).

    Refs (head axis squeezed by the BlockSpecs): q, k [c, K]; v [c, V]; b [c] or [c, K] (per key), beta [c]
    (float32); outputs p [c, c], w [c, K], u [c, V], and with per-key gates (or `decayed`) the state pass's
    decayed keys k e^{b_c - b} and queries scale q e^b [c, K] (per value head; with `keys_t` the keys as [K, c]). Every exponent is a difference b_t - b_j with
    t >= j (or split at a reference token between them), so <= 0 for decaying gates.
    With `packed` two int32 tables src, cnt [Nc] come first and q, k, v are the whole packed sequence [L, D]:
    chunk n is rows src[n] .. src[n] + cnt[n] (`_PackedChunk`). With `skip_empty` (packed only) a chunk of no
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
    chunk_rows = functools.partial(_PackedChunk, src=src_ref[n], cnt=cnt, chunk=chunk)
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
                    blk = scale * _pair_block_per_key(q_ref, k_ref, b_ref, i, j, sub, False, prec)
                else:
                    blk = jnp.zeros((sub, sub), jnp.float32)
                p_ref[pl.ds(i * sub, sub), pl.ds(j * sub, sub)] = blk.astype(p_ref.dtype)
    else:  # scores against the full chunk (one [c, K] x [K, c] dot)
        b_all = b_ref[...]
        rows, cols = _iotas(c)
        causal = rows >= cols
        diff = jnp.where(causal, b_all[:, None] - b_all[None, :], 0.0)
        k_all = k_ref[...]
        scores = _dot(q_ref[...], k_all, prec, trans_b=True) * jnp.where(causal, jnp.exp(diff), 0.0)
        p_ref[...] = (scale * scores).astype(p_ref.dtype)
    if not delta:
        return

    if solve == "tile" and not per_key:  # the whole [c, c] inverse by doubling, then W, U as one dot each
        beta_all = beta_ref[...]
        strict = rows > cols
        kk = _dot(k_all, k_all, prec, trans_b=True)
        m = jnp.where(strict, beta_all[:, None] * kk * jnp.exp(jnp.where(strict, diff, 0.0)), 0.0)
        x = _inverse_doubling(m, solve_prec)
        rhs_k = (beta_all * jnp.exp(b_all))[:, None] * k_all.astype(jnp.float32)
        w_ref[...] = _dot(x, rhs_k, prec).astype(w_ref.dtype)
        u_ref[...] = _dot(x, beta_all[:, None] * v_ref[...].astype(jnp.float32), prec).astype(u_ref.dtype)
        return

    srows, scols = _iotas(sub)
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
                pair = _pair_block_per_key(k_ref, k_ref, b_ref, i, j, sub, True, prec)
            else:
                kk = _dot(ks[i], ks[j], prec, trans_b=True)
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
        x[i, i] = _inverse_rows(m[i, i]) if solve == "rows" else _inverse_doubling(m[i, i], solve_prec)
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


def _state_kernel(*refs, chunk, num_chunks, delta, per_key, outputs, segments, value_blocks, scale, prec,
                  values=True, tails=False, prefetch=False, packed=False, seg_init=False, bounded=False,
                  fill=False, split=False, by_segment=False):
    """One (column block j, head, piece): S <- Diag(e^{b_c}) S + Khat^T (U - W S) over the piece's chunks.

    Refs: w, k, q [Lp, K]; u [Lp, BV]; p [Lp, c]; b [Lp] or [Lp, K] (per-key gates: k and q come decayed from the
    chunk-local kernel, and only b's last row per chunk is read); with `segments` the int32 tables start
    [Nc] (1: reset the state to init before this chunk) and slot [Nc] (segment whose state is final after this
    chunk, else -1); init [K, BV]; outputs o [Lp, BV], final [K, BV] (or [N, K, BV] slots with segments). Column
    blocks j >= value_blocks are identity-widened columns (their values are zero) and write no outputs.
    The output read o = (scale Q e^b) S + P (U - W S) is fused into the same step, so per-chunk states never
    leave registers. Without `values` (no u ref; delta rule only) every column is a transfer column: S starts from
    identity columns and the pass returns the product of the chunks' transfer operators. With `tails` (segments
    over several pieces) a last output [K, BV] also takes each piece's final state: the product since its last
    reset (`_varlen_transfer`). With `packed` two more int32 tables src, cnt [Nc] follow the segment tables, and
    o (and u, which is v, without the delta rule; k and q with scalar gates) are whole packed sequences [L, D]
    read and written in place, chunk n being rows src[n] .. src[n] + cnt[n] (`_PackedChunk`).
    With `seg_init` (segments, one piece) init is [n, K, BV], one state per segment, and the start table says
    which: 1 + the row to load before this chunk, 0 to carry the state on (so a segment may continue the one
    before it); the state before the first chunk is zero. With `bounded` an int32 [1] table follows the segment
    tables: the number of chunks to step (the chunks that hold tokens); the chunks after it are never read.
    With `fill` (segments) an int32 [N] table follows the init: segment rows to set to init before the pass (empty
    segments own no chunk, so the pass never stores their rows). With `split` (segments, identity-widened) the
    final states go to two outputs, the value columns [N, K, BV] and the transfer columns [N, K, BV], so that no
    slice of a widened [N, K, V + K] array is copied out afterwards. With `by_segment` (segments that each start
    from their own state) two int32 [N] tables follow the live table's place, each segment's first chunk and one
    past its last, and program (j, h, s) steps segment s alone (its row of fill too).
    """
    it = iter(refs)
    w_ref = next(it) if delta else None
    u_ref = next(it) if values else None
    k_ref, b_ref = next(it), next(it)
    q_ref, p_ref = (next(it), next(it)) if outputs else (None, None)
    start_ref, slot_ref = (next(it), next(it)) if segments else (None, None)
    live_ref = next(it) if bounded else None
    begin_ref, end_ref = (next(it), next(it)) if by_segment else (None, None)
    src_ref, cnt_ref = (next(it), next(it)) if packed else (None, None)
    init_ref = next(it)
    fill_ref = next(it) if fill else None
    o_ref = next(it) if outputs else None
    final_ref = next(it)
    transfer_ref = next(it) if split else None
    tail_ref = next(it) if tails else None
    c = chunk
    is_value = None if value_blocks is None else pl.program_id(0) < value_blocks
    if seg_init:
        init = jnp.zeros(init_ref.shape[1:], jnp.float32)
    else:
        init = init_ref[...].astype(jnp.float32)
    if by_segment:
        segment = pl.program_id(2)
        first_chunk, steps = begin_ref[segment], end_ref[segment]
    else:
        first_chunk, steps = 0, (live_ref[0] if bounded else num_chunks)

    def store_final(row, state):
        if not split:
            final_ref[row] = state
            return

        @pl.when(is_value)
        def _():
            final_ref[row] = state

        @pl.when(jnp.logical_not(is_value))
        def _():
            transfer_ref[row] = state

    if fill and by_segment:
        @pl.when(fill_ref[segment] != 0)
        def _():
            store_final(segment, init)
    elif fill:
        def fill_row(row, carry):
            @pl.when(fill_ref[row] != 0)
            def _():
                store_final(row, init)

            return carry

        lax.fori_loop(0, fill_ref.shape[0], fill_row, 0)

    def small_loads(n):  # the step's loads that feed no dot directly: decays and segment tables
        first = n * c if isinstance(n, int) else pl.multiple_of(n * c, c)
        decays = b_ref[pl.ds(first + c - 1, 1), :] if per_key else b_ref[pl.ds(first, c)]
        return ((decays,) + ((start_ref[n], slot_ref[n]) if segments else ())
                + ((src_ref[n], cnt_ref[n]) if packed else ()))

    def body(n, carry):
        if prefetch:  # this step's small loads were issued one step earlier; issue the next step's now
            state, small = carry
            ahead = small_loads(jnp.minimum(n + 1, steps - 1))
        else:
            state, small, ahead = carry, small_loads(n), None
        rows = pl.ds(pl.multiple_of(n * c, c), c)
        if seg_init:  # load the segment's own initial state (a masked load: no memory read when carrying on)
            reset = small[1]
            loaded = pltriton.load(init_ref.at[jnp.maximum(reset - 1, 0)], mask=jnp.full(state.shape, reset != 0),
                                   other=0.0)
            state = jnp.where(reset != 0, loaded.astype(jnp.float32), state)
        elif segments:
            state = jnp.where(small[1] != 0, init, state)
        if packed:  # this chunk's rows of the packed arrays: src .. src + cnt
            in_place = functools.partial(_PackedChunk, src=small[-2], cnt=small[-1], chunk=c)
        if packed and not per_key:  # per-key gates read the chunk-local kernel's decayed k, q (chunk-aligned)
            k = in_place(k_ref)[...]
            q_rows = lambda: in_place(q_ref)[...]  # noqa: E731
        else:
            k = k_ref[rows, :]  # per-key gates: already decayed to the chunk's end (k e^{b_c - b})
            q_rows = lambda: q_ref[rows, :]  # noqa: E731
        if per_key:
            b_last = jnp.sum(small[0], axis=0)  # [K]
        else:
            b = small[0]  # [c]
            b_last = _last_row(b)
        if values:
            if packed and not delta:  # decay families: the values are v itself, packed like k and q
                u = in_place(u_ref)[...]
            else:
                u = u_ref[rows, :]
            u = u.astype(jnp.float32)
            if value_blocks is not None:
                u = jnp.where(is_value, u, 0.0)
            if delta:
                u = u - _dot(w_ref[rows, :], state, prec)
        else:  # transfer columns only: zero values
            u = -_dot(w_ref[rows, :], state, prec)
        if outputs:

            def write():
                if per_key:  # queries already scaled and decayed (scale q e^b)
                    o = _dot(q_rows(), state, prec)
                else:  # a row scale commutes with the product: scale the [c, BV] result, not the [c, K] queries
                    o = _dot(q_rows(), state, prec) * (scale * jnp.exp(b))[:, None]
                o = (o + _dot(p_ref[rows, :], u, prec)).astype(o_ref.dtype)
                if packed:
                    in_place(o_ref).store(o)
                else:
                    o_ref[rows, :] = o

            if value_blocks is None:
                write()
            else:
                pl.when(is_value)(write)
        if per_key:
            state = jnp.exp(b_last)[:, None] * state + _dot(k, u, prec, trans_a=True)
        else:  # Khat^T U = K^T (Diag(e^{b_c - b}) U): the decay scales the [c, BV] values, not the [c, K] keys
            state = jnp.exp(b_last) * state + _dot(k, u * jnp.exp(b_last - b)[:, None], prec, trans_a=True)
        if segments:
            slot = small[2]

            @pl.when(slot >= 0)
            def _():
                store_final(slot, state)

        return (state, ahead) if prefetch else state

    if prefetch:  # (an empty last segment starts past the last chunk: its first loads read the last chunk's)
        ahead = small_loads(jnp.minimum(first_chunk, num_chunks - 1)) if by_segment else small_loads(0)
        state, _ = lax.fori_loop(first_chunk, steps, body, (init, ahead))
    else:
        state = lax.fori_loop(first_chunk, steps, body, init)
    if not segments:
        final_ref[...] = state
    if tails:
        tail_ref[...] = state


# ----------------------------------------------------------------------------------------------------------------
# Launch wrappers.


def _compiler_params(warps, stages):
    return pltriton.CompilerParams(num_warps=warps, num_stages=stages)


def chunk_locals(q, k, v, b, beta, *, chunk, scale, inter_dtype, config, interpret, packed=None,
                 skip_empty=False, head_major=False):
    """P, W, U for every (chunk, head). b: [H, L] (scalar gate) or [L, H, K] (per key); beta [H, L] or None.
    packed: None, or the int32 tables (src, cnt) [Nc] of a chunk-aligned layout whose q, k, v stay packed
    (`_locals_kernel`); L is then the layout's length (b's), not q's. skip_empty (packed only): chunks of no
    tokens write nothing (their outputs are undefined).

    Outputs are token-major (P [H, L, c], W, U and decayed keys and queries [L, H, D]), or with `head_major` chunk
    by chunk and head by head ([Nc, H, c, c] and [Nc, H, c, D], the decayed keys transposed: [Nc, H, K, c]), the
    layouts `piece_fold.chunk_fold` reads, so that no transpose of these arrays runs between the kernels;
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
                               decayed=decayed, keys_t=head_major, scale=scale, prec=config.locals_precision, solve=config.solve,
                               solve_prec=config.solve_precision, packed=packed is not None,
                               skip_empty=skip_empty and packed is not None)
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


def _state_pass(w, u, k, b, q, p, init, *, chunk, pieces, value_dim, out_dtype, scale, config, interpret,
                segments=None, tails=False, packed=None, packed_length=None, segment_init=False, live=None,
                fill=None, split=False, by_segment=None):
    """Run the state recurrence over `pieces` equal pieces from init [pieces, H, K, Wd] (Wd = V or V + K).

    Returns (o [L, H, V] or None, final [pieces, H, K, Wd]). q, p None -> no outputs. `segments` = (start, slot,
    n) runs packed segments: the int32 per-chunk tables of `_state_kernel`; final is then [n, H, K, Wd], and with
    `tails` a third result holds each piece's final state [pieces, H, K, Wd]. u None (delta rule, no outputs):
    transfer columns only (`_transfer_pass`, `_varlen_transfer`). packed: None, or the int32 tables (src, cnt)
    [Nc] of a chunk-aligned layout whose outputs stay packed (and k, q with scalar gates: per-key gates pass the
    chunk-local kernel's decayed k, q, chunk-aligned); L is then b's length, the layout's, and o is
    [packed_length, H, V].
    segment_init (segments, pieces = 1): init is [n, H, K, Wd], one initial state per segment, and the start
    table holds 1 + the row to load (0: carry on; `_state_kernel`). live: None, or an int32 [1] array, the number
    of chunks to step (the rest are never read).
    fill (segments, one init for all): None, or an int32 [n] table: rows of final set to init before the pass
    (empty segments; rows that neither a chunk nor fill writes are left undefined). split (segments, widened): final
    is two arrays, the value columns [n, H, K, V] and the transfer columns [n, H, K, Wd - V]. by_segment (segments,
    one piece, every segment starting from its own state: the start table is nonzero at each one's first chunk):
    None, or int32 [n] tables (first chunk, one past the last) of the segments, which then run as parallel
    programs (`GDNConfig.segment_grid`).
    """
    key_heads, key_dim = k.shape[1:]
    per_key = b.ndim == 3
    length = b.shape[0] if per_key else b.shape[1]
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
    values = u is not None
    if not values and (outputs or not delta):
        raise ValueError("a pass without values runs transfer columns only: delta rule, no outputs")

    def vcol(j):  # value column block of program j (identity-widened programs read block 0 and mask it)
        return jnp.minimum(j, value_blocks - 1) if widened else j

    in_specs, args = [], []
    if delta:
        in_specs.append(pl.BlockSpec((piece_len, None, key_dim), lambda j, h, s: (s, h, 0)))
        args.append(w)
    if values and packed is not None and not delta:  # v itself, packed
        in_specs.append(pl.BlockSpec((u.shape[0], None, block_v), lambda j, h, s: (0, h, vcol(j))))
        args.append(u)
    elif values:
        in_specs.append(pl.BlockSpec((piece_len, None, block_v), lambda j, h, s: (s, h, vcol(j))))
        args.append(u)
    # keys and queries: the piece's rows, or with packed reads the whole packed sequence
    qk_spec = (pl.BlockSpec((k.shape[0], None, key_dim), lambda j, h, s: (0, h // group, 0))
               if packed is not None and not per_key
               else pl.BlockSpec((piece_len, None, key_dim), lambda j, h, s: (s, h // group, 0)))
    in_specs += [
        qk_spec,
        pl.BlockSpec((piece_len, None, key_dim), lambda j, h, s: (s, h, 0)) if per_key
        else pl.BlockSpec((None, piece_len), lambda j, h, s: (h, s)),
    ]
    args += [k, b]
    if outputs:
        in_specs += [qk_spec, pl.BlockSpec((None, piece_len, chunk), lambda j, h, s: (h, s, 0))]
        args += [q, p]
    if segments is not None:
        start, slot, n_seg = segments
        table = pl.BlockSpec((start.shape[0] // pieces,), lambda j, h, s: (s,))
        in_specs += [table, table]
        args += [start, slot]
    elif tails or segment_init:
        raise ValueError("tails and per-segment initial states belong to packed segments: segments needed")
    if segment_init and pieces != 1:
        raise ValueError("per-segment initial states run one piece")
    if (fill is not None or split) and (segments is None or segment_init):
        raise ValueError("fill and split belong to packed segments from one init")
    if by_segment is not None and (segments is None or pieces != 1 or tails):
        raise ValueError("a pass by segment runs packed segments in one piece, without tails")
    if split and (not widened or tails):
        raise ValueError("split needs an identity-widened state and no tails")
    if live is not None:
        if pieces != 1:
            raise ValueError("a bounded pass runs one piece")
        in_specs.append(pl.BlockSpec((1,), lambda j, h, s: (0,)))
        args.append(live)
    if by_segment is not None:
        in_specs += [pl.BlockSpec((n_seg,), lambda j, h, s: (0,))] * 2
        args += [a.astype(jnp.int32) for a in by_segment]
    if packed is not None:
        table = pl.BlockSpec((packed[0].shape[0] // pieces,), lambda j, h, s: (s,))
        in_specs += [table, table]
        args += list(packed)
    state_spec = pl.BlockSpec((None, None, key_dim, block_v), lambda j, h, s: (s, h, 0, j))
    if segment_init:
        in_specs.append(pl.BlockSpec((init.shape[0], None, key_dim, block_v), lambda j, h, s: (0, h, 0, j)))
    else:
        in_specs.append(state_spec)
    args.append(init)
    if fill is not None:
        in_specs.append(pl.BlockSpec((fill.shape[0],), lambda j, h, s: (0,)))
        args.append(fill.astype(jnp.int32))
    out_specs, out_shape = [], []
    if outputs and packed is not None:
        out_specs.append(pl.BlockSpec((packed_length, None, block_v), lambda j, h, s: (0, h, vcol(j))))
        out_shape.append(jax.ShapeDtypeStruct((packed_length, heads, value_dim), out_dtype))
    elif outputs:
        out_specs.append(pl.BlockSpec((piece_len, None, block_v), lambda j, h, s: (s, h, vcol(j))))
        out_shape.append(jax.ShapeDtypeStruct((length, heads, value_dim), out_dtype))
    if segments is None:
        out_specs.append(state_spec)
        out_shape.append(jax.ShapeDtypeStruct(init.shape, jnp.float32))
    elif split:  # programs of value columns store into the first, those of transfer columns into the second
        out_specs.append(pl.BlockSpec((n_seg, None, key_dim, block_v),
                                      lambda j, h, s: (0, h, 0, jnp.minimum(j, value_blocks - 1))))
        out_shape.append(jax.ShapeDtypeStruct((n_seg, heads, key_dim, value_dim), jnp.float32))
        out_specs.append(pl.BlockSpec((n_seg, None, key_dim, block_v),
                                      lambda j, h, s: (0, h, 0, jnp.maximum(j - value_blocks, 0))))
        out_shape.append(jax.ShapeDtypeStruct((n_seg, heads, key_dim, width - value_dim), jnp.float32))
    else:
        out_specs.append(pl.BlockSpec((n_seg, None, key_dim, block_v), lambda j, h, s: (0, h, 0, j)))
        out_shape.append(jax.ShapeDtypeStruct((n_seg, heads, key_dim, width), jnp.float32))
        if tails:
            out_specs.append(state_spec)
            out_shape.append(jax.ShapeDtypeStruct((pieces,) + init.shape[1:], jnp.float32))
    kernel = functools.partial(
        _state_kernel,
        chunk=chunk,
        num_chunks=piece_len // chunk,
        delta=delta,
        per_key=per_key,
        outputs=outputs,
        segments=segments is not None,
        value_blocks=value_blocks if widened else None,
        scale=scale,
        prec=config.state_precision,
        values=values,
        tails=tails,
        prefetch=config.state_prefetch,
        packed=packed is not None,
        seg_init=segment_init,
        bounded=live is not None,
        fill=fill is not None,
        split=split,
        by_segment=by_segment is not None,
    )
    grid_last = pieces
    if by_segment is not None:  # program s steps segment s; every block is the whole one-piece array
        pin = lambda spec: dataclasses.replace(spec, index_map=lambda j, h, s, f=spec.index_map: f(j, h, 0))  # noqa
        in_specs, out_specs = [pin(x) for x in in_specs], [pin(x) for x in out_specs]
        grid_last = n_seg
    res = pl.pallas_call(
        kernel,
        grid=(col_blocks, heads, grid_last),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_compiler_params(config.state_warps, config.state_stages),
        interpret=interpret,
        name="gdn_state_pass",
    )(*args)
    res = list(res) if outputs else [None] + list(res)
    return tuple(res)


def _pad_to_groups(w, k, b, chunk, group):
    """Chunk-aligned W, K, b padded with zero tokens (A = I) to whole groups of `group` chunks; a sequence shorter
    than one group is one group, not one padded to `group` chunks. Returns (w, k, b, group, groups, padded
    chunks); k None (keys read in place) stays None."""
    num_chunks = w.shape[0] // chunk
    group = min(group, num_chunks)
    groups = -(-num_chunks // group)
    pad = groups * group - num_chunks
    if pad:
        w = jnp.pad(w, [(0, pad * chunk), (0, 0), (0, 0)])
        k = None if k is None else jnp.pad(k, [(0, pad * chunk), (0, 0), (0, 0)])
        b = jnp.pad(b, [(0, 0), (0, pad * chunk)] if b.ndim == 2 else [(0, pad * chunk), (0, 0), (0, 0)])
    return w, k, b, group, groups, pad


def _transfer_pass(w, k, b, *, chunk, group, config, interpret, packed=None):
    """T_C = A_N ... A_1 of a whole (chunk-aligned) sequence, A_c = Diag(e^{b_c}) - Khat_c^T W_c, as [H, K, K].

    Why not widen the forward's own state by K identity columns: that doubles the programs of a pass whose time is
    set by its sequential depth and its per-SM work (bench/RESULTS.md), so T would cost about as much as the forward's
    state pass again. Here the product splits at `group`-chunk boundaries instead: one launch steps every group's
    identity columns through its chunks (zero values: S <- A S), all groups in parallel (depth `group` instead of
    L / c), and `compose.compose_all`'s log-depth tree multiplies the groups' [K, K] products in order
    (associativity of the matrix product; float32-level "bf16x3" dots unless the state dots are exact "ieee").
    Zero tokens pad the sequence to whole groups: they have A = I. packed: the (src, cnt) tables of keys read in
    place (`_state_pass`); the padded chunks get empty entries.
    """
    key_dim, heads = k.shape[-1], w.shape[1]
    w, k_padded, b, group, groups, pad = _pad_to_groups(w, None if packed is not None else k, b, chunk, group)
    if packed is None:
        k = k_padded
    elif pad:
        packed = tuple(jnp.pad(t, (0, pad)) for t in packed)
    if _mosaic_transfer(config, chunk, key_dim, b, packed, interpret):
        ts = gdn_mgpu.transfer_pass_mgpu(w, k, b, chunk=chunk, group_chunks=group, config=_mosaic_state_config(config))
    else:
        eye = jnp.broadcast_to(jnp.eye(key_dim, dtype=jnp.float32), (groups, heads, key_dim, key_dim))
        _, ts = _state_pass(w, None, k, b, None, None, eye, chunk=chunk, pieces=groups, value_dim=key_dim,
                            out_dtype=jnp.float32, scale=1.0, config=config, interpret=interpret, packed=packed)
    transfer, _ = compose_all(ts, None, "f32" if config.state_precision == "ieee" else "bf16x3")
    return transfer


def _mosaic_transfer(config, chunk, key_dim, b, packed, interpret) -> bool:
    """Whether the transfer pass's group products run under Mosaic GPU (`gdn_mgpu.transfer_pass_mgpu`): as the
    state pass does (`GDNConfig.state_lowering`: "auto" on a Hopper GPU, "mosaic" always) wherever the kernel takes
    the launch (scalar gates, keys chunk-aligned, bf16 state dots, chunk 64, K = 128); Triton's pass otherwise (a
    launch the state pass refuses under "mosaic" has been refused before this is asked)."""
    if config.state_lowering == "triton" or interpret:
        return False
    return (b.ndim == 2 and packed is None and config.state_precision == "bf16"
            and gdn_mgpu.supported(chunk, key_dim, key_dim, config.block_v)
            and (config.state_lowering == "mosaic" or is_hopper()))


def _chunk_cumsum(g: Array | None, length: int, heads: int, chunk: int) -> Array:
    """b = cumsum of the log gates inside each chunk, as [H, L] float32 (zeros without a gate)."""
    if g is None:
        return jnp.zeros((heads, length), jnp.float32)
    gc = g.astype(jnp.float32).reshape(length // chunk, chunk, heads)
    return jnp.cumsum(gc, axis=1).reshape(length, heads).T


def _chunk_cumsum_per_key(g: Array | None, gk: Array, chunk: int) -> Array:
    """b = chunk-local cumsum of gk (+ g broadcast over keys), as [L, H, K] float32."""
    log_decay = gk.astype(jnp.float32)
    if g is not None:
        log_decay = log_decay + g.astype(jnp.float32)[..., None]
    length = log_decay.shape[0]
    gc = log_decay.reshape((length // chunk, chunk) + log_decay.shape[1:])
    return jnp.cumsum(gc, axis=1).reshape(log_decay.shape)


def _prefix_tables(length: int, num_chunks: int, chunk: int) -> tuple[Array, Array]:
    """The (src, cnt) tables of a sequence of `length` tokens laid out as `num_chunks` chunks from token 0: chunk
    n is rows n c .. n c + cnt[n], and the chunks past the tokens are empty."""
    first = np.arange(num_chunks, dtype=np.int64) * chunk
    cnt = np.clip(length - first, 0, chunk)
    return jnp.asarray(np.where(cnt > 0, first, 0), jnp.int32), jnp.asarray(cnt, jnp.int32)


def _locals(q, k, v, g, gk, beta, *, scale, config, interpret, packed=None, skip_empty=False, head_major=False):
    """Gates and chunk-local kernel on a chunk-aligned (padded) sequence: returns (b, p, w, u, ks, qs); w is None
    and u = v without the delta rule; ks, qs are the keys and queries the state pass reads (k, q; with per-key gates
    the decayed k e^{b_c - b} and scale q e^b per value head). packed: the tables (src, cnt) of `chunk_locals`;
    q, k, v then stay packed while the gates (g, gk, beta) come chunk-aligned. head_major (with the delta rule):
    p, w, u, ks, qs as `chunk_locals` writes them with head_major, ks and qs decayed for either gate (ks
    transposed, [Nc, H, K, c])."""
    if head_major and beta is None:
        raise ValueError("head_major outputs need the delta rule (beta)")
    length = k.shape[0] if packed is None else packed[0].shape[0] * config.chunk
    heads = v.shape[1]
    if config.inter_dtype is None:
        inter = jnp.bfloat16 if k.dtype == jnp.bfloat16 else jnp.float32
    else:
        inter = jnp.dtype(config.inter_dtype)
    if gk is not None:
        b = _chunk_cumsum_per_key(g, gk, config.chunk)
    else:
        b = _chunk_cumsum(g, length, heads, config.chunk)
    beta_t = None if beta is None else beta.astype(jnp.float32).T
    if not head_major and _mosaic_locals(config, q, k, v, gk, beta, inter, packed, interpret):
        p, w, u = gdn_locals_mgpu.chunk_locals_mgpu(q, k, v, b, beta_t, chunk=config.chunk, scale=scale)
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


def _log_transfer(g, gk, seg_ids=None, n_seg=None):
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


def _mosaic_locals(config, q, k, v, gk, beta, inter, packed, interpret) -> bool:
    """Whether the chunk-local kernel runs under Mosaic GPU (`GDNConfig.locals_lowering`, config resolved;
    `_choose_mosaic`)."""
    if config.locals_lowering == "triton":
        return False
    bf16 = all(x.dtype == jnp.bfloat16 for x in (q, k, v)) and jnp.dtype(inter) == jnp.bfloat16
    fits = (gk is None and beta is not None and packed is None and config.solve == "tile" and bf16
            and config.locals_precision == "bf16" and config.solve_precision == "bf16"
            and gdn_locals_mgpu.supported(config.chunk, k.shape[-1], v.shape[-1], k.shape[0]))
    return _choose_mosaic(
        "locals_lowering", config.locals_lowering, fits, interpret, "gdn_locals_mgpu.chunk_locals_mgpu",
        takes="the 'tile' solve with a scalar gate or none, the delta rule, bf16 inputs and dots, chunk 64, K = V = "
              "128, whole chunks and no packed segments",
        got=f"solve {config.solve!r}, chunk {config.chunk}, K {k.shape[-1]}, V {v.shape[-1]}, {k.shape[0]} tokens, "
            f"inputs {k.dtype.name}")


def _choose_mosaic(field, lowering, fits, interpret, standalone, *, takes, got) -> bool:
    """The rule of both GDN kernels' lowering fields: "auto" runs the Mosaic GPU kernel where it takes the launch
    on a Hopper GPU; "mosaic" refuses, rather than silently run Triton, a launch the kernel cannot take and interpret
    mode (inside this jit the GPU interpreter's simulated threads wait on each other indefinitely; `standalone`,
    the kernel's own entry point, runs in the interpreter). takes / got: the refusal's two halves."""
    if lowering == "auto":
        return fits and not interpret and is_hopper()
    if not fits:
        raise ValueError(f"{field}='mosaic' takes {takes}; got {got}")
    if interpret:
        raise ValueError(f"{field}='mosaic' does not run in interpret mode inside gdn_forward; on the CPU use 'auto' "
                         f"or 'triton' ({standalone}(interpret=True) runs the kernel on its own)")
    return True


def _mosaic_state_config(config):
    """The Mosaic GPU state pass's launch (`gdn_mgpu.MosaicStateConfig`) that a GDNConfig asks for."""
    return gdn_mgpu.MosaicStateConfig(block_v=config.block_v, cluster=config.state_cluster)


def _mosaic_state_pass(config, chunk, key_dim, value_dim, w, gk, packed, widen, out_dtype, interpret) -> bool:
    """Whether a direct launch's state pass runs under Mosaic GPU (`GDNConfig.state_lowering`, config resolved;
    `_choose_mosaic`). The kernel's products are bf16, so it takes bf16 state dots and outputs only (float32 inputs
    keep Triton's float32 dots)."""
    if config.state_lowering == "triton":
        return False
    fits = (w is not None and gk is None and packed is None and not widen and config.state_precision == "bf16"
            and jnp.dtype(out_dtype) == jnp.bfloat16 and gdn_mgpu.supported(chunk, key_dim, value_dim, config.block_v))
    return _choose_mosaic(
        "state_lowering", config.state_lowering, fits, interpret, "gdn_mgpu.state_pass_mgpu",
        takes="a direct launch with scalar gates, the delta rule, bf16 state dots and outputs, chunk 64, K 128, "
              "block_v 32 or 64 dividing V, whole chunks and (T, S) from the transfer pass",
        got=f"chunk {chunk}, K {key_dim}, V {value_dim}, block_v {config.block_v}, state dots "
            f"{config.state_precision}, outputs {jnp.dtype(out_dtype).name}")


@functools.partial(jax.jit, static_argnames=("scale", "config", "emit_summary", "interpret"))
def _forward(q, k, v, g, beta, initial_state, gk=None, *, scale, config, emit_summary, interpret):
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
        packed = _prefix_tables(length, padded // chunk, chunk)
        g, gk, beta = map(pad_tokens, (g, gk, beta))
    else:
        q, k, v, g, gk, beta = map(pad_tokens, (q, k, v, g, gk, beta))
    out_dtype = jnp.result_type(q, v)
    b, p, w, u, ks, qs = _locals(q, k, v, g, gk, beta, scale=scale, config=config, interpret=interpret,
                                 packed=packed)
    state0 = (jnp.zeros((heads, key_dim, value_dim), jnp.float32) if initial_state is None
              else initial_state.astype(jnp.float32))
    eye = jnp.broadcast_to(jnp.eye(key_dim, dtype=jnp.float32), (heads, key_dim, key_dim))
    run = functools.partial(_state_pass, chunk=chunk, value_dim=value_dim, out_dtype=out_dtype, scale=scale,
                            config=config, interpret=interpret, packed=packed, packed_length=length)
    dense_summary = emit_summary and beta is not None
    summary = None
    if pieces == 1:
        widen = dense_summary and not config.transfer_group
        init = jnp.concatenate([state0, eye], axis=-1) if widen else state0
        if _mosaic_state_pass(config, chunk, key_dim, value_dim, w, gk, packed, widen, out_dtype, interpret):
            o, final = gdn_mgpu.state_pass_mgpu(w, u, ks, b, qs, p, init, chunk=chunk, out_dtype=out_dtype,
                                                scale=scale, config=_mosaic_state_config(config), interpret=interpret)
        else:
            o, final = run(w, u, ks, b, qs, p, init[None], pieces=1)
            final = final[0]
        state = final[..., :value_dim]
        if dense_summary:
            if widen:
                transfer = final[..., value_dim:]
            else:
                transfer = _transfer_pass(w, ks, b, chunk=chunk, group=config.transfer_group, config=config,
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
        form, log = _log_transfer(g, gk)
        transfer_only = Summary(form, jnp.zeros_like(state), log)
        summary = Summary(form, state - advance(transfer_only, state0) + 0.0, log)
    return o[:length], state, summary


def _check(q, k, v, g, gk, beta):
    if k.ndim != 3 or q is None or q.shape != k.shape or v.ndim != 3 or v.shape[0] != k.shape[0]:
        raise ValueError(f"expected q, k [L, Hk, K] and v [L, H, V], got {getattr(q, 'shape', None)}, {k.shape}, "
                         f"{v.shape}")
    length, key_heads, key_dim = k.shape
    heads, value_dim = v.shape[1:]
    if heads % key_heads:
        raise ValueError(f"key heads {key_heads} must divide value heads {heads}")
    for name, x in (("g", g), ("beta", beta)):
        if x is not None and x.shape != (length, heads):
            raise ValueError(f"{name} must be [L={length}, H={heads}], got {x.shape}")
    if gk is not None and gk.shape != (length, heads, key_dim):
        raise ValueError(f"gk must be [L={length}, H={heads}, K={key_dim}], got {gk.shape}")
    if not (_pow2(key_dim) and _pow2(value_dim)):
        raise ValueError(f"K and V must be powers of two >= 16 (Triton tiles), got K={key_dim}, V={value_dim}")
    if length == 0:
        raise ValueError("empty sequence")
    return length, key_heads, key_dim, heads, value_dim


def _check_per_key_launch(config: GDNConfig, key_dim: int, interpret: bool) -> None:
    """Refuse a per-key launch that cannot fit a GPU's shared memory, before Triton fails with a bare resource
    error: with per-key gates at K >= 128, chunk 64 requests 233,472 bytes (an H200's limit is 232,448; "tile"
    falls back to "doubling" there)."""
    if not interpret and config.chunk >= 64 and key_dim >= 128:
        raise ValueError(f"per-key gates (gk) at chunk {config.chunk} and K = {key_dim} need more shared memory than "
                         "an H100/H200 has; use gdn.default_config(per_key=True) (chunk 16) or chunk <= 32")


def _common_dtype(q: Array, k: Array, v: Array) -> tuple[Array, Array]:
    """q and k in v's dtype: the kernels hold every token tile in one dtype, and float32 q/k tiles beside bf16
    values (q, k straight out of a float32 L2 norm) would double the chunk kernel's shared memory past an H200's
    227 KiB at K = V = 128. The dot precision then follows that dtype, as it does for flash-linear-attention."""
    return q.astype(v.dtype), k.astype(v.dtype)


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
    """Chunked forward of every family of the core with Pallas kernels; matches `linear_attn.chunked`.

    Args:
      q, k: [L, Hk, K]; v: [L, H, V] with Hk dividing H (value head h reads key head h // (H / Hk)); q and k are
        cast to v's dtype.
      g: [L, H] log decay (<= 0) or None; gk: [L, H, K] per-key log decay (<= 0; KDA, GLA) or None;
      beta: [L, H] delta-rule strength or None (decay-only family).
      initial_state: [H, K, V] or None (zeros). scale: output scale.
      config: `GDNConfig` (None: `default_config` for the gates given). emit_summary: also return the segment's
        `linear_attn.Summary`: dense (K x K transfer from the same kernels, see the module docstring) when beta is
        given, else the sums of the log gates.
      interpret: run the kernels in the Pallas interpreter (default: unless the backend is a GPU).

    Returns (o [L, H, V] in the inputs' dtype, final_state [H, K, V] float32) or, with emit_summary,
    (o, final_state, summary).
    """
    _, _, key_dim, heads, value_dim = _check(q, k, v, g, gk, beta)
    config = default_config(gk is not None) if config is None else config
    q, k = _common_dtype(q, k, v)
    if initial_state is not None and initial_state.shape != (heads, key_dim, value_dim):
        raise ValueError(f"initial_state must be [{heads}, {key_dim}, {value_dim}], got {initial_state.shape}")
    if interpret is None:
        interpret = default_interpret()
    if gk is not None:
        _check_per_key_launch(config, key_dim, bool(interpret))
    o, state, summary = _forward(q, k, v, g, beta, initial_state, gk, scale=float(scale), config=config,
                                 emit_summary=emit_summary, interpret=bool(interpret))
    return (o, state, summary) if emit_summary else (o, state)


# ----------------------------------------------------------------------------------------------------------------
# Variable-length packed segments.


def _varlen_layout(cu: Array, length: int, n_seg: int, chunk: int, loads: Array | None = None):
    """Chunk-aligned layout of packed segments (all int32, traced-friendly; only the sizes are static).

    Every segment is padded to whole chunks so that a chunk never straddles a boundary: the chunk-local kernel
    then needs no segment masks, and the state pass only resets at a segment's first chunk and stores at its
    last. The padded length is bounded statically by sum_i ceil(len_i / c) <= floor((L + n (c - 1)) / c) chunks.
    Tokens from cu[n] to L (when cu[n] < L) belong to no segment and to no chunk.

    loads: None (every segment resets: start is 1 at its first chunk), or int32 [n], the start-table entry of each
    segment's first chunk (1 + the initial state it loads, or 0: it carries on from the chunk before; the
    state pass's `seg_init`).

    Returns (src [Lp]: packed token of each padded position, `length` for padding; pos [L]: padded position of
    each packed token; start [Nc], slot [Nc]: the state-pass tables; seg_of_token [L] (n past cu[n]); lens [n];
    chunk_begin, chunk_end [n]: each segment's first chunk and one past its last).
    """
    num_chunks = (length + n_seg * (chunk - 1)) // chunk
    lens = cu[1:] - cu[:-1]
    seg_chunks = (lens + chunk - 1) // chunk
    chunk_end = jnp.cumsum(seg_chunks)
    chunk_begin = chunk_end - seg_chunks
    ids = jnp.arange(num_chunks, dtype=jnp.int32)
    seg = jnp.searchsorted(chunk_end, ids, side="right").astype(jnp.int32)  # n_seg past the last segment
    seg_c = jnp.minimum(seg, n_seg - 1)
    live = seg < n_seg
    if loads is None:
        start = jnp.where(live, ids == chunk_begin[seg_c], True).astype(jnp.int32)
    else:
        start = jnp.where(live & (ids == chunk_begin[seg_c]), loads[seg_c], 0).astype(jnp.int32)
    slot = jnp.where(live & (ids == chunk_end[seg_c] - 1), seg, -1).astype(jnp.int32)
    padded = jnp.arange(num_chunks * chunk, dtype=jnp.int32)
    pseg = jnp.minimum(seg[padded // chunk], n_seg - 1)
    offset = padded - chunk_begin[pseg] * chunk
    valid = live[padded // chunk] & (offset < lens[pseg])
    src = jnp.where(valid, cu[pseg] + offset, length).astype(jnp.int32)
    tokens = jnp.arange(length, dtype=jnp.int32)
    seg_of_token = jnp.searchsorted(cu[1:], tokens, side="right").astype(jnp.int32)
    owner = jnp.minimum(seg_of_token, n_seg - 1)
    pos = jnp.where(tokens < cu[n_seg], chunk_begin[owner] * chunk + tokens - cu[owner], 0).astype(jnp.int32)
    return src, pos, start, slot, seg_of_token, lens, chunk_begin, chunk_end


def _varlen_transfer(w, k, b, start, slot, chunk_begin, chunk_end, *, n_seg, chunk, group, config, interpret):
    """Each packed segment's dense T = A_last ... A_first ([n, H, K, K]) through `group`-chunk groups, as
    `_transfer_pass` does for one sequence, instead of K identity columns widening the packed state pass.

    One launch steps identity columns through every group in parallel, resetting them at each segment's first
    chunk: a segment that ends in group e stores Q (its product since the later of its start and e's start) in its
    slot, and every group g leaves its tail P_g (the product since its last reset). A segment that started in an
    earlier group s then has T = Q P_{e-1} ... P_s: the groups strictly between hold no reset (the segment covers
    them), and s's tail starts at the segment's first chunk (no later segment starts in s). A segmented product
    scan over the groups (reset where a group holds a segment start) gives every such product at once.
    Only this launch's inputs are padded to whole groups (empty chunks: zero tokens, a reset, no slot), not the
    packed pass's. Empty segments (chunk_begin = chunk_end) get no slot; the caller replaces their T.
    """
    key_dim, heads = k.shape[-1], w.shape[1]
    w, k, b, group, groups, pad = _pad_to_groups(w, k, b, chunk, group)
    if pad:  # the padded chunks reset and store nothing
        start = jnp.pad(start, (0, pad), constant_values=1)
        slot = jnp.pad(slot, (0, pad), constant_values=-1)
    eye = jnp.broadcast_to(jnp.eye(key_dim, dtype=jnp.float32), (groups, heads, key_dim, key_dim))
    _, ends, tails = _state_pass(w, None, k, b, None, None, eye, chunk=chunk, pieces=groups, value_dim=key_dim,
                                 out_dtype=jnp.float32, scale=1.0, config=config, interpret=interpret,
                                 segments=(start, slot, n_seg), tails=True)
    resets = jnp.any(start.reshape(groups, group) != 0, axis=1)
    mm = functools.partial(jnp.einsum, "...ij,...jk->...ik", precision=lax.Precision.HIGHEST)

    def later_after(a, b):  # segmented product, b after a: restart at b when b holds a reset
        (reset_a, prod_a), (reset_b, prod_b) = a, b
        return reset_a | reset_b, jnp.where(reset_b[:, None, None, None], prod_b, mm(prod_b, prod_a))

    _, running = lax.associative_scan(later_after, (resets, tails))
    first_group, last_group = chunk_begin // group, jnp.maximum(chunk_end - 1, 0) // group
    before = running[jnp.maximum(last_group - 1, 0)]
    return jnp.where((last_group > first_group)[:, None, None, None], mm(ends, before), ends)


def _cu_array(cu_seqlens, length: int) -> Array:
    if isinstance(cu_seqlens, (list, tuple, np.ndarray)):
        cu = np.asarray(cu_seqlens, np.int64)
        if cu.ndim != 1 or cu.shape[0] < 2 or cu[0] != 0 or cu[-1] != length or np.any(np.diff(cu) < 0):
            raise ValueError(f"cu_seqlens must rise from 0 to L={length} (N + 1 offsets), got {list(cu)}")
    elif getattr(cu_seqlens, "ndim", None) != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError("cu_seqlens must be a 1-D array of N + 1 offsets")
    return jnp.asarray(cu_seqlens, jnp.int32)


@functools.partial(jax.jit, static_argnames=("scale", "config", "emit_summary", "interpret"))
def _varlen(q, k, v, cu, g, gk, beta, initial_state=None, continues=None, summary_rows=None, *, scale, config,
            emit_summary, interpret):
    length, key_heads, key_dim = k.shape
    heads, value_dim = v.shape[1:]
    n_seg = cu.shape[0] - 1
    config = config.resolved(k.dtype)
    chunk = config.chunk
    dense = emit_summary and beta is not None
    group = config.transfer_group if dense else 0  # 0: T from the widened state
    seeded = initial_state is not None or continues is not None
    loads = None
    if seeded:  # start-table entries: 1 + the segment's own initial state, or 0 where it carries on
        rows = jnp.arange(1, n_seg + 1, dtype=jnp.int32)
        loads = rows if continues is None else jnp.where(continues, 0, rows)
    src, pos, start, slot, seg_of_token, lens, chunk_begin, chunk_end = _varlen_layout(cu, length, n_seg, chunk,
                                                                                       loads)
    live = chunk_end[n_seg - 1:]  # [1]: the chunks that hold tokens; the state pass steps no others

    def gather(x):  # padded positions read a zero row: A = I, nothing added
        if x is None:
            return None
        return jnp.concatenate([x, jnp.zeros((1,) + x.shape[1:], x.dtype)])[src]

    packed = None
    if config.packed_reads:
        # q, k, v and o stay packed: the kernels read chunk n as rows src .. src + cnt of the packed arrays
        first = src.reshape(-1, chunk)
        cnt = jnp.sum(first < length, axis=1).astype(jnp.int32)
        packed = (jnp.where(cnt > 0, first[:, 0], 0).astype(jnp.int32), cnt)
        qp, kp, vp = q, k, v
    else:
        qp, kp, vp = map(gather, (q, k, v))
    gp, gkp, betap = map(gather, (g, gk, beta))
    # the group transfer pass below reads every chunk, so empty chunks are skipped only without it
    b, p, w, u, ks, qs = _locals(qp, kp, vp, gp, gkp, betap, scale=scale, config=config, interpret=interpret,
                                 packed=packed, skip_empty=not (dense and group))
    if config.state_lowering == "mosaic":
        raise ValueError("gdn_varlen runs the Triton state pass only (GDNConfig.state_lowering 'auto' or 'triton')")
    out_dtype = jnp.result_type(q, v)
    # every segment from its own state (none continues another): one program per segment (`segment_grid`)
    by_segment = (chunk_begin, chunk_end) if config.segment_grid and continues is None else None
    live = None if by_segment is not None else live
    if seeded:
        init = (jnp.zeros((n_seg, heads, key_dim, value_dim), jnp.float32) if initial_state is None
                else initial_state.astype(jnp.float32))
        o, finals = _state_pass(w, u, ks, b, qs, p, init, chunk=chunk, pieces=1, value_dim=value_dim,
                                out_dtype=out_dtype, scale=scale, config=config, interpret=interpret,
                                segments=(start, slot, n_seg), packed=packed, packed_length=length,
                                segment_init=True, live=live, by_segment=by_segment)
        finals = jnp.where((lens > 0)[:, None, None, None], finals, init)  # empty segments: their own init
    else:
        init = jnp.zeros((heads, key_dim, value_dim), jnp.float32)
        widened = dense and not group
        if widened:
            init = jnp.concatenate([init, jnp.broadcast_to(jnp.eye(key_dim, dtype=jnp.float32),
                                                           (heads, key_dim, key_dim))], axis=-1)
        # empty segments own no chunk, so the pass never stores their rows: it sets those that are read to init
        # ((I, 0)) first, instead of a select over every row afterwards (a copy of [N, H, K, V + K] per call)
        fill = lens == 0 if summary_rows is None else (lens == 0) & summary_rows
        res = _state_pass(w, u, ks, b, qs, p, init[None], chunk=chunk, pieces=1, value_dim=value_dim,
                          out_dtype=out_dtype, scale=scale, config=config, interpret=interpret,
                          segments=(start, slot, n_seg), packed=packed, packed_length=length, live=live,
                          fill=fill, split=widened, by_segment=by_segment)
        if widened:  # states and transfers as two outputs: no slices of a widened array copied out
            o, finals, widened_transfer = res
        else:
            o, finals = res
    if packed is None:
        o = o[pos]
    elif gk is None:  # scalar gates read k in place; the transfer pass below takes chunk-aligned keys
        ks = gather(k) if dense and group else None
    states = finals[..., :value_dim]
    if not emit_summary:
        return o, states
    if dense and group:
        transfer = _varlen_transfer(w, ks, b, start, slot, chunk_begin, chunk_end, n_seg=n_seg, chunk=chunk,
                                    group=group, config=config, interpret=interpret)
        eye = jnp.eye(key_dim, dtype=jnp.float32)
        return o, Summary("dense", states, jnp.where((lens > 0)[:, None, None, None], transfer, eye))
    if dense:
        return o, Summary("dense", states, widened_transfer)
    form, log = _log_transfer(g, gk, seg_of_token, n_seg)
    return o, Summary(form, states, log)


def gdn_varlen(
    q: Array,
    k: Array,
    v: Array,
    cu_seqlens: Sequence[int] | Array,
    *,
    g: Array | None = None,
    gk: Array | None = None,
    beta: Array | None = None,
    scale: float = 1.0,
    config: GDNConfig | None = None,
    emit_summary: bool = True,
    interpret: bool | None = None,
    initial_state: Array | None = None,
    continues: Array | None = None,
    summary_rows: Array | None = None,
):
    """Many segments packed in one sequence, each run from a zero state (reset at every boundary), or from its
    own initial state, or carrying on from the segment before it.

    Args:
      q, k: [L, Hk, K]; v: [L, H, V]; g, beta: [L, H]; gk: [L, H, K] (as `gdn_forward`).
      cu_seqlens: N + 1 segment offsets rising from 0 to L, static (a list) or an int32 array (traced: only N is
        static, so one compilation serves every split of L tokens into N segments); empty segments are allowed.
        A traced array may also end short of L: tokens from cu[N] on then belong to no segment and cost no step
        of the kernels; their outputs are undefined (a fixed-capacity buffer's padding: mask them).
      config: `GDNConfig` (None: `default_varlen_config`, which takes T from the widened state).
      emit_summary: return each segment's `linear_attn.Summary` (leading axis N): dense T for delta rules (through
        the state widened by an identity block when `config.transfer_group` is 0, or the transfer pass over
        groups of that many chunks), log sums of the gates otherwise.
      initial_state: [N, H, K, V] float32, the state each segment starts from (default zeros).
      continues: bool [N] (traced): segment i carries on from the state the previous non-empty segment ended with
        (its initial state unused); a first segment that continues starts from zero. Segments that continue one
        another run as one sequence, and the states returned are still each one's own end.
      With initial_state or continues, emit_summary must be False: the states returned are then each segment's
      end state from where it started (an empty segment returns its initial state).
      summary_rows: bool [N] or None (from a zero start only): the segments whose summaries or end states are
        read. An empty segment's row (zero state, identity transfer) is set only where this is True (None: every
        empty segment); the rows of other empty segments are undefined. A caller that reads only some rows saves
        writing the others (a stitched request's cached pieces are empty segments of its varlen call).

    Returns (o [L, H, V], summary) with emit_summary, else (o, states [N, H, K, V]); the states are S(C_i|0)
    (or the end states from initial_state / continues).

    Memory: the kernels step a chunk-aligned layout (each segment padded to whole chunks; at most N (c - 1) extra
    zero tokens) through per-chunk int32 tables, reading q, k, v and writing o in place in the packed arrays
    (`GDNConfig.packed_reads`); only the gates are gathered into the layout. With `packed_reads=False` q, k, v
    are gathered in and o out in XLA instead (one extra read and write of each).
    """
    length, _, key_dim, heads, value_dim = _check(q, k, v, g, gk, beta)
    config = default_varlen_config(gk is not None) if config is None else config
    q, k = _common_dtype(q, k, v)
    cu = _cu_array(cu_seqlens, length)
    n_seg = cu.shape[0] - 1
    if interpret is None:
        interpret = default_interpret()
    if gk is not None:
        _check_per_key_launch(config, key_dim, bool(interpret))
    if initial_state is not None or continues is not None:
        if emit_summary:
            raise ValueError("gdn_varlen's summaries are of zero-start segments: emit_summary=False with "
                             "initial_state or continues")
        if initial_state is not None and initial_state.shape != (n_seg, heads, key_dim, value_dim):
            raise ValueError(f"initial_state must be [N, H, K, V] = {(n_seg, heads, key_dim, value_dim)}, got "
                             f"{initial_state.shape}")
        if continues is not None:
            continues = jnp.asarray(continues, bool)
            if continues.shape != (n_seg,):
                raise ValueError(f"continues must be [N={n_seg}], got shape {continues.shape}")
    if summary_rows is not None:
        if initial_state is not None or continues is not None:
            raise ValueError("summary_rows selects rows of zero-start segments: not with initial_state or continues")
        summary_rows = jnp.asarray(summary_rows, bool)
        if summary_rows.shape != (n_seg,):
            raise ValueError(f"summary_rows must be [N={n_seg}], got shape {summary_rows.shape}")
    return _varlen(q, k, v, cu, g, gk, beta, initial_state, continues, summary_rows, scale=float(scale),
                   config=config, emit_summary=emit_summary, interpret=bool(interpret))


def flops(length: int, heads: int, key_dim: int, value_dim: int, chunk: int, *, emit: bool = False,
          pieces: int = 1) -> float:
    """Matmul FLOPs of the pipeline (for achieved-rate reports; elementwise work not counted)."""
    per_chunk_locals = 2 * chunk * chunk * key_dim * 2 + 2 * chunk * chunk * (key_dim + value_dim) / 2
    width = value_dim + (key_dim if emit or pieces > 1 else 0)
    step = lambda cols, out: 2 * chunk * key_dim * cols * 2 + (2 * chunk * key_dim * cols + 2 * chunk * chunk * cols
                                                               if out else 0)  # noqa: E731
    per_chunk_state = step(width, True) if pieces == 1 else step(width, False) + step(value_dim, True)
    return heads * (length / chunk) * (per_chunk_locals + per_chunk_state)
