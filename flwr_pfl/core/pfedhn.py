"""pFedHN's mathematics (Shamsian, Navon, Fetaya and Chechik, *Personalized Federated Learning
using Hypernetworks*, ICML 2021), as plain torch functions; no Flower here.

A hypernetwork ``h(v_i; phi)`` maps client i's learned embedding ``v_i`` to every parameter tensor
``theta_i`` of the client's model (Sec. 3, Fig. 1). Architecture, as the authors' code builds it
(github.com/AvivSham/pFedHN, ``experiments/pfedhn/models.py``, ``CNNHyper``): an ``nn.Embedding``
of the N clients, an MLP ``Linear(e, h)`` followed by ``n_hidden`` x ``(ReLU, Linear(h, h))`` (no
activation after the last layer), and one linear head ``Linear(h, numel)`` per target tensor,
reshaped to that tensor's shape. The heads here are built from the shapes of the target arrays,
so any model works (the authors wrote one head per tensor of their LeNet by hand).

Update (Sec. 3, Eq. 4 and Alg. 1): client i trains ``theta_i`` for K steps into ``theta~_i``; with
``Delta_i = theta_i - theta~_i``, the server's gradient is the chain rule

    grad_phi = (d theta_i / d phi)^T Delta_i,     grad_{v_i} = (d theta_i / d v_i)^T Delta_i,

i.e. the gradient of the surrogate ``<h(v_i; phi), Delta_i>`` with ``Delta_i`` held fixed
(:func:`chain_rule_gradients`; the authors' ``torch.autograd.grad(weights, hnet.parameters(),
grad_outputs=delta_theta)``, with ``delta_theta = inner_state - final_state``). It is applied by
SGD with momentum and weight decay over all of phi and the embedding table, after clipping the
total gradient norm (the authors' ``clip_grad_norm_(hnet.parameters(), 50)``;
:func:`apply_step`). With several clients in a round, :func:`server_round` applies one
optimizer step per client in the given order (the authors' code takes one optimizer step per
client: one client per step), each client's gradient taken at the phi that generated the model
it trained, i.e. the round's phi; :func:`server_round_sum` (the default) takes one step along
the sum of their clipped gradients (the K steps' first-order total, momentum applied once), and
:func:`server_round_mean` one step along their mean (its step does not grow with the clients per
round: for many clients a round).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import nn

#: the authors' defaults (``experiments/pfedhn/trainer.py``'s argparse)
HIDDEN_DIM = 100  # --hyper-hid
N_HIDDEN = 3  # --n-hidden
SERVER_LR = 1e-2  # --lr (the embeddings too: --embed-lr defaults to --lr)
SERVER_MOMENTUM = 0.9  # torch.optim.SGD(..., momentum=0.9)
SERVER_WEIGHT_DECAY = 1e-3  # --wd
CLIP_NORM = 50.0  # clip_grad_norm_(hnet.parameters(), 50)
#: how a round's replies move the hypernetwork: one step along their clipped gradients' sum
#: (:func:`server_round_sum`, the default), one step along their mean (:func:`server_round_mean`)
#: or one step per reply (:func:`server_round`); the same with one client per round
ROUND_STEPS = ("sum", "mean", "per-client")
ROUND_STEP = "sum"
INNER_STEPS = 50  # --inner-steps
INNER_CLIP_NORM = 50.0  # clip_grad_norm_(net.parameters(), 50) before each inner step


def auto_embed_dim(num_clients: int) -> int:
    """The authors' embedding size when ``--embed-dim`` is -1 (their default): ``int(1 + N / 4)``."""
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    return int(1 + num_clients / 4)


