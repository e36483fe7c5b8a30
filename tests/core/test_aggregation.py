"""weighted_average: the FedAvg step, tensor by tensor."""

from __future__ import annotations

import numpy as np
import pytest

from flwr_pfl.core.aggregation import weighted_average


def _clients(k: int = 3, seed: int = 0) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        [rng.normal(size=(3, 4)).astype(np.float32), rng.normal(size=(5,)).astype(np.float32), rng.normal(size=())]
        for _ in range(k)
    ]


def test_equals_hand_computed_weighted_mean():
    clients = _clients()
    weights = [10, 30, 60]
    out = weighted_average(clients, weights)
    assert len(out) == 3
    for i in range(3):
        expected = (10 * clients[0][i].astype(np.float64) + 30 * clients[1][i] + 60 * clients[2][i]) / 100
        assert out[i].shape == clients[0][i].shape
        assert out[i].dtype == clients[0][i].dtype
        np.testing.assert_allclose(out[i], expected, rtol=1e-6, atol=1e-7)


def test_small_explicit_example():
    out = weighted_average([[np.array([0.0, 4.0])], [np.array([2.0, 8.0])]], [1.0, 3.0])
    np.testing.assert_allclose(out[0], [1.5, 7.0])


def test_weights_are_scale_free():
    clients = _clients()
    a = weighted_average(clients, [1, 2, 3])
    b = weighted_average(clients, [100, 200, 300])
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=1e-6)


def test_equal_weights_give_plain_mean():
    clients = _clients(k=4)
    out = weighted_average(clients, [7, 7, 7, 7])
    for i in range(3):
        np.testing.assert_allclose(out[i], np.mean([c[i] for c in clients], axis=0), rtol=1e-5, atol=1e-7)


def test_single_client_is_returned_unchanged():
    clients = _clients(k=1)
    out = weighted_average(clients, [5])
    for a, b in zip(out, clients[0]):
        np.testing.assert_array_equal(a, b)


def test_integer_dtype_preserved_and_rounded():
    a = [np.array([1, 2, 10], dtype=np.int64), np.array([0.0], dtype=np.float32)]
    b = [np.array([2, 4, 20], dtype=np.int64), np.array([1.0], dtype=np.float32)]
    out = weighted_average([a, b], [1, 2])
    assert out[0].dtype == np.int64 and out[1].dtype == np.float32
    np.testing.assert_array_equal(out[0], np.rint([5 / 3, 10 / 3, 50 / 3]).astype(np.int64))
    np.testing.assert_array_equal(out[0], [2, 3, 17])
    # 0-d integer buffer (BatchNorm's num_batches_tracked)
    out = weighted_average([[np.array(10, dtype=np.int64)], [np.array(20, dtype=np.int64)]], [1, 1])
    assert out[0].dtype == np.int64 and out[0].shape == () and int(out[0]) == 15


def test_float64_accumulation_for_float32_inputs():
    # many small contributions: float64 accumulation keeps the exact mean
    clients = [[np.array([1e-3 * k], dtype=np.float32)] for k in range(1000)]
    out = weighted_average(clients, [1] * 1000)
    np.testing.assert_allclose(out[0], [np.mean(np.array([1e-3 * k for k in range(1000)], dtype=np.float32), dtype=np.float64)], rtol=1e-6)


def test_zero_weight_client_is_ignored():
    clients = _clients()
    clients[1] = [np.full_like(a, 1e6) for a in clients[1]]
    out = weighted_average(clients, [2, 0, 3])
    ref = weighted_average([clients[0], clients[2]], [2, 3])
    for a, b in zip(out, ref):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_zero_weight_client_with_non_finite_values_does_not_poison():
    clients = _clients()
    clients[2] = [np.full_like(a, np.nan) for a in clients[2]]
    clients[2][0][0, 0] = np.inf
    out = weighted_average(clients, [1, 1, 0])
    for a in out:
        assert np.all(np.isfinite(a))


def test_inputs_are_not_modified():
    clients = _clients()
    copies = [[a.copy() for a in c] for c in clients]
    weighted_average(clients, [1, 2, 3])
    for c, cc in zip(clients, copies):
        for a, b in zip(c, cc):
            np.testing.assert_array_equal(a, b)


def test_mismatched_shapes_raise():
    clients = _clients()
    clients[2][1] = np.zeros(6, dtype=np.float32)
    with pytest.raises(ValueError, match="client 2"):
        weighted_average(clients, [1, 1, 1])


def test_mismatched_array_count_raises():
    clients = _clients()
    clients[1] = clients[1][:2]
    with pytest.raises(ValueError, match="client 1"):
        weighted_average(clients, [1, 1, 1])


@pytest.mark.parametrize("weights", [[1, -1, 2], [0, 0, 0], [1, float("nan"), 1], [1, float("inf"), 1]])
def test_invalid_weights_raise(weights):
    with pytest.raises(ValueError, match="weights"):
        weighted_average(_clients(), weights)


@pytest.mark.parametrize("weights", [[1, 2], [1, 2, 3, 4]])
def test_wrong_number_of_weights_raises(weights):
    with pytest.raises(ValueError, match="one weight per client"):
        weighted_average(_clients(), weights)


def test_no_clients_raises_with_its_exact_message():
    with pytest.raises(ValueError, match="^cannot average zero clients$"):
        weighted_average([], [])


def test_clients_with_no_arrays_average_to_no_arrays():
    """Local training's replies carry zero arrays; their average is the empty list, not an error."""
    assert weighted_average([[], [], []], [1, 2, 3]) == []


def test_float32_weights_are_normalised_in_float64():
    """Weights given in float32 (a numpy array of counts) are widened before w / sum(w): the
    result is bit-identical to the same weights given as Python floats."""
    clients = [[np.full((4,), v, dtype=np.float64)] for v in (0.1, 0.7, 1.3)]
    weights = [1.0, 3.0, 7.0]
    expected = weighted_average(clients, weights)
    got = weighted_average(clients, np.asarray(weights, dtype=np.float32))
    np.testing.assert_array_equal(got[0], expected[0])
    # the float32 normalisation this guards against rounds differently
    w32 = np.asarray(weights, dtype=np.float32)
    w32 = w32 / w32.sum()
    assert float(sum(wk * c[0][0] for wk, c in zip(w32, clients))) != expected[0][0]


def test_bit_identical_to_the_plain_float64_sum():
    """The in-place accumulation rounds exactly as sum_k (w_k / W) * theta_k in float64 would,
    for float32, float64 and integer tensors with unequal weights."""
    rng = np.random.default_rng(3)
    clients = [[rng.normal(size=(7, 3)).astype(np.float32), rng.normal(size=(4,)),
                rng.integers(0, 50, size=(5,))] for _ in range(6)]
    weights = [3.0, 0.0, 11.0, 1.0, 7.5, 2.0]
    w = np.asarray(weights) / sum(weights)
    out = weighted_average(clients, weights)
    for i, ref in enumerate(clients[0]):
        expected = np.zeros(ref.shape)
        for wk, arrays in zip(w, clients):
            if wk > 0:
                expected = expected + wk * arrays[i]
        expected = np.rint(expected).astype(ref.dtype) if ref.dtype.kind == "i" else expected.astype(ref.dtype)
        assert out[i].dtype == ref.dtype
        np.testing.assert_array_equal(out[i], expected)


def test_inputs_are_left_unchanged():
    clients = _clients()
    before = [[a.copy() for a in c] for c in clients]
    weighted_average(clients, [1, 2, 3])
    for c, b in zip(clients, before):
        for x, y in zip(c, b):
            np.testing.assert_array_equal(x, y)
