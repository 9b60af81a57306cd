"""Typed option groups: frozen dataclasses whose fields declare their help text, command-line flag and check once.

Every knob a user sets is a field of one group (`hypic_jax.engine.options` lists them). A field is declared with
`option(default, help, check=..., flag=..., scale=...)`; the group checks every field in `__post_init__`, so a bad
value fails where it is given, naming the field (or, from the command line, the flag). `add_arguments` turns the
groups into argparse flags (one flag per field, its help text with the field's default) and `from_args` builds the
groups back from the flags a user gave, so a flag and a keyword argument share one default and one check.

`None` as a default means "derived": the engine fills it from the model and the machine (`EngineOptions.resolve`).
This module imports nothing of the package.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import numbers
import os
import typing
from typing import Any, Callable, Sequence

import numpy as np

__all__ = ["option", "OptionGroup", "add_arguments", "from_args", "is_number", "is_integer", "whole", "number",
           "choice", "boolean", "folder", "rungs", "devices", "GIB"]

GIB = 1 << 30


def is_number(x) -> bool:
    """A real number that is not a bool (Python's or NumPy's: numbers.Real counts a bool as one)."""
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def is_integer(x) -> bool:
    """An integer that is not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


# ------------------------------------------------------------------------------------------------------------------
# Checks: each takes (what, value) and raises ValueError naming `what`, or returns the value (normalised)

Check = Callable[[str, Any], Any]


def whole(least: int = 0, *, optional: bool = False) -> Check:
    """An integer >= least (None allowed when optional: derived)."""

    def check(what, value):
        if value is None and optional:
            return None
        if not is_integer(value) or value < least:
            raise ValueError(f"{what} must be a whole number >= {least}, got {value!r}")
        return int(value)

    check.kind = int
    return check


def number(least: float = 0.0, *, optional: bool = False, above: bool = False) -> Check:
    """A finite real number >= least (> least when `above`; None allowed when optional)."""

    def check(what, value):
        if value is None and optional:
            return None
        if not is_number(value) or not math.isfinite(value) or value < least or (above and value == least):
            relation = ">" if above else ">="
            raise ValueError(f"{what} must be a finite number {relation} {least:g}, got {value!r}")
        return value

    check.kind = float
    return check


def choice(*allowed, optional: bool = False) -> Check:
    def check(what, value):
        if value is None and optional:
            return None
        if value not in allowed:
            raise ValueError(f"{what} must be one of {', '.join(map(str, allowed))}, got {value!r}")
        return value

    check.kind = str
    check.choices = allowed
    return check


def boolean(*, optional: bool = False) -> Check:
    def check(what, value):
        if value is None and optional:
            return None
        if not isinstance(value, (bool, np.bool_)):
            raise ValueError(f"{what} must be True or False{' or None' if optional else ''}, got {value!r}")
        return bool(value)

    check.kind = bool
    return check


def folder(*, optional: bool = True) -> Check:
    """A folder path (str or os.PathLike) that is not an existing file; created later by its user."""

    def check(what, value):
        if value is None and optional:
            return None
        if not isinstance(value, (str, os.PathLike)) or not str(value):
            raise ValueError(f"{what} must be a folder path, got {value!r}")
        if os.path.isfile(os.path.expanduser(str(value))):
            raise ValueError(f"{what} {str(value)!r} is a file, not a folder")
        return value

    check.kind = str
    return check


def rungs() -> Check:
    """None or increasing whole numbers >= 1 (a tuple); from the command line, comma-separated."""

    def check(what, value):
        if value is None:
            return None
        values = tuple(value) if isinstance(value, (list, tuple)) else None
        if not values or not all(is_integer(v) and v >= 1 for v in values) or list(values) != sorted(set(values)):
            raise ValueError(f"{what} must be increasing whole numbers >= 1, got {value!r}")
        return tuple(int(v) for v in values)

    check.kind = "rungs"
    return check


def devices() -> Check:
    """None, a device count >= 1, or a sequence of devices (checked against the machine by their user)."""

    def check(what, value):
        if value is None:
            return None
        if is_integer(value):
            if value < 1:
                raise ValueError(f"{what} must be a device count >= 1 or a list of devices, got {value!r}")
            return int(value)
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
            raise ValueError(f"{what} must be a device count >= 1 or a list of devices, got {value!r}")
        return tuple(value)

    check.kind = int
    return check


