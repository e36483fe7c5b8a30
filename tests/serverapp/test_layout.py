"""select_wire_arrays: a model's state_dict gives the wire's model arrays by name; an algorithm's
own arrays (pFedFDA's statistics), which no state_dict has, come from a node; a missing model
array is refused all the same."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord

from flwr_pfl.errors import ConfigError
from flwr_pfl.serverapp.layout import select_wire_arrays

LAYOUT = [("module.fc1.weight", (2, 3)), ("pfedfda:means", (4, 2)), ("module.fc1.bias", (2,))]


def record(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({name: Array(array) for name, array in arrays.items()})


def state_dict(**extra: np.ndarray) -> ArrayRecord:
    return record({"fc1.weight": np.full((2, 3), 1.0), "fc1.bias": np.full(2, 2.0), "fc2.weight": np.zeros(1), **extra})


def test_model_arrays_by_name_and_the_algorithms_own_from_a_node_in_wire_order() -> None:
    asked = []
    means = np.arange(8.0).reshape(4, 2)

    def node_arrays():
        asked.append(True)
        return {"fc1.weight": np.zeros((2, 3)), "pfedfda:means": means, "fc1.bias": np.zeros(2)}

    arrays = select_wire_arrays(state_dict(), LAYOUT, node_arrays)
    assert asked == [True]
    np.testing.assert_array_equal(arrays[0], np.full((2, 3), 1.0))  # the user's, not the node's
    np.testing.assert_array_equal(arrays[1], means)
    np.testing.assert_array_equal(arrays[2], np.full(2, 2.0))


def test_a_missing_model_array_is_refused_and_no_node_is_asked() -> None:
    partial = record({"fc1.weight": np.full((2, 3), 1.0)})
    with pytest.raises(ConfigError, match=r"lacks .*'fc1\.bias'"):
        select_wire_arrays(partial, LAYOUT, lambda: pytest.fail("a node was asked"))


def test_without_a_node_the_algorithms_arrays_must_be_given() -> None:
    with pytest.raises(ConfigError, match="pfedfda:means"):
        select_wire_arrays(state_dict(), LAYOUT)
    given = select_wire_arrays(state_dict(**{"pfedfda:means": np.ones((4, 2))}), LAYOUT)
    np.testing.assert_array_equal(given[1], np.ones((4, 2)))
