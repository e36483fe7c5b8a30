"""Checkpoints and run directories that cannot be misused: atomic writes, no unpickling, refused
configuration changes, no overwritten runs, no run outside ``output-dir``, and a summary that
says why when every client fails."""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, RecordDict

from fakes import Killed
import flwr_pfl.app.checkpoint as checkpoint_module
from flwr_pfl.app.checkpoint import CHECKPOINT_NAME, encode_state, read_checkpoint, write_checkpoint
from flwr_pfl.app.client_app import app as client_app
from flwr_pfl.app.config import parse_experiment
from flwr_pfl.app.inprocess import InProcessGrid, run_inprocess
from flwr_pfl.app.results import METRICS_LOG, ResultsWriter, RunFailed
from flwr_pfl.app.server_app import app as server_app
from flwr_pfl.errors import ConfigError


def config(tmp_path, dataset, **overrides) -> dict:
    base = {
        "dataset": dataset, "model": "mlp", "num-clients": 4, "num-server-rounds": 3, "learning-rate": 0.1,
        "partitioner": "iid", "test-fraction": 0.25, "output-dir": str(tmp_path), "run-name": "run",
    }
    return base | overrides


def run(cfg: dict) -> InProcessGrid:
    return run_inprocess(server_app, client_app, cfg["num-clients"], cfg)


# ------------------------------------------------------------------------------ encoding
def test_state_round_trips_with_key_types_order_and_values(tmp_path):
    state = {
        "global_arrays": [np.arange(6, dtype=np.float32).reshape(2, 3), np.array([1.5])],
        "arrays": {"big": np.ones((3, 2), dtype=np.float16)},
        "count_table": {3: np.array([1.0, 2.0]), 0: np.array([4.0, 0.0])},  # int keys, not sorted
        "nested": {"a": [1, 2.5, None, True, "x", float("nan"), float("inf")], "b": (np.float64(0.1), np.int64(7))},
        "raw": b"\x00\xff",
        "warned": {"large", "few"},
        "__odd": {"__array__": "not an array"},
    }
    write_checkpoint(tmp_path, 4, {"seed": 1}, {"metric_rows": 0}, state)
    ck = read_checkpoint(tmp_path / CHECKPOINT_NAME)
    assert ck.rounds_done == 4 and ck.config == {"seed": 1}
    got = ck.state
    assert [a.dtype for a in got["global_arrays"]] == [np.float32, np.float64]
    np.testing.assert_array_equal(got["global_arrays"][0], state["global_arrays"][0])
    assert got["arrays"]["big"].dtype == np.float16
    assert list(got["count_table"]) == [3, 0]  # the int keys, in insertion order
    np.testing.assert_array_equal(got["count_table"][3], [1.0, 2.0])
    a = got["nested"]["a"]
    assert a[:5] == [1, 2.5, None, True, "x"] and math.isnan(a[5]) and a[6] == math.inf
    assert got["nested"]["b"] == [0.1, 7] and type(got["nested"]["b"][1]) is int
    assert got["raw"] == b"\x00\xff"
    assert got["warned"] == ["few", "large"]
    assert got["__odd"] == {"__array__": "not an array"}
    with np.load(tmp_path / CHECKPOINT_NAME, allow_pickle=False) as npz:  # the documented names
        assert {"rounds_done", "meta", "global_0", "global_1", "state_big"} <= set(npz.files)


def test_object_arrays_are_refused_when_writing(tmp_path):
    with pytest.raises(TypeError, match="dtype object"):
        encode_state({"global_arrays": [], "x": np.array([{"a": 1}], dtype=object)})
    with pytest.raises(TypeError, match="cannot be stored"):
        encode_state({"global_arrays": [], "x": object()})
    assert not (tmp_path / CHECKPOINT_NAME).exists()


