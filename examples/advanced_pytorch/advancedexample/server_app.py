"""The ServerApp of Flower's advanced-pytorch example, with a flwr_pfl strategy.

As Flower's: the whole ``Net().state_dict()`` as the initial arrays, the subclassed strategy
(:mod:`advancedexample.strategy`), ``lr`` in the train config, the run directory for the
results, the server-side ``evaluate_fn`` (it loads the arrays into a fresh ``Net`` with
``load_state_dict``) and the final model saved. What changed:

* the strategy's parent is the flwr_pfl algorithm the run config's ``algorithm`` names;
* its constructor is told ``num_rounds``: the subclass runs Flower's round loop itself, so the
  library's own ``start()``, which would tell the algorithm the run's length, is not called
  (pFedFDA has every client train in the last round, and refuses to start without knowing it);
* ``metric_names`` keeps the names Flower's client reported its metrics under
  (``eval_acc``, ``eval_loss``) next to flwr_pfl's (``accuracy``, ``loss``);
* ``lr`` comes from the run config (Flower's 0.1 by default), so that a short run on a few
  hundred images, where 0.1 with momentum 0.9 is too much for pFedFDA, can take a smaller one;
* the central test set is a slice of the local Fashion-MNIST test images (``central-samples``),
  read from disk, not downloaded; the final model goes to ``final-model``.

The arrays the strategy hands back (to ``evaluate_fn`` and in ``result.arrays``) are the whole
``state_dict`` again: the shared part trained and, for the part each client keeps (FedRep's and
FedPer's head ``fc2``), the values given to ``start()``, except pFedFDA's head, which is the
Gaussian classifier of the global feature statistics.
"""

from __future__ import annotations

from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from advancedexample.strategy import STRATEGIES
from advancedexample.task import Net, create_run_dir, load_centralized_testset, test

# Create ServerApp
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Main entry point for the ServerApp."""
    # Read run config
    cfg = context.run_config
    num_rounds = int(cfg["num-server-rounds"])
    fraction_train = float(cfg["fraction-train"])
    fraction_eval = float(cfg["fraction-evaluate"])
    device = str(cfg["server-device"])

    # Load global model (seeded: the clients build the same initial Net)
    torch.manual_seed(0)
    global_model = Net()
    arrays = ArrayRecord(global_model.state_dict())

    # Initialize the strategy of the chosen algorithm
    strategy = STRATEGIES[str(cfg["algorithm"])](
        fraction_train=fraction_train,
        fraction_evaluate=fraction_eval,
        num_rounds=num_rounds,
        metric_names={"accuracy": "eval_acc", "loss": "eval_loss"},
    )
    strategy.use_wandb = bool(cfg["use-wandb"])

    # Define directory for results and save config
    save_path, run_dir = create_run_dir(config=cfg, outputs_dir=str(cfg["outputs-dir"]))
    strategy.set_save_path_and_run_dir(save_path, run_dir)

    # Start strategy, run the algorithm for `num_rounds`
    result = strategy.start(
        grid=grid,
        initial_arrays=arrays,
        train_config=ConfigRecord({"lr": float(cfg["lr"])}),
        num_rounds=num_rounds,
        evaluate_fn=get_global_evaluate_fn(device=device, data_dir=str(cfg["data-dir"]), samples=int(cfg["central-samples"])),
    )

    # Save final model to disk
    print("\nSaving final model to disk...")
    state_dict = result.arrays.to_torch_state_dict()
    torch.save(state_dict, Path(str(cfg["final-model"])).expanduser())


def get_global_evaluate_fn(device: str, data_dir: str, samples: int):
    """Return an evaluation function for server-side evaluation."""

    def global_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        """Evaluate model on central data."""
        # Fashion-MNIST's test images, from the same local files the clients read theirs from
        testloader = load_centralized_testset(data_dir, samples)

        net = Net()
        net.load_state_dict(arrays.to_torch_state_dict())
        net.to(device)
        loss, accuracy = test(net, testloader, device=device)
        return MetricRecord({"accuracy": accuracy, "loss": loss})

    return global_evaluate
