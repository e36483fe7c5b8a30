"""Client sampling that reruns identically: seeded per round, keyed by partition id.

Flower's ``ClientManager.sample`` draws from Python's global ``random`` over node ids. Both break
reruns: clients running in the same process reseed that generator in whatever order threads
reach it, and node ids are random under the Ray engine. Here a round's sample is drawn from a
generator derived from (seed, stage, round) alone, over the clients' partition ids in sorted
order, so it is the same in every rerun, on every engine, and after a resume (a resumed round
draws what the uninterrupted run drew, with no generator state to save). Replies are put in
partition order before anything sums them, because floating-point sums depend on order.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from flwr_pfl.data.sampling import stage_rng

#: the ``get_properties`` query every suite client answers with ``{"partition_id": i}``
PARTITION_QUERY = {"query": "partition-id"}


def sampling_rng(seed: int, stage: str, server_round: int) -> np.random.Generator:
    """The generator for one round's client sampling (``stage``: "fit", "evaluate", ...)."""
    return stage_rng(seed, f"client-sampling/{stage}", server_round)


def sample_size(available: int, fraction: float, least: int) -> int:
    """Clients a round samples of ``available`` connected ones: ``fraction`` of them, at least
    ``least``, at most all (Flower's FedAvg rule)."""
    return min(max(int(available * fraction), least), available)


def sample_indices(num_clients: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """``size`` distinct indices of ``num_clients``, sorted (all of them when size >= num_clients)."""
    if size >= num_clients:
        return np.arange(num_clients)
    return np.sort(rng.choice(num_clients, size=size, replace=False))


def reply_order(pair: tuple[Any, Any]) -> tuple[int, str]:
    """Sort key of a ``(ClientProxy, FitRes | EvaluateRes)`` pair: partition id, then node id.

    Replies without a ``partition_id`` metric (clients from outside the suite) come first, in
    node-id order.
    """
    proxy, res = pair
    try:
        partition = int(res.metrics.get("partition_id", -1))
    except (TypeError, ValueError):
        partition = -1
    return partition, str(proxy.cid)


def in_partition_order(pairs: Iterable[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """``pairs`` sorted by :func:`reply_order`: the order every aggregation sums in."""
    return sorted(pairs, key=reply_order)
