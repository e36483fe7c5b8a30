"""select_wire_arrays: a model's state_dict gives the wire's model arrays by name; an algorithm's
own arrays (pFedFDA's statistics), which no state_dict has, come from a node; a missing model
array is refused all the same."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord

from flwr_pfl.errors import ConfigError
from flwr_pfl.serverapp.layout import head_copies, select_wire_arrays

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


#: FedDAR's wire for two domains: the body, the user's head (head 0), then head 1, a copy of it
DOMAIN_LAYOUT = [("module.fc1.weight", (2, 3)), ("module.fc2.weight", (3, 2)), ("module.fc2.bias", (3,)),
                 ("extra_heads.0.weight", (3, 2)), ("extra_heads.0.bias", (3,))]


def domain_state_dict() -> ArrayRecord:
    return record({"fc1.weight": np.full((2, 3), 1.0), "fc2.weight": np.full((3, 2), 5.0), "fc2.bias": np.full(3, 6.0)})


def test_added_heads_start_as_copies_of_the_users_head_and_no_node_is_asked() -> None:
    """The user's state_dict has no head for domain 1: it starts as the client starts it, a copy
    of the user's own head (head 0), entry for entry."""
    assert head_copies(DOMAIN_LAYOUT) == {"extra_heads.0.weight": "module.fc2.weight", "extra_heads.0.bias": "module.fc2.bias"}
    arrays = select_wire_arrays(domain_state_dict(), DOMAIN_LAYOUT, lambda: pytest.fail("a node was asked"))
    np.testing.assert_array_equal(arrays[3], np.full((3, 2), 5.0))
    np.testing.assert_array_equal(arrays[4], np.full(3, 6.0))


def test_three_heads_copy_the_users_head_each() -> None:
    layout = [*DOMAIN_LAYOUT, ("extra_heads.1.weight", (3, 2)), ("extra_heads.1.bias", (3,))]
    assert head_copies(layout)["extra_heads.1.bias"] == "module.fc2.bias"
    assert head_copies(LAYOUT) == {}


def test_a_later_rounds_arrays_keep_the_current_added_heads_and_statistics() -> None:
    """A record handed back without the arrays the user's model lacks (a wrapper's new record)
    takes them from the round before, not from the user's head or a node's initial arrays."""
    current = {"extra_heads.0.weight": np.full((3, 2), -1.0), "extra_heads.0.bias": np.full(3, -2.0)}
    arrays = select_wire_arrays(domain_state_dict(), DOMAIN_LAYOUT, lambda: pytest.fail("a node was asked"), current)
    np.testing.assert_array_equal(arrays[3], current["extra_heads.0.weight"])
    np.testing.assert_array_equal(arrays[4], current["extra_heads.0.bias"])
    means = select_wire_arrays(state_dict(), LAYOUT, lambda: pytest.fail("a node was asked"), {"pfedfda:means": np.ones((4, 2))})
    np.testing.assert_array_equal(means[1], np.ones((4, 2)))


def test_a_missing_body_array_is_refused_even_with_the_current_arrays_at_hand() -> None:
    partial = record({"fc2.weight": np.full((3, 2), 5.0), "fc2.bias": np.full(3, 6.0)})
    with pytest.raises(ConfigError, match=r"lacks 1 array.*'fc1\.weight'"):
        select_wire_arrays(partial, DOMAIN_LAYOUT, None, {"fc1.weight": np.zeros((2, 3))})


