"""Every file the suite loads state from, damaged or foreign, is refused with a named reason and
loads nothing: a node's state file (flwr_pfl.app.node_state), the server's checkpoint
(flwr_pfl.app.checkpoint, loaded through ``server_app.load_checkpoint``) and a node's settings
(flwr_pfl.app.node_settings). The truncation point, the flipped byte and its new value, the
false dtype or shape and the other run are drawn by hypothesis.

``client_cache`` keeps nothing on disk; its counterpart of "another run's file", a message of
another run reusing what the previous run cached, is tested here too.
"""

from __future__ import annotations

import logging
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, MetricRecord, RecordDict
from hypothesis import given, settings
from hypothesis import strategies as st

from flwr_pfl.app import node_state
from flwr_pfl.app.checkpoint import CHECKPOINT_NAME, Checkpoint, read_checkpoint, write_checkpoint
from flwr_pfl.app.node_settings import NodeSettings, NodeSettingsError
from flwr_pfl.app.node_state import StateFileError, identity, persist, restore, state_path
from flwr_pfl.errors import ConfigError

RUN_CONFIG = {"run-name": "exp", "algorithm": "fedrep", "learning-rate": 0.05, "num-server-rounds": 3, "resume": False}
#: every reason the node-state reader gives for refusing a file
NODE_STATE_REASONS = re.compile(
    r"not a flwr_pfl node state file \(wrong leading bytes\)|truncated before its header|header length \d+ is out "
    r"of range|header is not JSON|header does not match its SHA-256|unknown format|header field '[a-z0-9-]+' is "
    r"missing|body has \d+ bytes, the header says \d+|body does not match its SHA-256|records do not decode|array "
    r"\S+ does not decode|array \S+ holds .* but declares|it belongs to partition \d+ of run"
)
#: every reason the checkpoint reader gives for refusing a file
CHECKPOINT_REASONS = re.compile(
    r"there is no checkpoint|it is not a \.npz archive|cannot be read|is damaged|holds an object array|has no "
    r"metadata entry 'meta'|metadata entry 'meta' is|metadata is not valid JSON|metadata lacks|has format|refers to "
    r"a missing array entry|does not match the model|global arrays but the strategy's model has|non-finite value|"
    r"rounds_done is"
)


@contextmanager
def captured(logger: str = "flwr") -> Iterator[list[str]]:
    """The messages ``logger`` emits (INFO and up) while the block runs."""
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler, log = Keep(logging.INFO), logging.getLogger(logger)
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield messages
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


# ------------------------------------------------------------------------------ node state
def node(directory: Path, run_id: int = 7, partition: int = 2, **run_config) -> Context:
    """A node's Context with ``state-dir`` under ``directory`` and an empty state."""
    return Context(run_id=run_id, node_id=1000 + partition,
                   node_config={"partition-id": partition, "num-partitions": 4, "state-dir": str(directory / "state")},
                   state=RecordDict(), run_config=RUN_CONFIG | run_config)


ARRAY_DTYPES = ("float32", "float64", "float16", "int64", "int32", "uint8", "bool")


@st.composite
def node_states(draw) -> RecordDict:
    """A state of 1..3 arrays of drawn dtypes and shapes, a config and a metric record."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    arrays = []
    for _ in range(draw(st.integers(1, 3))):
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
        arrays.append(np.asarray(10 * rng.normal(size=shape), dtype=draw(st.sampled_from(ARRAY_DTYPES))))
    return RecordDict({
        "personal": ArrayRecord(arrays),
        "scalars": ConfigRecord({"beta": draw(st.floats(-1e6, 1e6)), "count": draw(st.integers(-5, 10**6)), "tag": "x"}),
        "metrics": MetricRecord({"loss": draw(st.floats(0, 10))}),
    })


def saved_state(directory: Path, state: RecordDict) -> tuple[Path, bytes]:
    """The default node's state file holding ``state``, as ``persist`` writes it (written here
    without ``persist``'s fsyncs, which would dominate the run time); its path and bytes."""
    ctx = node(directory)
    path = state_path(directory / "state", identity(ctx))
    good = node_state.encode(state, identity(ctx))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(good)
    return path, good


