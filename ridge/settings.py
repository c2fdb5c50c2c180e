"""Settings: dataclass fields that carry their own help text, validation and command-line flag.

A settings class (`ridge.config.EngineConfig`, `ridge.server.config.ServerConfig`) declares each
setting once, as a field made by `setting(...)`. From that one declaration come the keyword
arguments a constructor accepts (`check_names`), the validation of a value (`validate`, run by the
class's `__post_init__`), the command-line flags (`add_arguments`), the parse back from argparse
(`from_args`) and the reverse, a command line that rebuilds a configuration (`to_args`).

Validation is strict on purpose: a bool is not an integer, a float must be finite, and a bad
value raises ValueError naming the setting, so a mistake stops before any weights are read.
This module imports nothing from ridge.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import types
import typing
from typing import Any, Callable

_KEY = "ridge.setting"


@dataclasses.dataclass(frozen=True)
class Setting:
    help: str
    choices: tuple | None = None
    minimum: float | None = None          # inclusive
    maximum: float | None = None          # inclusive
    above: float | None = None            # exclusive lower bound
    flag: str | None = None               # default: --the-field-name
    aliases: tuple[str, ...] = ()         # more option strings; for a bool, '--no-...' ones turn it off
    parse: Callable[[str], Any] | None = None   # command-line text -> value (default: from the type)
    default_text: str | None = None       # what --help says for the default when the value alone does not
    check: Callable[[Any], str | None] | None = None   # a further check: returns why a value is bad


def setting(default: Any, *, help: str, choices=None, minimum=None, maximum=None, above=None, flag=None,
            aliases=(), parse=None, default_text=None, check=None) -> Any:
    """A dataclass field that is a setting (see the module docstring)."""
    meta = Setting(help, tuple(choices) if choices is not None else None, minimum, maximum, above, flag,
                   tuple(aliases), parse, default_text, check)
    return dataclasses.field(default=default, metadata={_KEY: meta})


def fields(cls) -> list[tuple[dataclasses.Field, Setting, tuple[type, ...]]]:
    """(field, its Setting, the types it accepts) for each setting of a settings class, in order."""
    cls = cls if isinstance(cls, type) else type(cls)
    cached = cls.__dict__.get("_ridge_settings")
    if cached is None:
        hints = typing.get_type_hints(cls)
        cached = [(f, f.metadata[_KEY], _types_of(hints[f.name]))
                  for f in dataclasses.fields(cls) if _KEY in f.metadata]
        setattr(cls, "_ridge_settings", cached)
    return cached


def names(cls) -> list[str]:
    return [f.name for f, _, _ in fields(cls)]


def _types_of(hint) -> tuple[type, ...]:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return tuple(t for t in typing.get_args(hint))
    return (hint,)


def _kind(value) -> str:
    return type(value).__name__


def _type_words(accepted: tuple[type, ...]) -> str:
    words = {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "None"}
    return " or ".join(words.get(t, t.__name__) for t in accepted)


def check_value(name: str, value, accepted: tuple[type, ...], s: Setting) -> None:
    """Raise ValueError naming `name` unless `value` is of an accepted type and within the setting's
    bounds and choices."""
    def bad(why):
        raise ValueError(f"{name}: {why}")

    if value is None:
        if type(None) not in accepted:
            bad(f"must be {_type_words(accepted)}, got None")
        return
    if isinstance(value, bool):
        if bool not in accepted:
            bad(f"must be {_type_words(accepted)}, got {value!r}")
        return
    number = isinstance(value, int) and int in accepted or isinstance(value, (int, float)) and float in accepted
    if number:
        if isinstance(value, float) and not math.isfinite(value):
            bad(f"must be a finite number, got {value!r}")
        if s.minimum is not None and value < s.minimum:
            bad(f"must be >= {s.minimum}, got {value!r}")
        if s.maximum is not None and value > s.maximum:
            bad(f"must be <= {s.maximum}, got {value!r}")
        if s.above is not None and value <= s.above:
            bad(f"must be > {s.above}, got {value!r}")
    elif isinstance(value, str) and str in accepted:
        if s.choices is not None and value not in s.choices:
            bad(f"must be one of {', '.join(map(str, s.choices))}; got {value!r}")
    elif not any(isinstance(value, t) for t in accepted if t not in (bool, int, float, str, type(None))):
        bad(f"must be {_type_words(accepted)}, got {_kind(value)} {value!r}")
    if s.check is not None:
        why = s.check(value)
        if why:
            bad(why)


def validate(obj) -> None:
    """Check every setting of a settings instance (call it from `__post_init__`)."""
    for f, s, accepted in fields(obj):
        check_value(f.name, getattr(obj, f.name), accepted, s)


def check_names(cls, kwargs: dict, what: str = "setting") -> None:
    """Reject keyword arguments that are not settings of `cls`, suggesting close names."""
    known = names(cls)
    for key in kwargs:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
            hint = f"; did you mean {' or '.join(close)}?" if close else f"; the {what}s are: {', '.join(known)}"
            raise ValueError(f"{key}: not a{'n' if what[0] in 'aeiou' else ''} {what}{hint}")


# -- the command line -----------------------------------------------------------------------------
def flag_of(f: dataclasses.Field, s: Setting) -> str:
    return s.flag or "--" + f.name.replace("_", "-")


def _negated(flag: str) -> str:
    return "--no-" + flag[2:]


class _Switch(argparse.Action):
    """A bool setting: `--x` sets it, `--no-x` (and any '--no-' alias) clears it."""

    def __init__(self, option_strings, dest, default=None, help=None):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, not option_string.startswith("--no-"))


def _cli_parser(accepted: tuple[type, ...]) -> Callable[[str], Any]:
    for t in (int, float, str):
        if t in accepted:
            return t
    raise TypeError(f"no command-line form for {accepted}")


_METAVARS = {int: "N", float: "X"}


def _shown(value, s: Setting, override_text: str | None) -> str:
    if override_text is not None:
        return override_text
    if s.default_text is not None:
        return s.default_text
    return "off" if value is False else "on" if value is True else str(value)


def add_arguments(parser: argparse.ArgumentParser, cls, *, title: str | None = None,
                  defaults: dict[str, Any] | None = None) -> argparse._ArgumentGroup:
    """One flag per setting of `cls`, its help ending with the default. `defaults` overrides a
    default for this command: name -> value, or name -> (value, how --help describes it)."""
    group = parser.add_argument_group(title or f"{cls.__name__} settings")
    overrides = dict(defaults or {})
    check_names(cls, overrides)
    for f, s, accepted in fields(cls):
        default, text = f.default, None
        if f.name in overrides:
            default = overrides[f.name]
            if isinstance(default, tuple):
                default, text = default
        help_text = f"{s.help} (default: {_shown(default, s, text)})".replace("%", "%%")
        flag = flag_of(f, s)
        if bool in accepted:
            group.add_argument(flag, _negated(flag), *s.aliases, dest=f.name, action=_Switch, default=default,
                               help=help_text)
        else:
            choices = s.choices if accepted[0] is str else None
            group.add_argument(flag, *s.aliases, dest=f.name, type=s.parse or _cli_parser(accepted),
                               choices=choices, default=default, help=help_text,
                               metavar=None if choices else _METAVARS.get(accepted[0], f.name.upper()))
    return group


def values(cls, namespace: argparse.Namespace) -> dict[str, Any]:
    """The settings of `cls` as parsed by `add_arguments`, unvalidated (a command may fill some)."""
    return {name: getattr(namespace, name) for name in names(cls)}


def from_args(cls, namespace: argparse.Namespace, **overrides):
    """A validated instance of `cls` from the parsed command line."""
    return cls(**{**values(cls, namespace), **overrides})


def to_args(obj) -> list[str]:
    """The command-line flags that rebuild `obj` (settings left at their default are left out)."""
    argv = []
    for f, s, accepted in fields(obj):
        value = getattr(obj, f.name)
        if value == f.default:
            continue
        flag = flag_of(f, s)
        if isinstance(value, bool):
            argv.append(flag if value else _negated(flag))
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def describe(cls) -> str:
    """A plain-text list of the settings: name, flag, default and help."""
    lines = []
    for f, s, accepted in fields(cls):
        lines.append(f"{f.name} ({flag_of(f, s)}, {_type_words(accepted)}; default {_shown(f.default, s, None)}): "
                     f"{s.help}")
    return "\n".join(lines)
