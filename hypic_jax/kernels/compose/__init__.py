"""Composition of many dense (T, S) pairs for all layers and heads at once.

A request that reuses n cached segments needs, per linear layer and value head, the state at every segment
boundary, S_i = T_i S_{i-1} + S(C_i|0), or only the state after the last. For dense transfers (the delta rules,
K x K) each step is a K x K matrix product, and composing the pairs themselves,

    (T2, S2) o (T1, S1) = (T2 T1, T2 S1 + S2),

doubles it. Composing pairs is associative but not commutative, so any bracketing of the ordered sequence gives
the same pair in exact arithmetic; rounding differs between bracketings only at the dot algorithm's own level.

    compose_all          the pair of the whole sequence by a balanced tree of batched products (XLA; `tree`)
    fold_pallas          the composed pair or state, one sequential fold per (batch entry, column block) (`fold`)
    prefix_fold_pallas   every prefix state S_i, the same fold writing each step (`prefix_fold`)
    FoldConfig           the folds' launch (`config`)

`reference` holds both folds as plain loops. The dense products take a named dot algorithm (`ALGORITHMS`, from
`hypic_jax.core.summary`):

  "f32"    float32 FMA (Precision.HIGHEST): the accuracy reference, the slowest;
  "tf32"   one TF32 pass: fast, about 2^-11 relative error per product, not float32-level;
  "tf32x3" three TF32 passes (operands split into hi + lo): float32-level;
  "bf16x3" three bfloat16 passes (a_hi b_hi + a_hi b_lo + a_lo b_hi): float32-level in practice, at bfloat16's
           tensor-core rate;
  "bf16x6" / "bf16x9": more correction terms, closer to exact float32.

All functions take T [n, ..., K, K] and S [n, ..., K, V] with the segment axis first and any batch axes (layers,
heads) after it. `bench/pic_kernels.py --sections prefix bar` times the folds and `bench/linear_kernels.py` the XLA tree
(bench/RESULTS.md, "pic_kernels.py" and "linear_kernels.py").
"""

from hypic_jax.core.summary import ALGORITHMS, matmul, precision_of
from hypic_jax.kernels.compose.config import FINAL_STATE_CONFIG, FoldConfig
from hypic_jax.kernels.compose.fold import fold_pallas
from hypic_jax.kernels.compose.prefix_fold import prefix_fold_pallas
from hypic_jax.kernels.compose.reference import fold_reference, prefix_fold_reference
from hypic_jax.kernels.compose.tree import compose_all, compose_pair

__all__ = ["ALGORITHMS", "precision_of", "matmul", "compose_pair", "compose_all", "FoldConfig", "FINAL_STATE_CONFIG",
           "fold_pallas", "prefix_fold_pallas", "fold_reference", "prefix_fold_reference"]
