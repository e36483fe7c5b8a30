"""Models: an encoder (body) plus one or more heads, built by name, or a user's own model with
its head named (:func:`split_model`)."""

from __future__ import annotations

import math

import torch
from torch import nn

from flwr_pfl.errors import ConfigError
from flwr_pfl.models.base import EncoderHeadModel
from flwr_pfl.models.split import HeadSplit, HeadSpec, split_model
from flwr_pfl.models.encoders import (
    LinearEncoder,
    cnn28_encoder,
    cnn32_encoder,
    mlp_encoder,
    resnet18_encoder,
)

MODEL_NAMES = ("mlp", "cnn28", "cnn28-bn", "cnn32", "resnet18", "resnet18-gn", "linear")
#: the models with BatchNorm (running statistics), which record-level DP (DP-SGD) refuses
RUNNING_STAT_MODELS = ("cnn28-bn", "resnet18")


def _feature_dim(encoder: nn.Module, input_shape: tuple[int, ...]) -> int:
    """Width of the encoder's output, found with one dummy forward pass."""
    was_training = encoder.training
    encoder.eval()
    with torch.no_grad():
        out = encoder(torch.zeros(2, *input_shape))
    encoder.train(was_training)
    return int(out.shape[1])


def build_model(
    name: str,
    input_shape: tuple[int, ...],
    num_outputs: int,
    num_heads: int = 1,
    feature_dim: int = 0,
) -> EncoderHeadModel:
    """Build an encoder + ``num_heads`` heads model by name.

    Args:
        name: one of ``MODEL_NAMES``: ``mlp``, ``cnn28`` (28x28 inputs), ``cnn28-bn`` (the same
            with BatchNorm, as FedBN's DigitModel), ``cnn32`` (32x32), ``resnet18`` (BatchNorm),
            ``resnet18-gn`` (GroupNorm), ``linear`` (FedDAR's B^T x).
        input_shape: shape of one input, e.g. (1, 28, 28) or (d,).
        num_outputs: classes, or regression targets, per head.
        num_heads: heads, one per domain or task.
        feature_dim: representation width for ``linear`` (k), ``cnn28(-bn)`` and ``cnn32``; 0 keeps
            the model's default (128; ``linear`` requires it).
    """
    if name == "mlp":
        encoder = mlp_encoder(input_shape)
    elif name in ("cnn28", "cnn28-bn"):
        if tuple(input_shape[-2:]) != (28, 28):
            raise ConfigError(f"model {name!r} needs 28x28 inputs, got input shape {input_shape}")
        encoder = cnn28_encoder(input_shape, feature_dim or 128, batch_norm=name == "cnn28-bn")
    elif name == "cnn32":
        if tuple(input_shape[-2:]) != (32, 32):
            raise ConfigError(f"model 'cnn32' needs 32x32 inputs, got input shape {input_shape}")
        encoder = cnn32_encoder(input_shape, feature_dim or 128)
    elif name in ("resnet18", "resnet18-gn"):
        encoder = resnet18_encoder(input_shape, group_norm=name == "resnet18-gn")
    elif name == "linear":
        if feature_dim <= 0:
            raise ConfigError("model 'linear' needs a representation width: set feature-dim > 0")
        encoder = LinearEncoder(math.prod(input_shape), feature_dim)
    else:
        raise ConfigError(f"unknown model {name!r}; allowed: {', '.join(MODEL_NAMES)}")
    head_bias = name != "linear"
    return EncoderHeadModel(
        encoder, _feature_dim(encoder, input_shape), num_outputs, num_heads, head_bias
    )


__all__ = ["MODEL_NAMES", "RUNNING_STAT_MODELS", "EncoderHeadModel", "HeadSpec", "HeadSplit", "build_model", "split_model"]
