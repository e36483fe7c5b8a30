"""Checks on client replies before anything of theirs reaches an aggregate (DESIGN principle 8)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flwr_pfl.errors import ReplyError

Scalar = bool | bytes | float | int | str


@dataclass(frozen=True)
class ClientReply:
    """A validated fit reply: who sent it, how many examples, its arrays and metrics."""

    cid: str
    partition_id: int
    num_examples: int
    arrays: list[np.ndarray]
    metrics: dict[str, Scalar]


def check_arrays(
    who: str,
    arrays: Sequence[np.ndarray],
    expected_shapes: Sequence[tuple[int, ...]],
    num_examples: int,
) -> None:
    """Raise ReplyError if the reply has a non-positive example count, the wrong number or shapes
    of arrays, or any NaN/Inf value; the message names the client and the first problem."""
    if num_examples <= 0:
        raise ReplyError(f"client {who}: reported {num_examples} examples; must be > 0")
    if len(arrays) != len(expected_shapes):
        raise ReplyError(f"client {who}: sent {len(arrays)} arrays, expected {len(expected_shapes)}")
    for i, (array, shape) in enumerate(zip(arrays, expected_shapes)):
        if tuple(array.shape) != tuple(shape):
            raise ReplyError(f"client {who}: array {i} has shape {tuple(array.shape)}, expected {tuple(shape)}")
        if np.issubdtype(array.dtype, np.floating) and not np.all(np.isfinite(array)):
            raise ReplyError(f"client {who}: array {i} contains NaN or Inf")
