"""Streaming safetensors reading and rule-based conversion with strict validation.

A converter lists `Rule`s: each names the Hugging Face tensors it consumes (with their expected shapes), the
parameter path it fills and a transform (transpose, stack experts, regroup...). `apply_rules` first checks the
whole checkpoint against the rules using only the safetensors headers (so a bad checkpoint fails before any data is
read), then streams tensor by tensor from memory-mapped files, converting each result to the target dtype.

Block-wise FP8 checkpoints (`hypic_jax.checkpoint.hf.fp8`) go through the same rules: a rule whose sources are all
FP8 and whose target is one the architecture quantizes (`models.fp8_leaf`) applies its transform to the values and,
separately, to the scales expanded along the output axis, so that transposes, expert stacking and rearranged output
columns move both alike, and builds a `kernels.fp8.BlockFP8`. Any other rule reading FP8 tensors dequantizes them
first. `write_safetensors` writes a (sharded) Hugging Face folder's tensors.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import struct
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from hypic_jax import models
from hypic_jax.checkpoint.hf import fp8 as fp8_format
from hypic_jax.kernels import fp8

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

    def dtype(self, name: str) -> str:
        """The tensor's safetensors dtype name ("BF16", "F8_E4M3", ...)."""
        return self._entries[name].dtype

    def is_fp8(self, name: str) -> bool:
        return self._entries[name].dtype == fp8_format.FP8_SAFETENSORS_DTYPE

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


def _fp8_problems(reader: CheckpointReader, expected: dict[str, tuple], block: int | None) -> list[str]:
    """Every FP8 source without its scale or with a mis-shaped one, and every scale without an FP8 weight."""
    problems = []
    for name, shape in expected.items():
        if name not in reader or reader.dtype(name) not in ("F8_E4M3", "F8_E5M2"):
            continue
        scale = fp8_format.scale_name(name)
        if reader.dtype(name) != fp8_format.FP8_SAFETENSORS_DTYPE:
            problems.append(f"tensor {name!r} has dtype {reader.dtype(name)}; FP8 weights must be float8_e4m3fn")
        elif block is None:
            problems.append(f"FP8 tensor {name!r} in a checkpoint whose config.json has no block-wise FP8 "
                            f"quantization_config")
        elif scale not in reader:
            problems.append(f"FP8 tensor {name!r} without its scale {scale!r}")
        elif tuple(reader.shape(scale)) != fp8_format.scale_shape(reader.shape(name), block):
            problems.append(f"FP8 scale {scale!r} has shape {tuple(reader.shape(scale))}, expected "
                            f"{fp8_format.scale_shape(reader.shape(name), block)} for weight {name!r} of shape "
                            f"{tuple(reader.shape(name))} in blocks of {block}")
    for name in reader.names():
        if name.endswith(fp8_format.SCALE_SUFFIX):
            weight = name[: -len(fp8_format.SCALE_SUFFIX)]
            if weight in expected and not (weight in reader and reader.is_fp8(weight)):
                problems.append(f"FP8 scale {name!r} without its weight: {weight!r} is "
                                + (f"{reader.dtype(weight)}, not FP8" if weight in reader else "missing"))
    return problems


def validate(reader: CheckpointReader, rules: Sequence[Rule], ignore: Callable[[str], bool] = lambda n: False,
             block: int | None = None) -> None:
    """Raise ValueError naming every missing, unexpected or mis-shaped tensor (headers only, no data read), and for
    FP8 sources (`block`: the checkpoint's FP8 block size, None for an unquantized one) every missing or
    mis-shaped scale and every scale without its FP8 weight."""
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
    problems += _fp8_problems(reader, expected, block)
    for name in reader.names():
        if name.endswith(fp8_format.SCALE_SUFFIX) and name[: -len(fp8_format.SCALE_SUFFIX)] in expected:
            continue  # a scale of a converted weight (checked above)
        if name.endswith(fp8_format.SCALE_SUFFIX) and not ignore(name):
            problems.append(f"FP8 scale {name!r} without its weight {name[: -len(fp8_format.SCALE_SUFFIX)]!r}")
        elif name not in expected and not ignore(name):
            problems.append(f"unexpected tensor {name!r} with shape {tuple(reader.shape(name))}")
    if problems:
        shown = "\n  ".join(problems[:20]) + ("" if len(problems) <= 20 else f"\n  ... and {len(problems) - 20} more")
        raise ValueError(f"checkpoint {reader.folder} does not match the model:\n  {shown}")


