"""Registry entry of FedPAC (Xu, Tong and Huang, ICLR 2023): body averaged and aligned to global
class prototypes, personal heads combined per client by a QP."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from flwr_pfl.app.registry import AlgorithmSpec, register
from flwr_pfl.clients.fedpac import FedPACClient, check_options
from flwr_pfl.strategies.fedpac import FedPAC


@dataclass(frozen=True)
class FedPACOptions:
    """FedPAC: ``lam`` weighs the feature-alignment loss (Eq. 7; the paper and pFedFDA's
    comparison use 1.0); ``head_epochs`` epochs of head-only training at ``head_learning_rate``
    precede the body's local epochs (the authors' code: 1 epoch at 0.1)."""

    lam: float = 1.0
    head_epochs: int = 1
    head_learning_rate: float = 0.1

    def __post_init__(self) -> None:
        check_options(self.lam, self.head_epochs, self.head_learning_rate, lambda option: f"fedpac.{option}")


register(
    AlgorithmSpec(
        "fedpac",
        FedPAC,
        FedPACClient,
        "FedPAC: body aligned to global prototypes (FedAvg), personal heads combined per client by a QP",
        options=FedPACOptions,
        client_kwargs=asdict,
    )
)
