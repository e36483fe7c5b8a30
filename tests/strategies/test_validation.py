"""check_arrays: every kind of bad reply is rejected with a message naming the client."""

from __future__ import annotations

import numpy as np
import pytest

from flwr_pfl.errors import ReplyError
from flwr_pfl.strategies.validation import check_arrays

SHAPES = [(3, 4), (4,), ()]


def _arrays() -> list[np.ndarray]:
    return [np.ones((3, 4), np.float32), np.zeros(4, np.float32), np.array(7, dtype=np.int64)]


def test_valid_reply_passes():
    assert check_arrays("client-7", _arrays(), SHAPES, num_examples=12) is None
    # shapes given as lists work too
    check_arrays("client-7", _arrays(), [[3, 4], [4], []], num_examples=1)


@pytest.mark.parametrize("count", [0, -5])
def test_non_positive_count(count):
    with pytest.raises(ReplyError, match=rf"client c42: reported {count} examples"):
        check_arrays("c42", _arrays(), SHAPES, num_examples=count)


def test_too_few_arrays():
    with pytest.raises(ReplyError, match="client c1: sent 2 arrays, expected 3"):
        check_arrays("c1", _arrays()[:2], SHAPES, num_examples=3)


def test_too_many_arrays():
    with pytest.raises(ReplyError, match="client c1: sent 4 arrays, expected 3"):
        check_arrays("c1", _arrays() + [np.zeros(1)], SHAPES, num_examples=3)


def test_wrong_shape_names_array_and_shapes():
    arrays = _arrays()
    arrays[1] = np.zeros(5, np.float32)
    with pytest.raises(ReplyError, match=r"client node-9: array 1 has shape \(5,\), expected \(4,\)"):
        check_arrays("node-9", arrays, SHAPES, num_examples=3)


def test_transposed_array_rejected():
    arrays = _arrays()
    arrays[0] = np.ones((4, 3), np.float32)
    with pytest.raises(ReplyError, match="client x: array 0"):
        check_arrays("x", arrays, SHAPES, num_examples=3)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_non_finite_values_rejected(bad, dtype):
    arrays = _arrays()
    arrays[0] = arrays[0].astype(dtype)
    arrays[0][2, 1] = bad
    with pytest.raises(ReplyError, match="client c5: array 0 contains NaN or Inf"):
        check_arrays("c5", arrays, SHAPES, num_examples=3)


def test_non_finite_in_later_array_names_that_array():
    arrays = _arrays()
    arrays[1][3] = np.nan
    with pytest.raises(ReplyError, match="array 1 contains NaN"):
        check_arrays("c5", arrays, SHAPES, num_examples=3)


def test_count_checked_before_layout():
    with pytest.raises(ReplyError, match="examples"):
        check_arrays("c", [], SHAPES, num_examples=0)


def test_reply_error_is_a_value_error():
    assert issubclass(ReplyError, ValueError)  # callers that catch ValueError catch it too
    with pytest.raises(ValueError) as err:
        check_arrays("c", [], SHAPES, num_examples=1)
    assert type(err.value) is ReplyError and "client c" in str(err.value)


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128, object, "U3"])
def test_arrays_that_are_not_real_numbers_are_rejected(dtype):
    arrays = _arrays()
    arrays[1] = np.zeros(4, dtype=dtype)
    with pytest.raises(ReplyError, match=r"client c3: array 1 is .*; a reply holds real numbers only"):
        check_arrays("c3", arrays, SHAPES, num_examples=2)


def test_a_complex_array_of_finite_values_is_rejected_before_the_finiteness_check():
    arrays = _arrays()
    arrays[0] = np.ones((3, 4), np.complex64) * (1 + 1e30j)
    with pytest.raises(ReplyError, match="array 0 is complex64"):
        check_arrays("c3", arrays, SHAPES, num_examples=2)


def test_expected_dtypes_pin_each_array_and_none_accepts_any_real_one():
    dtypes = [np.dtype(np.float32), None, np.dtype(np.int64)]
    check_arrays("c5", _arrays(), SHAPES, 3, dtypes)
    wide = _arrays()
    wide[0] = wide[0].astype(np.float64)
    with pytest.raises(ReplyError, match="client c5: array 0 is float64, expected float32"):
        check_arrays("c5", wide, SHAPES, 3, dtypes)
    loose = _arrays()
    loose[1] = np.zeros(4, np.float64)  # None: any real dtype
    check_arrays("c5", loose, SHAPES, 3, dtypes)
    counter = _arrays()
    counter[2] = np.array(7.0, np.float32)
    with pytest.raises(ReplyError, match="array 2 is float32, expected int64"):
        check_arrays("c5", counter, SHAPES, 3, dtypes)
    with pytest.raises(ValueError, match="2 expected dtypes for 3 expected shapes"):
        check_arrays("c5", _arrays(), SHAPES, 3, dtypes[:2])
