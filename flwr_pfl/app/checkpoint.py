"""A run's ``checkpoint.npz``: the server's whole state after a round, written atomically,
read without ever unpickling anything.

Layout (one ``.npz``, readable with ``np.load(path, allow_pickle=False)``):

* ``rounds_done``: the number of the last completed round (0-d int64);
* ``global_<i>``: the strategy's global arrays, in order;
* ``state_<name>``: the named arrays of the strategy's ``state["arrays"]`` (large buffers such
  as FEDORA's ``K x P`` stack);
* ``array_<n>``: every other array found anywhere in the strategy's state;
* ``meta``: UTF-8 JSON (a uint8 array) with the format version, the run's configuration, the
  results writer's position and the strategy's state, in which each array is a reference
  ``{"__array__": "<entry name>"}``.

The state a strategy returns from ``state_dict()`` may nest dicts (string keys, or any JSON
scalar keys: kept as key-value pairs so that ``{3: ...}`` comes back with the int key and the
insertion order), lists, tuples (read back as lists), sets (read back as sorted lists),
``None``, bools, ints, floats (NaN and infinities included), strings, bytes, NumPy scalars
(read back as Python scalars) and NumPy arrays of any non-object dtype. Anything else is refused
when writing, naming where it was found.

With a key (run key ``checkpoint-key-file``, a file on the server's host), the checkpoint also
holds ``signature``: the HMAC-SHA256 of every other entry (name, dtype, shape and bytes), and a
checkpoint without a valid one is refused when the run resumes: one written by someone else,
altered (a re-computed digest does not help without the key), or written before the key was
set (:mod:`flwr_pfl.app.signing`).

Writing goes to a temporary file in the run's directory that replaces ``checkpoint.npz`` with
``os.replace`` only once complete and flushed to disk, so a run killed while writing leaves the
previous checkpoint intact (and at worst a ``.checkpoint-*.tmp`` file, removed on resume).
"""

from __future__ import annotations

import base64
import json
import os
import tempfile
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from flwr_pfl.app.signing import signature, verify
from flwr_pfl.errors import ConfigError

#: the entry that holds a signed checkpoint's HMAC-SHA256 (hex digits as uint8)
SIGNATURE_ENTRY = "signature"

#: run-config keys a resume may change: the round count, where the run is, and how the server waits for
#: and times out nodes (an operator resuming on a fleet that changed); none changes what is computed
RESUMABLE_CHANGES = frozenset({
    "num-server-rounds", "resume", "output-dir", "run-name", "checkpoint-interval", "checkpoint-key-file",
    "wait-timeout", "min-clients", "round-timeout", "server-workers", "api", "fail-on-no-training", "tracking",
})



def changed_keys(saved: Mapping[str, Any], current: Mapping[str, Any], ignore: Iterable[str] = ()) -> list[str]:
    """The keys (sorted) in which a stored run configuration and the current one differ, but for
    ``ignore``.

    A key that only one side has is not a change when that side holds the app's default for it:
    a run key the app gained after the stored run, left at its default, computes what the run
    without it computed (the app keeps results identical while a new option is off). So a run
    checkpointed, or a result stored, before an upgrade still resumes, or is reused, after it.
    Nor is another algorithm's option (a ``<section>.<option>`` key outside the run's own
    algorithm's section, :attr:`~flwr_pfl.app.registry.AlgorithmSpec.section`): the run never
    reads it, so a default changed for FMTL does not strand a FEDORA run.
    """
    from flwr_pfl.app.appdir import default_run_config

    ignored = frozenset(ignore)
    defaults: dict[str, Any] | None = None
    own = _own_section(saved, current)
    changed = []
    for key in sorted((saved.keys() | current.keys()) - ignored):
        if own is not None and "." in key and not key.startswith(own):
            continue
        if key in saved and key in current:
            if saved[key] != current[key]:
                changed.append(key)
            continue
        if defaults is None:
            defaults = default_run_config()
        value = saved[key] if key in saved else current[key]
        if key not in defaults or value != defaults[key]:
            changed.append(key)
    return changed


def _own_section(saved: Mapping[str, Any], current: Mapping[str, Any]) -> str | None:
    """The options section (``"fedora."``) of the algorithm both configurations run; None when
    they run different algorithms (then every key counts) or one the registry does not know."""
    algorithm = current.get("algorithm", saved.get("algorithm"))
    if saved.get("algorithm", algorithm) != algorithm or not isinstance(algorithm, str):
        return None
    from flwr_pfl.app.registry import ALGORITHMS

    spec = ALGORITHMS.get(algorithm)
    return spec.section if spec is not None else None


