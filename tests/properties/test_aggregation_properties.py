"""Aggregation as properties over generated replies: flwr_pfl.core.aggregation,
flwr_pfl.core.robust and ``PFLStrategy.aggregate_fit``.

Order: the strategy puts replies in partition order before anything sums them
(:func:`~flwr_pfl.strategies.sampling.in_partition_order`), so its result is *bitwise* the same
for every arrival order; :func:`~flwr_pfl.core.robust.trimmed_mean` sorts every coordinate's
values first, so it is bitwise order-free too. :func:`~flwr_pfl.core.aggregation.weighted_average`
itself sums in the order it is given: floating-point addition is not associative, so another
order may round differently, and its order property holds to float64 rounding (then one unit in
the last place of the output dtype, one for integer tensors rounded at a .5 tie).

Values are drawn from a NumPy generator seeded by the drawn seed (cheap, and every magnitude
the scale allows); layouts, dtypes, example counts, orders and defects are drawn directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from flwr.common import parameters_to_ndarrays
from hypothesis import given, settings
from hypothesis import strategies as st

from fakes import FakeProxy, fit_res
from flwr_pfl.core.aggregation import weighted_average
from flwr_pfl.core.robust import clip_update, trimmed_mean
from flwr_pfl.strategies import FedAvg

FLOATS = (np.float32, np.float64)
#: how a rejected reply is wrong -> the words of the ReplyError that names it
DEFECTS = {
    "nan": "contains NaN or Inf",
    "inf": "contains NaN or Inf",
    "-inf": "contains NaN or Inf",
    "wrong shape": "has shape",
    "one array too few": "arrays, expected",
    "one array too many": "arrays, expected",
    "zero examples": "must be > 0",
    "negative examples": "must be > 0",
}


@dataclass(frozen=True)
class Replies:
    """K clients' arrays over one layout, with their example counts."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[type, ...]
    arrays: tuple[tuple[np.ndarray, ...], ...]
    counts: tuple[int, ...]

    def lists(self) -> list[list[np.ndarray]]:
        return [list(a) for a in self.arrays]


@st.composite
def layouts(draw) -> tuple[tuple[tuple[int, ...], ...], tuple[type, ...]]:
    """1..4 tensors of 0..3 dimensions (sizes 1..4), float32 / float64, maybe one int64 counter."""
    shapes = draw(st.lists(st.lists(st.integers(1, 4), max_size=3).map(tuple), min_size=1, max_size=4))
    dtypes = [draw(st.sampled_from(FLOATS)) for _ in shapes]
    if draw(st.booleans()):
        shapes.append(())
        dtypes.append(np.int64)
    return tuple(shapes), tuple(dtypes)


@st.composite
def replies(draw, min_clients: int = 1, max_clients: int = 8) -> Replies:
    """Replies of ``min_clients``..``max_clients`` clients with unequal example counts."""
    shapes, dtypes = draw(layouts())
    k = draw(st.integers(min_clients, max_clients))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    scale = draw(st.sampled_from([1e-3, 1.0, 1e3]))
    arrays = tuple(
        tuple(np.asarray(rng.integers(0, 100, size=s) if d is np.int64 else scale * rng.normal(size=s), dtype=d)
              for s, d in zip(shapes, dtypes))
        for _ in range(k)
    )
    counts = tuple(draw(st.lists(st.integers(1, 10**6), min_size=k, max_size=k)))
    return Replies(shapes, dtypes, arrays, counts)


def closed_form(arrays: list[list[np.ndarray]], weights) -> list[np.ndarray]:
    """sum_k w_k theta_k / sum_k w_k with NumPy in float64, tensor by tensor."""
    w = np.asarray(weights, dtype=np.float64)
    return [np.tensordot(w, np.stack([np.asarray(a[i], np.float64) for a in arrays]), axes=1) / w.sum()
            for i in range(len(arrays[0]))]


