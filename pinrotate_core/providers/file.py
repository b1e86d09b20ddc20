"""``file`` provider: a TOML keyring on local disk, created on first use.

Rules (contract §3): created atomically when absent (one fresh key), file 0600 in a 0700 folder,
but only where a keyring may begin: ``keys add``, the demo and a run's first start
(``create=True``). A read path (inventory, gate, ``keys list``, a Dask worker's shard) never
creates one: a missing file is a one-line ConfigError naming it, and the file stays absent (a
keyring made up on a worker or by a gate would hold keys nobody else has).
every read and change serialised by a file lock beside it. A file that exists but is malformed,
has a bad key length or an unknown setting stops the start; it is never overwritten or deleted.
As ssh refuses a private key that others may read, a keyring file with any group/other permission
bit or owned by another user, or in a folder that group or others may write, stops the start too.
"""

from __future__ import annotations

import base64
import contextlib
import os
import re
import secrets
import stat
import tomllib
from collections.abc import Iterator
from pathlib import Path

import tomli_w

from .._files import exclusive_lock, write_atomically
from ..errors import ConfigError
from ..keyring import (
    Key,
    Keyring,
    check_id_for_style,
    check_key_ids,
    is_version,
    next_version,
    shown_key_id,
    shown_name,
    sort_key,
)
from ._material import decode_key, normalise_current

_ALLOWED_TOP = {"current", "keys", "legacy"}
_HEADER = "# pinrotate keyring: SECRET key material. Keep 0600, never commit, never paste.\n"


class FileKeyProvider:
    def __init__(self, path: str | Path, *, style: str = "versions", create: bool = False) -> None:
        if style not in ("versions", "named"):
            raise ValueError(f"unknown keyring style {style}")
        self.path = Path(path).expanduser()
        self.style = style
        self.create = create  # may load_keyring create the file when it is absent?
        self.description = f"file {self.path}"

    # -- reading -------------------------------------------------------------------------------

    def load_keyring(self) -> Keyring:
        if not self.create:
            self._refuse_absent()
        with self._locked():
            if not self.path.exists():
                if not self.create:
                    self._refuse_absent()
                self._write(self._fresh_keyring())
            return self._read()

    def _refuse_absent(self) -> None:
        """A missing keyring on a read path: one line naming the file; nothing is created (not even
        the lock file beside it)."""
        try:
            exists = self.path.exists()
        except OSError as e:
            raise ConfigError(f"keys.file: cannot inspect {self.path} ({e.strerror})") from None
        if not exists:
            raise ConfigError(f"keys.file: {self.path} does not exist; a keyring is created only by `keys add`, "
                              "the demo or the first run, never by a read (nothing was created)")

    def _read(self) -> Keyring:
        where = str(self.path)
        try:
            text = self.path.read_text(encoding="utf-8")
            raw = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{where}: keyring file is not valid TOML ({e}); it was left as it is") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{where}: cannot read keyring file ({type(e).__name__})") from None
        unknown = sorted(set(raw) - _ALLOWED_TOP)
        if unknown:
            name = unknown[0] if re.fullmatch(r"[a-z_]{1,32}", unknown[0]) else shown_name(unknown[0])
            raise ConfigError(f"{where}: {_line_of(text, unknown[0])}unknown setting {name} in keyring file (expected"
                              " current, [keys] and legacy); it was left as it is")
        if "current" not in raw:
            raise ConfigError(f"{where}: keyring file has no current; it was left as it is")
        table = raw.get("keys")
        if not isinstance(table, dict) or not table:
            raise ConfigError(f"{where}: keyring file has no [keys] table; it was left as it is")
        current = normalise_current(raw["current"], where=where)
        keys = {str(k): decode_key(str(k), v, where=f"{where}: {_line_of(text, str(k))}[keys]")
                for k, v in table.items()}
        legacy = decode_key("legacy", raw["legacy"], where=where) if "legacy" in raw else None
        check_key_ids(current, keys, where=where, name=lambda k: f"[keys] {k}")
        if current not in keys:
            raise ConfigError(f"{where}: current names key {shown_key_id(current)}, which is not in [keys]")
        return Keyring(current=current, keys=keys, legacy=legacy, source=self.description)

    # -- changing ------------------------------------------------------------------------------

    def add_key(self, key_id: str | None = None) -> str:
        """Add a fresh key, read-only: ``current`` does not move until ``promote``."""
        with self._locked():
            ring = self._read() if self.path.exists() else self._create_and_read()
            if key_id is None:
                key_id = next_version(ring.keys) if self.style == "versions" else _named_id("k")
            check_id_for_style(key_id, self.style, where="keys add")
            if key_id in ring.keys:
                raise ConfigError(f"keys add: key {key_id} already exists in {self.path}")
            keys = dict(ring.keys)
            keys[key_id] = Key(key_id, secrets.token_bytes(self._key_length()))
            self._write(Keyring(current=ring.current, keys=keys, legacy=ring.legacy, source=ring.source))
            return key_id

    def promote(self, key_id: str) -> None:
        """Make ``key_id`` current. Refused, the file left as it is, for a key the file lacks, one its
        style cannot hold (a hand-written ``foo`` in an integer keyring) and the current key itself."""
        check_id_for_style(key_id, self.style, where="keys promote")
        self._refuse_absent()
        with self._locked():
            ring = self._read()
            if key_id not in ring.keys:
                raise ConfigError(f"keys promote: key {key_id} is not in {self.path}; add it first")
            if key_id == ring.current:
                raise ConfigError(f"keys promote: key {key_id} is already the current key in {self.path}; "
                                  "nothing was changed (add a new key first: keys add)")
            self._write(Keyring(current=key_id, keys=ring.keys, legacy=ring.legacy, source=ring.source))

    # -- internals -----------------------------------------------------------------------------

    def _key_length(self) -> int:
        return 16 if self.style == "named" else 32

    def _fresh_keyring(self) -> Keyring:
        key_id = "1" if self.style == "versions" else _named_id("bootstrap")
        key = Key(key_id, secrets.token_bytes(self._key_length()))
        return Keyring(current=key_id, keys={key_id: key}, source=self.description)

    def _create_and_read(self) -> Keyring:
        self._write(self._fresh_keyring())
        return self._read()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        try:
            with exclusive_lock(self.path):
                check_private(self.path)
                yield
        except OSError as e:
            raise ConfigError(f"keys.file: cannot lock the keyring in {self.path.parent} ({e.strerror})") from None

    def _write(self, ring: Keyring) -> None:
        """Write atomically: readers see the old keyring or the new one, never a torn file."""
        doc: dict[str, object] = {"current": int(ring.current) if is_version(ring.current) else ring.current}
        if ring.legacy is not None:
            doc["legacy"] = _b64(ring.legacy)
        doc["keys"] = {key_id: _b64(ring.keys[key_id]) for key_id in sorted(ring.keys, key=sort_key)}
        try:
            write_atomically(self.path, _HEADER + tomli_w.dumps(doc))
        except OSError as e:
            raise ConfigError(f"keys.file: cannot write {self.path} ({e.strerror})") from None


