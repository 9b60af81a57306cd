"""The grouped matmul's launch (`GMMConfig`) and its choice by row count."""

from __future__ import annotations

import dataclasses

__all__ = ["GMMConfig", "COPY_BLOCKS_CONFIG", "FEW_ROWS_CONFIG", "FEW_ROWS_MAX", "default_config"]


@dataclasses.dataclass(frozen=True)
class GMMConfig:
    """Tiling of the MoE grouped matmul: block_m rows per expert block (each expert's rows are padded to a multiple
    of it), block_n / block_k the weight tile, Triton warps and pipeline stages. The class defaults are the launch
    the long prefills run with (many copies per expert, so each weight tile serves many rows); `default_config`
    picks per row count, and `bench/pic_kernels.py --sections moe` times the alternatives at the PIC request's shape
    (bench/RESULTS.md, "pic_kernels.py")."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


# Few copies per expert (a PIC request's seams and query: tens of copies per expert) make the matmul a read of every
# used expert's weights. This launch is the fastest at that shape (`bench/pic_kernels.py --sections moe` times it
# against the class defaults; bench/RESULTS.md, "pic_kernels.py"): a wider weight tile with 8 warps keeps more bytes
# in flight, and 32-row blocks waste less work on padding. Long prefills keep the class defaults, where block_m 64
# reuses each weight tile for twice the rows; hence the split.
FEW_ROWS_CONFIG = GMMConfig(block_m=32, block_n=256, block_k=64, num_warps=8, num_stages=3)
FEW_ROWS_MAX = 16384

# One block per copy (`layout.copy_blocks`, a decode step's few copies): the smallest block the Triton matmul takes
# (16 rows), since only one row of each block is real, and FEW_ROWS_CONFIG's weight tile.
COPY_BLOCKS_CONFIG = GMMConfig(block_m=16, block_n=256, block_k=64, num_warps=8, num_stages=3)


def default_config(num_rows: int) -> GMMConfig:
    """The launch for `num_rows` (token, expert) copies: FEW_ROWS_CONFIG up to FEW_ROWS_MAX, else GMMConfig()."""
    return FEW_ROWS_CONFIG if num_rows <= FEW_ROWS_MAX else GMMConfig()
