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
    with pytest.raises(RuntimeError, match="built by start"):
        _ = strategy.logic
    logic = strategy._build(6)  # what start() does once the grid says the federation's size
    assert (logic.num_clients, logic.fraction_fit, logic.min_available_clients, logic.min_fit_clients) == (6, 0.5, 4, 3)
    serverapp.FedGP(fraction_evaluate=0.5)  # full participation is checked against the size, later
    with pytest.raises(ValueError, match="fraction_fit"):
        serverapp.FedRep(fraction_train=1.5)._build(6)
    with pytest.raises(ConfigError, match="min_available_clients=4"):
        serverapp.FedRep(min_available_nodes=4)._build(3)
