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

A resume must not train twice. The server checkpoints every ``checkpoint-interval`` rounds, and
a node writes its state after every message, so after a server kill the nodes' files can be
ahead of the checkpoint the run resumes from (a FedRep node whose head already trained in the
round the server did not finish would train it again). So every file is versioned by round:
:func:`rounds_mod`, a ClientApp mod, notes each message's ``server-round`` in the state
(:data:`ROUND_KEY`) before it is handled; :func:`persist` tags the file with it and, when a
message of a later round replaces the file, keeps the previous round's file as
``partition-<id>.round-<r>.state`` (a hard link, else a copy), as many as a resume can need
(the rounds after ``<latest> - checkpoint-interval``, and the newest before them). When a
resumed run's first message to a restored node has round ``r`` and the restored file is of
round ``r`` or later, :func:`roll_back` replaces the state by the newest file of a round before
``r`` (none: the node starts afresh, as it did before round ``r``), with a warning naming both
rounds. A node that restarts within one Flower run continues from its latest file.

The file holds no pickle: a small header (format, the run's identity, the body's length and
SHA-256) followed by the header's own SHA-256, then the records in Flower's own protobuf
encoding. Both digests are checked before anything in the file is used, so a damaged header is
refused as damaged rather than taken for another run's or partition's file (files of format 1,
written before the header had its digest, are still read). Every array is then read back with
NumPy's ``allow_pickle=False`` and checked against its declared dtype and shape. A file that
fails any check (damaged, truncated, crafted, another partition's) is refused: a warning names
the file and the reason, the file is renamed to ``*.state.rejected`` (kept for inspection) and
the node starts afresh, as a node without ``state-dir`` would.

The digests catch accidents, not tampering: whoever can write the file can recompute them. A
node given a secret key (node-config key ``state-key-file``: a file of at least 16 bytes that
only the node's user can read) signs every file it writes with HMAC-SHA256 over the header and
the body, and refuses any file without its valid signature (written by someone else, altered,
or written before the key was set), as it refuses a damaged one.

Unset ``state-dir`` (the simulation engine's nodes, the in-process engine) keeps the state in
memory only, as Flower does.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import struct
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common import log
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

from flwr_pfl.app.checkpoint import RESUMABLE_CHANGES
from flwr_pfl.app.signing import read_key, signature, verify
from flwr_pfl.errors import ConfigError

#: the node-config key naming the directory (unset: state stays in memory only)
NODE_CONFIG_KEY = "state-dir"
#: the node-config key naming a file that holds the node's secret signing key (unset: unsigned)
KEY_CONFIG_KEY = "state-key-file"
#: the header field that holds the HMAC-SHA256 signature
SIGNATURE = "hmac-sha256"
#: where a restored state counts its restores (``{"restores": n}``), with the round of the file
#: it came from (``file-round``, -1: untagged) and whether it continues an earlier Flower run
#: (``resumed``: 1 until :func:`roll_back` has compared it with the first message's round)
RESTORED_KEY = "flwr_pfl.restored"
#: where :func:`rounds_mod` notes the round of the message being handled (``{"round": r}``)
ROUND_KEY = "flwr_pfl.round"
#: the message config key that carries the run's round (every suite strategy sends it)
SERVER_ROUND = "server-round"
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


def state_key(context: Context) -> bytes | None:
    """The node's signing key, read from ``state-key-file`` (None when unset; ConfigError for a
    bad one, :func:`~flwr_pfl.app.signing.read_key`)."""
    return read_key(context.node_config.get(KEY_CONFIG_KEY, ""), f"node config {KEY_CONFIG_KEY}")


def _signed_parts(header: Mapping[str, Any], body: bytes) -> tuple[bytes, bytes]:
    """What a file's signature covers: its header (without the signature) and its body."""
    fields = {k: v for k, v in header.items() if k != SIGNATURE}
    return json.dumps(fields, sort_keys=True).encode(), body


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


def snapshot_path(directory: Path, ident: StateIdentity, server_round: int) -> Path:
    """``<directory>/<run>/partition-<id>.round-<round>.state``: the state after ``server_round``."""
    return directory / ident.run_key / f"partition-{ident.partition_id}.round-{server_round}.state"


def snapshots(directory: Path, ident: StateIdentity) -> dict[int, Path]:
    """This node's kept rounds: round -> file."""
    prefix = f"partition-{ident.partition_id}.round-"
    out = {}
    for path in (directory / ident.run_key).glob(f"{prefix}*.state"):
        number = path.name[len(prefix):-len(".state")]
        if number.isdigit():
            out[int(number)] = path
    return out


def state_round(state: RecordDict) -> int:
    """The round noted in ``state`` by :func:`rounds_mod` (-1: none)."""
    record = state.config_records.get(ROUND_KEY)
    value = record.get("round") if record is not None else None
    return value if isinstance(value, int) and not isinstance(value, bool) else -1


# --- the file format ----------------------------------------------------------------------


def encode_body(state: RecordDict) -> bytes:
    """``state`` in Flower's protobuf encoding (every record kind, arrays byte for byte)."""
    return recorddict_to_proto(state).SerializeToString(deterministic=True)


def encode(state: RecordDict, ident: StateIdentity, body: bytes | None = None, key: bytes | None = None) -> bytes:
    """The whole file: magic, header length, JSON header (signed with ``key`` when given), the
    header's SHA-256, body."""
    body = encode_body(state) if body is None else body
    header = {"format": FORMAT, **ident.header(), "round": state_round(state), "body-bytes": len(body),
              "body-sha256": hashlib.sha256(body).hexdigest()}
    if key is not None:
        header[SIGNATURE] = signature(key, *_signed_parts(header, body))
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
    found_round = header.setdefault("round", -1)  # files written before rounds were noted: untagged
    if not isinstance(found_round, int) or isinstance(found_round, bool) or found_round < -1:
        raise StateFileError(f"header field 'round' is {found_round!r}, not a round number")
    return header, blob[end:]


def decode(blob: bytes, key: bytes | None = None) -> tuple[dict[str, Any], RecordDict]:
    """(header, state) of a file's bytes, every check passed (with ``key``, its signature too);
    StateFileError otherwise."""
    header, body = _split(blob)
    if len(body) != header["body-bytes"]:
        raise StateFileError(f"body has {len(body)} bytes, the header says {header['body-bytes']} (truncated?)")
    if hashlib.sha256(body).hexdigest() != header["body-sha256"]:
        raise StateFileError("body does not match its SHA-256 (damaged or altered)")
    if key is not None:
        if not verify(key, header.get(SIGNATURE), *_signed_parts(header, body)):
            raise StateFileError(f"it is not signed with this node's key ({KEY_CONFIG_KEY}): written by someone else, "
                                 "altered, or written before the key was set")
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
        header, state = decode(path.read_bytes(), state_key(context))
        _check_owner(header, ident)
    except (OSError, StateFileError) as err:
        _reject(path, str(err))
        return False
    if not _continues(header, ident, path):
        return False
    _adopt(context, state, header, ident)
    log(INFO, "restored the node state of partition %d from %s (%d records)", ident.partition_id, path, len(state))
    return True


def _clear(state: RecordDict) -> None:
    """Remove every record of ``state`` (Flower keeps the node's RecordDict object itself)."""
    for key in list(state.keys()):
        del state[key]


def _adopt(context: Context, state: RecordDict, header: Mapping[str, Any], ident: StateIdentity) -> None:
    """Make ``state`` the node's, with the restore marker (:data:`RESTORED_KEY`) updated."""
    restores = int(state[RESTORED_KEY]["restores"]) if RESTORED_KEY in state.config_records else 0
    _clear(context.state)
    for key, record in state.items():
        context.state[key] = record
    context.state[RESTORED_KEY] = ConfigRecord({
        "restores": restores + 1,
        "file-round": int(header["round"]),
        "resumed": int(header["flower-run-id"] != ident.flower_run_id),
    })


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
    key = state_key(context)
    if (on_disk is not None and on_disk["body-sha256"] == hashlib.sha256(body).hexdigest()
            and on_disk["flower-run-id"] == ident.flower_run_id and on_disk["run-name"] == ident.run_name
            and on_disk["partition-id"] == ident.partition_id and (SIGNATURE in on_disk) == (key is not None)):
        return False
    new_round = state_round(context.state)
    if (on_disk is not None and 0 <= on_disk["round"] < new_round and on_disk["flower-run-id"] == ident.flower_run_id
            and on_disk["partition-id"] == ident.partition_id):
        _keep(path, snapshot_path(directory, ident, on_disk["round"]))
    write_atomic(path, encode(context.state, ident, body, key))
    if new_round >= 0:
        _prune(directory, ident, new_round, _checkpoint_interval(context))
    return True


def _checkpoint_interval(context: Context) -> int:
    value = context.run_config.get("checkpoint-interval", 1)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else 1


def _keep(path: Path, kept: Path) -> None:
    """``kept`` becomes a second name of ``path``'s file (a hard link; a copy where links fail)."""
    kept.unlink(missing_ok=True)
    try:
        os.link(path, kept)
    except OSError:
        write_atomic(kept, path.read_bytes())


def _prune(directory: Path, ident: StateIdentity, latest: int, interval: int) -> None:
    """Keep the rounds a resume can go back to: those after ``latest - interval`` (the server's
    last checkpoint is at most ``interval`` rounds behind the round it was in) and the newest
    one before them; remove the rest."""
    kept = snapshots(directory, ident)
    floor = latest - interval
    older = [r for r in kept if r <= floor]
    for r, path in kept.items():
        if r <= floor and r != max(older):
            path.unlink(missing_ok=True)


def roll_back(context: Context, incoming_round: int) -> bool:
    """Go back to the state after the round before ``incoming_round`` when the restored state is
    ahead of it; True when the state was replaced (or emptied).

    Acts once, on a state restored from an earlier Flower run that this run resumes (the
    :data:`RESTORED_KEY` marker's ``resumed``), and only when the restored file's round is
    ``incoming_round`` or later: the server resumed from a checkpoint older than what this node
    did. The newest kept round before ``incoming_round`` is loaded (a kept file that fails a
    check is refused as :func:`restore` refuses one, and the next older is tried); with none,
    the node starts afresh, as it was before its first message.
    """
    marker = context.state.config_records.get(RESTORED_KEY)
    if marker is None or not marker.get("resumed"):
        return False
    marker["resumed"] = 0
    file_round = marker.get("file-round", -1)
    directory = state_dir(context)
    if directory is None or not isinstance(file_round, int) or file_round < incoming_round:
        return False
    ident = identity(context)
    for server_round, path in sorted(snapshots(directory, ident).items(), reverse=True):
        if server_round >= incoming_round:
            continue
        try:
            header, state = decode(path.read_bytes(), state_key(context))
            _check_owner(header, ident)
        except (OSError, StateFileError) as err:
            _reject(path, str(err))
            continue
        _adopt(context, state, header, ident)
        log(WARNING, "partition %d: its state is from round %d, but this resumed run goes on with round %d: "
            "rolled back to its state after round %d (%s), so that no round is trained twice",
            ident.partition_id, file_round, incoming_round, server_round, path)
        return True
    _clear(context.state)
    log(WARNING, "partition %d: its state is from round %d, but this resumed run goes on with round %d and no "
        "state of an earlier round is kept: it starts afresh, as it did before its first round",
        ident.partition_id, file_round, incoming_round)
    return True


def message_round(message: Message) -> int | None:
    """The ``server-round`` of a message's config (legacy ``fitins.config`` or the Message API's
    ``config``), or None when it carries none."""
    for record in message.content.config_records.values():
        value = record.get(SERVER_ROUND)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def rounds_mod(message: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """ClientApp mod (with ``state-dir`` set): roll a resumed node back when its state is ahead of
    the run (:func:`roll_back`), then note the message's round in the state (:data:`ROUND_KEY`)
    so that :func:`persist` versions the file by round. Put it before the mods that build the
    client, inside the lifespan that wraps the messages in :func:`persisted`."""
    if state_dir(context) is not None:
        incoming = message_round(message)
        if incoming is not None:
            roll_back(context, incoming)
            context.state[ROUND_KEY] = ConfigRecord({"round": incoming})
    return call_next(message, context)


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
