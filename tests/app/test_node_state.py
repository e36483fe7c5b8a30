"""A node's state on disk (flwr_pfl.app.node_state): exact round trip of every record kind,
atomic replacement, which run's file a node loads, and files that must be refused."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, MetricRecord, RecordDict

from flwr_pfl.app import node_state
from flwr_pfl.app.node_state import (
    MAGIC,
    RESTORED_KEY,
    StateFileError,
    decode,
    encode,
    identity,
    persist,
    persisted,
    restore,
    state_path,
)
from flwr_pfl.errors import ConfigError

RUN_CONFIG = {"run-name": "exp", "algorithm": "fedrep", "learning-rate": 0.05, "num-server-rounds": 3, "resume": False}


def node(tmp_path, run_id=7, partition=2, state_dir=True, **run_config) -> Context:
    node_config = {"partition-id": partition, "num-partitions": 4}
    if state_dir:
        node_config["state-dir"] = str(tmp_path / "state")
    return Context(run_id=run_id, node_id=1000 + partition, node_config=node_config, state=RecordDict(),
                   run_config=RUN_CONFIG | run_config)


def every_kind() -> RecordDict:
    """Arrays of many dtypes (0-d and empty included), config and metric values of every type."""
    arrays = [
        np.arange(12, dtype=np.float32).reshape(3, 4) / 7,
        np.array([1e-300, -2.5, np.pi]),
        np.array(5, dtype=np.int64),
        np.array([[1, 2], [3, 255]], dtype=np.uint8),
        np.array([True, False]),
        np.array([0.1, 65504.0], dtype=np.float16),
        np.zeros((0, 3), dtype=np.int32),
    ]
    return RecordDict({
        "personal": ArrayRecord(arrays),
        "named": ArrayRecord({"w": Array(np.full((2, 2), -1.25, dtype=np.float64))}),
        "scalars": ConfigRecord({"beta_mu": 0.123456789012345, "count": 3, "done": True, "name": "x",
                                 "blob": b"\x00\xff", "ints": [1, 2, 3], "floats": [0.5, 1.5], "flags": [True, False]}),
        "metrics": MetricRecord({"loss": 0.25, "seen": 17, "history": [0.1, 0.2], "counts": [4, 5]}),
    })


def assert_same(a: RecordDict, b: RecordDict) -> None:
    assert list(a.keys()) == list(b.keys())
    for key, record in a.items():
        other = b[key]
        assert type(other) is type(record), key
        if isinstance(record, ArrayRecord):
            assert list(record.keys()) == list(other.keys())
            for name, array in record.items():
                x, y = array.numpy(), other[name].numpy()
                assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), (key, name)
        else:
            assert dict(record) == dict(other), key
            for name, value in record.items():  # int stays int, bool stays bool
                assert type(other[name]) is type(value), (key, name)


def test_every_record_kind_comes_back_exactly(tmp_path):
    before = node(tmp_path)
    for key, record in every_kind().items():
        before.state[key] = record
    assert persist(before)
    after = node(tmp_path)  # the restarted node: same run, same partition, empty state
    assert restore(after)
    assert after.state[RESTORED_KEY]["restores"] == 1
    del after.state[RESTORED_KEY]
    assert_same(before.state, after.state)


def test_the_file_is_written_only_when_the_state_changed(tmp_path):
    ctx = node(tmp_path)
    assert not persist(ctx)  # nothing to keep: no file
    assert not state_path(tmp_path / "state", identity(ctx)).exists()
    ctx.state["personal"] = ArrayRecord([np.ones(3, dtype=np.float32)])
    assert persist(ctx)
    assert not persist(ctx)
    ctx.state["personal"] = ArrayRecord([np.full(3, 2.0, dtype=np.float32)])
    assert persist(ctx)
    assert not restore(ctx)  # a node that holds its state reads nothing


def test_restores_are_counted_and_carried(tmp_path):
    ctx = node(tmp_path)
    ctx.state["personal"] = ArrayRecord([np.ones(2)])
    persist(ctx)
    for n in (1, 2):
        ctx = node(tmp_path)
        with persisted(ctx):
            pass
        assert ctx.state[RESTORED_KEY]["restores"] == n


def test_without_state_dir_nothing_is_read_or_written(tmp_path):
    ctx = node(tmp_path, state_dir=False)
    ctx.state["personal"] = ArrayRecord([np.ones(2)])
    assert not persist(ctx) and not restore(node(tmp_path, state_dir=False))
    assert not (tmp_path / "state").exists()


def test_state_dir_without_partition_id_is_a_config_error(tmp_path):
    ctx = node(tmp_path)
    del ctx.node_config["partition-id"]
    ctx.state["personal"] = ArrayRecord([np.ones(2)])
    with pytest.raises(ConfigError, match="state-dir is set but partition-id is missing"):
        persist(ctx)


# --- atomic replacement ---------------------------------------------------------------------


def test_a_writer_killed_before_the_rename_leaves_the_previous_state(tmp_path, monkeypatch):
    ctx = node(tmp_path)
    ctx.state["personal"] = ArrayRecord([np.arange(4, dtype=np.float32)])
    persist(ctx)
    path = state_path(tmp_path / "state", identity(ctx))
    previous = path.read_bytes()

    def killed(src, dst):
        raise KeyboardInterrupt  # the process dies between writing the temp file and the rename

    monkeypatch.setattr(node_state.os, "replace", killed)
    ctx.state["personal"] = ArrayRecord([np.arange(4, dtype=np.float32) + 100])
    with pytest.raises(KeyboardInterrupt):
        persist(ctx)
    monkeypatch.undo()
    assert path.read_bytes() == previous
    restarted = node(tmp_path)
    assert restore(restarted)
    np.testing.assert_array_equal(restarted.state["personal"].to_numpy_ndarrays()[0], np.arange(4, dtype=np.float32))


def test_a_leftover_temp_file_is_ignored_then_removed(tmp_path):
    ctx = node(tmp_path)
    ctx.state["personal"] = ArrayRecord([np.arange(3.0)])
    persist(ctx)
    path = state_path(tmp_path / "state", identity(ctx))
    # a writer killed after writing half its temp file (no rename happened)
    leftover = path.with_name(f".{path.name}.999-dead.tmp")
    leftover.write_bytes(encode(ctx.state, identity(ctx))[:40])
    restarted = node(tmp_path)
    assert restore(restarted)
    np.testing.assert_array_equal(restarted.state["personal"].to_numpy_ndarrays()[0], np.arange(3.0))
    restarted.state["personal"] = ArrayRecord([np.arange(3.0) * 2])
    assert persist(restarted)
    assert not leftover.exists()
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


# --- whose file a node loads ----------------------------------------------------------------


def saved(tmp_path, **kwargs) -> Context:
    ctx = node(tmp_path, **kwargs)
    ctx.state["personal"] = ArrayRecord([np.arange(5.0)])
    assert persist(ctx)
    return ctx


def test_runs_and_partitions_have_their_own_files(tmp_path):
    saved(tmp_path, run_id=7, partition=2)
    assert not restore(node(tmp_path, run_id=7, partition=1))  # another partition
    assert not restore(node(tmp_path, run_id=7, partition=2, **{"run-name": "other"}))  # another run
    assert restore(node(tmp_path, run_id=7, partition=2))
    files = sorted(p.relative_to(tmp_path / "state").as_posix() for p in (tmp_path / "state").rglob("*") if p.is_file())
    assert files == ["exp/partition-2.state"]


def test_an_unnamed_run_is_keyed_by_flowers_run_id(tmp_path):
    saved(tmp_path, run_id=7, **{"run-name": ""})
    assert (tmp_path / "state" / "flower-run-7" / "partition-2.state").exists()
    assert not restore(node(tmp_path, run_id=8, **{"run-name": ""}))
    assert restore(node(tmp_path, run_id=7, **{"run-name": ""}))


def test_a_new_run_under_the_same_name_starts_afresh(tmp_path, caplog):
    saved(tmp_path, run_id=7)
    fresh = node(tmp_path, run_id=8)  # resume=false: a new run that reuses the name
    with caplog.at_level(logging.INFO, logger="flwr"):
        assert not restore(fresh)
    assert len(fresh.state) == 0
    assert "from an earlier run (Flower run 7)" in caplog.text
    fresh.state["personal"] = ArrayRecord([np.zeros(5)])
    assert persist(fresh)  # its own state replaces the old one
    assert decode(state_path(tmp_path / "state", identity(fresh)).read_bytes())[0]["flower-run-id"] == 8


def test_a_resumed_run_continues_the_state_of_its_name(tmp_path):
    saved(tmp_path, run_id=7)
    # a resume may change the round count and output settings: Flower gives it a new run id
    resumed = node(tmp_path, run_id=9, resume=True, **{"num-server-rounds": 6, "output-dir": "/elsewhere"})
    assert restore(resumed)
    np.testing.assert_array_equal(resumed.state["personal"].to_numpy_ndarrays()[0], np.arange(5.0))


def test_a_resume_with_another_configuration_starts_afresh(tmp_path, caplog):
    saved(tmp_path, run_id=7)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        assert not restore(node(tmp_path, run_id=9, resume=True, **{"learning-rate": 0.5}))
    assert "written under another configuration" in caplog.text


# --- files that are refused -----------------------------------------------------------------


def craft(ident, body: bytes, **header_changes) -> bytes:
    """A file with a consistent header (length and SHA-256 of ``body``), as an attacker would make."""
    header = {"format": 1, **ident.header(), "body-bytes": len(body), "body-sha256": hashlib.sha256(body).hexdigest()}
    raw = json.dumps(header | header_changes).encode()
    return MAGIC + len(raw).to_bytes(8, "big") + raw + body


def pickled_array_body() -> bytes:
    """A state whose one 'array' is a pickled object array (np.save with allow_pickle=True)."""
    buffer = io.BytesIO()
    np.save(buffer, np.array([{"evil": 1}], dtype=object), allow_pickle=True)
    record = ArrayRecord({"x": Array(dtype="object", shape=(1,), stype="numpy.ndarray", data=buffer.getvalue())})
    return node_state.encode_body(RecordDict({"personal": record}))


def mislabelled_array_body() -> bytes:
    """A float32 array that declares itself float64 of another shape."""
    real = Array(np.zeros((2, 3), dtype=np.float32))
    record = ArrayRecord({"x": Array(dtype="float64", shape=(6,), stype=real.stype, data=real.data)})
    return node_state.encode_body(RecordDict({"personal": record}))


CRAFTED = {
    "not ours": lambda ident, good: b"PK\x03\x04 some zip file",
    "empty": lambda ident, good: b"",
    "truncated": lambda ident, good: good[:-10],
    "one byte flipped": lambda ident, good: good[:-1] + bytes([good[-1] ^ 1]),
    "huge header length": lambda ident, good: MAGIC + (2**40).to_bytes(8, "big") + b"{}",
    "header not json": lambda ident, good: MAGIC + (5).to_bytes(8, "big") + b"{{{{{",
    "future format": lambda ident, good: craft(ident, b"", format=99),
    "body not protobuf": lambda ident, good: craft(ident, b"\xff\xff\xff\xff garbage"),
    "pickled object array": lambda ident, good: craft(ident, pickled_array_body()),
    "array with a false dtype": lambda ident, good: craft(ident, mislabelled_array_body()),
    "another partition's file": lambda ident, good: craft(ident, node_state.encode_body(RecordDict({"p": ArrayRecord([np.ones(1)])})), **{"partition-id": 1}),
}


@pytest.mark.parametrize("case", CRAFTED)
def test_a_bad_or_crafted_file_is_refused_and_the_node_starts_afresh(tmp_path, caplog, case):
    ctx = saved(tmp_path)
    ident = identity(ctx)
    path = state_path(tmp_path / "state", ident)
    bad = CRAFTED[case](ident, path.read_bytes())
    path.write_bytes(bad)
    with pytest.raises(StateFileError):
        decode(bad) if case != "another partition's file" else node_state._check_owner(decode(bad)[0], ident)
    restarted = node(tmp_path)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        assert not restore(restarted)
    assert len(restarted.state) == 0
    assert f"refused the node state file {path}" in caplog.text and "starts afresh" in caplog.text
    assert not path.exists() and path.with_name(path.name + ".rejected").read_bytes() == bad
    restarted.state["personal"] = ArrayRecord([np.ones(2)])
    assert persist(restarted) and restore(node(tmp_path))  # the node's new state is written and read again


def test_decode_accepts_what_encode_writes(tmp_path):
    ctx = node(tmp_path)
    header, state = decode(encode(every_kind(), identity(ctx)))
    assert header["partition-id"] == 2 and header["run-name"] == "exp" and header["flower-run-id"] == 7
    assert_same(every_kind(), state)
    assert os.path.basename(state_path(tmp_path, identity(ctx))) == "partition-2.state"


def test_a_state_that_cannot_be_written_is_a_warning_not_a_failed_message(tmp_path, caplog, monkeypatch):
    ctx = node(tmp_path)

    def full(path, blob):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(node_state, "write_atomic", full)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        with persisted(ctx):
            ctx.state["personal"] = ArrayRecord([np.ones(2)])
    assert "could not write the node state" in caplog.text and "No space left" in caplog.text
    assert "personal" in ctx.state


def test_another_runs_file_is_not_read_past_its_header(tmp_path, monkeypatch):
    saved(tmp_path, run_id=7)
    monkeypatch.setattr(node_state, "decode", lambda blob: pytest.fail("the body of another run's file was read"))
    assert not restore(node(tmp_path, run_id=8))


# ------------------------------------------------------------------------------ versions by round
def at_round(context: Context, server_round: int, value: float) -> None:
    """A message of ``server_round`` that sets the node's state to ``value``."""
    context.state[node_state.ROUND_KEY] = ConfigRecord({"round": server_round})
    context.state["personal"] = ArrayRecord([np.full(3, value, np.float32)])
    assert persist(context)


