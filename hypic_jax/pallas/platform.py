"""What the Mosaic GPU kernels need to know about the machine, shared by the modules that pick or run them."""

from __future__ import annotations

import jax


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
