"""The ServerApp: Flower's Message-API ``start()`` with a flwr_pfl strategy (FedRep, pFedFDA or
FedBN) instead of FedAvg, over torchvision's ResNet-18, which has BatchNorm layers.

The strategy starts from the model's whole ``state_dict`` (BatchNorm's running statistics and
step counters included) and sends the part its algorithm shares. ``result.arrays`` is that whole
``state_dict`` again, loadable into the model with ``load_state_dict``: the shared part trained,
and the part each client keeps as it was given (FedRep's head, FedBN's BatchNorm layers: the
trained ones stay on the nodes), except pFedFDA's head, the Gaussian classifier of the global
feature statistics. The clients evaluate their personalized models
(``result.evaluate_metrics_clientapp``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp

from flwr_pfl.serverapp import FedBN, FedRep, PFedFDA

from bnexample.task import make_model

STRATEGIES = {"fedrep": FedRep, "pfedfda": PFedFDA, "fedbn": FedBN}

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    num_rounds = int(cfg["num-server-rounds"])
    strategy = STRATEGIES[str(cfg["algorithm"])](
        fraction_train=float(cfg["fraction-train"]), fraction_evaluate=float(cfg["fraction-evaluate"]))
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(make_model().state_dict()),  # seed 0, as the clients'
        train_config=ConfigRecord({"lr": float(cfg["lr"])}),
        num_rounds=num_rounds,
    )
    if cfg["final-model"]:
        torch.save(result.arrays.to_torch_state_dict(), Path(str(cfg["final-model"])).expanduser())
