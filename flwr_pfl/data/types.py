"""In-memory datasets as tensors: every sample is a triple (input, target, domain label).

Algorithms that know nothing of domains see domain 0 everywhere; domain-aware algorithms (FedDAR,
FedGP, FEDORA's rotated clients) read the third element. Keeping whole splits as tensors makes
loading a client's data in a fresh simulation actor cheap and lets training run on any device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch.utils.data import DataLoader, TensorDataset

from flwr_pfl.errors import ConfigError

Task = Literal["classification", "regression"]


def no_training_samples(who: str, detail: str = "") -> ConfigError:
    """The one error for a client without training samples, wherever it is first noticed.

    Every algorithm needs at least one training sample per client (without it they fail deep
    inside with unrelated messages), so the data pipeline and the client base both raise this.
    ``who`` names the client (``"partition 3"``); ``detail`` says what was found.
    """
    return ConfigError(
        f"{who} has no training samples{detail}; every client needs at least one. Use fewer "
        f"clients (num-clients), another partitioner, more samples per client (max-samples, "
        f"samples-per-client) or smaller val-fraction / test-fraction"
    )


def check_aligned(x: torch.Tensor, y: torch.Tensor, domain: torch.Tensor) -> None:
    """Raise ValueError unless inputs, targets and domain labels have one entry per sample."""
    n = x.shape[0]
    if y.shape[0] != n or domain.shape[0] != n:
        raise ValueError(
            f"x, y and domain must have the same number of samples; got {n}, "
            f"{y.shape[0]} and {domain.shape[0]}"
        )


@dataclass(frozen=True)
class ArraySplit:
    """One split (train, validation or test) of one client.

    Attributes:
        x: inputs, float32, shape (N, *input_shape).
        y: targets, int64 of shape (N,) for classification, float32 of shape (N,) or (N, o)
            for regression.
        domain: int64 domain labels of shape (N,), in [0, num_domains).
    """

    x: torch.Tensor
    y: torch.Tensor
    domain: torch.Tensor

    def __post_init__(self) -> None:
        check_aligned(self.x, self.y, self.domain)

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def subset(self, index: torch.Tensor) -> ArraySplit:
        """The samples at ``index`` (a long tensor or boolean mask)."""
        return ArraySplit(self.x[index], self.y[index], self.domain[index])

    def domain_counts(self, num_domains: int) -> torch.Tensor:
        """Number of samples of each domain, shape (num_domains,)."""
        return torch.bincount(self.domain, minlength=num_domains)

    def loader(self, batch_size: int, shuffle: bool, seed: int | None = None) -> DataLoader:
        """A DataLoader over (x, y, domain) triples.

        With ``seed`` the shuffle order is fixed by its own generator; without it, shuffling
        draws from torch's global generator (clients seed that per round, so every round sees
        a new, reproducible order).
        """
        generator = torch.Generator().manual_seed(seed) if shuffle and seed is not None else None
        return DataLoader(
            TensorDataset(self.x, self.y, self.domain),
            batch_size=batch_size,
            shuffle=shuffle,
            generator=generator,
        )


@dataclass(frozen=True)
class ClientData:
    """A client's local train / validation / test splits and what a model needs to know of them."""

    train: ArraySplit
    val: ArraySplit
    test: ArraySplit
    num_classes: int
    num_domains: int
    input_shape: tuple[int, ...]
    task: Task = "classification"

    @property
    def num_outputs(self) -> int:
        """Width of a head's output: classes for classification, targets for regression."""
        if self.task == "classification":
            return self.num_classes
        return 1 if self.train.y.dim() == 1 else int(self.train.y.shape[1])
