"""Flower's ``CustomFedAvg``, on top of flwr_pfl strategies instead of Flower's ``FedAvg``.

The body is Flower's, method for method: ``start`` is its own round loop (results saved to
``results.json`` every round, the global model saved whenever the server-side evaluation finds
a new best, W&B logging) and ``configure_train`` halves ``config["lr"]`` at round 5 before
calling the parent's. What changed:

* the body is a mixin, ``CustomStrategy``, put in front of each flwr_pfl algorithm
  (``FedRep``, ``PFedFDA``, ``FedPer`` from ``flwr_pfl.serverapp``); ``STRATEGIES`` maps the
  run config's ``algorithm`` to the class;
* the halving round is a class attribute (``lr_halving_round``, Flower's 5), so that a short
  run can reach it;
* W&B is off unless the run config says ``use-wandb = true``: the nodes this example runs on
  are offline, and ``wandb`` is then not even imported.
"""

from __future__ import annotations

import importlib
import io
import json
import os
import time
from collections.abc import Callable, Iterable
from logging import INFO
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common import log, logger
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from flwr.serverapp.strategy.strategy_utils import log_strategy_start_info

from flwr_pfl.serverapp import FedPer, FedRep, PFedFDA

PROJECT_NAME = "FLOWER-advanced-pytorch"


