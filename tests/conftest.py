"""Test-session hygiene shared by every test module.

XLA's CPU backend maps each compiled program's code into its own memory regions, and JAX keeps every program it
compiled for the life of the process. A pytest worker that runs hundreds of hypothesis examples over many shapes
compiles tens of thousands of programs; once the process reaches the kernel's limit on memory maps
(`vm.max_map_count`, 65,530 by default on Linux) the next compile cannot map its code and the worker dies with a
segmentation fault inside the compiler. Dropping JAX's compiled-program caches once the count runs high keeps each
worker well under that limit, at the cost of recompiling whatever a later test needs again.
"""

from __future__ import annotations

import gc
import os

import jax
import pytest

_MAPS = "/proc/self/maps"
_LIMIT = "/proc/sys/vm/max_map_count"


def _map_limit() -> int | None:
    try:
        with open(_LIMIT) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


_CEILING = _map_limit()


def _map_count() -> int:
    with open(_MAPS, "rb") as f:
        return sum(1 for _ in f)


@pytest.fixture(autouse=True)
def _bounded_compiled_programs():
    """After each test: when this process holds more than a third of the allowed memory maps, clear JAX's caches."""
    yield
    if _CEILING is None or not os.path.exists(_MAPS):
        return
    if _map_count() > _CEILING // 3:
        jax.clear_caches()
        gc.collect()
