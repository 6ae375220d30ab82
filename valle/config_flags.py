"""Command-line flags generated from typed config dataclasses: each option is declared once.

A field made with ``flag(default, help, ...)`` is an option: its metadata holds what argparse
needs (help, aliases, choices, the parser of its value, group, hidden, append), and
``add_flags(parser, Config)`` turns every such field into its ``--flag`` (``--field-name`` unless
aliases are given). ``from_namespace(Config, args)`` reads the parsed values back into the
dataclass, and ``flag_values(config)`` gives them as plain types (what a checkpoint records).
Fields made with plain ``dataclasses.field`` are library settings without a flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import types
import typing
from collections.abc import Callable, Collection
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any

from valle.args import str2bool

FLAG = "flag"  # the metadata key of a field's Flag
SAME_AS_FIELD = "<the field's default>"  # Flag.cli_default when the flag has no default of its own


@dataclass(frozen=True)
class Flag:
    """How one dataclass field appears on the command line."""

    help: str | None = None
    names: tuple[str, ...] = ()  # option strings; () means --field-name
    group: str | None = None  # argparse group title (None: the parser's own options)
    choices: tuple[Any, ...] | None = None
    parse: Callable[[str], Any] | None = None  # argparse's ``type``; None: from the field's type
    hidden: bool = False  # accepted but not shown by --help (tests, sweeps)
    append: bool = False  # repeatable: each use appends to a list
    switch: bool = False  # no value: the flag alone sets True
    negation: str | None = None  # a second flag that sets False (--no-shuffle)
    nargs: str | None = None
    const: Any = None
    metavar: str | None = None
    cli_default: Any = SAME_AS_FIELD  # the flag's default where it differs from the field's


def flag(default: Any = MISSING, help: str | None = None, *, default_factory: Any = MISSING,
         metadata: dict[str, Any] | None = None, **spec: Any) -> Any:
    """A dataclass field that is also a command-line flag (``spec``: the fields of ``Flag``)."""
    meta = {**(metadata or {}), FLAG: Flag(help=help, **spec)}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def flag_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of ``cls`` that are flags, in declaration order."""
    return [f for f in dataclasses.fields(cls) if FLAG in f.metadata]


def flag_name(name: str) -> str:
    """``decoder_dim`` -> ``--decoder-dim``."""
    return "--" + name.replace("_", "-")


def option_strings(f: dataclasses.Field) -> tuple[str, ...]:
    return f.metadata[FLAG].names or (flag_name(f.name),)


def add_flags(parser: argparse.ArgumentParser, cls: type,
              descriptions: dict[str, str] | None = None, groups: Collection[str] | None = None) -> None:
    """One argparse option per flag field of ``cls``, in its group (created on first use,
    or the parser's group of that title when it has one already); ``groups``: only the
    fields of these groups (a CLI that places its own flags between them)."""
    hints = typing.get_type_hints(cls)
    for f in flag_fields(cls):
        spec: Flag = f.metadata[FLAG]
        if groups is not None and spec.group not in groups:
            continue
        target = _group(parser, spec.group, (descriptions or {}).get(spec.group)) if spec.group else parser
        kwargs = _argparse_kwargs(f, spec, hints[f.name])
        target.add_argument(*option_strings(f), dest=f.name, **kwargs)
        if spec.negation:
            target.add_argument(spec.negation, dest=f.name, action="store_false")


def _group(parser: argparse.ArgumentParser, title: str, description: str | None):
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title, description)


def _argparse_kwargs(f: dataclasses.Field, spec: Flag, kind: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"default": _flag_default(f, spec), "help": spec.help}
    if spec.hidden:
        kwargs["help"] = argparse.SUPPRESS
    if spec.switch:
        kwargs["action"] = "store_true"
        return kwargs
    if spec.append:
        kwargs["action"] = "append"
    kwargs["type"] = spec.parse or value_parser(kind)
    if spec.choices is not None:
        kwargs["choices"] = list(spec.choices)
    for key in ("nargs", "const", "metavar"):
        if getattr(spec, key) is not None:
            kwargs[key] = getattr(spec, key)
    return kwargs


def _flag_default(f: dataclasses.Field, spec: Flag) -> Any:
    if spec.cli_default is not SAME_AS_FIELD:
        return spec.cli_default
    value = f.default_factory() if f.default_factory is not MISSING else f.default
    # Flags hold plain values in the Namespace (a checkpoint records them as they are).
    return value.value if isinstance(value, enum.Enum) else value


def value_parser(kind: Any) -> Callable[[str], Any]:
    """The parser of a flag's value, from its field's type (``X | None``: X's)."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    if kind is bool:
        return str2bool
    if isinstance(kind, type) and issubclass(kind, enum.IntEnum):
        return int
    if kind in (int, float, str, Path):
        return kind
    raise TypeError(f"no flag parser for type {kind!r}: give the field's flag a parse=")


def from_namespace(cls: type, args: argparse.Namespace | dict[str, Any], **extra: Any) -> Any:
    """An instance of ``cls`` from parsed flags (its flag fields that ``args`` holds; other
    keys are ignored), with ``extra`` for fields that are not flags."""
    values = vars(args) if isinstance(args, argparse.Namespace) else args
    picked = {f.name: values[f.name] for f in flag_fields(cls) if f.name in values}
    return cls(**picked, **extra)


def plain(value: Any) -> Any:
    """A flag value as JSON-like plain types: Paths and other objects as their text."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str, dict)):
        return value
    return str(value)


def flag_values(config: Any) -> dict[str, Any]:
    """Every flag field of ``config`` -> its value as plain types."""
    return {f.name: plain(getattr(config, f.name)) for f in flag_fields(type(config))}
