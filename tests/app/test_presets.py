"""Every preset in simulations/ is a valid run configuration (keys and values)."""

from __future__ import annotations

from pathlib import Path

import pytest
from flwr.common.config import get_fused_config_from_dir

from flwr_pfl.app.config import parse_experiment
from flwr_pfl.app.overrides import parse_overrides

REPO_ROOT = Path(__file__).resolve().parents[2]
PRESETS = sorted((REPO_ROOT / "simulations").glob("*.toml"))


def test_there_are_presets():
    assert len(PRESETS) >= 5


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_preset_parses(preset: Path):
    config = get_fused_config_from_dir(REPO_ROOT, parse_overrides([str(preset)]))
    experiment = parse_experiment(config)
    assert experiment.run.num_server_rounds >= 1