def kept_rounds(tmp_path, partition=2) -> list[int]:
    ident = identity(node(tmp_path, partition=partition))
    return sorted(node_state.snapshots(tmp_path / "state", ident))


def test_a_later_rounds_file_keeps_the_previous_rounds_and_prunes_what_no_resume_needs(tmp_path):
    ctx = node(tmp_path, **{"checkpoint-interval": 2})
    for r in (1, 2, 3, 4, 5):
        at_round(ctx, r, float(r))
    # latest 5, interval 2: rounds after 3 (4) and the newest at or before 3 (3); 1 and 2 pruned
    assert kept_rounds(tmp_path) == [3, 4]
    ident = identity(ctx)
    header, state = decode(node_state.snapshot_path(tmp_path / "state", ident, 4).read_bytes())
    assert header["round"] == 4 and state["personal"].to_numpy_ndarrays()[0].tolist() == [4.0] * 3
    assert decode(state_path(tmp_path / "state", ident).read_bytes())[0]["round"] == 5
    at_round(ctx, 5, 5.5)  # a second message of the same round replaces the file, keeps no version
    assert kept_rounds(tmp_path) == [3, 4]


def resumed_node(tmp_path) -> Context:
    """A node of a resumed run (a new Flower run, resume=true), restored from the file."""
    ctx = node(tmp_path, run_id=8, resume=True)
    assert restore(ctx)
    return ctx


