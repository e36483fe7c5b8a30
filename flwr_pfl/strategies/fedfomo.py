"""FedFomo's Strategy (Zhang, Sapra, Fidler, Yeung and Alvarez, ICLR 2021, Sec. 3): every client's
latest model, an affinity matrix, and per client a download of its own model and M others.

Wire layout (P = the model's ``state_dict`` arrays, in order; i = the client's partition id)
--------------------------------------------------------------------------------------------
* fit instruction, *per client*: ``[theta_i (P)..., theta_{c_1} (P)..., ..., theta_{c_M'} (P)...]``
  and config ``fedfomo-models = M'``, ``server-round``. ``theta_i`` is the model client i last
  uploaded, or the initial global model while it has none; ``c_1 .. c_M'`` are the models the
  epsilon-greedy rule chose from the candidate pool (below), ``M' = min(M, pool size)``; in the
  first round the pool is empty and ``M' = 0``. Download: ``(M' + 1) P`` values.
* fit reply: ``[theta_i after the first-order step and local training (P)..., fedfomo:weights
  (M',) float64]``: the raw weights ``(L_i(theta_i) - L_i(theta_c)) / ||theta_c - theta_i||`` in
  the order of the models sent; ``num_examples`` (training split); metrics ``partition_id``,
  ``train_loss``, ``train_seconds``, ``fomo_models``, ``fomo_positive``, ``fomo_val_loss``.
  Upload: ``P + M'`` values.
* evaluate instruction, per client: ``theta_i`` (P; the initial model while it has none);
  reply: loss, ``num_examples`` (test split), ``accuracy`` of theta_i.

Server, each round: each accepted reply's model becomes its client's stored model and its
weights are added into the client's row of the affinity matrix (``A[i, c_n] += w_n``, ``A``
initialised to 0: FL-bench and PFLlib start from the identity, the authors' code from 0 off
the diagonal; the diagonal is never read, a client is never its own candidate). The candidate
pool of the next round: ``candidates = "last-round"`` (default; the authors', FL-bench's and
PFLlib's rule) the clients whose replies the latest aggregated round accepted, or ``"all"``
every client with a stored model; a client is never a candidate of itself. A client sampled
but failed or rejected keeps its previous model and row.

Memory: the stored models, at most ``N P`` values (as the arrays' dtypes), plus ``A``, ``8 N^2``
bytes. :meth:`FedFomo.state_dict` holds both (by reference) and the pool, so a resumed run
sends every client what the uninterrupted run would have sent. The candidates are drawn from a
generator of (seed, round, partition id) alone, so they repeat in every rerun and resume.
There is no global model: the global arrays stay the initial ones (the model of a client that
has not trained yet) and nothing is exported as ``model.pt``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from flwr.common import EvaluateIns, FitIns, FitRes, Parameters, ndarrays_to_parameters
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy

from flwr_pfl.clients.fedfomo import MODELS_KEY
from flwr_pfl.core.fedfomo import exploration_rate, select_candidates, update_affinity
from flwr_pfl.data.sampling import stage_rng
from flwr_pfl.errors import ConfigError, ReplyError
from flwr_pfl.strategies.base import NDArrays, PFLStrategy
from flwr_pfl.strategies.decode import decode_arrays
from flwr_pfl.strategies.validation import ClientReply, check_arrays

#: values of ``candidates``
POOLS = ("last-round", "all")


def check_options(num_models: object, epsilon: object, epsilon_decay: object, candidates: object,
                  key=lambda option: f"fedfomo.{option}") -> None:
    """Refuse bad option values, naming each by ``key(<kebab-case option>)``.

    Raises:
        ConfigError: ``num-models`` is not an integer >= 1, ``epsilon`` not in [0, 1],
            ``epsilon-decay`` not a finite number >= 0, or ``candidates`` not one of :data:`POOLS`.
    """
    def number(value: object) -> bool:
        return not isinstance(value, bool) and isinstance(value, (int, float)) and bool(np.isfinite(value))

    if isinstance(num_models, bool) or not isinstance(num_models, int) or num_models < 1:
        raise ConfigError(f"{key('num-models')} must be an integer >= 1 (models each client downloads besides its own); "
                          f"got {num_models!r}")
    if not number(epsilon) or not 0 <= epsilon <= 1:  # type: ignore[operator]
        raise ConfigError(f"{key('epsilon')} must be a probability in [0, 1] (0: always the top models by affinity); "
                          f"got {epsilon!r}")
    if not number(epsilon_decay) or not epsilon_decay >= 0:  # type: ignore[operator]
        raise ConfigError(f"{key('epsilon-decay')} must be a finite number >= 0 (subtracted from epsilon each round); "
                          f"got {epsilon_decay!r}")
    if candidates not in POOLS:
        raise ConfigError(f"{key('candidates')}={candidates!r} is not allowed; choose one of {', '.join(map(repr, POOLS))}")


class FedFomo(PFLStrategy):
    """FedFomo's server (see the module docstring for the wire).

    Args:
        num_models: M, the models each client downloads besides its own (FL-bench's default 5;
            the authors' README runs 4 and 9 with 15 clients).
        epsilon: the exploration probability of the first round with something to download
            (the authors' 0.3).
        epsilon_decay: subtracted from ``epsilon`` each round (the authors' 0.05):
            ``epsilon_t = max(0, epsilon - epsilon_decay (t - 1))``.
        candidates: the pool the models are chosen from: ``"last-round"`` or ``"all"``.
        **kwargs: :class:`PFLStrategy`'s arguments. ``evaluate_fn`` is refused (there is no
            global model), and so are the reply bounds (each reply is a client's own model).
    """

    name = "fedfomo"
    needs_partition_ids = True  # each client is sent its own model and its own choice of others
    has_global_model = False  # one model per client; the global arrays stay the initial ones
    refused_hooks = {
        "evaluate_fn": "FedFomo has no global model to evaluate on the server: each client has its own model, "
        "combined from others' by its own weights (evaluate them with the clients' evaluation)",
    }
    robust_refusal = "each FedFomo reply is that client's own model, stored as it is, not averaged into a global one"

    def __init__(self, *, num_models: int = 5, epsilon: float = 0.3, epsilon_decay: float = 0.05,
                 candidates: str = "last-round", **kwargs: Any) -> None:
        check_options(num_models, epsilon, epsilon_decay, candidates, key=lambda option: option.replace("-", "_"))
        super().__init__(**kwargs)
        self.num_models = int(num_models)
        self.epsilon = float(epsilon)
        self.epsilon_decay = float(epsilon_decay)
        self.candidates = candidates
        #: partition id -> its latest uploaded model
        self.models: dict[int, NDArrays] = {}
        #: A[i, j]: the sum of the raw weights client i computed for client j's models
        self.affinity = np.zeros((self.num_clients, self.num_clients), dtype=np.float64)
        #: the clients whose replies the latest aggregated round accepted (the "last-round" pool)
        self.latest: list[int] = []
        #: partition id -> the models it was sent in the current round, in order
        self.sent: dict[int, list[int]] = {}
        #: the partitions whose reply this round's checks accepted (a second reply is refused)
        self.accepted: set[int] = set()

    # ---------------------------------------------------------------- instructions
    def own_model(self, pid: int | None) -> NDArrays:
        """Client ``pid``'s latest model, or the initial global arrays while it has none."""
        stored = self.models.get(pid) if pid is not None else None
        return list(stored if stored is not None else (self.global_arrays or []))

    def pool(self, pid: int) -> list[int]:
        """The clients ``pid`` may be sent models of this round (never itself), sorted."""
        source = self.latest if self.candidates == "last-round" else self.models
        return sorted(j for j in source if j != pid and j in self.models)

    def choose(self, server_round: int, pid: int) -> list[int]:
        """The models client ``pid`` downloads in ``server_round`` (of this process; the run's
        round counts the rounds before a resume), epsilon-greedily from its affinity row."""
        current = self.run_round(server_round)
        rng = stage_rng(self.seed, f"fedfomo/candidates/{pid}", current)
        rate = exploration_rate(self.epsilon, self.epsilon_decay, current)
        return select_candidates(self.affinity[pid], self.pool(pid), self.num_models, rate, rng)

    def fit_instructions(
        self, server_round: int, parameters: Parameters, clients: list[ClientProxy]
    ) -> list[tuple[ClientProxy, FitIns]]:
        self.sent, self.accepted = {}, set()
        out = []
        for proxy in clients:
            pid = self.partition_of.get(proxy.cid)
            chosen = self.choose(server_round, pid) if pid is not None else []
            if pid is not None:
                self.sent[pid] = chosen
            arrays = self.own_model(pid) + [a for j in chosen for a in self.models[j]]
            config = self.fit_config(server_round, {MODELS_KEY: len(chosen)})
            out.append((proxy, FitIns(ndarrays_to_parameters(arrays), config)))
        return out

    def configure_evaluate(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, EvaluateIns]]:
        """Each evaluating client gets its own latest model (the initial one while it has none)."""
        return self.personal_evaluate_instructions(server_round, parameters, client_manager,
                                                   lambda pid: (self.own_model(pid), {}))

    # ---------------------------------------------------------------- replies
    def check_reply(self, server_round: int, proxy: ClientProxy, res: FitRes) -> ClientReply:
        """The model's arrays (shapes of the global arrays, finite) and one finite weight per
        model the client was sent this round; its partition id must be the one it was sent to,
        and only its first valid reply of the round counts (its weights are added once)."""
        partition_id = self.check_partition(proxy.cid, res.metrics.get("partition_id", -1))
        who = f"{proxy.cid} (partition {partition_id})"
        known = self.partition_of.get(proxy.cid)
        if partition_id not in self.sent or (known is not None and known != partition_id):
            raise ReplyError(f"client {who}: no FedFomo instruction of this round went to partition {partition_id}")
        shapes = [tuple(a.shape) for a in (self.global_arrays or [])] + [(len(self.sent[partition_id]),)]
        arrays = decode_arrays(res.parameters)
        check_arrays(who, arrays, shapes, res.num_examples, [*self.expected_dtypes(server_round), None])
        if not np.issubdtype(arrays[-1].dtype, np.floating):
            raise ReplyError(f"client {who}: its weights are {arrays[-1].dtype}, not floating-point numbers")
        for i, (array, own) in enumerate(zip(arrays[:-1], self.global_arrays or [])):
            if np.issubdtype(np.asarray(own).dtype, np.floating) != np.issubdtype(array.dtype, np.floating):
                raise ReplyError(f"client {who}: array {i} is {array.dtype}, the model's is {np.asarray(own).dtype}")
        if partition_id in self.accepted:
            raise ReplyError(f"client {who}: a second reply for partition {partition_id} in one round")
        self.accepted.add(partition_id)
        return ClientReply(proxy.cid, partition_id, res.num_examples, arrays, dict(res.metrics))

    def aggregate_replies(self, server_round: int, replies: list[ClientReply]) -> NDArrays:
        """Store each reply's model as its client's, add its weights into its affinity row, and
        make the repliers the next round's "last-round" pool; the global arrays stay as they are."""
        for reply in replies:
            pid = reply.partition_id
            dtypes = [np.asarray(a).dtype for a in self.global_arrays or []]
            self.models[pid] = [np.asarray(a).astype(d, copy=True) for a, d in zip(reply.arrays[:-1], dtypes)]
            update_affinity(self.affinity, pid, self.sent[pid], reply.arrays[-1])
        self.latest = sorted(r.partition_id for r in replies)
        return list(self.global_arrays or [])

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Base state plus every stored model (by reference: they are replaced, never changed in
        place), the affinity matrix and the "last-round" pool."""
        return super().state_dict() | {
            "fedfomo_models": {int(pid): list(arrays) for pid, arrays in self.models.items()},
            "fedfomo_affinity": self.affinity,
            "fedfomo_latest": list(self.latest),
        }

    def load_state_dict(self, state: dict[str, Any], rounds_done: int) -> None:
        """Resume from :meth:`state_dict`, checking the matrix's shape and each model's arrays
        against the global arrays.

        Raises:
            ConfigError: the state was written for another federation size or another model.
        """
        super().load_state_dict(state, rounds_done)
        affinity = np.asarray(state.get("fedfomo_affinity", np.zeros((self.num_clients,) * 2)), dtype=np.float64)
        if affinity.shape != (self.num_clients, self.num_clients) or not np.all(np.isfinite(affinity)):
            raise ConfigError(f"the checkpoint's FedFomo affinity matrix is {affinity.shape} (finite: "
                              f"{bool(np.all(np.isfinite(affinity)))}); this federation needs a finite "
                              f"({self.num_clients}, {self.num_clients}) matrix")
        reference = self.global_arrays or []
        models: dict[int, NDArrays] = {}
        for pid, arrays in (state.get("fedfomo_models") or {}).items():
            arrays = [np.asarray(a) for a in arrays]
            if not 0 <= int(pid) < self.num_clients or [(a.shape, a.dtype) for a in arrays] != [
                    (np.shape(r), np.asarray(r).dtype) for r in reference]:
                raise ConfigError(f"the checkpoint's FedFomo model of partition {pid} does not match the global arrays "
                                  f"of this model and federation of {self.num_clients} clients")
            models[int(pid)] = arrays
        self.affinity = affinity.copy()
        self.models = models
        self.latest = sorted(int(pid) for pid in state.get("fedfomo_latest") or [])