#: version of the layout above; a checkpoint of another version is refused
FORMAT_VERSION = 2
CHECKPOINT_NAME = "checkpoint.npz"
TEMP_PREFIX = ".checkpoint-"
TEMP_SUFFIX = ".tmp"


@dataclass(frozen=True)
class Checkpoint:
    """What a checkpoint holds.

    Attributes:
        rounds_done: the last completed round; a resumed run starts at ``rounds_done + 1``.
        config: the run's resolved configuration (flat run-config keys) when it was written.
        results: the results writer's position (:meth:`ResultsWriter.position`).
        state: the strategy's ``state_dict()``, arrays restored.
    """

    rounds_done: int
    config: dict[str, Any]
    results: dict[str, Any]
    state: dict[str, Any]


# ---------------------------------------------------------------------------------- encoding
class _Encoder:
    """Splits a nested state into JSON and named arrays (see the module docstring)."""

    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}

    def add(self, name: str, value: Any, where: str) -> dict[str, str]:
        array = np.asarray(value)
        if array.dtype.hasobject:
            raise TypeError(f"checkpoint state {where}: an array of dtype object cannot be stored "
                            "(it would need pickling); convert it to a numeric or string array")
        if name in self.arrays:
            raise ValueError(f"checkpoint state {where}: the entry name {name!r} is used twice")
        self.arrays[name] = array
        return {"__array__": name}

    def encode(self, value: Any, where: str) -> Any:
        if isinstance(value, np.ndarray):
            return self.add(f"array_{len(self.arrays)}", value, where)
        if isinstance(value, np.generic):
            return self.encode(value.item(), where)
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, bytes):
            return {"__bytes__": base64.b64encode(value).decode("ascii")}
        if isinstance(value, (list, tuple)):
            return [self.encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, (set, frozenset)):
            return {"__set__": [self.encode(v, f"{where}{{}}") for v in sorted(value)]}
        if isinstance(value, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in value):
                return {k: self.encode(v, f"{where}[{k!r}]") for k, v in value.items()}
            return {"__items__": [[self.encode(k, f"{where} key"), self.encode(v, f"{where}[{k!r}]")]
                                  for k, v in value.items()]}
        raise TypeError(f"checkpoint state {where}: {type(value).__name__} values cannot be stored; "
                        "use numbers, strings, lists, dicts or NumPy arrays")


def _decode(value: Any, arrays: dict[str, np.ndarray]) -> Any:
    if isinstance(value, list):
        return [_decode(v, arrays) for v in value]
    if not isinstance(value, dict):
        return value
    if set(value) == {"__array__"}:
        return arrays[value["__array__"]]
    if set(value) == {"__bytes__"}:
        return base64.b64decode(value["__bytes__"])
    if set(value) == {"__set__"}:
        return [_decode(v, arrays) for v in value["__set__"]]
    if set(value) == {"__items__"}:
        return {_hashable(_decode(k, arrays)): _decode(v, arrays) for k, v in value["__items__"]}
    return {k: _decode(v, arrays) for k, v in value.items()}


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


def encode_state(state: dict[str, Any]) -> tuple[Any, dict[str, np.ndarray]]:
    """(JSON-able tree, named arrays) of a strategy state; ``global_arrays`` become
    ``global_<i>`` and ``arrays`` entries ``state_<name>``."""
    encoder = _Encoder()
    tree: dict[str, Any] = {}
    for key, value in state.items():
        if key == "global_arrays":
            tree[key] = [encoder.add(f"global_{i}", a, f"global_arrays[{i}]") for i, a in enumerate(value)]
        elif key == "arrays" and isinstance(value, dict):
            tree[key] = {name: encoder.add(f"state_{name}", a, f"arrays[{name!r}]") for name, a in value.items()}
        else:
            tree[key] = encoder.encode(value, f"[{key!r}]")
    return tree, encoder.arrays


# ---------------------------------------------------------------------------------- files
def _signed_parts(entries: Mapping[str, np.ndarray]) -> list[bytes]:
    """What a checkpoint's signature covers: every entry's name, dtype, shape and bytes, by name."""
    parts = []
    for name in sorted(entries):
        array = np.ascontiguousarray(entries[name])
        parts += [name.encode(), array.dtype.str.encode(), json.dumps(list(array.shape)).encode(), array.tobytes()]
    return parts


