"""The FedGP / FedDA client: one NumPyClient that plays the source or the target role.

Wire layout: see :mod:`flwr_pfl.strategies.fedgp`. The role is fixed per node: the node config
key ``fedgp-role`` (``target`` or ``source``, for deployments) wins; otherwise the client is the
target when its partition id equals ``target_partition`` (-1: the last partition). Every round
the client trains from the global model with a fresh optimizer (App. C: a new Adam each round),
as the server's ``fedgp.*`` instructions say; nothing of the algorithm persists on the client.

The target trains on its own labelled subset (``target_train_samples``, drawn once from its
training split with a seed derived from the run seed and partition id, so it is the same every
round and after every re-creation of the client), with batch size ``target_batch_size`` and
learning rate ``target_lr_ratio`` x the run's learning rate x the server's ``lr-scale``. In auto
mode it records one parameter delta per optimizer step (Algorithm 1, step 4), through the shared
train loop's ``after_step`` hook. Under the target placement (App. C.1 / C.4) the target also
aggregates: :func:`aggregate_as_target` runs the core's ``fda_round`` on the forwarded source
models and returns the new global model.
"""

from __future__ import annotations

import dataclasses
import json
from logging import WARNING

import numpy as np
import torch
from flwr.app import Context
from flwr.common import log
from torch import nn
from torch.utils.data import Subset

from flwr_pfl.app.node_settings import ROLE, role_setting
from flwr_pfl.clients.base import Config, LocalData, NDArrays, PFLClient, TrainConfig, seeded_message
from flwr_pfl.core.fedgp import (
    FDAConfig,
    SourceUpdate,
    Stage,
    TargetUpdate,
    TensorRole,
    fda_round,
    model_delta,
    prepare_step_updates,
    summarize_step_updates,
    tensor_roles,
)
from flwr_pfl.errors import ConfigError
from flwr_pfl.models.split import HeadSpec
from flwr_pfl.training import get_arrays, loader_like, num_samples
from flwr_pfl.training.params import buffer_flags

ROLE_KEY = ROLE


