"""server-workers: how many clients the server contacts at once."""

from __future__ import annotations

import flwr.server.server as legacy
import pytest

from flwr_pfl.app.client_app import app as client_app
from flwr_pfl.app.config import parse_experiment
from flwr_pfl.app.inprocess import run_inprocess
from flwr_pfl.app.server_app import app as server_app
from flwr_pfl.app.server_app import build_strategy, server_workers
from flwr_pfl.errors import ConfigError


class ThreadedGrid:
    """A grid that says nothing about concurrency (as Flower's own grids)."""


def test_up_to_32_clients_at_once_by_default_one_in_process_or_as_set():
    experiment = parse_experiment({"num-clients": 40})
    assert server_workers(experiment, ThreadedGrid()) == 32
    assert server_workers(parse_experiment({"num-clients": 5})) == 5

    class OneAtATime:
        max_concurrent_clients = 1

    assert server_workers(experiment, OneAtATime()) == 1
    assert server_workers(parse_experiment({"num-clients": 40, "server-workers": 7}), OneAtATime()) == 7
    strategy = build_strategy(parse_experiment({"num-clients": 40, "server-workers": 7}))
    assert strategy.max_workers == 7 and strategy.workers_for(3) == 3 and strategy.workers_for(100) == 7
    with pytest.raises(ConfigError, match="server-workers"):
        parse_experiment({"server-workers": -1})


def test_the_legacy_server_pool_gets_the_setting(tmp_path, blobs_dataset, monkeypatch):
    seen = []
    original = legacy.fit_clients

    def recording(client_instructions, max_workers, timeout, group_id):
        seen.append(max_workers)
        return original(client_instructions, max_workers, timeout, group_id)

    monkeypatch.setattr(legacy, "fit_clients", recording)
    cfg = {"dataset": blobs_dataset, "model": "mlp", "num-clients": 3, "num-server-rounds": 1,
           "output-dir": str(tmp_path), "run-name": "run"}
    run_inprocess(server_app, client_app, 3, cfg)
    run_inprocess(server_app, client_app, 3, cfg | {"server-workers": 2, "run-name": "run-2"})
    assert seen == [1, 2]
