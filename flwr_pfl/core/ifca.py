"""IFCA's mathematics (Ghosh, Chung, Yin and Ramchandran, "An Efficient Framework for Clustered
Federated Learning", NeurIPS 2020, Algorithm 1 with option II, model averaging).

The server keeps k cluster models theta_1 .. theta_k. In every round each sampled client i

* estimates its cluster identity ``j_i = argmin_j F_i(theta_j)``, F_i its loss on its own
  training data (:func:`assign_cluster`; ties go to the lowest index, as ``np.argmin`` in the
  authors' code);
* trains theta_{j_i} locally and returns the result theta~_i with j_i.

The server then replaces each cluster's model by the average of the models its members returned,
weighted by their training examples n_i; a cluster no client picked keeps its model
(:func:`aggregate_clusters`). The paper's Algorithm 1 weighs the members equally (its clients hold
equally many samples, where the two agree); example weights are FedAvg's, which ``k = 1`` then
reproduces exactly.

Weight sharing (the paper's neural-network experiments: every layer but the last is shared by
the clusters): the shared body is averaged over every client that replied, whatever its cluster,
and only the per-cluster part (the heads) cluster by cluster (:func:`aggregate`).

The k models must start different, or every client picks cluster 0 and IFCA is FedAvg. The
authors' code draws each cluster's model from a fresh initialisation: in ``mnist/`` k models
built in turn after one ``torch.manual_seed``, in ``femnist/`` model g with seed ``seed + g``,
in ``cifar/`` the TensorFlow initializer run k times. Here cluster 0 is the run's initial model
and cluster j >= 1 the model's modules re-initialised under :func:`cluster_init_seed` (seed, j)
(:func:`flwr_pfl.models.reinit.redrawn_arrays`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from flwr_pfl.core.aggregation import weighted_average
from flwr_pfl.errors import ConfigError

NDArrays = list[np.ndarray]
#: fit / evaluate metric of the cluster a client picked (a label in [0, k), not a quantity)
CLUSTER_METRIC = "ifca_cluster"


def check_options(num_clusters: object, share_body: object, key: Callable[[str], str]) -> None:
    """Refuse bad option values, naming each by ``key(<kebab-case option>)``.

    Raises:
        ConfigError: ``num-clusters`` is not an integer >= 1, or ``share-body`` not a bool.
    """
    if isinstance(num_clusters, bool) or not isinstance(num_clusters, int) or num_clusters < 1:
        raise ConfigError(f"{key('num-clusters')} must be an integer >= 1 (1 is FedAvg); got {num_clusters!r}")
    if not isinstance(share_body, bool):
        raise ConfigError(f"{key('share-body')} must be true or false; got {share_body!r}")


def assign_cluster(losses: Sequence[float]) -> int:
    """The cluster estimate ``argmin_j F_i(theta_j)`` over one client's losses, one per cluster.

    Ties go to the lowest index. A non-finite loss (a diverged cluster model) never wins over a
    finite one; when no loss is finite the client takes cluster 0.

    Raises:
        ValueError: no losses.
    """
    if len(losses) == 0:
        raise ValueError("assign_cluster needs one loss per cluster; got none")
    values = np.asarray([float(v) for v in losses], dtype=np.float64)
    values[~np.isfinite(values)] = np.inf
    return int(np.argmin(values))  # the first of equal minima; all inf: 0


def cluster_sizes(clusters: Sequence[int], num_clusters: int) -> list[int]:
    """How many of ``clusters`` (one cluster index per client) fall in each of ``num_clusters``."""
    return [sum(1 for c in clusters if c == j) for j in range(num_clusters)]


def aggregate_clusters(
    previous: Sequence[NDArrays], models: Sequence[NDArrays], clusters: Sequence[int], weights: Sequence[float]
) -> list[NDArrays]:
    """Each cluster's new model: the ``weights``-weighted mean of the ``models`` whose entry of
    ``clusters`` is its index; ``previous[j]`` itself (the same arrays) for a cluster j that no
    model belongs to.

    Args:
        previous: the k cluster models before the round.
        models: the clients' trained models (one per client, each laid out as ``previous[j]``).
        clusters: each client's cluster index in [0, k).
        weights: each client's weight (its training examples).

    Raises:
        ValueError: the three per-client sequences differ in length, or a cluster index is
            outside [0, k).
    """
    if not len(models) == len(clusters) == len(weights):
        raise ValueError(f"{len(models)} models, {len(clusters)} cluster indices and {len(weights)} weights")
    k = len(previous)
    bad = [c for c in clusters if not 0 <= c < k]
    if bad:
        raise ValueError(f"cluster indices {bad} are outside [0, {k})")
    out: list[NDArrays] = []
    for j in range(k):
        members = [i for i, c in enumerate(clusters) if c == j]
        if not members:
            out.append(list(previous[j]))
            continue
        out.append(weighted_average([models[i] for i in members], [weights[i] for i in members]))
    return out


def aggregate(
    previous: Sequence[NDArrays],
    bodies: Sequence[NDArrays],
    parts: Sequence[NDArrays],
    clusters: Sequence[int],
    weights: Sequence[float],
) -> tuple[NDArrays, list[NDArrays]]:
    """One round of IFCA's server: ``(shared body, the k per-cluster parts)``.

    The body (empty without weight sharing) is the weighted mean of every client's body; the
    per-cluster parts (the whole model without weight sharing, the heads with it) are averaged
    cluster by cluster (:func:`aggregate_clusters`).
    """
    body = weighted_average(list(bodies), list(weights)) if bodies and len(bodies[0]) else []
    return body, aggregate_clusters(previous, parts, clusters, weights)


def cluster_init_seed(seed: int, cluster: int) -> int:
    """The seed cluster ``cluster``'s starting model is drawn under, from the run's ``seed``:
    distinct for every (seed, cluster) pair and the same on every client and machine."""
    if cluster < 0:
        raise ValueError(f"cluster must be >= 0; got {cluster}")
    return int(np.random.SeedSequence([int(seed) % 2**63, int(cluster), 0x1FCA]).generate_state(1, np.uint64)[0] % 2**63)
