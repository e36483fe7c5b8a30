"""FedAMP's Strategy (Huang et al., AAAI 2021, Alg. 1): every client's latest model on the server
and, for each sampled client, its own cloud model by attentive message passing. The mathematics
is in :mod:`flwr_pfl.core.fedamp`.

Wire layout (A = the model's arrays, every ``state_dict`` entry in order; m = ``num_clients``)
---------------------------------------------------------------------------------------------
* fit instruction, *per client* i: u_i (A arrays; Eq. 5 over the parameters, client i's own
  BatchNorm statistics and counters), config ``server-round``, ``fedamp-alpha-k`` (alpha_k) and
  ``fedamp-lam`` (lambda), which set the client's proximal term lambda / (2 alpha_k) ||w - u_i||^2.
* fit reply: ``[w_i (A arrays)..., fedamp:parameter-mask (A,) float32]``: the trained model and
  1.0 for each array that is a model parameter, 0.0 for a buffer (the server combines and
  measures parameters only, the paper's w); ``num_examples = n_i``; metrics ``partition_id``,
  ``train_loss``, ``train_seconds``.
* evaluate instruction, per client i: w_i as the server holds it (its latest accepted upload;
  the initial global model for a client never seen yet); the client evaluates it as it is.
* The global arrays (``get_parameters``, checkpoints) stay the initial model: FedAMP has no
  global model (``has_global_model = False``; nothing is exported as ``model.pt``).

Server, each round k: for every sampled client i, the squared distances from w_i to every
client's latest w_j over the parameters, the weights xi_i of Eq. 5 and u_i (computed in
``configure_fit`` from W^{k-1}, before any reply of round k); then each accepted reply
overwrites its client's row. The paper's server combines the models of all m clients (full
participation, cross-silo); with partial participation this server combines the latest model of
every client, a client never seen counting with the initial model. PFLlib instead combines only
the models uploaded in the previous round (``uploaded_models``); this follows the paper.
The fit row records each replier's ``xi_self`` (xi_ii of the u_i it trained from; < 0 means u_i
extrapolated, see :func:`~flwr_pfl.core.fedamp.self_weight_lower_bound`).

Memory: the m stacked models, 4 m P bytes for float32 parameters (P values), by reference in
:meth:`FedAMP.state_dict`; per round O(P) temporaries and O(|S| m P) work for |S| sampled
clients. Bytes on the wire per round: down |S| P + |E| P (fit, evaluate), up |S| (P + A).
"""

from __future__ import annotations

from logging import WARNING
from typing import Any

import numpy as np
from flwr.common import EvaluateIns, FitIns, FitRes, Parameters, log, ndarrays_to_parameters
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy

from flwr_pfl.core.fedamp import (
    ALPHA_KEY,
    LAM_KEY,
    check_hyperparameters,
    cloud_model,
    message_weights,
    self_weight_lower_bound,
    squared_distances,
)
from flwr_pfl.errors import ConfigError, ReplyError
from flwr_pfl.strategies.base import NDArrays, PFLStrategy
from flwr_pfl.strategies.validation import ClientReply

STATE_PREFIX = "fedamp_model_"


