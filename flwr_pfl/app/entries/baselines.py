"""Registry entries of the baselines: FedAvg, Local, FedAvg + fine-tuning, FedRep, FedPer, FedProx,
FedProx + fine-tuning, FedBN, LG-FedAvg, FedBABU."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from flwr_pfl.app.registry import AlgorithmSpec, register
from flwr_pfl.clients import (
    FedAvgClient,
    FedBABUClient,
    FedBNClient,
    FedPerClient,
    FedProxClient,
    FedProxFinetuneClient,
    FedRepClient,
    FinetuneClient,
    LGFedAvgClient,
    LocalClient,
)
from flwr_pfl.errors import ConfigError
from flwr_pfl.strategies import (
    FedAvg,
    FedBABU,
    FedBN,
    FedPer,
    FedProx,
    FedProxFinetune,
    FedRep,
    Finetune,
    LGFedAvg,
    Local,
)


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


@dataclass(frozen=True)
class FedProxOptions:
    """FedProx: ``mu`` is the proximal coefficient of Eq. 2 (Li et al.); 0 is FedAvg. The suite's
    default is 0.01; FedDAR's experiments use 0.1, FMTL's paper leaves mu unstated and its preset
    takes FedRep's code default, 0.1 (presets/fedprox_*.toml)."""

    mu: float = 0.01

    def __post_init__(self) -> None:
        if not self.mu >= 0:
            raise ConfigError(f"fedprox.mu must be >= 0, got {self.mu}")


@dataclass(frozen=True)
class FedProxFinetuneOptions:
    """FedProx + fine-tuning: ``mu`` as FedProx's, ``epochs`` of local fine-tuning before each
    evaluation (FedDAR's experiments fine-tune for 1 epoch)."""

    mu: float = 0.01
    epochs: int = 1

    def __post_init__(self) -> None:
        if not self.mu >= 0:
            raise ConfigError(f"fedprox-ft.mu must be >= 0, got {self.mu}")
        if self.epochs < 0:
            raise ConfigError(f"fedprox-ft.epochs must be >= 0, got {self.epochs}")


@dataclass(frozen=True)
class FedBABUOptions:
    """FedBABU: ``finetune_epochs`` of whole-model fine-tuning before each evaluation (5, as
    pFedFDA's comparison fine-tunes FedBABU)."""

    finetune_epochs: int = 5

    def __post_init__(self) -> None:
        if self.finetune_epochs < 0:
            raise ConfigError(f"fedbabu.finetune-epochs must be >= 0, got {self.finetune_epochs}")


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
register(
    AlgorithmSpec(
        "fedprox",
        FedProx,
        FedProxClient,
        "FedProx: FedAvg with the proximal term (mu/2)||w - w^t||^2 in the local objective",
        options=FedProxOptions,
        client_kwargs=asdict,
    )
)
register(
    AlgorithmSpec(
        "fedprox-ft",
        FedProxFinetune,
        FedProxFinetuneClient,
        "FedProx + local fine-tuning before evaluation",
        options=FedProxFinetuneOptions,
        client_kwargs=lambda o: {"mu": o.mu, "finetune_epochs": o.epochs},
    )
)
register(
    AlgorithmSpec(
        "fedbn",
        FedBN,
        FedBNClient,
        "FedBN: normalisation layers local, the rest averaged as FedAvg",
    )
)
register(
    AlgorithmSpec(
        "lg-fedavg",
        LGFedAvg,
        LGFedAvgClient,
        "LG-FedAvg: personal body (local representation), shared head",
    )
)
register(
    AlgorithmSpec(
        "fedbabu",
        FedBABU,
        FedBABUClient,
        "FedBABU: body trained with the head frozen at its initialisation; fine-tune all before evaluation",
        options=FedBABUOptions,
        client_kwargs=asdict,
    )
)