def test_the_state_file_written_here_is_what_persist_writes() -> None:
    """:func:`saved_state` writes the bytes ``persist`` would, and they restore the state."""
    state = RecordDict({"personal": ArrayRecord([np.arange(3.0)]), "scalars": ConfigRecord({"beta": 0.5})})
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        ctx = node(Path(a))
        for key, record in state.items():
            ctx.state[key] = record
        assert persist(ctx)
        path, good = saved_state(Path(b), state)
        assert state_path(Path(a) / "state", identity(ctx)).read_bytes() == good
        restarted = node(Path(b))
        assert restore(restarted)
        np.testing.assert_array_equal(restarted.state["personal"].to_numpy_ndarrays()[0], np.arange(3.0))


def assert_refused(directory: Path, path: Path, bad: bytes) -> None:
    """``bad`` at ``path`` is refused: ``decode`` names a reason, ``restore`` loads nothing, warns
    with the file and the same reason, and moves the file aside unchanged."""
    with pytest.raises(StateFileError) as refused:
        header, _ = node_state.decode(bad)
        node_state._check_owner(header, identity(node(directory)))
    reason = str(refused.value)
    assert NODE_STATE_REASONS.search(reason), reason
    path.write_bytes(bad)
    restarted = node(directory)
    with captured() as logs:
        assert not restore(restarted)
    assert len(restarted.state) == 0
    assert any(f"refused the node state file {path}: {reason}" in m for m in logs), logs
    assert not path.exists() and path.with_name(path.name + ".rejected").read_bytes() == bad


@settings(max_examples=60)
@given(node_states(), st.data())
def test_a_truncated_node_state_file_is_refused_with_its_reason_and_loads_nothing(state: RecordDict, data) -> None:
    """A state file cut at any byte is refused, named, kept aside, and the node starts empty."""
    with tempfile.TemporaryDirectory() as tmp:
        path, good = saved_state(Path(tmp), state)
        cut = data.draw(st.integers(0, len(good) - 1), label="cut")
        assert_refused(Path(tmp), path, good[:cut])


@settings(max_examples=150)
@given(node_states(), st.data())
def test_a_node_state_file_with_any_byte_changed_is_refused_with_its_reason_and_loads_nothing(state: RecordDict, data) -> None:
    """A state file with any one byte replaced by another value (magic, header length, header,
    body) is refused, named, kept aside, and the node starts empty."""
    with tempfile.TemporaryDirectory() as tmp:
        path, good = saved_state(Path(tmp), state)
        where = data.draw(st.integers(0, len(good) - 1), label="byte")
        mask = data.draw(st.integers(1, 255), label="xor")
        bad = good[:where] + bytes([good[where] ^ mask]) + good[where + 1:]
        assert_refused(Path(tmp), path, bad)


def craft(ident: node_state.StateIdentity, body: bytes) -> bytes:
    """A file whose framing and checksums are consistent with ``body`` (as a careful forger, or a
    bug in a writer, would make it): only the content itself can be wrong."""
    return node_state.encode(RecordDict(), ident, body)


@settings(max_examples=60)
@given(st.sampled_from(ARRAY_DTYPES), st.lists(st.integers(0, 4), max_size=3).map(tuple),
       st.sampled_from(ARRAY_DTYPES), st.lists(st.integers(0, 4), max_size=3).map(tuple))
def test_a_node_state_array_whose_data_is_not_its_declared_dtype_or_shape_is_refused_naming_both(
    dtype: str, shape: tuple[int, ...], declared_dtype: str, declared_shape: tuple[int, ...]
) -> None:
    """An array whose bytes hold ``dtype[shape]`` but which declares another dtype or shape is
    refused with both named; nothing is loaded."""
    if (dtype, shape) == (declared_dtype, declared_shape):
        declared_shape = declared_shape + (1,)
    real = Array(np.zeros(shape, dtype=dtype))
    record = ArrayRecord({"x": Array(dtype=declared_dtype, shape=declared_shape, stype=real.stype, data=real.data)})
    with tempfile.TemporaryDirectory() as tmp:
        path, _ = saved_state(Path(tmp), RecordDict({"personal": ArrayRecord([np.ones(2)])}))
        bad = craft(identity(node(Path(tmp))), node_state.encode_body(RecordDict({"personal": record})))
        assert_refused(Path(tmp), path, bad)
        rejected = path.with_name(path.name + ".rejected")
        with pytest.raises(StateFileError, match=re.escape(f"holds {np.dtype(dtype)}{shape} but declares "
                                                           f"{declared_dtype}{declared_shape}")):
            node_state.decode(rejected.read_bytes())


@settings(max_examples=60)
@given(node_states(), st.sampled_from(["another partition", "another Flower run", "another configuration"]),
       st.integers(0, 3), st.integers(8, 10**6), st.floats(0.001, 0.5))
