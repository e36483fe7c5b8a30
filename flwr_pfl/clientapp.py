"""flwr_pfl's clients as Flower Message-API handlers (``@app.train()``, ``@app.evaluate()``,
``@app.query()``), for apps of the shape ``flwr new`` generates.

The handlers only translate messages: each message builds the algorithm's client for the node
(``build(context)``, the same client class the NumPyClient flavour uses, e.g.
:class:`flwr_pfl.clients.FedRep`) and calls its ``fit`` / ``evaluate`` / ``get_properties``. The
client keeps its personal part in ``context.state``, as it does in the NumPyClient flavour, so
what a client trains, keeps and replies is one copy of code in both flavours.

Example (the user's own model and data)::

    from flwr.clientapp import ClientApp
from flwr.clientapp.typing import Mod
    from flwr_pfl.clientapp import register_handlers
    from flwr_pfl.clients import FedRepClient

    app = ClientApp()
    register_handlers(app, lambda context: FedRepClient(context, Net(), load_data(context), head="fc3"))

A node that should keep its personal part across restarts (a SuperNode with the node-config
key ``state-dir``) wraps its messages in :func:`flwr_pfl.app.node_state.persisted`::

    @app.lifespan()
    def keep_state(context: Context):
        with persisted(context):
            yield

and builds its app with ``ClientApp(mods=[rounds_mod])``
(:func:`flwr_pfl.app.node_state.rounds_mod`), so that its state files are versioned by round
and a resumed run rolls a node that is ahead of the server's checkpoint back to the round the
run resumes from.

Requests and replies are packed and read by :mod:`flwr_pfl.messages`: a ``train`` reply holds
the arrays (named as the user's model names them, where the client knows them) and a
MetricRecord with ``num-examples``; an ``evaluate`` reply a MetricRecord with ``loss`` and
``num-examples``; a ``query`` reply the client's properties. An exception in the client becomes
Flower's error reply, which the server counts as a failure.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import Mod
from flwr.common import NDArrays, Scalar

from flwr_pfl import messages

Config = dict[str, Scalar]


class MessageClient(Protocol):
    """What the handlers call: a NumPyClient's three methods (every flwr_pfl client has them)."""

    def fit(self, parameters: NDArrays, config: Config) -> tuple[NDArrays, int, Config]: ...

    def evaluate(self, parameters: NDArrays, config: Config) -> tuple[float, int, Config]: ...

    def get_properties(self, config: Config) -> Config: ...

    def get_parameters(self, config: Config) -> NDArrays: ...


BuildClient = Callable[[Context], MessageClient]


def array_names(client: MessageClient) -> list[str] | None:
    """The names of the client's wire arrays as the user's model has them (a flwr_pfl client's
    ``user_wire_names``); None for a client that does not name them (arrays go by position)."""
    user_wire_names = getattr(client, "user_wire_names", None)
    return user_wire_names() if callable(user_wire_names) else None


def train_reply(client: MessageClient, message: Message) -> Message:
    """The reply to a ``train`` message: ``client.fit`` on the message's arrays (read by the
    client's wire names, :func:`~flwr_pfl.messages.arrays_in_wire_order`) and config."""
    arrays, config = messages.read_request(message.content, array_names(client))
    new_arrays, num_examples, metrics = client.fit(arrays, config)
    return Message(messages.train_reply_content(new_arrays, num_examples, metrics, array_names(client)), reply_to=message)


def evaluate_reply(client: MessageClient, message: Message) -> Message:
    """The reply to an ``evaluate`` message: ``client.evaluate`` on its arrays (read by the
    client's wire names) and config."""
    arrays, config = messages.read_request(message.content, array_names(client))
    loss, num_examples, metrics = client.evaluate(arrays, config)
    return Message(messages.metrics_content(num_examples, metrics, loss=loss), reply_to=message)


def query_reply(client: MessageClient, message: Message) -> Message:
    """The reply to a ``query`` message: ``client.get_properties`` on its config."""
    _, config = messages.read_request(message.content)
    return Message(messages.properties_content(client.get_properties(config)), reply_to=message)


def parameters_reply(client: MessageClient, message: Message) -> Message:
    """The reply to a ``query.parameters`` message (the server starting from an empty
    ``initial_arrays`` asks one node for them): the client's initial shared arrays, named."""
    _, config = messages.read_request(message.content)
    return Message(RecordDict({messages.ARRAYS: messages.pack_arrays(client.get_parameters(config), array_names(client))}), reply_to=message)


#: the handlers :func:`register_handlers` registers (the keys of its ``mods``)
HANDLERS = ("train", "evaluate", "query", "query.parameters")


def register_handlers(app: ClientApp, build: BuildClient, mods: Mapping[str, Sequence[Mod]] | None = None) -> ClientApp:
    """Register the ``train``, ``evaluate``, ``query`` and ``query.parameters`` handlers of ``build``'s client on
    ``app`` (a ``ClientApp`` created without ``client_fn``) and return ``app``.

    Args:
        app: the user's ClientApp.
        build: makes the node's client for one message from the node's Context (it is called
            once per message; the client reads its personal part from ``context.state``).
        mods: Flower mods for one handler only, by handler name (:data:`HANDLERS`), e.g.
            ``{"train": [fixedclipping_mod]}``: a mod that expects a training reply (Flower's
            clipping mods) then never sees the suite's ``query`` messages. They run inside the
            ClientApp's own mods, as Flower's ``@app.train(mods=...)`` does.

    Raises:
        ValueError: a key of ``mods`` that is not a handler.
    """
    mods = dict(mods or {})
    unknown = sorted(set(mods) - set(HANDLERS))
    if unknown:
        raise ValueError(f"register_handlers: mods for {', '.join(map(repr, unknown))}, which are not handlers; "
                         f"the handlers are {', '.join(map(repr, HANDLERS))}")

    def handler_mods(name: str) -> list[Mod]:
        return list(mods.get(name, ()))

    @app.train(mods=handler_mods("train"))
    def train(message: Message, context: Context) -> Message:
        return train_reply(build(context), message)

    @app.evaluate(mods=handler_mods("evaluate"))
    def evaluate(message: Message, context: Context) -> Message:
        return evaluate_reply(build(context), message)

    @app.query(mods=handler_mods("query"))
    def query(message: Message, context: Context) -> Message:
        return query_reply(build(context), message)

    @app.query("parameters", mods=handler_mods("query.parameters"))
    def parameters(message: Message, context: Context) -> Message:
        return parameters_reply(build(context), message)

    return app


def message_client_app(build: BuildClient) -> ClientApp:
    """A new ClientApp with :func:`register_handlers` for ``build``."""
    return register_handlers(ClientApp(), build)
