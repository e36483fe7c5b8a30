"""Registry entries of the baselines: FedAvg, Local, FedAvg + fine-tuning, FedRep, FedPer."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from flwr_pfl.app.registry import AlgorithmSpec, register
from flwr_pfl.clients import FedAvgClient, FedPerClient, FedRepClient, FinetuneClient, LocalClient
from flwr_pfl.errors import ConfigError
from flwr_pfl.strategies import FedAvg, FedPer, FedRep, Finetune, Local

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
