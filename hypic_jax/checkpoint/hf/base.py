"""Streaming safetensors reading and rule-based conversion with strict validation.

A converter lists `Rule`s: each names the Hugging Face tensors it consumes (with their expected shapes), the
parameter path it fills and a transform (transpose, stack experts, regroup...). `apply_rules` first checks the
whole checkpoint against the rules using only the safetensors headers (so a bad checkpoint fails before any data is
read), then streams tensor by tensor from memory-mapped files, converting each result to the target dtype.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import struct
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

log = logging.getLogger(__name__)

_SAFETENSORS_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}

# Above this many bytes a conversion shows a progress bar.
PROGRESS_BYTES = 1 << 30


# ----------------------------------------------------------------------------------------------------------------
# Reading


@dataclasses.dataclass(frozen=True)
class _Entry:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


def _read_header(file: Path) -> dict[str, _Entry]:
    with open(file, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    base = 8 + header_len
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        entries[name] = _Entry(file, info["dtype"], tuple(info["shape"]), base + begin, base + end)
    return entries


class CheckpointReader:
    """Tensors of a Hugging Face folder (model.safetensors, or shards listed in model.safetensors.index.json),
    read lazily one at a time from memory maps."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (self.folder / "model.safetensors").exists():
            files = ["model.safetensors"]
        else:
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"no safetensors files in {self.folder}")
        self._entries: dict[str, _Entry] = {}
        for name in files:
            self._entries.update(_read_header(self.folder / name))
        self._maps: dict[Path, np.memmap] = {}

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name].shape

    def nbytes(self, name: str) -> int:
        entry = self._entries[name]
        return entry.end - entry.begin

    def get(self, name: str) -> np.ndarray:
        """The tensor as a numpy array (a view of the memory map, in its stored dtype)."""
        entry = self._entries[name]
        if entry.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name!r} has unsupported dtype {entry.dtype}")
        data = self._maps.get(entry.file)
        if data is None:
            data = self._maps[entry.file] = np.memmap(entry.file, dtype=np.uint8, mode="r")
        raw = data[entry.begin : entry.end]
        return raw.view(_SAFETENSORS_DTYPES[entry.dtype]).reshape(entry.shape)


def read_hf_config(folder: str | Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.exists():
        raise ValueError(f"{folder} has no config.json")
    return json.loads(path.read_text())


# ----------------------------------------------------------------------------------------------------------------
# Rules


def transpose(x: np.ndarray) -> np.ndarray:
    """HF Linear weight [out, in] -> our [in, out]."""
    return np.ascontiguousarray(x.T)


def identity(x: np.ndarray) -> np.ndarray:
    return x


@dataclasses.dataclass(frozen=True)
class Rule:
    """Fill `target` (a path of dict keys / list indices in the param tree) from HF tensors `sources`.

    `shapes` are the expected HF shapes (same order as sources); `combine` maps the loaded source arrays to the
    parameter (default: the single source unchanged).
    """

    target: tuple
    sources: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    combine: Callable[..., np.ndarray] = identity


def linear(target: tuple, name: str, out_dim: int, in_dim: int) -> Rule:
    """A bias-free nn.Linear weight, stored transposed."""
    return Rule(target, (name,), ((out_dim, in_dim),), transpose)


def vector(target: tuple, name: str, size: int) -> Rule:
    return Rule(target, (name,), ((size,),))


def _leaf_paths(abstract: Any) -> tuple[list[tuple], Any]:
    """Leaf paths (tuples of dict keys / sequence indices, in jax leaf order) and the tree structure."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    paths = []
    for keypath, _ in flat:
        paths.append(tuple(getattr(k, "key", getattr(k, "idx", None)) for k in keypath))
    return paths, treedef


def _format_path(path: tuple) -> str:
    return "/".join(str(p) for p in path)


def validate(reader: CheckpointReader, rules: Sequence[Rule], ignore: Callable[[str], bool] = lambda n: False) -> None:
    """Raise ValueError naming every missing, unexpected or mis-shaped tensor (headers only, no data read)."""
    problems = []
    expected = {}
    for rule in rules:
        for name, shape in zip(rule.sources, rule.shapes, strict=True):
            expected[name] = tuple(shape)
    for name, shape in expected.items():
        if name not in reader:
            problems.append(f"missing tensor {name!r} (expected shape {shape})")
        elif tuple(reader.shape(name)) != shape:
            problems.append(f"tensor {name!r} has shape {tuple(reader.shape(name))}, expected {shape}")
    for name in reader.names():
        if name not in expected and not ignore(name):
            problems.append(f"unexpected tensor {name!r} with shape {tuple(reader.shape(name))}")
    if problems:
        shown = "\n  ".join(problems[:20]) + ("" if len(problems) <= 20 else f"\n  ... and {len(problems) - 20} more")
        raise ValueError(f"checkpoint {reader.folder} does not match the model:\n  {shown}")


def apply_rules(
    reader: CheckpointReader,
    rules: Sequence[Rule],
    abstract: Any,
    *,
    ignore: Callable[[str], bool] = lambda n: False,
) -> Any:
    """Validate, then build the parameter tree with the structure of `abstract` (a ShapeDtypeStruct tree).

    Every parameter must be produced by exactly one rule with exactly the abstract shape; each is converted to the
    abstract leaf's dtype (the architecture decides which parameters stay float32) and moved to the default device
    as soon as it is built, so host memory holds one tensor at a time beyond the memory maps.
    """
    validate(reader, rules, ignore)
    paths, treedef = _leaf_paths(abstract)
    wanted = dict(zip(paths, jax.tree.leaves(abstract)))
    built: dict[tuple, jax.Array] = {}
    total = sum(reader.nbytes(n) for rule in rules for n in rule.sources)
    bar = None
    if total >= PROGRESS_BYTES:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"converting {reader.folder.name}")
    try:
        for rule in rules:
            if rule.target not in wanted:
                raise ValueError(f"rule for {rule.sources[:1]} targets unknown parameter {_format_path(rule.target)}")
            if rule.target in built:
                raise ValueError(f"parameter {_format_path(rule.target)} is filled by two rules")
            value = rule.combine(*[reader.get(n) for n in rule.sources])
            spec = wanted[rule.target]
            if tuple(value.shape) != tuple(spec.shape):
                raise ValueError(
                    f"parameter {_format_path(rule.target)} from {rule.sources[0]!r}: built shape "
                    f"{tuple(value.shape)}, model expects {tuple(spec.shape)}"
                )
            built[rule.target] = jnp.asarray(value, dtype=spec.dtype)
            if bar is not None:
                bar.update(sum(reader.nbytes(n) for n in rule.sources))
    finally:
        if bar is not None:
            bar.close()
    unfilled = [p for p in paths if p not in built]
    if unfilled:
        raise ValueError(f"no checkpoint tensor fills parameter(s) {[_format_path(p) for p in unfilled[:10]]}")
    return jax.tree.unflatten(treedef, [built[p] for p in paths])


def skip_prefixes(*prefixes: str) -> Callable[[str], bool]:
    """An `ignore` predicate for tensors that are deliberately not converted (vision towers, MTP heads)."""
    return lambda name: name.startswith(prefixes)
