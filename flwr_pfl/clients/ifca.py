"""IFCA's client (Ghosh, Chung, Yin and Ramchandran, NeurIPS 2020, Algorithm 1 with option II):
receive the k cluster models, take the one with the lowest loss on the local training data, train
it as FedAvg does, and send it back with its cluster index.

Wire (see :mod:`flwr_pfl.strategies.ifca` for the server's side)
---------------------------------------------------------------
* instructions (fit and evaluate) and the global arrays: cluster 0's model under the model's own
  ``state_dict`` names (what ``model.pt`` exports, loadable into the user's ``nn.Module``), then
  for each cluster j = 1 .. k-1 its per-cluster part, named ``ifca:cluster<j>.<name>``
  (``<name>`` as the user's model names the tensor). The per-cluster part is the whole model, or
  with ``share_body`` only the head (parameter group ``heads``; the body is one model that every
  cluster shares and that comes first, under its own names).
* fit reply: the trained model (body then head, every ``state_dict`` entry, as a FedAvg client's
  reply); ``num_examples`` = the training split's size; metrics ``ifca_cluster`` (the cluster the
  client picked and trained), ``train_loss``, ``train_seconds``, ``partition_id``.
* evaluate reply: loss and accuracy on the test split of the cluster model the client picks (by
  training loss, as in fit), with ``ifca_cluster``.

Each cluster's loss is the mean loss over the whole training split, the model in eval mode and
the data in its stored order (no random draw: the message's training afterwards draws exactly as
FedAvg's does). With one cluster no loss is computed: the client is FedAvg's.
"""

from __future__ import annotations

import torch

from flwr_pfl.clients.base import EXTRA_SEPARATOR, Config, NDArrays, PFLClient, seeded_message
from flwr_pfl.core.ifca import CLUSTER_METRIC, assign_cluster, check_options, cluster_init_seed
from flwr_pfl.models.reinit import redrawn_arrays
from flwr_pfl.models.split import user_keys
from flwr_pfl.training import EvalResult, evaluate, group_keys, loader_like, num_samples, set_arrays
from flwr_pfl.training.params import arrays_of_keys, set_arrays_of_keys

NAME = "ifca"


def cluster_array_name(cluster: int, name: str) -> str:
    """The wire name of cluster ``cluster``'s copy of tensor ``name`` (j >= 1): ``ifca:cluster<j>.<name>``."""
    return f"{NAME}{EXTRA_SEPARATOR}cluster{cluster}.{name}"


