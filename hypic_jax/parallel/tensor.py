"""Where an engine's arrays live: one device, or a tensor-parallel ("data", "model") mesh of 1 x M devices over
which the parameters (by the architecture's `param_specs`), the entry pools (`pools.split_spec`) and every program
are split."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hypic_jax.models.base import shard_params
from hypic_jax.models.stack import LayerStack


def model_placement(params) -> NamedSharding | None:
    """Where the engine's own arrays (pools, decode caches, layouts) go: None (the default device) for parameters
    on one device, else replicated over the parameters' mesh."""
    for leaf in jax.tree.leaves(params):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and len(sharding.device_set) > 1:
            return NamedSharding(sharding.mesh, PartitionSpec())
    return None


def tensor_parallel_mesh(tensor_parallel) -> Mesh:
    """A ("data", "model") mesh of 1 x M devices for `tensor_parallel`: a count M (this process's first M devices)
    or a sequence of jax devices."""
    from hypic_jax.parallel.segments import resolve_devices

    devices = resolve_devices(tensor_parallel, name="tensor_parallel", local=True)
    return Mesh(np.asarray(devices, dtype=object).reshape(1, len(devices)), ("data", "model"))


def place_tensor_parallel(arch, config, params, tensor_parallel):
    """`params` split over a tensor-parallel mesh (`tensor_parallel_mesh`) by the architecture's `param_specs`
    (Megatron-style column and row splits of the projections, experts over "model")."""
    mesh = tensor_parallel_mesh(tensor_parallel)
    if mesh.size == 1:  # one device: where the engine's arrays go by default, or refused
        if mesh.devices.flat[0] != jax.devices()[0]:
            raise ValueError(f"tensor_parallel={tensor_parallel}: a split over one device other than the default "
                             f"one; place the model there instead")
        return params
    specs = arch.param_specs(config)
    if isinstance(params["layers"], LayerStack):
        specs = dict(specs, layers=_stacked_specs(params["layers"], specs["layers"]))
    specs = _fp8_scale_specs(specs, params, mesh.shape["model"])
    try:
        return shard_params(params, specs, mesh)
    except ValueError as error:
        raise ValueError(f"tensor_parallel={mesh.shape['model']}: the parameters of {arch.__name__} do not split "
                         f"evenly over {mesh.shape['model']} devices (each split axis, such as the heads, must be "
                         f"divisible by it): {error}") from error


def _fp8_scale_specs(specs, params, size: int):
    """`specs` with every block-wise FP8 weight's scale given its weight's split, but kept whole along an axis its
    scale cannot split into `size` parts (a row split of K rows has ceil(K / 128) scale rows: a small model's one)."""
    is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
    per_leaf = jax.tree.map(lambda spec, sub: jax.tree.map(lambda _: spec, sub), specs, params, is_leaf=is_spec)

    def fit(path, spec, leaf):
        if not path or getattr(path[-1], "name", None) != "scale":
            return spec
        return PartitionSpec(*(axis if axis is None or leaf.shape[i] % size == 0 else None
                               for i, axis in enumerate(spec)))

    return jax.tree_util.tree_map_with_path(fit, per_leaf, params, is_leaf=is_spec)


def _stacked_specs(stack: LayerStack, layer_specs) -> LayerStack:
    """The per-layer PartitionSpecs `layer_specs` for the layers stacked in `stack`: a stacked part's leaves (or
    chunks of experts) take their layer's spec behind the new leading axis."""
    is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
    parts = []
    for part, tree in enumerate(stack.parts):
        spec = layer_specs[stack.plan.layer(part)]
        if stack.plan.members(part) == 1:
            parts.append(spec)
        else:
            parts.append(jax.tree.map(lambda p, sub: jax.tree.map(lambda _: PartitionSpec(None, *p), sub),
                                      spec, tree, is_leaf=is_spec))
    return LayerStack(tuple(parts), stack.plan)
