"""kNN-Per's mathematics (flwr_pfl/core/knnper.py) against hand computations: the kernel-weighted
vote of the k nearest neighbours (ties, k larger than the datastore, one class, leave-one-out,
batching, large distances), the mixture with the global model, the lambda grid and selection,
and the datastore's capacity subset."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flwr_pfl.core.knnper import (
    PROBABILITY_FLOOR,
    Datastore,
    datastore_indices,
    datastore_size,
    kernel_weights,
    knn_probabilities,
    lambda_grid,
    mixture_log_probs,
    mixture_losses,
    nearest_neighbours,
    select_lambda,
)


def store(points, labels) -> Datastore:
    return Datastore(torch.tensor(points, dtype=torch.float32), torch.tensor(labels))


def vote_by_hand(query, points, labels, k, num_classes, temperature, skip=None):
    """p_kNN with Python loops: squared distances, neighbours sorted by (distance, index), the
    first k, weights exp(-d / (D T)) normalised, summed per class."""
    width = len(query)
    cands = [(sum((a - b) ** 2 for a, b in zip(query, p)), i) for i, p in enumerate(points) if i != skip]
    chosen = sorted(cands)[:k]
    weights = [math.exp(-d / (width * temperature)) for d, _ in chosen]
    total = sum(weights)
    out = [0.0] * num_classes
    for w, (_, i) in zip(weights, chosen):
        out[labels[i]] += w / total
    return out


POINTS = [[0.0, 0.0], [1.0, 0.0], [0.0, 2.0], [3.0, 1.0], [-1.0, -1.0], [2.0, 2.0]]
LABELS = [0, 1, 1, 2, 0, 2]


@pytest.mark.parametrize("k,temperature", [(1, 1.0), (3, 0.7), (4, 2.5)])
def test_the_vote_is_the_kernel_weighted_share_of_each_class_among_the_k_nearest(k, temperature):
    queries = [[0.5, 0.2], [2.0, 1.5], [-0.3, 1.1]]
    got = knn_probabilities(torch.tensor(queries), store(POINTS, LABELS), k=k, num_classes=4, temperature=temperature)
    assert got.dtype == torch.float64
    expected = [vote_by_hand(q, POINTS, LABELS, k, 4, temperature) for q in queries]
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(got.sum(1).numpy(), 1.0, atol=1e-12)
    assert got[:, 3].abs().max() == 0  # a class no entry holds


def test_a_worked_example():
    """Query (0, 0), k = 2, D = 2, T = 1: the neighbours are (0, 0) (label 0, d = 0) and (1, 0)
    (label 1, d = 1); weights 1 and e^-0.5, so p = (1, e^-0.5) / (1 + e^-0.5)."""
    got = knn_probabilities(torch.zeros(1, 2), store(POINTS, LABELS), k=2, num_classes=3)
    w = math.exp(-0.5)
    np.testing.assert_allclose(got.numpy(), [[1 / (1 + w), w / (1 + w), 0.0]], rtol=1e-12)


def test_ties_at_the_k_th_distance_go_to_the_lower_datastore_index():
    ring = [[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]]  # all at distance 1 from the origin
    for labels, expected in (([0, 1, 2, 2], [0.5, 0.5, 0.0]), ([2, 2, 0, 1], [0.0, 0.0, 1.0])):
        got = knn_probabilities(torch.zeros(1, 2), store(ring, labels), k=2, num_classes=3)
        np.testing.assert_allclose(got.numpy(), [expected], atol=1e-15)
    distances, indices = nearest_neighbours(torch.zeros(1, 2), torch.tensor(ring), k=3)
    assert indices.tolist() == [[0, 1, 2]] and distances.tolist() == [[1.0, 1.0, 1.0]]


def test_k_larger_than_the_datastore_uses_every_entry():
    small = store(POINTS[:3], LABELS[:3])
    query = torch.tensor([[0.4, 0.9]])
    got = knn_probabilities(query, small, k=10, num_classes=3, temperature=0.3)
    np.testing.assert_allclose(got.numpy(), [vote_by_hand([0.4, 0.9], POINTS[:3], LABELS[:3], 3, 3, 0.3)], rtol=1e-6)
    assert nearest_neighbours(query, small.features, k=10)[1].shape == (1, 3)
    one = store([[5.0, 5.0]], [2])
    np.testing.assert_array_equal(knn_probabilities(query, one, k=10, num_classes=3).numpy(), [[0.0, 0.0, 1.0]])


def test_a_datastore_of_one_class_votes_for_it_with_certainty():
    got = knn_probabilities(torch.randn(5, 2, generator=torch.Generator().manual_seed(1)), store(POINTS, [1] * 6),
                            k=3, num_classes=3)
    np.testing.assert_allclose(got.numpy(), np.tile([0.0, 1.0, 0.0], (5, 1)), rtol=0, atol=1e-15)
    assert (got[:, [0, 2]] == 0).all()


def test_leave_one_out_excludes_each_querys_own_entry_and_nothing_else():
    points = POINTS + [[0.0, 0.0]]  # a duplicate of entry 0 stays a neighbour of entry 0
    labels = LABELS + [2]
    exclude = torch.arange(len(points))
    got = knn_probabilities(torch.tensor(points), store(points, labels), k=3, num_classes=3, exclude=exclude)
    expected = [vote_by_hand(p, points, labels, 3, 3, 1.0, skip=i) for i, p in enumerate(points)]
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6)
    assert got[0, 2] > 0.3  # the duplicate (label 2, distance 0) counts
    partial = torch.tensor([-1, 1, -1, -1, -1, -1, -1])  # only query 1 skips an entry (its own)
    got = knn_probabilities(torch.tensor(points), store(points, labels), k=2, num_classes=3, exclude=partial)
    np.testing.assert_allclose(got[1].numpy(), vote_by_hand(points[1], points, labels, 2, 3, 1.0, skip=1), rtol=1e-6)
    np.testing.assert_allclose(got[0].numpy(), vote_by_hand(points[0], points, labels, 2, 3, 1.0), rtol=1e-6)
    assert not np.allclose(got[1].numpy(), vote_by_hand(points[1], points, labels, 2, 3, 1.0), rtol=1e-3)
    with pytest.raises(ValueError, match="no neighbour"):
        knn_probabilities(torch.zeros(1, 2), store([[0.0, 0.0]], [0]), k=1, num_classes=2, exclude=torch.tensor([0]))


def test_batching_the_search_changes_nothing():
    g = torch.Generator().manual_seed(3)
    keys, queries = torch.randn(40, 5, generator=g), torch.randn(23, 5, generator=g)
    data = Datastore(keys, torch.randint(0, 4, (40,), generator=g))
    whole = knn_probabilities(queries, data, k=7, num_classes=4, max_pairs=10_000)
    for max_pairs in (1, 40, 95):
        np.testing.assert_allclose(knn_probabilities(queries, data, k=7, num_classes=4, max_pairs=max_pairs).numpy(),
                                   whole.numpy(), rtol=1e-6, atol=1e-9)


def test_far_queries_still_get_a_distribution():
    """exp(-d / D) underflows for every neighbour at distances ~1e4; the normalised weights do
    not (the authors' numpy division would give 0/0)."""
    far = torch.tensor([[0.0, 300.0]])  # nearest: (0, 2), label 1, d = 298^2; then (2, 2), label 2, d = 298^2 + 4
    assert math.exp(-(298.0 ** 2) / 2) == 0.0
    got = knn_probabilities(far, store(POINTS, LABELS), k=2, num_classes=3)
    w = math.exp(-4 / 2)
    np.testing.assert_allclose(got.numpy(), [[0.0, 1 / (1 + w), w / (1 + w)]], rtol=1e-6)


def test_kernel_weights_and_label_checks():
    np.testing.assert_allclose(kernel_weights(torch.tensor([[0.0, 2.0, math.inf]]), 4, 0.5).numpy(),
                               [[1 / (1 + math.e ** -1), math.e ** -1 / (1 + math.e ** -1), 0.0]], rtol=1e-12)
    for bad in (0.0, -1.0, math.inf):
        with pytest.raises(ValueError, match="temperature"):
            kernel_weights(torch.zeros(1, 1), 2, bad)
    with pytest.raises(ValueError, match="labels must lie"):
        knn_probabilities(torch.zeros(1, 2), store(POINTS, [0, 1, 2, 3, 0, 0]), k=1, num_classes=3)
    with pytest.raises(ValueError, match="k must be"):
        nearest_neighbours(torch.zeros(1, 2), torch.zeros(2, 2), k=0)


# ---------------------------------------------------------------------------- the mixture
LOGITS = torch.tensor([[2.0, 0.5, -1.0], [0.1, 0.3, 0.2], [-2.0, 1.0, 3.0]])
KNN = torch.tensor([[0.0, 1.0, 0.0], [0.6, 0.0, 0.4], [0.25, 0.25, 0.5]], dtype=torch.float64)


def test_lambda_zero_is_the_global_model_and_lambda_one_the_knn_model_exactly():
    assert torch.equal(mixture_log_probs(KNN, LOGITS, 0.0), torch.log_softmax(LOGITS, 1).double())
    assert torch.equal(mixture_log_probs(KNN, LOGITS, 1.0), KNN.log())
    assert mixture_log_probs(KNN, LOGITS, 0.0).argmax(1).tolist() == LOGITS.argmax(1).tolist() == [0, 1, 2]
    assert mixture_log_probs(KNN, LOGITS, 1.0).argmax(1).tolist() == KNN.argmax(1).tolist() == [1, 0, 2]


@pytest.mark.parametrize("lam", [0.2, 0.5, 0.93])
def test_the_mixture_is_the_convex_combination_of_probabilities(lam):
    softmax = np.exp(LOGITS.numpy().astype(np.float64))
    softmax /= softmax.sum(1, keepdims=True)
    expected = lam * KNN.numpy() + (1 - lam) * softmax
    np.testing.assert_allclose(mixture_log_probs(KNN, LOGITS, lam).exp().numpy(), expected, rtol=1e-6)


def test_the_loss_is_the_negative_log_likelihood_capped_for_impossible_labels():
    labels = torch.tensor([0, 2, 1])
    log_probs = mixture_log_probs(KNN, LOGITS, 0.5)
    np.testing.assert_allclose(mixture_losses(log_probs, labels).numpy(),
                               [-log_probs[i, c].item() for i, c in enumerate(labels)], rtol=1e-12)
    pure_knn = mixture_losses(mixture_log_probs(KNN, LOGITS, 1.0), labels)  # p_kNN(0 | x_0) = 0
    assert pure_knn[0] == pytest.approx(-math.log(PROBABILITY_FLOOR)) and pure_knn[1] == pytest.approx(-math.log(0.4))
    ce = torch.nn.functional.cross_entropy(LOGITS, labels, reduction="none").double()
    assert torch.equal(mixture_losses(mixture_log_probs(KNN, LOGITS, 0.0), labels), ce)
    with pytest.raises(ValueError, match="lambda"):
        mixture_log_probs(KNN, LOGITS, 1.5)


def test_the_lambda_grid_is_the_authors_arange():
    assert lambda_grid(0.25) == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert lambda_grid(0.3) == [0.0, 0.3, 0.6, 0.9]
    assert lambda_grid(1.0) == [0.0, 1.0]
    fine = lambda_grid(0.01)
    np.testing.assert_allclose(fine, np.arange(0, 1 + 1e-6, 0.01), atol=1e-12)
    assert len(fine) == 101 and fine[-1] == 1.0
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="step"):
            lambda_grid(bad)


