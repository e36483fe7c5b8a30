"""Run-config overrides from the command line: presets and ``key=value`` pairs, mixed.

``flwr run`` accepts either TOML files or ``key=value`` pairs, not both; the suite's commands
accept any mix, applied in order (later wins), and hand ``flwr run`` one fused TOML file. A
preset is a TOML file's path or the name of a preset shipped with the package
(:mod:`flwr_pfl.app.presets`).
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Iterable
from typing import Any

from flwr.common.config import flatten_dict, parse_config_args

from flwr_pfl.app.presets import resolve_preset


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """Fuse ``items`` (TOML file paths, preset names or ``'k=v k2=v2'`` strings) into one flat dict.

    Raises:
        ConfigError: an item names a TOML file or preset that does not exist.
    """
    fused: dict[str, Any] = {}
    for item in items:
        path = resolve_preset(item)
        if path is not None:
            fused.update(flatten_dict(tomllib.loads(path.read_text())))
        else:
            fused.update(parse_config_args([item]))
    return fused


def to_toml(config: dict[str, Any]) -> str:
    """A TOML document of flat keys (dotted keys quoted, so they stay single keys)."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        return json.dumps(str(v))

    return "".join(f"{json.dumps(k)} = {value(v)}\n" for k, v in config.items())
