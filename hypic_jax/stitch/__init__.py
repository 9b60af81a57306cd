"""The pieces of a span forward that read a request's layout as data (`hypic_jax.stitch.layout.LayoutArrays`).

Every function here has shapes fixed by the layout's `Capacity`, and every loop runs to a bound held in the layout
(`num_chunks`, `num_pieces`, the key range of a query block), so requests of any lengths, orders and hit patterns
that fit one capacity share one compiled program, and padding costs buffer space, not loop steps.

* conv (`conv`): each fresh token's W-1 predecessors are rows of one table [zero | fresh rows | cached tails],
  named by `conv_rows`; the depthwise conv is W shifted multiply-adds of gathered rows.
* linear core, three steps (all loops bounded by data):
    1. (programs that need it) every fresh piece's own summary (T, S(piece|0)): one chunk loop with the state
       widened by an identity block for dense transfers, restarted at each piece;
    2. a fold over the pieces in request order (`fold`), each applying its summary (fresh: step 1; cached: its
       pool row, RoPE-moved and without T for `addition`); a piece flagged `piece_reset` starts from zero. It
       yields the state entering every piece;
    3. the output chunk loop: a chunk that starts a piece loads that piece's incoming state (`chunk_load`) or
       carries on from the chunk before; it also keeps every piece's end state (prefix-cache snapshots).
  Chunk-local work (the WY/UT solves) is shared by steps 1 and 3: the widened pass only appends zero value
  columns (`linear_xla`). On a GPU (`linear_kernel_fits`, `impl=`) steps 1 and 3 run the Pallas kernels instead
  (`pallas.gdn.gdn_varlen`, `linear_kernels`): the pieces are its packed segments, their offsets `cu` built from
  the layout's chunk tables, and the padded tokens past the last piece belong to no segment. Step 1 is one
  zero-start launch that emits every piece's (T, S); step 3 one launch where each piece starts from its incoming
  state or carries on from the piece before (`continues`), returning every piece's end state. The kernels step
  only the chunks that hold tokens, so padding costs no sequential step there either.
  A stitched request that records nothing (every PIC request) runs the three steps as one where the fold is a
  kernel (`pallas.piece_fold.chunk_fold`, `chunk_fold`): the chunk-local work of all its chunks, then one fold in
  which a fresh piece steps through its chunks and emits their outputs. What the span writes back to its pools
  is in `writes`.
* attention (`attention`): keys are gathered in absolute order from the fresh keys and the per-token pools
  (`key_index`), and each block of queries runs an online-softmax loop over only the key blocks it can see.
* a model axis (`model_axis`): traced under a mesh with a "model" axis of M > 1 devices (`jax.set_mesh`;
  `Engine(tensor_parallel=M)` lowers its programs so), the linear core and attention run on each device's 1/M of
  the heads (`jax.shard_map`), where M divides them. Heads are independent in both, so the split changes no
  result; it is what lets the Pallas kernels, custom calls that XLA's partitioner cannot split, read only their
  device's share of the split pools instead of gathered whole operands.

This module holds the two entry points that pick an implementation and split the heads over the model axis
(`linear_over_layout`, `masked_attention`); the implementations live in the modules named above.
"""

from __future__ import annotations

import functools
from typing import Callable

from jax import Array

from hypic_jax.core.linear_attn import LinearInputs, Summary
from hypic_jax.kernels import gdn as pallas_gdn
from hypic_jax.stitch.attention import MASK_VALUE, _masked_attention, gather_keys, kernel_fits
from hypic_jax.stitch.chunk_fold import _linear_over_layout_chunk_fold
from hypic_jax.stitch.conv import conv_over_layout
from hypic_jax.stitch.fold import FOLD_IMPLS, _blocked_fold, _fold_pieces, _use_fold_kernel
from hypic_jax.stitch.layout import LayoutArrays
from hypic_jax.stitch.linear_common import LINEAR_IMPLS, LinearResult, _repeat_key_heads, linear_kernel_fits
from hypic_jax.stitch.linear_kernels import _linear_over_layout_kernels
from hypic_jax.stitch.linear_xla import _linear_over_layout_xla
from hypic_jax.stitch.model_axis import MODEL_AXIS, _over_heads, model_split
from hypic_jax.stitch.writes import RowWrites, apply_row_writes, record_summaries, row_writes

__all__ = ["conv_over_layout", "linear_over_layout", "linear_kernel_fits", "LINEAR_IMPLS", "gather_keys",
           "masked_attention", "row_writes", "apply_row_writes", "RowWrites", "LinearResult", "model_split",
           "MODEL_AXIS", "record_summaries", "kernel_fits", "MASK_VALUE", "FOLD_IMPLS"]
# also used by name elsewhere: _blocked_fold, _fold_pieces, _over_heads, _linear_over_layout_kernels


