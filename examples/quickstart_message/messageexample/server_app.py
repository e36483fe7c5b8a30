"""The ServerApp of Flower's Message-API quickstart with a flwr_pfl strategy instead of FedAvg.

The strategy is used exactly as Flower's: ``start`` with the initial arrays (the whole
``Net().state_dict()``; the strategy keeps the part its algorithm shares, e.g. FedRep's body),
a train config (``learning-rate`` is the key flwr_pfl's clients read) and the number of rounds;
it returns Flower's ``Result``. Flower's template also passes ``evaluate_fn`` to evaluate the
global model on the server: a personalized algorithm has no complete global model (FedRep's
heads stay on the nodes), so the clients evaluate their personalized models instead
(``Result.evaluate_metrics_clientapp``).
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp

from flwr_pfl.serverapp import FEDORA, FedRep, PFedFDA

from messageexample.task import Net

STRATEGIES = {"fedrep": FedRep, "pfedfda": PFedFDA, "fedora": FEDORA}

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    num_rounds = int(cfg["num-server-rounds"])
    strategy = STRATEGIES[str(cfg["algorithm"])](fraction_train=float(cfg["fraction-train"]), num_rounds=num_rounds)
    torch.manual_seed(0)  # the clients' initial Net too
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(Net().state_dict()),
        train_config=ConfigRecord({"learning-rate": float(cfg["lr"])}),
        num_rounds=num_rounds,
    )
    if cfg["final-model"]:
        torch.save(result.arrays.to_torch_state_dict(), str(cfg["final-model"]))  # the shared part
