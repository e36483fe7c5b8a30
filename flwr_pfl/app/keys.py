"""Map flat kebab-case run-config keys onto typed dataclasses, with clear errors.

Flower hands the app a flat dict (``[tool.flwr.app.config]`` merged with ``--run-config``
overrides; nested tables become dotted keys such as ``fedrep.head-epochs``). Each dataclass
field ``some_name`` is read from the key ``<prefix>some-name``; values are checked against the
field's type here, and ranges by the dataclass's own ``__post_init__``.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import typing
from collections.abc import Collection, Mapping, Sequence
from typing import Any, TypeVar

from flwr_pfl.errors import ConfigError

T = TypeVar("T")


def key_of(field_name: str, prefix: str = "") -> str:
    return prefix + field_name.replace("_", "-")


def keys_of(cls: type, prefix: str = "") -> dict[str, dataclasses.Field]:
    """Run-config key -> dataclass field, for every init field of ``cls``."""
    return {key_of(f.name, prefix): f for f in dataclasses.fields(cls) if f.init}


def _coerce(key: str, value: Any, kind: Any) -> Any:
    """Check ``value`` against the field type ``kind`` (int, float, bool or str)."""
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={value!r} must be a boolean (true or false)")
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
            raise ConfigError(f"{key}={value!r} must be an integer")
        return int(value)
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={value!r} must be a number")
        return float(value)
    if kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}={value!r} must be a string (quote it: {key}='...')")
        return value
    raise TypeError(f"unsupported config field type {kind!r} for {key}")


def check_choice(key: str, value: str, allowed: Sequence[str]) -> None:
    """Raise ConfigError unless ``value`` is one of ``allowed``; the message lists them.

    An empty string among ``allowed`` means "the preset's value" and is shown as such.
    """
    if value not in allowed:
        shown = ", ".join(repr(a) for a in allowed if a)
        if "" in allowed:
            shown += ' or "" (the preset\'s)'
        raise ConfigError(f"{key}={value!r} is not allowed; choose one of {shown}")


def with_suggestions(names: Sequence[str], known: Collection[str]) -> str:
    """``'x' (did you mean y, z?)`` for each unknown name (closest known names), ``;``-joined."""
    hints = {name: difflib.get_close_matches(name, list(known), n=3) for name in names}
    return "; ".join(f"{n!r} (did you mean {', '.join(h)}?)" if h else repr(n) for n, h in hints.items())


def parse_section(cls: type[T], raw: Mapping[str, Any], prefix: str = "") -> T:
    """Build ``cls`` from the keys of ``raw`` that belong to it; absent keys keep defaults."""
    hints = typing.get_type_hints(cls)
    values = {
        f.name: _coerce(key, raw[key], hints[f.name])
        for key, f in keys_of(cls, prefix).items()
        if key in raw
    }
    return cls(**values)


def flat_dict(instance: Any, prefix: str = "") -> dict[str, Any]:
    """The instance's fields as run-config keys (the inverse of :func:`parse_section`)."""
    return {key_of(f.name, prefix): getattr(instance, f.name) for f in dataclasses.fields(instance) if f.init}


#: lower-case spellings of the booleans accepted in option strings, besides Python's True/False
_BOOLEANS = {"true": True, "false": False}


def parse_options(key: str, text: str) -> dict[str, Any]:
    """Keyword options written as in a Python call, e.g. ``"betas=(0.9, 0.99), eps=1e-8"``.

    Flower's run-config values are flat scalars, so a torch constructor's keyword arguments travel
    as one string (keys such as ``optimizer-options``). Values are Python literals: numbers,
    ``True``/``False`` (or ``true``/``false``), ``None``, quoted strings, tuples and lists; nothing
    is executed. An empty string means no options.
    """
    if not text.strip():
        return {}
    example = f"{key}='betas=(0.9, 0.99), eps=1e-8'"
    try:
        call = ast.parse(f"f({text})", mode="eval").body
    except SyntaxError as err:
        raise ConfigError(f"{key}={text!r} is not a list of name=value options ({err.msg}); write e.g. {example}") from None
    if not isinstance(call, ast.Call) or call.args or any(kw.arg is None for kw in call.keywords):
        raise ConfigError(f"{key}={text!r}: every option needs a name (name=value, comma-separated); write e.g. {example}")
    out: dict[str, Any] = {}
    for kw in call.keywords:
        node = kw.value
        if isinstance(node, ast.Name) and node.id in _BOOLEANS:
            out[str(kw.arg)] = _BOOLEANS[node.id]
            continue
        try:
            out[str(kw.arg)] = ast.literal_eval(node)
        except ValueError:
            raise ConfigError(
                f"{key}: the value of {kw.arg!r} ({ast.unparse(node)}) must be a literal: a number, True/False, "
                "None, a quoted string, or a tuple of these"
            ) from None
    return out
