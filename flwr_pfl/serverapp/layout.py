"""The global arrays a Message-API strategy starts from, in the round logic's wire order.

The round logic addresses arrays by position (the clients' ``wire_layout``: the shared group's
``state_dict`` names, in order, plus an algorithm's non-model arrays). A Flower user starts a
Message-API strategy with an ``ArrayRecord``, often of the whole model
(``ArrayRecord(model.state_dict())``). :func:`select_wire_arrays` takes from such a record the
arrays the wire carries, by name and in wire order, and refuses one that lacks some with a
message naming what is missing and what is extra. Names are matched as the client's model has
them or as the user's own model does (a user's model given with ``head=`` is wrapped by the
client, its keys gaining a ``module.`` prefix: :meth:`~flwr_pfl.models.split.HeadSplit.user_key`). A record named by position (``"0"``, ``"1"``,
...) is taken as it is: it already is in wire order.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence

import numpy as np
from flwr.app import ArrayRecord

from flwr_pfl.clients.base import EXTRA_SEPARATOR, WIRE_LAYOUT
from flwr_pfl.errors import ConfigError
from flwr_pfl.messages import is_positional, unpack_arrays
from flwr_pfl.models.split import EXTRA_HEADS, HeadSplit

#: ``(name, shape)`` of each wire array, in order
Layout = list[tuple[str, tuple[int, ...]]]


def parse_layout(properties: dict) -> Layout:
    """The wire layout of a node's answer to the wire-layout query.

    Raises:
        ConfigError: the answer has no layout (the node's client is not a flwr_pfl client).
    """
    if WIRE_LAYOUT not in properties:
        raise ConfigError(
            f"the node's answer to the wire-layout query has no {WIRE_LAYOUT!r} ({sorted(properties)}); its "
            "ClientApp must run a flwr_pfl client (flwr_pfl.clientapp.register_handlers) to start from named arrays, "
            "or pass the arrays named by position (ArrayRecord(list_of_arrays))"
        )
    return [(str(name), tuple(int(n) for n in shape)) for name, shape in json.loads(str(properties[WIRE_LAYOUT]))]


def user_name(name: str) -> str:
    """A wire name as the user's own model names the tensor."""
    return HeadSplit.user_key(name)


def _find(record: ArrayRecord, name: str) -> str | None:
    """The key of ``record`` holding wire array ``name`` (its own or its user name), or None."""
    return next((key for key in (name, user_name(name)) if key in record), None)


def is_algorithm_array(name: str) -> bool:
    """Whether wire array ``name`` is an algorithm's own (``<algorithm>:<what>``, e.g. pFedFDA's
    class means), not a model tensor: a model's ``state_dict`` does not have it."""
    return EXTRA_SEPARATOR in name


def outside_user_model(name: str) -> bool:
    """Whether wire array ``name`` (as :func:`user_name` gives it) has no place in the user's
    own model: an algorithm's own array (:func:`is_algorithm_array`) or a head the client added
    (FedDAR's heads of domains 1..M-1, ``extra_heads.<i>.*``)."""
    return is_algorithm_array(name) or name.startswith(EXTRA_HEADS)


def head_copies(layout: Layout) -> dict[str, str]:
    """Each added head's wire array -> the user's head's array it starts as a copy of. A model
    with several heads (:class:`~flwr_pfl.models.split.HeadSplit`) has on the wire its body, the
    user's head (head 0), then heads 1..M-1, each a copy of head 0's module: the same entries in
    the same order."""
    extra = [name for name, _ in layout if user_name(name).startswith(EXTRA_HEADS)]
    if not extra:
        return {}
    first = next(i for i, (name, _) in enumerate(layout) if name == extra[0])
    head_size = next((i for i, name in enumerate(extra) if name.split(".")[1] != extra[0].split(".")[1]), len(extra))
    head = [name for name, _ in layout[first - head_size: first]]
    return {name: head[i % head_size] for i, name in enumerate(extra)}


def select_wire_arrays(
    record: ArrayRecord,
    layout: Layout,
    algorithm_arrays: Callable[[], Mapping[str, np.ndarray]] | None = None,
    current: Mapping[str, np.ndarray] | None = None,
) -> list[np.ndarray]:
    """The arrays of ``layout``, taken from ``record`` by name, in wire order. Those that have no
    place in the user's model (:func:`outside_user_model`), which a user's ``state_dict`` lacks,
    are filled: from ``current`` (the arrays of the round before, by user name) when given; an
    added head from the user's own head in ``record``, as each client starts it
    (:func:`head_copies`); an algorithm's own array from ``algorithm_arrays()`` when given (one
    client's initial arrays, by name: the legacy server starts from those).

    Raises:
        ConfigError: ``record`` lacks some of the layout's model arrays (naming those and the
            names it has that the wire does not carry), or an array's shape is not the wire's.
    """
    wanted = [user_name(name) for name, _ in layout]
    keys = {name: _find(record, name) for name, _ in layout}
    filled: dict[str, np.ndarray] = {}
    copies = head_copies(layout)
    for name, key in keys.items():
        own = user_name(name)
        if key is not None or not outside_user_model(own):
            continue
        if current is not None and own in current:
            filled[own] = np.asarray(current[own])
        elif name in copies and keys[copies[name]] is not None:
            filled[own] = record[str(keys[copies[name]])].numpy()
    missing = [user_name(name) for name, key in keys.items() if key is None and user_name(name) not in filled]
    if missing and algorithm_arrays is not None and all(is_algorithm_array(name) for name in missing):
        given = algorithm_arrays()
        filled |= {name: np.asarray(given[name]) for name in missing if name in given}
        missing = [name for name in missing if name not in filled]
    if missing:
        used = {key for key in keys.values() if key is not None}
        extra = [name for name in record.keys() if name not in used]
        raise ConfigError(
            f"initial_arrays lacks {len(missing)} array(s) the algorithm's wire carries: {_names(missing)}; "
            f"it has {len(extra)} the wire does not carry: {_names(extra)}. The names are the clients' model's: "
            f"pass the state_dict of the model the ClientApp builds (ArrayRecord(model.state_dict()); a model "
            f"built otherwise names its tensors otherwise), the wire arrays {_names(wanted)}, or an empty "
            "ArrayRecord to ask a client for them"
        )
    arrays = []
    for name, shape in layout:
        array = record[str(keys[name])].numpy() if keys[name] is not None else np.asarray(filled[user_name(name)])
        if tuple(array.shape) != shape:
            raise ConfigError(f"initial_arrays[{name!r}] has shape {tuple(array.shape)}; the clients' model has {shape}")
        arrays.append(array)
    return arrays


def record_arrays(record: ArrayRecord, names: Sequence[str] | None) -> list[np.ndarray] | None:
    """``record``'s arrays when they are in wire order already (named by position, or by
    exactly ``names``); None when they must be selected by name."""
    if is_positional(record) or (names is not None and list(record.keys()) == list(names)):
        return unpack_arrays(record)
    return None


def _names(names: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return f"[{shown}{', ...' if len(names) > limit else ''}]" if names else "none"