def _build(reader: CheckpointReader, rule: Rule, spec: Any, block: int | None, fp8_ok: bool,
           quantize: bool) -> tuple[Any, bool]:
    """One rule's parameter and whether it was dequantized from FP8 tensors: a `BlockFP8` where the target may be
    one (`fp8_ok`) and every source is FP8 (or, `quantize`, becomes FP8 here, as `hypic-jax convert --quantize fp8`
    would write it), else an array of the abstract leaf's dtype."""
    values = [reader.get(n) for n in rule.sources]
    blocks = [reader.get(fp8_format.scale_name(n)) if reader.is_fp8(n) else None for n in rule.sources]
    block = block or fp8.BLOCK
    if fp8_ok and quantize:
        for i, (v, b) in enumerate(zip(values, blocks)):
            if b is None and v.ndim >= 2:
                values[i], blocks[i] = fp8_format.quantize(v, block)
    if fp8_ok and all(b is not None for b in blocks):
        value = rule.combine(*values)
        try:  # the same transform on each output row's scales [..., out, ceil(in / B)]
            scale = rule.combine(*[fp8_format.expand_out(b, block, v.shape[-2]) for v, b in zip(values, blocks)])
        except (ValueError, IndexError):  # a transform that reshapes the input axis: dequantize instead
            scale = None
        *lead, k, n = spec.shape
        if (scale is not None and tuple(value.shape) == tuple(spec.shape)
                and tuple(scale.shape) == (*lead, -(-k // block), n)):
            return fp8.BlockFP8(jnp.asarray(value), jnp.asarray(scale, jnp.float32), block, spec.dtype), False
    dequantized = any(b is not None for b in blocks)
    values = [v if b is None else fp8_format.dequantize(v, b, block) for v, b in zip(values, blocks)]
    value = rule.combine(*values)
    if tuple(value.shape) != tuple(spec.shape):
        raise ValueError(
            f"parameter {_format_path(rule.target)} from {rule.sources[0]!r}: built shape "
            f"{tuple(value.shape)}, model expects {tuple(spec.shape)}"
        )
    return jnp.asarray(value, dtype=spec.dtype), dequantized


def apply_rules(
    reader: CheckpointReader,
    rules: Sequence[Rule],
    abstract: Any,
    *,
    ignore: Callable[[str], bool] = lambda n: False,
    block: int | None = None,
    fp8_target: Callable[[tuple], bool] = lambda path: False,
    quantize: bool = False,
) -> Any:
    """Validate, then build the parameter tree with the structure of `abstract` (a ShapeDtypeStruct tree).

    Every parameter must be produced by exactly one rule with exactly the abstract shape; each is converted to the
    abstract leaf's dtype (the architecture decides which parameters stay float32) and moved to the default device
    as soon as it is built, so host memory holds one tensor at a time beyond the memory maps.

    FP8: `block` is the checkpoint's block size (None: an unquantized checkpoint); a parameter whose path
    `fp8_target` accepts is built as a `BlockFP8` (dequantizing to the abstract leaf's dtype) when its sources are
    FP8, and with `quantize` also when they are not (quantized per source tensor, in B x B blocks of the checkpoint's
    [out, in] orientation, as `hypic-jax convert --quantize fp8` writes them). Other parameters read from FP8
    tensors are dequantized.
    """
    validate(reader, rules, ignore, block)
    paths, treedef = _leaf_paths(abstract)
    wanted = dict(zip(paths, jax.tree.leaves(abstract)))
    built: dict[tuple, Any] = {}
    dequantized = []

    def nbytes(rule):
        return sum(reader.nbytes(n) + (reader.nbytes(fp8_format.scale_name(n)) if reader.is_fp8(n) else 0)
                   for n in rule.sources if n in reader)

    total = sum(nbytes(rule) for rule in rules)
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
            built[rule.target], lossy = _build(reader, rule, wanted[rule.target], block, fp8_target(rule.target),
                                               quantize)
            if lossy:
                dequantized.append(_format_path(rule.target))
            if bar is not None:
                bar.update(nbytes(rule))
    finally:
        if bar is not None:
            bar.close()
    unfilled = [p for p in paths if p not in built]
    if unfilled:
        raise ValueError(f"no checkpoint tensor fills parameter(s) {[_format_path(p) for p in unfilled[:10]]}")
    if dequantized:
        log.info("%d parameter(s) read from FP8 tensors are kept dequantized (not FP8 weights of the model, or "
                 "transforms that mix scale blocks): %s%s", len(dequantized), ", ".join(dequantized[:5]),
                 " ..." if len(dequantized) > 5 else "")
    return jax.tree.unflatten(treedef, [built[p] for p in paths])


@dataclasses.dataclass(frozen=True)
class Conversion:
    """What a converter makes of a checkpoint from its headers and config alone: the architecture module, its
    config, the rules and the tensors deliberately left out (`ignore`). `hypic-jax convert --quantize fp8` reads the
    rules to find the tensors that feed FP8 weights."""

    arch: ModuleType
    config: Any
    rules: list[Rule]
    ignore: Callable[[str], bool] = lambda name: False

    def fp8_sources(self, reader: CheckpointReader) -> set[str]:
        """The checkpoint tensors block-wise FP8 checkpoints quantize: the weight sources (two axes or more) of the
        rules whose targets are FP8 weights of the architecture (`models.fp8_leaf`)."""
        return {name for rule in self.rules if models.fp8_leaf(self.arch, rule.target)
                for name in rule.sources if len(reader.shape(name)) >= 2}


def build(conversion: Conversion, reader: CheckpointReader, dtype: Any, *, block: int | None = None,
          quantize: str | None = None) -> Any:
    """The parameters of a `Conversion` in `dtype` (`apply_rules`): from a block-wise FP8 checkpoint (`block`: its
    block size) with the architecture's FP8 weights as `BlockFP8`, and with quantize="fp8" quantizing those of an
    unquantized one as they load."""
    if quantize not in (None, "fp8"):
        raise ValueError(f"unsupported quantize={quantize!r}; supported: None, 'fp8'")
    fp8_weights = bool(getattr(conversion.arch, "FP8_LEAVES", ()))
    if (block is not None or quantize) and not fp8_weights:
        raise ValueError(f"architecture {conversion.arch.__name__} has no FP8 weights (FP8_LEAVES): its block-wise "
                         f"FP8 checkpoints and quantize='fp8' are not supported")
    abstract = models.abstract_params(conversion.arch, conversion.config, dtype)
    return apply_rules(reader, conversion.rules, abstract, ignore=conversion.ignore, block=block,
                       fp8_target=lambda path: models.fp8_leaf(conversion.arch, path), quantize=quantize == "fp8")


# ----------------------------------------------------------------------------------------------------------------
# Writing

MAX_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size ("5GB")

_DTYPE_NAMES = {np.dtype(v): k for k, v in _SAFETENSORS_DTYPES.items()}


@dataclasses.dataclass(frozen=True)
class Tensor:
    """A tensor to write: its name, shape, safetensors dtype name, and `make()` giving its data when it is written."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    make: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(_SAFETENSORS_DTYPES[self.dtype]).itemsize


def write_safetensors(folder: str | Path, tensors: Sequence[Tensor], max_shard_bytes: int = MAX_SHARD_BYTES,
                      on_written: Callable[[Tensor], None] = lambda t: None) -> list[Path]:
    """Write `tensors` as a Hugging Face folder's weights: model.safetensors, or shards of at most
    `max_shard_bytes` (a larger tensor gets one of its own) named and indexed as transformers does
    (model-00001-of-0000N.safetensors, model.safetensors.index.json). Each tensor is made as it is written, so
    memory holds one at a time. Returns the files written."""
    folder = Path(folder)
    shards: list[list[Tensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for t in shard:
            header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
            offset += t.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        with open(folder / name, "wb") as f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            for t in shard:
                data = np.ascontiguousarray(t.make())
                if tuple(data.shape) != tuple(t.shape) or _DTYPE_NAMES.get(data.dtype) != t.dtype:
                    raise ValueError(f"tensor {t.name!r}: made {data.dtype} {data.shape}, declared {t.dtype} {t.shape}")
                f.write(data.reshape(-1).view(np.uint8).data)
                on_written(t)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.nbytes for t in tensors)},
                 "weight_map": {t.name: name for name, shard in zip(names, shards) for t in shard}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return [folder / name for name in names]


def skip_prefixes(*prefixes: str) -> Callable[[str], bool]:
    """An `ignore` predicate for tensors that are deliberately not converted (vision towers, MTP heads)."""
    return lambda name: name.startswith(prefixes)
