"""What flwr_pfl's Message-API flavour puts in a Flower ``Message``: the one place that packs and
reads its records, used by the server side (:mod:`flwr_pfl.serverapp`) and the client handlers
(:mod:`flwr_pfl.clientapp`).

The records follow Flower's own Message-API apps (``flwr new``):

* ``train`` and ``evaluate`` requests: ``{"arrays": ArrayRecord, "config": ConfigRecord}``;
* ``train`` replies: ``{"arrays": ArrayRecord, "metrics": MetricRecord}``; ``evaluate`` replies:
  ``{"metrics": MetricRecord}``; ``num-examples`` is in the MetricRecord, and in an evaluate
  reply also ``loss``;
* ``query`` requests: ``{"config": ConfigRecord}``; replies: ``{"properties": ConfigRecord}``.

A client's metrics that are not numbers (a reason string, a flag) travel in a ConfigRecord
``"info"`` beside the MetricRecord, which holds numbers only; :func:`read_metrics` merges them
back. Arrays keep their order: an ArrayRecord is ordered, and the order is the protocol (the
round logic addresses arrays by position); the names label them (the model's ``state_dict``
names where the sender knows them, else ``"0"``, ``"1"``, ...). A reader that knows the wire's
names (:func:`arrays_in_wire_order`) reads a named record by name: a record from a sender that
orders its arrays otherwise (another tool, a user's own ClientApp) reaches the round logic and
the clients in wire order, and one whose names are not the wire's is refused, naming them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.common import Scalar

#: the round's learning rate in a train or evaluate config: the suite's name, and the name
#: Flower's PyTorch examples send (``{"lr": ...}``); either sets it, both at once must agree
LEARNING_RATE_KEYS = ("learning-rate", "lr")
#: the keys of the user's part of a config (``on_fit_config_fn``, ``fit_config``, the Message
#: API's ``train_config`` / ``evaluate_config``) that the suite's clients read
CLIENT_CONFIG_KEYS = LEARNING_RATE_KEYS

ARRAYS = "arrays"
CONFIG = "config"
METRICS = "metrics"
INFO = "info"
PROPERTIES = "properties"
NUM_EXAMPLES = "num-examples"
LOSS = "loss"


class MessageContentError(ValueError):
    """A message's content is not what the Message-API flavour sends or expects."""


def pack_arrays(arrays: Sequence[np.ndarray], names: Sequence[str] | None = None) -> ArrayRecord:
    """An ArrayRecord holding ``arrays`` in order, named by ``names`` when given (same length,
    distinct), else by position."""
    if names is None or len(names) != len(arrays) or len(set(names)) != len(names):
        names = [str(i) for i in range(len(arrays))]
    return ArrayRecord({name: Array(np.asarray(array)) for name, array in zip(names, arrays)})


def unpack_arrays(record: ArrayRecord) -> list[np.ndarray]:
    """The arrays of ``record`` in order."""
    return record.to_numpy_ndarrays()


def is_positional(record: ArrayRecord) -> bool:
    """Whether ``record``'s names are its positions (``"0"``, ``"1"``, ...): nothing to read by name."""
    return list(record.keys()) == [str(i) for i in range(len(record))]


def _shown(names: Sequence[str], limit: int = 8) -> str:
    """``names`` for a message: the first ``limit`` of them, quoted."""
    return "[" + ", ".join(repr(n) for n in names[:limit]) + (", ..." if len(names) > limit else "") + "]"


def arrays_in_wire_order(record: ArrayRecord, names: Sequence[str] | None) -> list[np.ndarray]:
    """The arrays of ``record`` in wire order: read by name when the reader knows the wire's
    ``names`` and the record is named, else in the record's own order.

    A record named by position (``"0"``, ``"1"``, ...: a sender that does not name its arrays),
    or read without ``names`` (the reader does not know them), is taken in its order; one named
    exactly ``names`` in that order too (the usual case, read as :func:`unpack_arrays` reads it).
    A record holding the same names in another order is put back in the order of ``names``: the
    names say which array is which, and reading by position would hand the round logic or the
    client a weight where another belongs (same shapes slip through every later check).

    Raises:
        MessageContentError: the record is named, but its names are not ``names``: those it
            lacks and those it has beyond them are named.
    """
    if names is None or is_positional(record):
        return unpack_arrays(record)
    names = list(names)
    keys = list(record.keys())
    if keys == names:
        return unpack_arrays(record)
    missing = [name for name in names if name not in record]
    extra = [key for key in keys if key not in set(names)]
    if missing or extra or len(keys) != len(names):
        raise MessageContentError(
            f"the ArrayRecord {ARRAYS!r} is named, but not with the wire's {len(names)} array names: it lacks "
            f"{len(missing)} ({_shown(missing) if missing else 'none'}) and has {len(extra)} the wire does not carry "
            f"({_shown(extra) if extra else 'none'}); name the arrays as the model's state_dict does, or by position"
        )
    return [record[name].numpy() for name in names]


def _split_scalars(values: Mapping[str, Scalar]) -> tuple[dict[str, int | float], dict[str, Scalar]]:
    numbers: dict[str, int | float] = {}
    other: dict[str, Scalar] = {}
    for key, value in values.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            numbers[key] = value
        else:
            other[key] = value
    return numbers, other


