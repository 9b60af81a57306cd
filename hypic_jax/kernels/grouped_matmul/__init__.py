"""The grouped matmul for MoE experts: the expert-aligned layout of the routed copies (`layout`), the Pallas kernel
over it (`matmul`), its launch (`config`) and its pure-JAX reference (`reference`)."""

from hypic_jax.kernels.grouped_matmul.config import (COPY_BLOCKS_CONFIG, FEW_ROWS_CONFIG, FEW_ROWS_MAX, GMMConfig,
                                                     default_config)
from hypic_jax.kernels.grouped_matmul.layout import (ONE_HOT_ROUTING_MAX, BlockLayout, block_layout, copy_blocks,
                                                     copy_layout, sorted_copies)
from hypic_jax.kernels.grouped_matmul.matmul import ChunkedWeights, gmm
from hypic_jax.kernels.grouped_matmul.reference import gmm_reference
from hypic_jax.kernels.platform import default_interpret

__all__ = ["BlockLayout", "ChunkedWeights", "GMMConfig", "COPY_BLOCKS_CONFIG", "FEW_ROWS_CONFIG", "FEW_ROWS_MAX",
           "ONE_HOT_ROUTING_MAX", "block_layout", "copy_blocks", "copy_layout", "default_config", "gmm", "gmm_reference", "default_interpret",
           "sorted_copies"]
