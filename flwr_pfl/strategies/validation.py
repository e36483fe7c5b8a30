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


#: what an array of a reply may hold: real floating-point numbers, integers or booleans (numpy's
#: dtype kinds); complex numbers, strings and Python objects are refused
REAL_KINDS = "fiub"


def check_arrays(
    who: str,
    arrays: Sequence[np.ndarray],
    expected_shapes: Sequence[tuple[int, ...]],
    num_examples: int,
    expected_dtypes: Sequence[np.dtype | None] | None = None,
) -> None:
    """Raise ReplyError if the reply has a non-positive example count, the wrong number, shapes
    or dtypes of arrays, or any NaN/Inf value; the message names the client and the first
    problem.

    Every array must hold real numbers (:data:`REAL_KINDS`). ``expected_dtypes`` (one per
    expected array, None where any real dtype will do) pins the dtype: a float64 reply where
    the model is float32 would otherwise turn the global model into float64, and values cast
    back to float32 can overflow to Inf after the checks."""
    if num_examples <= 0:
        raise ReplyError(f"client {who}: reported {num_examples} examples; must be > 0")
    if len(arrays) != len(expected_shapes):
        raise ReplyError(f"client {who}: sent {len(arrays)} arrays, expected {len(expected_shapes)}")
    if expected_dtypes is not None and len(expected_dtypes) != len(expected_shapes):
        raise ValueError(f"{len(expected_dtypes)} expected dtypes for {len(expected_shapes)} expected shapes")
    for i, (array, shape) in enumerate(zip(arrays, expected_shapes)):
        if tuple(array.shape) != tuple(shape):
            raise ReplyError(f"client {who}: array {i} has shape {tuple(array.shape)}, expected {tuple(shape)}")
        if array.dtype.kind not in REAL_KINDS:
            raise ReplyError(f"client {who}: array {i} is {array.dtype}; a reply holds real numbers only "
                             "(floating point, integer or boolean)")
        wanted = expected_dtypes[i] if expected_dtypes is not None else None
        if wanted is not None and array.dtype != np.dtype(wanted):
            raise ReplyError(f"client {who}: array {i} is {array.dtype}, expected {np.dtype(wanted)}")
        if array.dtype.kind == "f" and not np.all(np.isfinite(array)):
            raise ReplyError(f"client {who}: array {i} contains NaN or Inf")


#: Flower's error for an exception raised by a ClientApp; group 1 is the client's own error
_FLOWER_ERROR = re.compile(r"Message contains an Error \(reason: (.*)\)\. It originated", re.DOTALL)


def describe_failures(failures: Sequence[Any], limit: int = 3, width: int = 400) -> str:
    """The round's failures in words, the first ``limit`` distinct ones: Flower's ``failures``
    list of exceptions (a client's own error unwrapped from Flower's message) or ``(proxy,
    reply)`` pairs with a bad status or a rejected reply. An error several clients share (a
    configuration error raises the same on every client) is quoted once, with its count where
    the errors differ (one error for all is quoted alone)."""
    counts: dict[str, int] = {}
    for failure in failures:
        if isinstance(failure, BaseException):
            text = f"{type(failure).__name__}: {failure}"
            wrapped = _FLOWER_ERROR.search(text)  # Flower wraps a client's exception in its own
            text = wrapped.group(1) if wrapped else text
        else:
            proxy, res = failure
            bad_status = res.status.code != Code.OK
            text = f"client {proxy.cid}: " + (res.status.message if bad_status else "its reply was rejected (see the warning above)")
        text = text if len(text) <= width else text[: width - 3] + "..."
        counts[text] = counts.get(text, 0) + 1
    if len(counts) == 1:  # one error for all: the caller says how many failed
        return next(iter(counts))
    texts = [text if n == 1 else f"{n} clients: {text}" for text, n in list(counts.items())[:limit]]
    more = f" (and {len(counts) - limit} more)" if len(counts) > limit else ""
    return "; ".join(texts) + more
