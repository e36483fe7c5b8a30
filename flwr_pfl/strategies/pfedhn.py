"""pFedHN's Flower Strategy (Shamsian, Navon, Fetaya and Chechik, ICML 2021, Alg. 1): a
hypernetwork on the server generates each client's model; the clients' changes train it.

The mathematics (the hypernetwork, the chain rule of Eq. 4, the optimizer step) lives in
:mod:`flwr_pfl.core.pfedhn`; this module moves arrays between Flower and the core and keeps the
server's state.

Wire layout (P = the model's *parameters*, ``state_dict`` order, no buffers; client i =
partition id i; see :class:`~flwr_pfl.clients.pfedhn.PFedHNClient`)
--------------------------------------------------------------------------------------------
* fit, server -> client i: ``theta_i = h(v_i; phi)`` (P arrays, different per client) and
  ``server-round``; client i -> server: ``theta~_i`` (P arrays, same shapes), its example count
  (not used: every reply makes one optimizer step) and metrics ``partition_id``, ``train_loss``,
  ``train_seconds``, ``inner_steps``.
* evaluate, server -> client i: ``theta_i = h(v_i; phi)`` from the current phi; client -> server
  the loss and ``accuracy`` of that model with the client's own buffers.
* The global arrays are the initial parameters and stay so (there is no global model; they give
  the hypernetwork's output shapes and dtypes).

Server step: each reply's gradient ``(d theta_i / d (phi, v_i))^T (theta_i - theta~_i)`` is taken
at the phi that generated the round's models; by default the round makes one SGD step along their
sum, each clipped (``round_step="sum"``, :func:`~flwr_pfl.core.pfedhn.server_round_sum`); or phi
makes one step along their mean and each embedding row along its own client's (``"mean"``,
:func:`~flwr_pfl.core.pfedhn.server_round_mean`); or each reply makes one SGD step, in partition
order (``"per-client"``, :func:`~flwr_pfl.core.pfedhn.server_round`). The authors' code samples
one client per step and steps once per client; with ``fraction-fit`` = 1/N all three are that
loop exactly.

Server state and memory: phi and v, ``|phi| = N e + (e + 1) h + n_hidden (h + 1) h + (h + 1) P``
floats (float32), and as much again for SGD's momentum: about ``8 ((h + 1) P + N e)`` bytes, e.g.
h = 100 and P = 121k (the authors' LeNet): 98 MB. A step adds one gradient (``4 |phi|`` bytes)
while it runs, and a round of several replies one copy of phi (the point its gradients are taken
at). phi, v and the momentum are in :meth:`PFedHN.state_dict`, so a resumed run continues bit
for bit.
"""

from __future__ import annotations

import math
from logging import INFO, WARNING
from typing import Any

import numpy as np
import torch
from flwr.common import EvaluateIns, FitIns, FitRes, Parameters, log, ndarrays_to_parameters
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy

from flwr_pfl.core import pfedhn as core
from flwr_pfl.errors import ConfigError, ReplyError
from flwr_pfl.strategies.base import NDArrays, PFLStrategy
from flwr_pfl.strategies.validation import ClientReply

STATE_KEY = "pfedhn"
PHI_PREFIX = "pfedhn_phi_"
MOMENTUM_PREFIX = "pfedhn_momentum_"


def check_options(embed_dim: object, hidden_dim: object, n_hidden: object, server_lr: object, server_momentum: object,
                  server_weight_decay: object, server_clip_norm: object, key=lambda option: option) -> None:
    """Refuse bad option values, naming each by ``key(<kebab-case option>)``.

    Raises:
        ConfigError: ``embed-dim`` not an integer >= 0 (0: the authors' ``int(1 + N / 4)``),
            ``hidden-dim`` not >= 1, ``n-hidden`` not >= 0, ``server-lr`` not a finite number > 0,
            ``server-momentum`` not in [0, 1), ``server-weight-decay`` or ``server-clip-norm``
            not a finite number >= 0 (clip 0: off).
    """
    def integer(value: object, least: int) -> bool:
        return not isinstance(value, bool) and isinstance(value, int) and value >= least

    def number(value: object) -> bool:
        return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)

    if not integer(embed_dim, 0):
        raise ConfigError(f"{key('embed-dim')} must be an integer >= 0 (0: int(1 + num-clients / 4), the authors' "
                          f"default); got {embed_dim!r}")
    if not integer(hidden_dim, 1):
        raise ConfigError(f"{key('hidden-dim')} must be an integer >= 1; got {hidden_dim!r}")
    if not integer(n_hidden, 0):
        raise ConfigError(f"{key('n-hidden')} must be an integer >= 0; got {n_hidden!r}")
    if not number(server_lr) or not server_lr > 0:  # type: ignore[operator]
        raise ConfigError(f"{key('server-lr')} must be a finite number > 0; got {server_lr!r}")
    if not number(server_momentum) or not 0 <= server_momentum < 1:  # type: ignore[operator]
        raise ConfigError(f"{key('server-momentum')} must be a number in [0, 1); got {server_momentum!r}")
    if not number(server_weight_decay) or not server_weight_decay >= 0:  # type: ignore[operator]
        raise ConfigError(f"{key('server-weight-decay')} must be a finite number >= 0; got {server_weight_decay!r}")
    if not number(server_clip_norm) or not server_clip_norm >= 0:  # type: ignore[operator]
        raise ConfigError(f"{key('server-clip-norm')} must be a finite number >= 0 (0: no clipping); got {server_clip_norm!r}")


