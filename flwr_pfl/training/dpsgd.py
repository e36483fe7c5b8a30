"""Record-level differential privacy of a client's local training: DP-SGD.

Each optimizer step (Abadi et al. 2016, "Deep Learning with Differential Privacy", Alg. 1):

1. the batch is drawn by **Poisson sampling**: every training record is taken independently
   with probability ``q = B / n`` (``B`` the batch size, ``n`` the client's records);
2. each record's gradient ``g_i`` (of its own loss, weighted as the algorithm weights it) is
   clipped to L2 norm ``C``: ``g_i min(1, C / ||g_i||)``, over every trained parameter together;
3. the clipped gradients are summed, Gaussian noise ``N(0, (z C)^2)`` is added to every
   coordinate, and the sum is divided by ``B`` (the expected batch size, fixed, so that the
   step does not reveal the batch's size);
4. a regularizer's gradient (a proximal term: no record enters it) is added, and the optimizer
   steps.

The unit of privacy is one training record of one client, add-or-remove neighbouring. Every step
is a Poisson-subsampled Gaussian mechanism with multiplier ``z``; a client's steps over the
whole run are composed by Google's ``dp-accounting`` (Renyi DP), the epsilon reported at the
client's ``delta`` after every round. Whatever the client sends that is computed from the trained
model (weights, updates, their evaluation) is post-processing and covered; what it computes from
its data otherwise (feature statistics, prototypes, validation losses that steer the server) is
not, which is why the algorithms that send such things refuse record-level DP.

Per-record gradients come from ``torch.func`` (``vmap`` over ``grad``), so any loss written
with batched PyTorch operations works; BatchNorm does not (a record's output depends on the
rest of its batch, and the running statistics would be released unnoised), so models with
running-statistics normalisation are refused (GroupNorm models, e.g. ``resnet18-gn``, work).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.data import DataLoader

from flwr_pfl.errors import ConfigError
from flwr_pfl.training.norms import running_stat_norms

#: (model, x, y, domain) -> per-sample losses of shape (B,)
LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

#: the Renyi orders of the accountant: integers, where the subsampled Gaussian's RDP is exact
#: (dp-accounting's fractional orders fail to converge for some rates and are dropped with a warning)
RDP_ORDERS = tuple(float(order) for order in range(2, 257))
#: how to install what the accountant needs
ACCOUNTING_EXTRA = 'pip install "flwr_pfl[privacy]" (Google\'s dp-accounting)'


@dataclass(frozen=True)
class RecordLevelDP:
    """Settings of DP-SGD (run keys ``dp-record-*``).

    Args:
        noise_multiplier: ``z`` (> 0).
        clip_norm: ``C``, each record's gradient is clipped to this L2 norm (> 0).
        delta: the delta at which epsilon is reported, in (0, 1); each client also needs it
            below ``1 / n`` for its ``n`` records (checked when the client is built).
        noise_seed: None (default): sampling and noise from the operating system's entropy, so
            that nobody can reproduce them; an integer makes them repeatable (then the run is not
            private against whoever knows it).
    """

    noise_multiplier: float
    clip_norm: float = 1.0
    delta: float = 1e-5
    noise_seed: int | None = None

    def __post_init__(self) -> None:
        if not self.noise_multiplier > 0:
            raise ConfigError(f"{type(self).__name__}(noise_multiplier={self.noise_multiplier}) (run config dp-record-noise-multiplier): DP-SGD needs noise > 0 (0 turns "
                              "record-level DP off)")
        if not self.clip_norm > 0:
            raise ConfigError(f"{type(self).__name__}(clip_norm={self.clip_norm}) (run config dp-record-clip-norm): DP-SGD needs a clipping norm > 0")
        if not 0 < self.delta < 1:
            raise ConfigError(f"{type(self).__name__}(delta={self.delta}) (run config dp-record-delta): delta must be in (0, 1) and below 1/n for a client of n "
                              "records (0 has no finite epsilon)")


def check_model(model: nn.Module, who: str = "") -> None:
    """ConfigError when ``model`` has normalisation with running statistics (BatchNorm)."""
    norms = [name for name, _ in running_stat_norms(model)]
    if norms:
        owner = f"{who}: " if who else ""
        raise ConfigError(f"{owner}record-level DP (DP-SGD) needs per-record gradients, but the model has BatchNorm-like "
                          f"modules with running statistics ({', '.join(norms[:3])}{', ...' if len(norms) > 3 else ''}): "
                          "a record's output depends on its batch and the statistics would leave unnoised; use a model "
                          "without them (mlp, cnn, resnet18-gn)")


@dataclass
class StepAccount:
    """The DP-SGD steps a client has taken, per (sampling rate, noise multiplier)."""

    steps: dict[tuple[float, float], int] = field(default_factory=dict)

    def add(self, rate: float, noise_multiplier: float, steps: int) -> None:
        key = (rate, noise_multiplier)
        self.steps[key] = self.steps.get(key, 0) + steps

    def epsilon(self, delta: float) -> float:
        """Epsilon of every step so far at ``delta`` (Renyi DP of the Poisson-subsampled Gaussian)."""
        if not any(self.steps.values()):
            return 0.0
        try:
            from dp_accounting import dp_event
            from dp_accounting.rdp import RdpAccountant
        except ImportError as err:
            raise ConfigError(f"record-level DP accounts privacy with dp-accounting, which is not installed ({err}); "
                              f"{ACCOUNTING_EXTRA}") from None
        accountant = RdpAccountant(orders=RDP_ORDERS)
        for (rate, z), count in sorted(self.steps.items()):
            accountant.compose(dp_event.PoissonSampledDpEvent(rate, dp_event.GaussianDpEvent(z)), count)
        return float(accountant.get_epsilon(delta))

    def to_scalars(self) -> dict[str, int]:
        """As ``{"<rate>|<z>": steps}`` (a client's state record)."""
        return {f"{rate!r}|{z!r}": count for (rate, z), count in self.steps.items()}

    @classmethod
    def from_scalars(cls, values: dict[str, object]) -> StepAccount:
        account = cls()
        for key, count in values.items():
            rate, z = (float(part) for part in str(key).split("|"))
            account.add(rate, z, int(count))  # type: ignore[arg-type]
        return account


class PrivateSteps:
    """One message's DP-SGD: the Poisson batches, the noisy clipped gradients, the steps taken."""

    def __init__(self, settings: RecordLevelDP, num_records: int, batch_size: int, seed: int | None) -> None:
        """``seed``: the message's seed when ``settings.noise_seed`` is set (repeatable), else
        ignored and the generator is seeded from the operating system."""
        if num_records < 1:
            raise ConfigError("record-level DP needs at least one training record")
        self.settings = settings
        self.num_records = num_records
        self.batch_size = batch_size
        self.rate = min(1.0, batch_size / num_records)
        self.generator = torch.Generator()
        # a tuple's hash is a signed 64-bit integer, which manual_seed takes as it is
        self.generator.manual_seed(secrets.randbits(63) if settings.noise_seed is None else hash((settings.noise_seed, seed)))
        self.steps = 0

    def steps_per_epoch(self) -> int:
        """``ceil(n / B)``: an epoch is as many Poisson batches as a pass of fixed batches."""
        return math.ceil(self.num_records / self.batch_size)

    def batches(self, loader: DataLoader, epochs: int) -> Iterator[object | None]:
        """``epochs`` epochs of Poisson batches from ``loader``'s dataset, collated as the loader
        does; None for an empty batch (the step is then noise only)."""
        dataset = loader.dataset
        collate = loader.collate_fn
        for _ in range(epochs * self.steps_per_epoch()):
            chosen = torch.nonzero(torch.rand(self.num_records, generator=self.generator) < self.rate).flatten()
            yield collate([dataset[int(i)] for i in chosen]) if len(chosen) else None

    def gradients(
        self,
        model: nn.Module,
        params: Sequence[nn.Parameter],
        per_record_loss: Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
        batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """The noisy mean of the clipped per-record gradients of ``params`` (one tensor each) and
        the batch's per-record losses (None for an empty batch)."""
        z, clip = self.settings.noise_multiplier, self.settings.clip_norm
        if batch is None:
            summed = [torch.zeros_like(p) for p in params]
            losses = None
        else:
            grads, losses = per_record_gradients(model, params, per_record_loss, *batch)
            norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in grads))
            factors = torch.clamp(clip / (norms + 1e-12), max=1.0)
            summed = [torch.einsum("b,b...->...", factors, g) for g in grads]
        noisy = [(s + z * clip * torch.randn(s.shape, generator=self.generator).to(s.device)) / self.batch_size
                 for s in summed]
        self.steps += 1
        return noisy, losses