# ------------------------------------------------------------------------------ the messages, in full
def test_a_refusal_names_what_is_missing_and_what_is_extra_in_full() -> None:
    partial = record({"fc1.weight": np.full((2, 3), 1.0), "fc9.weight": np.zeros(1), "fc9.bias": np.zeros(1)})
    with pytest.raises(ConfigError) as caught:
        select_wire_arrays(partial, LAYOUT, lambda: pytest.fail("a node was asked"))  # a model array is missing
    assert str(caught.value) == (
        "initial_arrays lacks 2 array(s) the algorithm's wire carries: ['pfedfda:means', 'fc1.bias']; it has 2 the wire does not carry: "
        "['fc9.weight', 'fc9.bias']. The names are the clients' model's: pass the state_dict of the model the ClientApp "
        "builds (ArrayRecord(model.state_dict()); a model built otherwise names its tensors otherwise), the wire arrays "
        "['fc1.weight', 'pfedfda:means', 'fc1.bias'], or an empty ArrayRecord to ask a client for them")


def test_long_name_lists_are_cut_after_eight_and_an_empty_one_is_none() -> None:
    many = [(f"module.l{i}.weight", (1,)) for i in range(9)]
    with pytest.raises(ConfigError) as caught:
        select_wire_arrays(record({}), many)
    listed = "'l0.weight', 'l1.weight', 'l2.weight', 'l3.weight', 'l4.weight', 'l5.weight', 'l6.weight', 'l7.weight'"
    assert f"lacks 9 array(s) the algorithm's wire carries: [{listed}, ...]; it has 0 the wire does not carry: none." in str(caught.value)
    with pytest.raises(ConfigError) as caught:
        select_wire_arrays(record({}), many[:8])
    assert f"carries: [{listed}]; it has 0" in str(caught.value)


def test_a_wrong_shape_is_refused_naming_the_array_and_both_shapes() -> None:
    wrong = record({"fc1.weight": np.ones((3, 2)), "fc1.bias": np.ones(2), "pfedfda:means": np.ones((4, 2))})
    with pytest.raises(ConfigError) as caught:
        select_wire_arrays(wrong, LAYOUT)
    assert str(caught.value) == "initial_arrays['module.fc1.weight'] has shape (3, 2); the clients' model has (2, 3)"


def test_an_answer_without_a_layout_is_refused_saying_what_the_clientapp_must_run() -> None:
    from flwr_pfl.serverapp.layout import parse_layout

    with pytest.raises(ConfigError) as caught:
        parse_layout({"partition_id": 0, "other": "x"})
    assert str(caught.value) == (
        "the node's answer to the wire-layout query has no 'wire_layout' (['other', 'partition_id']); its ClientApp must "
        "run a flwr_pfl client (flwr_pfl.clientapp.register_handlers) to start from named arrays, or pass the arrays "
        "named by position (ArrayRecord(list_of_arrays))")


def test_heads_of_one_array_each_are_copied_one_to_one() -> None:
    """A bias-free head: each added head is one array, a copy of the user's one."""
    layout = [("module.fc1.weight", (2, 3)), ("module.fc2.weight", (3, 2)),
              ("extra_heads.0.weight", (3, 2)), ("extra_heads.1.weight", (3, 2))]
    assert head_copies(layout) == {"extra_heads.0.weight": "module.fc2.weight", "extra_heads.1.weight": "module.fc2.weight"}


def test_added_heads_from_the_round_before_and_statistics_from_a_node_both_fill() -> None:
    layout = [*DOMAIN_LAYOUT, ("pfedfda:means", (4, 2))]
    current = {"extra_heads.0.weight": np.full((3, 2), -1.0), "extra_heads.0.bias": np.full(3, -2.0)}
    arrays = select_wire_arrays(domain_state_dict(), layout, lambda: {"pfedfda:means": np.ones((4, 2))}, current)
    np.testing.assert_array_equal(arrays[3], current["extra_heads.0.weight"])
    np.testing.assert_array_equal(arrays[5], np.ones((4, 2)))


def test_statistics_a_node_does_not_have_are_refused_by_name() -> None:
    layout = [*LAYOUT, ("pfedfda:covariance", (2, 2))]
    with pytest.raises(ConfigError, match=r"lacks 1 array\(s\) the algorithm's wire carries: \['pfedfda:covariance'\]"):
        select_wire_arrays(state_dict(), layout, lambda: {"pfedfda:means": np.ones((4, 2))})
