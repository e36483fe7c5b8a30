"""DataConfig: defaults, validation messages (key, value, allowed), run-config mapping."""

from __future__ import annotations

import dataclasses
import os

import pytest

from flwr_pfl.data.config import DataConfig
from flwr_pfl.data.registry import available_datasets, dataset_builder, register_dataset
from flwr_pfl.errors import ConfigError


def test_defaults_are_valid_and_hashable() -> None:
    config = DataConfig()
    assert hash(config) == hash(DataConfig())
    assert os.path.isabs(config.data_dir)
    assert {"mnist", "fashion-mnist", "cifar10", "cifar100"} <= set(available_datasets())


LARGE_LAYOUT = {
    "partitioner": "one-domain-per-client", "domain_transform": "rotation", "num_domains": 4,
    "samples_per_client": 50, "large_client": 2,
}


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"dataset": "imagenet"}, ["'dataset'", "'imagenet'", "'mnist'", "'cifar100'"]),
        ({"partitioner": "shards"}, ["'partitioner'", "'shards'", "'one-domain-per-client'"]),
        ({"domain_transform": "blur"}, ["'domain-transform'", "'blur'", "'corruption'"]),
        ({"dirichlet_alpha": 0.0}, ["'dirichlet-alpha'", "0.0", "> 0"]),
        ({"domain_alpha": -1}, ["'domain-alpha'", "-1", "> 0"]),
        ({"classes_per_client": 0}, ["'classes-per-client'", "0", ">= 1"]),
        ({"num_domains": 3}, ["'num-domains'", "3", "'none'"]),
        ({"samples_per_client": -5}, ["'samples-per-client'", "-5", ">= 0"]),
        ({"partitioner": "domain-mixture"}, ["'samples-per-client'", "'domain-mixture'"]),
        ({"max_samples": -1}, ["'max-samples'", ">= 0"]),
        ({"val_fraction": 1.0}, ["'val-fraction'", "1.0", "[0.0, 1.0)"]),
        ({"val_fraction": 0.5, "test_fraction": 0.5}, ["'test-fraction'", "< 1"]),
        ({"data_dir": "relative/data"}, ["'data-dir'", "'relative/data'", "absolute"]),
        ({"download": "yes"}, ["'download'", "'yes'", "bool"]),
        ({"seed": 1.5}, ["'seed'", "1.5", "int"]),
        ({"classes_per_client": True}, ["'classes-per-client'", "True"]),
        ({"rotation_step": float("nan")}, ["'rotation-step'", "nan"]),
        (
            {"domain_transform": "corruption", "num_domains": 5},
            ["'num-domains'", "<= 4", "5", "clean-domain=False"],
        ),
        ({"noise_std": -0.1}, ["'noise-std'", "-0.1", ">= 0.0"]),
        ({"noise_std": "0.4"}, ["'noise-std'", "'0.4'", "a number"]),
        ({"noise_std": float("inf")}, ["'noise-std'", "inf"]),
        ({"noise_clip": "false"}, ["'noise-clip'", "'false'", "bool"]),
        ({"domain_clients": 9}, ["'domain-clients'", "9", "str"]),
        (
            {"dataset": "toy-noisy-regression", "noise_free_test": "true"},
            ["'noise-free-test'", "'true'", "bool"],
        ),
        (
            {"noise_free_test": True},
            ["'noise-free-test'", "True", "dataset 'mnist'", "no noise-free targets",
             "'toy-noisy-regression'"],
        ),
        (
            {"dataset": "toy-regression", "noise_free_test": True},
            ["'noise-free-test'", "dataset 'toy-regression'", "'toy-noisy-regression'"],
        ),
        *(
            (
                {"partitioner": "one-domain-per-client", "domain_clients": bad},
                ["'domain-clients'", repr(bad), "client counts >= 1", "'9,1'"],
            )
            for bad in ("9,0", "9,-1", "a,b", "9,,1", "9.5,1", ",")
        ),
        (
            {"domain_clients": "9,1"},
            ["'domain-clients'", "'9,1'", "partitioner 'iid'", "'one-domain-per-client'"],
        ),
        ({"large_client": -2}, ["'large-client'", "-2", ">= -1"]),
        *(({"train_fraction": bad}, ["'train-fraction'", repr(float(bad)), "(0, 1]"]) for bad in (0, 1.5, -0.25)),
        ({"train_fraction": "half"}, ["'train-fraction'", "'half'", "a number"]),
        ({"large_client": 1.0}, ["'large-client'", "1.0", "int"]),
        *(
            ({**LARGE_LAYOUT, **change}, ["'large-client'", "-1 (no large client)", *why])
            for change, why in (
                ({"partitioner": "iid"}, ["partitioner 'one-domain-per-client'", "got 'iid'"]),
                ({"domain_transform": "none", "num_domains": 1}, ["a domain transform"]),
                ({"domain_clients": "1,1,1,1"}, ["domain-clients ''", "'1,1,1,1'"]),
                ({"samples_per_client": 0}, ["samples-per-client > 0"]),
                ({"large_client": 4}, ["below num-domains = 4"]),
            )
        ),
        (
            {"partitioner": "domain-dirichlet", "domain_clients": "9,1", "domain_transform":
             "corruption", "clean_domain": True, "num_domains": 3},
            ["'domain-clients'", "'9,1'", "one client count per domain", "3 counts"],
        ),
    ],
)
def test_bad_values_name_key_value_and_allowed(changes: dict, expected: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        DataConfig(**changes)
    for fragment in expected:
        assert fragment in str(info.value)


def test_home_is_expanded_and_ints_become_floats() -> None:
    config = DataConfig(data_dir="~/datasets", dirichlet_alpha=1, val_fraction=0)
    assert config.data_dir == os.path.join(os.path.expanduser("~"), "datasets")
    assert isinstance(config.dirichlet_alpha, float) and isinstance(config.val_fraction, float)


def test_domain_settings_that_fit_together() -> None:
    config = DataConfig(
        partitioner="domain-mixture", samples_per_client=100, domain_transform="rotation",
        num_domains=6,
    )
    assert config.num_domains == 6


def test_noise_and_domain_client_keys() -> None:
    config = DataConfig.from_run_config(
        {"partitioner": "one-domain-per-client", "domain-clients": " 9, 1", "noise-std": 1,
         "noise-clip": False, "domain-transform": "corruption", "num-domains": 2}
    )
    assert config.domain_client_counts() == (9, 1)
    assert config.noise_std == 1.0 and isinstance(config.noise_std, float) and not config.noise_clip
    assert DataConfig().domain_client_counts() is None  # the default layout: k mod M
    assert config.domain_client_counts(num_domains=2, num_clients=10) == (9, 1)
    with pytest.raises(ConfigError, match=r"'domain-clients'.*summing to the number of clients, 8"):
        config.domain_client_counts(num_clients=8)


def test_noise_default_is_the_transform_default() -> None:
    from flwr_pfl.data.domains import NOISE_STD

    assert DataConfig().noise_std == NOISE_STD and DataConfig().noise_clip


def test_run_config_round_trip_ignores_other_keys() -> None:
    run_config = {
        "dataset": "fashion-mnist",
        "dirichlet-alpha": 0.1,
        "partitioner": "dirichlet",
        "num-server-rounds": 50,  # someone else's key
        "data-dir": "/data",
    }
    config = DataConfig.from_run_config(run_config)
    assert (config.dataset, config.partitioner, config.dirichlet_alpha, config.data_dir) == (
        "fashion-mnist", "dirichlet", 0.1, "/data",
    )
    back = config.to_run_config()
    assert back["dirichlet-alpha"] == 0.1 and "num-server-rounds" not in back
    assert set(back) == {f.name.replace("_", "-") for f in dataclasses.fields(DataConfig)}
    assert DataConfig.from_run_config(back) == config


def test_registered_dataset_becomes_valid() -> None:
    toy_images = dataset_builder("toy-images")  # registered by this folder's conftest
    with pytest.raises(ConfigError):
        DataConfig(dataset="later-dataset")
    register_dataset("later-dataset", toy_images)
    assert DataConfig(dataset="later-dataset").dataset == "later-dataset"
    with pytest.raises(ValueError, match="already registered"):
        register_dataset("later-dataset", toy_images)