class HyperNetwork(nn.Module):
    """``h(v_i; phi)``: client index -> one tensor per target shape (Sec. 3).

    Args:
        num_clients: N, the rows of the embedding table ``v``.
        shapes: the target tensors' shapes, in the order :meth:`forward` returns them.
        embed_dim: e, the embedding size (:func:`auto_embed_dim` for the authors' default).
        hidden_dim: h, the MLP's width.
        n_hidden: the ``(ReLU, Linear(h, h))`` blocks after the first ``Linear(e, h)``.

    Parameters (phi and v) are initialised by torch's defaults (``nn.Embedding``: N(0, 1);
    ``nn.Linear``: Kaiming-uniform), as in the authors' code; build it under a seeded generator
    (:func:`build_hypernetwork`) for a repeatable start.
    """

    def __init__(self, num_clients: int, shapes: Sequence[Sequence[int]], embed_dim: int,
                 hidden_dim: int = HIDDEN_DIM, n_hidden: int = N_HIDDEN) -> None:
        super().__init__()
        for name, value, least in (("num_clients", num_clients, 1), ("embed_dim", embed_dim, 1),
                                   ("hidden_dim", hidden_dim, 1), ("n_hidden", n_hidden, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        if not shapes:
            raise ValueError("the hypernetwork needs at least one target tensor")
        self.shapes = [tuple(int(n) for n in shape) for shape in shapes]
        self.embeddings = nn.Embedding(num_clients, embed_dim)
        layers: list[nn.Module] = [nn.Linear(embed_dim, hidden_dim)]
        for _ in range(n_hidden):
            layers += [nn.ReLU(), nn.Linear(hidden_dim, hidden_dim)]
        self.mlp = nn.Sequential(*layers)
        self.heads = nn.ModuleList(nn.Linear(hidden_dim, math.prod(shape)) for shape in self.shapes)

    @property
    def num_clients(self) -> int:
        return int(self.embeddings.num_embeddings)

    def forward(self, client: int) -> list[torch.Tensor]:
        """``theta_client``: one tensor per target shape, from the client's embedding row."""
        if not 0 <= int(client) < self.num_clients:
            raise IndexError(f"client {client} is not in [0, {self.num_clients})")
        index = torch.tensor([int(client)], dtype=torch.long, device=self.embeddings.weight.device)
        features = self.mlp(self.embeddings(index))  # (1, h)
        return [head(features).reshape(shape) for head, shape in zip(self.heads, self.shapes)]


def build_hypernetwork(num_clients: int, shapes: Sequence[Sequence[int]], *, seed: int, embed_dim: int = 0,
                       hidden_dim: int = HIDDEN_DIM, n_hidden: int = N_HIDDEN) -> HyperNetwork:
    """A :class:`HyperNetwork` initialised from torch's generator seeded with ``seed`` (the
    caller's generator state is left as it was); ``embed_dim`` 0 is :func:`auto_embed_dim`."""
    embed = embed_dim or auto_embed_dim(num_clients)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        return HyperNetwork(num_clients, shapes, embed, hidden_dim, n_hidden)


def server_optimizer(hnet: nn.Module, lr: float = SERVER_LR, momentum: float = SERVER_MOMENTUM,
                     weight_decay: float = SERVER_WEIGHT_DECAY) -> torch.optim.SGD:
    """The authors' optimizer: SGD over phi and the embeddings, one learning rate, momentum and
    weight decay applied to every tensor (the embedding table included, every row of it)."""
    return torch.optim.SGD(hnet.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)


def chain_rule_gradients(hnet: HyperNetwork, client: int, delta: Sequence[torch.Tensor],
                         at: Mapping[str, torch.Tensor] | None = None) -> list[torch.Tensor]:
    """``(d theta_client / d (phi, v))^T delta`` for every parameter of ``hnet`` (Eq. 4, Alg. 1),
    ``delta = theta_client - theta~_client`` one tensor per target (cast to the network's dtype).
    The embedding table's gradient is zero off the client's row.

    ``at``: the point (phi, v) to differentiate at, by ``named_parameters`` name, when it is not
    ``hnet``'s own parameters (:func:`server_round` keeps the round's phi this way)."""
    if at is None:
        tensors, outputs = list(hnet.parameters()), hnet(client)
    else:
        tensors, outputs = list(at.values()), torch.func.functional_call(hnet, dict(at), (client,))
    if len(delta) != len(outputs):
        raise ValueError(f"delta has {len(delta)} tensors, the hypernetwork generates {len(outputs)}")
    grad_outputs = []
    for out, d in zip(outputs, delta):
        d = torch.as_tensor(d)
        if tuple(d.shape) != tuple(out.shape):
            raise ValueError(f"a delta of shape {tuple(d.shape)} for a generated tensor of shape {tuple(out.shape)}")
        grad_outputs.append(d.to(dtype=out.dtype, device=out.device))
    return list(torch.autograd.grad(outputs, tensors, grad_outputs=grad_outputs))


def total_norm(tensors: Sequence[torch.Tensor]) -> float:
    """The 2-norm of ``tensors`` taken together (what ``clip_grad_norm_`` measures)."""
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in tensors])))


