"""One Message-API strategy class per flwr_pfl strategy, generated from the legacy classes.

``flwr_pfl.serverapp.FedDAR(aggregation=..., num_clients=...)`` takes exactly the arguments of
``flwr_pfl.strategies.FedDAR`` and is a :class:`~flwr_pfl.serverapp.strategy.PFLMessageStrategy`
over an instance built with them (``.logic``). Nothing here is per algorithm: every class is
made by :func:`message_flavour` from the legacy class, so a new strategy gets its Message-API
class by being exported from :mod:`flwr_pfl.strategies`.
"""

from __future__ import annotations

import inspect
from typing import Any

from flwr_pfl import strategies
from flwr_pfl.errors import NumRoundsRequired
from flwr_pfl.serverapp.strategy import PFLMessageStrategy
from flwr_pfl.strategies.base import PFLStrategy


#: Flower's Message-API FedAvg argument names -> the legacy names the round logic takes
MESSAGE_API_NAMES = {
    "fraction_train": "fraction_fit",
    "min_train_nodes": "min_fit_clients",
    "min_evaluate_nodes": "min_evaluate_clients",
    "min_available_nodes": "min_available_clients",
}


def legacy_arguments(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with Flower's Message-API names (``fraction_train``, ``min_train_nodes``, ...)
    in their legacy spelling, so that a strategy takes the arguments of Flower's Message-API
    FedAvg as well as those of its legacy one.

    Raises:
        TypeError: an argument given under both names.
    """
    out = dict(kwargs)
    for new, old in MESSAGE_API_NAMES.items():
        if new in out:
            if old in out:
                raise TypeError(f"{new} and {old} are one argument (Message-API and legacy names); give one")
            out[old] = out.pop(new)
    return out


def message_flavour(logic_class: type[PFLStrategy]) -> type[PFLMessageStrategy]:
    """The Message-API class of ``logic_class``: same name, same constructor arguments (and
    Flower's Message-API names for FedAvg's, :data:`MESSAGE_API_NAMES`); ``num_clients`` may be
    left out, as Flower's strategies have none: ``start`` then learns it from the grid."""

    def __init__(self: PFLMessageStrategy, *args: Any, **kwargs: Any) -> None:
        kwargs = legacy_arguments(kwargs)

        def build(num_clients: int, num_rounds: int) -> PFLStrategy:
            return logic_class(*args, **{"num_rounds": num_rounds, **kwargs, "num_clients": num_clients})

        if "num_clients" not in kwargs:  # as Flower's strategies: the federation's size is learned from
            # the grid when the first round starts, and the arguments are checked then (their bounds
            # depend on it: min_available_clients)
            PFLMessageStrategy.__init__(self, build=build)
            return
        try:
            PFLMessageStrategy.__init__(self, logic_class(*args, **kwargs))
        except NumRoundsRequired:  # start() is told num_rounds: build the logic then
            PFLMessageStrategy.__init__(self, build=build, num_clients=kwargs["num_clients"])

    __init__.__signature__ = inspect.signature(logic_class.__init__)  # type: ignore[attr-defined]
    __init__.__doc__ = f"Build ``flwr_pfl.strategies.{logic_class.__name__}(*args, **kwargs)`` and drive it."
    doc = (
        f"{logic_class.__name__} as a Flower Message-API strategy: the round logic of "
        f":class:`flwr_pfl.strategies.{logic_class.__name__}` (its arguments, its documentation "
        "below), driven by :class:`~flwr_pfl.serverapp.strategy.PFLMessageStrategy`.\n\n"
        + inspect.cleandoc(logic_class.__doc__ or "")
    )
    return type(
        logic_class.__name__,
        (PFLMessageStrategy,),
        {"__init__": __init__, "__doc__": doc, "__module__": __name__, "logic_class": logic_class},
    )


#: the legacy strategy classes that get a Message-API class (all but the abstract base)
LOGIC_CLASSES: tuple[type[PFLStrategy], ...] = tuple(
    getattr(strategies, name) for name in strategies.__all__ if getattr(strategies, name) is not PFLStrategy
)

#: name -> Message-API class
MESSAGE_STRATEGIES: dict[str, type[PFLMessageStrategy]] = {cls.__name__: message_flavour(cls) for cls in LOGIC_CLASSES}
