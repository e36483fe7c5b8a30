"""The app with ``api="message"`` under the real `flwr run .` (the launcher): it finishes,
writes its results and model, and gives the NumPyClient flavour's in-process numbers."""

from __future__ import annotations

import json

import pytest

from app.test_engines import REPO_ROOT, launch, partial


@pytest.mark.slow
def test_flwr_run_message_flavour_gives_the_numpyclient_numbers(tmp_path, data_dir):
    from flwr.common.config import get_fused_config_from_dir

    from flwr_pfl.app.client_app import app as client_app
    from flwr_pfl.app.inprocess import run_inprocess
    from flwr_pfl.app.server_app import app as server_app

    cfg = partial(data_dir, tmp_path, "message", "fedrep") | {"api": "message"}
    result = launch(tmp_path, cfg)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "run status: finished:completed" in result.stdout
    out = tmp_path / "message"
    for name in ("config.json", "metrics.json", "clients.json", "model.pt", "summary.txt"):
        assert (out / name).exists(), name
    assert json.loads((out / "config.json").read_text())["api"] == "message"
    legacy = partial(data_dir, tmp_path, "legacy", "fedrep") | {"api": "numpyclient"}
    run_inprocess(server_app, client_app, 6, dict(get_fused_config_from_dir(REPO_ROOT, legacy)))
    for name in ("metrics.json", "clients.json"):
        assert (out / name).read_bytes() == (tmp_path / "legacy" / name).read_bytes(), name
