"""Run-config overrides from the command line: preset files and ``key=value`` pairs, mixed.

``flwr run`` accepts either TOML files or ``key=value`` pairs, not both; the suite's commands
accept any mix, applied in order (later wins), and hand ``flwr run`` one fused TOML file.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from flwr.common.config import flatten_dict, parse_config_args


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """Fuse ``items`` (TOML file paths or ``'k=v k2=v2'`` strings) into one flat dict."""
    fused: dict[str, Any] = {}
    for item in items:
        path = Path(item)
        if item.endswith(".toml"):
            if not path.is_file():
                raise FileNotFoundError(f"run-config file {item!r} does not exist")
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