def write_checkpoint(
    directory: Path, rounds_done: int, config: dict[str, Any], results: dict[str, Any], state: dict[str, Any],
    key: bytes | None = None,
) -> Path:
    """Write ``directory/checkpoint.npz`` atomically (temporary file, fsync, ``os.replace``),
    signed with ``key`` when given."""
    tree, arrays = encode_state(state)
    meta = {"format": FORMAT_VERSION, "rounds_done": int(rounds_done), "config": config,
            "results": results, "state": tree}
    payload = np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8)
    entries = {"rounds_done": np.array(rounds_done, dtype=np.int64), "meta": payload, **arrays}
    if key is not None:
        entries[SIGNATURE_ENTRY] = np.frombuffer(signature(key, *_signed_parts(entries)).encode("ascii"), dtype=np.uint8)
    final = Path(directory) / CHECKPOINT_NAME
    fd, temp = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=TEMP_SUFFIX, dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **entries)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, final)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    _sync_directory(final.parent)
    return final


def _sync_directory(directory: Path) -> None:
    """Make the rename itself durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_stale_temporaries(directory: Path) -> None:
    """Delete temporary files left by a run killed while writing its checkpoint."""
    for path in Path(directory).glob(f"{TEMP_PREFIX}*{TEMP_SUFFIX}"):
        path.unlink(missing_ok=True)


def read_checkpoint(path: Path, key: bytes | None = None) -> Checkpoint:
    """Read a checkpoint written by :func:`write_checkpoint` (with ``key``: signed with it).

    Nothing is unpickled: every entry is read with ``allow_pickle=False``, so a file holding an
    object array (a pickled Python object, which could run code when loaded) is refused.

    Raises:
        ConfigError: the file is missing, unreadable, of another format, holds an object array,
            or (with ``key``) is not signed with ``key``.
    """
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"there is no checkpoint at {path}")
    if not zipfile.is_zipfile(path):  # np.load would take anything else for a pickle
        raise ConfigError(f"checkpoint {path} cannot be read: it is not a .npz archive")
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
    except ValueError as err:
        if "allow_pickle" in str(err):
            raise ConfigError(f"checkpoint {path} is refused: it holds an object array (pickled Python "
                              "objects), which is never loaded because loading it could run code") from None
        raise ConfigError(f"checkpoint {path} cannot be read: {err}") from None
    except (OSError, EOFError) as err:
        raise ConfigError(f"checkpoint {path} cannot be read: {err}") from None
    except Exception as err:  # noqa: BLE001 - zipfile reports damage in several kinds (BadZipFile, ...)
        raise ConfigError(f"checkpoint {path} is damaged and cannot be read ({type(err).__name__}: {err})") from None
    found = arrays.pop(SIGNATURE_ENTRY, None)
    if key is not None:
        shown = found.tobytes().decode("ascii", errors="replace") if found is not None else None
        if not verify(key, shown, *_signed_parts(arrays)):
            raise ConfigError(f"checkpoint {path} is refused: it is not signed with this server's key (checkpoint-key-file): "
                              "written by someone else, altered, or written before the key was set; resume from a "
                              "checkpoint this server wrote, or start the run anew")
    payload = arrays.pop("meta", None)
    if payload is None:
        raise ConfigError(f"checkpoint {path} has no metadata entry 'meta'; it was written by an older "
                          "version of flwr_pfl and cannot be resumed (start the run again)")
    if payload.dtype != np.uint8 or payload.ndim != 1:
        raise ConfigError(f"checkpoint {path}: its metadata entry 'meta' is {payload.dtype}{payload.shape}, not the "
                          "1-d uint8 array of JSON flwr_pfl writes (the file was altered)")
    try:
        meta = json.loads(payload.tobytes().decode("utf-8"))
    except ValueError as err:
        raise ConfigError(f"checkpoint {path}: its metadata is not valid JSON: {err}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise ConfigError(f"checkpoint {path} has format {found!r}; this version reads format {FORMAT_VERSION}")
    missing = [key for key in ("rounds_done", "config", "results", "state") if key not in meta]
    if missing:
        raise ConfigError(f"checkpoint {path}: its metadata lacks {', '.join(missing)}")
    try:
        state = _decode(meta["state"], arrays)
    except KeyError as err:
        raise ConfigError(f"checkpoint {path} refers to a missing array entry {err}") from None
    return Checkpoint(int(meta["rounds_done"]), dict(meta["config"]), dict(meta["results"]), state)
