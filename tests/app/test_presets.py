"""Every shipped preset (flwr_pfl/presets/*.toml) is a valid run configuration, reachable by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from flwr_pfl.app.appdir import default_run_config
from flwr_pfl.app.config import parse_experiment
from flwr_pfl.app.overrides import parse_overrides
from flwr_pfl.app.presets import PRESETS_DIR, preset_names
from flwr_pfl.errors import ConfigError

PRESETS = sorted(PRESETS_DIR.glob("*.toml"))


def test_there_are_presets():
    assert len(PRESETS) >= 5
    assert preset_names() == [p.stem for p in PRESETS]


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_preset_parses(preset: Path):
    experiment = parse_experiment(default_run_config(parse_overrides([str(preset)])))
    assert experiment.run.num_server_rounds >= 1


def test_a_preset_by_name_is_the_file(tmp_path, monkeypatch):
    """From any directory: a bare name, the name with .toml, and the path give the same keys."""
    monkeypatch.chdir(tmp_path)
    by_path = parse_overrides([str(PRESETS_DIR / "tiny.toml")])
    assert by_path["num-clients"] == 3
    assert parse_overrides(["tiny"]) == parse_overrides(["tiny.toml"]) == by_path
    # mixed with key=value pairs, applied in order
    assert parse_overrides(["tiny", "num-clients=5"])["num-clients"] == 5
    assert parse_overrides(["num-clients=5", "tiny"])["num-clients"] == 3


def test_a_local_file_wins_over_a_shipped_preset_of_the_same_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.toml").write_text("num-clients = 7\n")
    assert parse_overrides(["tiny.toml"]) == {"num-clients": 7}
    assert parse_overrides(["tiny"])["num-clients"] == 3  # a bare name is always the shipped preset


@pytest.mark.parametrize("item", ["tinyy", "tinyy.toml", "no/such/dir/tiny.toml"])
def test_an_unknown_preset_names_the_shipped_ones(item):
    with pytest.raises(ConfigError) as err:
        parse_overrides([item])
    assert "tiny" in str(err.value) and "fmnist_label_skew" in str(err.value)


def test_fedgp_noise_paper_layout(data_dir):
    """The paper's noisy Fashion-MNIST (FedGP App. C.7): 9 clean sources on equal i.i.d.
    tenths, and the last client, the target, noisy (std 0.4, unclipped) in train and test."""
    import torch

    from flwr_pfl.data import describe_partition, load_client_data

    raw = default_run_config(
        parse_overrides(["fedgp_fmnist_noise_paper", "max-samples=3000", f"data-dir='{data_dir}'"])
    )
    experiment = parse_experiment({**raw, "algorithm": "fedgp"})
    data, clients = experiment.data, experiment.run.num_clients
    assert clients == 10 and experiment.options.target_partition == -1
    assert experiment.options.target_train_samples == 100
    summaries = describe_partition(data, clients)
    assert [s.domain_counts for s in summaries] == [(300, 0)] * 9 + [(0, 300)]
    target = load_client_data(data, clients - 1, clients)
    source = load_client_data(data, 0, clients)
    low, high = (-0.2860 / 0.3530, (1 - 0.2860) / 0.3530)  # [0, 1] after standardisation
    for split in (target.train, target.test):
        assert split.x.min() < low - 0.5 and split.x.max() > high + 0.5  # unclipped noise
    assert low - 1e-5 <= source.test.x.min() and source.test.x.max() <= high + 1e-5
    assert len(target.test) == 60 and torch.all(target.test.domain == 1)