def check_private(path: Path) -> None:
    """Refuse a keyring that someone else could read or replace (one line: the file, its mode, the fix).

    The folder may be owned by root (e.g. /etc/pinrotate) but no group or other may write it; the
    file must be owned by the user running pinrotate, with no group or other permission bit.
    """
    me = os.geteuid()
    folder = path.parent
    st: os.stat_result | None
    try:
        fst = folder.stat()  # exists: the lock beside the file is taken first
        try:
            st = path.stat()
        except FileNotFoundError:
            st = None  # created next, 0600
    except OSError as e:
        raise ConfigError(f"keys.file: cannot inspect {path} ({e.strerror})") from None
    fmode = stat.S_IMODE(fst.st_mode)
    if fmode & 0o022:
        raise ConfigError(f"keys.file: folder {folder} has mode {fmode:04o}: group or others may write it and "
                          f"replace the keyring; run chmod go-w {folder}")
    if fst.st_uid not in (me, 0):
        raise ConfigError(f"keys.file: folder {folder} is owned by uid {fst.st_uid}, not by uid {me} that runs "
                          f"pinrotate (or root); run chown {me} {folder}")
    if st is None or not stat.S_ISREG(st.st_mode):
        return  # absent: created 0600; not a file: reading it fails with its own message
    if st.st_uid != me:
        raise ConfigError(f"keys.file: {path} is owned by uid {st.st_uid}, not by uid {me} that runs pinrotate; "
                          f"run chown {me} {path} (or run pinrotate as its owner)")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise ConfigError(f"keys.file: {path} has mode {mode:04o}: group or others may read the keys; "
                          f"run chmod 600 {path}")


def _b64(key: Key) -> str:
    return base64.b64encode(key.material).decode("ascii")


def _named_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(6)}"


def _line_of(text: str, name: str) -> str:
    """``line N: `` of the first line that starts with the TOML key ``name`` (bare or quoted), or
    nothing: a message names where a setting is, never the text of a keyring file's line."""
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.lstrip().lstrip("\"'")
        if stripped.startswith(name) and stripped[len(name):].lstrip("\"'").lstrip().startswith("="):
            return f"line {number}: "
    return ""
