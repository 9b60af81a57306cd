"""An entry off the device (`Pieces`), and the byte-level helpers every tier shares: an array's raw bytes and the
payload checksums that the disk tier writes and checks and the bandwidth measurement times.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
from typing import Sequence

import numpy as np

# payload checksums: BLAKE2b-256 of each piece in slices of this many bytes, computed by a pool of threads (hashlib
# releases the interpreter lock over large buffers), so that checking a file runs near the drive's read rate
DIGEST_SLICE = 4 << 20
_DIGESTERS = concurrent.futures.ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1)),
                                                   thread_name_prefix="hypic-digest")


def _blake2b(view) -> str:
    return hashlib.blake2b(view, digest_size=32).hexdigest()


def payload_digests(views: Sequence[memoryview]) -> list[list[str]]:
    """Per piece (its bytes as a memoryview) the digests of its `DIGEST_SLICE`-byte slices, in parallel."""
    jobs = [[_DIGESTERS.submit(_blake2b, v[i: i + DIGEST_SLICE]) for i in range(0, len(v), DIGEST_SLICE)]
            for v in views]
    return [[job.result() for job in piece] for piece in jobs]


def raw_bytes(a: np.ndarray) -> np.ndarray:
    """The bytes of a contiguous array as uint8 (the buffer protocol refuses bfloat16 itself)."""
    return a.reshape(-1).view(np.uint8)


class Pieces:
    """One entry's content off the device: per pooled leaf (layer by layer, in `jax.tree.leaves` order) the slot's
    piece, or its token rows [length, ...] (`arrays`), and `kept`: leaf index -> the heads stored of a dense
    transfer leaf (increasing int16), whose array then holds those heads only (the others were negligible, `Mover`'s
    transfer_tol, and come back as zeros).

    An entry that came off the device holds its `Staged` buffers only (in pinned host memory where the device has
    it), which a promotion sends as they are; `arrays` and `kept` are then host copies made when asked for (a disk
    write). An entry read from disk holds its arrays."""

    def __init__(self, key: str, tokens: tuple[int, ...], kind: str, seam: int, arrays: list | None = None,
                 uses: int = 0, kept: dict | None = None, staged: "Staged | None" = None):
        if arrays is None and staged is None:
            raise ValueError("Pieces need their arrays or their staged buffers")
        self.key, self.tokens, self.kind, self.seam, self.uses = key, tokens, kind, seam, uses
        self.staged = staged
        self._arrays = arrays
        self._kept = dict(kept or {})

    @property
    def length(self) -> int:
        return len(self.tokens) - self.seam

    @property
    def arrays(self) -> list[np.ndarray]:
        return self._arrays if self._arrays is not None else self.staged.views(self.length)[0]

    @property
    def kept(self) -> dict[int, np.ndarray]:
        return self._kept if self._arrays is not None else self.staged.views(self.length)[1]

    @property
    def nbytes(self) -> int:
        if self.staged is not None:
            return self.staged.nbytes
        return int(sum(a.nbytes for a in self._arrays) + sum(k.nbytes for k in self._kept.values()))

    def __repr__(self) -> str:
        return f"Pieces(key={self.key[:12]}..., kind={self.kind}, seam={self.seam}, tokens={self.length}, " \
               f"nbytes={self.nbytes}, staged={self.staged is not None})"
