"""The ClientApp of Flower's advanced-pytorch example, switched to a flwr_pfl algorithm.

Flower's example writes ``@app.train()`` and ``@app.evaluate()`` handlers that load the
received weights, restore the node's own classification head (``fc2``) from ``context.state``,
train or test, save the head back and build the reply. Here
:func:`flwr_pfl.clientapp.register_handlers` registers both: each message builds the
algorithm's client for the node (FedRep, pFedFDA or FedPer, by the run config's
``algorithm``), which does all of that with the personal head ``head="fc2"`` kept in
``context.state``. Training settings are Flower's: SGD with momentum 0.9, ``local-epochs``
epochs, and the learning rate the server sends each round (``lr``, halved by the strategy's
schedule), which flwr_pfl's clients read from the round's config. The client metrics are
flwr_pfl's (``accuracy``, ``loss``, ``train_loss``); the server app also names them as
Flower's did (``eval_acc``, ``eval_loss``).
"""

from __future__ import annotations

import torch
from flwr.app import Context
from flwr.clientapp import ClientApp

from flwr_pfl.clientapp import register_handlers
from flwr_pfl.clients import FedPerClient, FedRepClient, PFedFDAClient, PFLClient, TrainConfig
from flwr_pfl.training import OptimizerConfig

from advancedexample.task import Net, load_data

CLIENTS = {"fedrep": FedRepClient, "pfedfda": PFedFDAClient, "fedper": FedPerClient}

# Flower ClientApp
app = ClientApp()


def client(context: Context) -> PFLClient:
    """The node's client for one message: its partition, a fresh ``Net`` (its personal head
    comes back from ``context.state``) and Flower's training settings."""
    cfg = context.run_config
    data = load_data(int(context.node_config["partition-id"]), int(context.node_config["num-partitions"]),
                     str(cfg["data-dir"]), int(cfg["max-samples"]))
    # the round's "lr" from the server replaces learning_rate (the run's lr) in every training message
    optimizer = OptimizerConfig(learning_rate=float(cfg["lr"]), momentum=0.9)
    train_config = TrainConfig(local_epochs=int(cfg["local-epochs"]), optimizer=optimizer)
    torch.manual_seed(0)  # the same initial Net as the server's
    return CLIENTS[str(cfg["algorithm"])](context, Net(), data, train_config, head="fc2")


register_handlers(app, client)
