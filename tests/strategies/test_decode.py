"""decode_arrays: reply arrays as views on their .npy bytes, equal to Flower's decoding."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.common import Parameters, ndarrays_to_parameters, parameters_to_ndarrays

from flwr_pfl.strategies.decode import decode_arrays


def test_same_values_dtypes_and_shapes_as_flower():
    rng = np.random.default_rng(0)
    arrays = [
        rng.normal(size=(4, 3, 2)).astype(np.float32),
        rng.normal(size=(5,)),
        np.array(7, dtype=np.int64),  # 0-d (BatchNorm's counter)
        np.zeros((0, 3), dtype=np.float32),
        np.array([True, False, True]),
        rng.normal(size=(2, 3)).astype(">f8"),  # big-endian
        np.asfortranarray(rng.normal(size=(3, 4))),  # Fortran order: decoded by copy
        rng.integers(0, 9, size=(2, 2)).astype(np.uint8),
    ]
    parameters = ndarrays_to_parameters(arrays)
    for ours, theirs, original in zip(decode_arrays(parameters), parameters_to_ndarrays(parameters), arrays):
        assert ours.dtype == theirs.dtype == original.dtype
        assert ours.shape == theirs.shape == original.shape
        np.testing.assert_array_equal(ours, theirs)


def test_views_share_the_reply_bytes_and_are_read_only():
    parameters = ndarrays_to_parameters([np.arange(12, dtype=np.float32).reshape(3, 4)])
    (array,) = decode_arrays(parameters)
    assert not array.flags.writeable
    assert np.shares_memory(array, np.frombuffer(parameters.tensors[0], dtype=np.uint8))


def test_a_truncated_payload_is_refused():
    data = ndarrays_to_parameters([np.arange(10, dtype=np.float64)]).tensors[0][:-8]
    with pytest.raises(ValueError, match="expected 80 bytes got 72"):  # not a view over the 9 values there are
        decode_arrays(Parameters(tensors=[data], tensor_type="numpy.ndarray"))


def test_a_version_2_header_is_read_as_a_view_too():
    import io

    stream = io.BytesIO()
    np.lib.format.write_array(stream, np.arange(6, dtype=np.float32).reshape(2, 3), version=(2, 0))
    data = stream.getvalue()
    assert data[6] == 2  # a four-byte header length
    (array,) = decode_arrays(Parameters(tensors=[data], tensor_type="numpy.ndarray"))
    np.testing.assert_array_equal(array, np.arange(6, dtype=np.float32).reshape(2, 3))
    assert not array.flags.writeable and np.shares_memory(array, np.frombuffer(data, dtype=np.uint8))


@pytest.mark.parametrize("data", [b"XXXXXX\x01\x00\x05\x00\x00\x00", b"\x93NUMPX\x02\x00\x05\x00\x00\x00\x00"])
def test_bytes_that_are_not_npy_are_refused_as_flower_refuses_them(data):
    with pytest.raises(ValueError) as flowers:
        parameters_to_ndarrays(Parameters(tensors=[data], tensor_type="numpy.ndarray"))
    with pytest.raises(ValueError) as ours:
        decode_arrays(Parameters(tensors=[data], tensor_type="numpy.ndarray"))
    assert str(ours.value) == str(flowers.value)