def request_content(arrays: Sequence[np.ndarray], config: Mapping[str, Scalar], names: Sequence[str] | None = None) -> RecordDict:
    """A ``train`` / ``evaluate`` request: the arrays and the config."""
    return RecordDict({ARRAYS: pack_arrays(arrays, names), CONFIG: ConfigRecord(dict(config))})


def read_request(content: RecordDict, names: Sequence[str] | None = None) -> tuple[list[np.ndarray], dict[str, Scalar]]:
    """The arrays and config of a request (no arrays: an empty list); the arrays in the order of
    the wire's ``names`` when the client knows them (:func:`arrays_in_wire_order`).

    Raises:
        MessageContentError: the arrays are named, but not with ``names``.
    """
    arrays = arrays_in_wire_order(content.array_records[ARRAYS], names) if ARRAYS in content.array_records else []
    config = dict(content.config_records[CONFIG]) if CONFIG in content.config_records else {}
    return arrays, config


def metrics_content(num_examples: int, metrics: Mapping[str, Scalar], loss: float | None = None) -> RecordDict:
    """``{"metrics": MetricRecord}``: the numeric metrics, ``num-examples`` and, for an evaluate
    reply, ``loss``; where some metrics are not numbers, also ``{"info": ConfigRecord}``.

    Raises:
        MessageContentError: a metric named ``num-examples``, or one named ``loss`` that differs
            from ``loss`` (the reply would say two things).
    """
    numbers, other = _split_scalars(metrics)
    if NUM_EXAMPLES in numbers or NUM_EXAMPLES in other:
        raise MessageContentError(f"a client metric may not be named {NUM_EXAMPLES!r}: it is the reply's own")
    if loss is not None:
        if LOSS in other or (LOSS in numbers and numbers[LOSS] != loss):
            raise MessageContentError(f"the client's metric {LOSS!r} ({metrics[LOSS]!r}) differs from the loss it returned ({loss!r})")
        numbers[LOSS] = float(loss)
    numbers[NUM_EXAMPLES] = int(num_examples)
    content = RecordDict({METRICS: MetricRecord(numbers)})
    if other:
        content[INFO] = ConfigRecord(other)
    return content


def train_reply_content(arrays: Sequence[np.ndarray], num_examples: int, metrics: Mapping[str, Scalar], names: Sequence[str] | None = None) -> RecordDict:
    """A ``train`` reply: the arrays, ``num-examples`` and the metrics."""
    content = metrics_content(num_examples, metrics)
    content[ARRAYS] = pack_arrays(arrays, names)
    return content


def read_metrics(content: RecordDict) -> tuple[int, dict[str, Scalar]]:
    """``(num_examples, the other metrics)`` of a reply (those of its ``"info"`` record too).

    Raises:
        MessageContentError: no MetricRecord, or no valid ``num-examples`` in it.
    """
    if METRICS not in content.metric_records:
        raise MessageContentError(f"the reply has no MetricRecord {METRICS!r} (records: {sorted(content.keys())})")
    metrics: dict[str, Any] = dict(content.metric_records[METRICS])
    num_examples = metrics.pop(NUM_EXAMPLES, None)
    if not isinstance(num_examples, int) or isinstance(num_examples, bool) or num_examples < 0:
        raise MessageContentError(f"the reply's {NUM_EXAMPLES!r} is {num_examples!r}, not a non-negative integer")
    if INFO in content.config_records:
        metrics |= dict(content.config_records[INFO])
    return num_examples, metrics


def read_evaluate_reply(content: RecordDict) -> tuple[float, int, dict[str, Scalar]]:
    """``(loss, num_examples, metrics)`` of an ``evaluate`` reply (``loss`` stays among the
    metrics too: flwr_pfl's clients report it there as well).

    Raises:
        MessageContentError: as :func:`read_metrics`, or no numeric ``loss``.
    """
    num_examples, metrics = read_metrics(content)
    loss = metrics.get(LOSS)
    if not isinstance(loss, float):
        raise MessageContentError(f"the evaluate reply's {LOSS!r} is {loss!r}, not a number")
    return loss, num_examples, metrics


def read_train_reply(content: RecordDict, names: Sequence[str] | None = None) -> tuple[list[np.ndarray], int, dict[str, Scalar]]:
    """``(arrays, num_examples, metrics)`` of a ``train`` reply (no ArrayRecord: no arrays); the
    arrays in the order of the wire's ``names`` when the server knows them
    (:func:`arrays_in_wire_order`).

    Raises:
        MessageContentError: as :func:`read_metrics`, or the arrays are named, but not with
            ``names``.
    """
    num_examples, metrics = read_metrics(content)
    arrays = arrays_in_wire_order(content.array_records[ARRAYS], names) if ARRAYS in content.array_records else []
    return arrays, num_examples, metrics


def query_content(config: Mapping[str, Scalar]) -> RecordDict:
    """A ``query`` request."""
    return RecordDict({CONFIG: ConfigRecord(dict(config))})


def properties_content(properties: Mapping[str, Scalar]) -> RecordDict:
    """A ``query`` reply."""
    return RecordDict({PROPERTIES: ConfigRecord(dict(properties))})


def read_properties(content: RecordDict) -> dict[str, Scalar]:
    """The properties of a ``query`` reply.

    Raises:
        MessageContentError: the reply has no ConfigRecord ``"properties"``.
    """
    if PROPERTIES not in content.config_records:
        raise MessageContentError(f"the query reply has no ConfigRecord {PROPERTIES!r} (records: {sorted(content.keys())})")
    return dict(content.config_records[PROPERTIES])
