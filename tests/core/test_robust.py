"""Closed-form checks of the reply bounds' maths (flwr_pfl.core.robust)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flwr_pfl.core.robust import (
    aggregate_blowup,
    clip_update,
    magnitude_outliers,
    reply_norm,
    trimmed_mean,
    update_norm,
    upper_median,
)


def test_clipping_caps_the_norm_and_keeps_the_direction():
    reference = [np.array([1.0, 1.0], np.float32), np.array([[2.0]], np.float32), np.array(7, np.int64)]
    arrays = [np.array([4.0, 5.0], np.float32), np.array([[14.0]], np.float32), np.array(9, np.int64)]
    # update (3, 4, 12): norm 13; integer arrays are not part of it and travel as sent
    assert update_norm([a.astype(np.float64) - r for a, r in zip(arrays[:2], reference[:2])]) == pytest.approx(13.0)
    clipped = clip_update(arrays, reference, 6.5)
    np.testing.assert_allclose(clipped[0], [1.0 + 1.5, 1.0 + 2.0], rtol=1e-6)
    np.testing.assert_allclose(clipped[1], [[2.0 + 6.0]], rtol=1e-6)
    assert clipped[2] == 9 and clipped[0].dtype == np.float32
    within = clip_update(arrays, reference, 13.5)
    assert all(np.array_equal(a, b) for a, b in zip(within, arrays))  # within the bound: unchanged
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        clip_update(arrays, reference, 0.0)


def test_trimmed_mean_drops_the_extremes_per_coordinate():
    values = [[np.array([1.0, 50.0])], [np.array([2.0, -3.0])], [np.array([3.0, 4.0])], [np.array([1e6, 5.0])],
              [np.array([4.0, 6.0])]]
    # floor(0.2 * 5) = 1 dropped at each end, per coordinate: (2, 3, 4) and (4, 5, 6)
    np.testing.assert_allclose(trimmed_mean(values, 0.2)[0], [3.0, 5.0])
    # floor(0.1 * 5) = 0: the plain unweighted mean
    np.testing.assert_allclose(trimmed_mean(values, 0.1)[0], np.mean([v[0] for v in values], axis=0))
    # integers are rounded back
    ints = trimmed_mean([[np.array([1], np.int64)], [np.array([2], np.int64)]], 0.0)[0]
    assert ints.dtype == np.int64 and ints[0] == 2  # 1.5 rounds to even
    with pytest.raises(ValueError, match="trim_fraction"):
        trimmed_mean(values, 0.5)


def test_update_norm_is_accumulated_in_float64():
    """Squares of float32 entries above ~1.8e19 overflow float32; the norm is taken in float64."""
    update = [np.full(4, 1e20, np.float32), np.array([3, 4], np.int64)]  # integer arrays are not counted
    assert update_norm(update) == pytest.approx(2e20, rel=1e-6)


def test_an_update_exactly_at_the_bound_is_returned_as_sent():
    """norm == max_norm is within the bound: the arrays come back bit for bit (rescaling by 1.0
    would round: reference + (arrays - reference) is not always arrays in floating point)."""
    reference = [np.array([0.2, 0.0])]
    arrays = [np.array([0.9, 0.0])]  # 0.2 + (0.9 - 0.2) == 0.8999999999999999
    assert not np.array_equal(reference[0] + (arrays[0] - reference[0]), arrays[0])
    bound = update_norm([arrays[0] - reference[0]])
    np.testing.assert_array_equal(clip_update(arrays, reference, bound)[0], arrays[0])


@pytest.mark.parametrize(
    "arrays",
    [
        [np.zeros(2), np.zeros(3)],  # one array too many
        [np.zeros(3)],  # same count, another shape
    ],
)
def test_clip_update_refuses_another_layout_with_its_message(arrays):
    with pytest.raises(ValueError, match="^the reply's arrays do not match the reference layout$"):
        clip_update(arrays, [np.zeros(2)], 1.0)


def test_trimmed_mean_of_no_clients_is_refused_with_its_message():
    with pytest.raises(ValueError, match="^cannot average zero clients$"):
        trimmed_mean([], 0.1)


def test_trimmed_mean_of_float32_arrays_is_computed_in_float64_and_returned_as_float32():
    rng = np.random.default_rng(0)
    values = [[(rng.normal(size=3) * 1000).astype(np.float32)] for _ in range(7)]
    out = trimmed_mean(values, 0.2)[0]
    kept = np.sort(np.stack([v[0].astype(np.float64) for v in values]), axis=0)[1:6]
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, kept.mean(axis=0).astype(np.float32))
    # a float32 mean rounds differently on these values
    assert not np.array_equal(np.sort(np.stack([v[0] for v in values]), axis=0)[1:6].mean(axis=0), out)


@pytest.mark.parametrize("second", [[np.zeros(3)], [np.zeros(2), np.zeros(1)]])
def test_trimmed_mean_refuses_another_layout_naming_the_client(second):
    with pytest.raises(ValueError, match="^client 1's arrays do not match client 0's layout$"):
        trimmed_mean([[np.zeros(2)], second], 0.0)


def test_upper_median_is_the_larger_middle_value():
    assert upper_median([3.0, 1.0, 2.0]) == 2.0
    assert upper_median([4.0, 1.0, 3.0, 2.0]) == 3.0  # even count: the larger of 2 and 3
    assert upper_median([7.0]) == 7.0
    with pytest.raises(ValueError, match="no values"):
        upper_median([])


def test_magnitude_outliers_compare_with_the_upper_median_or_the_given_reference():
    # reference = upper median 2.0; limit 10 x 2 = 20: 20 is kept, 20.5 and inf are not
    assert magnitude_outliers([1.0, 2.0, 20.0, 20.5, math.inf, 1.5], 10.0) == [3, 4]
    # fewer than three finite norms: the given reference, else none but the non-finite
    assert magnitude_outliers([1.0, 50.0], 10.0, reference=2.0) == [1]
    assert magnitude_outliers([1.0, 1e30], 10.0) == []
    assert magnitude_outliers([1.0, math.nan], 10.0) == [1]
    # a zero reference (most replies all zeros) compares with nothing
    assert magnitude_outliers([0.0, 0.0, 0.0, 5.0], 10.0) == []
    # one huge reply of three cannot raise the reference
    assert magnitude_outliers([1.0, 1.2, 1e30], 1000.0) == [2]
    with pytest.raises(ValueError, match="ratio must be > 1"):
        magnitude_outliers([1.0], 1.0)


def test_aggregate_blowup_names_non_finite_values_and_growth_beyond_the_factor():
    previous = [np.full(4, 1.0), np.arange(3)]  # norm 2 (the integer array does not count)
    assert aggregate_blowup([np.full(4, 1.0)], previous, 10.0) is None
    assert aggregate_blowup([np.full(4, 9.99)], previous, 10.0) is None  # norm 19.98 <= 20
    assert "norm 20.2" in aggregate_blowup([np.full(4, 10.1)], previous, 10.0)
    assert aggregate_blowup([np.array([1.0, np.nan, np.inf])], previous, 10.0) == "2 NaN/Inf value(s)"
    # a model that starts at zero may grow to entries of the factor's magnitude (the previous
    # norm is floored at sqrt(P) = 2: the limit is 20)
    assert aggregate_blowup([np.full(4, 9.9)], [np.zeros(4)], 10.0) is None
    assert "more than 10 x the previous round's 2" in aggregate_blowup([np.full(4, 10.1)], [np.zeros(4)], 10.0)
    assert aggregate_blowup([np.full(4, 10.1)], None, 10.0) is not None


def test_reply_norm_of_float32_values_near_their_maximum_does_not_warn_and_is_finite():
    assert reply_norm([np.full(3, 3e38, np.float32), np.arange(2)]) == pytest.approx(3e38 * math.sqrt(3), rel=1e-6)


def test_aggregate_blowup_at_its_edges():
    """The limit is growth x max(||previous||, sqrt(P)), P the floating-point values only."""
    grown = [np.full(4, 40.0, np.float32)]  # norm 80
    assert aggregate_blowup(grown, [np.full(4, 5.0)], 10.0) is None  # previous norm 10 > sqrt(4): limit 100
    assert aggregate_blowup([np.full(4, 10.0)], [np.full(4, 1.0)], 10.0) is None  # exactly at the limit 20
    assert aggregate_blowup([np.full(4, 9.9, np.float32)], [np.zeros(4, np.float32)], 10.0) is None  # float32 counts
    # integer arrays are no part of P: 104 values would allow a norm of 102
    assert aggregate_blowup([np.full(4, 10.1), np.zeros(100, np.int64)], [np.zeros(4)], 10.0) is not None
    assert aggregate_blowup([np.array([10.5])], None, 10.0) is not None  # one value: floor sqrt(1) = 1
    assert aggregate_blowup([np.array([1.0, np.nan], np.float32)], None, 10.0) == "1 NaN/Inf value(s)"


def test_a_ratio_just_above_one_is_allowed_and_messages_are_exact():
    assert magnitude_outliers([1.0, 1.0, 1.0, 1.6], 1.5) == [3]
    with pytest.raises(ValueError, match="^the upper median of no values is undefined$"):
        upper_median([])


def test_reply_norm_overflows_to_inf_without_a_warning():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert reply_norm([np.full(2, 1e200)]) == math.inf
