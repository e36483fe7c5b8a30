"""Checkpoints and resume in the Message-API flavour: a message-flavour run killed and resumed
ends exactly where an uninterrupted NumPyClient-flavour run ends (and a resume may switch the
flavour: ``api`` is among the keys a resume may change)."""

from __future__ import annotations

import pytest

from app.test_resume import check_killed_and_resumed, dataset  # noqa: F401 - a fixture

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
    check_killed_and_resumed(tmp_path, dataset, monkeypatch, algorithm, fraction, keep_nodes, kill_round, where, interval,
                             killed={"api": killed_api}, resumed={"api": resumed_api})
