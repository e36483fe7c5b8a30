"""The ServerApp of Flower's Message-API quickstart with a flwr_pfl strategy instead of FedAvg.

The strategy is used exactly as Flower's: ``start`` with the initial arrays (the whole
``Net().state_dict()``; the strategy sends the part its algorithm shares, e.g. FedRep's body),
a train config (``learning-rate``, or ``lr`` as Flower's examples write it) and the number of
rounds; it returns Flower's ``Result``, whose ``arrays`` load into ``Net``. Server-side
evaluation (``evaluate_fn``) is left out here: FedRep's global ``Net`` carries the head it was
started with (each client's trained head stays on its node), and FEDORA has no global model (it
refuses ``evaluate_fn``); the clients evaluate their personalized models instead
(``Result.evaluate_metrics_clientapp``). ``examples/advanced_pytorch`` shows server-side
evaluation."""

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
        # the whole Net: the part the algorithm shares, trained; the rest (FedRep's fc3) as given
        # above, since each client's own head stays on its node. FEDORA has no global model:
        # its result.arrays is empty.
        torch.save(result.arrays.to_torch_state_dict(), str(cfg["final-model"]))
