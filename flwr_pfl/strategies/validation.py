"""Checks on client replies before anything of theirs reaches an aggregate (DESIGN principle 8)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.common import Code

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


#: Flower's error for an exception raised by a ClientApp; group 1 is the client's own error
_FLOWER_ERROR = re.compile(r"Message contains an Error \(reason: (.*)\)\. It originated", re.DOTALL)


def describe_failures(failures: Sequence[Any], limit: int = 3, width: int = 400) -> str:
    """The first ``limit`` failures of a round in words: Flower's ``failures`` list of
    exceptions (a client's own error unwrapped from Flower's message) or ``(proxy, reply)``
    pairs with a bad status or a rejected reply."""
    texts = []
    for failure in failures[:limit]:
        if isinstance(failure, BaseException):
            text = f"{type(failure).__name__}: {failure}"
            wrapped = _FLOWER_ERROR.search(text)  # Flower wraps a client's exception in its own
            text = wrapped.group(1) if wrapped else text
        else:
            proxy, res = failure
            bad_status = res.status.code != Code.OK
            text = f"client {proxy.cid}: " + (res.status.message if bad_status else "its reply was rejected (see the warning above)")
        texts.append(text if len(text) <= width else text[: width - 3] + "...")
    more = f" (and {len(failures) - limit} more)" if len(failures) > limit else ""
    return "; ".join(texts) + more
