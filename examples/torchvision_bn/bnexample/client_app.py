"""The ClientApp: Flower's Message-API shape (``@app.train()`` / ``@app.evaluate()``), with a
torchvision model that has BatchNorm layers (ResNet-18), switched to a flwr_pfl algorithm.

:func:`flwr_pfl.clientapp.register_handlers` registers the handlers; each message builds the
algorithm's client for the node (run config ``algorithm``), which keeps its personal part in
``context.state``:

* FedRep and pFedFDA share the body and keep the head (``head="fc"``); the body's BatchNorm
  layers, running statistics included, are shared with it;
* FedBN shares everything but the BatchNorm layers: each node keeps their weights, biases,
  running statistics and step counters (no ``head=``: FedBN finds them by module type).

``frozen-norm`` (``TrainConfig.frozen_norm``) says what the BatchNorm layers of a frozen part do
in a phase that trains the rest; here that is FedRep's head phase, with the body frozen (the
head of either algorithm has no BatchNorm): ``"eval"`` keeps their running statistics as they
are, ``"train"`` lets them move, as the reference implementations do.
"""

from __future__ import annotations

from flwr.app import Context
from flwr.clientapp import ClientApp

from flwr_pfl.clientapp import register_handlers
from flwr_pfl.clients import FedBNClient, FedRepClient, PFedFDAClient, PFLClient, TrainConfig
from flwr_pfl.training import OptimizerConfig

from bnexample.task import HEAD, load_data, make_model

CLIENTS = {"fedrep": FedRepClient, "pfedfda": PFedFDAClient, "fedbn": FedBNClient}

app = ClientApp()


def client(context: Context) -> PFLClient:
    """The node's client for one message: its data, a fresh model (its personal part comes back
    from ``context.state``) and the run's training settings."""
    cfg = context.run_config
    data = load_data(int(context.node_config["partition-id"]), int(context.node_config["num-partitions"]),
                     str(cfg["data-dir"]), int(cfg["max-samples"]))
    train_config = TrainConfig(
        local_epochs=int(cfg["local-epochs"]),
        optimizer=OptimizerConfig(learning_rate=float(cfg["lr"]), momentum=0.9),
        frozen_norm=str(cfg["frozen-norm"]),  # type: ignore[arg-type]  # checked: "eval" or "train"
    )
    algorithm = str(cfg["algorithm"])
    head = None if algorithm == "fedbn" else HEAD
    return CLIENTS[algorithm](context, make_model(), data, train_config, head=head)


register_handlers(app, client)
