"""Where the Flower App is: the ``pyproject.toml`` whose ``[tool.flwr.app]`` ``flwr run`` reads.

One file holds the app's default run config (``[tool.flwr.app.config]``): the repository's
``pyproject.toml``. A source checkout (plain or editable install) uses it where it is. A wheel
carries a copy of it, put into the package at build time (``force-include`` in
``pyproject.toml``), in ``flwr_pfl/app/flower_app/``; that directory is a complete Flower App
whose components import the installed package, so ``flwr run`` can run it from anywhere.
(An editable install gets the copy too, in site-packages beside the import hook; unused there,
since the checkout is found first.)
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: the repository root when this module runs from a source checkout
CHECKOUT_ROOT = Path(__file__).resolve().parents[2]
#: the copy of the app's pyproject.toml that a wheel carries (absent in a checkout)
BUNDLED_APP = Path(__file__).resolve().parent / "flower_app"
SERVER_APP = "flwr_pfl.app.server_app:app"
#: clients that the suite's own tools simulate (the launcher's federation, compare's in-process
#: runs) when ``num-clients`` is 0, the federation's size, and so leaves the number to them (here,
#: beside the default run config, so that the launcher needs no import of the training stack)
SIMULATED_CLIENTS = 10


def is_app_dir(path: Path) -> bool:
    """Whether ``path`` holds this suite's Flower App (a pyproject.toml naming its ServerApp)."""
    try:
        data = tomllib.loads((path / "pyproject.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return False
    components = data.get("tool", {}).get("flwr", {}).get("app", {}).get("components", {})
    return components.get("serverapp") == SERVER_APP


def is_checkout() -> bool:
    """Whether flwr_pfl runs from a source checkout (not from an installed wheel)."""
    return is_app_dir(CHECKOUT_ROOT)


def app_dir() -> Path:
    """The Flower App directory: the checkout's root, else the copy inside the installed package.

    Raises:
        FileNotFoundError: neither exists (a wheel built without the app's pyproject.toml).
    """
    for candidate in (CHECKOUT_ROOT, BUNDLED_APP):
        if is_app_dir(candidate):
            return candidate
    raise FileNotFoundError(
        f"the Flower App's pyproject.toml is neither in a source checkout ({CHECKOUT_ROOT}) nor in the "
        f"installed package ({BUNDLED_APP}); reinstall flwr_pfl from a wheel built with its pyproject.toml"
    )


def default_run_config(overrides: Mapping[str, Any] | None = None, app: Path | None = None) -> dict[str, Any]:
    """The run config of the app in ``app`` (default :func:`app_dir`): its
    ``[tool.flwr.app.config]``, flattened, with ``overrides`` applied, as ``flwr run`` fuses them.

    Raises:
        ValueError: an override's key is not in the app's config (Flower's message).
    """
    from flwr.common.config import get_fused_config_from_dir

    return dict(get_fused_config_from_dir(app or app_dir(), dict(overrides or {})))