def assert_within_rounding(actual: np.ndarray, expected64: np.ndarray, magnitude: np.ndarray) -> None:
    """``actual`` (any dtype) equals the float64 value ``expected64`` up to float64 rounding of a
    sum of terms of size ``magnitude``, then one unit in the last place of ``actual``'s dtype
    (one, for an integer tensor rounded at a .5 tie)."""
    if np.issubdtype(actual.dtype, np.integer):
        assert np.all(np.abs(actual - expected64) <= 0.5 + 1e-9 * (1 + magnitude))
        return
    tolerance = 2 * np.finfo(actual.dtype).eps * np.abs(expected64) + 1e-13 * magnitude + np.finfo(actual.dtype).tiny
    assert np.all(np.abs(actual.astype(np.float64) - expected64) <= tolerance)


def magnitudes(arrays: list[list[np.ndarray]], weights) -> list[np.ndarray]:
    """Per tensor, sum_k (w_k / W) |theta_k|: the size of the terms a weighted mean adds."""
    return closed_form([[np.abs(np.asarray(a, np.float64)) for a in c] for c in arrays], weights)


# ------------------------------------------------------------------------------ core: weighted mean
@settings(max_examples=150)
@given(replies(), st.randoms(use_true_random=False))
def test_weighted_average_is_invariant_to_client_order_up_to_float64_rounding(r: Replies, random) -> None:
    """Permuting the clients (and their weights together) changes the result by no more than
    float64 rounding of the sum, then one ulp of the output dtype."""
    order = list(range(len(r.counts)))
    random.shuffle(order)
    base = weighted_average(r.lists(), r.counts)
    permuted = weighted_average([r.lists()[i] for i in order], [r.counts[i] for i in order])
    for a, b, m in zip(permuted, base, magnitudes(r.lists(), r.counts)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert_within_rounding(a, b.astype(np.float64), m)


@settings(max_examples=150)
@given(replies())
def test_weighted_average_equals_the_float64_closed_form_sum_of_counts_times_arrays_over_total(r: Replies) -> None:
    """Each tensor is sum_k n_k theta_k / sum_k n_k (NumPy, float64) to rounding, in the input's
    dtype and shape."""
    out = weighted_average(r.lists(), r.counts)
    assert [(a.dtype, a.shape) for a in out] == [(np.dtype(d), s) for d, s in zip(r.dtypes, r.shapes)]
    for a, e, m in zip(out, closed_form(r.lists(), r.counts), magnitudes(r.lists(), r.counts)):
        assert_within_rounding(a, e, m)


@settings(max_examples=150)
@given(replies(), st.data())
def test_doubling_a_clients_examples_equals_sending_its_reply_twice(r: Replies, data) -> None:
    """Client j with 2 n_j examples weighs what two copies of its reply with n_j each weigh."""
    j = data.draw(st.integers(0, len(r.counts) - 1))
    doubled = weighted_average(r.lists(), [2 * n if k == j else n for k, n in enumerate(r.counts)])
    duplicated = weighted_average(r.lists() + [r.lists()[j]], list(r.counts) + [r.counts[j]])
    counts = [2 * n if k == j else n for k, n in enumerate(r.counts)]
    for a, b, m in zip(doubled, duplicated, magnitudes(r.lists(), counts)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert_within_rounding(a, b.astype(np.float64), m)


@settings(max_examples=100)
@given(replies(), st.data())
def test_weighted_average_refuses_negative_non_finite_or_all_zero_weights(r: Replies, data) -> None:
    """A weight vector with a negative, NaN or infinite entry, or all zeros, is a ValueError that
    says what weights must be; nothing is returned."""
    k = len(r.counts)
    kind = data.draw(st.sampled_from(["negative", "nan", "inf", "all zero"]))
    weights = [float(n) for n in r.counts]
    if kind == "all zero":
        weights = [0.0] * k
    else:
        weights[data.draw(st.integers(0, k - 1))] = {"negative": -data.draw(st.floats(1e-9, 1e9)),
                                                     "nan": float("nan"), "inf": float("inf")}[kind]
    with pytest.raises(ValueError, match="weights must be finite, >= 0 and not all zero"):
        weighted_average(r.lists(), weights)


# ------------------------------------------------------------------------------ core: trimmed mean
@settings(max_examples=100)
@given(replies(), st.floats(0.0, 0.49), st.randoms(use_true_random=False))
def test_trimmed_mean_is_bitwise_invariant_to_client_order(r: Replies, trim: float, random) -> None:
    """Every coordinate's values are sorted before trimming and averaging: any client order gives
    the same bytes."""
    order = list(range(len(r.counts)))
    random.shuffle(order)
    base = trimmed_mean(r.lists(), trim)
    permuted = trimmed_mean([r.lists()[i] for i in order], trim)
    assert all(a.dtype == b.dtype and a.tobytes() == b.tobytes() for a, b in zip(permuted, base))


# ------------------------------------------------------------------------------ the strategy
AGGREGATES = ("mean", "trimmed-mean", "clip")


def strategy_for(mode: str, global_arrays: list[np.ndarray], num_clients: int) -> FedAvg:
    """A FedAvg that aggregates with ``mode`` and holds ``global_arrays`` as the round's. The
    outlier screen is off: the replies drawn here are arbitrary arrays, not one federation's
    models, and may differ by any factor (the screen has its own tests)."""
    kwargs = {"mean": {}, "trimmed-mean": {"aggregate": "trimmed-mean", "trim_fraction": 0.2},
              "clip": {"clip_update_norm": 0.5}}[mode]
    strategy = FedAvg(num_clients=num_clients, seed=0, outlier_norm_ratio=None, **kwargs)
    strategy.global_arrays = [a.copy() for a in global_arrays]
    return strategy


def expected_aggregate(mode: str, good: list[list[np.ndarray]], counts: list[int], global_arrays) -> list[np.ndarray]:
    """What the strategy's ``mode`` makes of the accepted replies, given in partition order."""
    if mode == "trimmed-mean":
        return trimmed_mean(good, 0.2)
    if mode == "clip":
        good = [clip_update(a, global_arrays, 0.5) for a in good]
    return weighted_average(good, counts)


def results_of(r: Replies, pids: list[int], order: list[int]) -> list:
    """(proxy, FitRes) pairs of the replies, client i as partition ``pids[i]``, in ``order``."""
    return [(FakeProxy(str(9000 - 17 * pids[i]), pids[i]), fit_res(list(r.arrays[i]), r.counts[i], pids[i])) for i in order]


@settings(max_examples=80)
@given(replies(min_clients=2), st.sampled_from(AGGREGATES), st.randoms(use_true_random=False))
def test_aggregate_fit_is_bitwise_invariant_to_reply_order(r: Replies, mode: str, random) -> None:
    """The strategy sums in partition order: every arrival order of the same replies gives the
    same bytes, for the plain mean, the trimmed mean and clipped updates."""
    global_arrays = list(r.arrays[0])
    pids = random.sample(range(100), len(r.counts))
    order = list(range(len(r.counts)))
    outs = []
    for _ in range(2):
        params, _ = strategy_for(mode, global_arrays, 100).aggregate_fit(1, results_of(r, pids, order), [])
        outs.append(parameters_to_ndarrays(params))
        random.shuffle(order)
    assert all(a.dtype == b.dtype and a.tobytes() == b.tobytes() for a, b in zip(*outs))


def damaged(arrays: list[np.ndarray], count: int, defect: str, rng: np.random.Generator) -> tuple[list[np.ndarray], int]:
    """A copy of one reply with ``defect``."""
    arrays = [a.copy() for a in arrays]
    floating = [i for i, a in enumerate(arrays) if np.issubdtype(a.dtype, np.floating)]
    if defect in ("nan", "inf", "-inf"):
        i = floating[int(rng.integers(len(floating)))]
        flat = arrays[i].reshape(-1)
        flat[int(rng.integers(flat.size))] = float(defect)
    elif defect == "wrong shape":
        i = int(rng.integers(len(arrays)))
        arrays[i] = np.zeros(arrays[i].shape + (2,), arrays[i].dtype)
    elif defect == "one array too few":
        del arrays[int(rng.integers(len(arrays)))]
    elif defect == "one array too many":
        arrays.insert(int(rng.integers(len(arrays) + 1)), np.zeros(3, np.float32))
    elif defect == "zero examples":
        count = 0
    else:
        count = -count
    return arrays, count


@settings(max_examples=100)
@given(replies(min_clients=1, max_clients=6), st.lists(st.sampled_from(sorted(DEFECTS)), max_size=5),
       st.sampled_from(AGGREGATES), st.randoms(use_true_random=False), st.integers(0, 2**32 - 1))
def test_bad_replies_are_rejected_by_name_and_the_good_ones_aggregate_exactly_as_without_them(
    r: Replies, defects: list[str], mode: str, random, seed: int
) -> None:
    """Replies with NaN/Inf, a wrong shape, a wrong number of arrays, or zero or negative example
    counts are rejected (counted in ``num_rejected`` and ``num_failures``, and handed back in
    ``failures``); the good ones aggregate to the bytes they give alone, in any arrival order."""
    rng = np.random.default_rng(seed)
    global_arrays = [np.zeros(s, d) for s, d in zip(r.shapes, r.dtypes)]
    good = len(r.counts)
    pids = random.sample(range(100), good + len(defects))
    results = results_of(r, pids[:good], list(range(good)))
    for defect, pid in zip(defects, pids[good:]):
        source = int(rng.integers(good))
        arrays, count = damaged(list(r.arrays[source]), r.counts[source], defect, rng)
        results.append((FakeProxy(str(9000 - 17 * pid), pid), fit_res(arrays, count, pid)))
    random.shuffle(results)
    failures: list = []
    params, metrics = strategy_for(mode, global_arrays, 100).aggregate_fit(1, results, failures)
    assert metrics["num_rejected"] == len(defects) and metrics["num_failures"] == len(defects)
    assert sorted(int(res.metrics["partition_id"]) for _, res in failures) == sorted(pids[good:])
    by_pid = sorted(range(good), key=lambda i: pids[i])
    expected = expected_aggregate(mode, [list(r.arrays[i]) for i in by_pid], [r.counts[i] for i in by_pid], global_arrays)
    got = parameters_to_ndarrays(params)
    assert all(a.dtype == b.dtype and a.tobytes() == b.tobytes() for a, b in zip(got, expected))


@settings(max_examples=60)
@given(replies(min_clients=1, max_clients=4), st.sampled_from(sorted(DEFECTS)), st.integers(0, 2**32 - 1))
def test_each_kind_of_bad_reply_is_rejected_with_its_reason_in_the_check(r: Replies, defect: str, seed: int) -> None:
    """``check_reply`` raises a ReplyError naming the client and the defect."""
    from flwr_pfl.errors import ReplyError

    rng = np.random.default_rng(seed)
    strategy = strategy_for("mean", [np.zeros(s, d) for s, d in zip(r.shapes, r.dtypes)], 100)
    arrays, count = damaged(list(r.arrays[0]), r.counts[0], defect, rng)
    with pytest.raises(ReplyError, match=rf"client 4242 \(partition 7\).*{DEFECTS[defect]}"):
        strategy.check_reply(1, FakeProxy("4242", 7), fit_res(arrays, count, 7))


@settings(max_examples=40)
@given(replies(min_clients=1, max_clients=4), st.lists(st.sampled_from(sorted(DEFECTS)), min_size=1, max_size=4))
def test_a_round_of_only_bad_replies_changes_nothing_and_returns_no_arrays(r: Replies, defects: list[str]) -> None:
    """Every reply rejected: no arrays are returned and the strategy's global arrays stay as they were."""
    rng = np.random.default_rng(0)
    global_arrays = [np.full(s, 3, d) for s, d in zip(r.shapes, r.dtypes)]
    strategy = strategy_for("mean", global_arrays, 100)
    strategy.stop_if_nothing_trains = False  # a first round of only bad replies stops the run (test_no_training.py)
    results = []
    for pid, defect in enumerate(defects):
        arrays, count = damaged(list(r.arrays[0]), r.counts[0], defect, rng)
        results.append((FakeProxy(str(100 + pid), pid), fit_res(arrays, count, pid)))
    params, metrics = strategy.aggregate_fit(1, results, [])
    assert params is None and metrics["num_rejected"] == len(defects)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(strategy.global_arrays, global_arrays))
