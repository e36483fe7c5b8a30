"""Tiny in-memory datasets for the data-layer tests (registered by name, nothing on disk)."""

from __future__ import annotations

import torch

from flwr_pfl.data.config import DataConfig
from flwr_pfl.data.registry import DatasetPool, register_dataset

TOY_SIZE = 1000
TOY_CLASSES = 10


def toy_images(config: DataConfig) -> DatasetPool:
    """1000 random 8x8 grey uint8 images, 100 per class, labels in a fixed shuffled order."""
    g = torch.Generator().manual_seed(1234)
    y = torch.arange(TOY_SIZE) % TOY_CLASSES
    y = y[torch.randperm(TOY_SIZE, generator=g)]
    x = torch.randint(0, 256, (TOY_SIZE, 1, 8, 8), generator=g, dtype=torch.uint8)
    return DatasetPool(
        x, y, torch.zeros(TOY_SIZE, dtype=torch.int64), TOY_CLASSES, mean=(0.5,), std=(0.25,)
    )


def toy_regression(config: DataConfig) -> DatasetPool:
    """300 random 5-dimensional vectors with a linear target (no images, no classes)."""
    g = torch.Generator().manual_seed(99)
    x = torch.randn(300, 5, generator=g)
    y = x @ torch.arange(1.0, 6.0)
    return DatasetPool(x, y, torch.zeros(300, dtype=torch.int64), 0, task="regression")


#: weights of toy-noisy-regression's noise-free target, and the std of the noise on its targets
NOISY_WEIGHTS = (0.5, -1.0, 2.0, 0.25)
NOISY_STD = 0.1


def toy_noisy_regression(config: DataConfig) -> DatasetPool:
    """500 random 4-dimensional vectors, targets x @ NOISY_WEIGHTS + N(0, NOISY_STD^2) noise, the
    noise-free targets kept alongside; two domains (the first 300 samples, the last 200)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(500, 4, generator=g)
    clean = x @ torch.tensor(NOISY_WEIGHTS)
    y = clean + NOISY_STD * torch.randn(500, generator=g)
    domain = (torch.arange(500) >= 300).long()
    return DatasetPool(x, y, domain, 0, num_domains=2, task="regression", noise_free_y=clean)


register_dataset("toy-images", toy_images, replace=True)
register_dataset("toy-regression", toy_regression, replace=True)
register_dataset("toy-noisy-regression", toy_noisy_regression, replace=True, noise_free_targets=True)
