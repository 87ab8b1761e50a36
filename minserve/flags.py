"""Command-line flags made from the configuration dataclasses, so a setting is declared once.

Every setting of :class:`~minserve.config.EngineConfig` (its groups' fields, flat), of
:class:`~minserve.config.ServerConfig` (and of any other config dataclass) becomes a flag: ``max_num_seqs``
is ``--max-num-seqs``, typed from its annotation, with its default and the help text of its
:func:`~minserve.config.option`. A boolean that is on by default becomes a
``--no-…`` switch (``enable_prefix_caching`` → ``--no-prefix-caching``), one that is off a plain switch, and
one that may be left unset (``bool | None``: the command decides) gets both (``--compile``, ``--no-compile``).

    add_config_flags(parser, EngineConfig, ENGINE_SCHEDULING)
    EngineConfig.from_options(**config_options(args, EngineConfig, ENGINE_SCHEDULING))

``unset=True`` makes every default ``None``, for a command whose defaults come from elsewhere (``minserve
plan simulate`` takes the calibrated engine's): only the flags given are passed on.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import MISSING

from minserve.config import EngineConfig, Option, SchedulerConfig, options_of

# The groups of engine fields the commands take.
ENGINE_MODEL = ("model", "dtype", "quantization", "quant_group_size", "kv_cache_dtype", "device", "backend",
                "tensor_parallel_size", "enable_expert_parallel", "pipeline_parallel_size",
                "num_micro_batches")  # fmt: skip
# The scheduler's group, whole: its settings as the engine takes them (the host blocks it sizes itself).
ENGINE_SCHEDULING = tuple(name for name in options_of(SchedulerConfig) if name in EngineConfig.options())
_TYPES = {"int": int, "float": float, "str": str}


def add_config_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    config_cls: type,
    names: Sequence[str],
    unset: bool = False,
) -> None:
    """Add a flag for each setting of ``config_cls`` named in ``names`` (in that order)."""
    by_name = options_of(config_cls)
    for name in names:
        _add_flag(parser, by_name[name], unset)


def config_options(args: argparse.Namespace, config_cls: type, names: Sequence[str]) -> dict:
    """The values of those flags, under the fields' names, leaving out the ones left unset (``None``)."""
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


def config_argv(args: argparse.Namespace, config_cls: type, names: Sequence[str]) -> list[str]:
    """The inverse of :func:`config_options`: those fields' values in ``args`` as command-line flags, the
    ones left at their defaults (or unset) left out. What a command hands to the ``minserve serve`` it starts."""
    by_name = options_of(config_cls)
    argv: list[str] = []
    for name in names:
        f, value = by_name[name], getattr(args, name, None)
        if value is None or value == f.default:
            continue
        flag = _flag_name(f)
        if f.type == "bool | None":
            argv.append(f"--{flag}" if value else f"--no-{flag}")
        elif f.type == "bool":  # it differs from the default: the switch is given
            argv.append("--no-" + flag.removeprefix("enable-") if f.default else f"--{flag}")
        else:
            argv += [f"--{flag}", json.dumps(value) if isinstance(value, dict) else str(value)]
    return argv


def _flag_name(f: Option) -> str:
    return f.metadata.get("flag") or f.name.replace("_", "-")


def _add_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup, f: Option, unset: bool) -> None:
    meta = f.metadata
    flag = _flag_name(f)
    default = None if unset or f.default is MISSING else f.default
    help_text = meta.get("help", "")
    if f.type == "bool | None":  # both ways can be said; neither leaves the choice to the command
        parser.add_argument(f"--{flag}", dest=f.name, action="store_true", default=None, help=help_text)
        parser.add_argument(f"--no-{flag}", dest=f.name, action="store_false", default=None,
                            help=f"turn off: {help_text}")  # fmt: skip
        return
    if f.type == "bool":
        if f.default:  # on by default: the flag switches it off
            switch = "--no-" + flag.removeprefix("enable-")
            parser.add_argument(switch, dest=f.name, action="store_false", default=None if unset else True,
                                help=f"turn off: {help_text}")  # fmt: skip
        else:
            parser.add_argument(f"--{flag}", dest=f.name, action="store_true", default=None if unset else False,
                                help=help_text)  # fmt: skip
        return
    choices = meta.get("choices")
    choices = choices() if callable(choices) else choices
    shown = "" if default is None else f" (default: {default})"
    parser.add_argument(
        f"--{flag}",
        dest=f.name,
        type=_value_type(f.type),
        default=default,
        choices=choices,
        metavar=None if choices else flag.upper().replace("-", "_"),
        help=help_text + shown,
    )


def _value_type(annotation: str):
    """``int``, ``float`` or ``str`` from an annotation such as ``"int | None"`` (strings, with postponed
    annotations); anything else (a policy object, say) is given on a command line by name, as a string."""
    first = annotation.split("|")[0].strip()
    if first.startswith("Mapping"):
        return json_object
    return _TYPES.get(first, str)


def json_object(text: str) -> dict:
    """A flag's value given as a JSON object, as vLLM takes ``--speculative-config '{"method": …}'``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON ({error.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"need a JSON object ({{...}}), got {text!r}")
    return value
