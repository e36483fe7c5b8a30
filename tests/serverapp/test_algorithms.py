"""flwr_pfl.serverapp offers one Message-API class per strategy of flwr_pfl.strategies, under
its name, taking its arguments and Flower's Message-API names for FedAvg's."""

from __future__ import annotations

import pytest
from flwr.serverapp.strategy import Strategy

import flwr_pfl.serverapp as serverapp
from flwr_pfl.errors import ConfigError
from flwr_pfl import strategies
from flwr_pfl.serverapp import MESSAGE_STRATEGIES, PFLMessageStrategy


def test_every_strategy_has_its_message_api_class_under_its_name() -> None:
    legacy = {name for name in strategies.__all__ if getattr(strategies, name) is not strategies.PFLStrategy}
    assert set(MESSAGE_STRATEGIES) == legacy
    for name, cls in MESSAGE_STRATEGIES.items():
        assert getattr(serverapp, name) is cls and name in serverapp.__all__
        assert issubclass(cls, Strategy) and issubclass(cls, PFLMessageStrategy)
        assert cls.logic_class is getattr(strategies, name)


def test_flower_message_api_names_reach_the_round_logic() -> None:
    strategy = serverapp.FedRep(num_clients=8, fraction_train=0.25, fraction_evaluate=0.5, min_train_nodes=2,
                                min_evaluate_nodes=3, min_available_nodes=4)
    logic = strategy.logic
    assert isinstance(logic, strategies.FedRep)
    assert (logic.fraction_fit, logic.fraction_evaluate) == (0.25, 0.5)
    assert (logic.min_fit_clients, logic.min_evaluate_clients, logic.min_available_clients) == (2, 3, 4)


def test_an_argument_under_both_names_is_refused() -> None:
    with pytest.raises(TypeError, match="fraction_train and fraction_fit are one argument"):
        serverapp.FedAvg(num_clients=4, fraction_train=0.5, fraction_fit=0.5)


def test_without_num_clients_the_logic_and_its_checks_wait_for_the_federations_size() -> None:
    strategy = serverapp.FedRep(fraction_train=0.5, min_available_nodes=4, min_train_nodes=3)
    with pytest.raises(RuntimeError, match="built when the first round starts"):
        _ = strategy.logic
    logic = strategy._build(6, 0)  # what start() does once the grid says the federation's size
    assert (logic.num_clients, logic.fraction_fit, logic.min_available_clients, logic.min_fit_clients) == (6, 0.5, 4, 3)
    serverapp.FedGP(fraction_evaluate=0.5)  # full participation is checked against the size, later
    with pytest.raises(ValueError, match="fraction_fit"):
        serverapp.FedRep(fraction_train=1.5)._build(6, 0)
    with pytest.raises(ConfigError, match="min_available_clients=4"):
        serverapp.FedRep(min_available_nodes=4)._build(3, 0)


def test_a_logic_that_needs_the_runs_rounds_waits_for_start_to_be_told_them() -> None:
    """pFedFDA's full last round needs num_rounds: the legacy class refuses to be built without it
    (Flower never tells legacy strategies), the Message-API class waits for start(num_rounds=...)."""
    with pytest.raises(ConfigError, match="PFedFDA: full_last_round=True .* needs the run's total number of rounds"):
        strategies.PFedFDA(num_clients=3)
    strategy = serverapp.PFedFDA(num_clients=3)
    with pytest.raises(RuntimeError, match="built when the first round starts"):
        _ = strategy.logic
    logic = strategy._build(3, 4)
    assert (logic.num_clients, logic.num_rounds) == (3, 4)
    assert serverapp.PFedFDA(num_clients=3, num_rounds=5).logic.num_rounds == 5  # given: built at once


def test_start_tells_the_logic_its_rounds_and_refuses_a_different_number() -> None:
    strategy = serverapp.FedRep(num_clients=3)
    assert strategy.logic.num_rounds == 0
    strategy.adopt_num_rounds(4)
    assert strategy.logic.num_rounds == 4 and strategy.logic.is_last_round(4) and not strategy.logic.is_last_round(3)
    strategy.adopt_num_rounds(4)  # the same again: fine
    with pytest.raises(ConfigError, match=r"FedRep\(num_rounds=5\) but start\(num_rounds=3\).*pass the same number"):
        serverapp.FedRep(num_clients=3, num_rounds=5).adopt_num_rounds(3)
    resumed = serverapp.FedRep(num_clients=3, num_rounds=5)
    resumed.logic.round_offset = 2  # a resume: start() runs the 3 rounds left
    resumed.adopt_num_rounds(3)
    assert resumed.logic.num_rounds == 5
