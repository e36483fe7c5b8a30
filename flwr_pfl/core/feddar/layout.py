"""The layout of a linear domain head: weight W (N, k) and optional bias b (N,) travel as one flat
vector of P = N (k + bias) numbers, the rows of [W | b] one after the other ("class-major" vec);
Hessians are (P, P) in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass(frozen=True)
class HeadLayout:
    """Shape of one linear domain head and its flat wire layout.

    Attributes:
        num_outputs: N, 1 for regression / binary logistic, number of classes for softmax.
        feature_dim: k, the encoder's output dimension.
        bias: whether the head has a bias (handled by appending a constant 1 to the features;
            the paper does not say, so False by default, which gives the (kN) x (kN) Hessian that
            App. C counts).
    """

    num_outputs: int
    feature_dim: int
    bias: bool = False

    def __post_init__(self) -> None:
        for name in ("num_outputs", "feature_dim"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"HeadLayout.{name} must be a positive integer, got {value!r}")

    @property
    def in_dim(self) -> int:
        """Columns of the augmented weight [W | b]: k + 1 with a bias, else k."""
        return self.feature_dim + int(self.bias)

    @property
    def num_params(self) -> int:
        """P = N * in_dim, the length of a flat head and the side of its Hessian."""
        return self.num_outputs * self.in_dim

    def pack(self, weight: Tensor | np.ndarray, bias: Tensor | np.ndarray | None = None):
        """Flatten weight (..., N, k) and bias (..., N) into heads (..., P), class-major."""
        if tuple(weight.shape[-2:]) != (self.num_outputs, self.feature_dim):
            raise ValueError(
                f"head weight must end in shape ({self.num_outputs}, {self.feature_dim}), "
                f"got {tuple(weight.shape)}"
            )
        if self.bias:
            if bias is None or tuple(bias.shape) != tuple(weight.shape[:-1]):
                raise ValueError(
                    f"this layout has a bias: expected bias of shape {tuple(weight.shape[:-1])}, "
                    f"got {None if bias is None else tuple(bias.shape)}"
                )
            cat = torch.cat if isinstance(weight, Tensor) else np.concatenate
            weight = cat([weight, bias[..., None]], -1)
        elif bias is not None:
            raise ValueError("this layout has no bias, but a bias was given")
        return weight.reshape(*weight.shape[:-2], self.num_params)

    def unpack(self, heads: Tensor | np.ndarray):
        """Split heads (..., P) into (weight (..., N, k), bias (..., N) or None)."""
        if heads.shape[-1] != self.num_params:
            raise ValueError(f"heads must end in {self.num_params} parameters, got {tuple(heads.shape)}")
        full = heads.reshape(*heads.shape[:-1], self.num_outputs, self.in_dim)
        if self.bias:
            return full[..., : self.feature_dim], full[..., self.feature_dim]
        return full, None
