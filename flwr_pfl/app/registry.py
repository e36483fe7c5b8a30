"""The one registry of algorithms: name -> strategy, client, options (DESIGN principle 4).

Adding an algorithm touches its core, strategy and client modules, one entry module in
``flwr_pfl/app/entries/`` (its ``register`` call and options dataclass, listed in
``ENTRY_MODULES`` below), its tests and its preset. Its options are a frozen dataclass whose
fields are read from the run-config keys ``<name>.<field-name>`` (kebab-case), e.g.
``fedrep.head-epochs``; every such key must also appear in pyproject.toml's
``[tool.flwr.app.config]`` so that ``flwr run`` accepts overrides of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import importlib

from flwr_pfl.app.keys import with_suggestions
from flwr_pfl.clients.base import PFLClient
from flwr_pfl.errors import ConfigError
from flwr_pfl.strategies.base import PFLStrategy


@dataclass(frozen=True)
class NoOptions:
    """For algorithms without options of their own."""


@dataclass(frozen=True)
class AlgorithmSpec:
    """How the app builds one algorithm.

    Attributes:
        name: the ``algorithm`` run-config value.
        strategy: the Strategy class (built with the common federation settings plus
            ``strategy_kwargs(options)``).
        client: the NumPyClient class (built with context, model, data, train config plus
            ``client_kwargs(options)``).
        options: dataclass of the algorithm's own options (keys ``<name>.<field>``).
        summary: one line for listings and errors.
        num_heads: heads the model needs, from (options, number of domains); default 1.
        options_prefix: the run-config section of ``options`` (keys ``<options_prefix>.<field>``);
            empty means ``name``. Variants of one algorithm registered under several names
            (e.g. ``feddar-sa`` and ``feddar-wa``) share one section this way.
    """

    name: str
    strategy: type[PFLStrategy]
    client: type[PFLClient]
    summary: str
    options: type = NoOptions
    client_kwargs: Callable[[Any], dict[str, Any]] = field(default=lambda options: {})
    strategy_kwargs: Callable[[Any], dict[str, Any]] = field(default=lambda options: {})
    num_heads: Callable[[Any, int], int] = field(default=lambda options, num_domains: 1)
    options_prefix: str = ""

    @property
    def section(self) -> str:
        """The run-config key prefix of this algorithm's options, with its trailing dot."""
        return f"{self.options_prefix or self.name}."


ALGORITHMS: dict[str, AlgorithmSpec] = {}


def register(spec: AlgorithmSpec) -> AlgorithmSpec:
    """Add ``spec`` to the registry (a name may be registered once)."""
    if spec.name in ALGORITHMS:
        raise ValueError(f"algorithm {spec.name!r} is already registered")
    ALGORITHMS[spec.name] = spec
    return spec


def get_algorithm(name: str) -> AlgorithmSpec:
    """The spec registered as ``name``; ConfigError listing the names otherwise."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ConfigError(
            f"algorithm={with_suggestions([name], ALGORITHMS)} is unknown; allowed: {', '.join(sorted(ALGORITHMS))}"
        ) from None


#: modules under flwr_pfl.app.entries that register algorithms when imported
ENTRY_MODULES = ("baselines", "pfedfda", "fmtl", "fedgp", "feddar", "fedora", "ditto", "apfl", "perfedavg", "pfedme", "fedrod", "fedpac", "ifca", "knnper", "fedamp", "pfedhn", "fedfomo")

for _module in ENTRY_MODULES:
    importlib.import_module(f"flwr_pfl.app.entries.{_module}")