def apply_step(hnet: nn.Module, optimizer: torch.optim.Optimizer, grads: Sequence[torch.Tensor],
               clip_norm: float = CLIP_NORM) -> float:
    """One optimizer step of ``hnet`` along ``grads`` (its parameters' order), the total norm
    clipped to ``clip_norm`` first (0: no clipping). Returns the norm before clipping."""
    params = list(hnet.parameters())
    if len(grads) != len(params):
        raise ValueError(f"{len(grads)} gradients for {len(params)} parameters")
    for p, g in zip(params, grads):
        p.grad = g.detach().clone()
    if clip_norm > 0:
        norm = float(torch.nn.utils.clip_grad_norm_(params, clip_norm))
    else:
        norm = total_norm([p.grad for p in params])
    optimizer.step()
    for p in params:
        p.grad = None
    return norm


def server_round(hnet: HyperNetwork, optimizer: torch.optim.Optimizer,
                 updates: Sequence[tuple[int, Sequence[torch.Tensor]]], clip_norm: float = CLIP_NORM) -> list[float]:
    """The server's step for one round's replies ``[(client, delta), ...]``: one
    :func:`apply_step` per client in the order given, each along the client's
    :func:`chain_rule_gradients` at the phi the round started from (the one that generated the
    models the clients trained). With one client per round this is Alg. 1's step exactly.
    Memory: one copy of phi (none for a single client) and one gradient at a time. Returns each
    step's gradient norm before clipping."""
    at = None
    if len(updates) > 1:
        at = {name: p.detach().clone().requires_grad_(True) for name, p in hnet.named_parameters()}
    return [apply_step(hnet, optimizer, chain_rule_gradients(hnet, client, delta, at), clip_norm)
            for client, delta in updates]


def _round_gradients(hnet: HyperNetwork, updates: Sequence[tuple[int, Sequence[torch.Tensor]]],
                     clip_each: float) -> tuple[list[torch.Tensor] | None, list[float]]:
    """The sum over a round's replies of their :func:`chain_rule_gradients`, all at ``hnet``'s
    current phi (the round's), each clipped to ``clip_each`` first (0: not clipped), and each
    reply's gradient norm before clipping. ``None`` for no replies.

    Raises:
        ValueError: two updates for one client, or a delta that does not fit."""
    clients = [client for client, _ in updates]
    if len(set(clients)) != len(clients):
        raise ValueError(f"one update per client and round; got clients {clients}")
    total: list[torch.Tensor] | None = None
    norms = []
    for client, delta in updates:
        grads = chain_rule_gradients(hnet, client, delta)  # phi does not move inside the loop
        norm = total_norm(grads)
        norms.append(norm)
        if clip_each > 0 and (factor := clip_each / (norm + 1e-6)) < 1.0:  # clip_grad_norm_'s factor
            grads = [g * factor for g in grads]
        total = grads if total is None else [t + g for t, g in zip(total, grads)]
    return total, norms


def server_round_mean(hnet: HyperNetwork, optimizer: torch.optim.Optimizer,
                      updates: Sequence[tuple[int, Sequence[torch.Tensor]]], clip_norm: float = CLIP_NORM) -> list[float]:
    """The server's step for one round's replies as one optimizer step: phi moves along the mean
    of the clients' :func:`chain_rule_gradients` and each client's embedding row along its own
    client's gradient (a row gets a gradient from its client only, so a mean over the K clients
    would shrink every embedding step K-fold). The total norm is clipped once.

    Every gradient is taken at the round's phi, which generated the models the clients trained;
    this step's size does not grow with K (for many clients a round: at 100 a round,
    :func:`server_round` and :func:`server_round_sum` overshoot). With one client it is Alg. 1's
    step exactly. Returns each client's gradient norm before clipping.

    Raises:
        ValueError: two updates for one client, or a delta that does not fit (see
            :func:`chain_rule_gradients`).
    """
    total, norms = _round_gradients(hnet, updates, clip_each=0.0)
    if total is None:
        return []
    embedding = next(i for i, p in enumerate(hnet.parameters()) if p is hnet.embeddings.weight)
    mean = [g if i == embedding else g / len(updates) for i, g in enumerate(total)]
    apply_step(hnet, optimizer, mean, clip_norm)
    return norms


