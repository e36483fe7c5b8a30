"""IFCA's Strategy (Ghosh, Chung, Yin and Ramchandran, NeurIPS 2020, Algorithm 1 with option II,
model averaging): k cluster models, each averaged over the clients that picked it. The
mathematics is in :mod:`flwr_pfl.core.ifca`.

Wire layout (M arrays in one model, in the client's ``state_dict`` order: body then head; P arrays
per cluster: M, or with ``share_body`` the head's)
-----------------------------------------------------------------------------------------------
* global arrays (``get_parameters``, checkpoints, export) and every fit and evaluate instruction,
  the same for every client: ``[cluster 0's model (M)..., cluster 1's part (P)..., ...,
  cluster k-1's part (P)...]``, M + (k - 1) P arrays; the parts are named
  ``ifca:cluster<j>.<name>`` (:func:`flwr_pfl.clients.ifca.cluster_array_name`), so ``model.pt``
  holds cluster 0's model and ``extras.pt`` the others'. With ``share_body`` the body of cluster
  0's model is the one body all clusters share. The starting arrays come from a client
  (cluster j >= 1 drawn afresh from the run's seed, the same on every client), or from the
  user's ``initial_arrays``, which must then hold all of them.
* fit reply: the trained model (M arrays: the picked cluster's model, or the shared body and the
  picked cluster's head); ``num_examples`` = n_i; metrics ``ifca_cluster`` (the cluster the client
  picked, in [0, k)), ``train_loss``, ``train_seconds``, ``partition_id``.
* evaluate reply: loss and metrics of the cluster model the client picks, and ``ifca_cluster``.

Server, each round: each cluster's part is the example-weighted mean of the parts of the replies
that picked it; a cluster no reply picked keeps its part; with ``share_body`` the body is the
example-weighted mean over every reply. With one cluster this is FedAvg's average, to the bit.
Every fit and evaluate row records ``ifca_cluster_size_<j>``, how many clients picked cluster j,
and ``ifca_assignment``, each client's pick (``"<partition>:<cluster> ..."``); each client's own
pick is also in its per-client metrics (``ifca_cluster``).

``evaluate_fn`` (server-side evaluation) receives the whole global layout above, all k clusters.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from flwr.common import FitIns, FitRes, Parameters
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy

from flwr_pfl.core.ifca import CLUSTER_METRIC, aggregate, check_options, cluster_sizes
from flwr_pfl.errors import ConfigError, ReplyError
from flwr_pfl.strategies.base import NDArrays, PFLStrategy
from flwr_pfl.strategies.validation import ClientReply, Scalar

#: row key of the round's assignment, ``"<partition>:<cluster> ..."``
ASSIGNMENT = "ifca_assignment"


def size_key(cluster: int) -> str:
    """The row key of how many clients picked cluster ``cluster``."""
    return f"ifca_cluster_size_{cluster}"


class IFCA(PFLStrategy):
    """IFCA's server: k cluster models, each the weighted mean of its members' trained models
    (see the module docstring for the wire).

    Args:
        num_clusters: k (1: FedAvg).
        share_body: weight sharing (one body, averaged over every reply; a head per cluster).
            Must match the clients' setting.
        **kwargs: :class:`PFLStrategy`'s arguments.
    """

    name = "ifca"
    robust_refusal = ("IFCA's fit replies carry one cluster's model and are averaged cluster by cluster, not as one "
                      "mean of the global arrays")

    def __init__(self, *, num_clusters: int = 2, share_body: bool = False, **kwargs: Any) -> None:
        check_options(num_clusters, share_body, lambda option: f"IFCA's {option.replace('-', '_')}")
        super().__init__(**kwargs)
        self.num_clusters = num_clusters
        self.share_body = share_body
        #: M, the arrays of one model (a fit reply): the global arrays' count / k, or with
        #: ``share_body`` (and k > 1) learned from the first valid reply and kept in the state
        self.model_arrays: int | None = None
        self._reply_arrays: int | None = None  # the M a reply being checked is held to

    # ---------------------------------------------------------------- layout
    def split_of(self, model_arrays: int) -> int:
        """P, the per-cluster arrays, when one model has ``model_arrays`` arrays; checked against
        the global arrays: M + (k - 1) P of them, each further cluster's part shaped as the last
        P arrays of cluster 0's model.

        Raises:
            ReplyError: ``model_arrays`` does not fit the global arrays.
        """
        glob = self.global_arrays or []
        total, k, m = len(glob), self.num_clusters, model_arrays
        if k == 1:
            if m != total:
                raise ReplyError(f"the reply has {m} arrays; the model has {total}")
            return m
        rest = total - m
        p = rest // (k - 1) if rest > 0 and rest % (k - 1) == 0 else 0
        if not 1 <= p <= m or (not self.share_body and p != m):
            raise ReplyError(f"a model of {m} arrays does not fit the {total} global arrays of {k} clusters "
                             f"({'a model, then a head per further cluster' if self.share_body else 'k whole models'})")
        shapes = [a.shape for a in glob]
        for j in range(1, k):
            start = m + (j - 1) * p
            if shapes[start:start + p] != shapes[m - p:m]:
                raise ReplyError(f"a model of {m} arrays does not fit the global arrays: cluster {j}'s part is shaped "
                                 f"{shapes[start:start + p]}, cluster 0's {shapes[m - p:m]}")
        return p

    def expected_model_arrays(self) -> int | None:
        """M when the global arrays determine it (k = 1, or no weight sharing), else the one learned."""
        total = len(self.global_arrays or [])
        if self.num_clusters == 1:
            return total
        if not self.share_body:
            return total // self.num_clusters
        return self.model_arrays

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        instructions = super().configure_fit(server_round, parameters, client_manager)
        total = len(self.global_arrays or [])
        if not self.share_body and total % self.num_clusters:
            raise ConfigError(f"IFCA(num_clusters={self.num_clusters}): the {total} global arrays are not "
                              f"{self.num_clusters} whole models; start from a client's initial arrays "
                              "(initial_arrays=None) or pass every cluster's model")
        return instructions

    # ---------------------------------------------------------------- replies
    def expected_shapes(self, server_round: int) -> list[tuple[int, ...]]:
        """One model's shapes: the first M global arrays."""
        return super().expected_shapes(server_round)[: self._reply_arrays]

    def expected_dtypes(self, server_round: int) -> list[np.dtype | None]:
        """One model's dtypes: those of the first M global arrays."""
        return super().expected_dtypes(server_round)[: self._reply_arrays]

    def check_reply(self, server_round: int, proxy: ClientProxy, res: FitRes) -> ClientReply:
        """The base checks against one model's shapes, and ``ifca_cluster`` in [0, k)."""
        who = f"client {proxy.cid} (partition {res.metrics.get('partition_id', '?')})"
        expected = self.expected_model_arrays()
        count = expected if expected is not None else len(res.parameters.tensors)
        try:
            self.split_of(count)
        except ReplyError as err:
            raise ReplyError(f"{who}: {err}") from None
        self._reply_arrays = count
        reply = super().check_reply(server_round, proxy, res)
        cluster = reply.metrics.get(CLUSTER_METRIC)
        if (isinstance(cluster, bool) or not isinstance(cluster, (int, float)) or not float(cluster).is_integer()
                or not 0 <= cluster < self.num_clusters):
            raise ReplyError(f"{who}: metric {CLUSTER_METRIC}={cluster!r} must be a cluster index in "
                             f"[0, {self.num_clusters})")
        reply.metrics[CLUSTER_METRIC] = int(cluster)
        if self.model_arrays is None:
            self.model_arrays = count
        return reply

    def aggregate_replies(self, server_round: int, replies: list[ClientReply]) -> NDArrays:
        """Each cluster's part by the weighted mean of its members' (a cluster nobody picked keeps
        its own); the shared body, with ``share_body``, over every reply (:func:`~flwr_pfl.core.ifca.aggregate`)."""
        glob = self.global_arrays or []
        m = len(replies[0].arrays)
        p = self.split_of(m)
        previous = [glob[m - p:m], *(glob[m + (j - 1) * p:m + j * p] for j in range(1, self.num_clusters))]
        body, parts = aggregate(
            previous,
            [r.arrays[:m - p] for r in replies],
            [r.arrays[m - p:] for r in replies],
            [int(r.metrics[CLUSTER_METRIC]) for r in replies],
            [r.num_examples for r in replies],
        )
        return [*body, *(a for part in parts for a in part)]

    # ---------------------------------------------------------------- metrics
    def fit_metric_keys(self, replies: list[ClientReply]) -> list[str]:
        """The base's summaries but of ``ifca_cluster``, a label (the sizes are recorded instead)."""
        return [k for k in super().fit_metric_keys(replies) if k != CLUSTER_METRIC]

    def _notify(self, server_round: int, phase: str, metrics: dict[str, float], clients: dict[int, dict[str, Scalar]]) -> None:
        """Fit and evaluate rows (and the metrics returned to Flower) gain the cluster sizes
        ``ifca_cluster_size_<j>`` of the replies recorded and the assignment itself,
        ``ifca_assignment`` (``"<partition>:<cluster> ..."`` in partition order), and lose the
        mean / min / max of the cluster labels."""
        if phase in ("fit", "evaluate") and clients:
            for stat in ("wmean", "mean", "min", "max", "std", "n_nonfinite"):
                metrics.pop(f"{CLUSTER_METRIC}_{stat}", None)
            picked = {pid: int(c[CLUSTER_METRIC]) for pid, c in sorted(clients.items()) if CLUSTER_METRIC in c}
            for j, size in enumerate(cluster_sizes(list(picked.values()), self.num_clusters)):
                metrics[size_key(j)] = float(size)
            metrics[ASSIGNMENT] = " ".join(f"{pid}:{cluster}" for pid, cluster in picked.items())  # type: ignore[assignment]
        super()._notify(server_round, phase, metrics, clients)

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Base state (the global arrays: every cluster's model) plus M where it was learned."""
        return super().state_dict() | {"ifca_model_arrays": self.model_arrays}

    def load_state_dict(self, state: dict[str, Any], rounds_done: int) -> None:
        super().load_state_dict(state, rounds_done)
        learned = state.get("ifca_model_arrays")
        self.model_arrays = None if learned is None else int(learned)