class FedGPClient(PFLClient):
    """Source or target of FedGP / FedDA (and of the Target Only / Source Only baselines).

    The whole model moves, so any ``torch.nn.Module`` works as it is (``head`` is accepted and
    not needed).

    Args:
        context, model, data, train_config, head: as :class:`~flwr_pfl.clients.base.PFLClient`.
        target_partition: partition id of the target; -1 = the last partition.
        target_train_samples: labelled training samples the target uses (0 = its whole
            training split); fewer available is a ConfigError.
        target_train_fraction: instead of a count, this fraction of its training split
            (rounded, at least 1; 0 = unused).
        target_lr_ratio: lr_T / lr_S (DomainBed code 0.2; Fashion-MNIST / CIFAR-10 code 0.5).
        target_batch_size: the target's batch size (0 = the run's batch size).

    Raises:
        ConfigError: a target partition outside the federation, a bad ``fedgp-role`` value, more
            target samples asked for than the target has, or (for every client, from
            :class:`~flwr_pfl.clients.base.PFLClient`) no training samples.
    """

    #: DP-SGD covers this client although it has its own fit: every use of its data is a step of
    #: the shared train loop (DP-SGD's Poisson batches, of the target's batch size on the target),
    #: and what it uploads or aggregates (its model, its per-step updates, the target's
    #: projections and auto-weights) is computed from DP-SGD's iterates and the other clients'
    #: models alone: post-processing of a release DP-SGD's accounting already covers
    record_dp_refusal = ""

    shared_group = "all"

    def __init__(
        self,
        context: Context,
        model: nn.Module,
        data: LocalData,
        train_config: TrainConfig | None = None,
        *,
        head: HeadSpec | None = None,
        target_partition: int = -1,
        target_train_samples: int = 0,
        target_train_fraction: float = 0.0,
        target_lr_ratio: float = 0.5,
        target_batch_size: int = 16,
    ) -> None:
        super().__init__(context, model, data, train_config, head=head)
        if not target_lr_ratio > 0:
            raise ConfigError(f"target_lr_ratio must be > 0; got {target_lr_ratio}")
        self.target_lr_ratio = float(target_lr_ratio)
        self.is_target = self._role(context, target_partition)
        if self.is_target:
            self.data = self._target_data(data, target_train_samples, target_train_fraction, target_batch_size)

    def _role(self, context: Context, target_partition: int) -> bool:
        role = role_setting(context.node_config, self.who)
        if role is not None:
            return role == "target"
        num = int(context.node_config.get("num-partitions", 0))
        if target_partition < -1:
            raise ConfigError(f"target_partition={target_partition} (run config <algorithm>.target-partition) must be -1 (the last partition) or >= 0")
        if num > 0 and target_partition >= num:
            raise ConfigError(
                f"target_partition={target_partition} (run config <algorithm>.target-partition) is outside the federation of {num} partitions "
                f"(allowed: -1 or 0..{num - 1})"
            )
        if target_partition == -1:
            return num > 0 and self.partition_id == num - 1
        return self.partition_id == target_partition

    def _target_data(self, data: LocalData, samples: int, fraction: float, batch_size: int) -> LocalData:
        dataset = data.train.dataset
        available = num_samples(data.train)  # > 0: PFLClient.check_training_data
        if not 0.0 <= fraction <= 1.0:
            raise ConfigError(f"target_train_fraction={fraction} (run config <algorithm>.target-train-fraction) must lie in [0, 1] (0 = unused)")
        if fraction > 0:
            samples = max(1, round(fraction * available))
        if samples < 0:
            raise ConfigError(f"target_train_samples={samples} (run config <algorithm>.target-train-samples) must be >= 0 (0 = all)")
        if samples > available:
            raise ConfigError(
                f"target-train-samples={samples} but the target (partition {self.partition_id}) has only "
                f"{available} training samples"
            )
        if samples:
            g = torch.Generator().manual_seed(10_007 * (self.train_config.seed + 1) + self.partition_id)
            dataset = Subset(dataset, torch.randperm(available, generator=g)[:samples].tolist())
        bs = batch_size or self.train_config.batch_size
        # drop_last=False: with tiny targets every sample counts; shuffling uses the per-round seed.
        return dataclasses.replace(data, train=loader_like(data.train, dataset, batch_size=bs, shuffle=True))

    # ---------------------------------------------------------------- NumPyClient
    def round_seed(self, config: Config) -> int:
        """Seeded by ``fedgp.seed-round`` when sent (W + r, the same under both placements)."""
        if "fedgp.seed-round" in config:
            config = {**config, "server-round": int(config["fedgp.seed-round"])}
        return super().round_seed(config)

    @seeded_message
    def fit(self, parameters: NDArrays, config: Config) -> tuple[NDArrays, int, Config]:
        aggregates = self.is_target and config.get("fedgp.stage") == Stage.TARGET.value
        n_model = len(self.model.state_dict())
        glob = list(parameters[:n_model]) if aggregates else list(parameters)
        self.receive(glob)
        n = num_samples(self.data.train)
        flags = buffer_flags(self.model)
        base = {"partition_id": self.partition_id, "is_target": int(self.is_target),
                "buffer_mask": "".join("1" if f else "0" for f in flags)}
        trains = bool(config.get("fedgp.target-trains" if self.is_target else "fedgp.sources-train", True))
        if not trains:
            return [], n, {**base, "skipped": 1}
        self.start_private_steps(config, batch_size=getattr(self.data.train, "batch_size", None))
        factor = float(config.get("fedgp.lr-scale", 1.0)) * (self.target_lr_ratio if self.is_target else 1.0)
        optimizer = self.train_config.optimizer.scaled(factor)
        record = self.is_target and bool(config.get("fedgp.record-steps", False))
        steps: list[NDArrays] = []
        after_step = None
        if record:
            prev = [a.astype(np.float32) for a in get_arrays(self.model)]

            def after_step(model, step: int) -> None:
                nonlocal prev
                cur = [a.astype(np.float32) for a in get_arrays(model)]
                steps.append([c - p for c, p in zip(cur, prev)])
                prev = cur

        stats = self.train_groups(("all",), self.train_config.local_epochs, optimizer=optimizer, after_step=after_step)
        arrays = self.get_parameters(config)
        metrics: Config = {**base, "num_steps": stats.steps, "lr": optimizer.learning_rate,
                           "train_loss": stats.loss, "train_seconds": stats.seconds, "n_model_arrays": len(arrays),
                           **self.finish_private_steps()}
        if aggregates:
            cfg = fda_config_from(config)
            g = self._step_matrix(steps, arrays, flags, cfg) if record else None
            new_global, extra = aggregate_as_target(glob, parameters[n_model:], arrays, g, cfg, flags, config, metrics)
            return new_global, n, {**metrics, **extra}
        if record:
            max_rows = int(config.get("fedgp.max-step-updates", 0))
            cfg = FDAConfig(
                buffer_role=str(config.get("fedgp.buffer-role", "fedavg")),
                scalar_role=str(config.get("fedgp.scalar-role", "fedavg")),
                max_step_updates=max_rows or None,
            )
            g = self._step_matrix(steps, arrays, flags, cfg)
            if config.get("fedgp.step-upload", "matrix") == "summary":
                metrics["step_rows"] = int(g.shape[0])
                if g.shape[0] >= 2:
                    metrics["step_var"] = float(summarize_step_updates(g).sample_target_var)
            else:
                arrays = arrays + [g]
        return arrays, n, metrics

    @staticmethod
    def _step_matrix(steps: list[NDArrays], arrays: NDArrays, flags: list[bool], cfg: FDAConfig) -> np.ndarray:
        """The recorded per-step updates as the B' x m matrix of the aggregated tensors."""
        roles = tensor_roles(arrays, cfg, flags)
        if not steps:
            log(WARNING, "target took no optimizer step; no step updates to use")
            m = sum(a.size for a, r in zip(arrays, roles) if r is TensorRole.AGGREGATE)
            return np.zeros((0, m), dtype=np.float32)
        return prepare_step_updates(steps, roles, cfg)

    @seeded_message
    def evaluate(self, parameters: NDArrays, config: Config) -> tuple[float, int, Config]:
        loss, n, metrics = super().evaluate(parameters, config)
        return loss, n, {**metrics, "is_target": int(self.is_target)}


