"""The chunked forward of the gated delta rule and the decay families, in Pallas (Triton, and Mosaic GPU on
Hopper), with the transfer-operator summary (T_C, S(C|0)) of a sequence or of each packed segment.

Scope: the recurrence of `hypic_jax.core.linear_attn` (value head h reads key head h // (H / Hk)),

    S_t = (I - beta_t k_t k_t^T) Diag(e^{gk_t}) e^{g_t} S_{t-1} + beta_t k_t v_t^T,    o_t = scale S_t^T q_t,

i.e. Gated DeltaNet (g and beta), DeltaNet (beta only), KDA (gk and beta), GLA (gk only) and the scalar-gate decay
families (g only: RetNet, lightning, Mamba2; no gate at all is plain linear attention). q and k may have fewer (key)
heads than v, and the head repeat is never materialised. A leading batch axis goes through `jax.vmap` (the
pallas_call batching rule adds a grid axis).

    gdn_forward          one sequence (`chunk`); its summary on request
    gdn_varlen           many segments packed in one sequence (`varlen`)
    GDNConfig            the launch (`config`), `default_config`, `default_varlen_config`

Files: `config` (the launch and the input checks), `chunk_local` (the WY/UT chunk-local kernel), `state` (the
state pass and the transfer pass), `chunk` and `varlen` (the two entry points), `mosaic_chunk_local` and
`mosaic_state` (the Mosaic GPU versions of the two kernels), `cost` (FLOP counts) and `reference` (the same
computations in pure JAX, which the tests check every kernel against).

Speed: `bench/linear_kernels.py` times the forward beside flash-linear-attention's chunk_gated_delta_rule and chunk_kda,
and the scripts of `bench/investigations/` each kernel alone; bench/RESULTS.md ("linear_kernels.py", "Findings of the
investigations") holds the numbers.
"""

from hypic_jax.kernels.gdn.chunk import gdn_forward
from hypic_jax.kernels.gdn.chunk_local import chunk_local_pass, chunk_locals
from hypic_jax.kernels.gdn.config import (GDNConfig, default_config, default_interpret, default_varlen_config,
                                          supports)
from hypic_jax.kernels.gdn.cost import flops
from hypic_jax.kernels.gdn.varlen import gdn_varlen

# The chunk-local pass under the name `hypic_jax.stitch` calls it by (`gdn._locals`).
_locals = chunk_local_pass

__all__ = ["GDNConfig", "gdn_forward", "gdn_varlen", "default_config", "default_varlen_config", "default_interpret",
           "flops", "supports", "chunk_locals", "chunk_local_pass"]
