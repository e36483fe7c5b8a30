"""Client state that lives across rounds, kept in Flower's ``context.state``.

The simulation engine builds a new client object for every message, so anything a client must
remember (a personal head, statistics, a chosen beta) is stored here, as records:
NumPy arrays in an ``ArrayRecord``, scalars in a ``ConfigRecord``.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

Scalar = bool | int | float | str


def save_arrays(state: RecordDict, key: str, arrays: list[np.ndarray]) -> None:
    """Store an ordered list of arrays under ``key`` (replacing what was there).

    0-d arrays (e.g. BatchNorm's ``num_batches_tracked``) keep their shape ``()``.
    """
    state[key] = ArrayRecord([np.asarray(a, order="C") for a in arrays])


def load_arrays(state: RecordDict, key: str) -> list[np.ndarray] | None:
    """The arrays stored under ``key`` in their original order, or None if nothing is stored."""
    if key not in state:
        return None
    record = state[key]
    if not isinstance(record, ArrayRecord):
        raise TypeError(f"context.state[{key!r}] holds a {type(record).__name__}, not an ArrayRecord")
    return record.to_numpy_ndarrays()


def save_scalars(state: RecordDict, key: str, values: Mapping[str, Scalar]) -> None:
    """Store a flat dict of scalars under ``key``."""
    state[key] = ConfigRecord(dict(values))


def load_scalars(state: RecordDict, key: str) -> dict[str, Scalar]:
    """The scalars stored under ``key`` (empty if nothing is stored)."""
    if key not in state:
        return {}
    record = state[key]
    if not isinstance(record, ConfigRecord):
        raise TypeError(f"context.state[{key!r}] holds a {type(record).__name__}, not a ConfigRecord")
    return dict(record)