def test_lambda_is_chosen_by_accuracy_then_loss_then_smallness():
    # the global model is right on samples 0, 1; the kNN model on samples 1, 2
    logits = torch.tensor([[3.0, 0.0], [0.0, 3.0], [1.0, 0.0]])
    knn = torch.tensor([[0.0, 1.0], [0.0, 1.0], [0.0, 1.0]], dtype=torch.float64)
    labels = torch.tensor([0, 1, 1])

    def score(lam):
        p = lam * knn.numpy() + (1 - lam) * torch.softmax(logits, 1).double().numpy()
        picked = np.maximum(p[np.arange(3), labels.numpy()], PROBABILITY_FLOOR)
        return int((p.argmax(1) == labels.numpy()).sum()), float(-np.log(picked).mean())

    grid = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]  # only lambda in (0.32, 0.47) is right on all three
    scores = {lam: score(lam) for lam in grid}
    best = max(grid, key=lambda lam: (scores[lam][0], -scores[lam][1], -lam))
    choice = select_lambda(knn, logits, labels, grid)
    assert choice.lam == best and (choice.correct, choice.count) == (scores[best][0], 3)
    assert choice.loss == pytest.approx(scores[best][1])
    assert best == 0.4 and scores[best][0] == 3  # the mixture beats both ends
    # equal accuracy and loss (identical models): the smallest lambda, whatever the grid's order
    same = select_lambda(torch.softmax(logits, 1).double(), logits, labels, [0.9, 0.3, 0.6])
    assert same.lam == 0.3
    # no selection sample: the smallest lambda
    empty = select_lambda(knn[:0], logits[:0], labels[:0], [0.5, 0.2])
    assert empty.lam == 0.2 and empty.count == 0


