"""Per-node settings and a node's own data: the node config is read and checked in one place
(flwr_pfl.app.node_settings), a node trains on its own image folder / .npz / .pt file
(flwr_pfl.data.node_files), and a wrong setting, a duplicate partition or data that does not
fit the other nodes' stops the run at its start naming the node."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from flwr_pfl.app.client_app import app as client_app
from flwr_pfl.app.inprocess import InProcessGrid
from flwr_pfl.app.node_settings import NodeSettings, NodeSettingsError
from flwr_pfl.app.server_app import app as server_app
from flwr_pfl.data.node_files import NodeDataSpec, load_node_data, read_arrays
from flwr_pfl.errors import ConfigError
from flwr.app import Context, RecordDict


def write_images(root: Path, counts: dict[str, int], size=(6, 5), seed=0) -> None:
    """``counts[c]`` RGB images of ``size`` (w, h) under ``root/c/``; class c's red channel is its index * 40."""
    rng = np.random.default_rng(seed)
    for k, (name, n) in enumerate(sorted(counts.items())):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            pixels = rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
            pixels[..., 0] = 40 * k
            Image.fromarray(pixels).save(root / name / f"{i}.png")


def write_npz(path: Path, n: int, num_classes: int = 3, dim: int = 20, seed: int = 0, **extra) -> Path:
    rng = np.random.default_rng(seed)
    y = np.arange(n) % num_classes
    x = (rng.normal(size=(n, dim)) + 3.0 * np.eye(num_classes, dim)[y]).astype(np.float32)
    np.savez(path, x=x, y=y, **extra)
    return path


def _touch(path: str) -> None:
    Path(path).touch()


