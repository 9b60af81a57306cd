"""The fold over a request's pieces, one Pallas (Triton) launch per linear layer: the state entering every piece.

A stitched request (`hypic_jax.stitch.linear_over_layout`) needs, per linear layer and value head, the state
entering each of its pieces, in order:

    S <- 0 where a piece resets;  S <- T_p S + S_p,

where a cached piece's (T_p, S_p) is its entry's row of the pools and a fresh piece's is its own zero-start summary
(or the identity, in programs without summaries). T takes any summary form (`FORMS`: identity, a scalar or per-key
log decay, a dense K x K matrix).

    piece_fold     the final state and the state entering every piece (`fold`)
    chunk_fold     the same fold for a request that records nothing, a fresh piece entering it as its chunks' steps
                   and each chunk's outputs emitted on the way (`chunk`)

Why a kernel: the number of pieces is data (`LayoutArrays.num_pieces`), so as an XLA loop each step is a handful of
small kernels plus a device-to-host copy of the loop predicate, the host waiting on every step. Here one program
per (block of state columns, head) runs the whole fold with its state block in registers, reads a cached piece's T
and S where they lie in the pool (no gathered copy of every piece's T), and stops at the piece count read from
memory. Columns of the state are independent (T acts on rows), so they split across programs without any exchange.
`bench/investigations/piece_fold.py` times both against the loop (bench/RESULTS.md, "Findings of the
investigations" and "32 documents, the fold over the pieces in one kernel").

`reference` holds both folds as plain loops.
"""

from hypic_jax.kernels.piece_fold.chunk import chunk_fold
from hypic_jax.kernels.piece_fold.common import FORMS, PIECE_CACHED, PIECE_FRESH, piece_fold_fits
from hypic_jax.kernels.piece_fold.fold import piece_fold
from hypic_jax.kernels.piece_fold.reference import chunk_fold_reference, piece_fold_reference

__all__ = ["piece_fold", "piece_fold_reference", "piece_fold_fits", "chunk_fold", "chunk_fold_reference", "FORMS",
           "PIECE_FRESH", "PIECE_CACHED"]