def test_equal_accuracy_is_broken_by_the_lower_loss():
    logits = torch.tensor([[2.0, 0.0], [0.0, 0.5]])
    knn = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)  # right on both, and certain
    labels = torch.tensor([0, 1])
    choice = select_lambda(knn, logits, labels, [0.0, 0.5, 1.0])
    assert choice.correct == 2 and choice.lam == 1.0  # all three are right on both; lambda = 1 has loss 0


# ---------------------------------------------------------------------------- capacity
def test_the_capacity_keeps_a_fixed_random_fraction_of_the_training_samples():
    assert datastore_indices(7, 1.0).tolist() == list(range(7))
    assert [datastore_size(10, c) for c in (0.01, 0.1, 0.35, 0.5, 0.99, 1.0)] == [1, 1, 3, 5, 9, 10]
    assert datastore_size(3, 0.7) == 2 and datastore_size(100, 0.29) == 29
    picked = datastore_indices(20, 0.35, torch.Generator().manual_seed(4))
    assert len(picked) == 7 and picked.tolist() == sorted(set(picked.tolist())) and 0 <= picked.min() and picked.max() < 20
    again = datastore_indices(20, 0.35, torch.Generator().manual_seed(4))
    other = datastore_indices(20, 0.35, torch.Generator().manual_seed(5))
    assert torch.equal(picked, again) and not torch.equal(picked, other)
    for bad in (0.0, -0.5, 1.01):
        with pytest.raises(ValueError, match="capacity"):
            datastore_size(5, bad)
    with pytest.raises(ValueError, match="at least one"):
        datastore_size(0, 1.0)
