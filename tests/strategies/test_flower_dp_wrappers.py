"""Flower's own DP wrappers around a suite strategy: the FedAvg family composes with them and
then holds (evaluates, checkpoints, exports) the released, noised model; the algorithms whose
replies are not the global arrays averaged are refused when the wrapper asks for round 1's
instructions, before any client trains, naming the algorithm and the reason."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord
from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server import ServerApp, ServerConfig
from flwr.server import strategy as legacy
from flwr.server.compat import start_grid
from flwr.server.server import Server
from flwr.server.client_manager import SimpleClientManager
from flwr.serverapp import strategy as message_api

from flwr_pfl.app.client_app import app as client_app
from flwr_pfl.app.config import parse_experiment
from flwr_pfl.app.inprocess import run_inprocess
from flwr_pfl.app.server_app import build_strategy
from flwr_pfl.errors import ConfigError
from flwr_pfl.serverapp import PFLMessageStrategy
from flwr_pfl.strategies import FedAvg

LEGACY_WRAPPERS = {
    "server-fixed": lambda s: legacy.DifferentialPrivacyServerSideFixedClipping(s, 1.0, 1.0, 3),
    "client-fixed": lambda s: legacy.DifferentialPrivacyClientSideFixedClipping(s, 1.0, 1.0, 3),
    "server-adaptive": lambda s: legacy.DifferentialPrivacyServerSideAdaptiveClipping(s, 0.1, 3),
    "dpfedavg-fixed": lambda s: legacy.DPFedAvgFixed(s, 3, 1.0, 1.0),
}


def strategy_of(algorithm: str, **overrides):
    return build_strategy(parse_experiment({"algorithm": algorithm, "num-clients": 3, "num-server-rounds": 2} | overrides))


@pytest.mark.parametrize("wrap", LEGACY_WRAPPERS.values(), ids=LEGACY_WRAPPERS.keys())
@pytest.mark.parametrize(("algorithm", "reason"), [
    ("pfedfda", "feature statistics"), ("feddar-sa", "own rule"), ("fmtl", "own rule"), ("fedora", "own rule"),
    ("fedamp", "attention weights"), ("local", "sends no model"),
])
def test_a_legacy_wrapper_that_cannot_apply_is_refused_before_any_client_trains(wrap, algorithm, reason):
    inner = strategy_of(algorithm)
    wrapper = wrap(inner)
    parameters = ndarrays_to_parameters([np.zeros(3, dtype=np.float32)])
    with pytest.raises(ConfigError, match=rf"cannot run inside Flower's {type(wrapper).__name__}: .*{reason}") as err:
        wrapper.configure_fit(1, parameters, None)  # refused before it samples: no client manager needed
    assert str(err.value).endswith(". Flower's DP wrappers clip each reply against the arrays sent and noise the mean; "
                                   "use the suite's client-level DP (dp-noise-multiplier) where the algorithm accepts "
                                   "it, or record-level DP")


@pytest.mark.parametrize(("overrides", "match"), [
    ({"dp-noise-multiplier": 1.0}, "FedAvg already applies client-level DP \\(client_dp\\); inside Flower's "
     "DifferentialPrivacyServerSideFixedClipping it would be clipped and noised twice, with two accountants that each "
     "ignore the other; use one$"),
    ({"secure-aggregation": "secagg+"}, "FedAvg aggregates securely \\(secure_aggregation\\): Flower's "
     "DifferentialPrivacyServerSideFixedClipping clips each reply on the server, which then sees none; use "
     "record-level DP with secure aggregation$"),
])
def test_a_legacy_wrapper_on_top_of_the_suites_own_privacy_is_refused(overrides, match):
    wrapper = LEGACY_WRAPPERS["server-fixed"](strategy_of("fedavg", **overrides))
    with pytest.raises(ConfigError, match=match):
        wrapper.configure_fit(1, ndarrays_to_parameters([np.zeros(3, dtype=np.float32)]), None)


def test_a_message_api_wrapper_that_cannot_apply_is_refused():
    inner = PFLMessageStrategy(strategy_of("pfedfda"))
    wrapper = message_api.DifferentialPrivacyServerSideFixedClipping(inner, 1.0, 1.0, 3)
    with pytest.raises(ConfigError, match="PFedFDA cannot run inside Flower's DifferentialPrivacyServerSideFixedClipping"):
        wrapper.configure_train(1, ArrayRecord(), ConfigRecord(), None)


def test_only_a_flower_dp_wrapper_around_this_very_strategy_counts():
    from flwr_pfl.strategies.wrappers import calling_wrapper

    mine, other = FedAvg(num_clients=3), FedAvg(num_clients=3)

    def ask(strategy):
        return calling_wrapper(strategy)  # looks at the frames above this one

    def method_of(self, strategy):  # a frame whose ``self`` is ``self``, as a wrapper's method is
        return ask(strategy)

    around_mine = legacy.DifferentialPrivacyServerSideFixedClipping(mine, 1.0, 1.0, 3)
    assert method_of(around_mine, mine) is around_mine
    assert method_of(legacy.DifferentialPrivacyServerSideFixedClipping(other, 1.0, 1.0, 3), mine) is None

    class NotAWrapper:
        strategy = mine

    assert method_of(NotAWrapper(), mine) is None


def test_the_plain_loop_calls_are_not_taken_for_a_wrapper():
    strategy = strategy_of("pfedfda")
    with pytest.raises(Exception) as caught:  # no client manager: it fails later, on sampling, not on a wrapper
        strategy.configure_fit(1, ndarrays_to_parameters([np.zeros(3, dtype=np.float32)]), None)
    assert not isinstance(caught.value, ConfigError)


def test_the_fedavg_family_composes_and_holds_the_released_noised_model(tmp_path, blobs_dataset):
    """Flower's server-side DP wrapper around the suite's FedAvg, on the in-process grid: the
    strategy's global arrays after the run are the noised aggregate the wrapper released (which
    the clients received), in the model's dtype, not the noiseless one it computed itself."""
    inner = FedAvg(num_clients=3, num_rounds=2, seed=0)
    wrapper = legacy.DifferentialPrivacyServerSideFixedClipping(inner, noise_multiplier=0.3, clipping_norm=0.5,
                                                                 num_sampled_clients=3)
    noiseless, released = [], []
    own, wrapped = inner.aggregate_fit, wrapper.aggregate_fit

    def spy_inner(*args):
        answer = own(*args)
        noiseless.append(parameters_to_ndarrays(answer[0]))
        return answer

    def spy_wrapper(*args):
        answer = wrapped(*args)
        released.append(parameters_to_ndarrays(answer[0]))
        return answer

    inner.aggregate_fit = spy_inner
    wrapper.aggregate_fit = spy_wrapper
    server_app = ServerApp()

    @server_app.main()
    def main(grid, context) -> None:
        start_grid(grid=grid, server=Server(client_manager=SimpleClientManager(), strategy=wrapper),
                   config=ServerConfig(num_rounds=2))

    run_config = {"dataset": "test-blobs", "model": "mlp", "num-clients": 3, "partitioner": "iid",
                  "test-fraction": 0.25, "output-dir": str(tmp_path), "learning-rate": 0.1}
    run_inprocess(server_app, client_app, 3, run_config)
    assert len(released) == 2
    for held, noised, plain in zip(inner.global_arrays, released[-1], noiseless[-1], strict=True):
        assert held.dtype == plain.dtype == np.float32
        np.testing.assert_array_equal(held, noised.astype(np.float32))
        assert not np.allclose(held, plain, atol=1e-3)  # the noise (std 0.05) is in what the strategy holds


