"""Run-config parsing: defaults, typed values, and errors that name the key and what is allowed."""

from __future__ import annotations

import tomllib

import pytest

from flwr_pfl.app.config import RunConfig, known_keys, parse_experiment
from flwr_pfl.app.registry import ALGORITHMS
from flwr_pfl.errors import ConfigError

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def pyproject_config() -> dict:
    data = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    flat: dict = {}
    for key, value in data["tool"]["flwr"]["app"]["config"].items():
        if isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    return flat


def test_pyproject_lists_every_known_key_and_parses():
    """flwr run only accepts overrides of keys present in pyproject.toml, so all must be there."""
    config = pyproject_config()
    assert set(config) == known_keys()
    experiment = parse_experiment(config)
    assert experiment.run.algorithm == "fedavg"
    assert experiment.data.dataset == "fashion-mnist"


def test_empty_config_uses_defaults():
    experiment = parse_experiment({})
    assert experiment.run == RunConfig()
    assert experiment.train_config.optimizer.learning_rate == RunConfig().learning_rate


def test_noise_free_test_is_a_data_key_recorded_with_the_run():
    experiment = parse_experiment({"dataset": "feddar-synthetic", "noise-free-test": True})
    assert experiment.data.noise_free_test and experiment.to_dict()["noise-free-test"] is True
    assert parse_experiment({}).to_dict()["noise-free-test"] is False


def test_algorithm_options_are_namespaced():
    experiment = parse_experiment({"algorithm": "fedrep", "fedrep.head-epochs": 3})
    assert experiment.options.head_epochs == 3
    assert experiment.to_dict()["fedrep.head-epochs"] == 3


@pytest.mark.parametrize(
    ("raw", "fragments"),
    [
        ({"algorithm": "fedfoo"}, ["algorithm='fedfoo'", "fedavg", "fedrep"]),
        ({"num-server-rounds": 0}, ["num-server-rounds=0", ">= 1"]),
        ({"fraction-fit": 1.5}, ["fraction-fit=1.5", "[0, 1]"]),
        ({"learning-rate": -1.0}, ["learning-rate", "> 0"]),
        ({"model": "vgg"}, ["model='vgg'", "cnn28"]),
        ({"optimizer": "lbfgs"}, ["optimizer='lbfgs'", "closure", "adamw", "sgd"]),
        ({"optimizer": "adamx"}, ["optimizer='adamx'", "did you mean adamax", "rmsprop"]),
        ({"optimizer": "adamw", "optimizer-options": "beta=(0.9, 0.99)"}, ["'beta'", "did you mean betas", "amsgrad"]),
        ({"optimizer": "adamw", "optimizer-options": "betas=(0.9"}, ["optimizer-options='betas=(0.9'", "name=value"]),
        ({"optimizer": "adamw", "optimizer-options": "betas=(1.5, 0.9)"}, ["AdamW", "beta parameter"]),
        ({"optimizer": "adam", "optimizer-options": "lr=0.1"}, ["'lr'", "learning-rate"]),
        ({"lr-scheduler": "steplr"}, ["StepLR", "step_size"]),
        ({"lr-scheduler": "stepl", "lr-scheduler-options": "step_size=2"}, ["lr-scheduler='stepl'", "did you mean steplr"]),
        ({"lr-scheduler": "reducelronplateau"}, ["ReduceLROnPlateau", "metric"]),
        ({"lr-scheduler-options": "gamma=0.5"}, ["lr-scheduler-options", "no lr-scheduler"]),
        ({"local-epochs": 1.5}, ["local-epochs=1.5", "integer"]),
        ({"device": 3}, ["device=3", "string"]),
        ({"lerning-rate": 0.1}, ["lerning-rate", "learning-rate"]),
        ({"fedrep.head-epochs": -2}, ["fedrep.head-epochs", ">= 0"]),
        ({"dataset": "imagenet"}, ["imagenet", "fashion-mnist"]),
        ({"partitioner": "zipf"}, ["zipf", "dirichlet"]),
        ({"noise-free-test": True}, ["'noise-free-test'", "dataset 'mnist'", "'feddar-synthetic'"]),
        ({"dataset": "feddar-synthetic", "noise-free-test": "true"}, ["noise-free-test='true'", "boolean"]),
        ({"eval-every": -1}, ["eval-every=-1", ">= 0"]),
        ({"algorithm": "pfedfda", "eval-every": 5, "pfedfda.eval-every": 10},
         ["eval-every=5", "pfedfda.eval-every=10", "set one of them"]),
        ({"train-fraction": 0.0}, ["'train-fraction'", "(0, 1]"]),
    ],
)
def test_bad_values_name_the_key_and_what_is_allowed(raw, fragments):
    with pytest.raises(ConfigError) as err:
        parse_experiment(raw)
    for fragment in fragments:
        assert fragment in str(err.value)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"algorithm": "finetune", "eval-every": 5}, 5),
        ({"algorithm": "fedora", "fedora.eval-every": 10}, 10),
        ({"algorithm": "fedora", "eval-every": 10}, 10),
        ({"algorithm": "fedora", "eval-every": 0}, 0),
        ({"algorithm": "pfedfda", "eval-every": 0}, 0),
        ({"algorithm": "pfedfda", "eval-every": 4, "pfedfda.eval-every": 4}, 4),
        ({"algorithm": "fedrep", "pfedfda.eval-every": 7}, 1),  # another algorithm's key
    ],
)
def test_eval_every_reaches_the_strategy(raw, expected):
    """``eval-every`` sets every algorithm's schedule; FEDORA's and pFedFDA's own keys set theirs."""
    from flwr_pfl.app.server_app import build_strategy

    experiment = parse_experiment({"num-clients": 4, "num-server-rounds": 20, **raw})
    assert experiment.eval_every == expected
    assert build_strategy(experiment).eval_every == expected


def test_output_path_is_absolute_and_named(tmp_path):
    experiment = parse_experiment({"output-dir": "~/somewhere", "run-name": "r1"})
    path = experiment.output_path()
    assert path.is_absolute() and path.name == "r1" and "~" not in str(path)


def test_every_registered_algorithm_has_a_summary():
    for name, spec in ALGORITHMS.items():
        assert spec.name == name and spec.summary


def test_optimizer_and_scheduler_keys_reach_the_train_config():
    """Any torch optimizer by name with its options, and a scheduler with its options, from the
    flat run-config strings; absent keys keep the plain optimizer."""
    experiment = parse_experiment({
        "optimizer": "AdamW", "learning-rate": 0.003, "weight-decay": 0.02,
        "optimizer-options": "betas=(0.8, 0.95), amsgrad=true, eps=1e-6",
        "lr-scheduler": "StepLR", "lr-scheduler-options": "step_size=3, gamma=0.25",
    })
    opt = experiment.train_config.optimizer
    assert (opt.name, opt.learning_rate, opt.weight_decay) == ("adamw", 0.003, 0.02)
    assert dict(opt.options) == {"betas": (0.8, 0.95), "amsgrad": True, "eps": 1e-6}
    assert opt.scheduler == "steplr" and dict(opt.scheduler_options) == {"step_size": 3, "gamma": 0.25}
    plain = parse_experiment({}).train_config.optimizer
    assert (plain.name, plain.options, plain.scheduler, plain.scheduler_options) == ("sgd", (), "", ())