# ------------------------------------------------------------------------------------------------------------------
# Fields and groups


def option(default, help: str, *, check: Check | None = None, flag: str | None = None, aliases: Sequence[str] = (),
           scale: float | None = None, unit: str | None = None, metavar: str | None = None,
           cli: bool = True, derived: bool = False) -> Any:
    """A field of an `OptionGroup`. help: one sentence for the docs and `--help`. check: validates (and normalises)
    the value. flag: the command-line flag (default: --field-name); scale: the flag's value times `scale` is the
    field's (a flag in GiB for a field in bytes), `unit` names the flag's unit. cli=False: no flag (a Python-only
    value, such as a list of devices). derived: the default None is filled from the model and the machine."""
    metadata = dict(help=help, check=check, flag=flag, aliases=tuple(aliases), scale=scale, unit=unit,
                    metavar=metavar, cli=cli, derived=derived)
    return dataclasses.field(default=default, metadata=metadata)


class OptionGroup:
    """Base of the frozen option dataclasses: checks every field once, at construction."""

    def __post_init__(self):
        for field in dataclasses.fields(self):
            check = field.metadata.get("check")
            if check is not None:
                object.__setattr__(self, field.name, check(field.name, getattr(self, field.name)))

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def _flag(field) -> str:
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def _describe_default(field) -> str:
    value = field.default
    if value is None:
        return "derived" if field.metadata.get("derived") else "none"
    scale = field.metadata.get("scale")
    if scale and is_number(value):
        value = value / scale
        return f"{value:g}"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


def _parser_for(field) -> Callable[[str], Any] | None:
    check = field.metadata.get("check")
    kind = getattr(check, "kind", str)
    scale = field.metadata.get("scale")
    flag = _flag(field)

    def parse(text: str):
        if text.lower() in ("none", "auto") and field.default is None:
            return None
        try:
            if kind == "rungs":
                value = tuple(int(part) for part in text.split(",") if part.strip())
            elif kind is int and not scale:
                value = int(text)
            elif kind in (int, float):
                value = float(text)
                if not math.isfinite(value):
                    raise ValueError
            else:
                value = text
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag}: cannot read {text!r}") from None
        if scale:
            if value < 0:
                raise argparse.ArgumentTypeError(f"{flag} must be >= 0, got {text}")
            value = value * scale
            if kind is int:
                value = int(round(value))
        if check is not None:
            try:
                value = check(flag, value)
            except ValueError as error:
                raise argparse.ArgumentTypeError(str(error)) from None
        return value

    return parse


def add_arguments(parser: argparse.ArgumentParser, group_type: type, *, title: str | None = None,
                  skip: Sequence[str] = ()) -> None:
    """One flag per field of `group_type` (an `OptionGroup` dataclass). Flags not given leave no attribute, so the
    group's own default applies (`from_args`)."""
    summary = " ".join((group_type.__doc__ or "").split("\n\n")[0].split())
    section = parser.add_argument_group(title or group_type.__name__, summary)
    for field in dataclasses.fields(group_type):
        meta = field.metadata
        if not meta.get("cli", True) or field.name in skip:
            continue
        unit = f" ({meta['unit']})" if meta.get("unit") else ""
        help_text = f"{meta['help']}{unit} [default: {_describe_default(field)}]".replace("%", "%%")
        names = [_flag(field), *meta.get("aliases", ())]
        check = meta.get("check")
        if getattr(check, "kind", None) is bool:
            section.add_argument(*names, dest=field.name, action=argparse.BooleanOptionalAction,
                                 default=argparse.SUPPRESS, help=help_text)
            continue
        choices = getattr(check, "choices", None)
        section.add_argument(*names, dest=field.name, default=argparse.SUPPRESS, help=help_text,
                             type=_parser_for(field), metavar=meta.get("metavar") or (
                                 "{" + ",".join(map(str, choices)) + "}" if choices else
                                 meta["unit"].upper() if meta.get("unit") else None))


def from_args(group_type: type, args: argparse.Namespace):
    """The group built from the flags given in `args` (the others at their defaults)."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(group_type) if hasattr(args, f.name)}
    return group_type(**given)


def field_names(group_type: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(group_type))


def type_hints(group_type: type) -> dict:
    return typing.get_type_hints(group_type)
