"""Closed-form checks of the reply bounds' maths (flwr_pfl.core.robust)."""

from __future__ import annotations

import numpy as np
import pytest

from flwr_pfl.core.robust import clip_update, trimmed_mean, update_norm


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
