"""What an `Engine` adds to device memory when it is built, from an unstacked model and from one stacked once
(`prefill.random_model`), and whether a segment mesh's replicated parameters share the home device's buffers.

`bench/segment_parallel.py` builds a plain engine and mesh engines on one model; its first GPU runs ran out of
memory. Per step this prints the bytes held on the first device: the device's own counter where it has one
(`memory_stats()["bytes_in_use"]`, a GPU), and everywhere the bytes of the distinct buffers behind the live arrays
(two arrays on one buffer count once). The mesh engine (`devices=2`: an engine of one device runs no mesh) is built
where the process has two devices (`--small` forces two CPU host devices).

    python3 -m bench.investigations.engine_memory --layers 12 --cache-gb 6     # GPUs
    python3 -m bench.investigations.engine_memory --small                      # the CPU
"""
import os
import sys

if "--small" in sys.argv:  # the host device count is read when JAX starts
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in _flags:
        os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=2".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import gc  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.common import full_config, random_model, small_config  # noqa: E402

from hypic_jax.engine import Engine  # noqa: E402
from hypic_jax.models import qwen3_5  # noqa: E402
from hypic_jax.models.base import Model  # noqa: E402


def held(device) -> tuple[float, float | None]:
    """MiB: the distinct buffers of the live arrays on `device`, and the device's own counter (None without one)."""
    gc.collect()
    buffers = {}
    for array in jax.live_arrays():
        for shard in array.addressable_shards:
            if shard.device == device:
                buffers[shard.data.unsafe_buffer_pointer()] = shard.data.nbytes
    stats = device.memory_stats() or {}
    counter = stats.get("bytes_in_use")
    return sum(buffers.values()) / 2**20, None if counter is None else counter / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--cache-gb", type=float, default=6.0)
    args = parser.parse_args()
    config, dtype = (small_config(), jnp.float32) if args.small else (full_config(args.layers), jnp.bfloat16)
    cache_gb = 1 / 1024 if args.small else args.cache_gb
    base = dict(max_prompt_tokens=1024, max_segments=8, max_new_tokens=8, max_batch=1, compile_cache="none",
                cache_bytes=int(cache_gb * 2**30))
    device = jax.devices()[0]
    mesh_devices = 2 if len(jax.devices()) >= 2 else None

    def report(step: str) -> None:
        buffers, counter = held(device)
        shown = "" if counter is None else f", device counter {counter:10.1f} MiB"
        print(f"{step:48s} buffers {buffers:10.1f} MiB{shown}", flush=True)

    for name in ("unstacked", "stacked once"):
        if name == "unstacked":
            model = Model(qwen3_5, config, qwen3_5.init_params(config, jax.random.key(0), dtype))
        else:
            model = random_model(config, dtype)
        report(f"{name}: the model")
        plain = Engine(model, **base)
        report(f"{name}: + a plain engine")
        mesh = None
        if mesh_devices is None:
            print(f"{name}: one device: no mesh engine", flush=True)
        else:
            mesh = Engine(model, **base, devices=mesh_devices)
            report(f"{name}: + a mesh engine of {mesh_devices} devices")
            leaf = jax.tree.leaves(mesh.params)[-1]
            replicated = jax.tree.leaves(mesh.segment_mesh.params)[-1]
            home = next(s.data for s in replicated.addressable_shards if s.device == device)
            print(f"{name}: the mesh's replicated parameters share the engine's buffers: "
                  f"{home.unsafe_buffer_pointer() == leaf.unsafe_buffer_pointer()}", flush=True)
            del leaf, replicated, home
            mesh.close()
        plain.close()
        del model, plain, mesh
        report(f"{name}: all released")


if __name__ == "__main__":
    main()
