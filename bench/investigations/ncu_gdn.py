"""One warm Gated DeltaNet forward between cudaProfilerStart/Stop, for Nsight Compute's hardware counters.

    ncu --profile-from-start off --clock-control none --section ... \
      python3 -m bench.investigations.ncu_gdn --impl pallas
    ncu --profile-from-start off ... python3 -m bench.investigations.ncu_gdn --impl fla   # fla's forward

Shapes are bench/linear_kernels.py's (batch 1, 16 key heads -> 32 value heads of 128, bf16 inputs). Compilation, fla's
autotuning and a warm-up call happen before the profiled range, so only the kernels of one forward are profiled.
(Its `--impl compose`, which profiled the split-operand composition fold, left with that fold.) Run it with XLA's
memory pool and command buffers off, so that ncu can replay each kernel:

    XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS="--xla_gpu_enable_command_buffer=" ncu --profile-from-start off \
      --clock-control none --kernel-name regex:gdn --section SpeedOfLight --section WarpStateStats \
      python3 -m bench.investigations.ncu_gdn --impl pallas [--emit]
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os


def _cudart():
    """The CUDA runtime, for cudaProfilerStart/Stop (JAX has no binding of its own)."""
    names = [ctypes.util.find_library("cudart")] + [f"libcudart.so.{v}" for v in (13, 12)] + ["libcudart.so"]
    try:
        import nvidia.cuda_runtime as rt  # the pip package JAX's CUDA plugin depends on

        lib_dir = os.path.join(list(rt.__path__)[0], "lib")
        names = [os.path.join(lib_dir, f) for f in sorted(os.listdir(lib_dir)) if f.startswith("libcudart.so")] + names
    except (ImportError, OSError):
        pass
    for name in names:
        if not name:
            continue
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise RuntimeError("libcudart not found: cannot bracket the profiled range")


def run_pallas(length, emit):
    import jax

    from bench.linear_kernels import DIM, gdn_inputs
    from hypic_jax.kernels import gdn

    q, k, v, g, beta = gdn_inputs(length)
    config = gdn.GDNConfig()
    fn = jax.jit(lambda q, k, v, g, b: gdn.gdn_forward(q, k, v, g=g, beta=b, scale=DIM**-0.5, config=config,
                                                       emit_summary=emit, interpret=False))
    for _ in range(3):
        jax.block_until_ready(fn(q, k, v, g, beta))
    rt = _cudart()
    rt.cudaProfilerStart()
    jax.block_until_ready(fn(q, k, v, g, beta))
    rt.cudaProfilerStop()
    print("profiled one pallas forward:", config, "emit" if emit else "", flush=True)


def run_fla(length):
    import torch

    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from bench.linear_kernels import DIM, KEY_HEADS, fla_gdn_inputs

    q, k, v, g, beta = fla_gdn_inputs(length, KEY_HEADS)
    fn = lambda: chunk_gated_delta_rule(q, k, v, g=g, beta=beta, scale=DIM**-0.5,  # noqa: E731
                                        output_final_state=True)
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("profiled one fla chunk_gated_delta_rule forward", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", choices=("pallas", "fla"), default="pallas")
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--emit", action="store_true", help="also emit (T, S) (the transfer pass)")
    args = ap.parse_args()
    if args.impl == "fla":
        run_fla(args.length)
    else:
        run_pallas(args.length, args.emit)


if __name__ == "__main__":
    main()
