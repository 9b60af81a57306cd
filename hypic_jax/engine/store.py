"""Compiled programs kept on disk, loaded by a restarted process without tracing or lowering them again.

JAX's persistent compilation cache (`engine.use_compile_cache`) skips XLA's compile, but its key is the lowered
program, so a restarted process still traces and lowers every program first. For the engine's
ladder that is most of a cached warmup: about a second of Python per program at the 35B-A3B shape, under the GIL
(`bench/rag_trace.py --compile-cache` measures it; see bench/RESULTS.md). `ExecutableStore` keeps each compiled
program whole (`jax.experimental.serialize_executable`, with its argument and result tree structures) under a
digest of everything the program is made of, computed without tracing:

* the package's source code (every `hypic_jax` module file) and its module-level settings (upper-case names
  whose values print without an address, e.g. `layer_stack.BANK_MAX_ELEMENTS`, which benchmarks may change);
* jax and jaxlib versions, the backend, the device kind and count, XLA_FLAGS;
* what the caller passes: the program's kind and shapes and the engine's choices (`describe`).

A file that cannot be read or loaded is skipped (the program is compiled, and the file replaced). Files are written
atomically. Trust: loading runs pickled code, as JAX's own cache does; keep the folder private.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import sys
import tempfile
from pathlib import Path
from typing import Any

import jax

log = logging.getLogger("hypic_jax.engine.store")

SUFFIX = ".jaxexec"
_SOURCE_DIGEST: list[str] = []


def _source_digest() -> str:
    """SHA-256 of every .py file of the package (once per process)."""
    if not _SOURCE_DIGEST:
        root = Path(__file__).resolve().parent
        digest = hashlib.sha256()
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
        _SOURCE_DIGEST.append(digest.hexdigest())
    return _SOURCE_DIGEST[0]


def _settings() -> str:
    """Module-level settings of the loaded hypic_jax modules: upper-case names whose repr names no address."""
    out = []
    modules = (m for m in sys.modules if (m == "hypic_jax" or m.startswith("hypic_jax.")) and m != __name__)
    for name in sorted(modules):
        module = sys.modules[name]
        for attr, value in sorted(vars(module).items()):
            if attr.isupper() and not callable(value):
                text = repr(value)
                if " at 0x" not in text and len(text) < 2000:
                    out.append(f"{name}.{attr}={text}")
    return "\n".join(out)


def environment() -> str:
    """What compiled code depends on besides the program: versions, backend, devices, XLA flags, our code."""
    import jaxlib

    devices = jax.devices()
    flags = os.environ.get("XLA_FLAGS", "")
    return "\n".join([f"jax={jax.__version__}", f"jaxlib={jaxlib.__version__}", f"backend={jax.default_backend()}",
                      f"device={devices[0].device_kind} x{len(devices)}", f"XLA_FLAGS={flags}",
                      f"source={_source_digest()}", _settings()])


def describe(tree) -> str:
    """A tree of arrays or ShapeDtypeStructs as text: its structure, every leaf's shape and dtype, and the split
    of a leaf over several devices (a program takes its arguments where they lie)."""
    leaves, structure = jax.tree.flatten(tree)
    return f"{structure}|" + ";".join(f"{tuple(a.shape)}:{a.dtype}{_placement(a)}" for a in leaves)


def _placement(leaf) -> str:
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding) or len(sharding.device_set) == 1:
        return ""
    mesh = sharding.mesh
    return f"@{dict(mesh.shape)}{[d.id for d in mesh.devices.flat]}{sharding.spec}"


class ExecutableStore:
    """Compiled programs in `folder` (created if missing), one file per digest."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder).expanduser().resolve()
        self.folder.mkdir(parents=True, exist_ok=True)
        self._environment = environment()

    def digest(self, *parts: Any) -> str:
        digest = hashlib.sha256(self._environment.encode())
        for part in parts:
            digest.update(b"\x00")
            digest.update(str(part).encode())
        return digest.hexdigest()

    def _path(self, digest: str) -> Path:
        return self.folder / f"{digest}{SUFFIX}"

    def load(self, digest: str, devices=None):
        """The compiled program stored under `digest`, or None (none stored, or one that no longer loads).
        devices: the devices a program over several runs on, in its mesh's order (None: a one-device program)."""
        path = self._path(digest)
        if not path.exists():
            return None
        from jax.experimental import serialize_executable

        try:
            payload, in_tree, out_tree = pickle.loads(path.read_bytes())
            return serialize_executable.deserialize_and_load(payload, in_tree, out_tree, execution_devices=devices)
        except Exception as error:  # noqa: BLE001  (stale or damaged file: compile instead and replace it)
            log.warning("stored program %s did not load (%s: %s); compiling it again", path.name,
                        type(error).__name__, str(error)[:300])
            path.unlink(missing_ok=True)  # the compilation stores it again (unless JAX's own cache serves it)
            return None

    def save(self, digest: str, compiled) -> bool:
        """Store `compiled` under `digest` (atomically). False, with a warning, where it cannot be stored."""
        from jax.experimental import serialize_executable

        temporary = None
        try:
            blob = pickle.dumps(serialize_executable.serialize(compiled))
            with tempfile.NamedTemporaryFile(dir=self.folder, suffix=".tmp", delete=False) as handle:
                temporary = handle.name
                handle.write(blob)
            os.replace(temporary, self._path(digest))
            return True
        except Exception as error:  # noqa: BLE001  (some programs do not serialise; they are compiled each time)
            log.warning("could not store a compiled program (%s: %s)", type(error).__name__, str(error)[:300])
            if temporary is not None:
                Path(temporary).unlink(missing_ok=True)
            return False
