"""What the kernels need to know about the machine: whether they run compiled or in the Pallas interpreter, and
what the Mosaic GPU kernels need (a Hopper GPU, the GPU interpreter, their lowering semantics)."""

from __future__ import annotations

import jax

__all__ = ["default_interpret", "is_hopper", "gpu_interpreter", "SEMANTICS", "check_semantics",
           "mosaic_compiler_params"]


def default_interpret() -> bool:
    """Interpret mode unless a GPU is the default backend: off a GPU the kernels run in the Pallas interpreter (the
    CPU tests run every kernel that way)."""
    return jax.default_backend() not in ("gpu", "cuda", "rocm")


def is_hopper() -> bool:
    """Whether JAX's default device is a Hopper GPU (compute capability 9.x): the Mosaic GPU kernels use its
    warpgroup MMA and TMA engine."""
    device = jax.devices()[0]
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9")


def gpu_interpreter():
    """Pallas's GPU interpreter (threads, shared memory, barriers and TMA simulated on the CPU), the `interpret`
    argument of a Mosaic GPU kernel; JAX exports its parameters class from no public module yet."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


SEMANTICS = ("lane", "warpgroup")


def check_semantics(semantics: str) -> None:
    """A Mosaic GPU config's `semantics` field is one of SEMANTICS (raises ValueError naming it otherwise)."""
    if semantics not in SEMANTICS:
        raise ValueError(f"semantics must be one of {SEMANTICS}, got {semantics!r}")


def mosaic_compiler_params(semantics: str):
    """Mosaic GPU compiler parameters with the lowering semantics named explicitly. JAX's default changed between
    releases (lane up to 0.10, warpgroup from 0.11, whose lowering runs a layout-inference search over every
    register array), so a kernel that leaves it to the default lowers differently on different installs.
    "lane": arrays carry the layouts the kernel gives them (`plgpu.layout_cast`, `plgpu.load(layout=...)`);
    "warpgroup": the layout-inference pass picks them."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    check_semantics(semantics)
    lowering = plgpu.LoweringSemantics.Lane if semantics == "lane" else plgpu.LoweringSemantics.Warpgroup
    return plgpu.CompilerParams(lowering_semantics=lowering)
