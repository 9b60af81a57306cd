"""Test-session hygiene shared by every test module."""

from __future__ import annotations

import os
from importlib import metadata

# Compilation, not arithmetic, is what the suite spends its time on: its programs are tiny but many (every new shape
# of a property test is one; every op of an eager call is one). On the CPU, XLA's legacy loop emitters and LLVM
# without its optimisation passes compile them two to three times faster (a 40-element op: 63 -> 24 ms, a chunked
# scan: 0.34 -> 0.07 s) and give the same IEEE results. Only where no GPU plugin is installed (the backend
# optimisation level would apply to GPU kernels too), only before JAX creates its backends (the flags are read
# then), and never over a value the environment already sets.
_FAST_COMPILE = {"--xla_cpu_use_fusion_emitters": "false", "--xla_backend_optimization_level": "0"}


def _gpu_plugin_installed() -> bool:
    names = ((d.metadata["Name"] or "").lower().replace("_", "-") for d in metadata.distributions())
    return any(name.startswith(("jax-cuda", "jax-rocm")) for name in names)


if (os.environ.get("JAX_PLATFORMS") or "cpu").split(",")[0] == "cpu" and not _gpu_plugin_installed():
    _flags = os.environ.get("XLA_FLAGS", "")
    _added = [f"{k}={v}" for k, v in _FAST_COMPILE.items() if k not in _flags]
    os.environ["XLA_FLAGS"] = " ".join(filter(None, [_flags, *_added]))

import pytest  # noqa: E402

from families import trim_compiled_programs  # noqa: E402


@pytest.fixture(autouse=True)
def _bounded_compiled_programs():
    """After each test, keep the process under its memory-map limit (`families.trim_compiled_programs`: XLA's CPU
    compiler segfaults once a worker's compiled programs reach it)."""
    yield
    trim_compiled_programs()
