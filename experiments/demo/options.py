"""Dataclass fields that carry their own CLI help: the demo's flags are built from the configs' fields.

``option(default, help)`` declares a field; :func:`add_arguments` turns every field of a dataclass into a
``--flag`` (field name with ``-``, or the field's ``flag``), typed from its default (or ``type``), a bool
default False becoming a switch. Parsed flags default to "not given", so the dataclass default stays the
single source of truth (:func:`given`).
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, Field, field, fields
from typing import Any, Callable, Optional


def option(default: Any, help: str, *, flag: Optional[str] = None, type: Optional[Callable[[str], Any]] = None,
           cli: bool = True, factory: Optional[Callable[[], Any]] = None) -> Any:
    """A dataclass field with a default (or ``factory``) and its CLI description.

    Args:
        default: the field's default (ignored when ``factory`` is given).
        help: one line for ``--help``.
        flag: the CLI flag when it is not ``--field-name``.
        type: the parser of the flag's value when the default's type does not tell (a None default).
        cli: False keeps the field off the command line.
    """
    meta = {"help": help, "flag": flag, "type": type, "cli": cli}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _default_of(f: Field) -> Any:
    if f.default is not MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not MISSING else None  # type: ignore[misc]


def flag_of(f: Field) -> str:
    """The ``--flag`` of field ``f``."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser, cls: type, notes: Optional[dict[str, str]] = None) -> None:
    """Add one flag per CLI field of dataclass ``cls``; ``notes`` appends text to a field's help."""
    group = parser.add_argument_group(cls.__name__, (cls.__doc__ or "").strip().splitlines()[0])
    for f in fields(cls):
        if not f.metadata.get("cli", False):
            continue
        default = _default_of(f)
        text = f.metadata["help"] + (f" {notes[f.name]}" if notes and f.name in notes else "")
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS}
        if isinstance(default, bool):
            kwargs.update(action="store_true", help=text)
        else:
            shown = "" if default is None else f" (default: {default})"  # a None default explains itself
            kwargs.update(type=f.metadata.get("type") or type(default), metavar=f.name.upper(), help=text + shown)
        group.add_argument(flag_of(f), **kwargs)


def given(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields of ``cls`` set on the command line (absent flags are left to the dataclass defaults)."""
    return {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
