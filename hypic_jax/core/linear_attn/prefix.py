"""Many stacked summaries: the state at every segment boundary, the state after all of them, and the move of a
RoPE'd summary to another position."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import Array

from hypic_jax.core.rope import rotate_state_keys, rotation_matrix
from hypic_jax.core.summary import Summary, advance, compose, dense_product, dense_transfer, einsum
from hypic_jax.kernels import compose as pallas_compose

PREFIX_IMPLS = ("associative", "fold", "pallas")


def prefix_states(summaries: Summary, initial_state: Array | None = None, *, algorithm: str | None = None,
                  impl: str = "associative", block: int | None = None) -> Array:
    """The state after each of n stacked summaries (leading axis n), from `initial_state` (zeros if None).

    impl:
      "associative"  one `jax.lax.associative_scan` of `compose` (depth O(log n)) builds every prefix pair, then
                     each is applied to the initial state. Any form.
      "fold"         for dense transfers, a sequential `lax.scan` of S_i = T_i S_{i-1} + S_i: n state products
                     instead of the ~2n pair compositions (each two products) of the scan, at depth n.
      "pallas"       for dense transfers, the fold in Pallas (`pallas.compose.prefix_fold_pallas`; GPU, or
                     interpret mode; `block` cuts it into blocks of that size, 0 about sqrt(n)): the PIC engine's
                     choice on a GPU, where the scan's 2 log2 n levels of small launches and its
                     transfer-by-transfer products cost more. State widths that Triton cannot tile (not powers of
                     two >= 16) take "fold" on a GPU.
    Non-dense forms always use the scan (their compositions are elementwise). Returns [n, ..., H, K, V].
    `algorithm`: the dense products' dot algorithm (see `compose`).
    """
    if summaries.state.ndim < 4:
        raise ValueError(f"summaries must be stacked along a leading axis, got state shape {summaries.state.shape}")
    if impl not in PREFIX_IMPLS:
        raise ValueError(f"impl must be one of {PREFIX_IMPLS}, got {impl!r}")
    if impl != "associative" and summaries.form == "dense":
        tiles_ok = all(n >= 16 and not n & (n - 1) for n in summaries.state.shape[-2:])
        if impl == "pallas" and (tiles_ok or jax.default_backend() != "gpu"):  # else the XLA fold below
            config = pallas_compose.FoldConfig(algorithm=algorithm or "f32")
            interpret = jax.default_backend() != "gpu"
            return pallas_compose.prefix_fold_pallas(summaries.transfer, summaries.state, initial_state, config=config,
                                      block=block, interpret=interpret)
        states = summaries.state
        if initial_state is not None:  # fold the initial state into the first segment's zero-start state
            first = advance(jax.tree.map(lambda a: a[0], summaries), initial_state)
            states = states.at[0].set(first)

        def step(state, pair):
            transfer, zero_start = pair
            state = dense_product(transfer, state, algorithm) + zero_start
            return state, state

        return jax.lax.scan(step, jnp.zeros_like(states[0]), (summaries.transfer, states))[1]
    prefixes = jax.lax.associative_scan(functools.partial(compose, algorithm=algorithm), summaries, axis=0)
    if initial_state is None:
        return prefixes.state
    return advance(prefixes, jnp.broadcast_to(initial_state, summaries.state.shape[1:]))


def composed_state(summaries: Summary, initial_state: Array | None = None, *, algorithm: str | None = None,
                   impl: str = "associative") -> Array:
    """The state after all n stacked summaries (leading axis n), from `initial_state` (zeros if None): what
    resuming after n cached segments needs, without the composed transfer or the states in between.

    impl as in `prefix_states`; "pallas" (dense transfers) runs `pallas.compose.fold_pallas` without the transfer
    columns, one program per whole state, every batch entry (layers, heads) in one launch, which costs less than
    every prefix state (bench/linear_kernels.py measures both; see bench/RESULTS.md). Returns [..., H, K, V].
    """
    if summaries.state.ndim < 4:
        raise ValueError(f"summaries must be stacked along a leading axis, got state shape {summaries.state.shape}")
    if impl not in PREFIX_IMPLS:
        raise ValueError(f"impl must be one of {PREFIX_IMPLS}, got {impl!r}")
    tiles_ok = all(n >= 16 and not n & (n - 1) for n in summaries.state.shape[-2:])
    if impl == "pallas" and summaries.form == "dense" and (tiles_ok or jax.default_backend() != "gpu"):
        states = summaries.state
        if initial_state is not None:  # fold the initial state into the first segment's zero-start state
            states = states.at[0].set(advance(jax.tree.map(lambda a: a[0], summaries), initial_state))
        config = dataclasses.replace(pallas_compose.FINAL_STATE_CONFIG, algorithm=algorithm or "f32")
        return pallas_compose.fold_pallas(summaries.transfer, states, with_transfer=False, config=config,
                                          interpret=jax.default_backend() != "gpu")[1]
    return prefix_states(summaries, initial_state, algorithm=algorithm, impl=impl)[-1]


def rotate_summary(summary: Summary, offset, *, rotary_dim: int | None = None, base: float = 10000.0) -> Summary:
    """Move a summary built from RoPE'd keys at canonical position 0 to position `offset`.

    Keys rotated by R(offset) turn every A_t into R A_t R^T, so the pair becomes (R T R^T, R S). Identity and
    scalar transfers commute with R and stay as they are; diagonal and dense ones become dense.
    """
    state = rotate_state_keys(summary.state, offset, rotary_dim=rotary_dim, base=base)
    if summary.form in ("identity", "scalar"):
        return Summary(summary.form, state, summary.transfer)
    rot = rotation_matrix(offset, summary.state.shape[-2], rotary_dim=rotary_dim, base=base)
    transfer = einsum("kj,...jn,mn->...km", rot, dense_transfer(summary), rot)
    return Summary("dense", state, transfer)
