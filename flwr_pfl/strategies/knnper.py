"""kNN-Per's Strategy (Marfoq, Neglia, Vidal and Kameni, ICML 2022).

kNN-Per's server is FedAvg's: the global model is trained by FedAvg (the authors'
``CentralizedAggregator`` with their plain ``Client``), and the personalization happens at
inference, on each client, from the global model's representation
(:class:`~flwr_pfl.clients.knnper.KNNPerClient`). Nothing personal crosses the wire or is kept
on the server.
"""

from __future__ import annotations

from flwr_pfl.strategies.base import PFLStrategy


class KNNPer(PFLStrategy):
    """kNN-Per: the sample-weighted average of the whole model (wire: all arrays, both ways, as
    FedAvg). Each client evaluates the global model interpolated with a kNN model over its own
    datastore, lambda p_kNN + (1 - lambda) p_global; its evaluate metrics add ``knn_lambda``,
    ``knn_datastore_size``, ``knn_accuracy`` and the global model's ``global_loss`` /
    ``global_accuracy``."""

    name = "knn-per"
