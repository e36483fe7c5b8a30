"""The ClientApp: Flower's quickstart-pytorch client switched to a flwr_pfl algorithm.

Flower's example defines a NumPyClient that trains ``Net`` with its own loop. Here the
algorithm's flwr_pfl client trains it instead, and ``head="fc3"`` names the layer that stays
personal (FedRep's head, pFedFDA's generative classifier's place; FEDORA keeps the whole model
personal and reads the head only to check the model). Switching algorithm is one entry of
``CLIENTS`` and of ``server_app.STRATEGIES``.
"""

from __future__ import annotations

import torch
from flwr.app import Context
from flwr.client import Client, ClientApp

from flwr_pfl.clients import FEDORAClient, FedRepClient, PFedFDAClient, TrainConfig
from flwr_pfl.training import OptimizerConfig

from pytorchexample.task import Net, load_data

CLIENTS = {"fedrep": FedRepClient, "pfedfda": PFedFDAClient, "fedora": FEDORAClient}


def client_fn(context: Context) -> Client:
    partition_id = int(context.node_config["partition-id"])
    num_partitions = int(context.node_config["num-partitions"])
    cfg = context.run_config
    data = load_data(partition_id, num_partitions, str(cfg["data-dir"]), int(cfg["max-samples"]))
    torch.manual_seed(0)  # the same initial Net on every client
    train = TrainConfig(local_epochs=int(cfg["local-epochs"]), optimizer=OptimizerConfig(learning_rate=float(cfg["lr"]), momentum=0.9))
    client = CLIENTS[str(cfg["algorithm"])]
    return client(context, Net(), data, train, head="fc3").to_client()


app = ClientApp(client_fn=client_fn)
