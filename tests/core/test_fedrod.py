"""FedRoD's losses (flwr_pfl.core.fedrod) against the balanced softmax written out by hand in
NumPy, its closed-form gradient, and its properties: uniform counts give cross-entropy, absent
classes drop out of the softmax and stay finite."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flwr_pfl.core.fedrod import (
    balanced_logits,
    balanced_softmax_loss,
    class_counts,
    personal_head_loss,
    personalized_logits,
)


def logits_and_targets(seed: int = 0, batch: int = 7, classes: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, classes, generator=g, dtype=torch.float64) * 2, torch.randint(0, 3, (batch,), generator=g)


def bsm_by_hand(logits: np.ndarray, targets: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """-log( n_y exp(g_y) / sum_c n_c exp(g_c) ), sample by sample, classes with n_c = 0 left out."""
    out = []
    for g, y in zip(logits, targets):
        numerator = counts[y] * np.exp(g[y])
        denominator = sum(n * np.exp(gc) for n, gc in zip(counts, g) if n > 0)
        out.append(-np.log(numerator / denominator))
    return np.array(out)


def test_class_counts_count_each_class_and_refuse_labels_outside_the_classes():
    counts = class_counts(torch.tensor([2, 0, 2, 2, 1, 0]), 4)
    assert counts.dtype == torch.float64 and counts.tolist() == [2.0, 1.0, 3.0, 0.0]
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        class_counts(torch.tensor([0, 3]), 3)
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        class_counts(torch.tensor([-1, 0]), 3)


def test_balanced_softmax_matches_the_formula_written_out_by_hand():
    logits, targets = logits_and_targets()
    counts = torch.tensor([9.0, 1.0, 4.0, 30.0])
    got = balanced_softmax_loss(logits, targets, counts)
    assert got.shape == (7,)
    np.testing.assert_allclose(got.numpy(), bsm_by_hand(logits.numpy(), targets.numpy(), counts.numpy()), rtol=1e-12)
    # skewed counts change the loss: it is not the plain cross-entropy
    assert not torch.allclose(got, F.cross_entropy(logits, targets, reduction="none"))


@pytest.mark.parametrize("count", [1.0, 5.0, 123.0])
def test_with_uniform_class_counts_the_balanced_softmax_is_the_cross_entropy(count):
    logits, targets = logits_and_targets(seed=3)
    got = balanced_softmax_loss(logits, targets, torch.full((4,), count))
    torch.testing.assert_close(got, F.cross_entropy(logits, targets, reduction="none"), rtol=1e-12, atol=1e-12)


def test_the_gradient_is_the_balanced_softmax_minus_the_one_hot_target():
    logits, targets = logits_and_targets(seed=5)
    counts = torch.tensor([2.0, 7.0, 1.0, 11.0])
    logits.requires_grad_(True)
    balanced_softmax_loss(logits, targets, counts).mean().backward()
    z = logits.detach().numpy() + np.log(counts.numpy().astype(np.float64))
    softmax = np.exp(z - z.max(1, keepdims=True))
    softmax /= softmax.sum(1, keepdims=True)
    expected = (softmax - np.eye(4)[targets.numpy()]) / len(targets)
    np.testing.assert_allclose(logits.grad.numpy(), expected, rtol=1e-10, atol=1e-14)


def test_an_absent_class_drops_out_of_the_softmax_with_a_finite_loss_and_no_gradient():
    """n_c = 0 gives log 0 = -inf (the authors' shift): probability exactly 0, loss finite, equal
    to the balanced softmax over the present classes only, and no gradient on the absent column."""
    logits, targets = logits_and_targets(seed=7)  # targets in {0, 1, 2}
    counts = torch.tensor([3.0, 5.0, 2.0, 0.0])
    assert torch.isinf(balanced_logits(logits, counts)[:, 3]).all()
    logits.requires_grad_(True)
    loss = balanced_softmax_loss(logits, targets, counts)
    assert torch.isfinite(loss).all()
    present = balanced_softmax_loss(logits.detach()[:, :3], targets, counts[:3])
    torch.testing.assert_close(loss.detach(), present, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(loss.detach().numpy(), bsm_by_hand(logits.detach().numpy(), targets.numpy(), counts.numpy()), rtol=1e-12)
    loss.mean().backward()
    assert torch.isfinite(logits.grad).all()
    assert (logits.grad[:, 3] == 0).all()


def test_a_target_whose_class_count_is_zero_and_mismatched_counts_are_refused():
    logits, targets = logits_and_targets(seed=1)
    with pytest.raises(ValueError, match="count 0"):
        balanced_softmax_loss(logits, torch.tensor([0, 2]), torch.tensor([1.0, 1.0, 0.0, 1.0]))
    with pytest.raises(ValueError, match=r"\(4,\)"):
        balanced_softmax_loss(logits, targets, torch.ones(3))
    with pytest.raises(ValueError, match=">= 0"):
        balanced_softmax_loss(logits, targets, torch.tensor([1.0, -1.0, 1.0, 1.0]))


def test_the_personal_loss_is_the_cross_entropy_of_the_sum_and_reaches_the_personal_logits_only():
    generic, targets = logits_and_targets(seed=2)
    personal = torch.randn(7, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    generic.requires_grad_(True)
    personal.requires_grad_(True)
    loss = personal_head_loss(generic, personal, targets)
    expected = F.cross_entropy(generic.detach() + personal.detach(), targets, reduction="none")
    torch.testing.assert_close(loss.detach(), expected)
    torch.testing.assert_close(personalized_logits(generic, personal), generic + personal)
    grad_generic, grad_personal = torch.autograd.grad(loss.sum(), (generic, personal), allow_unused=True)
    assert grad_generic is None  # the generic logits are constants for this loss
    softmax = torch.softmax(generic.detach() + personal.detach(), 1)
    torch.testing.assert_close(grad_personal, softmax - F.one_hot(targets, 4).double())