def test_another_runs_or_partitions_node_state_file_loads_nothing_and_says_whose_it_is(
    state: RecordDict, other: str, partition: int, run_id: int, learning_rate: float
) -> None:
    """The file of another partition (refused, kept aside), of an earlier Flower run that this run
    does not resume, or of a resumed run with another configuration (left for this run's state
    to replace) loads nothing, and the log says which of these it is."""
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        path, good = saved_state(directory, state)
        if other == "another partition":
            partition = partition if partition != 2 else 3
            foreign = node(directory, partition=partition)
            path.write_bytes(node_state.encode(state, identity(foreign)))
            reason = f"it belongs to partition {partition} of run 'exp', not to partition 2 of run 'exp'"
            restarted = node(directory)
        elif other == "another Flower run":
            restarted = node(directory, run_id=run_id)
            reason = "is from an earlier run (Flower run 7) that this run does not resume"
        else:
            lr = learning_rate if learning_rate != RUN_CONFIG["learning-rate"] else 0.5
            restarted = node(directory, run_id=run_id, resume=True, **{"learning-rate": lr})
            reason = "was written under another configuration than this resumed run's"
        before = path.read_bytes()
        with captured() as logs:
            assert not restore(restarted)
        assert len(restarted.state) == 0
        assert any(reason in m for m in logs), logs
        if other == "another partition":
            assert path.with_name(path.name + ".rejected").read_bytes() == before
        else:
            assert path.read_bytes() == before


# ------------------------------------------------------------------------------ checkpoints
def strategy_state(seed: int) -> dict:
    """A FedAvg-like server state: global arrays of several dtypes, rounds and partition ids."""
    rng = np.random.default_rng(seed)
    return {
        "global_arrays": [rng.normal(size=(3, 4)).astype(np.float32), rng.normal(size=5), np.array(7, np.int64)],
        "round_offset": int(rng.integers(0, 9)),
        "partition_of": {str(5000 + 7 * i): i for i in range(int(rng.integers(1, 6)))},
    }


def strategy():
    """A FedAvg round logic holding a known state (the target of a load)."""
    from flwr_pfl.strategies import FedAvg

    s = FedAvg(num_clients=5, seed=0)
    s.load_state_dict(strategy_state(99), 3)
    return s


def snapshot(s) -> tuple:
    """Everything a checkpoint load could change in ``s``, as comparable bytes and values."""
    state = s.state_dict()
    return (tuple((a.dtype.str, a.shape, a.tobytes()) for a in state["global_arrays"]), state["round_offset"],
            tuple(sorted(state["partition_of"].items())), s.initial_parameters.tensors)


def same_checkpoint(a: Checkpoint, b: Checkpoint) -> bool:
    """Whether two checkpoints hold the same rounds, config, results and state, arrays bitwise."""
    ga, gb = a.state["global_arrays"], b.state["global_arrays"]
    return (a.rounds_done, a.config, a.results) == (b.rounds_done, b.config, b.results) and len(ga) == len(gb) and all(
        x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes() for x, y in zip(ga, gb)
    ) and {k: v for k, v in a.state.items() if k != "global_arrays"} == {k: v for k, v in b.state.items() if k != "global_arrays"}


#: seeds of the checkpoints the tests damage (each written once, by ``write_checkpoint``)
CHECKPOINT_SEEDS = (0, 1, 2)
_CHECKPOINTS: dict[int, tuple[bytes, Checkpoint]] = {}


def good_checkpoint(seed: int) -> tuple[bytes, Checkpoint]:
    """The bytes of a checkpoint of :func:`strategy_state` ``(seed)`` after 4 rounds, and what
    it reads back as (written once per process: ``write_checkpoint`` fsyncs)."""
    if seed not in _CHECKPOINTS:
        with tempfile.TemporaryDirectory() as tmp:
            path = write_checkpoint(Path(tmp), 4, {"seed": seed, "algorithm": "fedavg"}, {"metric_rows": 8},
                                    strategy_state(seed))
            _CHECKPOINTS[seed] = (path.read_bytes(), read_checkpoint(path))
    return _CHECKPOINTS[seed]


def written_checkpoint(directory: Path, seed: int) -> tuple[Path, bytes]:
    """:func:`good_checkpoint` ``(seed)`` as ``directory/checkpoint.npz``; its path and bytes."""
    good, _ = good_checkpoint(seed)
    path = directory / CHECKPOINT_NAME
    path.write_bytes(good)
    return path, good


