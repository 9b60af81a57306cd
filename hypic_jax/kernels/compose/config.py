"""The launch of the Pallas folds (`fold_pallas`, `prefix_fold_pallas`)."""

from __future__ import annotations

import dataclasses

__all__ = ["FoldConfig", "FINAL_STATE_CONFIG"]


@dataclasses.dataclass(frozen=True)
class FoldConfig:
    """block_w: accumulator (state) columns per program; algorithm: the in-kernel dot algorithm (`ALGORITHMS`);
    num_warps / num_stages: Triton launch parameters. The defaults are the fastest launch of `prefix_fold_pallas`
    for one PIC layer's 64 groups x 32 heads that `bench/pic_kernels.py --sections prefix` finds (bench/RESULTS.md,
    "pic_kernels.py"). The composition of all layers at once prefers wider blocks (`FINAL_STATE_CONFIG`)."""

    block_w: int = 32
    algorithm: str = "bf16x3"
    num_warps: int = 8
    num_stages: int = 3


# The launch of `fold_pallas` for the composed state of many heads and layers at once (64 segments x 30 layers x 32
# heads of dense 128 x 128 pairs): whole 128-column states per program, so that each T_i is read once per (layer,
# head); the fastest of the launches `bench/pic_kernels.py --sections bar` times (bench/RESULTS.md, "The
# composition").
FINAL_STATE_CONFIG = FoldConfig(block_w=128, num_warps=8, num_stages=3)
