"""The Pallas GPU kernels, one package per kernel family, each with the pure-JAX reference of what its kernels
compute (`<family>.reference`), against which the tests run every kernel in the Pallas interpreter on the CPU.

    gdn              the chunked forward of the gated delta rule and the decay families (GDN, DeltaNet, KDA, GLA,
                     RetNet, ...), one sequence or many packed segments, with their summaries (T_C, S(C|0))
    compose          folds of many dense (T, S) pairs: the composed pair or state, every prefix state
    piece_fold       the fold over a stitched request's pieces, cached pieces read in place from the pools
    attention        flash attention for queries at arbitrary positions over keys in order
    grouped_matmul   the MoE experts' grouped matmul over expert-aligned row blocks

Shared helpers: `platform` (interpret mode, Hopper, the Mosaic GPU lowering's parameters) and `utils` (in-kernel dot
algorithms, column blocks). Most kernels lower through Triton; on Hopper the GDN chunk-local kernel and state pass
also have Mosaic GPU versions. The kernels import nothing of the package above them but the base definitions
(`hypic_jax.options`, `hypic_jax.core.summary`; tests/test_imports.py checks this).
"""
