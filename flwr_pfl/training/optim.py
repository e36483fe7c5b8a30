"""Optimizers from config."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from flwr_pfl.errors import ConfigError

OPTIMIZERS = ("sgd", "adam")


@dataclass(frozen=True)
class OptimizerConfig:
    """Local optimizer settings (run-config keys ``optimizer``, ``learning-rate``, ``momentum``,
    ``weight-decay``)."""

    name: str = "sgd"
    learning_rate: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ConfigError(f"optimizer={self.name!r} is unknown; allowed: {', '.join(OPTIMIZERS)}")
        if not self.learning_rate > 0:
            raise ConfigError(f"learning-rate must be > 0, got {self.learning_rate}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0:
            raise ConfigError(f"weight-decay must be >= 0, got {self.weight_decay}")

    def scaled(self, factor: float) -> OptimizerConfig:
        """The same optimizer with the learning rate multiplied by ``factor``."""
        return OptimizerConfig(self.name, self.learning_rate * factor, self.momentum, self.weight_decay)


def make_optimizer(params: Iterable[torch.nn.Parameter], config: OptimizerConfig) -> torch.optim.Optimizer:
    """Build the optimizer ``config`` names over ``params``."""
    params = list(params)
    if config.name == "adam":
        return torch.optim.Adam(params, lr=config.learning_rate, weight_decay=config.weight_decay)
    return torch.optim.SGD(
        params, lr=config.learning_rate, momentum=config.momentum, weight_decay=config.weight_decay
    )