class Payload:
    """What a pickle-based attack smuggles in: unpickling it would run ``_touch``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (_touch, (str(self.marker),))


def settings(path: Path, **more) -> NodeSettings:
    return NodeSettings.parse({"partition-id": 1, "num-partitions": 2, "data-path": str(path), **more}, node_id=7)


# ---------------------------------------------------------------- node settings
@pytest.mark.parametrize(("config", "message"), [
    ({"num-partitions": 2}, r"node 7 \(partition \?\): the node config lacks partition-id"),
    ({"partition-id": 2, "num-partitions": 2}, r"partition-id=2 must be in \[0, num-partitions=2\)"),
    ({"partition-id": 0, "num-partitions": 0}, "num-partitions=0 must be an integer >= 1"),
    ({"partition-id": 0, "num-partitions": 2, "fedgp-role": "boss"}, "fedgp-role='boss' is not allowed; use 'target' or 'source'"),
    ({"partition-id": 0, "num-partitions": 2, "device": "gpu"}, "device='gpu' is not allowed"),
    ({"partition-id": 0, "num-partitions": 2, "data-pth": "/x"}, "'data-pth' is unknown; did you mean 'data-path'"),
    ({"partition-id": 0, "num-partitions": 2, "data-path": "rel/data.npz"}, "data-path='rel/data.npz' must be an absolute path"),
    ({"partition-id": 0, "num-partitions": 2, "data-path": "/nonexistent/d.npz"}, "/nonexistent/d.npz does not exist"),
    ({"partition-id": 0, "num-partitions": 2, "num-classes": 3}, "num-classes without data-path"),
])
def test_a_wrong_or_missing_node_setting_names_the_node_the_key_and_what_is_allowed(config, message):
    with pytest.raises(NodeSettingsError, match=message):
        NodeSettings.parse(config, node_id=7)


def test_node_settings_are_typed():
    s = NodeSettings.parse({"partition-id": 1, "num-partitions": 3, "fedgp-role": "target", "device": "cpu",
                            "other-software-key": 1})
    assert (s.partition_id, s.num_partitions, s.role, s.device, s.data) == (1, 3, "target", "cpu", None)


# ---------------------------------------------------------------- reading files
def test_an_npz_file_is_read_split_and_counted(tmp_path):
    path = write_npz(tmp_path / "d.npz", 40, num_classes=3, domain=np.arange(40) % 2)
    s = settings(path, **{"data-test-fraction": 0.25, "data-split-seed": 3})
    data = load_node_data(s.data, val_fraction=0.1, test_fraction=0.5, seed=0, who="n")
    assert (len(data.train), len(data.val), len(data.test)) == (26, 4, 10)  # 0.25 of 40 test (not the run's 0.5)
    assert data.input_shape == (20,) and data.num_classes == 3 and data.num_domains == 2
    x = np.load(path)["x"]
    # every sample once, each with its own label and domain
    together = torch.cat([data.train.x, data.val.x, data.test.x])
    order = [int(np.flatnonzero((x == row.numpy()).all(axis=1))[0]) for row in together]
    assert sorted(order) == list(range(40))
    assert torch.equal(torch.cat([data.train.y, data.val.y, data.test.y]), torch.tensor(order) % 3)
    assert torch.equal(torch.cat([data.train.domain, data.val.domain, data.test.domain]), torch.tensor(order) % 2)
    again = load_node_data(s.data, val_fraction=0.1, test_fraction=0.5, seed=0, who="n")
    assert torch.equal(again.train.x, data.train.x)  # seeded split
    other = load_node_data(settings(path, **{"data-split-seed": 4}).data, val_fraction=0.1, test_fraction=0.25, seed=0, who="n")
    assert not torch.equal(other.train.x, data.train.x)


def test_a_torch_file_and_a_separate_test_file(tmp_path):
    x, y = torch.randn(10, 2, 3), torch.tensor([0, 1, 2, 3] * 2 + [0, 1])
    torch.save({"x": x, "y": y}, tmp_path / "train.pt")
    torch.save({"x": x[:4], "y": y[:4]}, tmp_path / "test.pt")
    s = settings(tmp_path / "train.pt", **{"data-test-path": str(tmp_path / "test.pt"), "num-classes": 5})
    data = load_node_data(s.data, val_fraction=0.0, test_fraction=0.5, seed=0, who="n")
    assert len(data.train) == 10 and len(data.test) == 4 and data.num_classes == 5 and data.input_shape == (2, 3)
    assert torch.equal(data.test.x, x[:4]) and torch.equal(data.test.y, y[:4])
    with pytest.raises(ConfigError, match="label 3 but the node config says num-classes=3"):
        load_node_data(settings(tmp_path / "train.pt", **{"num-classes": 3}).data, val_fraction=0.0,
                       test_fraction=0.2, seed=0, who="n")


def test_a_pickle_bearing_file_is_refused_not_unpickled(tmp_path):
    objects = np.empty(3, dtype=object)
    objects[:] = [{"a": 1}, [2], "three"]
    np.savez(tmp_path / "evil.npz", x=np.zeros((3, 2), np.float32), y=objects)
    with pytest.raises(ConfigError, match="cannot be read without unpickling"):
        read_arrays(str(tmp_path / "evil.npz"))
    marker = tmp_path / "executed"
    torch.save({"x": torch.zeros(2, 2), "y": torch.zeros(2, dtype=torch.long), "z": Payload(marker)}, tmp_path / "evil.pt")
    with pytest.raises(ConfigError, match=r"torch.load\(weights_only=True\)"):
        read_arrays(str(tmp_path / "evil.pt"))
    assert not marker.exists()  # refused, never run


def test_array_files_with_missing_or_wrong_arrays_are_refused(tmp_path):
    np.savez(tmp_path / "a.npz", x=np.zeros((3, 2), np.float32))
    with pytest.raises(ConfigError, match="lacks array"):
        read_arrays(str(tmp_path / "a.npz"))
    np.savez(tmp_path / "b.npz", x=np.zeros((3, 2), np.float32), y=np.zeros(3, np.float32))
    with pytest.raises(ConfigError, match="y must be a 1-d array of integer labels"):
        read_arrays(str(tmp_path / "b.npz"))
    np.savez(tmp_path / "c.npz", x=np.zeros((3, 2), np.float32), y=np.zeros(4, np.int64))
    with pytest.raises(ConfigError, match="one entry per sample"):
        read_arrays(str(tmp_path / "c.npz"))


def test_an_image_folder_is_read_with_its_class_folders(tmp_path):
    write_images(tmp_path / "train", {"cat": 3, "dog": 2, "eel": 4})
    write_images(tmp_path / "test", {"cat": 1, "dog": 1, "eel": 1}, seed=1)
    s = settings(tmp_path / "train", **{"data-test-path": str(tmp_path / "test"), "image-size": "4x3"})
    data = load_node_data(s.data, val_fraction=0.0, test_fraction=0.2, seed=0, who="n")
    assert data.input_shape == (3, 4, 3) and data.num_classes == 3 and len(data.train) == 9 and len(data.test) == 3
    assert sorted(data.train.y.tolist()) == [0, 0, 0, 1, 1, 2, 2, 2, 2]
    # class k's red channel is 40 k / 255 (resizing a constant channel keeps it)
    red = data.train.x[:, 0].mean(dim=(1, 2))
    assert torch.allclose(red, data.train.y.float() * 40 / 255, atol=1e-6)
    assert float(data.train.x.max()) <= 1.0
    grey = load_node_data(settings(tmp_path / "train", **{"image-channels": 1}).data, val_fraction=0.0,
                          test_fraction=0.0, seed=0, who="n")
    assert grey.input_shape == (1, 5, 6)


def test_images_of_different_sizes_need_an_image_size(tmp_path):
    write_images(tmp_path / "d", {"a": 1})
    write_images(tmp_path / "e", {"b": 1}, size=(7, 7))
    (tmp_path / "e" / "b" / "0.png").rename(tmp_path / "d" / "a" / "1.png")
    with pytest.raises(ConfigError, match="give the node config image-size=<height>x<width>"):
        load_node_data(settings(tmp_path / "d").data, val_fraction=0.0, test_fraction=0.0, seed=0, who="n")


# ---------------------------------------------------------------- runs
def cfg(tmp_path: Path, **extra) -> dict:
    return {"algorithm": "fedavg", "model": "mlp", "num-server-rounds": 2, "output-dir": str(tmp_path / "out"),
            "run-name": "run", "wait-timeout": 5.0, "local-epochs": 3, "learning-rate": 0.2, "batch-size": 8, "seed": 1, **extra}


def run(tmp_path: Path, node_configs: dict[int, dict], config: dict | None = None) -> InProcessGrid:
    config = config or cfg(tmp_path)
    grid = InProcessGrid(client_app, len(node_configs), config)
    for i, context in enumerate(grid.contexts.values()):
        context.node_config = {"partition-id": i, "num-partitions": len(node_configs), **node_configs[i]}
    server_app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config))
    return grid


def test_a_run_in_which_each_node_trains_on_its_own_files(tmp_path):
    a = write_npz(tmp_path / "a.npz", 30, seed=1)
    b = write_npz(tmp_path / "b.npz", 50, seed=2)
    run(tmp_path, {0: {"data-path": str(a)}, 1: {"data-path": str(b), "data-test-fraction": 0.4}})
    clients = {c["partition_id"]: c for c in json.loads((tmp_path / "out" / "run" / "clients.json").read_text())}
    # 30 * 0.2 (the run's test-fraction) and 50 * 0.4 (the node's) held out; the rest trains
    assert clients[0]["num_examples"] == 6 and clients[1]["num_examples"] == 20
    rows = json.loads((tmp_path / "out" / "run" / "metrics.json").read_text())
    assert [r["participant_ids"] for r in rows if r["phase"] == "evaluate"] == ["0 1", "0 1"]
    assert rows[-1]["accuracy_wmean"] > 0.6  # separable classes: it learns from the nodes' files


def test_image_folder_nodes_with_other_classes_are_refused_at_the_start(tmp_path):
    write_images(tmp_path / "a", {"cat": 2, "dog": 2})
    write_images(tmp_path / "b", {"cat": 2, "eel": 2})
    with pytest.raises(ConfigError, match=r"does not fit one model: node 1000 \(partition 0\): own data, inputs "
                       r"\(3, 5, 6\), 2 classes \['cat', 'dog'\].*node 1001 \(partition 1\): .*\['cat', 'eel'\]"):
        run(tmp_path, {0: {"data-path": str(tmp_path / "a")}, 1: {"data-path": str(tmp_path / "b")}})
    assert not (tmp_path / "out" / "run").exists()


def test_nodes_whose_labels_differ_in_number_are_refused_unless_they_declare_num_classes(tmp_path):
    a = write_npz(tmp_path / "a.npz", 30, num_classes=3)
    b = write_npz(tmp_path / "b.npz", 30, num_classes=2)
    with pytest.raises(ConfigError, match="3 classes.*2 classes.*sets num-classes / num-domains"):
        run(tmp_path, {0: {"data-path": str(a)}, 1: {"data-path": str(b)}})
    run(tmp_path, {0: {"data-path": str(a)}, 1: {"data-path": str(b), "num-classes": 3}})
    assert (tmp_path / "out" / "run" / "summary.txt").exists()


def test_own_data_that_does_not_fit_the_run_datasets_slices_is_refused(tmp_path, blobs_dataset):
    a = write_npz(tmp_path / "a.npz", 30, dim=7)
    with pytest.raises(ConfigError, match=r"node 1000 \(partition 0\): own data, inputs \(7,\).*node 1001 "
                       r"\(partition 1\): the run's dataset, inputs \(20,\), 4 classes"):
        run(tmp_path, {0: {"data-path": str(a)}, 1: {}}, cfg(tmp_path, dataset=blobs_dataset))


def test_a_bad_node_setting_stops_the_run_at_the_start_naming_the_node(tmp_path, blobs_dataset):
    with pytest.raises(ConfigError, match=r"node 1001 \(partition 1\): node config device='tpu' is not allowed"):
        run(tmp_path, {0: {}, 1: {"device": "tpu"}, 2: {}}, cfg(tmp_path, dataset=blobs_dataset))
    assert not (tmp_path / "out" / "run").exists()


def test_two_nodes_with_one_partition_id_are_refused_naming_both(tmp_path, blobs_dataset):
    config = cfg(tmp_path, dataset=blobs_dataset)
    grid = InProcessGrid(client_app, 3, config)
    grid.contexts[1002].node_config["partition-id"] = 0
    with pytest.raises(ConfigError, match="nodes 1000 and 1002 both have partition-id=0"):
        server_app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config))


# ---------------------------------------------------------------- every data setting, named and read
@pytest.fixture()
def npz_file(tmp_path) -> Path:
    path = tmp_path / "d.npz"
    np.savez(path, x=np.zeros((4, 2), np.float32), y=np.zeros(4, np.int64))
    return path


@pytest.mark.parametrize(("more", "message"), [
    ({"data-test-fraction": 1.0}, r"node 7 \(partition 1\): node config data-test-fraction=1.0 must be a number in \[0, 1\)"),
    ({"data-test-fraction": -0.1}, r"node 7 \(partition 1\): node config data-test-fraction=-0.1 must be a number in \[0, 1\)"),
    ({"data-split-seed": -1}, r"node 7 \(partition 1\): node config data-split-seed=-1 must be an integer >= 0"),
    ({"image-size": "28x0"}, r"node 7 \(partition 1\): node config image-size='28x0' must be '<height>x<width>', e.g. '28x28'"),
    ({"image-size": "0x28"}, r"node 7 \(partition 1\): node config image-size='0x28' must be"),
    ({"image-size": "x28"}, r"image-size='x28' must be"),
    ({"image-size": "28x"}, r"image-size='28x' must be"),
    ({"image-size": 28}, r"node 7 \(partition 1\): node config image-size=28 must be a non-empty string"),
    ({"image-channels": 2}, r"node 7 \(partition 1\): node config image-channels=2 must be 1 or 3"),
    ({"image-channels": True}, r"image-channels=True must be 1 or 3"),
    ({"num-classes": -1}, r"node 7 \(partition 1\): node config num-classes=-1 must be an integer >= 0"),
    ({"num-domains": -1}, r"node 7 \(partition 1\): node config num-domains=-1 must be an integer >= 0"),
    ({"num-domains": 1.5}, r"node 7 \(partition 1\): node config num-domains=1.5 must be an integer >= 0"),
])
def test_each_bad_data_setting_names_the_node_the_key_the_value_and_what_is_allowed(npz_file, more, message):
    with pytest.raises(NodeSettingsError, match=message):
        settings(npz_file, **more)


def test_the_data_settings_are_read_as_given(npz_file):
    spec = settings(npz_file, **{"data-test-fraction": 0, "data-split-seed": 0, "num-classes": 0, "num-domains": 0,
                                 "image-size": "28X32", "image-channels": 1}).data
    assert (spec.test_fraction, spec.split_seed, spec.num_classes, spec.num_domains, spec.image_size,
            spec.image_channels) == (0.0, 0, 0, 0, (28, 32), 1)
    assert settings(npz_file, **{"image-size": "1x7"}).data.image_size == (1, 7)  # one pixel high is a size
    assert settings(npz_file, **{"image-size": "7x1"}).data.image_size == (7, 1)
    spec = settings(npz_file, **{"num-classes": 12, "num-domains": 4, "data-split-seed": 5}).data
    assert (spec.num_classes, spec.num_domains, spec.split_seed, spec.test_fraction, spec.image_size,
            spec.image_channels) == (12, 4, 5, None, None, 3)


def test_conflicting_test_data_settings_name_the_node(tmp_path, npz_file):
    other = tmp_path / "t.npz"
    np.savez(other, x=np.zeros((2, 2), np.float32), y=np.zeros(2, np.int64))
    with pytest.raises(NodeSettingsError, match=r"node 7 \(partition 1\): node config data-test-fraction and "
                                                 r"data-test-path exclude each other"):
        settings(npz_file, **{"data-test-path": str(other), "data-test-fraction": 0.2})
    torch.save({"x": torch.zeros(2, 2), "y": torch.zeros(2, dtype=torch.long)}, tmp_path / "t.pt")
    with pytest.raises(NodeSettingsError, match=r"node 7 \(partition 1\): node config data-test-path is a \S+ but "
                                                 r"data-path is a \S+; give both of one kind"):
        settings(npz_file, **{"data-test-path": str(tmp_path / "t.pt")})
    with pytest.raises(NodeSettingsError, match=r"node 7 \(partition 1\): node config data-test-path='rel.npz' must be "
                                                 r"an absolute path \(the ClientApp does not run in the directory the "
                                                 r"SuperNode was started from\)"):
        settings(npz_file, **{"data-test-path": "rel.npz"})


def test_data_settings_without_data_path_are_all_named_with_the_node():
    with pytest.raises(NodeSettingsError, match=r"^node 7 \(partition 0\): node config num-domains, image-size without "
                                                 r"data-path \(this node's own data"):
        NodeSettings.parse({"partition-id": 0, "num-partitions": 2, "num-domains": 2, "image-size": "8x8"}, node_id=7)


def test_typos_name_the_node_and_keys_only_close_to_a_known_one_are_refused():
    base = {"partition-id": 0, "num-partitions": 2}
    with pytest.raises(NodeSettingsError, match=r"^node 3 \(partition 0\): node config key 'data-paths' is unknown; "
                                                 r"did you mean 'data-path'\?"):
        NodeSettings.parse({**base, "data-paths": "/x"}, node_id=3)
    # 0.6-0.8 similar to a known key (difflib's default cutoff would refuse them): left to other software
    assert NodeSettings.parse({**base, "num-domain-count": 1, "test-path": "x", "image-colour": "red"}).data is None


def test_a_missing_setting_and_a_node_without_id_are_named():
    from flwr_pfl.app.node_settings import node_label, role_setting

    assert node_label(None, {"partition-id": 4}) == "node ? (partition 4)" and node_label(2, {}) == "node 2 (partition ?)"
    with pytest.raises(NodeSettingsError, match=r"^node \? \(partition \?\): the node config lacks partition-id, "
                                                 r"num-partitions; start the SuperNode with"):
        NodeSettings.parse({})
    with pytest.raises(NodeSettingsError, match=r"^this node: node config fedgp-role='x' is not allowed"):
        role_setting({"fedgp-role": "x"})
