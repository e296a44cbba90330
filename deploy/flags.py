"""Command-line flags made from a pydantic settings model: one `--field-name` per field, its type, choices,
default and help taken from the field, so that a setting is defined once (cluster.settings and the
deployment configs) and the CLI, the Serve YAML and the engines cannot drift apart."""
from __future__ import annotations

import argparse
import json
import types
import typing

from pydantic import BaseModel


def add_model_flags(parser: argparse.ArgumentParser, model: type[BaseModel], *,
                    overrides: dict[str, dict] | None = None, aliases: dict[str, tuple[str, ...]] | None = None) -> None:
    """Add a flag per field of `model`. `overrides[name]` replaces argparse keywords of one flag (a CLI-only
    default or help); `aliases[name]` adds short spellings."""
    overrides, aliases = overrides or {}, aliases or {}
    for name, info in model.model_fields.items():
        kind, choices = _flag_type(name, info.annotation)
        default = None if info.is_required() else info.default
        shown = json.dumps(default) if isinstance(default, dict) else default  # as the flag is written
        keywords = dict(type=kind, choices=choices, default=default, dest=name,
                        help=info.description if default is None else f"{info.description} (default: {shown})")
        keywords.update(overrides.get(name, {}))
        parser.add_argument(*aliases.get(name, ()), f"--{name.replace('_', '-')}", **keywords)


def model_kwargs(args: argparse.Namespace, model: type[BaseModel]) -> dict:
    """The fields of `model` that the command line set (unset optional flags are left to the model)."""
    return {name: getattr(args, name) for name in model.model_fields if getattr(args, name, None) is not None}


def _json_object(text: str) -> dict:
    """A mapping flag is written as `ray start --resources` writes it: '{"tandem_decode": 1}'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.msg}): {text!r}; write e.g. '{{\"tandem_decode\": 1}}'")
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}; write e.g. '{{\"tandem_decode\": 1}}'")
    return value


def _boolean(text: str) -> bool:
    """A switch is written `--name true` or `--name false` (also 1/0, yes/no, on/off), like its YAML value."""
    value = text.strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r}; write true or false")


def _flag_type(name: str, annotation) -> tuple[type, list | None]:
    """(argparse type, choices) of a field: str, int, float, bool, a Literal of strings, one of those | None,
    or a dict (a JSON object)."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return _flag_type(name, rest[0])
    elif typing.get_origin(annotation) is typing.Literal and all(isinstance(a, str) for a in args):
        return str, list(args)
    elif annotation in (str, int, float):
        return annotation, None
    elif annotation is bool:
        return _boolean, None
    elif typing.get_origin(annotation) is dict:
        return _json_object, None
    raise TypeError(f"settings field {name!r} of type {annotation!r} has no command-line form; give it one in "
                    f"deploy/flags.py")