def test_a_resumed_node_ahead_of_the_run_rolls_back_to_the_round_before(tmp_path, caplog):
    ctx = node(tmp_path)
    for r in (1, 2, 3):
        at_round(ctx, r, float(r))
    ahead = resumed_node(tmp_path)
    assert ahead.state[RESTORED_KEY]["file-round"] == 3 and ahead.state[RESTORED_KEY]["resumed"] == 1
    with caplog.at_level(logging.WARNING):
        assert node_state.roll_back(ahead, 3)
    assert ahead.state["personal"].to_numpy_ndarrays()[0].tolist() == [2.0] * 3
    assert "its state is from round 3, but this resumed run goes on with round 3: rolled back to its state after round 2" in caplog.text
    assert not node_state.roll_back(ahead, 3)  # once
    in_step = resumed_node(tmp_path)
    assert not node_state.roll_back(in_step, 4)  # the run goes on with round 4: the file is not ahead
    assert in_step.state["personal"].to_numpy_ndarrays()[0].tolist() == [3.0] * 3


def test_a_node_restarted_within_its_run_continues_from_its_latest_file(tmp_path):
    ctx = node(tmp_path)
    for r in (1, 2):
        at_round(ctx, r, float(r))
    again = node(tmp_path)  # the same Flower run
    assert restore(again) and again.state[RESTORED_KEY]["resumed"] == 0
    assert not node_state.roll_back(again, 2)
    assert again.state["personal"].to_numpy_ndarrays()[0].tolist() == [2.0] * 2 + [2.0]