class _Payload:
    """Unpickling this creates ``marker``: proof that a load ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_checkpoint_holding_an_object_array_is_refused_without_running_anything(tmp_path, blobs_dataset):
    cfg = config(tmp_path, blobs_dataset, **{"num-server-rounds": 1})
    run(cfg)
    path = tmp_path / "run" / CHECKPOINT_NAME
    marker = tmp_path / "pwned"
    pickle.loads(pickle.dumps(_Payload(marker)))  # the payload works when unpickled ...
    assert marker.exists()
    marker.unlink()
    with np.load(path, allow_pickle=False) as npz:
        entries = {k: npz[k] for k in npz.files}
    entries["global_0"] = np.array([_Payload(marker)], dtype=object)  # ... crafted into the checkpoint
    np.savez(path, **entries)
    with pytest.raises(ConfigError, match="object array"):
        read_checkpoint(path)
    with pytest.raises(ConfigError, match="object array"):
        run(cfg | {"resume": True})
    assert not marker.exists()


def test_an_old_or_foreign_checkpoint_is_refused_clearly(tmp_path):
    np.savez(tmp_path / CHECKPOINT_NAME, rounds_done=np.array(2), global_0=np.zeros(3))
    with pytest.raises(ConfigError, match="older version"):
        read_checkpoint(tmp_path / CHECKPOINT_NAME)
    (tmp_path / CHECKPOINT_NAME).write_bytes(b"not a zip file")
    with pytest.raises(ConfigError, match="cannot be read"):
        read_checkpoint(tmp_path / CHECKPOINT_NAME)


# ------------------------------------------------------------------------------ atomic writes
def test_a_failure_while_writing_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    write_checkpoint(tmp_path, 1, {}, {"metric_rows": 2}, {"global_arrays": [np.ones(4)]})
    real_savez = np.savez

    def savez_then_fail(file, **arrays):
        real_savez(file, **{k: v for k, v in list(arrays.items())[:1]})  # some bytes reach the disk
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_module.np, "savez", savez_then_fail)
    with pytest.raises(OSError, match="disk full"):
        write_checkpoint(tmp_path, 2, {}, {"metric_rows": 4}, {"global_arrays": [np.zeros(4)]})
    ck = read_checkpoint(tmp_path / CHECKPOINT_NAME)
    assert ck.rounds_done == 1 and ck.results == {"metric_rows": 2}
    np.testing.assert_array_equal(ck.state["global_arrays"][0], np.ones(4))
    assert sorted(p.name for p in tmp_path.iterdir()) == [CHECKPOINT_NAME]  # no temporary left


def test_a_run_killed_while_writing_its_checkpoint_resumes_from_the_previous_one(tmp_path, blobs_dataset, monkeypatch):
    straight = config(tmp_path, blobs_dataset, **{"run-name": "straight", "num-server-rounds": 4, "fraction-fit": 0.5})
    run(straight)
    cfg = straight | {"run-name": "killed"}
    real_savez = np.savez

    def killed_on_round_3(file, **arrays):
        if int(arrays["rounds_done"]) == 3:
            real_savez(file, rounds_done=arrays["rounds_done"])  # half a file, then the kill
            raise Killed()
        real_savez(file, **arrays)

    with monkeypatch.context() as m:
        m.setattr(checkpoint_module.np, "savez", killed_on_round_3)
        with pytest.raises(Killed):
            run(cfg)
    out = tmp_path / "killed"
    assert read_checkpoint(out / CHECKPOINT_NAME).rounds_done == 2
    (out / ".checkpoint-left-by-a-kill.tmp").write_bytes(b"partial")  # what SIGKILL would leave
    run(cfg | {"resume": True})
    assert not list(out.glob(".checkpoint-*.tmp"))
    for name in ("metrics.json", "clients.json"):
        assert (out / name).read_bytes() == (tmp_path / "straight" / name).read_bytes(), name


def test_checkpoints_follow_the_interval_and_the_last_round(tmp_path, blobs_dataset, monkeypatch):
    written = []
    real = checkpoint_module.write_checkpoint

    def record(directory, rounds_done, *args, **kwargs):
        written.append(rounds_done)
        return real(directory, rounds_done, *args, **kwargs)

    monkeypatch.setattr("flwr_pfl.app.results.write_checkpoint", record)
    run(config(tmp_path, blobs_dataset, **{"num-server-rounds": 5, "checkpoint-interval": 2}))
    assert written == [2, 4, 5]
    written.clear()
    run(config(tmp_path, blobs_dataset, **{"run-name": "r2", "num-server-rounds": 7, "checkpoint-interval": 2,
                                           "resume": False}))
    assert written == [2, 4, 6, 7]


def test_checkpoint_interval_is_validated():
    with pytest.raises(ConfigError, match="checkpoint-interval"):
        parse_experiment({"checkpoint-interval": 0})


# ------------------------------------------------------------------------------ results files
def test_rows_are_appended_per_round_and_exported_at_the_end(tmp_path):
    writer = ResultsWriter(tmp_path, {"algorithm": "fedavg"})
    for r in range(1, 4):
        writer.on_round(r, "fit", {"train_loss_wmean": 0.5 / r, "train_seconds_mean": 0.1}, {})
        writer.on_round(r, "evaluate", {"num_clients": 2.0, "accuracy_wmean": 0.5, "loss_wmean": 1.0 / r,
                                        "accuracy_mean": 0.5, "accuracy_min": 0.4, "accuracy_max": 0.6,
                                        "loss_mean": 1.0, "loss_min": 1.0, "loss_max": 1.0}, {0: {"accuracy": 0.5}})
        lines = (tmp_path / METRICS_LOG).read_text().splitlines()
        assert len(lines) == 2 * r and json.loads(lines[-1])["round"] == r
        assert not (tmp_path / "metrics.json").exists()  # nothing is rewritten per round
    writer.finish()
    rows = json.loads((tmp_path / "metrics.json").read_text())
    assert rows == [json.loads(line) for line in (tmp_path / METRICS_LOG).read_text().splitlines()]
    assert all("train_seconds_mean" not in r for r in rows)
    timings = json.loads((tmp_path / "timings.json").read_text())
    assert [t["train_seconds_mean"] for t in timings if t["phase"] == "fit"] == [0.1] * 3
    assert (tmp_path / "metrics.csv").read_text().splitlines()[0].startswith("round,phase,")


# ------------------------------------------------------------------------------ refused resumes
def test_a_resume_that_changes_the_configuration_is_refused_naming_the_keys(tmp_path, blobs_dataset):
    cfg = config(tmp_path, blobs_dataset, **{"num-server-rounds": 2})
    run(cfg)
    before = (tmp_path / "run" / "metrics.json").read_bytes()
    with pytest.raises(ConfigError, match=r"differs from the checkpoint's in model \(model: checkpoint 'mlp', now 'linear'\)"):
        run(cfg | {"resume": True, "model": "linear"})
    with pytest.raises(ConfigError, match="learning-rate, seed"):
        run(cfg | {"resume": True, "learning-rate": 0.2, "seed": 4, "num-server-rounds": 3})
    with pytest.raises(ConfigError, match="num-server-rounds=1 but the checkpoint has 2 rounds done"):
        run(cfg | {"resume": True, "num-server-rounds": 1})
    assert (tmp_path / "run" / "metrics.json").read_bytes() == before  # nothing was touched


def test_an_existing_run_is_not_overwritten_without_resume(tmp_path, blobs_dataset):
    cfg = config(tmp_path, blobs_dataset, **{"num-server-rounds": 1})
    run(cfg)
    before = {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir()}
    with pytest.raises(ConfigError, match="already holds a run's results; set resume=true"):
        run(cfg | {"learning-rate": 0.3})
    assert {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir()} == before


def test_unnamed_runs_get_their_own_directories(tmp_path, blobs_dataset, monkeypatch):
    from flwr_pfl.app.config import Experiment

    monkeypatch.setattr(Experiment, "output_path", lambda self: tmp_path / "fedavg-default")  # one clock second
    cfg = config(tmp_path, blobs_dataset, **{"num-server-rounds": 1, "run-name": ""})
    run(cfg)
    run(cfg)
    run(cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fedavg-default", "fedavg-default-2", "fedavg-default-3"]


@pytest.mark.parametrize("name", ["../../x", "..", ".", "a/b", "/abs/x", "a\\b"])
def test_a_run_name_that_leaves_output_dir_is_refused(tmp_path, name):
    with pytest.raises(ConfigError, match="run-name=.* must be a plain directory name inside output-dir"):
        parse_experiment({"output-dir": str(tmp_path), "run-name": name})


def test_resume_needs_a_run_name(tmp_path):
    with pytest.raises(ConfigError, match="resume=true needs run-name"):
        parse_experiment({"output-dir": str(tmp_path), "resume": True})


# ------------------------------------------------------------------------------ every client fails
def test_when_every_client_fails_the_summary_says_why(tmp_path, blobs_dataset, monkeypatch):
    from flwr_pfl.clients import FedAvgClient

    def broken(self, *args):
        raise RuntimeError("the data on this node is corrupt")

    monkeypatch.setattr(FedAvgClient, "fit", broken)
    monkeypatch.setattr(FedAvgClient, "evaluate", broken)
    with pytest.raises(RunFailed):  # no round trained: the run ends as failed, its summary written
        run(config(tmp_path, blobs_dataset, **{"num-server-rounds": 2}))
    summary = (tmp_path / "run" / "summary.txt").read_text()
    assert summary.startswith("FAILED: rounds 1-2 (of 2) trained nothing")
    assert "no evaluation round completed" in summary
    assert "every client's evaluation failed" in summary
    assert "4 of 4 failed" in summary and "the data on this node is corrupt" in summary
    assert not (tmp_path / "run" / "learning_curves.png").exists()
    rows = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert [r["num_failures"] for r in rows] == [4.0] * 4


def test_when_no_client_can_start_the_summary_says_why(tmp_path, blobs_dataset, monkeypatch):
    from flwr_pfl.app import client_app as client_app_module

    def no_client(context):
        raise RuntimeError("no data on this node")

    monkeypatch.setattr(client_app_module, "build_client", no_client)
    grid = InProcessGrid(client_app, 4, config(tmp_path, blobs_dataset))
    with pytest.raises(Exception):
        cfg = config(tmp_path, blobs_dataset)
        server_app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=cfg))
    summary = (tmp_path / "run" / "summary.txt").read_text()
    assert "the run stopped" in summary and "no data on this node" in summary


def test_a_checkpoint_from_before_a_new_run_key_resumes_while_the_key_is_at_its_default(tmp_path, blobs_dataset):
    """An upgrade that adds a run key (off by default) does not strand runs checkpointed before it;
    setting the new key to anything else is still a change."""
    from flwr_pfl.app.checkpoint import Checkpoint, changed_keys
    from flwr_pfl.app.server_app import check_resumable

    cfg = config(tmp_path, blobs_dataset, **{"num-server-rounds": 2})
    current = parse_experiment(cfg).to_dict()
    assert current["noise-free-test"] is False and current["noise-clip"] is True
    older = {k: v for k, v in current.items() if k not in ("noise-free-test", "noise-clip")}  # written before the keys existed
    check_resumable(parse_experiment(cfg | {"resume": True}), Checkpoint(2, older, {}, {}))  # no error
    with pytest.raises(ConfigError, match=r"noise-clip \(noise-clip: checkpoint \(absent\), now False\)"):
        check_resumable(parse_experiment(cfg | {"resume": True, "noise-clip": False}), Checkpoint(2, older, {}, {}))
    # either side may lack the key; a key the app does not know is always a change
    assert changed_keys({"seed": 1}, {"seed": 1, "noise-std": 0.3}) == []
    assert changed_keys({"seed": 1, "noise-std": 0.5}, {"seed": 1}) == ["noise-std"]
    assert changed_keys({"seed": 1, "retired-key": 0}, {"seed": 2}) == ["retired-key", "seed"]
    assert changed_keys({"seed": 1, "resume": False}, {"seed": 1, "resume": True}, ignore={"resume"}) == []


def test_another_algorithms_options_are_no_change_of_a_run():
    """A run reads only its own algorithm's options: FMTL's t1-rounds default moving (100 -> -1)
    does not strand a FEDORA run; FEDORA's own options, and any option when the algorithm
    itself changed, still count."""
    from flwr_pfl.app.checkpoint import changed_keys

    fedora = {"algorithm": "fedora", "fmtl.t1-rounds": 100, "fedora.p": 1, "seed": 0}
    assert changed_keys(fedora, fedora | {"fmtl.t1-rounds": -1, "fedrep.head-epochs": 9}) == []
    assert changed_keys(fedora, fedora | {"fedora.p": 2}) == ["fedora.p"]
    assert changed_keys(fedora, fedora | {"algorithm": "fmtl", "fmtl.t1-rounds": -1}) == ["algorithm", "fmtl.t1-rounds"]
    feddar = {"algorithm": "feddar-wa", "feddar.head-epochs": 5, "fmtl.t1-rounds": 100}  # a variant reads its family's section
    assert changed_keys(feddar, feddar | {"feddar.head-epochs": 1, "fmtl.t1-rounds": -1}) == ["feddar.head-epochs"]
    assert changed_keys({"algorithm": "gone", "x.y": 1}, {"algorithm": "gone", "x.y": 2}) == ["x.y"]


# ------------------------------------------------------------------------------ signed checkpoints
KEY, OTHER = b"a server key of 32 bytes .......", b"another key of 32 bytes ........"


def signed(tmp_path, key=KEY) -> Path:
    state = {"global_arrays": [np.arange(4, dtype=np.float32)], "round_offset": 2, "partition_of": {"7": 1}}
    return write_checkpoint(tmp_path, 2, {"algorithm": "fedavg"}, {"rows": 4}, state, key=key)


def test_a_signed_checkpoint_is_read_with_its_key_and_refused_with_another_or_none(tmp_path):
    path = signed(tmp_path)
    assert read_checkpoint(path, KEY).rounds_done == 2
    assert read_checkpoint(path).rounds_done == 2  # without a key nothing is checked
    with pytest.raises(ConfigError, match="not signed with this server's key \\(checkpoint-key-file\\)"):
        read_checkpoint(path, OTHER)
    (tmp_path / "plain").mkdir()
    unsigned = signed(tmp_path / "plain", key=None)
    with pytest.raises(ConfigError, match="not signed with this server's key"):
        read_checkpoint(unsigned, KEY)


@pytest.mark.parametrize("entry", ["global_0", "global_0 reshaped", "rounds_done", "meta"])
def test_an_altered_entry_of_a_signed_checkpoint_is_refused(tmp_path, entry):
    path = signed(tmp_path)
    with np.load(path, allow_pickle=False) as npz:
        entries = {name: npz[name].copy() for name in npz.files}
    if entry == "meta":
        entries[entry] = np.frombuffer(entries[entry].tobytes().replace(b'"rows": 4', b'"rows": 5'), np.uint8)
    elif entry == "global_0 reshaped":
        entries["global_0"] = entries["global_0"].reshape(2, 2)  # the same bytes and dtype, another shape
    else:
        entries[entry] = entries[entry] + 1
    with path.open("wb") as f:
        np.savez(f, **entries)  # the signature entry kept as it was
    read_checkpoint(path)  # well-formed: only the key tells
    with pytest.raises(ConfigError, match="not signed with this server's key"):
        read_checkpoint(path, KEY)


def test_a_run_with_a_key_signs_its_checkpoints_and_its_resume_refuses_a_foreign_one(tmp_path, blobs_dataset):
    (tmp_path / "server.key").write_bytes(KEY)
    cfg = config(tmp_path, blobs_dataset, **{"num-server-rounds": 2, "checkpoint-key-file": str(tmp_path / "server.key")})
    run(cfg)
    path = tmp_path / "run" / CHECKPOINT_NAME
    assert read_checkpoint(path, KEY).rounds_done == 2
    ours = path.read_bytes()
    foreign = read_checkpoint(path)
    write_checkpoint(tmp_path / "run", foreign.rounds_done, foreign.config, foreign.results, foreign.state)  # unsigned
    with pytest.raises(ConfigError, match="not signed with this server's key"):
        run(cfg | {"resume": True, "num-server-rounds": 3})
    path.write_bytes(ours)
    run(cfg | {"resume": True, "num-server-rounds": 3})
    assert read_checkpoint(path, KEY).rounds_done == 3
    with pytest.raises(ConfigError, match="checkpoint-key-file: the key in .* has 3 bytes"):
        (tmp_path / "short.key").write_bytes(b"abc")
        run(cfg | {"run-name": "short", "checkpoint-key-file": str(tmp_path / "short.key")})


def test_a_state_with_tuple_keys_and_sets_comes_back_as_it_was(tmp_path):
    """Keys that are not strings (a pair of client ids, an integer) are stored as items and come
    back as the same hashable keys; a set comes back as a sorted list."""
    state = {"pairs": {(1, 2): 0.5, 7: "seven"}, "seen": {3, 1, 2}, "global_arrays": [np.ones(2, np.float32)]}
    restored = read_checkpoint(write_checkpoint(tmp_path, 1, {}, {}, state)).state
    assert restored["pairs"] == {(1, 2): 0.5, 7: "seven"} and restored["seen"] == [1, 2, 3]