def fda_config_from(config: Config) -> FDAConfig:
    """The aggregation options the server sent as ``fedgp.cfg.<option>`` (target placement)."""
    prefix = "fedgp.cfg."
    values = {k[len(prefix):]: v for k, v in config.items() if k.startswith(prefix)}
    if not values:
        raise ValueError("the target was asked to aggregate but the instructions carry no fedgp.cfg.* options")
    return FDAConfig.from_scalars(values)


def aggregate_as_target(
    glob: NDArrays,
    source_arrays: NDArrays,
    trained: NDArrays,
    step_matrix: np.ndarray | None,
    cfg: FDAConfig,
    flags: list[bool],
    config: Config,
    train_metrics: Config,
) -> tuple[NDArrays, Config]:
    """Target placement (App. C.1 / C.4): the new global model from the target's own update
    and the sources' models the server forwarded, by the same
    :func:`~flwr_pfl.core.fedgp.fda_round` the server runs under the server placement.

    Returns:
        the new global arrays and metrics ``fda.<name>_s<j>`` (j = the source's position in
        the order received).

    Raises:
        ValueError: the payload does not hold one model per source described in
            ``fedgp.sources`` (the server then counts this client as failed).
    """
    meta = json.loads(str(config.get("fedgp.sources", "[]")))
    n_model = len(glob)
    if len(source_arrays) != n_model * len(meta):
        raise ValueError(
            f"target placement: received {len(source_arrays)} source arrays for {len(meta)} sources "
            f"of {n_model} arrays each"
        )
    if not meta:
        log(WARNING, "target placement: no source models this round; the target's model becomes the global model")
        return trained, {}
    sources = [
        SourceUpdate(model_delta(source_arrays[i * n_model : (i + 1) * n_model], glob), float(m["n"]), float(m["lr"]), int(m["steps"]))
        for i, m in enumerate(meta)
    ]
    target = TargetUpdate(
        model_delta(trained, glob), lr=float(train_metrics["lr"]), steps=int(train_metrics["num_steps"]), step_matrix=step_matrix
    )
    result = fda_round(glob, target, sources, cfg, tensor_roles(glob, cfg, flags))
    for note in result.notes:
        log(WARNING, "%s", note)
    stats = result.metrics([f"s{j}" for j in range(len(sources))])
    return result.new_global, {f"fda.{k}": v for k, v in stats.items()}