class PFedHN(PFLStrategy):
    """pFedHN's server: a hypernetwork generates each client's model; each reply makes one SGD
    step of the hypernetwork by the chain rule (see the module docstring for the wire).

    Args:
        embed_dim: e, the client embedding's size; 0 (default) is the authors' ``int(1 + N / 4)``.
        hidden_dim: h, the hypernetwork MLP's width (authors: 100).
        n_hidden: the MLP's ``(ReLU, Linear(h, h))`` blocks after its first layer (authors: 3).
        server_lr / server_momentum / server_weight_decay: the hypernetwork's SGD (authors:
            1e-2, 0.9, 1e-3), over phi and the embeddings alike.
        server_clip_norm: the total gradient norm is clipped to this before each step (authors: 50;
            0: off).
        round_step: how a round's replies move phi. ``"sum"`` (default): one step along the
            sum of their gradients, each clipped (:func:`~flwr_pfl.core.pfedhn.server_round_sum`);
            ``"mean"``: one step along their mean (each client's embedding along its own;
            :func:`~flwr_pfl.core.pfedhn.server_round_mean`); ``"per-client"``: one step per
            reply in partition order (:func:`~flwr_pfl.core.pfedhn.server_round`). With one
            client per round (the authors' protocol) all three are Alg. 1's step. With several,
            the per-client momentum steps along gradients all taken at the round's phi compound
            and overshoot (the default experiment's 10 clients a round diverged); ``"sum"`` keeps
            the authors' pace per client visited with the momentum applied once a round; with
            many clients a round (100: both overshoot) ``"mean"`` is the choice, which learns K
            times slower per round.
        **kwargs: :class:`PFLStrategy`'s arguments. ``evaluate_fn`` is refused (there is no
            global model), and so are ``clip_update_norm`` and ``aggregate="trimmed-mean"``.

    The hypernetwork is built, from the seed (``seed``), when the global arrays (the model's
    initial parameters: their shapes and dtypes) are first known.
    """

    name = "pfedhn"
    needs_partition_ids = True  # each client is sent the model of its own embedding
    has_global_model = False  # each client its own generated model; the global arrays stay the initial ones
    refused_hooks = {
        "evaluate_fn": "pFedHN has no global model to evaluate on the server: each client i is evaluated on "
        "theta_i = h(v_i; phi), the model the hypernetwork generates for it (the clients' evaluation)",
    }
    robust_refusal = ("pFedHN's replies are not averaged: each one makes a step of the server's hypernetwork along "
                      "the chain rule of its change (theta_i - theta~_i)")

    def __init__(self, *, embed_dim: int = 0, hidden_dim: int = core.HIDDEN_DIM, n_hidden: int = core.N_HIDDEN,
                 server_lr: float = core.SERVER_LR, server_momentum: float = core.SERVER_MOMENTUM,
                 server_weight_decay: float = core.SERVER_WEIGHT_DECAY, server_clip_norm: float = core.CLIP_NORM,
                 round_step: str = core.ROUND_STEP, **kwargs: Any) -> None:
        check_options(embed_dim, hidden_dim, n_hidden, server_lr, server_momentum, server_weight_decay, server_clip_norm,
                      key=lambda option: f"PFedHN: {option.replace('-', '_')} (pfedhn.{option})")
        if round_step not in core.ROUND_STEPS:
            raise ConfigError(f"PFedHN: round_step (pfedhn.round-step) must be one of {', '.join(map(repr, core.ROUND_STEPS))}; "
                              f"got {round_step!r}")
        super().__init__(**kwargs)
        self.round_step = round_step
        self.embed_dim = int(embed_dim) or core.auto_embed_dim(self.num_clients)
        self.hidden_dim = int(hidden_dim)
        self.n_hidden = int(n_hidden)
        self.server_lr = float(server_lr)
        self.server_momentum = float(server_momentum)
        self.server_weight_decay = float(server_weight_decay)
        self.server_clip_norm = float(server_clip_norm)
        self.hnet: core.HyperNetwork | None = None
        self.optimizer: torch.optim.SGD | None = None
        #: node id -> the partition whose model it was sent in the current fit round
        self._sent: dict[str, int] = {}

    # ---------------------------------------------------------------- the hypernetwork
    def hypernetwork(self) -> core.HyperNetwork:
        """The hypernetwork, built (with its optimizer) on first use from the global arrays' shapes.

        Raises:
            ConfigError: no global arrays yet, or one that is not floating point (the wire must
                be the model's parameters; a client sending buffers is not a pFedHN client).
        """
        if self.hnet is not None:
            return self.hnet
        arrays = self.global_arrays
        if not arrays:
            raise ConfigError("PFedHN: the hypernetwork's output shapes come from the global arrays (the model's "
                              "parameters), and there are none yet")
        for i, array in enumerate(arrays):
            if not np.issubdtype(np.asarray(array).dtype, np.floating):
                raise ConfigError(f"PFedHN: global array {i} is {np.asarray(array).dtype}{np.shape(array)}: the hypernetwork "
                                  "generates floating-point parameters only; the clients' wire must be the model's "
                                  "parameters without its buffers (PFedHNClient's)")
        shapes = [np.shape(a) for a in arrays]
        self.hnet = core.build_hypernetwork(self.num_clients, shapes, seed=self.seed, embed_dim=self.embed_dim,
                                            hidden_dim=self.hidden_dim, n_hidden=self.n_hidden)
        self.optimizer = core.server_optimizer(self.hnet, self.server_lr, self.server_momentum, self.server_weight_decay)
        values = sum(p.numel() for p in self.hnet.parameters())
        log(INFO, "pFedHN: hypernetwork for %d clients, embedding %d, %d x %d hidden, %d target tensors (%d values): "
            "%d values (%.1f MB, and as much for SGD's momentum)", self.num_clients, self.embed_dim, self.n_hidden + 1,
            self.hidden_dim, len(shapes), sum(int(np.size(a)) for a in arrays), values, values * 4 / 2**20)
        return self.hnet

    def client_arrays(self, partition: int) -> NDArrays:
        """``theta_partition = h(v_partition; phi)``, each array in its global array's dtype."""
        return core.generate(self.hypernetwork(), partition, [np.asarray(a).dtype for a in self.global_arrays or []])

    # ---------------------------------------------------------------- instructions
    def fit_instructions(
        self, server_round: int, parameters: Parameters, clients: list[ClientProxy]
    ) -> list[tuple[ClientProxy, FitIns]]:
        """Each sampled client gets the model of its own embedding."""
        config = self.fit_config(server_round)
        self._sent = {}
        out = []
        for proxy in clients:
            pid = self.partition_of.get(proxy.cid)
            if pid is None:
                log(WARNING, "round %d: client %s has no known partition id; skipped", self.run_round(server_round), proxy.cid)
                continue
            self._sent[proxy.cid] = pid
            out.append((proxy, FitIns(ndarrays_to_parameters(self.client_arrays(pid)), dict(config))))
        return out

    def configure_evaluate(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, EvaluateIns]]:
        """Each evaluating client gets ``h(v_i; phi)`` from the current phi (a client without a
        known partition id is left out)."""
        return self.personal_evaluate_instructions(
            server_round, parameters, client_manager, lambda pid: None if pid is None else (self.client_arrays(pid), {}))

    # ---------------------------------------------------------------- replies
    def check_reply(self, server_round: int, proxy: ClientProxy, res: FitRes) -> ClientReply:
        """The base checks (count, shapes, finite values), and the reply must come from a node
        sent a model this round, for the partition it reports."""
        sent = self._sent.get(proxy.cid)
        reported = res.metrics.get("partition_id")
        if sent is None:
            raise ReplyError(f"client {proxy.cid} (partition {reported}): no model was sent to it this round")
        if isinstance(reported, bool) or not isinstance(reported, (int, float)) or reported != sent:
            # checked before the base learns the node's partition from the reply
            raise ReplyError(f"client {proxy.cid}: reports partition {reported!r}, but was sent the model of "
                             f"partition {sent}")
        return super().check_reply(server_round, proxy, res)

    def aggregate_replies(self, server_round: int, replies: list[ClientReply]) -> NDArrays:
        """The hypernetwork's step (``round_step``) along the chain rule of each reply's
        ``theta_i - theta~_i`` at the round's phi (Alg. 1). Records each reply's
        ``delta_norm`` (||theta_i - theta~_i||) and ``hn_grad_norm`` (before clipping).
        Returns the unchanged global arrays (there is no global model)."""
        hnet = self.hypernetwork()
        assert self.optimizer is not None
        updates = []
        for reply in replies:
            with torch.no_grad():
                sent = hnet(reply.partition_id)  # what fit_instructions sent: phi has not moved since
            delta = [theta - torch.tensor(np.asarray(a), dtype=theta.dtype) for theta, a in zip(sent, reply.arrays)]
            reply.metrics["delta_norm"] = float(torch.linalg.vector_norm(torch.cat([d.reshape(-1) for d in delta])))
            updates.append((reply.partition_id, delta))
        step = {"sum": core.server_round_sum, "mean": core.server_round_mean, "per-client": core.server_round}[self.round_step]
        norms = step(hnet, self.optimizer, updates, self.server_clip_norm)
        for reply, norm in zip(replies, norms):
            reply.metrics["hn_grad_norm"] = norm
        return list(self.global_arrays or [])

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Base state plus phi and v (``arrays``: ``pfedhn_phi_<k>``, the hypernetwork's
        tensors in ``parameters()`` order), SGD's momentum (``pfedhn_momentum_<k>``, once a
        step has made it) and the architecture they belong to."""
        state = super().state_dict()
        if self.hnet is None or self.optimizer is None:
            return state
        params = list(self.hnet.parameters())
        arrays = {f"{PHI_PREFIX}{k}": p.detach().cpu().numpy().copy() for k, p in enumerate(params)}
        momenta = core.momentum_buffers(self.optimizer, self.hnet)
        if momenta is not None:
            arrays |= {f"{MOMENTUM_PREFIX}{k}": m for k, m in enumerate(momenta)}
        state["arrays"] = arrays
        state[STATE_KEY] = {"num_clients": self.num_clients, "embed_dim": self.embed_dim, "hidden_dim": self.hidden_dim,
                            "n_hidden": self.n_hidden, "tensors": len(params), "momentum": momenta is not None}
        return state

    def load_state_dict(self, state: dict[str, Any], rounds_done: int) -> None:
        """Resume from :meth:`state_dict` (or a checkpoint's ``state_*`` arrays): phi, v and the
        momentum exactly as they were.

        Raises:
            ConfigError: the checkpoint's hypernetwork has another architecture (clients,
                embedding, width, depth) than this strategy's options, or its tensors do not fit.
        """
        super().load_state_dict(state, rounds_done)
        self.hnet, self.optimizer, self._sent = None, None, {}
        meta = state.get(STATE_KEY)
        if meta is None:  # written before the hypernetwork existed: it is built afresh, from the seed
            return
        ours = {"num_clients": self.num_clients, "embed_dim": self.embed_dim, "hidden_dim": self.hidden_dim,
                "n_hidden": self.n_hidden}
        differ = {k: (meta.get(k), v) for k, v in ours.items() if meta.get(k) != v}
        if differ:
            raise ConfigError("the checkpoint's pFedHN hypernetwork does not fit this configuration: "
                              + ", ".join(f"{k} {saved} in the checkpoint, {now} now" for k, (saved, now) in differ.items()))
        arrays = state.get("arrays") or {}
        hnet = self.hypernetwork()
        params = list(hnet.parameters())
        loaded = [arrays.get(f"{PHI_PREFIX}{k}") for k in range(len(params))]
        if int(meta.get("tensors", -1)) != len(params) or any(a is None for a in loaded):
            raise ConfigError(f"the checkpoint holds {meta.get('tensors')} pFedHN tensors, this hypernetwork has "
                              f"{len(params)}: it was written for another model")
        for k, (p, a) in enumerate(zip(params, loaded)):
            if tuple(np.shape(a)) != tuple(p.shape):
                raise ConfigError(f"the checkpoint's {PHI_PREFIX}{k} has shape {tuple(np.shape(a))}, the hypernetwork's "
                                  f"tensor {tuple(p.shape)}: it was written for another model")
        with torch.no_grad():
            for p, a in zip(params, loaded):
                p.copy_(torch.tensor(np.asarray(a), dtype=p.dtype))
        if meta.get("momentum"):
            assert self.optimizer is not None
            try:
                core.load_momentum_buffers(self.optimizer, hnet, [arrays[f"{MOMENTUM_PREFIX}{k}"] for k in range(len(params))])
            except (KeyError, ValueError) as err:
                raise ConfigError(f"the checkpoint's pFedHN momentum does not fit the hypernetwork: {err}") from None
