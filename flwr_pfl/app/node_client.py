"""The app's client on a node: the configured algorithm's client, built when a message needs it.

The ClientApp's ``client_fn`` returns a :class:`NodeClient` for every message. It answers the
server's federation query (:data:`~flwr_pfl.clients.base.FEDERATION_QUERY`) with ``answer``: the
app's answers from the node config (and, for a node with its own data, a description of it),
with no model built; a ``num-clients`` that disagrees, a wrong node setting or data that does
not fit the others' is then reported by the server (:mod:`flwr_pfl.app.nodes`). Every
other message goes to the algorithm's client, built on first use; on the evaluate message of the
run's last round, that client also writes its personalized part (:mod:`flwr_pfl.app.export`).
"""

from __future__ import annotations

from collections.abc import Callable

from flwr.app import Context
from flwr.client import NumPyClient

from flwr_pfl.app.export import EXPORT_KEY, write_client_export
from flwr_pfl.clients.base import FEDERATION_QUERY, Config, NDArrays, PFLClient, federation_answer

#: a node's answer to the federation query: (node context, query config) -> properties
Answer = Callable[[Context, Config], Config]


class NodeClient(NumPyClient):
    """A node's client for one message: ``build(context)`` makes the algorithm's client when a
    message needs it.

    Args:
        node_context: the node's Flower Context.
        build: builds the configured algorithm's client for ``node_context``.
        answer: answers the federation query (default: the node config's ``num-partitions``).
    """

    def __init__(self, node_context: Context, build: Callable[[Context], PFLClient], answer: Answer | None = None) -> None:
        self.node_context = node_context
        self.build = build
        self.answer = answer
        self._client: PFLClient | None = None

    @property
    def client(self) -> PFLClient:
        """The algorithm's client (built on first use)."""
        if self._client is None:
            self._client = self.build(self.node_context)
        return self._client

    def get_properties(self, config: Config) -> Config:
        if config.get("query") == FEDERATION_QUERY["query"]:
            if self.answer is not None:
                return self.answer(self.node_context, config)
            return federation_answer(self.node_context.node_config)
        return self.client.get_properties(config)

    def get_parameters(self, config: Config) -> NDArrays:
        return self.client.get_parameters(config)

    def user_wire_names(self) -> list[str]:
        """The names of the arrays the algorithm's client sends (Message-API replies carry them)."""
        return self.client.user_wire_names()

    def fit(self, parameters: NDArrays, config: Config) -> tuple[NDArrays, int, Config]:
        return self.client.fit(parameters, config)

    def evaluate(self, parameters: NDArrays, config: Config) -> tuple[float, int, Config]:
        loss, num_examples, metrics = self.client.evaluate(parameters, config)
        if EXPORT_KEY in config:  # the run's last round
            scores = {**metrics, "loss": loss, "num_examples": num_examples}
            write_client_export(self.client, str(config[EXPORT_KEY]), int(config.get("server-round", 0)), scores)
        return loss, num_examples, metrics
