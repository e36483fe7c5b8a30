"""Flower's FedAvg hooks on the suite's strategies: checks, per-round configs, seeds.

:class:`~flwr_pfl.strategies.base.PFLStrategy` takes FedAvg's constructor arguments with
Flower's meaning; this module holds the checks they need, so that the base class only wires
them in. A hook is checked whenever it is set, in the constructor or later as an attribute
(Flower users do both), and an attribute that looks like a hook but is none of them is refused
rather than silently ignored.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.common import log

from flwr_pfl.errors import ConfigError
from flwr_pfl.messages import CLIENT_CONFIG_KEYS
from flwr_pfl.strategies.validation import Scalar

#: FedAvg's hooks, with what Flower calls them with
FLOWER_HOOKS = {
    "evaluate_fn": "(server_round, arrays, config) -> (loss, metrics) | None",
    "on_fit_config_fn": "(server_round) -> config dict",
    "on_evaluate_config_fn": "(server_round) -> config dict",
    "fit_metrics_aggregation_fn": "([(num_examples, metrics), ...]) -> metrics dict",
    "evaluate_metrics_aggregation_fn": "([(num_examples, metrics), ...]) -> metrics dict",
}
#: the suite's own hook (results writers)
SUITE_HOOKS = {"on_round": "(round, phase, metrics, per-client metrics) -> None"}
HOOKS = FLOWER_HOOKS | SUITE_HOOKS
SCALAR_TYPES = (bool, bytes, float, int, str)


def looks_like_hook(name: str) -> bool:
    """Whether an attribute name reads as a hook (``on_*`` or ``*_fn``)."""
    return name.startswith("on_") or name.endswith("_fn")


def unknown_hook(owner: str, name: str) -> AttributeError:
    """The error for setting ``name``, which looks like a hook but is none of ``HOOKS``."""
    close = difflib.get_close_matches(name, list(HOOKS), n=2)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    return AttributeError(
        f"{owner} has no hook {name!r}{hint}; setting it would be silently ignored. Hooks: "
        + "; ".join(f"{k}{v}" for k, v in HOOKS.items())
    )


def check_hook(owner: str, name: str, value: Any, refused: Mapping[str, str]) -> None:
    """Refuse a hook that is not callable (None unsets it) or that ``owner`` cannot honour."""
    if value is None:
        return
    if name in refused:
        raise ConfigError(f"{owner} cannot take {name}: {refused[name]}")
    if not callable(value):
        raise TypeError(f"{owner}.{name} must be a callable {HOOKS[name]} or None, got {type(value).__name__}")


def round_config(owner: str, hook: str, fn: Callable[[int], Any], server_round: int) -> dict[str, Scalar]:
    """``fn(server_round)``, checked to be a dict of Flower scalars (the message names the hook,
    the round and the offending key)."""
    config = fn(server_round)
    if not isinstance(config, Mapping):
        raise TypeError(f"{owner}.{hook}({server_round}) returned {type(config).__name__}; it must return a dict")
    for key, value in config.items():
        if not isinstance(key, str) or not isinstance(value, SCALAR_TYPES):
            raise TypeError(
                f"{owner}.{hook}({server_round}) returned {key!r}: {value!r}; keys must be strings and values "
                "Flower scalars (bool, bytes, float, int, str)"
            )
    return dict(config)


#: config keys that Flower's DP wrappers send for its client-side mods (``fixedclipping_mod``,
#: ``adaptiveclipping_mod``), which read them before the client does
FLOWER_MOD_KEYS = ("clipping_norm",)


def report_unread_keys(owner: str, source: str, user: Mapping[str, Scalar], reported: set[str]) -> None:
    """Log once, at INFO, the keys of the user's config that the suite's clients do not read.

    Flower's examples send settings such as ``local_epochs`` or ``batch_size`` in the train
    config; the suite's clients take those from their own options and read only
    :data:`~flwr_pfl.messages.CLIENT_CONFIG_KEYS` from it (and Flower's mods :data:`FLOWER_MOD_KEYS`),
    so the other keys reach the clients and change nothing (a client class of the user's own may still read them). ``reported``
    holds the keys already named, so each key is named once per strategy.
    """
    unread = sorted(set(user) - set(CLIENT_CONFIG_KEYS) - set(FLOWER_MOD_KEYS) - reported)
    if unread:
        reported.update(unread)
        log(INFO, "%s: %s sends %s to the clients; flwr_pfl's clients read only %s from it (set the rest through "
            "the clients' options, e.g. the run config's local-epochs and batch-size)", owner, source, unread,
            list(CLIENT_CONFIG_KEYS))


def merge_config(owner: str, source: str, user: Mapping[str, Scalar], protocol: Mapping[str, Scalar]) -> dict[str, Scalar]:
    """The user's keys followed by the algorithm's; a user key the algorithm sets itself is refused
    (it would be overwritten, or would break the algorithm's protocol)."""
    clash = sorted(set(user) & set(protocol))
    if clash:
        raise ConfigError(
            f"{source} set {clash}, which {owner} sets itself in its instructions; use other names "
            f"(the keys {owner} sets here: {sorted(protocol)})"
        )
    return {**user, **protocol}


def aggregated_metrics(owner: str, hook: str, fn: Callable[[list[tuple[int, dict]]], Any], pairs: list[tuple[int, dict]]) -> dict[str, Scalar]:
    """``fn(pairs)`` (Flower's ``[(num_examples, metrics), ...]``), checked to be a dict."""
    result = fn(pairs)
    if not isinstance(result, Mapping):
        raise TypeError(f"{owner}.{hook} returned {type(result).__name__}; it must return a dict of metrics")
    return dict(result)


def server_evaluation(owner: str, result: Any) -> tuple[float, dict[str, Scalar]] | None:
    """``evaluate_fn``'s answer as (loss, metrics), or None; anything else is refused."""
    if result is None:
        return None
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], Mapping)):
        raise TypeError(f"{owner}.evaluate_fn returned {result!r}; it must return (loss, metrics dict) or None")
    loss, metrics = result
    if isinstance(loss, bool) or not isinstance(loss, (int, float, np.floating, np.integer)):
        raise TypeError(f"{owner}.evaluate_fn returned loss {loss!r}; it must be a number")
    return float(loss), dict(metrics)