class _LossOf(nn.Module):
    """``loss_fn(model, x, y, d)`` as a module, so that ``torch.func.functional_call`` can swap
    the model's parameters for the per-record ones."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, x: torch.Tensor, y: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.model, x, y, d)


def per_record_gradients(
    model: nn.Module,
    params: Sequence[nn.Parameter],
    loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    d: torch.Tensor,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each record's gradient of its own loss with respect to ``params`` (tensors of shape
    ``(b, *p.shape)``) and the records' losses (``(b,)``), by ``vmap`` over ``grad``; dropout
    draws independently per record."""
    from torch.func import functional_call, grad, vmap

    wrapper = _LossOf(model, loss_fn)
    name_of = {id(p): f"model.{n}" for n, p in model.named_parameters()}
    names = [name_of[id(p)] for p in params]
    detached = {name_of[id(p)]: p.detach() for p in params}

    def loss_one(weights: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor, di: torch.Tensor):
        loss = functional_call(wrapper, weights, (xi.unsqueeze(0), yi.unsqueeze(0), di.unsqueeze(0))).sum()
        return loss, loss.detach()

    grads, losses = vmap(grad(loss_one, has_aux=True), in_dims=(None, 0, 0, 0), randomness="different")(detached, x, y, d)
    return [grads[name] for name in names], losses
