"""Checkpoints and resume in the Message-API flavour: a message-flavour run killed and resumed
ends exactly where an uninterrupted NumPyClient-flavour run ends (and a resume may switch the
flavour: ``api`` is among the keys a resume may change)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from app.test_resume import Killed, assert_same, config, dataset, kill_at, new_grid, outcome, serve  # noqa: F401 - a fixture

# (algorithm, fraction-fit, nodes keep their state, kill round, kill point, checkpoint interval, api killed, api resumed)
CASES = [
    ("fedrep", 0.5, True, 3, "end", 1, "message", "message"),
    ("feddar-sa", 0.5, False, 3, "head", 2, "message", "message"),
    ("fedora", 1.0, True, 3, "end", 1, "numpyclient", "message"),
    ("pfedfda", 0.5, True, 3, "fit", 1, "message", "numpyclient"),
]


@pytest.mark.parametrize(("algorithm", "fraction", "keep_nodes", "kill_round", "where", "interval", "killed_api", "resumed_api"), CASES)
def test_message_flavour_killed_and_resumed_equals_uninterrupted(tmp_path, dataset, monkeypatch, algorithm, fraction,  # noqa: F811
                                                                 keep_nodes, kill_round, where, interval, killed_api, resumed_api):
    straight = config(tmp_path, dataset, algorithm, "straight", **{"fraction-fit": fraction})
    serve(new_grid(straight), straight)
    cfg = config(tmp_path, dataset, algorithm, "killed", **{"fraction-fit": fraction, "checkpoint-interval": interval})
    grid = new_grid(cfg)
    with monkeypatch.context() as m:
        kill_at(m, kill_round, where)
        with pytest.raises(Killed):
            serve(grid, cfg | {"api": killed_api})
    checkpointed = kill_round if where == "end" and kill_round % interval == 0 else (kill_round - 1) // interval * interval
    rows = [json.loads(line) for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["round"] == kill_round
    with np.load(tmp_path / "killed" / "checkpoint.npz", allow_pickle=False) as ckpt:
        assert int(ckpt["rounds_done"]) == checkpointed
    serve(grid if keep_nodes else new_grid(cfg), cfg | {"resume": True, "api": resumed_api})
    assert_same(outcome(tmp_path, "straight"), outcome(tmp_path, "killed"))
