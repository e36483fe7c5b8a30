"""Registry entry of APFL (Deng, Kamani and Mahdavi, "Adaptive Personalized Federated Learning", 2020)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from flwr_pfl.app.registry import AlgorithmSpec, register
from flwr_pfl.clients.apfl import APFLClient
from flwr_pfl.errors import ConfigError
from flwr_pfl.strategies.apfl import APFL


@dataclass(frozen=True)
class APFLOptions:
    """APFL: ``alpha`` is the mixing weight of the personalized model alpha v + (1 - alpha) w
    (fixed, or the start of each client's learned alpha), ``learn_alpha`` turns on the paper's
    adaptive alpha (a projected gradient step on alpha at every local step), ``alpha_lr`` is that
    step's size (0: the round's learning rate, the single eta_t of Alg. 1).

    Defaults: alpha = 0.5 learned (the paper's adaptive APFL; 0.5 is FedGP's mixing value and the
    middle of pFedFDA's grid {0.25, 0.5, 0.75, 1}), alpha's step = the learning rate.
    """

    alpha: float = 0.5
    learn_alpha: bool = True
    alpha_lr: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0 <= self.alpha <= 1:
            raise ConfigError(f"apfl.alpha must be a number in [0, 1], got {self.alpha!r}")
        if not isinstance(self.learn_alpha, bool):
            raise ConfigError(f"apfl.learn-alpha must be true or false, got {self.learn_alpha!r}")
        if isinstance(self.alpha_lr, bool) or not isinstance(self.alpha_lr, (int, float)) or not (
            self.alpha_lr >= 0 and math.isfinite(self.alpha_lr)
        ):
            raise ConfigError(
                f"apfl.alpha-lr must be a finite number >= 0 (0: the learning rate), got {self.alpha_lr!r}"
            )


register(
    AlgorithmSpec(
        "apfl",
        APFL,
        APFLClient,
        "APFL: FedAvg's global model plus a personal model v mixed as alpha v + (1 - alpha) w, alpha learned or fixed",
        options=APFLOptions,
        client_kwargs=lambda o: {"alpha": o.alpha, "learn_alpha": o.learn_alpha, "alpha_lr": o.alpha_lr},
    )
)
