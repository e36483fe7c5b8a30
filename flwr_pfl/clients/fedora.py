"""FEDORA's NumPyClient: selective regularization toward the server's auxiliary model.

Per round (Algorithm 1 lines 9-14; mathematics in :mod:`flwr_pfl.core.fedora`): receive
``theta_hat_k``; load the personalized model ``theta_k`` from ``context.state`` (first contact:
``theta_hat_k``); compare their validation errors and set ``lambda_k`` (Eq. 8); train ``theta_k``
for E epochs on ``CE + lambda_k ||theta_k - theta_hat_k||^2`` (Eq. 9) with the shared train loop;
store ``theta_k`` in ``context.state`` and upload it. Evaluation uses the stored ``theta_k``.

Optionally a LOCAL shadow model (no communication, same optimizer, same batches) is trained
beside it and kept in ``context.state`` too, so that the server can report R-Acc and PTR
against LOCAL on the same splits in the same run. Wire layout: see
:mod:`flwr_pfl.strategies.fedora`.
"""

from __future__ import annotations

import copy
from logging import WARNING

import numpy as np
import torch
from flwr.common import log

from flwr_pfl.clients.base import Config, NDArrays, PFLClient, seeded_message
from flwr_pfl.core import fedora as core
from flwr_pfl.models.base import EncoderHeadModel
from flwr_pfl.strategies.fedora import PHASE_KEY, SETUP_ERROR_KEY
from flwr_pfl.training import (
    EvalResult,
    collect_features,
    get_arrays,
    load_arrays,
    num_samples,
    read_batch,
    save_arrays,
    set_arrays,
    train,
)
from torch.utils.data import DataLoader

LOCAL_KEY = "fedora-local"