def resolve_seed(seed: int | None) -> int:
    """``seed`` as an int; None draws one from the operating system's entropy and says so.

    An unseeded run cannot be repeated unless its seed is known, so the drawn seed is logged
    (a WARNING) with how to repeat the run.
    """
    if seed is None:
        drawn = int(np.random.SeedSequence().entropy % 2**63)
        log(WARNING, "seed=None: this run is unseeded; client sampling (and every seeded server draw) uses the "
            "freshly drawn seed=%d; pass seed=%d to repeat it", drawn, drawn)
        return drawn
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an int (or None for an unseeded run, with a warning), got {seed!r}")
    return int(seed)


#: the suffix of the example-weighted mean of a metric the clients report
WEIGHTED_MEAN = "_wmean"


def check_metric_names(owner: str, names: Any) -> dict[str, str]:
    """``metric_names`` checked: a mapping of the clients' metric names to the user's."""
    if names is None:
        return {}
    if not isinstance(names, Mapping) or not all(isinstance(k, str) and isinstance(v, str) and v for k, v in names.items()):
        raise ConfigError(f"{owner}: metric_names must map the clients' metric names to yours as strings (e.g. "
                          f"{{'accuracy': 'eval_acc', 'loss': 'eval_loss'}}), got {names!r}")
    return dict(names)


def flower_named(metrics: Mapping[str, Any], names: Mapping[str, str]) -> dict[str, Any]:
    """The aggregated ``metrics`` as Flower's FedAvg names them, added to the suite's: each metric
    ``k`` the clients report, as its example-weighted mean (``k_wmean``) under ``k`` itself, and
    under the user's name where ``names`` gives one (``{"accuracy": "eval_acc"}``). The suite's
    own summaries (``k_wmean``, ``k_min``, ...) stay."""
    out = dict(metrics)
    for key, value in metrics.items():
        if key.endswith(WEIGHTED_MEAN) and key[: -len(WEIGHTED_MEAN)] not in metrics:
            out[key[: -len(WEIGHTED_MEAN)]] = value
    for ours, theirs in names.items():
        if ours in out:
            out[theirs] = out[ours]
    return out
