"""Test-session hygiene shared by every test module, and the pytest fixtures several modules use.

Plain functions the tests call (the relative error `rel_err`, the tiny-checkpoint builder `tiny_checkpoint`, random
inputs) live in helpers.py, which test modules import by name: pytest loads this file itself, as a plugin, and it is
not meant to be imported."""

from __future__ import annotations

import os
from importlib import metadata

# Compilation, not arithmetic, is what the suite spends its time on: its programs are tiny but many (every new shape
# of a property test is one; every op of an eager call is one). On the CPU, XLA's legacy loop emitters and LLVM
# without its optimisation passes compile them two to three times faster (a 40-element op: 63 -> 24 ms, a chunked
# scan: 0.34 -> 0.07 s) and give the same IEEE results. Codegen in one piece instead of split for a thread pool
# saves another tenth of the suite's CPU time: `make test` runs one xdist worker per core, so the pieces only wait
# for each other's cores (the same machine code: an engine's logits are bitwise equal). Only where no GPU plugin is
# installed (the backend optimisation level would apply to GPU kernels too), only before JAX creates its backends
# (the flags are read then), and never over a value the environment already sets.
_FAST_COMPILE = {"--xla_cpu_use_fusion_emitters": "false", "--xla_backend_optimization_level": "0",
                 "--xla_cpu_parallel_codegen_split_count": "1"}


def _gpu_plugin_installed() -> bool:
    names = ((d.metadata["Name"] or "").lower().replace("_", "-") for d in metadata.distributions())
    return any(name.startswith(("jax-cuda", "jax-rocm")) for name in names)


if (os.environ.get("JAX_PLATFORMS") or "cpu").split(",")[0] == "cpu" and not _gpu_plugin_installed():
    _flags = os.environ.get("XLA_FLAGS", "")
    _added = [f"{k}={v}" for k, v in _FAST_COMPILE.items() if k not in _flags]
    os.environ["XLA_FLAGS"] = " ".join(filter(None, [_flags, *_added]))

# Engines keep compiled programs in JAX's persistent cache (tests: one folder per worker, see
# `_no_compile_cache_in_home`), which by default stores only programs that took a second to compile. The tests'
# programs take less, and several engines of one checkpoint compile identical ones (an engine with fused programs
# and one without, a restarted engine, a server beside an engine): stored at any compile time, they are loaded.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


import pytest  # noqa: E402

import helpers  # noqa: E402


@pytest.fixture(autouse=True)
def _bounded_compiled_programs():
    """After each test, keep the process under its memory-map limit (`helpers.trim_compiled_programs`: XLA's CPU
    compiler segfaults once a worker's compiled programs reach it)."""
    yield
    helpers.trim_compiled_programs()


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """arch -> (model with slow decays, vocabulary size, folder): `helpers.tiny_checkpoint` in one folder per
    architecture for the whole worker, so the modules that run on one worker build and load each checkpoint once.
    Read-only: a test that writes into a checkpoint's folder builds its own with `helpers.tiny_checkpoint`."""
    root = tmp_path_factory.mktemp("tiny")
    return lambda arch: helpers.tiny_checkpoint(arch, str(root / arch))


def pytest_configure(config):
    config.addinivalue_line("markers", "long: a test of tens of seconds (`helpers.LONG`), scheduled first")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """The tests marked `long` first, the order of the others kept: xdist hands out the tests of one group together
    (the largest groups first) and the others in collection order, so a long test collected last would run alone
    on one worker while the other idles.

    Under `--dist loadgroup` (pyproject.toml), give each test marked with `xdist_group` the "@group" suffix of its
    node id that xdist's scheduler groups by. pytest-xdist (3.8) sets it through `item._nodeid`, which pytest 9.2's
    structured node ids no longer read (pytest-dev/pytest-xdist#1386): without this the groups are silently ignored
    and every worker builds and compiles the shared checkpoints anew. A no-op where xdist set the suffix itself, and
    where pytest's node ids change again (grouping only saves time; the tests are the same)."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)
    if not getattr(config.option, "loadgroup", False):  # set in xdist workers only
        return
    try:
        from _pytest.nodeid import NodeId
    except ImportError:
        return
    for item in items:
        marks = item.iter_markers("xdist_group")
        names = {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in marks}
        suffix = "@" + "_".join(sorted(names))
        if not names or item.nodeid.endswith(suffix) or not hasattr(item, "_id"):
            continue
        item._id = NodeId.parse(item.nodeid + suffix)


@pytest.fixture(autouse=True)
def _no_compile_cache_in_home(tmp_path_factory, monkeypatch):
    """`hypic-jax serve` keeps compiled programs in a per-user folder by default; tests that run its command line
    keep theirs in a temporary one instead of the home directory."""
    if "HYPIC_JAX_CACHE" not in os.environ:
        monkeypatch.setenv("HYPIC_JAX_CACHE", str(tmp_path_factory.getbasetemp() / "hypic-jax-cache"))
