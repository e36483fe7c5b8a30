"""The round schedule (server): warm-up FedAvg rounds over the sources (App. C.2), then FDA rounds
with decayed learning rates (App. C.3/C.4); under the ``target`` placement an FDA round takes two
server rounds (sources, then target).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flwr_pfl.core.fedgp.config import FDAConfig
from flwr_pfl.core.fedgp.options import Phase, Placement, Stage


@dataclass(frozen=True)
class RoundPlan:
    """What one server round does (a pure function of the round number, see :func:`plan_round`).

    Attributes:
        phase: ``warmup`` or ``fda``.
        fda_round: 0 during warm-up, then 1, 2, ... (the paper's r).
        lr_scale: factor on every client's learning rate this round.
        stage: who trains in an FDA round (:class:`Stage`); ``all`` during warm-up (the
            sources train, the target idles).
        target_trains: whether the target client trains (FDA rounds of stage ``all`` or
            ``target``).
        sources_train: whether the sources train (warm-up, and stages ``all`` / ``sources``).
        record_step_updates: whether the target must record its per-step updates (auto mode,
            whenever the target trains).
        seed_round: the server round the same training has under the server placement, W + r;
            clients derive their seeds from it, so that both placements train identically.
    """

    phase: Phase
    fda_round: int
    lr_scale: float
    stage: Stage
    target_trains: bool
    sources_train: bool
    record_step_updates: bool
    seed_round: int


def plan_round(server_round: int, config: FDAConfig) -> RoundPlan:
    """The phase, lr factor and duties of server round ``server_round`` (1-based).

    Rounds 1..W are FedAvg over the sources only (App. C.2 "initialization": W = 2, or 5 for
    TerraIncognita); the rounds after are FDA rounds, with the learning rates multiplied by
    ``config.lr_decay_after_warmup`` (C.3/C.4, auto variants). With the ``server`` placement
    server round W + r is FDA round r; with the ``target`` placement FDA round r takes server
    rounds W + 2r - 1 (sources) and W + 2r (target).

    Raises:
        ValueError: ``server_round`` is not an integer >= 1.
    """
    if isinstance(server_round, bool) or not isinstance(server_round, (int, np.integer)) or server_round < 1:
        raise ValueError(f"server_round must be an integer >= 1 (Flower counts from 1); got {server_round!r}")
    w = config.warmup_rounds
    if server_round <= w:
        return RoundPlan(Phase.WARMUP, 0, 1.0, Stage.ALL, False, True, False, int(server_round))
    k = int(server_round) - w
    if config.placement is Placement.SERVER:
        fda_round, stage = k, Stage.ALL
    else:
        fda_round, stage = (k + 1) // 2, (Stage.SOURCES if k % 2 else Stage.TARGET)
    target_trains = stage is not Stage.SOURCES
    return RoundPlan(
        Phase.FDA,
        fda_round,
        float(config.lr_decay_after_warmup),
        stage,
        target_trains=target_trains,
        sources_train=stage is not Stage.TARGET,
        record_step_updates=bool(config.auto_weight) and target_trains,
        seed_round=w + fda_round,
    )
