"""A clean copy of a Flower App for ``flwr run``: only what the app needs to run.

``flwr run <dir>`` builds the app bundle (FAB) from a walk over every file under ``<dir>``,
filtering afterwards: in a checkout with its virtual environment inside, that walk visited tens
of thousands of files (seconds per run) before throwing them away, and the bundle still carried
tests, docs and result tables. :func:`stage_app` copies ``pyproject.toml`` and the top-level
packages that ``[tool.flwr.app.components]`` names into a directory of their own, which is what
the launcher hands to ``flwr run``.
"""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

from flwr_pfl.errors import ConfigError

#: besides the packages, files Flower copies into a bundle when present
EXTRA_FILES = ("pyproject.toml", "LICENSE")


def app_packages(app_dir: Path) -> list[str]:
    """Top-level modules the app's components come from (``serverapp`` and ``clientapp``)."""
    config = tomllib.loads((app_dir / "pyproject.toml").read_text())
    components = config.get("tool", {}).get("flwr", {}).get("app", {}).get("components", {})
    refs = [components.get(name, "") for name in ("serverapp", "clientapp")]
    if not all(refs):
        raise ConfigError(f"{app_dir / 'pyproject.toml'} lacks [tool.flwr.app.components] serverapp and clientapp")
    return sorted({ref.split(":")[0].split(".")[0] for ref in refs})


def stage_app(app_dir: Path, stage_dir: Path) -> Path:
    """Copy the app in ``app_dir`` into ``stage_dir/<app directory name>`` (replacing what was
    there) and return that directory.

    Copied: ``pyproject.toml``, ``LICENSE`` if present, and each package (or module) the
    components live in, without ``__pycache__``.
    """
    app_dir = app_dir.resolve()
    target = _fresh_target(app_dir, stage_dir)
    for name in EXTRA_FILES:
        if (app_dir / name).is_file():
            shutil.copy2(app_dir / name, target / name)
    for package in app_packages(app_dir):
        source = app_dir / package
        if source.is_dir():
            shutil.copytree(source, target / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif (app_dir / f"{package}.py").is_file():
            shutil.copy2(app_dir / f"{package}.py", target / f"{package}.py")
        else:
            raise ConfigError(f"the app's components live in {package!r}, which is not in {app_dir}")
    return target


def stage_bundled_app(app_dir: Path, stage_dir: Path) -> Path:
    """Stage the app an installed package carries: its ``pyproject.toml`` alone (the code is the
    installed package), without the ``fab-include`` key.

    ``fab-include`` names the package's files, which a checkout's bundle carries and this
    one-file app does not; Flower refuses a pattern that matches nothing.
    """
    target = _fresh_target(app_dir.resolve(), stage_dir)
    lines = (app_dir / "pyproject.toml").read_text().splitlines(keepends=True)
    (target / "pyproject.toml").write_text("".join(line for line in lines if not line.lstrip().startswith("fab-include")))
    return target


def _fresh_target(app_dir: Path, stage_dir: Path) -> Path:
    """An empty ``stage_dir/<app directory name>`` (what was there is removed); never the app's
    own directory or one of its parents."""
    target = stage_dir.resolve() / app_dir.name
    if target == app_dir or target in app_dir.parents:
        raise ValueError(f"staging into {target} would overwrite the app in {app_dir}")
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    return target
