"""Registry entry of pFedMe (T. Dinh, Tran and Nguyen, NeurIPS 2020)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from flwr_pfl.app.registry import AlgorithmSpec, register
from flwr_pfl.clients.pfedme import PFedMeClient
from flwr_pfl.errors import ConfigError
from flwr_pfl.strategies.pfedme import WEIGHTINGS, PFedMe


def _positive(key: str, value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"pfedme.{key} must be a finite number > 0 ({what}), got {value!r}")


@dataclass(frozen=True)
class PFedMeOptions:
    """pFedMe: ``lam`` is Eq. 2's lambda (the pull between the personalized model theta and the
    local model w), ``k`` the inner steps K per mini-batch, ``personal_lr`` their learning rate,
    ``beta`` the server's mixing weight (1: plain averaging), ``weighting`` how the server
    averages the local models (``examples``: by training examples, the authors' code; ``uniform``:
    Alg. 1's formula). The outer learning rate eta is the run's ``learning-rate``.

    Defaults: lambda = 15, K = 5, personal lr 0.01, beta = 1: PFLlib's and FL-bench's defaults,
    and for lambda, K and beta the authors' MNIST command (which uses personal lr 0.1, eta 0.005).
    pFedFDA's comparison uses lambda = 5 (presets/pfedme_cifar10.toml).
    """

    lam: float = 15.0
    k: int = 5
    personal_lr: float = 0.01
    beta: float = 1.0
    weighting: str = "examples"

    def __post_init__(self) -> None:
        _positive("lam", self.lam, "Eq. 2's lambda")
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ConfigError(f"pfedme.k must be an integer >= 1 (inner steps per mini-batch), got {self.k!r}")
        _positive("personal-lr", self.personal_lr, "the inner steps' learning rate")
        _positive("beta", self.beta, "the server's mixing weight; 1 = plain averaging")
        if self.weighting not in WEIGHTINGS:
            raise ConfigError(f"pfedme.weighting={self.weighting!r} is not allowed; choose one of "
                              f"{', '.join(map(repr, WEIGHTINGS))}")


register(
    AlgorithmSpec(
        "pfedme",
        PFedMe,
        PFedMeClient,
        "pFedMe: personalized models theta from the Moreau envelope f(theta) + (lam/2)||theta - w||^2; "
        "the server mixes the average of the local models w by beta",
        options=PFedMeOptions,
        client_kwargs=lambda o: {"lam": o.lam, "k": o.k, "personal_lr": o.personal_lr},
        strategy_kwargs=lambda o: {"beta": o.beta, "weighting": o.weighting},
    )
)
