"""The matmul FLOPs of the chunked forward, for the achieved-rate columns of `bench/kernels.py`."""

from __future__ import annotations

__all__ = ["flops"]


def flops(length: int, heads: int, key_dim: int, value_dim: int, chunk: int, *, emit: bool = False,
          pieces: int = 1) -> float:
    """Matmul FLOPs of `gdn_forward` (elementwise work not counted).

    Per chunk and value head of c tokens: the chunk-local kernel's Q K^T and K K^T (2 c^2 K each) and the products
    of the causal [c, c] inverse with [c, K + V] operands (about c^2 (K + V), half of a dense product); the state
    pass's W S and Khat^T u (2 c K cols each), and with outputs Q S (2 c K cols) and P u (2 c^2 cols), over
    cols = V state columns, V + K when the state is widened by identity columns (emit, or pieces > 1, whose second
    pass steps V columns again with the outputs).
    """
    per_chunk_locals = 2 * chunk * chunk * key_dim * 2 + 2 * chunk * chunk * (key_dim + value_dim) / 2
    width = value_dim + (key_dim if emit or pieces > 1 else 0)

    def step(cols, out):
        return 2 * chunk * key_dim * cols * 2 + (2 * chunk * key_dim * cols + 2 * chunk * chunk * cols if out else 0)

    per_chunk_state = step(width, True) if pieces == 1 else step(width, False) + step(value_dim, True)
    return heads * (length / chunk) * (per_chunk_locals + per_chunk_state)
