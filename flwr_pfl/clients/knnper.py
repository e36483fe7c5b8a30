"""kNN-Per's client (Marfoq, Neglia, Vidal and Kameni, ICML 2022): FedAvg's training, and at
evaluation the global model interpolated with a kNN model over the client's own memory.

Training is FedAvg's, unchanged (:meth:`PFLClient.local_update`). Every evaluation:

1. scores the received global model on the test split as it stands (``global_loss``,
   ``global_accuracy``, the library's evaluation loop);
2. builds the datastore: the global model's representation (the head's input, ``features()``,
   in eval mode, so BatchNorm uses its running statistics and dropout is off) and the label of
   every training sample, or of a fixed random ``capacity`` fraction of them;
3. chooses lambda (``lam=None``): on the validation split (``LocalData.val``; the run's
   ``val-fraction``), the grid value whose mixture is most accurate, ties broken by the lower
   validation loss, then by the smaller lambda (:func:`~flwr_pfl.core.knnper.select_lambda`).
   A client without a validation split falls back, with a warning, to leave-one-out on its
   training split: each training sample is scored by the global model and by its neighbours
   in the datastore other than itself. A fixed ``lam`` skips this step;
4. reports the mixture's loss and accuracy on the test split, with the chosen lambda and the
   datastore's size. The test split is never used to choose anything.

Nothing personal persists between rounds: the datastore and lambda are rebuilt from the current
global model at every evaluation (one forward pass over the training, validation and test
splits, then the kNN search). The last evaluation's datastore and lambda are this client's
personalized model (:meth:`personal_state`, what export writes), with the global model.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping

import torch
from torch.utils.data import DataLoader

from flwr_pfl.clients.base import EXTRA_SEPARATOR, Config, PFLClient
from flwr_pfl.core.knnper import (
    Datastore,
    LambdaChoice,
    check_lambda,
    datastore_indices,
    knn_probabilities,
    lambda_grid,
    mixture_log_probs,
    mixture_losses,
    select_lambda,
)
from flwr_pfl.errors import ConfigError
from flwr_pfl.training import EvalResult, client_seed, loader_like, num_samples, read_batch

NAME = "knn-per"


def export_name(what: str) -> str:
    """A tensor of the personalized model that is not a model tensor: ``knn-per:<what>``."""
    return f"{NAME}{EXTRA_SEPARATOR}{what}"


#: the names of :meth:`KNNPerClient.personal_state`, in order
EXPORT_KEYS = (export_name("features"), export_name("labels"), export_name("lambda"))


def check_options(k: object, lam: object, lambda_step: object, capacity: object, temperature: object) -> None:
    """Refuse bad option values, naming each as ``kNN-Per's <option>``.

    Raises:
        ConfigError: ``k`` is not an integer >= 1, ``lam`` not None or a number in [0, 1],
            ``lambda_step`` not in (0, 1], ``capacity`` not in (0, 1], ``temperature`` not a
            finite number > 0.
    """
    def number(value: object) -> bool:
        return not isinstance(value, bool) and isinstance(value, (int, float))

    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"kNN-Per's k must be an integer >= 1; got {k!r}")
    if lam is not None and (not number(lam) or not 0 <= lam <= 1):  # type: ignore[operator]
        raise ConfigError(f"kNN-Per's lam must be None (chosen per client) or a number in [0, 1]; got {lam!r}")
    if not number(lambda_step) or not 0 < lambda_step <= 1:  # type: ignore[operator]
        raise ConfigError(f"kNN-Per's lambda_step must lie in (0, 1]; got {lambda_step!r}")
    if not number(capacity) or not 0 < capacity <= 1:  # type: ignore[operator]
        raise ConfigError(f"kNN-Per's capacity must lie in (0, 1] (a fraction of the training samples); got {capacity!r}")
    if not number(temperature) or not 0 < temperature < math.inf:  # type: ignore[operator]
        raise ConfigError(f"kNN-Per's temperature must be a finite number > 0; got {temperature!r}")


class KNNPerClient(PFLClient):
    """kNN-Per's client: FedAvg's training; evaluation of lambda p_kNN + (1 - lambda) p_global.

    Wire: FedAvg's (the whole model both ways). Evaluate metrics: the mixture's ``loss`` and
    ``accuracy`` (and per-domain figures), the global model's ``global_loss`` /
    ``global_accuracy``, ``knn_lambda`` (the lambda used), ``knn_datastore_size``,
    ``knn_selection_examples`` (how many samples chose lambda; 0 for a fixed lambda),
    ``knn_selected_on_validation`` (1 when they were the validation split, 0 for leave-one-out on
    the training split or a fixed lambda) and ``knn_accuracy`` (the kNN model alone, lambda = 1).

    The model needs its head as one module (``features()``: ``head="fc3"`` for a user's model)
    and a classification task.

    Args:
        k: neighbours (the FedGP paper's comparison: 10).
        lam: a fixed lambda in [0, 1] for every evaluation, or None (default) to choose it per
            client and evaluation from :func:`~flwr_pfl.core.knnper.lambda_grid` ``(lambda_step)``.
        lambda_step: the grid's step (the authors' ``weights_grid_resolution``, 0.01).
        capacity: the fraction of the training samples the datastore keeps (1: all). The subset
            is drawn once per client (seeded by the run's seed and the partition id), so that it
            is the same at every evaluation.
        temperature: T of the kernel exp(-||phi(x) - phi(x_i)||^2 / (D T)) (authors: 1).
        *args, **kwargs: :class:`PFLClient`'s arguments.

    Raises:
        ConfigError: a bad option, a model without one head module, or a task other than
            classification.
    """

    head_requirement = "module"
    shared_group = "all"
    personal_group = None

    def __init__(self, *args, k: int = 10, lam: float | None = None, lambda_step: float = 0.01,
                 capacity: float = 1.0, temperature: float = 1.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        check_options(k, lam, lambda_step, capacity, temperature)
        if self.data.task != "classification":
            raise ConfigError("kNN-Per is a classification method (a vote of labelled neighbours); "
                              f"this client's task is {self.data.task!r}")
        self.k = k
        self.lam = None if lam is None else float(lam)
        self.grid = lambda_grid(float(lambda_step))
        self.capacity = float(capacity)
        self.temperature = float(temperature)
        self.num_classes = int(self.model.num_outputs)
        self.exported: dict[str, torch.Tensor] = {}

    # ---------------------------------------------------------------- passes over the data
    @torch.no_grad()
    def representations(self, loader: DataLoader) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(phi(x) (N, D), logits (N, C), labels (N,), domains (N,)) of every sample of
        ``loader``'s dataset in its order, the model in eval mode; the logits are the head's
        output on phi(x) (the model's own output), batch by batch as the evaluation loop has it.
        The pass reads an unshuffled copy of the loader (:func:`loader_like`), which draws
        nothing from torch's global generator."""
        model = self.model.to(self.device).eval()
        feats, logits, ys, ds = [], [], [], []
        for batch in loader_like(loader):
            x, y, d = read_batch(batch, self.device, self.data.batch_keys)
            z = model.features(x)
            feats.append(z)
            logits.append(model.head_outputs(z, d))
            ys.append(y.reshape(-1).long())
            ds.append(d)
        if not feats:
            raise ValueError(f"{self.who}: no samples to compute representations of")
        return torch.cat(feats), torch.cat(logits), torch.cat(ys), torch.cat(ds)

    def datastore_rows(self, n: int) -> torch.Tensor:
        """Which training samples (in dataset order) the datastore keeps: all, or the
        ``capacity`` fraction drawn with a generator of its own seeded by (seed, partition)."""
        generator = torch.Generator().manual_seed(client_seed(self.train_config.seed, self.partition_id, 0))
        return datastore_indices(n, self.capacity, generator)

    def knn(self, queries: torch.Tensor, store: Datastore, exclude: torch.Tensor | None = None) -> torch.Tensor:
        return knn_probabilities(queries, store, k=self.k, num_classes=self.num_classes,
                                 temperature=self.temperature, exclude=exclude)

    # ---------------------------------------------------------------- lambda
    def choose_lambda(self, store: Datastore, train_z: torch.Tensor, train_logits: torch.Tensor,
                      train_y: torch.Tensor, rows: torch.Tensor) -> tuple[LambdaChoice, bool]:
        """(the lambda to use with its selection score, whether the validation split chose it).

        Fixed ``lam``: that value, scored on nothing. Otherwise the validation split when the
        client has one; else leave-one-out on the training split (``rows``: the training samples
        kept in the datastore, each excluded from its own neighbours; a sample that would be left
        without any neighbour is skipped).
        """
        if self.lam is not None:
            return LambdaChoice(self.lam, 0, 0, math.nan), False
        val = self.data.val
        if val is not None and num_samples(val) > 0:
            z, logits, y, _ = self.representations(val)
            return select_lambda(self.knn(z, store), logits, y, self.grid), True
        warnings.warn(
            f"{self.who}: kNN-Per chooses lambda on a validation split and this client has none "
            "(give LocalData(val=...) a validation loader; run config: val-fraction > 0); choosing it by leave-one-out on the training split instead",
            RuntimeWarning, stacklevel=2,
        )
        exclude = torch.full((len(train_y),), -1, dtype=torch.long)
        exclude[rows] = torch.arange(len(rows))
        keep = exclude < 0 if store.size == 1 else torch.ones(len(train_y), dtype=torch.bool)
        probs = self.knn(train_z[keep.to(train_z.device)], store, exclude[keep])
        on = keep.to(train_logits.device)
        return select_lambda(probs, train_logits[on], train_y[on], self.grid), False

    # ---------------------------------------------------------------- evaluation
    def interpolated(self, store: Datastore, lam: float, loader: DataLoader) -> EvalResult:
        """The mixture lam p_kNN + (1 - lam) p_global on ``loader``: mean loss (-log p, capped;
        :func:`~flwr_pfl.core.knnper.mixture_losses`), accuracy and per-domain figures as the
        evaluation loop reports them; ``extra`` holds ``knn_accuracy`` (lam = 1)."""
        check_lambda(lam)
        z, logits, y, d = self.representations(loader)
        probs = self.knn(z, store)
        log_probs = mixture_log_probs(probs, logits, lam)
        losses = mixture_losses(log_probs, y).cpu()
        hits = (log_probs.argmax(1) == y).long().cpu()
        d = d.cpu()
        m = max(self.data.num_domains, int(d.max()) + 1 if len(d) else 1)
        count = torch.bincount(d, minlength=m)
        loss_sum = torch.zeros(m, dtype=torch.float64).index_add_(0, d, losses)
        correct = torch.zeros(m, dtype=torch.long).index_add_(0, d, hits)
        n = int(count.sum())
        knn_hits = int((probs.argmax(1) == y).sum())
        return EvalResult(
            loss=float(loss_sum.sum()) / max(n, 1),
            num_examples=n,
            accuracy=float(correct.sum()) / max(n, 1),
            per_domain_count=count.tolist(),
            per_domain_loss=loss_sum.tolist(),
            per_domain_correct=correct.tolist(),
            extra={"knn_accuracy": knn_hits / max(n, 1)},
        )

    def local_evaluate(self, config: Config) -> EvalResult:
        """The global model's figures, then the datastore, lambda and the mixture's figures on the
        test split (see the module docstring)."""
        global_result = self.evaluate_on(self.data.test)
        train_z, train_logits, train_y, _ = self.representations(self.data.train)
        rows = self.datastore_rows(len(train_y))
        store = Datastore(train_z[rows.to(train_z.device)], train_y[rows.to(train_y.device)])
        choice, on_validation = self.choose_lambda(store, train_z, train_logits, train_y, rows)
        result = self.interpolated(store, choice.lam, self.data.test)
        self.exported = {
            EXPORT_KEYS[0]: store.features.detach().cpu().clone(),
            EXPORT_KEYS[1]: store.labels.detach().cpu().clone(),
            EXPORT_KEYS[2]: torch.tensor([choice.lam], dtype=torch.float64),
        }
        result.extra |= {
            "knn_lambda": choice.lam,
            "knn_datastore_size": float(store.size),
            "knn_selection_examples": float(choice.count),
            "knn_selected_on_validation": float(on_validation),
            **{f"global_{k}": v for k, v in global_result.metrics().items()},
        }
        return result

    # ---------------------------------------------------------------- the personalized model
    def personal_state(self) -> dict[str, torch.Tensor]:
        """The last evaluation's datastore (``knn-per:features`` (n, D), ``knn-per:labels``
        (n,)) and lambda (``knn-per:lambda`` (1,)); with the global model it is the model the
        client evaluated. Empty before the client's first evaluation."""
        return dict(self.exported)

    def evaluate_personal(self, state: Mapping[str, torch.Tensor], loader: DataLoader | None = None) -> EvalResult:
        """Evaluate a saved personalized model (an export's ``clients/<id>.pt``) with the model
        as it stands (load the global model first) on ``loader`` (default: the test split).

        Raises:
            KeyError: ``state`` lacks one of :data:`EXPORT_KEYS`.
        """
        missing = [key for key in EXPORT_KEYS if key not in state]
        if missing:
            raise KeyError(f"{self.who}: the saved kNN-Per model lacks {missing}")
        store = Datastore(state[EXPORT_KEYS[0]].to(self.device), state[EXPORT_KEYS[1]].to(self.device).long())
        return self.interpolated(store, float(state[EXPORT_KEYS[2]].reshape(-1)[0]), loader or self.data.test)