def linear_over_layout(
    inputs: LinearInputs,
    pool: Summary,
    layout: LayoutArrays,
    *,
    summaries: bool,
    rotate: Callable[[Summary, Array], Summary] | None = None,
    algorithm: str | None = None,
    impl: str = "xla",
    kernel_config: pallas_gdn.GDNConfig | None = None,
    fold_impl: str = "auto",
) -> LinearResult:
    """A linear layer's core over the pieces of `layout`.

    inputs: the family's LinearInputs of the fresh tokens ([F, H, ...]; q and k may have fewer key heads Hk
    dividing H, each serving H / Hk consecutive value heads). pool: every slot's cached summary
    ([S, H, K, V] states, transfers in the family's form). summaries: compute every fresh piece's own summary
    (needed when a fresh piece precedes a cached one, and for the records of a cold prefill). The layout's
    `drop_transfer` drops cached transfers (HYPIC's `addition`). rotate(summary, offset): moves a cached summary by `offset`
    positions (RoPE'd linear layers), applied when given.
    impl: "xla" (the chunk loops below), "pallas" or "auto" (`linear_kernel_fits`): steps 1 and 3 through
    `pallas.gdn.gdn_varlen` (its `kernel_config`; None: `default_varlen_config`). Both give the same outputs,
    states and summaries up to rounding, except in rows that nothing reads: padded tokens' outputs (zeros from the
    kernels), and the summaries and end states of pieces that are not fresh.
    fold_impl: step 2, the fold over the pieces: "auto" the Pallas kernel `pallas.piece_fold` on a GPU where it
    fits (`piece_fold_fits`; always when impl is "pallas"), else "blocked" on a GPU and "xla" elsewhere; "pallas"
    always (interpreted off a GPU), "xla" the loop, "blocked" batched products in blocks without a loop bound by
    data (`_blocked_fold`).
    Where the fold runs as a kernel and the layout computes summaries but records none (a stitched PIC request),
    steps 1 to 3 become one: `_linear_over_layout_chunk_fold`. It returns no summaries and no piece end states.
    Under a model axis (`model_split` of the value heads) each device runs all of this on its own heads; key heads
    that the axis does not divide are first repeated to the value heads.
    """
    run = functools.partial(_linear_over_layout, summaries=summaries, rotate=rotate, algorithm=algorithm, impl=impl,
                            kernel_config=kernel_config, fold_impl=fold_impl)
    split = model_split(inputs.v.shape[1])
    if split == 1:
        return run(inputs, pool, layout)
    if inputs.k.shape[1] % split:
        inputs = _repeat_key_heads(inputs)

    def local(inputs, pool, layout):
        result = run(inputs, pool, layout)  # the final state [H, K, V] with a leading axis, so heads are axis 1
        return result.outputs, result.final_state[None], result.piece_summaries, result.piece_ends

    outputs, final, piece_summaries, piece_ends = _over_heads(local, (inputs, pool), (layout,))
    return LinearResult(outputs, final[0], piece_summaries, piece_ends)


def _linear_over_layout(inputs: LinearInputs, pool: Summary, layout: LayoutArrays, *, summaries: bool, rotate,
                        algorithm, impl: str, kernel_config, fold_impl: str) -> LinearResult:
    """`linear_over_layout` on the heads it is given."""
    fold_impl = "pallas" if impl == "pallas" and fold_impl == "auto" else fold_impl
    if (summaries and layout.record_piece.shape[0] == 0 and inputs.q is not None
            and _use_fold_kernel(fold_impl, inputs.k.shape[-1], inputs.v.shape[-1])):
        return _linear_over_layout_chunk_fold(inputs, pool, layout, rotate=rotate, algorithm=algorithm,
                                              kernel_locals=linear_kernel_fits(inputs, impl), config=kernel_config)
    if linear_kernel_fits(inputs, impl):
        return _linear_over_layout_kernels(inputs, pool, layout, summaries=summaries, rotate=rotate,
                                           algorithm=algorithm, config=kernel_config, fold_impl=fold_impl)
    return _linear_over_layout_xla(inputs, pool, layout, summaries=summaries, rotate=rotate, algorithm=algorithm,
                                   fold_impl=fold_impl)


def masked_attention(q: Array, k: Array, v: Array, layout: LayoutArrays, *, isolated: bool, scale: float,
                     block_q: int = 64, block_k: int = 128, use_kernel: bool | None = None) -> Array:
    """GQA attention of the fresh queries q [F, Hq, D] over the keys k, v [P, Hkv, D(v)] in key order.

    Key j is visible to query i iff j < num_keys, key_positions[j] <= positions[i] and, when isolated, both belong
    to the same span. Each block of `block_q` queries loops over the key blocks between its first and last
    visible key (from the layout: stitched keys are in absolute order, isolated keys are the packed fresh
    tokens), with an online softmax, so neither the logits [F, P] nor padded keys are ever computed in full.
    On a GPU (`kernel_fits`; `use_kernel` forces either path) the same mask runs in the Pallas flash kernel
    `pallas.attention.positioned_attention`, with each query's first and last visible key. Under a model axis that
    divides the key heads (`model_split`) each device attends with its own heads (query heads follow their key
    head).
    """
    run = functools.partial(_masked_attention, isolated=isolated, scale=scale, block_q=block_q, block_k=block_k,
                            use_kernel=use_kernel)
    if model_split(k.shape[1]) == 1:
        return run(q, k, v, layout)
    return _over_heads(run, (q, k, v), (layout,))