class CustomStrategy:
    """A mixin that gives a strategy the extra functionality of Flower's ``CustomFedAvg``: its
    ``start`` (1) saves results to the filesystem each round, (2) saves a checkpoint of the
    global model when a new best is found, (3) logs results to W&B (when ``use_wandb``); its
    ``configure_train`` implements a simple learning-rate schedule."""

    #: the round at which ``configure_train`` halves ``config["lr"]`` (Flower's: 5)
    lr_halving_round = 5
    #: log to W&B (the server app sets it from the run config's ``use-wandb``)
    use_wandb = False

    def set_save_path_and_run_dir(self, path: Path, run_dir: str) -> None:
        """Set the path where results and model checkpoints will be saved."""
        self.save_path = path
        self.run_dir = run_dir

    def _update_best_acc(self, current_round: int, accuracy: float, arrays: ArrayRecord) -> None:
        """Update best accuracy and save model checkpoint if current accuracy is higher."""
        if accuracy > self.best_acc_so_far:
            self.best_acc_so_far = accuracy
            logger.log(INFO, "💡 New best global model found: %f", accuracy)
            # Save the PyTorch model
            file_name = f"model_state_acc_{accuracy}_round_{current_round}.pth"
            torch.save(arrays.to_torch_state_dict(), self.save_path / file_name)
            logger.log(INFO, "💾 New best model saved to disk: %s", file_name)

    def save_metrics_as_json(self, current_round: int, result: Result) -> None:
        """Save the current results to a JSON file."""
        # Load current JSON if file exists
        if os.path.exists(f"{self.save_path}/results.json"):
            with open(f"{self.save_path}/results.json", encoding="utf-8") as fp:
                try:
                    results = json.load(fp)
                except json.JSONDecodeError:
                    results = []
        else:
            results = []

        # Extract metrics from current round
        round_results = {
            "round": current_round,
            "train_metrics": dict(result.train_metrics_clientapp.get(current_round, {})),
            "evaluate_metrics_clientapp": dict(result.evaluate_metrics_clientapp.get(current_round, {})),
            "evaluate_metrics_serverapp": dict(result.evaluate_metrics_serverapp.get(current_round, {})),
        }
        results.append(round_results)
        with open(f"{self.save_path}/results.json", "w", encoding="utf-8") as fp:
            json.dump(results, fp)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        """Configure the next round of federated training."""
        # Perform basic learning rate scheduling
        if server_round == self.lr_halving_round:  # half LR at round 5
            config["lr"] = config["lr"] * 0.5
            logger.log(INFO, "⚙️ Adjusted learning rate to %f", config["lr"])
        # Continue with the algorithm's configure_train
        return super().configure_train(server_round, arrays, config, grid)  # type: ignore[misc]

    def _wandb_log(self, metrics: MetricRecord, step: int) -> None:
        """``wandb.log`` where Flower's example calls it, when W&B is on."""
        if self._wandb is not None:
            self._wandb.log(dict(metrics), step=step)

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Execute the federated learning strategy logging results to W&B and saving them to disk."""
        # Init W&B (only when asked: offline nodes cannot reach it)
        self._wandb: Any = importlib.import_module("wandb") if self.use_wandb else None
        if self._wandb is not None:
            self._wandb.init(project=PROJECT_NAME, name=f"{str(self.run_dir)}-ServerApp")

        # Keep track of best acc
        self.best_acc_so_far = 0.0

        log(INFO, "Starting %s strategy:", self.__class__.__name__)
        log_strategy_start_info(num_rounds, initial_arrays, train_config, evaluate_config)
        self.summary()  # type: ignore[attr-defined]
        log(INFO, "")

        # Initialize if None
        train_config = ConfigRecord() if train_config is None else train_config
        evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
        result = Result()

        t_start = time.time()
        # Evaluate starting global parameters
        if evaluate_fn:
            res = evaluate_fn(0, initial_arrays)
            log(INFO, "Initial global evaluation results: %s", res)
            if res is not None:
                result.evaluate_metrics_serverapp[0] = res

        arrays = initial_arrays

        for current_round in range(1, num_rounds + 1):
            log(INFO, "")
            log(INFO, "[ROUND %s/%s]", current_round, num_rounds)

            # -----------------------------------------------------------------
            # --- TRAINING (CLIENTAPP-SIDE) -----------------------------------
            # -----------------------------------------------------------------

            # Call strategy to configure training round
            # Send messages and wait for replies
            train_replies = grid.send_and_receive(
                messages=self.configure_train(current_round, arrays, train_config, grid),
                timeout=timeout,
            )

            # Aggregate train
            agg_arrays, agg_train_metrics = self.aggregate_train(current_round, train_replies)  # type: ignore[attr-defined]

            # Log training metrics and append to history
            if agg_arrays is not None:
                result.arrays = agg_arrays
                arrays = agg_arrays
            if agg_train_metrics is not None:
                log(INFO, "\t└──> Aggregated MetricRecord: %s", agg_train_metrics)
                result.train_metrics_clientapp[current_round] = agg_train_metrics
                # Log to W&B
                self._wandb_log(agg_train_metrics, current_round)

            # -----------------------------------------------------------------
            # --- EVALUATION (CLIENTAPP-SIDE) ---------------------------------
            # -----------------------------------------------------------------

            # Call strategy to configure evaluation round
            # Send messages and wait for replies
            evaluate_replies = grid.send_and_receive(
                messages=self.configure_evaluate(current_round, arrays, evaluate_config, grid),  # type: ignore[attr-defined]
                timeout=timeout,
            )

            # Aggregate evaluate
            agg_evaluate_metrics = self.aggregate_evaluate(current_round, evaluate_replies)  # type: ignore[attr-defined]

            # Log training metrics and append to history
            if agg_evaluate_metrics is not None:
                log(INFO, "\t└──> Aggregated MetricRecord: %s", agg_evaluate_metrics)
                result.evaluate_metrics_clientapp[current_round] = agg_evaluate_metrics
                # Log to W&B
                self._wandb_log(agg_evaluate_metrics, current_round)

            # -----------------------------------------------------------------
            # --- EVALUATION (SERVERAPP-SIDE) ---------------------------------
            # -----------------------------------------------------------------

            # Centralized evaluation
            if evaluate_fn:
                log(INFO, "Global evaluation")
                res = evaluate_fn(current_round, arrays)
                log(INFO, "\t└──> MetricRecord: %s", res)
                if res is not None:
                    result.evaluate_metrics_serverapp[current_round] = res
                    # Maybe save to disk if new best is found
                    self._update_best_acc(current_round, res["accuracy"], arrays)
                    # Log to W&B
                    self._wandb_log(res, current_round)

            # Save metrics to disk as JSON
            self.save_metrics_as_json(current_round=current_round, result=result)

        log(INFO, "")
        log(INFO, "Strategy execution finished in %.2fs", time.time() - t_start)
        log(INFO, "")
        log(INFO, "Final results:")
        log(INFO, "")
        for line in io.StringIO(str(result)):
            log(INFO, "\t%s", line.strip("\n"))
        log(INFO, "")

        return result


class CustomFedRep(CustomStrategy, FedRep):
    """Flower's CustomFedAvg on FedRep: the body is shared; each client's head (``fc2``) stays on its node."""


class CustomPFedFDA(CustomStrategy, PFedFDA):
    """Flower's CustomFedAvg on pFedFDA: the body is shared; each client's head is a Gaussian
    classifier of its features, and the global model's head the one of the global statistics."""


class CustomFedPer(CustomStrategy, FedPer):
    """Flower's CustomFedAvg on FedPer: the body is shared; the head trains with it, on each node."""


STRATEGIES = {"fedrep": CustomFedRep, "pfedfda": CustomPFedFDA, "fedper": CustomFedPer}
