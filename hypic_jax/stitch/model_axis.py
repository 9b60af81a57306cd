"""The "model" mesh axis: how many ways the traced mesh splits a layer's heads, and running a function on
each device's share of them (`jax.shard_map`)."""

from __future__ import annotations

from typing import Callable

import jax


MODEL_AXIS = "model"  # the tensor-parallel mesh axis (`engine.placement.tensor_parallel_mesh`, the models' `param_specs`)


def model_split(heads: int) -> int:
    """M, the size of the "model" axis of the mesh being traced under (`jax.set_mesh`), when M > 1 divides `heads`;
    else 1 (no mesh, no such axis, or heads it cannot split evenly: the caller runs on whole operands)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or MODEL_AXIS not in mesh.axis_names:
        return 1
    size = mesh.shape[MODEL_AXIS]
    return size if size > 1 and heads % size == 0 else 1


def _over_heads(fn: Callable, split: tuple, whole: tuple):
    """fn(*split, *whole) on each device of the traced mesh's model axis, with every array in `split` and in fn's
    results split along axis 1 (the heads) and `whole` replicated. fn must treat heads independently."""
    heads = jax.sharding.PartitionSpec(None, MODEL_AXIS)
    return jax.shard_map(fn, mesh=jax.sharding.get_abstract_mesh(),
                         in_specs=(heads,) * len(split) + (jax.sharding.PartitionSpec(),) * len(whole),
                         out_specs=heads, check_vma=False)(*split, *whole)