def test_released_arrays_of_another_shape_are_refused_naming_both_counts():
    strategy = FedAvg(num_clients=3, initial_arrays=[np.zeros((2, 2), dtype=np.float32)])
    strategy._returned = ndarrays_to_parameters([np.zeros((2, 2), dtype=np.float32)])
    strategy.follow_released(strategy._returned)  # what it returned: nothing to adopt
    assert strategy.global_arrays[0].shape == (2, 2)
    with pytest.raises(ConfigError, match=r"sends \(2\) differ in number or shape from the aggregate .* \(1\)"):
        strategy.follow_released(ndarrays_to_parameters([np.zeros(4), np.zeros(1)]))
    strategy.follow_released(ndarrays_to_parameters([np.ones((2, 2))]))  # float64 noise on it: adopted as float32
    assert strategy.global_arrays[0].dtype == np.float32 and strategy.global_arrays[0].sum() == 4


@pytest.mark.parametrize("side", ["client", "server"])
@pytest.mark.parametrize("algorithm", ["fedavg", "fedrep"])
def test_message_api_dp_wrappers_compose_with_the_fedavg_family(tmp_path, blobs_dataset, caplog, algorithm, side):
    """Flower's Message-API DP wrappers around the suite's strategy, started without initial
    arrays (the strategy asks a node for them). Client side: Flower's ``fixedclipping_mod`` on the
    ClientApp's train handler only (``register_handlers(mods=...)``) clips every train reply
    (FedRep's body against the body it received) and the queries pass it by. Server side: the
    wrapper clips each reply against the arrays round 1 sent. Either way the run completes and
    the strategy holds the noised aggregate the wrapper released."""
    from flwr.app import ArrayRecord
    from flwr.clientapp import ClientApp
    from flwr.clientapp.mod import fixedclipping_mod
    from flwr.serverapp import ServerApp as MessageServerApp

    from flwr_pfl.app.client_app import node_client
    from flwr_pfl.clientapp import register_handlers
    from flwr_pfl.strategies import FedRep

    logic = (FedAvg if algorithm == "fedavg" else FedRep)(num_clients=3, num_rounds=2, seed=0)
    wrapping = (message_api.DifferentialPrivacyClientSideFixedClipping if side == "client"
                else message_api.DifferentialPrivacyServerSideFixedClipping)
    wrapper = wrapping(PFLMessageStrategy(logic), 0.3, 0.5, 3)
    noiseless = []
    own = logic.aggregate_fit

    def spy(*args):
        answer = own(*args)
        noiseless.append(parameters_to_ndarrays(answer[0]))
        return answer

    logic.aggregate_fit = spy
    server = MessageServerApp()

    @server.main()
    def main(grid, context) -> None:
        wrapper.start(grid=grid, initial_arrays=ArrayRecord(), num_rounds=2)

    clients = register_handlers(ClientApp(), node_client, mods={"train": [fixedclipping_mod]} if side == "client" else {})
    run_config = {"dataset": "test-blobs", "model": "mlp", "num-clients": 3, "partitioner": "iid", "algorithm": algorithm,
                  "test-fraction": 0.25, "output-dir": str(tmp_path), "learning-rate": 0.1}
    with caplog.at_level("INFO", logger="flwr"):
        run_inprocess(server, clients, 3, run_config)
    clipped = "fixedclipping_mod: parameters are clipped" if side == "client" else "aggregate_fit: parameters are clipped"
    assert sum(clipped in r.getMessage() for r in caplog.records) == 6  # three replies, two rounds
    assert not any("clipping_norm" in r.getMessage() and "read only" in r.getMessage() for r in caplog.records)
    assert len(noiseless) == 2
    for held, plain in zip(logic.global_arrays, noiseless[-1], strict=True):
        assert held.dtype == plain.dtype and not np.allclose(held, plain, atol=1e-3)


