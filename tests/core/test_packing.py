"""Symmetric matrices packed to their upper triangle and back (pFedFDA's covariance, FedDAR-SA's
Hessians): exact for symmetric stacks, the mirrored upper triangle otherwise, clear errors."""

from __future__ import annotations

import numpy as np
import pytest

from flwr_pfl.core.packing import pack_symmetric, unpack_symmetric


def symmetric_stack(shape: tuple[int, ...], dim: int, seed: int = 0) -> np.ndarray:
    a = np.random.default_rng(seed).normal(size=(*shape, dim, dim))
    return a + np.swapaxes(a, -1, -2)


@pytest.mark.parametrize("shape", [(), (3,), (2, 4)])
def test_a_symmetric_stack_round_trips_exactly_in_half_the_values(shape):
    matrices = symmetric_stack(shape, 5)
    packed = pack_symmetric(matrices)
    assert packed.shape == (*shape, 15)
    np.testing.assert_array_equal(unpack_symmetric(packed, 5), matrices)


def test_the_layout_is_row_major_upper_triangle_with_the_diagonal():
    m = np.array([[1.0, 2.0, 3.0], [2.0, 4.0, 5.0], [3.0, 5.0, 6.0]])
    np.testing.assert_array_equal(pack_symmetric(m), [1, 2, 3, 4, 5, 6])


def test_an_almost_symmetric_matrix_comes_back_as_its_mirrored_upper_triangle():
    m = symmetric_stack((), 4)
    m[3, 0] += 1e-12  # a rounding difference below the diagonal
    back = unpack_symmetric(pack_symmetric(m), 4)
    np.testing.assert_array_equal(back, np.triu(m) + np.triu(m, 1).T)
    assert np.abs(back - m).max() == pytest.approx(1e-12, rel=1e-3)


def test_the_dtype_is_kept():
    packed = pack_symmetric(symmetric_stack((2,), 3).astype(np.float32))
    assert packed.dtype == np.float32 and unpack_symmetric(packed, 3).dtype == np.float32


def test_bad_shapes_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"square matrices .*\(3, 4\)"):
        pack_symmetric(np.zeros((3, 4)))
    with pytest.raises(ValueError, match=r"packed 4x4 symmetric matrix has 10 values, got shape \(2, 9\)"):
        unpack_symmetric(np.zeros((2, 9)), 4)
