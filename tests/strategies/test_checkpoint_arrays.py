"""A checkpoint's global arrays are checked against the strategy before anything is loaded
(``PFLStrategy.load_state_dict``, reached through ``server_app.load_checkpoint``): another
count, shape or dtype than the strategy's global arrays, a non-finite value or a negative
``rounds_done`` is a ConfigError naming the entry, what was expected and what was found, and
the strategy keeps its state."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from flwr_pfl.app.checkpoint import write_checkpoint
from flwr_pfl.app.server_app import load_checkpoint
from flwr_pfl.errors import ConfigError
from flwr_pfl.strategies import FedAvg


def model_arrays() -> list[np.ndarray]:
    """The strategy's global arrays: a weight, a bias, a BatchNorm-like counter."""
    return [np.full((3, 4), 0.5, np.float32), np.arange(5, dtype=np.float32), np.array(7, np.int64)]


def state(arrays: list[np.ndarray]) -> dict:
    return {"global_arrays": arrays, "round_offset": 2, "partition_of": {"5000": 0, "5007": 1}}


def strategy() -> FedAvg:
    return FedAvg(num_clients=3, initial_arrays=model_arrays(), seed=0)


def snapshot(s: FedAvg) -> tuple:
    return (tuple((a.dtype.str, a.shape, a.tobytes()) for a in s.global_arrays or []), s.round_offset,
            sorted(s.partition_of.items()), s.initial_parameters.tensors)


def refused(tmp_path: Path, arrays: list[np.ndarray], rounds_done: int = 2) -> str:
    """Load a checkpoint of ``arrays``: it must be refused and change nothing; the reason."""
    path = write_checkpoint(tmp_path, rounds_done, {"algorithm": "fedavg"}, {}, state(arrays))
    target = strategy()
    before = snapshot(target)
    with pytest.raises(ConfigError) as err:
        load_checkpoint(target, path)
    assert snapshot(target) == before
    return str(err.value)


def test_a_matching_checkpoint_loads(tmp_path: Path) -> None:
    saved = [a + 1 for a in model_arrays()]
    path = write_checkpoint(tmp_path, 2, {"algorithm": "fedavg"}, {}, state(saved))
    target = strategy()
    assert load_checkpoint(target, path) == 2
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(target.global_arrays, saved))
    assert target.round_offset == 2 and target.partition_of == {"5000": 0, "5007": 1}


def test_a_global_array_of_another_shape_is_refused_naming_the_entry_and_both_shapes(tmp_path: Path) -> None:
    arrays = model_arrays()
    arrays[0] = arrays[0].reshape(-1, 1)
    reason = refused(tmp_path, arrays)
    assert "global_0" in reason and "float32(12, 1)" in reason and "float32(3, 4)" in reason


def test_a_global_array_of_another_dtype_is_refused_naming_the_entry_and_both_dtypes(tmp_path: Path) -> None:
    arrays = model_arrays()
    arrays[1] = arrays[1].astype(np.float16)
    reason = refused(tmp_path, arrays)
    assert "global_1" in reason and "float16(5,)" in reason and "float32(5,)" in reason


def test_another_number_of_global_arrays_is_refused_naming_both_counts(tmp_path: Path) -> None:
    assert "holds 2 global arrays but the strategy's model has 3" in refused(tmp_path, model_arrays()[:2])


def test_a_non_finite_global_array_is_refused_naming_the_entry(tmp_path: Path) -> None:
    arrays = model_arrays()
    arrays[1][3] = np.nan
    reason = refused(tmp_path, arrays)
    assert "global_1" in reason and "1 non-finite value" in reason


def test_a_negative_rounds_done_is_refused(tmp_path: Path) -> None:
    assert "rounds_done is -1" in refused(tmp_path, model_arrays(), rounds_done=-1)


def test_without_global_arrays_of_its_own_a_strategy_still_refuses_non_finite_values() -> None:
    """A strategy built without initial arrays (the app's) has no model to compare with; a
    non-finite value is refused all the same."""
    s = FedAvg(num_clients=3, seed=0)
    bad = model_arrays()
    bad[0][0, 0] = np.inf
    with pytest.raises(ConfigError, match=r"global_0\) holds 1 non-finite"):
        s.load_state_dict(state(bad), 2)
    assert s.global_arrays is None and s.round_offset == 0