class IFCAClient(PFLClient):
    """IFCA's client: pick the cluster model with the lowest training loss, train it, send it back.

    Any ``torch.nn.Module`` works as it is; ``share_body=True`` needs its head named
    (``head="fc3"``), the part that is per cluster.

    Args:
        num_clusters: k, the number of cluster models (1: FedAvg).
        share_body: weight sharing: one body shared by every cluster, a head per cluster (the
            paper's neural-network experiments); False: k whole models.
        *args, **kwargs: :class:`PFLClient`'s arguments.

    Raises:
        ConfigError: a bad option, or ``share_body`` with a model whose head is not named.
    """

    #: DP-SGD cannot cover this client (see PFLClient.record_dp_refusal)
    record_dp_refusal = (
        "it chooses its cluster by the training loss of every cluster's model on its data, outside DP-SGD"
    )

    def __init__(self, *args, num_clusters: int = 2, share_body: bool = False, **kwargs) -> None:
        check_options(num_clusters, share_body, lambda option: f"IFCA's {option.replace('-', '_')}")
        self.num_clusters = num_clusters
        self.share_body = share_body
        self.head_requirement = "parameters" if share_body else "none"
        super().__init__(*args, **kwargs)
        #: the whole model as the last evaluation left it (the picked cluster's; export)
        self.evaluated: dict[str, torch.Tensor] = {}

    # ---------------------------------------------------------------- layout
    @property
    def cluster_group(self) -> str:
        """The parameter group each cluster has its own copy of."""
        return "heads" if self.share_body else "all"

    def model_keys(self) -> list[str]:
        """The model's ``state_dict`` keys in wire order: the body, then the per-cluster part."""
        if not self.share_body:
            return group_keys(self.model, "all")
        return [*group_keys(self.model, "body"), *group_keys(self.model, "heads")]

    def wire_names(self) -> list[str]:
        """Cluster 0's model, then clusters 1 .. k-1's per-cluster parts (``ifca:cluster<j>.<name>``)."""
        part = user_keys(self.model, group_keys(self.model, self.cluster_group))
        extras = [cluster_array_name(j, name) for j in range(1, self.num_clusters) for name in part]
        return [*self.model_keys(), *extras]

    def get_parameters(self, config: Config) -> NDArrays:
        """The starting global arrays: this model as cluster 0, and for each cluster j >= 1 the
        per-cluster part drawn afresh under :func:`~flwr_pfl.core.ifca.cluster_init_seed` of the
        client's seed (the run's) and j: the same on every client."""
        keys = group_keys(self.model, self.cluster_group)
        extras = [a for j in range(1, self.num_clusters)
                  for a in redrawn_arrays(self.model, keys, cluster_init_seed(self.train_config.seed, j))]
        return [*arrays_of_keys(self.model, self.model_keys()), *extras]

    def wire_layout(self) -> list[tuple[str, list[int]]]:
        """``(name, shape)`` of every global array, read off the model (nothing is drawn)."""
        state = self.model.state_dict()
        part = group_keys(self.model, self.cluster_group)
        keys = [*self.model_keys(), *(key for _ in range(1, self.num_clusters) for key in part)]
        return [(name, list(state[key].shape)) for name, key in zip(self.wire_names(), keys, strict=True)]

    # ---------------------------------------------------------------- the cluster estimate
    def load_cluster(self, parameters: NDArrays, cluster: int) -> None:
        """Load cluster ``cluster``'s model from the instruction's arrays into the model."""
        keys = self.model_keys()
        part = group_keys(self.model, self.cluster_group)
        expected = len(keys) + (self.num_clusters - 1) * len(part)
        if len(parameters) != expected:
            raise ValueError(
                f"{self.who}: IFCA's instruction has {len(parameters)} arrays; with {self.num_clusters} clusters this "
                f"model needs {expected} (the model's {len(keys)}, then {len(part)} per further cluster): start the "
                "strategy from a client's initial arrays (initial_arrays=None) or from all the clusters' arrays"
            )
        set_arrays_of_keys(self.model, keys, parameters[: len(keys)], what="IFCA's cluster-0 model")
        if cluster > 0:
            start = len(keys) + (cluster - 1) * len(part)
            set_arrays(self.model, parameters[start:start + len(part)], self.cluster_group)

    def training_loss(self) -> float:
        """F_i: the model's mean loss over the training split, in eval mode, in the data's stored
        order (no random draw is taken from torch's generators)."""
        with torch.random.fork_rng(devices=[]):
            return evaluate(self.model, loader_like(self.data.train), device=self.device, task=self.data.task,
                            num_domains=self.data.num_domains, keys=self.data.batch_keys).loss

    def pick_cluster(self, parameters: NDArrays) -> int:
        """The cluster whose model has the lowest training loss (ties: the lowest index), loaded
        into the model (:func:`~flwr_pfl.core.ifca.assign_cluster`)."""
        if self.num_clusters == 1:
            self.load_cluster(parameters, 0)
            return 0
        losses = []
        for j in range(self.num_clusters):
            self.load_cluster(parameters, j)
            losses.append(self.training_loss())
        chosen = assign_cluster(losses)
        self.load_cluster(parameters, chosen)
        return chosen

    # ---------------------------------------------------------------- NumPyClient
    @seeded_message
    def fit(self, parameters: NDArrays, config: Config) -> tuple[NDArrays, int, Config]:
        cluster = self.pick_cluster(parameters)
        metrics = self.local_update(config)
        reply = arrays_of_keys(self.model, self.model_keys())
        return reply, num_samples(self.data.train), {**metrics, CLUSTER_METRIC: cluster, "partition_id": self.partition_id}

    @seeded_message
    def evaluate(self, parameters: NDArrays, config: Config) -> tuple[float, int, Config]:
        cluster = self.pick_cluster(parameters)
        result: EvalResult = self.local_evaluate(config)
        self.evaluated = self.group_state("all")
        metrics = {**result.metrics(), CLUSTER_METRIC: cluster, "partition_id": self.partition_id}
        return result.loss, result.num_examples, metrics

    def personal_state(self) -> dict[str, torch.Tensor]:
        """The whole model of the cluster this client picked at its last evaluation (empty before
        any): with ``model.pt`` (cluster 0) it is the model the client evaluated."""
        return dict(self.evaluated)