def test_with_no_earlier_round_kept_the_node_starts_afresh_and_a_damaged_one_is_refused(tmp_path, caplog):
    ctx = node(tmp_path)
    at_round(ctx, 1, 1.0)
    first = resumed_node(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert node_state.roll_back(first, 1)
    assert len(first.state) == 0 and "no state of an earlier round is kept: it starts afresh" in caplog.text
    for r in (2, 3):
        at_round(ctx, r, float(r))
    ident = identity(ctx)
    damaged = node_state.snapshot_path(tmp_path / "state", ident, 2)
    damaged.write_bytes(damaged.read_bytes()[:-3])
    ahead = resumed_node(tmp_path)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert node_state.roll_back(ahead, 3)
    assert "refused the node state file" in caplog.text and len(ahead.state) == 0  # round 1 was pruned


def test_the_round_header_is_checked(tmp_path):
    ctx = node(tmp_path)
    at_round(ctx, 4, 1.0)
    blob = state_path(tmp_path / "state", identity(ctx)).read_bytes()
    assert decode(blob)[0]["round"] == 4
    untagged = node(tmp_path, partition=3)
    untagged.state["personal"] = ArrayRecord([np.zeros(2, np.float32)])
    persist(untagged)
    assert decode(state_path(tmp_path / "state", identity(untagged)).read_bytes())[0]["round"] == -1
    ident = identity(ctx)
    for bad in ("4", -2, True):
        forged = node_state.encode(ctx.state, ident).replace(b'"round": 4', f'"round": {json.dumps(bad)}'.encode())
        body = forged.split(node_state.MAGIC, 1)[1]
        with pytest.raises(StateFileError):
            decode(node_state.MAGIC + body)


def test_the_mod_notes_the_messages_round_and_rolls_back_only_with_a_state_dir(tmp_path):
    from types import SimpleNamespace

    def message(config: dict) -> SimpleNamespace:  # what the mod reads of a Message: its content
        return SimpleNamespace(content=RecordDict({"fitins.config": ConfigRecord(config)}))

    assert node_state.message_round(message({"server-round": 3, "lr": 0.1})) == 3
    assert node_state.message_round(message({"lr": 0.1})) is None
    assert node_state.message_round(message({"server-round": True})) is None
    seen = []
    without = node(tmp_path, state_dir=False)
    node_state.rounds_mod(message({"server-round": 3}), without, lambda m, c: seen.append(dict(c.state)) or m)
    assert seen == [{}]  # nothing noted in memory-only nodes
    ctx = node(tmp_path)
    for r in (1, 2, 3):
        at_round(ctx, r, float(r))
    ahead = resumed_node(tmp_path)
    node_state.rounds_mod(message({"server-round": 3}), ahead, lambda m, c: m)
    assert ahead.state["personal"].to_numpy_ndarrays()[0].tolist() == [2.0] * 3
    assert ahead.state[node_state.ROUND_KEY]["round"] == 3


# ------------------------------------------------------------------------------ signed files
def keyed(tmp_path, key: bytes = b"k" * 32, **kwargs) -> Context:
    ctx = node(tmp_path, **kwargs)
    (tmp_path / "state.key").write_bytes(key + b"\n")
    ctx.node_config["state-key-file"] = str(tmp_path / "state.key")
    return ctx


def test_a_node_with_a_key_signs_its_files_and_reads_them_back(tmp_path):
    ctx = keyed(tmp_path)
    ctx.state["personal"] = ArrayRecord([np.arange(3, dtype=np.float32)])
    assert persist(ctx)
    header, _ = decode(state_path(tmp_path / "state", identity(ctx)).read_bytes(), b"k" * 32)
    assert len(header["hmac-sha256"]) == 64
    again = keyed(tmp_path)
    assert restore(again) and again.state["personal"].to_numpy_ndarrays()[0].tolist() == [0.0, 1.0, 2.0]


def test_a_file_re_signed_with_fresh_digests_but_without_the_key_is_refused(tmp_path, caplog):
    ctx = keyed(tmp_path)
    ctx.state["personal"] = ArrayRecord([np.zeros(3, np.float32)])
    persist(ctx)
    path = state_path(tmp_path / "state", identity(ctx))
    forged = RecordDict({"personal": ArrayRecord([np.full(3, 9.0, np.float32)])})
    path.write_bytes(encode(forged, identity(ctx)))  # valid SHA-256 digests, no signature
    with caplog.at_level(logging.WARNING):
        assert not restore(keyed(tmp_path))
    assert "not signed with this node's key (state-key-file)" in caplog.text
    wrong = node(tmp_path)
    wrong.state["personal"] = ArrayRecord([np.zeros(3, np.float32)])
    path.write_bytes(encode(wrong.state, identity(wrong), key=b"another key of 32 bytes........"))
    assert not restore(keyed(tmp_path))
    unsigned_reader = node(tmp_path)  # without a key, signed files are read (nothing to check them with)
    path.write_bytes(encode(wrong.state, identity(wrong), key=b"k" * 32))
    assert restore(unsigned_reader)


def test_setting_a_key_later_rewrites_the_unchanged_state_signed(tmp_path):
    plain = node(tmp_path)
    plain.state["personal"] = ArrayRecord([np.zeros(3, np.float32)])
    assert persist(plain) and not persist(plain)
    signed = keyed(tmp_path)
    signed.state["personal"] = ArrayRecord([np.zeros(3, np.float32)])
    assert persist(signed)
    assert "hmac-sha256" in node_state.read_header(state_path(tmp_path / "state", identity(signed)))


@pytest.mark.parametrize("content, message", [(b"short", "has 5 bytes; use at least 16"), (None, "cannot read the key file")])
def test_a_short_or_missing_key_is_a_config_error(tmp_path, content, message):
    ctx = node(tmp_path)
    if content is not None:
        (tmp_path / "k").write_bytes(content)
    ctx.node_config["state-key-file"] = str(tmp_path / "k")
    ctx.state["personal"] = ArrayRecord([np.zeros(3, np.float32)])
    with pytest.raises(ConfigError, match=message):
        persist(ctx)


def test_read_key_takes_sixteen_bytes_and_names_the_setting_when_it_is_no_path(tmp_path):
    from flwr_pfl.app.signing import read_key

    (tmp_path / "k16").write_bytes(b"0123456789abcdef\n")
    assert read_key(str(tmp_path / "k16"), "x") == b"0123456789abcdef"  # exactly the least length
    (tmp_path / "k15").write_bytes(b"0123456789abcde")
    with pytest.raises(ConfigError, match="has 15 bytes; use at least 16"):
        read_key(str(tmp_path / "k15"), "x")
    assert read_key("", "x") is None and read_key(None, "x") is None
    with pytest.raises(ConfigError, match="^node config state-key-file=5 must be the path of a key file"):
        read_key(5, "node config state-key-file")
