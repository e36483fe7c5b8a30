"""A node's personal state on its own disk, so that a SuperNode restart does not lose it.

Clients keep everything they remember between messages in Flower's ``context.state`` (FedRep's
and FedPer's heads, Local's and FEDORA's models, pFedFDA's beta, FMTL's counts and statistics,
FedDAR's heads, FedGP's buffers, ...). Flower holds it in the SuperNode's memory only, so a node
that restarts would silently start those over. With the node-config key ``state-dir`` set
(``flower-supernode --node-config "... state-dir='/var/lib/flwr-pfl'"``) this module mirrors the
whole ``context.state`` into one file per run and partition:

``<state-dir>/<run-name>/partition-<partition-id>.state``
    (``flower-run-<run-id>/`` in place of ``<run-name>/`` for a run without ``run-name``.)

* :func:`persist`, after a message, writes the state when it differs from the file: to a
  temporary file in the same directory, flushed and fsynced, then ``os.replace``d onto the file
  (and the directory fsynced). A node killed at any moment leaves the previous file whole.
* :func:`restore`, before a message, fills an empty ``context.state`` from the file (a restarted
  node's first message). It loads a file written in the same Flower run (the node restarted
  mid-run), or in an earlier one when this run resumes it (``resume=true`` under the same
  ``run-name``, with the same configuration but for the keys a resume may change); a file of an
  earlier run that this run does not resume is left alone and overwritten by this run's state.
  A restored state carries a ``ConfigRecord`` under :data:`RESTORED_KEY` counting its restores.
* :func:`persisted` is both as one context manager: any ClientApp's lifespan can wrap its
  messages in it (``flwr_pfl.app.client_app`` does).

The file holds no pickle: a small header (format, the run's identity, the body's length and
SHA-256) followed by the header's own SHA-256, then the records in Flower's own protobuf
encoding. Both digests are checked before anything in the file is used, so a damaged header is
refused as damaged rather than taken for another run's or partition's file (files of format 1,
written before the header had its digest, are still read). Every array is then read back with
NumPy's ``allow_pickle=False`` and checked against its declared dtype and shape. A file that
fails any check (damaged, truncated, crafted, another partition's) is refused: a warning names
the file and the reason, the file is renamed to ``*.state.rejected`` (kept for inspection) and
the node starts afresh, as a node without ``state-dir`` would.

Unset ``state-dir`` (the simulation engine's nodes, the in-process engine) keeps the state in
memory only, as Flower does.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import struct
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
from flwr.common import log
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

from flwr_pfl.app.checkpoint import RESUMABLE_CHANGES
from flwr_pfl.errors import ConfigError

#: the node-config key naming the directory (unset: state stays in memory only)
NODE_CONFIG_KEY = "state-dir"
#: where a restored state counts its restores (``{"restores": n}``)
RESTORED_KEY = "flwr_pfl.restored"
#: the first bytes of every state file
MAGIC = b"flwr_pfl node state\n"
#: the file layout this module writes (2: the header is followed by its SHA-256)
FORMAT = 2
#: layouts this module reads (1: written before the header had a digest of its own)
READABLE_FORMATS = (1, 2)
_LENGTH = struct.Struct(">Q")
_DIGEST_BYTES = hashlib.sha256().digest_size
_MAX_HEADER = 64 * 1024


class StateFileError(ValueError):
    """A state file that must not be loaded (damaged, crafted, or not this node's)."""


@dataclass(frozen=True)
class StateIdentity:
    """Whose state a file holds: the run (by name, stable across resumes; Flower's run id
    otherwise), the partition, and the configuration's fingerprint."""

    run_name: str
    flower_run_id: int
    partition_id: int
    config_digest: str
    resume: bool

    @property
    def run_key(self) -> str:
        """The run's directory under ``state-dir``."""
        return self.run_name or f"flower-run-{self.flower_run_id}"

    def header(self) -> dict[str, Any]:
        return {"run-name": self.run_name, "flower-run-id": self.flower_run_id,
                "partition-id": self.partition_id, "config-digest": self.config_digest}


def state_dir(context: Context) -> Path | None:
    """The node's ``state-dir`` (``~`` expanded, absolute), or None when unset or empty."""
    value = context.node_config.get(NODE_CONFIG_KEY, "")
    if value in ("", None):
        return None
    if not isinstance(value, str):
        raise ConfigError(f"node config {NODE_CONFIG_KEY}={value!r} must be a path (quote it: {NODE_CONFIG_KEY}='/path')")
    return Path(os.path.expanduser(value)).resolve()


def config_digest(run_config: Mapping[str, Any]) -> str:
    """SHA-256 of the run config without the keys a resume may change: a resumed run continues
    a state only if what it computes is configured the same."""
    kept = {k: v for k, v in run_config.items() if k not in RESUMABLE_CHANGES}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()


def identity(context: Context) -> StateIdentity:
    """This node's identity in this run (ConfigError: no usable ``partition-id`` or ``run-name``)."""
    from flwr_pfl.app.config import check_run_name

    run_name = str(context.run_config.get("run-name", "") or "")
    check_run_name(run_name)
    try:
        partition_id = int(context.node_config["partition-id"])
    except (KeyError, TypeError, ValueError):
        raise ConfigError(
            f"node config {NODE_CONFIG_KEY} is set but partition-id is missing or not an integer; "
            "start the SuperNode with --node-config \"partition-id=<i> num-partitions=<n> "
            f"{NODE_CONFIG_KEY}='<dir>'\""
        ) from None
    return StateIdentity(run_name, int(context.run_id), partition_id, config_digest(context.run_config),
                         bool(context.run_config.get("resume", False)))


def state_path(directory: Path, ident: StateIdentity) -> Path:
    """``<directory>/<run>/partition-<id>.state``."""
    return directory / ident.run_key / f"partition-{ident.partition_id}.state"


# --- the file format ----------------------------------------------------------------------


def encode_body(state: RecordDict) -> bytes:
    """``state`` in Flower's protobuf encoding (every record kind, arrays byte for byte)."""
    return recorddict_to_proto(state).SerializeToString(deterministic=True)


def encode(state: RecordDict, ident: StateIdentity, body: bytes | None = None) -> bytes:
    """The whole file: magic, header length, JSON header, the header's SHA-256, body."""
    body = encode_body(state) if body is None else body
    header = {"format": FORMAT, **ident.header(), "body-bytes": len(body),
              "body-sha256": hashlib.sha256(body).hexdigest()}
    raw = json.dumps(header, sort_keys=True).encode()
    return MAGIC + _LENGTH.pack(len(raw)) + raw + hashlib.sha256(raw).digest() + body


def _split(blob: bytes) -> tuple[dict[str, Any], bytes]:
    """(header, body) of a file's bytes; StateFileError when the framing is wrong."""
    if not blob.startswith(MAGIC):
        raise StateFileError("not a flwr_pfl node state file (wrong leading bytes)")
    start = len(MAGIC) + _LENGTH.size
    if len(blob) < start:
        raise StateFileError("truncated before its header")
    (length,) = _LENGTH.unpack_from(blob, len(MAGIC))
    if length > _MAX_HEADER or start + length > len(blob):
        raise StateFileError(f"header length {length} is out of range for a file of {len(blob)} bytes")
    raw, end = blob[start:start + length], start + length
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise StateFileError(f"header is not JSON ({err})") from None
    found = header.get("format") if isinstance(header, dict) else header
    if found not in READABLE_FORMATS or isinstance(found, bool):
        raise StateFileError(f"unknown format {found!r}; expected {FORMAT}")
    if found >= 2:
        if blob[end:end + _DIGEST_BYTES] != hashlib.sha256(raw).digest():
            raise StateFileError("header does not match its SHA-256 (damaged, altered or truncated)")
        end += _DIGEST_BYTES
    for key, kind in (("run-name", str), ("flower-run-id", int), ("partition-id", int),
                      ("config-digest", str), ("body-bytes", int), ("body-sha256", str)):
        if not isinstance(header.get(key), kind) or isinstance(header.get(key), bool):
            raise StateFileError(f"header field {key!r} is missing or not a {kind.__name__}")
    return header, blob[end:]


def decode(blob: bytes) -> tuple[dict[str, Any], RecordDict]:
    """(header, state) of a file's bytes, every check passed; StateFileError otherwise."""
    header, body = _split(blob)
    if len(body) != header["body-bytes"]:
        raise StateFileError(f"body has {len(body)} bytes, the header says {header['body-bytes']} (truncated?)")
    if hashlib.sha256(body).hexdigest() != header["body-sha256"]:
        raise StateFileError("body does not match its SHA-256 (damaged or altered)")
    try:
        state = recorddict_from_proto(ProtoRecordDict.FromString(body))
    except Exception as err:  # noqa: BLE001 - protobuf and Flower raise several kinds
        raise StateFileError(f"records do not decode ({type(err).__name__}: {err})") from None
    _check_arrays(state)
    return header, state


def _check_arrays(state: RecordDict) -> None:
    """Every array decodes without pickle to its declared dtype and shape."""
    for key, record in state.items():
        if not isinstance(record, ArrayRecord):
            continue
        for name, array in record.items():
            try:
                value = array.numpy()  # Flower reads it with allow_pickle=False
            except Exception as err:  # noqa: BLE001
                raise StateFileError(f"array {key}/{name} does not decode ({type(err).__name__}: {err})") from None
            if str(value.dtype) != array.dtype or tuple(value.shape) != tuple(array.shape):
                raise StateFileError(
                    f"array {key}/{name} holds {value.dtype}{tuple(value.shape)} but declares "
                    f"{array.dtype}{tuple(array.shape)}"
                )


def read_header(path: Path) -> dict[str, Any] | None:
    """The header of the file at ``path``, or None when there is none readable (the body is
    neither read nor checked)."""
    try:
        with path.open("rb") as f:
            head = f.read(len(MAGIC) + _LENGTH.size)
            if len(head) < len(MAGIC) + _LENGTH.size:
                return None
            (length,) = _LENGTH.unpack_from(head, len(MAGIC))
            if length > _MAX_HEADER:
                return None
            return _split(head + f.read(length + _DIGEST_BYTES))[0]
    except (OSError, StateFileError):
        return None


def write_atomic(path: Path, blob: bytes) -> None:
    """Replace ``path`` by ``blob`` all at once: a temporary file beside it, fsynced, renamed
    over it, the directory fsynced. Temporary files left by killed writers are removed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        with tmp.open("wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    for leftover in path.parent.glob(f".{path.name}.*.tmp"):
        leftover.unlink(missing_ok=True)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. a platform without directory descriptors
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- restore / persist --------------------------------------------------------------------


def restore(context: Context) -> bool:
    """Fill an empty ``context.state`` from this node's state file; True when it did.

    Does nothing without ``state-dir``, when the state is not empty, or when no file belongs to
    this run (see the module's docstring for which files are loaded and which are refused).
    """
    directory = state_dir(context)
    if directory is None or len(context.state) > 0:
        return False
    ident = identity(context)
    path = state_path(directory, ident)
    if not path.exists():
        return False
    header = read_header(path)
    if header is not None and not _continues(header, ident, path):
        return False  # another run's state: not even read
    try:
        header, state = decode(path.read_bytes())
        _check_owner(header, ident)
    except (OSError, StateFileError) as err:
        _reject(path, str(err))
        return False
    if not _continues(header, ident, path):
        return False
    restores = int(state[RESTORED_KEY]["restores"]) if RESTORED_KEY in state.config_records else 0
    for key, record in state.items():
        context.state[key] = record
    context.state[RESTORED_KEY] = ConfigRecord({"restores": restores + 1})
    log(INFO, "restored the node state of partition %d from %s (%d records)", ident.partition_id, path, len(state))
    return True


def _continues(header: Mapping[str, Any], ident: StateIdentity, path: Path) -> bool:
    """Whether this run continues the state of ``header``: the same Flower run (a node that
    restarted), or the run it resumes under the same configuration; logs why not."""
    if header["flower-run-id"] == ident.flower_run_id:
        return True
    if not ident.resume:
        log(INFO, "node state %s is from an earlier run (Flower run %d) that this run does not resume "
            "(resume=false); partition %d starts afresh and its state will replace the file",
            path, header["flower-run-id"], ident.partition_id)
        return False
    if header["config-digest"] != ident.config_digest:
        log(WARNING, "node state %s was written under another configuration than this resumed run's; "
            "partition %d starts afresh and its state will replace the file", path, ident.partition_id)
        return False
    return True


def _check_owner(header: Mapping[str, Any], ident: StateIdentity) -> None:
    if header["partition-id"] != ident.partition_id or header["run-name"] != ident.run_name:
        raise StateFileError(
            f"it belongs to partition {header['partition-id']} of run {header['run-name']!r}, not to "
            f"partition {ident.partition_id} of run {ident.run_name!r}"
        )


def _reject(path: Path, reason: str) -> None:
    rejected = path.with_name(path.name + ".rejected")
    try:
        os.replace(path, rejected)
        kept = f"moved to {rejected}"
    except OSError as err:
        kept = f"could not be moved aside ({err})"
    log(WARNING, "refused the node state file %s: %s; it was %s and this node starts afresh", path, reason, kept)


def persist(context: Context) -> bool:
    """Write ``context.state`` to this node's state file when it changed; True when written.

    Does nothing without ``state-dir``, for an empty state, or when the file already holds this
    state for this run.
    """
    directory = state_dir(context)
    if directory is None or len(context.state) == 0:
        return False
    ident = identity(context)
    path = state_path(directory, ident)
    body = encode_body(context.state)
    on_disk = read_header(path)
    if (on_disk is not None and on_disk["body-sha256"] == hashlib.sha256(body).hexdigest()
            and on_disk["flower-run-id"] == ident.flower_run_id and on_disk["run-name"] == ident.run_name
            and on_disk["partition-id"] == ident.partition_id):
        return False
    write_atomic(path, encode(context.state, ident, body))
    return True


@contextmanager
def persisted(context: Context) -> Iterator[None]:
    """Restore before the body runs, persist after it (also after it failed: the file mirrors
    what the node holds in memory). For a ClientApp's ``@app.lifespan()``.

    A state that cannot be written (a full or read-only disk) is logged as a warning, not
    raised: the message's reply stands and the node goes on with its state in memory; only a
    restart before the next successful write would lose it.
    """
    restore(context)
    try:
        yield
    finally:
        try:
            persist(context)
        except OSError as err:
            log(WARNING, "could not write the node state to %s: %s; this node keeps its state in memory only "
                "until a later write succeeds", context.node_config.get(NODE_CONFIG_KEY), err)
