"""Encoder + heads: the model shape every algorithm in the suite works with.

A model is a shared encoder (the "body", phi) that maps inputs to features, followed by M heads
(one per domain or task; M = 1 for ordinary models). A sample's domain label picks its head.
Parameter groups name the parts that algorithms move around: ``all``, ``body``, ``heads`` and
``head:<m>`` (see :mod:`flwr_pfl.training.params`); a model says which of its ``state_dict`` keys
are head keys through :meth:`EncoderHeadModel.in_head`. A user's own model gets the same
interface, keeping its modules and weights, from :func:`flwr_pfl.models.split_model`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class EncoderHeadModel(nn.Module):
    """A shared encoder followed by ``num_heads`` linear heads.

    Args:
        encoder: maps a batch of inputs to features of shape (B, feature_dim).
        feature_dim: width of the encoder's output.
        num_outputs: width of each head's output (classes, or regression targets).
        num_heads: number of heads M (one per domain or task).
        head_bias: whether heads have a bias (the FedDAR linear problem has none).
    """

    def __init__(
        self,
        encoder: nn.Module,
        feature_dim: int,
        num_outputs: int,
        num_heads: int = 1,
        head_bias: bool = True,
    ) -> None:
        super().__init__()
        if num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {num_heads}")
        self.encoder = encoder
        self.feature_dim = feature_dim
        self.num_outputs = num_outputs
        self.heads = nn.ModuleList(
            nn.Linear(feature_dim, num_outputs, bias=head_bias) for _ in range(num_heads)
        )

    #: features() and head_outputs() are available (see :class:`~flwr_pfl.models.split.HeadSplit`)
    splits_features = True

    @property
    def num_heads(self) -> int:
        return len(self.heads)

    def in_head(self, key: str, index: int | None = None) -> bool:
        """Whether ``state_dict`` key ``key`` belongs to head ``index`` (None: to any head)."""
        return key.startswith("heads." if index is None else f"heads.{index}.")

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Encoder output phi(x), shape (B, feature_dim)."""
        return self.encoder(x)

    def head_outputs(self, features: torch.Tensor, domain: torch.Tensor | None) -> torch.Tensor:
        """Each sample's own head on its features, shape (B, num_outputs) (:func:`route_heads`)."""
        return route_heads(self.heads, features, domain)

    def forward(self, x: torch.Tensor, domain: torch.Tensor | None = None) -> torch.Tensor:
        return self.head_outputs(self.features(x), domain)


def route_heads(heads: Sequence[nn.Module], features: torch.Tensor, domain: torch.Tensor | None) -> torch.Tensor:
    """Apply each sample's head to its features: output shape (B, num_outputs).

    With one head, ``domain`` is ignored. With M heads, sample i uses head ``domain[i]``, which
    must lie in [0, M).
    """
    num_heads = len(heads)
    if num_heads == 1:
        return heads[0](features)
    if domain is None:
        raise ValueError(f"a model with {num_heads} heads needs each sample's domain label")
    if domain.numel() and (int(domain.min()) < 0 or int(domain.max()) >= num_heads):
        raise ValueError(
            f"domain labels must lie in [0, {num_heads}); got values in "
            f"[{int(domain.min())}, {int(domain.max())}]"
        )
    all_heads = torch.stack([head(features) for head in heads])  # (M, B, o)
    return all_heads[domain, torch.arange(features.shape[0], device=features.device)]
