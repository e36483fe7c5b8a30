"""Encoders (bodies): each maps an input batch to a flat feature vector per sample."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn


def mlp_encoder(input_shape: tuple[int, ...], hidden: tuple[int, ...] = (200, 200)) -> nn.Module:
    """Flatten, then Linear + ReLU layers; the features are the last hidden layer."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(input_shape)
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    return nn.Sequential(*layers)


def cnn28_encoder(input_shape: tuple[int, ...], feature_dim: int = 128, batch_norm: bool = False) -> nn.Module:
    """Small CNN for 28x28 inputs (MNIST family): two 5x5 conv + pool blocks, one dense layer.

    ``batch_norm=True`` (model ``cnn28-bn``) puts a BatchNorm after each conv and after the dense
    layer, before its ReLU, as FedBN's ``DigitModel`` does (Li et al., ICLR 2021): a small model
    whose normalisation layers FedBN and friends can keep local."""
    channels = input_shape[0]

    def norm(width: int, dims: int) -> list[nn.Module]:
        return [(nn.BatchNorm2d if dims == 2 else nn.BatchNorm1d)(width)] if batch_norm else []

    return nn.Sequential(
        nn.Conv2d(channels, 16, 5), *norm(16, 2), nn.ReLU(), nn.MaxPool2d(2),   # 28 -> 24 -> 12
        nn.Conv2d(16, 32, 5), *norm(32, 2), nn.ReLU(), nn.MaxPool2d(2),         # 12 -> 8 -> 4
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, feature_dim), *norm(feature_dim, 1), nn.ReLU(),
    )


def cnn32_encoder(input_shape: tuple[int, ...], feature_dim: int = 128) -> nn.Module:
    """CNN for 32x32 colour inputs (CIFAR family), the FedAvg/FedRep-style two-conv network."""
    channels = input_shape[0]
    return nn.Sequential(
        nn.Conv2d(channels, 32, 5), nn.ReLU(), nn.MaxPool2d(2),   # 32 -> 28 -> 14
        nn.Conv2d(32, 64, 5), nn.ReLU(), nn.MaxPool2d(2),         # 14 -> 10 -> 5
        nn.Flatten(),
        nn.Linear(64 * 5 * 5, 512), nn.ReLU(),
        nn.Linear(512, feature_dim), nn.ReLU(),
    )


def resnet18_encoder(input_shape: tuple[int, ...], group_norm: bool = False) -> nn.Module:
    """torchvision's ResNet-18 without its classifier (512 features).

    ``group_norm=True`` swaps BatchNorm for GroupNorm (2 groups per layer), the usual choice in
    federated learning where batch statistics differ across clients (pFedFDA's CIFAR setup).
    Inputs with other than 3 channels get a matching first convolution.
    """
    from torchvision.models import resnet18  # only here: importing torchvision takes over a second

    norm_layer: Callable[[int], nn.Module] | None = (
        (lambda c: nn.GroupNorm(2, c)) if group_norm else None
    )
    net = resnet18(weights=None, norm_layer=norm_layer)
    if input_shape[0] != 3:
        net.conv1 = nn.Conv2d(input_shape[0], 64, kernel_size=7, stride=2, padding=3, bias=False)
    net.fc = nn.Identity()
    return net


class LinearEncoder(nn.Module):
    """phi(x) = B^T x with B in R^{d x k}, no bias: the FedDAR linear representation."""

    def __init__(self, input_dim: int, feature_dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(input_dim, feature_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.flatten(1))
