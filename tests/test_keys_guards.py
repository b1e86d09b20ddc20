"""``keys add`` and ``keys promote`` keep a keyring valid (issue 33): an id the keyring's style
cannot hold, or promoting the key that is already current, is refused with one line and exit 2,
the file left byte for byte; ``keys add`` on a missing file says that it created it, and with which
key ids. Driven through the command line as a person types it."""

from __future__ import annotations

import base64
import os
from pathlib import Path

from tests.pinprofile import cli, cli_all

AESGCM_TARGET = ('[[targets]]\nname = "Person"\ntable = "profile.persons"\nid = "id"\nkey_version = "key_version"\n'
                 'columns = ["first_name_cipher"]\nformat = "aesgcm"\n')


def config(tmp_path: Path) -> tuple[Path, Path]:
    keys = tmp_path / "keys" / "keys.toml"
    path = tmp_path / "pinrotate.toml"
    path.write_text(f'[database]\nurl = "postgresql://nobody@127.0.0.1:1/none"\n'
                    f'[keys]\nprovider = "file"\nfile = "{keys}"\n' + AESGCM_TARGET, encoding="utf-8")
    return path, keys


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("pinrotate: error: "), err
    return lines[0]


def test_keys_add_on_a_missing_file_says_it_created_it_and_with_which_ids(tmp_path: Path) -> None:
    path, keys = config(tmp_path)
    code, out, err = cli("keys", "add", "--config", str(path))
    assert code == 0, err
    assert f"created the keyring file {keys} (it did not exist) with keys 1, 2: key 1 current" in out, out
    assert "added key 2" in out
    code, doc, err = cli("keys", "add", "--config", str(path), "--json")
    assert code == 0 and "created" not in doc and doc["added"] == "3", (doc, err)


def test_an_id_an_integer_keyring_cannot_hold_is_refused_by_add_and_promote_leaving_the_file_byte_for_byte(
        tmp_path: Path) -> None:
    path, keys = config(tmp_path)
    assert cli("keys", "add", "--config", str(path))[0] == 0
    # A hand-edited file that carries a named key beside the integer versions: promote must not make it current.
    text = keys.read_text(encoding="utf-8") + f'foo = "{base64.b64encode(os.urandom(32)).decode()}"\n'
    keys.write_text(text, encoding="utf-8")
    before = keys.read_bytes()
    (add_code, add_doc, add_err), (promote_code, _, promote_err), (json_code, promote_doc, _), \
        (zero_code, _, zero_err) = cli_all([
            ["keys", "add", "--id", "foo", "--config", str(path), "--json"],
            ["keys", "promote", "foo", "--config", str(path)],
            ["keys", "promote", "foo", "--config", str(path), "--json"],
            ["keys", "add", "--id", "02", "--config", str(path)]])
    assert add_code == 2 and add_doc["exit_code"] == 2 and "key id foo cannot name a key of this keyring" in \
        add_doc["error"], add_err
    assert promote_code == 2 and "integer version" in one_error_line(promote_err)
    assert json_code == 2 and promote_doc["exit_code"] == 2
    assert zero_code == 2 and "cannot name a key" in one_error_line(zero_err)
    assert keys.read_bytes() == before
    assert "Traceback" not in add_err + promote_err + zero_err


def test_promoting_the_current_key_says_so_and_exits_2_leaving_the_file_alone(tmp_path: Path) -> None:
    path, keys = config(tmp_path)
    assert cli("keys", "add", "--config", str(path))[0] == 0
    assert cli("keys", "promote", "2", "--config", str(path))[0] == 0
    before = keys.read_bytes()
    code, out, err = cli("keys", "promote", "2", "--config", str(path))
    assert code == 2 and out == ""
    assert "key 2 is already the current key" in one_error_line(err)
    assert keys.read_bytes() == before
