"""FedDAR (Zhong et al., ICLR 2023) and its baselines as Flower NumPyClients: unpack, train, pack.

The wire layout is documented in :mod:`flwr_pfl.strategies.feddar`. Clients keep nothing across
rounds (FedDAR re-sends the whole model every phase, spec 8.3); the per-domain counts L_{i,m} are
recomputed from the local data whenever they are needed. Training always goes through the shared
loop (:func:`flwr_pfl.training.train`); head statistics and local least squares come from
:mod:`flwr_pfl.core.feddar`.
"""

from __future__ import annotations

import copy

from logging import WARNING

import numpy as np
import torch
from flwr.common import log
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

from flwr_pfl.clients.base import Config, LocalData, NDArrays, PFLClient, seeded_message
from flwr_pfl.core import feddar as core
from flwr_pfl.core.packing import pack_symmetric
from flwr_pfl.data.types import Task
from flwr_pfl.errors import ConfigError
from flwr_pfl.models.base import EncoderHeadModel
from flwr_pfl.strategies.feddar import COUNTS_QUERY, HESSIAN_UPLOADS, PHASE_KEY, QUERY_KEY
from flwr_pfl.training import (
    EvalResult,
    collect_features,
    dataset_targets,
    evaluate,
    get_arrays,
    loader_like,
    read_batch,
    set_arrays,
    train,
)
from flwr_pfl.training.loops import LossFn, supervised_loss
from flwr_pfl.training.norms import running_stat_norms


