"""Client sampling as properties over generated federations (flwr_pfl.strategies.sampling and
``PFLStrategy.configure_fit`` / ``configure_evaluate``).

Generated: the federation's size, which partitions are connected (and under which node ids),
``fraction_fit`` / ``fraction_evaluate``, ``min_fit_clients`` / ``min_evaluate_clients``,
``min_available_clients``, the seed and the round. The documented rule
(``PFLStrategy._sample``): after waiting for ``min_available_clients`` connected clients, a round
samples ``max(int(K * fraction), min_clients)`` of the K connected clients (``min_clients`` capped
at ``num_clients``), drawn by partition id from a generator of (seed, stage, round) alone; with
fewer than ``min_clients`` connected it samples nobody (the step is skipped, as Flower's FedAvg
skips it); fewer than ``min_available_clients`` connected stops the round with a RuntimeError
naming the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest
from flwr.common import ndarrays_to_parameters
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fakes import FakeProxy, client_manager
from flwr_pfl.strategies import FedAvg

PARAMETERS = ndarrays_to_parameters([np.zeros(2, np.float32)])


@dataclass(frozen=True)
class Federation:
    """A generated federation and strategy settings."""

    num_clients: int
    connected: tuple[int, ...]  # partition ids of the connected clients
    cids: tuple[str, ...]  # their node ids, in the same order
    fraction: float
    min_clients: int
    min_available: int
    seed: int
    server_round: int

    def manager(self):
        """A client manager holding the connected clients."""
        return client_manager(FakeProxy(cid, pid) for cid, pid in zip(self.cids, self.connected))

    def strategy(self, **overrides) -> FedAvg:
        """A FedAvg over this federation (no waiting: ``wait_timeout=0``)."""
        kwargs = dict(num_clients=self.num_clients, fraction_fit=self.fraction, min_fit_clients=self.min_clients,
                      fraction_evaluate=self.fraction, min_evaluate_clients=self.min_clients,
                      min_available_clients=self.min_available, seed=self.seed, wait_timeout=0)
        return FedAvg(**(kwargs | overrides))

    def expected_size(self) -> int:
        """The documented sample size over the connected clients: none when fewer than
        ``min_clients`` (capped at ``num_clients``) are connected."""
        k, least = len(self.connected), min(self.min_clients, self.num_clients)
        return 0 if k < least else max(int(k * self.fraction), least)


@st.composite
def federations(draw, enough: bool = True, partial: bool = False) -> Federation:
    """A federation of 1..40 partitions; ``enough``: at least ``min_available_clients`` of them are
    connected (else fewer); ``partial``: a fraction < 1 that samples fewer than all connected."""
    n = draw(st.integers(1 if enough else 2, 40))
    min_available = draw(st.integers(1, n) if enough else st.integers(2, n))
    size = draw(st.integers(min_available, n) if enough else st.integers(0, min_available - 1))
    connected = tuple(sorted(draw(st.permutations(range(n)))[:size]))
    cid_base = draw(st.integers(0, 10**9))
    cids = tuple(str(cid_base + 13 * i + draw(st.integers(0, 12))) for i in range(size))
    fraction = draw(st.floats(0.0, 1.0, exclude_max=partial))
    min_clients = draw(st.integers(1, n + 3))
    fed = Federation(n, connected, cids, fraction, min_clients, min_available,
                     draw(st.integers(0, 2**32 - 1)), draw(st.integers(1, 500)))
    if partial:
        assume(1 <= fed.expected_size() < len(fed.connected))
    return fed


def sampled_partitions(instructions) -> list[int]:
    """The partition ids of the proxies in a configure_fit / configure_evaluate answer."""
    return [proxy.pid for proxy, _ in instructions]


@settings(max_examples=80)
@given(federations())
def test_fit_sample_has_the_documented_size_and_never_fewer_than_min_fit_clients(fed: Federation) -> None:
    """``max(int(K * fraction_fit), min_fit_clients)`` clients while at least ``min_fit_clients``
    are connected; none (the round's training is skipped) while fewer are: a round never trains
    on fewer than ``min_fit_clients``."""
    chosen = sampled_partitions(fed.strategy().configure_fit(fed.server_round, PARAMETERS, fed.manager()))
    assert len(chosen) == fed.expected_size()
    wanted = min(fed.min_clients, fed.num_clients)
    if len(fed.connected) >= wanted:
        assert len(chosen) >= wanted
    else:
        assert chosen == []


@settings(max_examples=60)
@given(federations())
def test_evaluate_sample_has_the_documented_size(fed: Federation) -> None:
    """``configure_evaluate`` samples ``max(int(K * fraction_evaluate), min_evaluate_clients)``
    clients, none while fewer than ``min_evaluate_clients`` are connected, and none when
    ``fraction_evaluate = 0`` (evaluation off)."""
    chosen = sampled_partitions(fed.strategy().configure_evaluate(fed.server_round, PARAMETERS, fed.manager()))
    assert len(chosen) == (0 if fed.fraction == 0.0 else fed.expected_size())


@settings(max_examples=80)
@given(federations(), st.sampled_from(["fit", "evaluate"]))
def test_sample_has_no_duplicates_and_only_connected_clients(fed: Federation, stage: str) -> None:
    """Every sampled proxy is a distinct client that is connected to the client manager."""
    manager = fed.manager()
    strategy = fed.strategy(fraction_evaluate=max(fed.fraction, 0.01))
    configure = strategy.configure_fit if stage == "fit" else strategy.configure_evaluate
    instructions = configure(fed.server_round, PARAMETERS, manager)
    cids = [proxy.cid for proxy, _ in instructions]
    assert len(set(cids)) == len(cids)
    connected = manager.all()
    assert all(cid in connected and connected[cid] is proxy for cid, (proxy, _) in zip(cids, instructions))


@settings(max_examples=60)
@given(federations(), st.integers(0, 10**9), st.integers(0, 50))
def test_same_seed_and_round_sample_the_same_partitions_under_any_node_ids_and_after_a_resume(
    fed: Federation, other_cid_base: int, rounds_done: int
) -> None:
    """Two strategies with one seed sample the same partition ids in the same round of the run,
    whatever node ids the clients have (they differ between engines and reruns) and however many
    of its rounds a resumed strategy did before (``round_offset``)."""
    first = sampled_partitions(fed.strategy().configure_fit(fed.server_round + rounds_done, PARAMETERS, fed.manager()))
    renamed = replace(fed, cids=tuple(str(other_cid_base + 7 * i) for i in range(len(fed.cids))))
    resumed = renamed.strategy()
    resumed.round_offset = rounds_done
    again = sampled_partitions(resumed.configure_fit(fed.server_round, PARAMETERS, renamed.manager()))
    assert sorted(again) == sorted(first)


@settings(max_examples=40)
@given(federations(partial=True))
def test_sampled_sets_vary_across_rounds_when_the_fraction_samples_part_of_the_federation(fed: Federation) -> None:
    """With fewer clients sampled than connected, 20 consecutive rounds do not all draw the same set."""
    strategy, manager = fed.strategy(), fed.manager()
    draws = {tuple(sorted(sampled_partitions(strategy.configure_fit(r, PARAMETERS, manager))))
             for r in range(fed.server_round, fed.server_round + 20)}
    assert len(draws) > 1


@settings(max_examples=40)
@given(federations(enough=False), st.sampled_from(["fit", "evaluate"]))
def test_too_few_connected_clients_stop_the_round_with_an_error_naming_the_numbers(fed: Federation, stage: str) -> None:
    """Fewer than ``min_available_clients`` connected (after ``wait_timeout``): the round samples
    nobody and raises a RuntimeError that says how many connected out of how many wanted."""
    strategy = fed.strategy(fraction_evaluate=max(fed.fraction, 0.01))
    configure = strategy.configure_fit if stage == "fit" else strategy.configure_evaluate
    wanted = f"num-clients={fed.min_available}" if fed.min_available == fed.num_clients else f"min_available_clients={fed.min_available}"
    with pytest.raises(RuntimeError, match=rf"^only {len(fed.connected)} of {wanted} clients connected within 0 s"):
        configure(fed.server_round, PARAMETERS, fed.manager())
    assert strategy._sampled_nodes == {}
