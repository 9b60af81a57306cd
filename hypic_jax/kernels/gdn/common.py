"""In-kernel helpers shared by the two Triton kernels of the chunked forward (`chunk_local`, `state_pass`)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import Array, lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def dot(a: Array, b: Array, precision: str, *, trans_a: bool = False, trans_b: bool = False) -> Array:
    """a @ b (optionally transposed) accumulated in float32, with the dot algorithm named by `precision`
    (`GDNConfig.locals_precision`).

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


def iotas(n: int, m: int | None = None) -> tuple[Array, Array]:
    """Row and column indices of an [n, m] tile (m = n by default)."""
    m = n if m is None else m
    return lax.broadcasted_iota(jnp.int32, (n, m), 0), lax.broadcasted_iota(jnp.int32, (n, m), 1)


def eye(n: int) -> Array:
    """The [n, n] float32 identity, from iotas (Triton tiles cannot be built from constants of arbitrary shape)."""
    rows, cols = iotas(n)
    return jnp.where(rows == cols, 1.0, 0.0).astype(jnp.float32)


def last_row(x: Array) -> Array:
    """The last row of a [c, K] tile (or last entry of a [c] tile) as [K] (a scalar): a masked sum, since Triton
    cannot index a register tensor."""
    n = x.shape[0]
    if x.ndim == 1:
        return jnp.sum(jnp.where(lax.iota(jnp.int32, n) == n - 1, x, 0.0))
    rows, _ = iotas(n, x.shape[1])
    return jnp.sum(jnp.where(rows == n - 1, x, 0.0), axis=0)


class PackedChunk:
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


def compiler_params(warps: int, stages: int):
    """Triton launch parameters."""
    return pltriton.CompilerParams(num_warps=warps, num_stages=stages)


def chunk_cumsum(g: Array | None, length: int, heads: int, chunk: int) -> Array:
    """b = cumsum of the log gates inside each chunk, as [H, L] float32 (zeros without a gate)."""
    if g is None:
        return jnp.zeros((heads, length), jnp.float32)
    gc = g.astype(jnp.float32).reshape(length // chunk, chunk, heads)
    return jnp.cumsum(gc, axis=1).reshape(length, heads).T


def chunk_cumsum_per_key(g: Array | None, gk: Array, chunk: int) -> Array:
    """b = chunk-local cumsum of gk (+ g broadcast over keys), as [L, H, K] float32."""
    log_decay = gk.astype(jnp.float32)
    if g is not None:
        log_decay = log_decay + g.astype(jnp.float32)[..., None]
    length = log_decay.shape[0]
    gc = log_decay.reshape((length // chunk, chunk) + log_decay.shape[1:])
    return jnp.cumsum(gc, axis=1).reshape(log_decay.shape)
