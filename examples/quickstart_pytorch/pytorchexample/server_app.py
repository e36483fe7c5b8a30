"""The ServerApp: Flower's quickstart-pytorch server with a flwr_pfl strategy instead of FedAvg.

The strategies take FedAvg's arguments (``fraction_evaluate``, ``on_fit_config_fn``, ...), so
the server keeps the shape of Flower's example; ``num_clients`` is the federation's size and
``num_rounds`` lets pFedFDA treat its last round as the paper does.
"""

from __future__ import annotations

from flwr.app import Context
from flwr.server import ServerApp, ServerAppComponents, ServerConfig

from flwr_pfl.strategies import FEDORA, FedRep, PFedFDA

STRATEGIES = {"fedrep": FedRep, "pfedfda": PFedFDA, "fedora": FEDORA}


def server_fn(context: Context) -> ServerAppComponents:
    cfg = context.run_config
    rounds = int(cfg["num-server-rounds"])
    strategy = STRATEGIES[str(cfg["algorithm"])](
        num_clients=int(cfg["num-clients"]),
        fraction_evaluate=1.0,
        num_rounds=rounds,
        on_fit_config_fn=lambda server_round: {"learning-rate": float(cfg["lr"]) * 0.95 ** (server_round - 1)},
    )
    return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=rounds))


app = ServerApp(server_fn=server_fn)