def assert_checkpoint_refused(path: Path) -> str:
    """Loading ``path`` into a strategy raises a ConfigError with a named reason and leaves the
    strategy as it was; returns the reason."""
    from flwr_pfl.app.server_app import load_checkpoint

    target = strategy()
    before = snapshot(target)
    with pytest.raises(ConfigError) as refused:
        load_checkpoint(target, path)
    assert CHECKPOINT_REASONS.search(str(refused.value)), str(refused.value)
    assert snapshot(target) == before
    return str(refused.value)


@settings(max_examples=60)
@given(st.sampled_from(CHECKPOINT_SEEDS), st.data())
def test_a_truncated_checkpoint_is_refused_with_its_reason_and_loads_nothing(seed: int, data) -> None:
    """A checkpoint cut at any byte is a ConfigError naming why; the strategy keeps its state."""
    with tempfile.TemporaryDirectory() as tmp:
        path, good = written_checkpoint(Path(tmp), seed)
        path.write_bytes(good[: data.draw(st.integers(0, len(good) - 1), label="cut")])
        assert_checkpoint_refused(path)


@settings(max_examples=150)
@given(st.sampled_from(CHECKPOINT_SEEDS), st.data())
def test_a_checkpoint_with_any_byte_changed_is_refused_with_its_reason_or_reads_back_identical(seed: int, data) -> None:
    """A checkpoint with one byte replaced is a ConfigError naming why, leaving the strategy as it
    was; the only bytes that pass are the zip's own bookkeeping that no entry depends on (time
    stamps, version and attribute fields), and then every value reads back identical: damage
    never loads other values."""
    with tempfile.TemporaryDirectory() as tmp:
        path, good = written_checkpoint(Path(tmp), seed)
        original = good_checkpoint(seed)[1]
        where = data.draw(st.integers(0, len(good) - 1), label="byte")
        mask = data.draw(st.integers(1, 255), label="xor")
        path.write_bytes(good[:where] + bytes([good[where] ^ mask]) + good[where + 1:])
        try:
            loaded = read_checkpoint(path)
        except ConfigError:
            assert_checkpoint_refused(path)
        else:
            assert same_checkpoint(loaded, original)


@settings(max_examples=30)
@given(st.sampled_from(CHECKPOINT_SEEDS), st.sampled_from(["uint8", "float16", "int8", "int64", "float32", "uint16"]),
       st.sampled_from([(-1,), (1, -1), (-1, 1), (1, 1, -1)]))
def test_a_checkpoint_whose_metadata_entry_has_another_dtype_or_shape_is_refused_naming_the_entry(
    seed: int, dtype: str, shape: tuple[int, ...]
) -> None:
    """The ``meta`` entry (a 1-d uint8 array of JSON) replaced by an array of another dtype or
    number of dimensions (CRCs intact: the archive re-saved) is a ConfigError naming ``'meta'``
    and what it holds; the strategy keeps its state."""
    with tempfile.TemporaryDirectory() as tmp:
        path, _ = written_checkpoint(Path(tmp), seed)
        with np.load(path, allow_pickle=False) as npz:
            entries = {k: npz[k] for k in npz.files}
        changed = entries["meta"].astype(dtype).reshape(shape)
        if changed.dtype == np.uint8 and changed.ndim == 1:  # unchanged: change its number of dimensions
            changed = changed.reshape(1, -1)
        entries["meta"] = changed
        np.savez(path, **entries)
        assert f"metadata entry 'meta' is {changed.dtype}{changed.shape}" in assert_checkpoint_refused(path)


@settings(max_examples=10)
@given(st.sampled_from(CHECKPOINT_SEEDS), st.integers(0, 2), st.sampled_from(["shape", "dtype"]))
def test_a_checkpoint_whose_global_array_has_another_shape_or_dtype_than_the_model_is_refused(
    seed: int, index: int, change: str
) -> None:
    """A checkpoint whose ``global_<i>`` entry (CRC and metadata intact: re-saved) has another
    shape or dtype than the strategy's global arrays is a ConfigError naming the array; the
    strategy keeps its state."""
    with tempfile.TemporaryDirectory() as tmp:
        path, _ = written_checkpoint(Path(tmp), seed)
        with np.load(path, allow_pickle=False) as npz:
            entries = {k: npz[k] for k in npz.files}
        array = entries[f"global_{index}"]
        entries[f"global_{index}"] = array.reshape(-1, 1) if change == "shape" else array.astype(np.float16)
        np.savez(path, **entries)
        assert f"global_{index}" in assert_checkpoint_refused(path)