class FEDORAClient(PFLClient):
    """FEDORA client: the whole model is personal (``context.state``); the wire carries
    ``theta_hat_k`` down and ``theta_k`` up.

    The validation errors of Eq. 8 come from the model's features and head
    (``features()`` / ``head_outputs()``), and the subspaces' one-hot labels from its number of
    outputs, so a user's own model needs its head named as one module, e.g.
    ``FEDORAClient(context, Net(), data, head="fc3")`` (``head`` as in :class:`PFLClient`).

    Args:
        config: default client rules (``selection``, ``prox``, ``validation``) and subspace
            options; the strategy's fit/setup config overrides them key by key, so the server's
            settings win when both are given.
        local_baseline: train the LOCAL shadow model (the strategy's fit config overrides).
        *args, **kwargs: :class:`PFLClient`'s arguments.
    """

    #: DP-SGD cannot cover this client (see PFLClient.record_dp_refusal)
    record_dp_refusal = (
        'it uploads the principal subspace of its raw inputs and labels, and trains its auxiliary model '
        'by its own loop, outside DP-SGD'
    )

    shared_group = "all"
    personal_group = "all"
    head_requirement = "module"

    def __init__(self, *args, config: core.FedoraConfig | None = None, local_baseline: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.config = config or core.FedoraConfig()
        self.local_baseline = local_baseline

    # ---------------------------------------------------------------- options from the wire
    def rules(self, config: Config) -> tuple[core.LambdaOptions, core.ProxOptions, core.ValidationOptions, bool]:
        """The client rules: the strategy's config keys over this client's defaults."""
        sel, prox, val = self.config.selection, self.config.prox, self.config.validation
        lam_max = float(config.get("fedora-lambda-max", sel.lambda_max or 0.0))
        sel = core.LambdaOptions(
            rule=str(config.get("fedora-lambda-rule", sel.rule)),  # type: ignore[arg-type]
            epsilon=float(config.get("fedora-epsilon", sel.epsilon)),
            constant=float(config.get("fedora-lambda-constant", sel.constant)),
            lambda_max=lam_max if lam_max > 0 else None,
            on_nonfinite=str(config.get("fedora-on-nonfinite", sel.on_nonfinite)),  # type: ignore[arg-type]
        )
        prox = core.ProxOptions(
            factor=float(config.get("fedora-prox-factor", prox.factor)),
            mode=str(config.get("fedora-prox-mode", prox.mode)),  # type: ignore[arg-type]
        )
        val = core.ValidationOptions(
            metric=str(config.get("fedora-val-metric", val.metric)),  # type: ignore[arg-type]
            reduction=str(config.get("fedora-val-reduction", val.reduction)),  # type: ignore[arg-type]
            batch_size=int(config.get("fedora-val-batch-size", val.batch_size)),
        )
        return sel, prox, val, bool(config.get("fedora-local-baseline", self.local_baseline))

    def subspace_options(self, config: Config) -> core.SubspaceOptions:
        s = self.config.subspace
        return core.SubspaceOptions(
            p=int(config.get("fedora-p", s.p)),
            use_labels=bool(config.get("fedora-use-labels", s.use_labels)),
            center=bool(config.get("fedora-center", s.center)),
            label_scale=float(config.get("fedora-label-scale", s.label_scale)),
            rank_rtol=float(config.get("fedora-rank-rtol", s.rank_rtol)),
        )

    # ---------------------------------------------------------------- setup (Algorithm 1 l. 1-3)
    def training_matrix(self) -> tuple[np.ndarray, np.ndarray]:
        """The training inputs flattened to ``(n, d_x)`` and their labels, in loader order."""
        xs, ys = [], []
        for batch in self.data.train:
            x, y, _ = read_batch(batch, torch.device("cpu"), self.data.batch_keys)
            xs.append(x.reshape(len(x), -1))
            ys.append(y)
        return torch.cat(xs).double().numpy(), torch.cat(ys).numpy()

    def setup(self, config: Config) -> tuple[NDArrays, int, Config]:
        """Upload ``U_k`` (``(d_x + C) x p``); ``[]`` with a reason if the data cannot define one."""
        n = num_samples(self.data.train)
        metrics: Config = {"partition_id": self.partition_id}
        options = self.subspace_options(config)
        x, y = self.training_matrix()
        num_classes = int(self.model.num_outputs) if self.data.task == "classification" else None
        try:
            u = core.client_subspace(x, y if options.use_labels else None, num_classes=num_classes, options=options)
        except ValueError as err:
            log(WARNING, "FEDORA client %d: no subspace: %s", self.partition_id, err)
            return [], max(n, 1), {**metrics, SETUP_ERROR_KEY: str(err)}
        return [u.astype(np.float32)], n, metrics

    # ---------------------------------------------------------------- validation error (Eq. 8)
    def validation_loader(self) -> DataLoader:
        if self.data.val is not None:
            return self.data.val
        log(WARNING, "FEDORA client %d has no validation split (give LocalData(val=...) a validation loader; run config: val-fraction > 0); Eq. 8 uses "
            "the training split instead", self.partition_id)
        return self.data.train

    def validation_error(self, model: EncoderHeadModel, options: core.ValidationOptions) -> float:
        """``L~_k`` of ``model`` on the validation split (per-sample errors, then reduced)."""
        feats, y, d = collect_features(model, self.validation_loader(), device=self.device, keys=self.data.batch_keys)
        with torch.no_grad():
            outputs = model.head_outputs(feats, d)
        loss = "cross_entropy" if self.data.task == "classification" else "mse"
        if loss == "mse":
            y = y.reshape(outputs.shape)
        errors = core.per_sample_errors(outputs, y, metric=options.metric, loss=loss)
        return core.validation_error(errors, options)

    # ---------------------------------------------------------------- NumPyClient
    @seeded_message
    def fit(self, parameters: NDArrays, config: Config) -> tuple[NDArrays, int, Config]:
        if config.get(PHASE_KEY) == "setup":
            return self.setup(config)
        sel, prox, val, local_baseline = self.rules(config)
        first_contact = self.PERSONAL_KEY not in self.context.state
        aux = copy.deepcopy(self.model)
        set_arrays(aux, parameters, "all")  # theta_hat_k
        if first_contact:
            set_arrays(self.model, parameters, "all")
        loss_personal = self.validation_error(self.model, val)
        loss_aux = self.validation_error(aux, val)
        nonfinite = not (np.isfinite(loss_personal) and np.isfinite(loss_aux))
        lam = float(core.selection_weight(loss_personal, loss_aux, sel))  # raises on NaN under "raise"
        aux_params = [p.detach().to(self.device) for p in aux.parameters()]
        seed = self.round_seed(config)
        torch.manual_seed(seed)  # the LOCAL shadow model below sees the same batch order
        kwargs: dict = {}
        if lam > 0 and prox.mode == "loss":
            kwargs["regularizer"] = lambda m: core.proximal_penalty(list(m.parameters()), aux_params, lam, prox.factor)
        elif lam > 0:
            kwargs["after_step"] = self._post_step(aux_params, lam, prox.factor)
        stats = self.train_groups(("all",), self.train_config.local_epochs, **kwargs)
        self.keep_personal()
        metrics: Config = {
            "lambda": lam,
            "lambda_active": float(lam > sel.epsilon),
            "lambda_nonfinite": float(nonfinite),
            "delta": float(loss_personal - loss_aux) if not nonfinite else 0.0,
            "val_loss_personal": float(loss_personal) if np.isfinite(loss_personal) else -1.0,
            "val_loss_aux": float(loss_aux) if np.isfinite(loss_aux) else -1.0,
            "first_contact": float(first_contact),
            "train_loss": stats.loss,
            "train_seconds": stats.seconds,
        }
        if local_baseline:
            metrics["local_train_loss"] = self._train_local(parameters, seed)
        num_examples = num_samples(self.data.train)
        return get_arrays(self.model, "all"), num_examples, {**metrics, "partition_id": self.partition_id}

    def _post_step(self, aux_params: list[torch.Tensor], lam: float, factor: float):
        """The official code's correction after each optimizer step (ProxOptions.mode='post_step')."""
        lr = self.train_config.optimizer.learning_rate
        before = [p.detach().clone() for p in self.model.parameters()]

        def after_step(model: EncoderHeadModel, step: int) -> None:
            params = list(model.parameters())
            core.apply_proximal_correction_(params, before, aux_params, lam, lr, factor)
            for b, p in zip(before, params):
                b.copy_(p.detach())

        return after_step

    def _local_model(self, parameters: NDArrays | None) -> EncoderHeadModel | None:
        """The LOCAL shadow model from ``context.state`` (first contact: ``parameters``)."""
        stored = load_arrays(self.context.state, LOCAL_KEY)
        if stored is None and not parameters:
            return None
        local = copy.deepcopy(self.model)
        set_arrays(local, stored if stored is not None else parameters, "all")
        return local

    def _train_local(self, parameters: NDArrays, seed: int) -> float:
        """One round of LOCAL training (same optimizer, epochs and batch order) on the shadow model."""
        local = self._local_model(parameters)
        assert local is not None
        torch.manual_seed(seed)  # inside fit's seeded scope: restored when fit returns
        stats = train(local, self.data.train, optimizer=self.train_config.optimizer, device=self.device,
                      epochs=self.train_config.local_epochs, groups=("all",), task=self.data.task,
                      who=f"{self.who} (LOCAL shadow model)", keys=self.data.batch_keys)
        save_arrays(self.context.state, LOCAL_KEY, get_arrays(local, "all"))
        return stats.loss

    @seeded_message
    def evaluate(self, parameters: NDArrays, config: Config) -> tuple[float, int, Config]:
        """Evaluate the stored ``theta_k`` on the test split (and the validation split for the
        best-validation round), the LOCAL shadow model beside it, and ``theta_hat_k`` if sent."""
        trained = self.PERSONAL_KEY in self.context.state
        if not trained and parameters:
            set_arrays(self.model, parameters, "all")  # never trained: its model is theta_hat_k
        result = self.evaluate_on(self.data.test)
        metrics: Config = {**result.metrics(), "trained": float(trained), "partition_id": self.partition_id}
        if self.data.val is not None:
            metrics |= self._scores(self.evaluate_on(self.data.val), "val_")
        local = self._local_model(None)
        if local is not None:
            metrics |= self._scores(self._evaluate_model(local, self.data.test), "local_")
            if self.data.val is not None:
                metrics |= self._scores(self._evaluate_model(local, self.data.val), "local_val_")
        if parameters:
            aux = copy.deepcopy(self.model)
            set_arrays(aux, parameters, "all")
            metrics |= self._scores(self._evaluate_model(aux, self.data.test), "aux_")
        return result.loss, result.num_examples, metrics

    def _evaluate_model(self, model: EncoderHeadModel, loader: DataLoader) -> EvalResult:
        original, self.model = self.model, model
        try:
            return self.evaluate_on(loader)
        finally:
            self.model = original

    @staticmethod
    def _scores(result: EvalResult, prefix: str) -> dict[str, float]:
        out = {f"{prefix}loss": result.loss}
        if result.accuracy is not None:
            out[f"{prefix}accuracy"] = result.accuracy
        return out
