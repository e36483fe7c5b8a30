"""Registry entry of pFedHN (Shamsian, Navon, Fetaya and Chechik, ICML 2021): a server-side
hypernetwork generates each client's model from a learned client embedding."""

from __future__ import annotations

from dataclasses import dataclass

from flwr_pfl.app.keys import check_choice
from flwr_pfl.app.registry import AlgorithmSpec, register
from flwr_pfl.clients.pfedhn import PFedHNClient, check_inner_clip_norm, check_inner_steps
from flwr_pfl.core import pfedhn as core
from flwr_pfl.strategies.pfedhn import PFedHN, check_options


@dataclass(frozen=True)
class PFedHNOptions:
    """pFedHN, with the authors' defaults (github.com/AvivSham/pFedHN, ``experiments/pfedhn/trainer.py``):
    ``embed_dim`` 0 = ``int(1 + num-clients / 4)`` (their ``--embed-dim -1``), ``hidden_dim`` 100,
    ``n_hidden`` 3, the hypernetwork's SGD at ``server_lr`` 1e-2, ``server_momentum`` 0.9,
    ``server_weight_decay`` 1e-3, its gradient norm clipped to ``server_clip_norm`` 50 (0: off),
    ``round_step`` ``sum`` (one step per round along the sum of its replies' clipped gradients;
    ``mean``: along their mean, for many clients per round; ``per-client``: one step per reply;
    all the same with one client per round),
    and ``inner_steps`` K = 50 local optimizer steps per round (0: ``local-epochs`` full passes
    instead), each with its gradient norm clipped to ``inner_clip_norm`` 50 (0: off). The inner
    optimizer is the run's (``learning-rate``, ``momentum``, ``weight-decay``; authors: 5e-3, 0.9,
    5e-5)."""

    embed_dim: int = 0
    hidden_dim: int = core.HIDDEN_DIM
    n_hidden: int = core.N_HIDDEN
    server_lr: float = core.SERVER_LR
    server_momentum: float = core.SERVER_MOMENTUM
    server_weight_decay: float = core.SERVER_WEIGHT_DECAY
    server_clip_norm: float = core.CLIP_NORM
    inner_steps: int = core.INNER_STEPS
    inner_clip_norm: float = core.INNER_CLIP_NORM
    round_step: str = core.ROUND_STEP

    def __post_init__(self) -> None:
        check_choice("pfedhn.round-step", self.round_step, core.ROUND_STEPS)
        check_options(self.embed_dim, self.hidden_dim, self.n_hidden, self.server_lr, self.server_momentum,
                      self.server_weight_decay, self.server_clip_norm, key=lambda option: f"pfedhn.{option}")
        check_inner_steps(self.inner_steps, "pfedhn.inner-steps")
        check_inner_clip_norm(self.inner_clip_norm, "pfedhn.inner-clip-norm")


register(
    AlgorithmSpec(
        "pfedhn",
        PFedHN,
        PFedHNClient,
        "pFedHN: a server-side hypernetwork generates each client's model from its embedding; "
        "the clients' changes train it by the chain rule",
        options=PFedHNOptions,
        client_kwargs=lambda o: {"inner_steps": o.inner_steps, "inner_clip_norm": o.inner_clip_norm},
        strategy_kwargs=lambda o: {"embed_dim": o.embed_dim, "hidden_dim": o.hidden_dim, "n_hidden": o.n_hidden,
                                   "server_lr": o.server_lr, "server_momentum": o.server_momentum,
                                   "server_weight_decay": o.server_weight_decay, "server_clip_norm": o.server_clip_norm,
                                   "round_step": o.round_step},
    )
)
