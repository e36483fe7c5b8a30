"""Run-config presets: the TOML files shipped inside the package (``flwr_pfl/presets/*.toml``).

They live in the package, not beside it, so that an installed flwr_pfl has them too: the
suite's commands accept a preset by name (``-c fmnist_label_skew``) from any directory, or by
path (``-c flwr_pfl/presets/fmnist_label_skew.toml``, what ``flwr run --run-config`` needs).
"""

from __future__ import annotations

from pathlib import Path

from flwr_pfl.errors import ConfigError

PRESETS_DIR = Path(__file__).resolve().parents[1] / "presets"


def preset_names() -> list[str]:
    """Names of the shipped presets (file names without ``.toml``), sorted."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.toml"))


def preset_path(name: str) -> Path:
    """The shipped preset called ``name`` (with or without ``.toml``).

    Raises:
        ConfigError: no shipped preset has that name; the message lists those that exist.
    """
    stem = name[: -len(".toml")] if name.endswith(".toml") else name
    path = PRESETS_DIR / f"{stem}.toml"
    if "/" in stem or "\\" in stem or not path.is_file():
        raise ConfigError(f"no preset named {name!r}; shipped presets: {', '.join(preset_names())}")
    return path


def resolve_preset(item: str) -> Path | None:
    """The TOML file that the command-line item ``item`` means, or None for ``key=value`` items.

    An item is a preset when it is an existing ``.toml`` file, or else a word without ``=`` or
    spaces (a shipped preset's name, with or without ``.toml``).

    Raises:
        ConfigError: ``item`` looks like a preset (a ``.toml`` path, or a bare word) but no such
            file or shipped preset exists.
    """
    if item.endswith(".toml"):
        path = Path(item).expanduser()
        if path.is_file():
            return path
        if path.parent != Path("."):
            raise ConfigError(
                f"run-config file {item!r} does not exist; shipped presets (by name): {', '.join(preset_names())}"
            )
        return preset_path(item)
    if "=" not in item and not any(c.isspace() for c in item.strip()) and item.strip():
        return preset_path(item.strip())
    return None