class FedAMP(PFLStrategy):
    """FedAMP's server: one model per client, a cloud model u_i per sampled client (Eq. 5).

    Args:
        alpha_k: the message-passing step alpha_k (constant over rounds; PFLlib's ``alphaK``,
            default 1.0).
        lam: lambda of Eq. 6 (PFLlib's ``lamda``, default 1.0); sent to the clients with alpha_k.
        sigma: the scale of A(x) = 1 - exp(-x / sigma) (PFLlib's default 1.0).
        **kwargs: :class:`PFLStrategy`'s arguments. ``evaluate_fn`` is refused (no global model).

    Raises:
        ConfigError: a hyperparameter out of range.
    """

    name = "fedamp"
    needs_partition_ids = True  # each client is sent its own u_i and has its own row
    has_global_model = False
    refused_hooks = {
        "evaluate_fn": "FedAMP has no global model to evaluate on the server: each client i has its own w_i "
        "(evaluate them with the clients' evaluation)",
    }
    robust_refusal = "FedAMP keeps each client's own model and combines them per client by attention weights (Eq. 5)"

    def __init__(self, *, alpha_k: float = 1.0, lam: float = 1.0, sigma: float = 1.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        check_hyperparameters(alpha_k, lam, sigma, lambda name: f"FedAMP's {name.replace('-', '_')}")
        self.alpha_k, self.lam, self.sigma = float(alpha_k), float(lam), float(sigma)
        bound = self_weight_lower_bound(self.num_clients, self.alpha_k, self.sigma)
        if bound < 0:
            log(WARNING, "FedAMP: alpha_k (m - 1) / sigma = %.4g > 1: a client's own weight xi_ii can be negative "
                "(down to %.4g) when models are close, and u_i then extrapolates beyond the models; "
                "alpha_k <= sigma / (m - 1) = %.4g keeps every u_i a convex combination",
                1 - bound, bound, self.sigma / max(self.num_clients - 1, 1))
        #: row i of stack a = client i's latest array a (the initial model until it replies)
        self.models: list[np.ndarray] | None = None
        #: which wire arrays are model parameters (from the replies; None before the first)
        self.mask: list[bool] | None = None
        #: partition id -> xi_ii of the u_i sent to it this round
        self._self_weights: dict[int, float] = {}

    # ---------------------------------------------------------------- server state
    def ensure_models(self) -> list[np.ndarray]:
        """The stacked models, built from the initial global arrays on first use."""
        if self.models is None:
            if self.global_arrays is None:
                raise RuntimeError("FedAMP needs the initial model before its first round")
            self.models = [np.repeat(np.asarray(a)[None], self.num_clients, axis=0) for a in self.global_arrays]
        return self.models

    def client_model(self, pid: int) -> NDArrays:
        """w_i as the server holds it (copies)."""
        return [stack[pid].copy() for stack in self.ensure_models()]

    def cloud(self, pid: int) -> tuple[NDArrays, np.ndarray]:
        """(u_i, xi_i) for client ``pid`` from the stored models (Eq. 5). Before any reply every
        row is the initial model: u_i is that model and xi_i is not needed by it."""
        models = self.ensure_models()
        if self.mask is None:  # nobody has replied: every row is w^0, the distances are all 0
            xi = message_weights(np.zeros(self.num_clients), pid, self.alpha_k, self.sigma)
            return self.client_model(pid), xi
        xi = message_weights(squared_distances(models, pid, self.mask), pid, self.alpha_k, self.sigma)
        return cloud_model(models, pid, xi, self.mask), xi

    # ---------------------------------------------------------------- instructions
    def fit_instructions(
        self, server_round: int, parameters: Parameters, clients: list[ClientProxy]
    ) -> list[tuple[ClientProxy, FitIns]]:
        config = self.fit_config(server_round, {ALPHA_KEY: self.alpha_k, LAM_KEY: self.lam})
        out, self._self_weights = [], {}
        for proxy in clients:
            pid = self.partition_of.get(proxy.cid)
            if pid is None or not 0 <= pid < self.num_clients:
                log(WARNING, "round %d: client %s has no partition id in [0, %d); not sent a cloud model",
                    self.run_round(server_round), proxy.cid, self.num_clients)
                continue
            arrays, xi = self.cloud(pid)
            self._self_weights[pid] = float(xi[pid])
            out.append((proxy, FitIns(ndarrays_to_parameters(arrays), dict(config))))
        negative = sorted(pid for pid, w in self._self_weights.items() if w < 0)
        if negative:
            log(WARNING, "round %d: xi_ii < 0 for partitions %s: their cloud models extrapolate (see alpha_k, sigma)",
                self.run_round(server_round), negative)
        return out

    def configure_evaluate(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, EvaluateIns]]:
        """Each evaluating client gets its own latest w_i (the initial model if never seen); a client
        without a partition id in [0, num_clients) is left out."""
        return self.personal_evaluate_instructions(
            server_round, parameters, client_manager,
            lambda pid: (self.client_model(pid), {}) if pid is not None and 0 <= pid < self.num_clients else None)

    # ---------------------------------------------------------------- replies
    def expected_shapes(self, server_round: int) -> list[tuple[int, ...]]:
        """The model's shapes, then the parameter mask (A,)."""
        shapes = super().expected_shapes(server_round)
        return [*shapes, (len(shapes),)]

    def expected_dtypes(self, server_round: int) -> list[np.dtype | None]:
        """The model's dtypes, then the mask (any real dtype: its values are checked)."""
        return [*super().expected_dtypes(server_round), None]

    def check_reply(self, server_round: int, proxy: ClientProxy, res: FitRes) -> ClientReply:
        """The base checks, then: the partition id is the one the client was sent its u_i for,
        once per round; every array keeps its kind (float or integer); the mask is 0/1, marks
        floating-point arrays only and is the federation's."""
        known = self.partition_of.get(proxy.cid)
        try:
            pid = int(res.metrics.get("partition_id", -1))
        except (TypeError, ValueError):
            pid = -1
        who = f"client {proxy.cid} (partition {pid})"
        if known is None:  # the partition's range and a node's one partition: the base's check_partition
            raise ReplyError(f"{who}: this node was sent no cloud model (it is not a known partition of the round)")
        reply = super().check_reply(server_round, proxy, res)  # a second reply per partition: check_unclaimed
        models = self.ensure_models()
        for i, (array, stack) in enumerate(zip(reply.arrays, models)):
            if np.issubdtype(array.dtype, np.floating) != np.issubdtype(stack.dtype, np.floating):
                raise ReplyError(f"{who}: array {i} is {array.dtype}, the model's is {stack.dtype}")
        mask = reply.arrays[-1]
        if not np.all((mask == 0) | (mask == 1)) or not mask.any():
            raise ReplyError(f"{who}: the parameter mask must hold 0 or 1 with at least one 1; got {mask.tolist()}")
        flags = [bool(v) for v in mask]
        if any(flag and not np.issubdtype(stack.dtype, np.floating) for flag, stack in zip(flags, models)):
            raise ReplyError(f"{who}: the parameter mask marks an integer array as a parameter")
        if self.mask is not None and flags != self.mask:
            raise ReplyError(f"{who}: the parameter mask {flags} is not the federation's {self.mask}")
        self.mask = flags  # the first accepted reply sets it; the others must agree
        return reply

    def aggregate_replies(self, server_round: int, replies: list[ClientReply]) -> NDArrays:
        """Store each reply's w_i in its client's row (W^k); record ``xi_self``. Returns the
        unchanged initial global arrays (FedAMP has no global model)."""
        models = self.ensure_models()
        for reply in replies:
            for stack, array in zip(models, reply.arrays[:-1]):
                stack[reply.partition_id] = array
            if reply.partition_id in self._self_weights:
                reply.metrics["xi_self"] = self._self_weights[reply.partition_id]
        return list(self.global_arrays or [])

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Base state plus every client's model (stacked, by reference) and the parameter mask."""
        state = super().state_dict()
        if self.models is None:
            return state
        state["arrays"] = {f"{STATE_PREFIX}{a}": stack for a, stack in enumerate(self.models)}
        return state | {"fedamp_mask": self.mask}

    def load_state_dict(self, state: dict[str, Any], rounds_done: int) -> None:
        """Resume from :meth:`state_dict` (or a checkpoint's ``state_*`` arrays), checked first.

        Raises:
            ConfigError: the stored models do not fit the model and ``num_clients``, hold
                non-finite values, or the mask does not fit.
        """
        super().load_state_dict(state, rounds_done)
        arrays = state.get("arrays") or {}
        if not arrays:
            self.models, self.mask = None, None
            return
        shapes = [np.shape(a) for a in self.global_arrays or []]
        if len(arrays) != len(shapes):
            raise ConfigError(f"the checkpoint holds {len(arrays)} FedAMP model arrays; the model has {len(shapes)}")
        models = []
        for a, shape in enumerate(shapes):
            stack = np.asarray(arrays.get(f"{STATE_PREFIX}{a}"))
            want = (self.num_clients, *shape)
            if stack.shape != want or stack.dtype != np.asarray(self.global_arrays[a]).dtype:  # type: ignore[index]
                raise ConfigError(f"the checkpoint's {STATE_PREFIX}{a} is {stack.dtype}{stack.shape}; this run needs "
                                  f"{np.asarray(self.global_arrays[a]).dtype}{want} (num_clients x the model's array {a})")  # type: ignore[index]
            if np.issubdtype(stack.dtype, np.floating) and not np.all(np.isfinite(stack)):
                raise ConfigError(f"the checkpoint's {STATE_PREFIX}{a} holds non-finite values")
            models.append(np.array(stack, copy=True))
        mask = state.get("fedamp_mask")
        if mask is not None and len(mask) != len(shapes):
            raise ConfigError(f"the checkpoint's FedAMP parameter mask has {len(mask)} entries; the model has {len(shapes)} arrays")
        self.models = models
        self.mask = None if mask is None else [bool(v) for v in mask]
