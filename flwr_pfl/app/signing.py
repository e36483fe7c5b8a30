"""Files signed with a secret key (HMAC-SHA256), so that one written by someone else is refused.

The node state files and the server's checkpoint carry SHA-256 digests, which catch damage but
not tampering: whoever can write a file can recompute them. With a key that only the node (or
the server) holds, each file also carries an HMAC-SHA256 of its contents, and a file without a
valid one is refused before anything in it is used.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from pathlib import Path

from flwr_pfl.errors import ConfigError

#: the least bytes a key may have (surrounding whitespace is not part of it)
MIN_KEY_BYTES = 16
_LENGTH = struct.Struct(">Q")


def read_key(value: object, setting: str) -> bytes | None:
    """The key in the file named by ``value`` (the setting ``setting``), or None when unset.

    Raises:
        ConfigError: naming ``setting``: not a path, an unreadable file, or a key shorter than
            :data:`MIN_KEY_BYTES`.
    """
    if value in ("", None):
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{setting}={value!r} must be the path of a key file (quote it: {setting}='/path')")
    path = Path(os.path.expanduser(value))
    try:
        key = path.read_bytes().strip()
    except OSError as err:
        raise ConfigError(f"{setting}: cannot read the key file {path}: {err}") from None
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(f"{setting}: the key in {path} has {len(key)} bytes; use at least {MIN_KEY_BYTES} random "
                          f"bytes (e.g. `openssl rand -hex 32 > {path}`)")
    return key


def signature(key: bytes, *parts: bytes) -> str:
    """HMAC-SHA256 (hex) of ``parts``, each prefixed by its length (so that no two different
    sequences of parts sign alike)."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        mac.update(_LENGTH.pack(len(part)))
        mac.update(part)
    return mac.hexdigest()


def verify(key: bytes, found: object, *parts: bytes) -> bool:
    """Whether ``found`` is the signature of ``parts`` under ``key`` (compared in constant time)."""
    return isinstance(found, str) and hmac.compare_digest(found, signature(key, *parts))
