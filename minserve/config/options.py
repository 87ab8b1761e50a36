"""How a setting is declared once: its default, its help text and its choices, for every command that takes it.

:func:`option` is a dataclass field whose metadata carries what its command-line flag says; :func:`options_of`
lists a configuration's settings by the names users give them (a composed configuration, such as
:class:`~minserve.config.EngineConfig`, lists its groups' settings flat), and :mod:`minserve.flags` turns
each into a flag.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any


def option(
    default: Any, help: str, choices: Sequence[str] | Callable[[], Sequence[str]] | None = None, flag: str | None = None
) -> Any:
    """A dataclass field with what its command-line flag says: ``help``, ``choices`` (or a function giving
    them, for registries filled later), and ``flag`` when the flag's name is not the field's."""
    return field(default=default, metadata={"help": help, "choices": choices, "flag": flag})


@dataclass(frozen=True)
class Option:
    """One setting as a user names it: ``name`` (a keyword of ``LLM(...)``, a flag without its dashes), its
    ``type`` (the annotation, as a string), its ``default`` and the ``metadata`` :func:`option` gave it."""

    name: str
    type: str
    default: Any
    metadata: Mapping[str, Any]


def options_of(config_cls: type) -> dict[str, Option]:
    """A configuration's settings by name: a composed configuration lists its own (``options()``), a plain
    dataclass its fields."""
    own = getattr(config_cls, "options", None)
    if own is not None:
        return own()
    return {f.name: Option(f.name, str(f.type), f.default, f.metadata) for f in fields(config_cls)}


def check_whole(config: object, name: str, value: object, minimum: int = 1, optional: bool = False) -> None:
    """Refuse a field of ``config`` that is not an integer ≥ ``minimum`` (or None, when ``optional``)."""
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{type(config).__name__}.{name} must be an integer ≥ {minimum}, got {value!r}")
