"""docs/privacy.md's table of which protection each algorithm accepts is the code's."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_the_privacy_table_is_what_the_algorithms_accept():
    spec = importlib.util.spec_from_file_location("privacy_matrix", REPO_ROOT / "simulations" / "privacy_matrix.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = (REPO_ROOT / "docs" / "privacy.md").read_text()
    assert module.with_matrix(text) == text, "regenerate it: python simulations/privacy_matrix.py --write"
    assert "| `fedavg` | yes | yes | yes |" in text
    assert "| `pfedfda` | no: " in text
