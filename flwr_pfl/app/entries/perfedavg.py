"""Registry entry of Per-FedAvg (Fallah, Mokhtari and Ozdaglar, NeurIPS 2020)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from flwr_pfl.app.keys import check_choice
from flwr_pfl.app.registry import AlgorithmSpec, register
from flwr_pfl.clients.perfedavg import PerFedAvgClient
from flwr_pfl.core.perfedavg import VARIANTS
from flwr_pfl.errors import ConfigError
from flwr_pfl.strategies.perfedavg import PerFedAvg


@dataclass(frozen=True)
class PerFedAvgOptions:
    """Per-FedAvg: ``alpha`` is the inner (adaptation) step size of Alg. 1, also the step of
    the adaptation before each evaluation; ``variant`` the outer direction of Section 5 (``fo``:
    first order, ``hf``: with the exact Hessian-vector product); ``adapt_steps`` the gradient
    steps of that adaptation (0: evaluate the received model). The outer step beta is the
    suite's ``learning-rate`` (the clients' optimizer takes the outer step). Defaults: alpha =
    0.01 (FL-bench's, whose alpha is its learning rate, 0.01), FO, one step (the paper's
    personalization: one gradient step on local data)."""

    alpha: float = 0.01
    variant: str = "fo"
    adapt_steps: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0 < self.alpha < math.inf:
            raise ConfigError(f"per-fedavg.alpha must be a finite number > 0, got {self.alpha!r}")
        check_choice("per-fedavg.variant", self.variant, VARIANTS)
        if isinstance(self.adapt_steps, bool) or not isinstance(self.adapt_steps, int) or self.adapt_steps < 0:
            raise ConfigError(f"per-fedavg.adapt-steps must be an integer >= 0, got {self.adapt_steps!r}")


register(
    AlgorithmSpec(
        "per-fedavg",
        PerFedAvg,
        PerFedAvgClient,
        "Per-FedAvg: MAML meta steps (FO or HF) averaged as FedAvg; one alpha-step adaptation before evaluation",
        options=PerFedAvgOptions,
        client_kwargs=lambda o: {"alpha": o.alpha, "variant": o.variant, "adapt_steps": o.adapt_steps},
    )
)
