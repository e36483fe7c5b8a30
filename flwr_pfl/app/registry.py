"""The one registry of algorithms: name -> strategy, client, options (DESIGN principle 4).

Adding an algorithm touches its core, strategy and client modules, one ``register`` call here,
its tests and its preset. Its options are a frozen dataclass whose fields are read from the
run-config keys ``<name>.<field-name>`` (kebab-case), e.g. ``fedrep.head-epochs``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from flwr_pfl.clients import FedAvgClient, FedPerClient, FedRepClient, FinetuneClient, LocalClient
from flwr_pfl.clients.base import PFLClient
from flwr_pfl.errors import ConfigError
from flwr_pfl.strategies import FedAvg, FedPer, FedRep, Finetune, Local
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
    """

    name: str
    strategy: type[PFLStrategy]
    client: type[PFLClient]
    summary: str
    options: type = NoOptions
    client_kwargs: Callable[[Any], dict[str, Any]] = field(default=lambda options: {})
    strategy_kwargs: Callable[[Any], dict[str, Any]] = field(default=lambda options: {})
    num_heads: Callable[[Any, int], int] = field(default=lambda options, num_domains: 1)


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
        raise ConfigError(f"algorithm={name!r} is unknown; allowed: {', '.join(sorted(ALGORITHMS))}") from None


# ------------------------------------------------------------------------- baselines
@dataclass(frozen=True)
class FedRepOptions:
    """FedRep: ``head_epochs`` epochs on the personal head before the body's local epochs
    (Collins et al. use 10 head epochs and 1 body epoch for CIFAR; 5 is the suite's default)."""

    head_epochs: int = 5

    def __post_init__(self) -> None:
        if self.head_epochs < 0:
            raise ConfigError(f"fedrep.head-epochs must be >= 0, got {self.head_epochs}")


@dataclass(frozen=True)
class FinetuneOptions:
    """FedAvg + fine-tuning: ``epochs`` of local fine-tuning before each evaluation."""

    epochs: int = 1

    def __post_init__(self) -> None:
        if self.epochs < 0:
            raise ConfigError(f"finetune.epochs must be >= 0, got {self.epochs}")


register(AlgorithmSpec("fedavg", FedAvg, FedAvgClient, "FedAvg: one global model"))
register(AlgorithmSpec("local", Local, LocalClient, "Local: each client alone, no communication"))
register(
    AlgorithmSpec(
        "finetune",
        Finetune,
        FinetuneClient,
        "FedAvg + local fine-tuning before evaluation",
        options=FinetuneOptions,
        client_kwargs=lambda o: {"finetune_epochs": o.epochs},
    )
)
register(
    AlgorithmSpec(
        "fedrep",
        FedRep,
        FedRepClient,
        "FedRep: shared body, personal head trained first",
        options=FedRepOptions,
        client_kwargs=asdict,
    )
)
register(AlgorithmSpec("fedper", FedPer, FedPerClient, "FedPer: shared body, personal head trained jointly"))
