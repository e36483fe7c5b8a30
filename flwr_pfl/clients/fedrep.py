"""FedRep and FedPer: a shared body (representation) with a personal head per client; LG-FedAvg,
their mirror: a personal body with a shared head.

Both take the user's own model with its head named, e.g. quickstart-pytorch's ``Net``:
``FedRepClient(context, Net(), data, head="fc3")``; ``fc3`` (its module and weights) is the
personal head, every other parameter the shared body. The head may also be a list of
parameter-name prefixes (``head=["fc2", "fc3"]``) or a predicate on parameter names.
"""

from __future__ import annotations

from flwr_pfl.clients.base import Config, PFLClient


class FedPerClient(PFLClient):
    """FedPer (Arivazhagan et al., 2019): train body and head jointly; only the body is shared,
    the head stays on the client (``context.state``)."""

    head_requirement = "parameters"
    shared_group = "body"
    personal_group = "heads"


class FedRepClient(PFLClient):
    """FedRep (Collins et al., 2021, Alg. 1): each round, first ``head_epochs`` epochs on the
    personal head with the received body frozen, then ``local_epochs`` epochs on the body with
    the new head frozen; only the body is sent back.

    The frozen part's BatchNorm statistics stay as they are in each phase (the head is fitted to
    the representation it will be evaluated with, and the body's statistics that go back to the
    server are those of the body phase); ``TrainConfig(frozen_norm="train")`` lets them move, as
    the official code does (:mod:`flwr_pfl.training.norms`)."""

    head_requirement = "parameters"
    shared_group = "body"
    personal_group = "heads"

    def __init__(self, *args, head_epochs: int = 5, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if head_epochs < 0:
            raise ValueError(f"head_epochs must be >= 0, got {head_epochs}")
        self.head_epochs = head_epochs

    def local_update(self, config: Config) -> dict[str, float]:
        head = self.train_groups(("heads",), self.head_epochs)
        body = self.train_groups(("body",), self.train_config.local_epochs)
        return {
            "train_loss": body.loss,
            "head_loss": head.loss,
            "train_seconds": head.seconds + body.seconds,
        }


class LGFedAvgClient(PFLClient):
    """LG-FedAvg (Liang et al., 2020, Alg. 1): each client keeps its own local representation
    (the body, in ``context.state``) and shares the global head; body and head train jointly for
    ``local_epochs`` epochs and only the head goes back, to be averaged by example count. The
    mirror of :class:`FedPerClient`, with the same head split
    (``LGFedAvgClient(context, Net(), data, head="fc3")``).

    The body's BatchNorm statistics are part of the body: they stay on the client.
    """

    head_requirement = "parameters"
    shared_group = "heads"
    personal_group = "body"