@pytest.mark.parametrize("model", ["head in the middle", "head last"])
def test_a_server_side_wrapper_clips_against_the_part_an_algorithm_shares(model):
    """Flower's server-side wrapper around FedRep started with the user's whole state_dict: the
    replies carry the shared body only, so each is clipped against the body this round sent (the
    whole state_dict has more arrays, and with the head registered in the middle, others at the
    same positions). The run completes, Result holds the whole state_dict, and the arrays the
    wrapper clipped against in the last round are the body that round sent."""
    from fakes import BatchNormDropoutNet, MiddleHeadNet
    from flwr_pfl import messages
    from flwr_pfl.app.inprocess import InProcessGrid
    from flwr_pfl.clients import FedRepClient
    from flwr_pfl.serverapp import FedRep as MessageFedRep
    from serverapp.test_user_model import app_for, whole as whole_state_dict

    net, head = (MiddleHeadNet, "layers.head") if model == "head in the middle" else (BatchNormDropoutNet, "fc2")
    app = app_for(FedRepClient, net, head=head)
    whole = whole_state_dict(net, seed=0)
    strategy = MessageFedRep(num_clients=3)
    sent = []
    own = strategy.configure_train

    def spy(server_round, arrays, config, grid):
        out = list(own(server_round, arrays, config, grid))
        sent.append(out[0].content.array_records[messages.ARRAYS])
        return out

    strategy.configure_train = spy  # type: ignore[method-assign]
    wrapper = message_api.DifferentialPrivacyServerSideFixedClipping(strategy, 0.1, 0.5, 3)
    result = wrapper.start(grid=InProcessGrid(app, 3, {}), initial_arrays=whole, num_rounds=2, timeout=60)  # type: ignore[arg-type]
    assert list(result.arrays.keys()) == list(whole.keys())
    body = [name for name in whole.keys() if not name.startswith(head)]
    assert list(sent[-1].keys()) == list(wrapper.current_arrays.keys()) == body
    for name in body:
        np.testing.assert_array_equal(wrapper.current_arrays[name].numpy(), sent[-1][name].numpy())
