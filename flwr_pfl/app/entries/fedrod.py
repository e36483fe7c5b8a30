"""Registry entry of FedRoD (Chen and Chao, ICLR 2022): shared body and generic head trained with
the balanced softmax, personal head on top of the generic one kept on each client."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from flwr_pfl.app.registry import AlgorithmSpec, register
from flwr_pfl.clients.fedrod import GENERIC_LOSSES, FedRoDClient
from flwr_pfl.errors import ConfigError
from flwr_pfl.strategies.fedrod import FedRoD


@dataclass(frozen=True)
class FedRoDOptions:
    """FedRoD: ``generic_loss`` trains the body and the generic head: ``"balanced-softmax"``
    (FedRoD's balanced risk, cross-entropy on g(z) + log n_c; the default) or ``"cross-entropy"``
    (FedAvg's loss: an ablation of the balanced loss). The personal head always trains with
    cross-entropy on g(z) + p(z)."""

    generic_loss: str = "balanced-softmax"

    def __post_init__(self) -> None:
        if self.generic_loss not in GENERIC_LOSSES:
            allowed = ", ".join(repr(v) for v in GENERIC_LOSSES)
            raise ConfigError(f"fedrod.generic-loss must be one of {allowed}; got {self.generic_loss!r}")


register(
    AlgorithmSpec(
        "fedrod",
        FedRoD,
        FedRoDClient,
        "FedRoD: shared body + generic head (balanced softmax), personal head on top kept local",
        options=FedRoDOptions,
        client_kwargs=asdict,
    )
)
