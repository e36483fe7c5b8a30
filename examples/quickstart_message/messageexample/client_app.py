"""The ClientApp of Flower's Message-API quickstart, switched to a flwr_pfl algorithm.

Flower's template writes ``@app.train()`` and ``@app.evaluate()`` handlers around its own
training loop. Here :func:`flwr_pfl.clientapp.register_handlers` registers them: each message
builds the algorithm's client for the node, which trains the user's ``Net`` and keeps its
personal part (``head="fc3"``: FedRep's head; FEDORA keeps the whole model) in
``context.state``.
"""

from __future__ import annotations

import torch
from flwr.app import Context
from flwr.clientapp import ClientApp

from flwr_pfl.clientapp import register_handlers
from flwr_pfl.clients import FEDORAClient, FedRepClient, PFedFDAClient, PFLClient, TrainConfig
from flwr_pfl.training import OptimizerConfig

from messageexample.task import Net, load_data

CLIENTS = {"fedrep": FedRepClient, "pfedfda": PFedFDAClient, "fedora": FEDORAClient}

app = ClientApp()


def client(context: Context) -> PFLClient:
    """The node's client for one message: its data, a fresh ``Net`` (its personal part comes
    back from ``context.state``) and the run's training settings."""
    cfg = context.run_config
    data = load_data(int(context.node_config["partition-id"]), int(context.node_config["num-partitions"]),
                     str(cfg["data-dir"]), int(cfg["max-samples"]))
    torch.manual_seed(0)  # the same initial Net on every client
    train = TrainConfig(local_epochs=int(cfg["local-epochs"]), optimizer=OptimizerConfig(learning_rate=float(cfg["lr"]), momentum=0.9))
    return CLIENTS[str(cfg["algorithm"])](context, Net(), data, train, head="fc3")


register_handlers(app, client)
