"""Forge's bootstrap file as Forge writes it, for the ``forge`` provider tests.

Forge's bootstrapper stores its keys with ``java.util.Properties.store``: a comment line, a date
line, then ``key=value`` lines in hash order, with ``=``, ``:``, ``#`` and ``!`` escaped by a
backslash (so every base64 padding ``=`` is written ``\\=``). ``java_store`` reproduces that output
byte for byte for ASCII text, independently of the library pinrotate reads it with. Every key made
here is a random TEST key; nothing here is ever written outside a temporary folder.
"""

from __future__ import annotations

import base64
import os
import secrets
from collections.abc import Mapping
from pathlib import Path

BOOTSTRAP_COMMENT = "Forge crypto bootstrap keys. Do not edit, commit or share."
JAVA_DATE = "Tue Mar 04 10:15:22 CST 2025"
P = "forge.crypto.persistence."


def _java_escape(text: str, *, is_key: bool) -> str:
    """``Properties.saveConvert`` for ASCII: what Java writes for one key or value."""
    out = []
    for i, ch in enumerate(text):
        if ch == " " and (is_key or i == 0):
            out.append("\\ ")
        elif ch in "\\=:#!":
            out.append("\\" + ch)
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\n":
            out.append("\\n")
        else:
            out.append(ch)
    return "".join(out)


def java_store(props: Mapping[str, str], comment: str = BOOTSTRAP_COMMENT) -> bytes:
    """The bytes ``Properties.store(out, comment)`` writes (ISO-8859-1, ``\\n`` line ends on POSIX)."""
    lines = [f"#{comment}", f"#{JAVA_DATE}"]
    lines += [f"{_java_escape(k, is_key=True)}={_java_escape(v, is_key=False)}" for k, v in props.items()]
    return ("\n".join(lines) + "\n").encode("iso-8859-1")


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def bootstrap_props(active_id: str, active: bytes, **overrides: str) -> dict[str, str]:
    """What the bootstrapper writes on a new install (design 003), in the order Java's Hashtable
    happened to give: transport key, persistence switches, active key id and key."""
    props = {
        P + "legacy-read-enabled": "false",
        "forge.crypto.secret-key": b64(secrets.token_bytes(16)),
        P + "active-key": b64(active),
        P + "enabled": "true",
        P + "write-versioned": "true",
        P + "active-key-id": active_id,
    }
    props.update(overrides)
    return props


def write_bootstrap_file(path: Path, props: Mapping[str, str], mode: int = 0o600) -> Path:
    """Write as the bootstrapper does: folder 0700, file 0600 (unless told otherwise)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.write_bytes(java_store(props))
    os.chmod(path, mode)
    return path