def domain_mean_loss(task: Task, num_domains: int) -> LossFn:
    """Per-sample loss whose batch mean is the head-phase objective sum_m R_{i,m} (Algorithm 1
    head step, spec 9.6): sample j's loss is scaled by |B| / |B_{z_j}|, so each domain present in
    the batch contributes its own mean loss, with no u_m re-weighting."""
    base = supervised_loss(task)

    def loss(model: EncoderHeadModel, x: torch.Tensor, y: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        per_sample = base(model, x, y, d)
        counts = torch.bincount(d, minlength=num_domains).to(per_sample.dtype)
        return per_sample * (len(d) / counts[d])

    return loss


@torch.no_grad()
def with_auc(model: nn.Module, result: EvalResult, data, device: torch.device) -> EvalResult:
    """Add binary AUC to ``result`` for two-class tasks: ``auc`` on the client's test split (its
    across-client mean is the paper's "Client Avg") and ``auc_dom<m>`` per domain present with
    both classes (client-level; summarised across clients, not pooled). Two classes are told
    by the model's output width (a user's model need not declare its number of outputs)."""
    if data.task != "classification":
        return result
    model.to(device).eval()
    scores, labels, domains = [], [], []
    for batch in data.test:
        x, y, d = read_batch(batch, device, data.batch_keys)
        outputs = model(x, d)
        if outputs.shape[1] != 2:
            return result
        scores.append(torch.softmax(outputs, -1)[:, 1].cpu())
        labels.append(y.cpu())
        domains.append(d.cpu())
    if not scores:
        return result
    s, y, d = torch.cat(scores).numpy(), torch.cat(labels).numpy(), torch.cat(domains).numpy()
    extra = {"auc": core.binary_auc(s, y)}
    for m in np.unique(d):
        auc = core.binary_auc(s[d == m], y[d == m])
        if np.isfinite(auc):
            extra[f"auc_dom{int(m)}"] = auc
    result.extra = {**result.extra, **{k: v for k, v in extra.items() if np.isfinite(v)}}
    return result


class DomainAwareClient(PFLClient):
    """Base of the clients whose server needs their per-domain counts L_{i,m}.

    Answers the strategy's ``get_properties`` count query and checks that every local domain
    label lies in [0, M) (a label outside raises ValueError naming the client, so its reply counts
    as a failure instead of reaching an aggregate).
    """

    #: DP-SGD cannot cover this client (see PFLClient.record_dp_refusal)
    record_dp_refusal = (
        'the FedDAR family sends per-domain counts, heads and Hessians (feature Gram matrices) computed '
        'from the data outside DP-SGD'
    )

    @property
    def num_domains(self) -> int:
        return self.data.num_domains

    def train_domains(self) -> torch.Tensor:
        """Domain labels of the local training samples in dataset order (0 for plain (x, y) data)."""
        return dataset_targets(self.data.train, self.data.batch_keys)[1].long()

    def domain_counts(self) -> np.ndarray:
        """L_{i,m} of the training split, shape (M,), int64; ValueError for labels outside [0, M)."""
        try:
            return core.domain_counts(self.train_domains(), self.num_domains).numpy()
        except ValueError as err:
            raise ValueError(f"client partition {self.partition_id}: {err}") from None

    def head_loss(self) -> core.HeadLoss:
        """Loss of the linear heads, which fixes their Hessian (Sec. 4.3): squared error for
        regression, softmax cross-entropy otherwise; reported to the server, whose SA solve
        needs no trust region for squared loss."""
        return core.HeadLoss.SQUARED if self.data.task == "regression" else core.HeadLoss.SOFTMAX

    def local_evaluate(self, config: Config) -> EvalResult:
        return with_auc(self.model, super().local_evaluate(config), self.data, self.device)

    def get_properties(self, config: Config) -> dict[str, bool | bytes | float | int | str]:
        if config.get(QUERY_KEY) != COUNTS_QUERY:
            return super().get_properties(config)
        counts = self.domain_counts()
        head = {  # FedDAR's head layout; a user's model without a named head has none to report
            "num_outputs": int(self.model.num_outputs),
            "feature_dim": int(self.model.feature_dim),
            "head_bias": self.model.heads[0].bias is not None,
            "head_loss": self.head_loss().value,
        } if getattr(self.model, "splits_features", False) else {}
        return {
            "partition_id": self.partition_id,
            "num_domains": self.num_domains,
            **head,
            **{f"n_d{m}": int(n) for m, n in enumerate(counts)},
        }


class ReweightedFedAvgClient(DomainAwareClient):
    """FedAvg (w/ RW) and FedAvg + multi-head: the whole model trained for ``local-epochs`` on the
    u-re-weighted loss (1/|B|) sum_j u_{z_j} l_j (Eq. 6); the received ``[u]`` is the last array."""

    @seeded_message
    def fit(self, parameters: NDArrays, config: Config) -> tuple[NDArrays, int, Config]:
        self.domain_counts()  # stops on bad domain labels
        self._u = torch.as_tensor(parameters[-1], dtype=torch.float32)
        return super().fit(parameters[:-1], config)

    def local_update(self, config: Config) -> dict[str, float]:
        stats = self.train_groups(("all",), self.train_config.local_epochs, domain_weights=self._u)
        return {"train_loss": stats.loss, "train_seconds": stats.seconds}


class FedDARClient(DomainAwareClient):
    """FedDAR's client (Algorithm 1): answers the head phase, the representation phase and the
    warmup, as the fit config's ``feddar-phase`` says.

    Head phase (encoder frozen): features phi^{t-1}(x) are computed once in eval mode
    (``cache-features``), the heads start from the global heads and train for tau_h epochs on
    sum_m R_{i,m} (``head-solver="gd"``) or jump to the exact local least-squares minimiser
    nearest to the global head (``"lstsq"``, squared loss); for SA the client adds the exact
    mean-normalised Hessian of each R_{i,m} at the local (or global) head. Representation phase
    (heads frozen at h^t): tau_phi epochs on the encoder with the u-re-weighted loss.

    The model needs one linear head per domain on the representation. A user's own model with
    its final ``nn.Linear`` named as the head gets them built here, as copies of that head (its
    module is head 0): ``FedDARClient(context, Net(), data, head="fc3")`` has
    ``data.num_domains`` heads; or hand it ``split_model(net, head="fc3", num_heads=M)``.
    """

    head_requirement = "module"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        kinds = {type(h).__name__ for h in self.model.heads if not isinstance(h, nn.Linear)}
        if kinds:
            raise ConfigError(
                f"FedDAR needs linear heads (it aggregates and solves for them as [W | b]); this "
                f"model's head is a {', '.join(sorted(kinds))}: name its final nn.Linear as the head"
            )

    @classmethod
    def heads_for(cls, data: LocalData) -> int:
        """One head per domain."""
        return data.num_domains

    def head_layout(self) -> core.HeadLayout:
        return core.HeadLayout(int(self.model.num_outputs), int(self.model.feature_dim), self.model.heads[0].bias is not None)

    def flat_heads(self) -> torch.Tensor:
        """The model's heads as a float64 (M, P) tensor in the wire layout."""
        layout = self.head_layout()
        return torch.stack([
            layout.pack(h.weight.detach().double(), h.bias.detach().double() if h.bias is not None else None)
            for h in self.model.heads
        ])

    def set_flat_heads(self, heads: torch.Tensor) -> None:
        layout = self.head_layout()
        with torch.no_grad():
            for m, head in enumerate(self.model.heads):
                weight, bias = layout.unpack(heads[m])
                head.weight.copy_(weight)
                if bias is not None:
                    head.bias.copy_(bias)

    @seeded_message
    def fit(self, parameters: NDArrays, config: Config) -> tuple[NDArrays, int, Config]:
        phase = str(config.get(PHASE_KEY, ""))
        if self.model.num_heads != self.num_domains:
            raise ValueError(f"FedDAR needs one head per domain: the model has {self.model.num_heads}, the data {self.num_domains} domains")
        counts = self.domain_counts()  # stops on bad domain labels
        optimizer = self.train_config.optimizer.scaled(float(config.get("lr-scale", 1.0)))
        epochs = int(config.get("epochs", 1))
        meta = {"partition_id": self.partition_id}
        if phase == "head":
            self.receive(parameters)
            arrays, metrics = self.head_phase(config, counts)
            return arrays, int(counts.sum()), {**metrics, **meta}
        if phase not in ("rep", "warmup"):
            raise ValueError(f"unknown {PHASE_KEY}={phase!r}; expected 'head', 'rep' or 'warmup'")
        self.receive(parameters[:-1])
        u = torch.as_tensor(parameters[-1], dtype=torch.float32)
        group = "body" if phase == "rep" else "all"
        stats = self.train_groups((group,), epochs, optimizer=optimizer, domain_weights=u)
        return get_arrays(self.model, group), int(counts.sum()), {"train_loss": stats.loss, "train_seconds": stats.seconds, **meta}

    def head_phase(self, config: Config, counts: np.ndarray) -> tuple[NDArrays, dict[str, float]]:
        """Local head update and, for SA, head Hessians (Algorithm 1, head phase; Eq. 8 inputs)."""
        layout, loss, num_domains = self.head_layout(), self.head_loss(), self.num_domains
        optimizer = self.train_config.optimizer.scaled(float(config.get("lr-scale", 1.0)))
        epochs = int(config.get("epochs", 5))
        solver = str(config.get("head-solver", "gd"))
        start = self.flat_heads()
        feats, y, d = collect_features(self.model, self.data.train, device=self.device, keys=self.data.batch_keys)
        seconds = 0.0
        if solver == "lstsq":
            if loss is not core.HeadLoss.SQUARED:
                raise ValueError("head-solver 'lstsq' needs squared loss (a regression task)")
            self.set_flat_heads(core.local_least_squares_heads(feats, y, d, start.to(feats.device), layout))
        elif solver == "gd":
            loss_fn = domain_mean_loss(self.data.task, num_domains)
            if bool(config.get("cache-features", True)):
                head_model = EncoderHeadModel(nn.Identity(), layout.feature_dim, layout.num_outputs, num_domains, layout.bias)
                head_model.heads = self.model.heads  # shared modules: training them trains the model's heads
                loader = DataLoader(TensorDataset(feats.cpu(), y.cpu(), d.cpu()), batch_size=self.data.train.batch_size or 32, shuffle=True)
                stats = train(head_model, loader, optimizer=optimizer, device=self.device, epochs=epochs,
                              groups=("heads",), task=self.data.task, loss_fn=loss_fn,
                              who=f"{self.who} (head phase; its inputs are the encoder features)")
            else:
                stats = self.train_groups(("heads",), epochs, optimizer=optimizer, loss_fn=loss_fn)
            seconds = stats.seconds
        else:
            raise ValueError(f"unknown head-solver {solver!r}; expected 'gd' or 'lstsq'")
        local = self.flat_heads().to(feats.device)
        per_sample = core.per_sample_loss(core.head_outputs(feats, d, local, layout), y, loss)
        present = max(int((counts > 0).sum()), 1)
        metrics = {"head_loss": float(core.head_phase_loss(per_sample, d, num_domains)) / present, "train_seconds": seconds}
        arrays = [local.cpu().numpy(), counts.astype(np.float64)]
        if bool(config.get("hessian", False)):
            point = core.hessian_point(str(config.get("hessian-at", "local")), local, start.to(feats.device))
            stats_h = core.head_statistics(feats, y, d, point, layout, loss,
                                           max_hessian_params=int(config.get("max-hessian-params", 4096)))
            arrays.append(hessian_upload(stats_h.hessians.cpu().numpy(), str(config.get("hessian-upload", "full"))))
        return arrays, metrics


def hessian_upload(hessians: np.ndarray, how: str) -> np.ndarray:
    """The (M, P, P) head Hessians as the server asked for them (``hessian-upload``): whole,
    or each one's upper triangle (M, P(P+1)/2), in float64 or float32."""
    if how not in HESSIAN_UPLOADS:
        raise ValueError(f"unknown hessian-upload={how!r}; expected one of {', '.join(map(repr, HESSIAN_UPLOADS))}")
    if how == "full":
        return hessians
    packed = pack_symmetric(hessians)
    return packed.astype(np.float32) if how == "packed-float32" else packed


class _PerDomainModels(nn.Module):
    """M whole models; sample i is predicted by model ``domain[i]`` (for evaluation)."""

    def __init__(self, models: list[EncoderHeadModel]) -> None:
        super().__init__()
        self.models = nn.ModuleList(models)

    def forward(self, x: torch.Tensor, domain: torch.Tensor) -> torch.Tensor:
        outputs = torch.stack([m(x) for m in self.models])
        return outputs[domain, torch.arange(x.shape[0], device=x.device)]


class SeparateFedAvgClient(DomainAwareClient):
    """Separate FedAvg: M copies of a one-head model; copy m trains for ``local-epochs`` on the
    client's domain-m samples only (if any) and predicts domain-m test samples."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.models = [copy.deepcopy(self.model) for _ in range(self.num_domains)]

    def get_parameters(self, config: Config) -> NDArrays:
        return [a for model in self.models for a in get_arrays(model, "all")]

    def wire_names(self) -> list[str]:
        """Model m's ``state_dict`` keys prefixed ``models.<m>.``, for m = 0 .. M-1."""
        return [f"models.{m}.{key}" for m, model in enumerate(self.models) for key in model.state_dict()]

    def receive(self, parameters: NDArrays) -> None:
        per_model = len(parameters) // self.num_domains
        for m, model in enumerate(self.models):
            set_arrays(model, parameters[m * per_model : (m + 1) * per_model], "all")

    @seeded_message
    def fit(self, parameters: NDArrays, config: Config) -> tuple[NDArrays, int, Config]:
        counts = self.domain_counts()
        arrays, n, metrics = super().fit(parameters, config)
        return arrays + [counts.astype(np.float64)], n, metrics

    def local_update(self, config: Config) -> dict[str, float]:
        """Train copy m on the domain-m samples. Splitting the client's data by domain can leave
        a domain's last batch with one sample; a model with BatchNorm (in train mode here: the
        whole copy trains) cannot take a training step on one sample (no batch statistics: torch
        stops with "Expected more than 1 value per channel when training"), so such a batch is
        dropped from each epoch (the loader shuffles: a different sample each epoch), and a
        domain with a single sample leaves its copy as received this round (logged)."""
        domains = self.train_domains()
        losses, seconds = [], 0.0
        has_batch_norm = bool(running_stat_norms(self.models[0])) if self.models else False
        for m, model in enumerate(self.models):
            index = torch.nonzero(domains == m).flatten().tolist()
            if not index:
                continue
            batch_size = self.data.train.batch_size or 32  # what loader_like uses
            single = has_batch_norm and len(index) % batch_size == 1
            if single and len(index) == 1:
                log(WARNING, "%s: domain %d has 1 training sample, and the model's BatchNorm cannot train on one "
                    "sample: domain %d's model is not trained this round", self.who, m, m)
                continue
            loader = loader_like(self.data.train, Subset(self.data.train.dataset, index), shuffle=True, drop_last=single)
            stats = train(model, loader, optimizer=self.train_config.optimizer, device=self.device,
                          epochs=self.train_config.local_epochs, task=self.data.task,
                          who=f"{self.who} (domain {m}'s model)", keys=self.data.batch_keys)
            losses.append(stats.loss)
            seconds += stats.seconds
        return {"train_loss": float(np.mean(losses)) if losses else 0.0, "train_seconds": seconds}

    def local_evaluate(self, config: Config) -> EvalResult:
        routed = _PerDomainModels(self.models)
        result = evaluate(routed, self.data.test, device=self.device,  # type: ignore[arg-type]
                          task=self.data.task, num_domains=self.num_domains, keys=self.data.batch_keys)
        return with_auc(routed, result, self.data, self.device)


__all__ = ["DomainAwareClient", "FedDARClient", "ReweightedFedAvgClient", "SeparateFedAvgClient", "domain_mean_loss"]