def server_round_sum(hnet: HyperNetwork, optimizer: torch.optim.Optimizer,
                     updates: Sequence[tuple[int, Sequence[torch.Tensor]]], clip_norm: float = CLIP_NORM) -> list[float]:
    """The server's step for one round's replies as one optimizer step along the sum of the
    clients' :func:`chain_rule_gradients`, each clipped to ``clip_norm`` first (as Alg. 1 clips
    each client's step); the sum itself is not clipped again.

    To first order in the learning rate this moves phi as far as the authors' K one-client steps
    (without momentum), so it learns at their pace per client visited, unlike
    :func:`server_round_mean` (K times slower). Unlike :func:`server_round`, the momentum and the
    weight decay act once per round: K momentum steps along K gradients taken at the same stale
    phi compound (about 4 K steps' worth in the first round at momentum 0.9 and K = 10), which
    made the default experiment's 10-client rounds diverge. Each embedding row gets its own
    client's gradient either way. With one client it is Alg. 1's step exactly. Returns each
    client's gradient norm before clipping.

    Raises:
        ValueError: two updates for one client, or a delta that does not fit.
    """
    total, norms = _round_gradients(hnet, updates, clip_each=clip_norm)
    if total is not None:
        apply_step(hnet, optimizer, total, clip_norm=0.0)
    return norms


@torch.no_grad()
def generate(hnet: HyperNetwork, client: int, dtypes: Sequence[np.dtype] | None = None) -> list[np.ndarray]:
    """``theta_client`` as NumPy arrays (each cast to ``dtypes[k]`` when given)."""
    out = [t.detach().cpu().numpy() for t in hnet(client)]
    if dtypes is None:
        return [np.array(a, order="C") for a in out]  # copies; 0-d tensors stay 0-d
    return [np.array(a, dtype=dt, order="C") for a, dt in zip(out, dtypes)]


def momentum_buffers(optimizer: torch.optim.Optimizer, hnet: nn.Module) -> list[np.ndarray] | None:
    """The SGD momentum buffers of ``hnet``'s parameters (their order) as arrays; None before the
    first step (SGD creates them then) or without momentum."""
    buffers = []
    for p in hnet.parameters():
        buf = optimizer.state.get(p, {}).get("momentum_buffer")
        if buf is None:
            return None
        buffers.append(buf.detach().cpu().numpy().copy())
    return buffers


def load_momentum_buffers(optimizer: torch.optim.Optimizer, hnet: nn.Module, buffers: Sequence[np.ndarray]) -> None:
    """Restore :func:`momentum_buffers` (a resumed SGD continues exactly).

    Raises:
        ValueError: a count or shape differs from ``hnet``'s parameters.
    """
    params = list(hnet.parameters())
    if len(buffers) != len(params):
        raise ValueError(f"{len(buffers)} momentum buffers for {len(params)} hypernetwork tensors")
    for i, (p, buf) in enumerate(zip(params, buffers)):
        if tuple(np.shape(buf)) != tuple(p.shape):
            raise ValueError(f"momentum buffer {i} has shape {tuple(np.shape(buf))}, its tensor {tuple(p.shape)}")
    for p, buf in zip(params, buffers):
        optimizer.state[p]["momentum_buffer"] = torch.as_tensor(np.array(buf, copy=True), dtype=p.dtype, device=p.device)


def num_hypernetwork_values(num_clients: int, sizes: Sequence[int], embed_dim: int, hidden_dim: int, n_hidden: int) -> int:
    """phi's and v's size: ``N e + (e + 1) h + n_hidden (h + 1) h + sum_k (h + 1) P_k``, i.e. about
    ``(h + 1) P + N e`` for a model of P parameters (the momentum doubles the server's memory)."""
    return (num_clients * embed_dim + (embed_dim + 1) * hidden_dim + n_hidden * (hidden_dim + 1) * hidden_dim
            + sum((hidden_dim + 1) * int(p) for p in sizes))
