"""pFedMe's Strategy (T. Dinh, Tran and Nguyen, NeurIPS 2020, Alg. 1): the average of the
clients' local models, mixed with the previous global model by beta."""

from __future__ import annotations

from typing import Any

import numpy as np
from flwr.common import FitRes
from flwr.server.client_proxy import ClientProxy

from flwr_pfl.core.aggregation import weighted_average
from flwr_pfl.core.pfedme import BUFFER_MASK, server_step
from flwr_pfl.errors import ConfigError, ReplyError
from flwr_pfl.strategies.base import PFLStrategy
from flwr_pfl.strategies.validation import ClientReply

NDArrays = list[np.ndarray]
#: values of ``weighting``: how the clients' local models are averaged
WEIGHTINGS = ("examples", "uniform")


class PFedMe(PFLStrategy):
    """pFedMe's server: w^{t+1} = (1 - beta) w^t + beta * average_i w_{i,R} (Alg. 1's global
    update, :func:`~flwr_pfl.core.pfedme.server_step`), w^t being the global arrays the round sent.

    Wire: the whole model both ways (:class:`~flwr_pfl.clients.pfedme.PFedMeClient`); each fit
    reply's ``buffer_mask`` metric ('1' per buffer, '0' per parameter, in wire order) keeps the
    model's buffers (BatchNorm statistics, step counters) out of the beta step: they take the
    average as it is, as in the authors' code, whose beta step covers ``model.parameters()`` only
    (with beta > 1 a running variance could otherwise turn negative). A reply without the metric
    (a client from outside the suite) has every floating-point array moved; an array any reply
    flags as a buffer is not moved; a malformed mask rejects its reply.

    The average: Alg. 1 writes the uniform mean over the S sampled clients; the authors' code
    (``persionalized_aggregate_parameters``, the uniform line commented out), PFLlib and FL-bench
    weight by the clients' training examples. ``weighting="examples"`` (default) follows the
    codes, ``"uniform"`` the paper's formula. ``clip_update_norm`` and
    ``aggregate="trimmed-mean"`` apply as for FedAvg (the replies are the global model trained
    further): clipping bounds each reply's update before the average, the trimmed mean (always
    unweighted) replaces the average, and the beta step follows either, so one client's pull
    on the global model is at most beta times what it is under FedAvg.

    Args:
        beta: beta > 0 (1: plain averaging, the paper's pFedMe; the paper also runs beta = 2).
        weighting: ``"examples"`` or ``"uniform"`` (see above).
        **kwargs: :class:`PFLStrategy`'s arguments.

    Raises:
        ConfigError: ``beta`` or ``weighting`` out of range.
    """

    name = "pfedme"

    def __init__(self, *, beta: float = 1.0, weighting: str = "examples", **kwargs: Any) -> None:
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not (beta > 0 and np.isfinite(beta)):
            raise ConfigError(f"PFedMe: beta (pfedme.beta) must be a finite number > 0 (1 = plain averaging), got {beta!r}")
        if weighting not in WEIGHTINGS:
            raise ConfigError(f"PFedMe: weighting (pfedme.weighting) = {weighting!r} is not allowed; choose one of "
                              f"{', '.join(map(repr, WEIGHTINGS))}")
        super().__init__(**kwargs)
        if weighting == "uniform" and self.secure_aggregation:
            raise ConfigError("PFedMe: pfedme.weighting='uniform' cannot be used with secure-aggregation: SecAgg+ "
                              "weights every reply by its number of examples; use pfedme.weighting='examples'")
        self.beta = float(beta)
        self.weighting = weighting

    @classmethod
    def _default_refusal(cls) -> str:
        """No refusal of the reply bounds: the replies are the global arrays trained further and
        the base's average (clipped, or trimmed) is kept; only the beta step is added on top."""
        return ""

    def check_reply(self, server_round: int, proxy: ClientProxy, res: FitRes) -> ClientReply:
        """The base's checks, and a ``buffer_mask`` metric, when present, of one '0'/'1' per array."""
        reply = super().check_reply(server_round, proxy, res)
        mask = reply.metrics.get(BUFFER_MASK)
        if mask is not None and (not isinstance(mask, str) or len(mask) != len(reply.arrays) or set(mask) - {"0", "1"}):
            raise ReplyError(f"client {proxy.cid} (partition {reply.partition_id}): metric {BUFFER_MASK!r} must be one "
                             f"'0' or '1' per array ({len(reply.arrays)}), got {mask!r}")
        return reply

    def aggregate_replies(self, server_round: int, replies: list[ClientReply]) -> NDArrays:
        average = self.average(server_round, replies)
        if not average or self.global_arrays is None:
            return average
        return server_step(self.global_arrays, average, self.beta, self.moving_arrays(replies, len(average)))

    def average(self, server_round: int, replies: list[ClientReply]) -> NDArrays:
        """The clients' local models averaged: by ``weighting`` for the mean, else the base's rule
        (trimmed mean; client-level DP, which is uniform itself)."""
        if self.weighting == "uniform" and self.aggregate == "mean" and self.private is None and replies[0].arrays:
            return weighted_average([r.arrays for r in replies], [1.0] * len(replies))
        return super().aggregate_replies(server_round, replies)

    @staticmethod
    def moving_arrays(replies: list[ClientReply], count: int) -> list[bool]:
        """Which arrays the beta step moves: those no reply's ``buffer_mask`` flags as a buffer."""
        moves = [True] * count
        for reply in replies:
            mask = reply.metrics.get(BUFFER_MASK)
            if isinstance(mask, str):
                moves = [move and flag == "0" for move, flag in zip(moves, mask)]
        return moves
