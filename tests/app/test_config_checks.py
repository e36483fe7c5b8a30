"""Every check of the run config, at its boundary and with its whole message: the value just
inside is accepted, the value just outside refused, and the message names the key, the value
and what is allowed (so that a user who typed it knows what to change)."""

from __future__ import annotations

import importlib.util
import re

import pytest

from flwr_pfl.app.config import MODEL_NAMES, RUNNING_STAT_MODELS, check_run_name, parse_experiment
from flwr_pfl.errors import ConfigError


def refused(overrides: dict, message: str) -> None:
    """``overrides`` stop the parse with exactly ``message`` (the whole text)."""
    with pytest.raises(ConfigError) as err:
        parse_experiment(overrides)
    assert str(err.value) == message


INTEGER_KEYS = [("num-server-rounds", 1), ("num-clients", 0), ("local-epochs", 0), ("batch-size", 1), ("feature-dim", 0),
                ("num-threads", 0), ("checkpoint-interval", 1), ("server-workers", 0), ("eval-every", 0)]


@pytest.mark.parametrize(("key", "low"), INTEGER_KEYS)
def test_each_integer_key_takes_its_lower_bound_and_refuses_one_below(key, low):
    assert parse_experiment({key: low}) is not None
    refused({key: low - 1}, f"{key}={low - 1} is out of range; must be >= {low}")


@pytest.mark.parametrize("key", ["fraction-fit", "fraction-evaluate"])
def test_fractions_take_0_and_1_and_refuse_outside(key):
    parse_experiment({key: 0.0})
    parse_experiment({key: 1.0})
    refused({key: -0.01}, f"{key}=-0.01 is out of range; must be in [0, 1]")
    refused({key: 1.01}, f"{key}=1.01 is out of range; must be in [0, 1]")


def test_a_fraction_that_samples_nobody_is_refused_where_the_federation_is_known():
    refused({"fraction-fit": 0.05, "num-clients": 10}, "fraction-fit=0.05 samples no client out of num-clients=10")
    parse_experiment({"fraction-fit": 0.1, "num-clients": 10})
    parse_experiment({"fraction-fit": 0.05})  # num-clients = 0: checked once the federation's size is known
    parse_experiment({"fraction-fit": 0.0, "num-clients": 10})  # no training asked for: nothing to sample


def test_the_unknown_model_message_lists_every_model():
    refused({"model": "vgg"}, f"model='vgg' is unknown; allowed: {', '.join(MODEL_NAMES)}")


def test_timeouts():
    refused({"wait-timeout": 0.0}, "wait-timeout=0.0 must be > 0 seconds")
    parse_experiment({"wait-timeout": 0.5})
    refused({"round-timeout": -1.0}, "round-timeout=-1.0 must be >= 0 seconds (0 = no limit)")
    parse_experiment({"round-timeout": 0.0})


def test_min_clients_is_bounded_by_the_federation():
    message = ("min-clients={} is out of range; must be in [0, num-clients={}] (0 = num-clients: wait for the whole "
               "federation)")
    refused({"min-clients": -1}, message.format(-1, 0))
    refused({"min-clients": 4, "num-clients": 3}, message.format(4, 3))
    parse_experiment({"min-clients": 3, "num-clients": 3})
    parse_experiment({"min-clients": 7})  # num-clients = 0: checked once the federation's size is known


def test_output_dir_resume_and_the_reply_bounds():
    refused({"output-dir": ""}, "output-dir must not be empty")
    refused({"resume": True}, "resume=true needs run-name: the name of the run to continue under output-dir")
    refused({"clip-update-norm": -1.0}, "clip-update-norm=-1.0 must be > 0, or 0 (off)")
    refused({"max-examples": -1}, "max-examples=-1 must be >= 1, or 0 (off)")
    for ok in (0.0, 0.49):
        parse_experiment({"trim-fraction": ok})
    for bad in (-0.1, 0.5, 1.2):
        refused({"trim-fraction": bad}, f"trim-fraction={bad} is out of range; must be in [0, 0.5)")
    for ok in (0.0, 1.5):
        parse_experiment({"outlier-norm-ratio": ok})
    for bad in (0.5, 1.0):
        refused({"outlier-norm-ratio": bad}, f"outlier-norm-ratio={bad} is out of range; must be > 1, or 0 (off)")


