"""FedPAC's Strategy (Xu, Tong and Huang, ICLR 2023, Alg. 1): averaged body, global prototypes
and one combined head per client. The mathematics is in :mod:`flwr_pfl.core.fedpac`.

Wire layout (C classes, d feature width; B body arrays, H head arrays, in ``state_dict`` order)
-------------------------------------------------------------------------------------------
* global arrays (``get_parameters``, what checkpoints and export hold):
  ``[body (B)..., head (H)..., fedpac:prototypes (C, d) float32, fedpac:prototype-counts (C,)
  float32]``; the head is the example-weighted mean of the trained heads (the authors' global
  model holds it; no client uses it), a class with count 0 has no global prototype.
* fit and evaluate instructions, *per client*: the global arrays, except that the head slot
  holds this client's combined head ``sum_j alpha_ij head_j`` when the server has one for it
  (config ``fedpac-head = True``; ``False``: the slot is the averaged head and the client keeps
  its own head); config ``server-round``.
* fit reply: ``[trained body (B)..., trained head (H)..., local prototypes (C, d), class counts
  (C,), fedpac:class-means (C, d), fedpac:variance (1,)]``: the prototypes from the trained
  body; the class means and ``V_i`` from the received body before training (the QP's
  statistics, Sec. 4.3); ``num_examples = n_i``; metrics ``partition_id``, ``head_arrays`` (H),
  ``train_loss``, ``head_loss``, ``train_seconds``, ``variance``.
* evaluate reply: loss, ``num_examples`` (test split) and ``accuracy`` of the averaged body with
  the client's head.

Server, each round: body and head by FedAvg over the replies, global prototypes (Sec. 4.2), and
for each replying client i its weights ``alpha_i`` from the QP over the replying clients
(Eq. 10-12) and its combined head, kept by partition id until it next takes part (a client
that does not reply keeps the previous one). The combined heads are part of
:meth:`FedPAC.state_dict`, so a resumed run sends every client the head it would have got.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from flwr.common import EvaluateIns, FitIns, FitRes, Parameters, ndarrays_to_parameters
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy

from flwr_pfl.core.aggregation import weighted_average
from flwr_pfl.core.fedpac import (
    HEAD_ARRAYS,
    HEAD_KEY,
    aggregate_prototypes,
    combination_weights,
    combine_heads,
    prior_weighted_means,
    qp_matrix,
)
from flwr_pfl.errors import ConfigError, ReplyError
from flwr_pfl.strategies.base import NDArrays, PFLStrategy
from flwr_pfl.strategies.validation import ClientReply, Scalar


class FedPAC(PFLStrategy):
    """FedPAC's server: FedAvg of the model, prototypes by class counts, a QP per client for its
    combined head (see the module docstring for the wire).

    Args:
        **kwargs: :class:`PFLStrategy`'s arguments.
    """

    name = "fedpac"
    needs_partition_ids = True  # each client is sent its own combined head
    robust_refusal = ("FedPAC's replies carry prototypes and statistics beside the model, and each client's head is "
                      "combined by its own QP weights")

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        #: partition id -> its combined head (H arrays), from the last round it took part in
        self.heads: dict[int, NDArrays] = {}
        #: H, learned from the first reply (the fit metric ``head_arrays``)
        self.head_arrays: int | None = None

    # ---------------------------------------------------------------- instructions
    def personal_arrays(self, pid: int | None) -> tuple[NDArrays, bool]:
        """The global arrays with the head slot holding ``pid``'s combined head, and whether it
        does (False: no head for it yet; the slot keeps the averaged head)."""
        arrays = list(self.global_arrays or [])
        head = self.heads.get(pid) if pid is not None else None
        if head is None or self.head_arrays is None:
            return arrays, False
        start = len(arrays) - 2 - self.head_arrays
        arrays[start:start + self.head_arrays] = head
        return arrays, True

    def fit_instructions(
        self, server_round: int, parameters: Parameters, clients: list[ClientProxy]
    ) -> list[tuple[ClientProxy, FitIns]]:
        out = []
        for proxy in clients:
            arrays, has_head = self.personal_arrays(self.partition_of.get(proxy.cid))
            out.append((proxy, FitIns(ndarrays_to_parameters(arrays), self.fit_config(server_round, {HEAD_KEY: has_head}))))
        return out

    def configure_evaluate(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, EvaluateIns]]:
        """Each evaluating client gets the averaged body with its own combined head."""

        def instruction(pid: int | None) -> tuple[NDArrays, dict[str, Scalar]]:
            arrays, has_head = self.personal_arrays(pid)
            return arrays, {HEAD_KEY: has_head}

        return self.personal_evaluate_instructions(server_round, parameters, client_manager, instruction)

    # ---------------------------------------------------------------- replies
    def expected_shapes(self, server_round: int) -> list[tuple[int, ...]]:
        """The global arrays' shapes, then the class means (C, d) and the variance (1,)."""
        shapes = super().expected_shapes(server_round)
        if len(shapes) < 2:
            raise ConfigError("FedPAC's global arrays must end with the prototypes (C, d) and their counts (C,); "
                              f"got {len(shapes)} arrays")
        return [*shapes, shapes[-2], (1,)]

    def expected_dtypes(self, server_round: int) -> list[np.dtype | None]:
        """The global arrays' dtypes, then any real dtype for the class means and the variance."""
        return [*super().expected_dtypes(server_round), None, None]

    def check_reply(self, server_round: int, proxy: ClientProxy, res: FitRes) -> ClientReply:
        """The base checks, then the head count, non-negative class counts and variance."""
        reply = super().check_reply(server_round, proxy, res)
        who = f"client {proxy.cid} (partition {reply.partition_id})"
        heads = reply.metrics.get(HEAD_ARRAYS)
        model = len(reply.arrays) - 4
        if isinstance(heads, bool) or not isinstance(heads, int) or not 1 <= heads < model:
            raise ReplyError(f"{who}: metric {HEAD_ARRAYS}={heads!r} must be an integer in [1, {model - 1}]")
        if self.head_arrays is not None and heads != self.head_arrays:
            raise ReplyError(f"{who}: {HEAD_ARRAYS}={heads}, but the federation's model has {self.head_arrays} head arrays")
        if (reply.arrays[-3] < 0).any() or float(reply.arrays[-1][0]) < 0:
            raise ReplyError(f"{who}: negative class counts or variance term")
        return reply

    def aggregate_replies(self, server_round: int, replies: list[ClientReply]) -> NDArrays:
        """FedAvg of body and head, the global prototypes (Sec. 4.2), and each replier's combined
        head (Eq. 10-12)."""
        counts = [r.num_examples for r in replies]
        model = weighted_average([r.arrays[:-4] for r in replies], counts)
        class_counts = [r.arrays[-3] for r in replies]
        protos, totals = aggregate_prototypes([r.arrays[-4] for r in replies], class_counts)
        self.head_arrays = int(replies[0].metrics[HEAD_ARRAYS])
        self.combine(replies)
        return [*model, protos.astype(replies[0].arrays[-4].dtype), totals.astype(replies[0].arrays[-3].dtype)]

    def combine(self, replies: list[ClientReply]) -> None:
        """Solve each replier's QP over the replying clients and keep its combined head; record
        its own weight ``alpha_self`` and its number of nonzero weights ``alpha_nonzero``."""
        assert self.head_arrays is not None
        h = [prior_weighted_means(r.arrays[-2], r.arrays[-3]) for r in replies]
        variances = [float(r.arrays[-1][0]) for r in replies]
        heads = [r.arrays[-4 - self.head_arrays:-4] for r in replies]
        for i, reply in enumerate(replies):
            alpha = combination_weights(qp_matrix(i, variances, h))
            if reply.partition_id >= 0:
                self.heads[reply.partition_id] = combine_heads(alpha, heads)
            reply.metrics["alpha_self"] = float(alpha[i])
            reply.metrics["alpha_nonzero"] = float(np.count_nonzero(alpha))

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Base state plus every client's combined head and the head-array count."""
        return super().state_dict() | {
            "fedpac_heads": {int(pid): [a.copy() for a in head] for pid, head in self.heads.items()},
            "fedpac_head_arrays": self.head_arrays,
        }

    def load_state_dict(self, state: dict[str, Any], rounds_done: int) -> None:
        super().load_state_dict(state, rounds_done)
        self.head_arrays = state.get("fedpac_head_arrays")
        self.heads = {int(pid): [np.asarray(a) for a in head] for pid, head in (state.get("fedpac_heads") or {}).items()}

