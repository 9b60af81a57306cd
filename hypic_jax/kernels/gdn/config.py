"""The launch of the chunked forward (`GDNConfig`), its defaults, and the checks of its inputs."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from hypic_jax.kernels import platform
from hypic_jax.kernels.platform import default_interpret

__all__ = ["GDNConfig", "default_config", "default_varlen_config", "default_interpret", "supports", "PRECISIONS",
           "SOLVES", "LOWERINGS"]

PRECISIONS = ("ieee", "tf32", "bf16x3", "bf16")
SOLVES = ("rows", "doubling", "tile")
LOWERINGS = ("auto", "triton", "mosaic")


@dataclasses.dataclass(frozen=True)
class GDNConfig:
    """Tuning knobs of the chunked forward (hashable: it is a static argument).

    chunk: tokens per chunk (16, 32, 64 or 128); the chunk-local [chunk, chunk] work grows as chunk^2, the number
      of sequential state steps as 1 / chunk.
    block_v: state columns per program of the state pass (16 ... V, power of two): more, narrower programs at
      batch 1; each re-reads the chunk's W, K, Q (L2 serves the repeats when column blocks run side by side, which
      is why the column block is the fastest-varying grid axis).
    pieces: sequence pieces summarised in parallel (the transfer-operator split, `chunk`); 1 runs a single direct
      pass.
    inter_dtype: dtype of W, U, P between the launches ("bfloat16" | "float32" | None = bfloat16 iff the inputs are).
    solve: how the chunk-local (I + M)^-1 is built (`chunk_local`): "rows" (forward substitution), "doubling"
      (16 x 16 diagonal blocks by recursive doubling, the rest by block substitution) or "tile" (the doubling on
      the whole [c, c] tile; scalar gates only, per-key gates fall back to "doubling").
    sub: diagonal block edge of the "rows" and "doubling" solves (16, 32 or 64; at most the chunk): larger blocks
      mean fewer, larger dots in the block substitution and a deeper diagonal inverse.
    transfer_group: how a direct launch (pieces = 1) emits a delta rule's dense T_C, and `gdn_varlen` each packed
      segment's: 0 widens the state by K identity columns; N > 0 runs a separate launch over groups of N chunks in
      parallel and multiplies the groups' products (`state.transfer_pass`, `varlen.varlen_transfer`).
      `default_config` takes the transfer pass for one sequence and `default_varlen_config` the widened pass for
      packed segments (`bench/kernels.py --all --sections steps varlen` compares them; `bench/investigations/
      transfer_pass.py` times the pass alone; bench/RESULTS.md, "kernels.py"). Where the state pass may run under
      Mosaic GPU, so do the group products (`mosaic_state.transfer_pass_mgpu`: scalar gates, keys
      chunk-aligned).
    locals_precision / state_precision: dot algorithm of float32 operands in the chunk-local kernel and the state
      pass: "ieee" (exact float32 FMA), "tf32", "bf16x3" (three bfloat16 passes, about float32 accuracy on the
      tensor cores) or "bf16" (operands rounded to bfloat16, as flash-linear-attention does for the state). None
      picks "bf16" for bfloat16 inputs and "ieee" otherwise. Interpret mode runs "ieee" exactly and emulates
      "bf16" by rounding the operands; bfloat16 x bfloat16 products are exact whatever the setting.
    solve_precision: dot algorithm of the inverse's own dots ("doubling": the diagonal blocks; "tile": all of it).
      None follows locals_precision: with bf16 inputs and bf16 dots elsewhere, a bfloat16 inverse adds little to
      the output error beside those dots (an interpret-mode comparison on random and on correlated keys; no
      benchmark script covers it).
    *_warps / *_stages: Triton launch parameters of the two kernels.
    state_lowering: "mosaic" runs the state pass as `mosaic_state.state_pass_mgpu` (Hopper; a direct launch
      with scalar gates, the delta rule, chunk 64, K = 128, whole chunks, (T, S) not widened; anything else is
      refused), "triton" as the Triton state pass, "auto" (default) Mosaic GPU on a Hopper GPU for the launches it
      takes and Triton otherwise (other families and layouts, packed segments, pieces, interpret mode).
    locals_lowering: "mosaic" runs the chunk-local kernel as `mosaic_chunk_local.chunk_locals_mgpu` (Hopper; the
      "tile" solve with a scalar gate or none, the delta rule, bf16 inputs and dots, chunk 64, K = V = 128, whole
      chunks, no packed segments or partial last chunk; anything else is refused), "triton" as the Triton kernel,
      "auto" (default) Mosaic GPU on a Hopper GPU for the launches it takes and Triton otherwise. A length that
      leaves the last chunk partial runs Triton's (it reads q, k, v in place there).
    state_cluster: under Mosaic GPU, column blocks of one head launched as a cluster that receives the head's W, K,
      Q and P through one multicast copy (1: no clusters; used where it divides the head's V / block_v blocks).
      The pass is bound by the bytes the SMs draw from L2, and the multicast halves the L2 reads of those
      operands.
    state_prefetch: the state pass issues each step's decay and segment-table loads one step ahead, carried in the
      loop. Triton's software pipeline prefetches the tiles that feed dots; these small loads feed only
      elementwise work, and without the carry each step may wait on one before its first product.
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
      another always run as one program). Off: at a stitched request's shape (many segment slots, most of them
      empty or one chunk long) the programs of one step each cost more than the sequential steps they replace
      (`bench/rag_trace.py`; bench/RESULTS.md, "32 documents, stitched programs without padded copies"). Long
      packed segments (cold prefills) are not measured.

    Defaults: the fastest Gated DeltaNet forward that `bench/kernels.py --all --sections steps` finds at 32k
    tokens, 16 key -> 32 value heads of 128, bf16 inputs (bench/RESULTS.md, "kernels.py"): the "tile" solve at
    chunk 64 with a 4-warp chunk-local kernel, a 4-warp, 3-stage state pass at block_v 32, (T, S) from the
    transfer pass over 64-chunk groups, the prefetched small loads (for packed segments' sake), and on Hopper both
    kernels under Mosaic GPU, the state pass in clusters of two (`bench/investigations/forward_lowerings.py`,
    `state_pass.py`, `locals_mgpu.py`; bench/RESULTS.md, "Findings of the investigations").
    Per-key gates (KDA) take `default_config(per_key=True)`.
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
        if self.solve not in SOLVES:
            raise ValueError(f"solve must be one of {SOLVES}, got {self.solve!r}")
        if self.sub not in (16, 32, 64):
            raise ValueError(f"sub must be 16, 32 or 64, got {self.sub}")
        if self.transfer_group < 0:
            raise ValueError(f"transfer_group must be >= 0, got {self.transfer_group}")
        if self.state_cluster not in (1, 2, 4):
            raise ValueError(f"state_cluster must be 1, 2 or 4, got {self.state_cluster}")
        if self.state_lowering not in LOWERINGS:
            raise ValueError(f"state_lowering must be one of {LOWERINGS}, got {self.state_lowering!r}")
        if self.locals_lowering not in LOWERINGS:
            raise ValueError(f"locals_lowering must be one of {LOWERINGS}, got {self.locals_lowering!r}")
        for name in ("locals_precision", "state_precision", "solve_precision"):
            if getattr(self, name) not in PRECISIONS + (None,):
                raise ValueError(f"{name} must be one of {PRECISIONS}, got {getattr(self, name)!r}")

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
    """The default launch. Scalar gates: `GDNConfig()`. per_key (KDA, GLA: per-key decays): chunk 16, one 16 x 16
    diagonal block, so "doubling" is one doubling inverse (`bench/kernels.py --all --sections steps` compares chunk
    16 and 32; bench/RESULTS.md, "KDA (per-key gates), packed segments, decode"). "rows" and "doubling" at chunk 64
    need more shared memory than a Hopper GPU has with per-key gates (`check_per_key_launch`), and
    "tile" takes scalar gates only."""
    return GDNConfig(chunk=16, solve="doubling", locals_warps=2) if per_key else GDNConfig()


def default_varlen_config(per_key: bool = False) -> GDNConfig:
    """`default_config` with each packed segment's T from the widened state (transfer_group = 0), the pass chosen
    for many uneven segments (`bench/kernels.py --all --sections varlen` compares the two passes; bench/RESULTS.md,
    "KDA (per-key gates), packed segments, decode")."""
    return dataclasses.replace(default_config(per_key), transfer_group=0)


def pow2(d: int) -> bool:
    """A tile width the Triton kernels take: a power of two >= 16."""
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
    return pow2(k.shape[-1]) and pow2(v.shape[-1])


def check_inputs(q, k, v, g, gk, beta):
    """The shapes `gdn_forward` and `gdn_varlen` take: q, k [L, Hk, K], v [L, H, V] (Hk dividing H), g, beta
    [L, H], gk [L, H, K], K and V powers of two >= 16, L > 0. Returns (L, Hk, K, H, V); a ValueError otherwise."""
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
    if not (pow2(key_dim) and pow2(value_dim)):
        raise ValueError(f"K and V must be powers of two >= 16 (Triton tiles), got K={key_dim}, V={value_dim}")
    if length == 0:
        raise ValueError("empty sequence")
    return length, key_heads, key_dim, heads, value_dim


def check_per_key_launch(config: GDNConfig, key_dim: int, interpret: bool) -> None:
    """Refuse a per-key launch that cannot fit a GPU's shared memory, before Triton fails with a bare resource
    error: with per-key gates at K >= 128, chunk 64 requests more than a Hopper GPU has ("tile" falls back to
    "doubling" there)."""
    if not interpret and config.chunk >= 64 and key_dim >= 128:
        raise ValueError(f"per-key gates (gk) at chunk {config.chunk} and K = {key_dim} need more shared memory than "
                         "a Hopper GPU has; use gdn.default_config(per_key=True) (chunk 16) or chunk <= 32")


def common_dtype(q, k, v):
    """q and k in v's dtype: the kernels hold every token tile in one dtype, and float32 q/k tiles beside bf16
    values (q, k straight out of a float32 L2 norm) would double the chunk-local kernel's shared memory past a
    Hopper GPU's at K = V = 128. The dot precision then follows that dtype, as it does for flash-linear-attention."""
    return q.astype(v.dtype), k.astype(v.dtype)


def choose_mosaic(field, lowering, fits, interpret, standalone, *, takes, got) -> bool:
    """The rule of both lowering fields (`GDNConfig.state_lowering`, `locals_lowering`): "auto" runs the Mosaic GPU
    kernel where it takes the launch on a Hopper GPU; "mosaic" refuses, rather than silently run Triton, a launch
    the kernel cannot take and interpret mode (inside a jit the GPU interpreter's simulated threads wait on each
    other indefinitely; `standalone`, the kernel's own entry point, runs in the interpreter). takes / got: the
    refusal's two halves."""
    if lowering == "auto":
        return fits and not interpret and platform.is_hopper()
    if not fits:
        raise ValueError(f"{field}='mosaic' takes {takes}; got {got}")
    if interpret:
        raise ValueError(f"{field}='mosaic' does not run in interpret mode inside gdn_forward; on the CPU use 'auto' "
                         f"or 'triton' ({standalone}(interpret=True) runs the kernel on its own)")
    return True
