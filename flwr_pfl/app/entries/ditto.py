"""Registry entry of Ditto (Li, Hu, Beirami and Smith, ICML 2021)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from flwr_pfl.app.registry import AlgorithmSpec, register
from flwr_pfl.clients.ditto import DittoClient
from flwr_pfl.errors import ConfigError
from flwr_pfl.strategies.ditto import Ditto


@dataclass(frozen=True)
class DittoOptions:
    """Ditto: ``lam`` is Eq. 2's lambda (the pull of the personal model towards the received
    global model; 0 is local training of the personal model), ``personal_epochs`` the epochs of
    personal training per round. Defaults: lambda = 1 (pFedFDA's tuned value over
    {0.05, 0.1, 0.5, 1, 2}, and FedGP's), 1 personal epoch (PFLlib's and FL-bench's default;
    pFedFDA uses 5, presets/ditto_cifar10.toml)."""

    lam: float = 1.0
    personal_epochs: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.lam, bool) or not isinstance(self.lam, (int, float)) or not (
            self.lam >= 0 and math.isfinite(self.lam)
        ):
            raise ConfigError(f"ditto.lam must be a finite number >= 0, got {self.lam!r}")
        if isinstance(self.personal_epochs, bool) or not isinstance(self.personal_epochs, int) or self.personal_epochs < 1:
            raise ConfigError(f"ditto.personal-epochs must be an integer >= 1, got {self.personal_epochs!r}")


register(
    AlgorithmSpec(
        "ditto",
        Ditto,
        DittoClient,
        "Ditto: FedAvg's global model plus a personal model trained on F_k(v) + (lam/2)||v - w^t||^2",
        options=DittoOptions,
        client_kwargs=lambda o: {"lam": o.lam, "personal_epochs": o.personal_epochs},
    )
)