NOT_RESUMABLE = {"seed": st.integers(0, 10**6), "learning-rate": st.floats(1e-4, 1.0),
                 "fraction-fit": st.floats(0.05, 1.0), "model": st.sampled_from(["mlp", "linear"]),
                 "algorithm": st.sampled_from(["fedavg", "fedrep", "fedper", "local"])}


@settings(max_examples=15)
@given(st.sampled_from(sorted(NOT_RESUMABLE)), st.data())
def test_another_runs_checkpoint_is_refused_naming_the_configuration_keys_that_differ(key: str, data) -> None:
    """A checkpoint written under another value of a key a resume may not change is a
    ConfigError naming that key and both values, raised before any state is loaded."""
    from flwr_pfl.app.config import parse_experiment
    from flwr_pfl.app.server_app import check_resumable

    base = {"num-server-rounds": 5, "resume": True, "run-name": "run", "output-dir": "/nonexistent-output"}
    current = parse_experiment(base)
    value = data.draw(NOT_RESUMABLE[key].filter(lambda v: v != current.to_dict()[key]), label=key)
    other = parse_experiment(base | {key: value}).to_dict()
    with pytest.raises(ConfigError, match=rf"differs from the checkpoint's in {re.escape(key)} \({re.escape(key)}: "
                                          rf"checkpoint {re.escape(repr(other[key]))}, now "):
        check_resumable(current, Checkpoint(2, other, {}, strategy_state(0)))


# ------------------------------------------------------------------------------ node settings
#: node-config values that are wrong for each key
WRONG_SETTINGS = {
    "partition-id": st.one_of(st.integers(max_value=-1), st.integers(4, 10**6), st.booleans(), st.text(max_size=3),
                              st.floats(allow_nan=False)),
    "num-partitions": st.one_of(st.integers(max_value=0), st.booleans(), st.text(max_size=3), st.floats(allow_nan=False)),
    "fedgp-role": st.text(max_size=8).filter(lambda v: v not in ("target", "source")),
    "device": st.one_of(st.just(""), st.integers(), st.sampled_from(["tpu", "gpu", "cuda:x", "mps"])),
    "data-path": st.one_of(st.just(""), st.sampled_from(["relative/path.npz", "/nonexistent/data.npz"]), st.integers()),
    "data-test-fraction": st.one_of(st.floats(1.0, 1e6), st.floats(max_value=-1e-9), st.text(max_size=3)),
}


@settings(max_examples=120)
@given(st.sampled_from(sorted(WRONG_SETTINGS)), st.data())
def test_a_wrong_node_setting_is_refused_naming_the_node_and_the_key(key: str, data) -> None:
    """A node config with one wrong value is a NodeSettingsError that names the node and the key;
    no settings are returned."""
    value = data.draw(WRONG_SETTINGS[key], label=key)
    config: dict = {"partition-id": 1, "num-partitions": 4, key: value}
    if key == "data-test-fraction":
        config["data-path"] = str(Path(__file__).parent)  # an image folder that exists
    with pytest.raises(NodeSettingsError) as refused:
        NodeSettings.parse(config, node_id=321)
    message = str(refused.value)
    assert message.startswith(f"node 321 (partition {config['partition-id']})")
    named = "partition-id" if key == "num-partitions" and "partition-id=" in message else key
    assert named in message, message


# ------------------------------------------------------------------------------ client cache
@settings(max_examples=30)
@given(st.integers(1, 5), st.integers(1, 5), st.sampled_from(["seed", "learning-rate", "batch-size"]), st.booleans())
def test_a_message_of_another_run_never_gets_the_previous_runs_cache(
    run_id: int, other_id: int, key: str, change_config: bool
) -> None:
    """The process's cache serves a run only for its run id and config: another id or config
    builds a new one (nothing of the previous run reaches it); the same ones reuse it."""
    from flwr_pfl.app.client_cache import ClientCache

    cache = ClientCache()
    config = {"num-server-rounds": 2, "seed": 1, "learning-rate": 0.1, "batch-size": 8}
    other = config | ({key: config[key] * 2} if change_config else {})
    first = cache.run(run_id, config)
    second = cache.run(other_id, other)
    assert (second is first) == (run_id == other_id and other == config)
    assert second.run_id == other_id and second.run_config == other