@pytest.mark.parametrize(("key", "allowed"), [("api", "'numpyclient', 'message'"), ("frozen-norm", "'eval', 'train'"),
                                              ("aggregate", "'mean', 'trimmed-mean'")])
def test_each_choice_names_its_key_and_the_choices(key, allowed):
    refused({key: "other"}, f"{key}='other' is not allowed; choose one of {allowed}")


def test_a_bad_scheduler_option_names_its_key():
    with pytest.raises(ConfigError, match=r"^lr-scheduler-options='gamma': every option needs a name"):
        parse_experiment({"lr-scheduler": "StepLR", "lr-scheduler-options": "gamma"})


def test_tracking_is_checked_for_its_names_only_the_server_checks_the_packages(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    assert parse_experiment({"tracking": "mlflow"}).run.tracking == "mlflow"  # a SuperNode parses it without MLflow


@pytest.mark.parametrize("name", [".", "..", "a/b", "a\\b", "nul\0l", "/abs"])
def test_a_run_name_is_one_plain_directory_name(name):
    with pytest.raises(ConfigError) as err:
        check_run_name(name)
    assert str(err.value) == (f"run-name={name!r} must be a plain directory name inside output-dir (no path separators, "
                              "not '.' or '..', not absolute); to write elsewhere, set output-dir")
    check_run_name("run-1.final")
    check_run_name("")


def test_the_default_run_name_is_algorithm_dataset_and_a_timestamp():
    experiment = parse_experiment({"algorithm": "fedrep", "dataset": "mnist"})
    assert re.fullmatch(r"fedrep-mnist-\d{8}-\d{6}", experiment.output_path().name)


def test_with_num_clients_sets_the_federations_size_and_keeps_the_rest():
    experiment = parse_experiment({"fraction-fit": 0.5, "seed": 7})
    sized = experiment.with_num_clients(6)
    assert sized.run.num_clients == 6 and sized.run.fraction_fit == 0.5 and sized.run.seed == 7


def test_the_unknown_key_message_lists_the_known_keys_in_order():
    with pytest.raises(ConfigError) as err:
        parse_experiment({"num-clinets": 3})
    text = str(err.value)
    assert text.startswith("unknown run-config key(s): 'num-clinets' (did you mean num-clients")
    known = text.split("Known keys: ", 1)[1].split(", ")
    assert known == sorted(known) and "num-clients" in known and "algorithm" in known


def test_two_evaluation_schedules_that_disagree_are_refused():
    refused({"algorithm": "fedora", "eval-every": 2, "fedora.eval-every": 3},
            "eval-every=2 and fedora.eval-every=3 disagree: they set the same evaluation schedule; set one of them")


def test_record_dp_with_a_batchnorm_model_lists_the_models_it_can_train():
    refused({"model": "resnet18", "dp-record-noise-multiplier": 1.0},
            "model='resnet18' has BatchNorm, which record-level DP (DP-SGD) cannot train: a record's output depends on "
            "its batch and the running statistics would leave unnoised; use one of "
            + ", ".join(m for m in MODEL_NAMES if m not in RUNNING_STAT_MODELS))


def test_dp_keys_without_noise_are_named_all_and_the_fix_is_given():
    refused({"dp-clip-norm": 2.0, "dp-delta": 1e-6},
            "dp-clip-norm=2.0, dp-delta=1e-06 set with dp-noise-multiplier=0: without noise there is no differential "
            "privacy; set dp-noise-multiplier > 0 (e.g. 1.0), or drop those keys")
    refused({"dp-record-clip-norm": 2.0},
            "dp-record-clip-norm=2.0 set with dp-record-noise-multiplier=0: without noise there is no differential "
            "privacy; set dp-record-noise-multiplier > 0 (e.g. 1.0), or drop those keys")
    refused({"dp-noise-seed": 3}, "dp-noise-seed=3 set without differential privacy: set dp-noise-multiplier or "
            "dp-record-noise-multiplier > 0, or drop it")
