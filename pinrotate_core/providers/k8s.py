"""``k8s-dir`` provider: a mounted Kubernetes Secret folder, re-read on every run.

File ``current`` holds the version, files ``1``, ``2``, ... (and optionally ``legacy``) hold base64
keys. Kubernetes' own ``..data`` links and hidden entries are ignored.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError
from ..keyring import Key, Keyring, check_key_ids, shown_key_id
from ._material import decode_key, normalise_current


class K8sDirKeyProvider:
    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory).expanduser()
        self.description = f"k8s-dir {self.directory}"

    def load_keyring(self) -> Keyring:
        d = self.directory
        if not d.is_dir():
            raise ConfigError(f"keys.dir: {d} is not a folder")
        current_file = d / "current"
        if not current_file.is_file():
            raise ConfigError(f"keys.dir: {current_file} is missing")
        current = normalise_current(_read(current_file), where=str(current_file))
        keys: dict[str, Key] = {}
        legacy = None
        for entry in sorted(d.iterdir()):
            if entry.name.startswith(".") or entry.name == "current" or not entry.is_file():
                continue
            if entry.name == "legacy":
                legacy = decode_key("legacy", _read(entry), where=str(entry))
            else:
                keys[entry.name] = decode_key(entry.name, _read(entry), where=str(d / shown_key_id(entry.name)))
        check_key_ids(current, keys, where="keys.dir", name=lambda k: f"file {d / k}")
        if current not in keys:
            raise ConfigError(f"keys.dir: current names key {shown_key_id(current)}, but"
                              f" {d / shown_key_id(current)} is missing")
        return Keyring(current=current, keys=keys, legacy=legacy, source=self.description)


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read ({type(e).__name__})") from None
