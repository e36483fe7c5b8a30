"""FedRoD's two losses (Chen and Chao, ICLR 2022, "On Bridging Generic and Personalized Federated
Learning for Image Classification", Sec. 4: Federated Robust Decoupling).

The model is a shared body z = f(x; theta), a *generic* head g (shared, averaged by FedAvg with
the body) and a *personal* head p_m kept on client m. Two losses train them, on the same forward
pass of every mini-batch:

* the generic head and the body minimise the client's *balanced* risk, with the balanced
  softmax (BSM) loss of Ren et al. (NeurIPS 2020, "Balanced Meta-Softmax"), which FedRoD adopts
  as its class-imbalance-robust loss (Sec. 4.2):

      l_BSM(x, y) = -log( n_{m,y} exp(g_y(z)) / sum_c n_{m,c} exp(g_c(z)) )
                  = CE(g(z) + log n_m, y),

  n_{m,c} the number of client m's training samples of class c: the generic head is trained as
  if every client's classes were balanced, so that the clients' objectives agree;
* the personal head minimises the client's own empirical risk with cross-entropy on the
  personalized prediction g(z) + p_m(z) (Sec. 4.3: the personal predictor is an adaptive module
  *on top of* the generic one), with g(z) and z treated as constants for this loss: its gradient
  reaches p_m only.

The personalized prediction (what the client is evaluated on) is g(z) + p_m(z).

Classes a client lacks (n_{m,c} = 0) get the shift log 0 = -inf, as in the authors' code as PFLlib
and FL-bench carry it (``logits + spc.log()``): their probability is exactly 0, the BSM loss is
the cross-entropy over the present classes only, stays finite, and sends no gradient to the
absent classes' logits. A target whose own class count is 0 has no finite loss; it cannot occur
when the counts are those of the data the loss is computed on, and :func:`balanced_softmax_loss`
refuses it.

The equation numbering of the FedRoD paper was not available to check here (the paper text is
not among the suite's papers); the sections above follow the published version.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def class_counts(labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """n_{m,c}: how many of ``labels`` are class c, for c = 0 .. num_classes-1 (float64, (C,)).

    Raises:
        ValueError: a label lies outside [0, num_classes).
    """
    labels = labels.reshape(-1).long()
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        raise ValueError(
            f"class labels must lie in [0, {num_classes}); got values in [{int(labels.min())}, {int(labels.max())}]"
        )
    return torch.bincount(labels.cpu(), minlength=num_classes).double()


def balanced_logits(logits: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """g(z) + log n_m: the logits the balanced softmax normalises (-inf for absent classes).

    Raises:
        ValueError: ``counts`` is not one non-negative count per class (``logits.shape[1]``).
    """
    if counts.dim() != 1 or counts.shape[0] != logits.shape[1]:
        raise ValueError(f"class counts have shape {tuple(counts.shape)}; the logits need ({logits.shape[1]},)")
    if bool((counts < 0).any()):
        raise ValueError("class counts must be >= 0")
    return logits + counts.to(logits.device, logits.dtype).log()


def balanced_softmax_loss(logits: torch.Tensor, targets: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Per-sample balanced softmax loss CE(g(z) + log n_m, y), shape (B,) (Ren et al. 2020;
    FedRoD Sec. 4.2). With equal counts it is the plain cross-entropy.

    Raises:
        ValueError: a target's class has count 0 (its loss would be +inf), or ``counts`` does
            not fit the logits (:func:`balanced_logits`).
    """
    shifted = balanced_logits(logits, counts)
    if targets.numel() and bool((counts.to(targets.device)[targets] == 0).any()):
        raise ValueError("a target's class has count 0 in the class counts: the balanced softmax loss is +inf there; "
                         "the counts must be those of the samples the loss is computed on")
    return F.cross_entropy(shifted, targets, reduction="none")


def personalized_logits(generic: torch.Tensor, personal: torch.Tensor) -> torch.Tensor:
    """The personalized prediction g(z) + p_m(z) (FedRoD Sec. 4.3)."""
    return generic + personal


def personal_head_loss(generic: torch.Tensor, personal: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-sample cross-entropy of the personalized prediction with the generic logits detached,
    shape (B,): its gradient reaches the personal head's output only (Sec. 4.3; PFLlib's
    ``loss(out_g.detach() + out_p, y)``). ``personal`` should be computed on detached features."""
    return F.cross_entropy(personalized_logits(generic.detach(), personal), targets, reduction="none")
