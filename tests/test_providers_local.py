"""The local key providers: ``file`` (created on first use, locked, atomic), ``env`` and ``k8s-dir``.

What matters to an operator: a keyring is created once and never clobbered, a broken keyring file
stops the start and stays byte-for-byte as it was, and no error ever shows key material.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import re
import secrets
import stat
from pathlib import Path

import pytest

from pinrotate_core.config import settings_from_mapping
from pinrotate_core.errors import ConfigError, KeyUnavailable
from pinrotate_core.keyring import Keyring
from pinrotate_core.providers import KeyProvider, KeyringAdmin, build_provider
from pinrotate_core.providers.env import EnvKeyProvider
from pinrotate_core.providers.file import FileKeyProvider
from pinrotate_core.providers.k8s import K8sDirKeyProvider

from .helpers import assert_secret_free, b64
from .pinprofile import cli


def fingerprint(ring: Keyring) -> str:
    """A digest of the whole keyring, comparable across processes (keys cannot be pickled)."""
    h = hashlib.sha256(ring.current.encode())
    for key_id in sorted(ring.keys):
        h.update(b"\0" + key_id.encode() + b"\0" + ring.keys[key_id].material)
    if ring.legacy is not None:
        h.update(b"\0legacy\0" + ring.legacy.material)
    return h.hexdigest()


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def write_private(path: Path, text: str) -> None:
    """A hand-written keyring file, 0600 as the provider requires."""
    path.write_text(text)
    path.chmod(0o600)


# -- file provider: first use -------------------------------------------------------------------


def test_first_use_creates_a_keyring_with_one_fresh_32_byte_key_current_1(tmp_path: Path) -> None:
    path = tmp_path / "home" / "keys.toml"
    ring = FileKeyProvider(path, create=True).load_keyring()
    assert ring.current == "1"
    assert list(ring.keys) == ["1"]
    assert len(ring.keys["1"].material) == 32
    assert ring.legacy is None
    assert ring.current_version == 1


def test_first_use_writes_the_file_0600_in_a_new_folder_0700(tmp_path: Path) -> None:
    path = tmp_path / "home" / "keys.toml"
    FileKeyProvider(path, create=True).load_keyring()
    assert mode(path) == 0o600
    assert mode(path.parent) == 0o700


def test_first_use_leaves_no_temporary_files(keys_file: Path) -> None:
    FileKeyProvider(keys_file, create=True).load_keyring()
    FileKeyProvider(keys_file, create=True).add_key()
    left = sorted(p.name for p in keys_file.parent.iterdir())
    assert left == ["keys.toml", "keys.toml.lock"]


def test_fpc1_first_use_creates_one_16_byte_bootstrap_key(keys_file: Path) -> None:
    ring = FileKeyProvider(keys_file, style="named", create=True).load_keyring()
    assert re.fullmatch(r"bootstrap-[0-9a-f]{12}", ring.current)
    assert list(ring.keys) == [ring.current]
    assert len(ring.keys[ring.current].material) == 16


def test_two_fresh_keyrings_get_different_keys(tmp_path: Path) -> None:
    a = FileKeyProvider(tmp_path / "a" / "keys.toml", create=True).load_keyring()
    b = FileKeyProvider(tmp_path / "b" / "keys.toml", create=True).load_keyring()
    assert a.keys["1"].material != b.keys["1"].material


def test_loading_again_reads_the_same_keyring_without_rewriting_it(keys_file: Path) -> None:
    first = FileKeyProvider(keys_file, create=True).load_keyring()
    before = keys_file.read_bytes()
    inode = keys_file.stat().st_ino
    second = FileKeyProvider(keys_file, create=True).load_keyring()
    assert fingerprint(first) == fingerprint(second)
    assert keys_file.read_bytes() == before
    assert keys_file.stat().st_ino == inode


def test_the_written_file_is_the_documented_toml_layout(keys_file: Path) -> None:
    ring = FileKeyProvider(keys_file, create=True).load_keyring()
    text = keys_file.read_text()
    assert re.search(r"^current = 1$", text, re.MULTILINE)
    assert re.search(r"^\[keys\]$", text, re.MULTILINE)
    assert f'1 = "{b64(ring.keys["1"].material)}"' in text


def test_the_provider_description_names_the_file_only(keys_file: Path) -> None:
    provider = FileKeyProvider(keys_file, create=True)
    ring = provider.load_keyring()
    assert str(keys_file) in provider.description
    assert_secret_free(provider.description + repr(ring) + repr(ring.keys["1"]), ring.keys["1"].material)


def _load_in_child(path: str, barrier: multiprocessing.synchronize.Barrier, out: multiprocessing.Queue[str]) -> None:
    barrier.wait()
    out.put(fingerprint(FileKeyProvider(path, create=True).load_keyring()))


@pytest.mark.parametrize("round_", range(5))
def test_concurrent_first_use_from_several_processes_creates_exactly_one_keyring(tmp_path: Path, round_: int) -> None:
    # The folder does not exist yet either: the processes race to create it too.
    path = tmp_path / "shared" / "keys.toml"
    ctx = multiprocessing.get_context("fork")
    workers = 6
    barrier = ctx.Barrier(workers)
    out: multiprocessing.Queue[str] = ctx.Queue()
    procs = [ctx.Process(target=_load_in_child, args=(str(path), barrier, out)) for _ in range(workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0] * workers
    seen = [out.get(timeout=5) for _ in procs]
    ring = FileKeyProvider(path, create=True).load_keyring()
    assert set(seen) == {fingerprint(ring)}
    assert list(ring.keys) == ["1"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["keys.toml", "keys.toml.lock"]


# -- file provider: a bad file stops the start and is never touched -----------------------------

GOOD_KEY = secrets.token_bytes(32)
GOOD = b64(GOOD_KEY)
SHORT_KEY = secrets.token_bytes(20)

BAD_FILES = {
    "malformed_toml": f'current = 1\n[keys]\n1 = "{GOOD}\n',
    "bad_base64": f'current = 1\n[keys]\n1 = "{GOOD[:-3]}!!"\n',
    "bad_key_length": f'current = 1\n[keys]\n1 = "{b64(SHORT_KEY)}"\n',
    "unknown_setting": f'current = 1\nrotate_every = "30d"\n[keys]\n1 = "{GOOD}"\n',
    "current_not_in_keys": f'current = 2\n[keys]\n1 = "{GOOD}"\n',
    "no_current": f'[keys]\n1 = "{GOOD}"\n',
    "no_keys_table": "current = 1\n",
    "empty_file": "",
    "current_zero": f'current = 0\n[keys]\n1 = "{GOOD}"\n',
    "current_boolean": f'current = true\n[keys]\n1 = "{GOOD}"\n',
    "key_not_a_string": f'current = 1\n[keys]\n1 = 12345\n2 = "{GOOD}"\n',
    "bad_key_id": f'current = 1\n[keys]\n1 = "{GOOD}"\n"bad id" = "{GOOD}"\n',
    "bad_legacy_key": f'current = 1\nlegacy = "{b64(SHORT_KEY)}"\n[keys]\n1 = "{GOOD}"\n',
}


@pytest.mark.parametrize("content", list(BAD_FILES.values()), ids=list(BAD_FILES))
def test_a_bad_keyring_file_stops_the_start_and_is_left_byte_identical(keys_file: Path, content: str) -> None:
    keys_file.write_text(content)
    keys_file.chmod(0o600)
    before = keys_file.read_bytes()
    provider = FileKeyProvider(keys_file, create=True)
    for attempt in (provider.load_keyring, provider.add_key, lambda: provider.promote("1")):
        with pytest.raises(ConfigError) as info:
            attempt()
        assert str(keys_file) in str(info.value)
        assert_secret_free(info.value, GOOD_KEY, SHORT_KEY, GOOD, GOOD[:-3])
        assert keys_file.read_bytes() == before
    assert sorted(p.name for p in keys_file.parent.iterdir()) == ["keys.toml", "keys.toml.lock"]


def test_error_for_an_unknown_setting_names_the_setting(keys_file: Path) -> None:
    write_private(keys_file, BAD_FILES["unknown_setting"])
    with pytest.raises(ConfigError, match="rotate_every"):
        FileKeyProvider(keys_file, create=True).load_keyring()


def test_error_for_a_bad_key_names_the_key_id_not_the_value(keys_file: Path) -> None:
    write_private(keys_file, BAD_FILES["bad_key_length"])
    with pytest.raises(ConfigError, match=r"key 1 must decode to 16, 24 or 32 bytes, got 20"):
        FileKeyProvider(keys_file, create=True).load_keyring()


def test_a_keyring_file_that_is_a_folder_is_a_config_error(keys_file: Path) -> None:
    keys_file.mkdir()
    with pytest.raises(ConfigError, match=re.escape(str(keys_file))):
        FileKeyProvider(keys_file, create=True).load_keyring()
    assert keys_file.is_dir()


# -- file provider: adding and promoting keys ---------------------------------------------------


def test_add_key_adds_a_read_only_key_and_promote_makes_it_current(keys_file: Path) -> None:
    provider = FileKeyProvider(keys_file, create=True)
    first = provider.load_keyring()
    assert provider.add_key() == "2"
    added = provider.load_keyring()
    assert added.current == "1"
    assert sorted(added.keys) == ["1", "2"]
    assert added.keys["1"].material == first.keys["1"].material
    assert len(added.keys["2"].material) == 32
    assert added.keys["2"].material != added.keys["1"].material

    provider.promote("2")
    promoted = provider.load_keyring()
    assert promoted.current == "2"
    assert promoted.current_version == 2
    assert fingerprint(Keyring(current="2", keys=added.keys, source="x")) == fingerprint(promoted)
    assert mode(keys_file) == 0o600


def test_add_key_on_an_absent_file_creates_it_first(keys_file: Path) -> None:
    assert FileKeyProvider(keys_file, create=True).add_key() == "2"
    ring = FileKeyProvider(keys_file, create=True).load_keyring()
    assert (ring.current, sorted(ring.keys)) == ("1", ["1", "2"])


def test_add_key_with_a_named_id_and_fpc1_style_makes_16_byte_keys(keys_file: Path) -> None:
    provider = FileKeyProvider(keys_file, style="named", create=True)
    bootstrap = provider.load_keyring().current
    generated = provider.add_key()
    assert re.fullmatch(r"k-[0-9a-f]{12}", generated)
    assert provider.add_key("k2025") == "k2025"
    provider.promote("k2025")
    ring = provider.load_keyring()
    assert ring.current == "k2025"
    assert set(ring.keys) == {bootstrap, generated, "k2025"}
    assert all(len(k.material) == 16 for k in ring.keys.values())


def test_add_key_refuses_an_existing_or_invalid_id_and_leaves_the_file_alone(keys_file: Path) -> None:
    provider = FileKeyProvider(keys_file, create=True)
    provider.load_keyring()
    before = keys_file.read_bytes()
    with pytest.raises(ConfigError, match="already exists"):
        provider.add_key("1")
    with pytest.raises(ConfigError):
        provider.add_key("no spaces allowed")
    assert keys_file.read_bytes() == before


def test_promote_refuses_a_key_that_was_not_added(keys_file: Path) -> None:
    provider = FileKeyProvider(keys_file, create=True)
    provider.load_keyring()
    before = keys_file.read_bytes()
    with pytest.raises(ConfigError, match="add it first"):
        provider.promote("7")
    assert keys_file.read_bytes() == before


def test_a_legacy_key_is_read_and_kept_across_add_and_promote(keys_file: Path) -> None:
    legacy = secrets.token_bytes(16)
    write_private(keys_file, f'current = "k1"\nlegacy = "{b64(legacy)}"\n[keys]\nk1 = "{b64(secrets.token_bytes(16))}"\n')
    provider = FileKeyProvider(keys_file, style="named", create=True)
    assert provider.load_keyring().legacy.material == legacy  # type: ignore[union-attr]
    provider.promote(provider.add_key("k2"))
    ring = provider.load_keyring()
    assert ring.current == "k2"
    assert ring.legacy is not None and ring.legacy.material == legacy


def test_a_hand_written_keyring_with_whitespace_around_base64_loads(keys_file: Path) -> None:
    write_private(keys_file, f'current = "2"\n[keys]\n1 = " {GOOD} "\n2 = "{b64(secrets.token_bytes(16))}"\n')
    ring = FileKeyProvider(keys_file, create=True).load_keyring()
    assert ring.current == "2"
    assert ring.keys["1"].material == GOOD_KEY


def test_missing_key_version_is_key_unavailable_without_material(keys_file: Path) -> None:
    ring = FileKeyProvider(keys_file, create=True).load_keyring()
    with pytest.raises(KeyUnavailable) as info:
        ring.key("5")
    assert_secret_free(info.value, ring.keys["1"].material)


# -- provider factory ---------------------------------------------------------------------------


def _settings(keys: dict[str, object], fmt: str = "aesgcm") -> object:
    target: dict[str, object] = {"name": "T", "table": "t", "columns": ["c"], "format": fmt}
    if fmt == "aesgcm":
        target["key_version"] = "key_version"
    return settings_from_mapping({"keys": keys, "targets": [target]}, env={})


def test_build_provider_gives_a_file_provider_in_the_style_of_the_targets(keys_file: Path) -> None:
    aes = build_provider(_settings({"provider": "file", "file": str(keys_file)}))  # type: ignore[arg-type]
    fpc = build_provider(_settings({"provider": "file", "file": str(keys_file)}, "fpc1"))  # type: ignore[arg-type]
    assert isinstance(aes, FileKeyProvider) and aes.style == "versions"
    assert isinstance(fpc, FileKeyProvider) and fpc.style == "named"
    assert isinstance(aes, KeyProvider) and isinstance(aes, KeyringAdmin)


def test_the_default_keyring_file_lives_under_pinrotate_home(pinrotate_home: Path) -> None:
    provider = build_provider(_settings({"provider": "file"}))  # type: ignore[arg-type]
    assert isinstance(provider, FileKeyProvider)
    assert provider.path == pinrotate_home / "keys.toml"


# -- env provider -------------------------------------------------------------------------------


def test_env_provider_reads_the_current_version_and_every_numbered_key() -> None:
    k1, k2 = secrets.token_bytes(32), secrets.token_bytes(16)
    env = {"PINROTATE_KEY_CURRENT": "2", "PINROTATE_KEY_1": b64(k1), "PINROTATE_KEY_2": b64(k2),
           "PINROTATE_KEYS_PROVIDER": "env", "HOME": "/root"}
    ring = EnvKeyProvider(env).load_keyring()
    assert ring.current == "2" and ring.current_version == 2
    assert {k: v.material for k, v in ring.keys.items()} == {"1": k1, "2": k2}
    assert ring.legacy is None


def test_env_provider_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    key = secrets.token_bytes(32)
    monkeypatch.setenv("PINROTATE_KEY_CURRENT", "1")
    monkeypatch.setenv("PINROTATE_KEY_1", b64(key))
    assert EnvKeyProvider().load_keyring().key("1").material == key


def test_env_provider_reads_a_legacy_key() -> None:
    legacy = secrets.token_bytes(16)
    env = {"PINROTATE_KEY_CURRENT": "k1", "PINROTATE_KEY_k1": b64(secrets.token_bytes(16)),
           "PINROTATE_KEY_LEGACY": b64(legacy)}
    ring = EnvKeyProvider(env).load_keyring()
    assert ring.legacy is not None and ring.legacy.material == legacy
    assert list(ring.keys) == ["k1"]


ENV_BAD = {
    "no_current": ({"PINROTATE_KEY_1": GOOD}, "PINROTATE_KEY_CURRENT"),
    "current_missing_key": ({"PINROTATE_KEY_CURRENT": "2", "PINROTATE_KEY_1": GOOD}, "PINROTATE_KEY_2"),
    "bad_base64": ({"PINROTATE_KEY_CURRENT": "1", "PINROTATE_KEY_1": GOOD[:-3] + "!!"}, "PINROTATE_KEY_1"),
    "bad_length": ({"PINROTATE_KEY_CURRENT": "1", "PINROTATE_KEY_1": b64(SHORT_KEY)}, "PINROTATE_KEY_1"),
    "current_zero": ({"PINROTATE_KEY_CURRENT": "0", "PINROTATE_KEY_1": GOOD}, "PINROTATE_KEY_CURRENT"),
}


@pytest.mark.parametrize(("env", "named"), list(ENV_BAD.values()), ids=list(ENV_BAD))
def test_env_provider_errors_name_the_variable_never_the_value(env: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError) as info:
        EnvKeyProvider(env).load_keyring()
    assert named in str(info.value)
    assert_secret_free(info.value, GOOD_KEY, SHORT_KEY, GOOD, GOOD[:-3])


# -- file provider: who may read or replace the keyring ---------------------------------------------

OTHER_UID = 54321  # no such user needed: the kernel keeps any uid


def fresh_keyring(keys_file: Path) -> bytes:
    FileKeyProvider(keys_file, create=True).load_keyring()
    return keys_file.read_bytes()


@pytest.mark.parametrize("file_mode", [0o644, 0o640, 0o604, 0o660, 0o601, 0o610, 0o666])
def test_a_keyring_file_that_group_or_others_may_access_is_refused_as_ssh_refuses_a_key(
        keys_file: Path, file_mode: int) -> None:
    before = fresh_keyring(keys_file)
    material = FileKeyProvider(keys_file, create=True).load_keyring().keys["1"].material
    keys_file.chmod(file_mode)
    provider = FileKeyProvider(keys_file, create=True)
    for attempt in (provider.load_keyring, provider.add_key, lambda: provider.promote("1")):
        with pytest.raises(ConfigError) as info:
            attempt()
        message = str(info.value)
        assert message == (f"keys.file: {keys_file} has mode {file_mode:04o}: group or others may read the keys; "
                           f"run chmod 600 {keys_file}")
        assert_secret_free(info.value, material)
    assert keys_file.read_bytes() == before and mode(keys_file) == file_mode  # refused, never "fixed" behind one's back


@pytest.mark.parametrize("file_mode", [0o600, 0o400, 0o700])
def test_a_keyring_file_only_its_owner_may_access_loads(keys_file: Path, file_mode: int) -> None:
    fresh_keyring(keys_file)
    keys_file.chmod(file_mode)
    assert FileKeyProvider(keys_file, create=True).load_keyring().current == "1"


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root (the test image runs as root)")
def test_a_keyring_file_owned_by_another_user_is_refused(keys_file: Path) -> None:
    before = fresh_keyring(keys_file)
    os.chown(keys_file, OTHER_UID, -1)
    with pytest.raises(ConfigError) as info:
        FileKeyProvider(keys_file, create=True).load_keyring()
    assert str(info.value) == (f"keys.file: {keys_file} is owned by uid {OTHER_UID}, not by uid {os.geteuid()} that "
                               f"runs pinrotate; run chown {os.geteuid()} {keys_file} (or run pinrotate as its owner)")
    assert keys_file.read_bytes() == before


@pytest.mark.parametrize("folder_mode", [0o770, 0o757, 0o777, 0o1777, 0o730])
def test_a_keyring_folder_that_group_or_others_may_write_is_refused(keys_file: Path, folder_mode: int) -> None:
    before = fresh_keyring(keys_file)
    folder = keys_file.parent
    folder.chmod(folder_mode)
    try:
        with pytest.raises(ConfigError) as info:
            FileKeyProvider(keys_file, create=True).load_keyring()
        assert str(info.value) == (f"keys.file: folder {folder} has mode {folder_mode:04o}: group or others may "
                                   f"write it and replace the keyring; run chmod go-w {folder}")
        assert keys_file.read_bytes() == before
    finally:
        folder.chmod(0o700)


def test_first_use_in_a_folder_others_may_write_creates_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(0o777)
    with pytest.raises(ConfigError, match=f"folder {folder} has mode 0777"):
        FileKeyProvider(folder / "keys.toml", create=True).load_keyring()
    assert not (folder / "keys.toml").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root (the test image runs as root)")
def test_a_keyring_folder_owned_by_another_user_is_refused_but_root_owned_folders_are_fine(keys_file: Path) -> None:
    fresh_keyring(keys_file)
    folder = keys_file.parent
    folder.chmod(0o755)  # root's (this process's) folder, readable by all, writable by none: fine
    assert FileKeyProvider(keys_file, create=True).load_keyring().current == "1"
    os.chown(folder, OTHER_UID, -1)
    with pytest.raises(ConfigError, match=f"folder {folder} is owned by uid {OTHER_UID}"):
        FileKeyProvider(keys_file, create=True).load_keyring()


def test_the_command_line_refuses_a_readable_keyring_with_exit_2_and_one_line(keys_file: Path, tmp_path: Path) -> None:
    fresh_keyring(keys_file)
    keys_file.chmod(0o644)
    config = tmp_path / "pinrotate.toml"
    config.write_text(f'[keys]\nprovider = "file"\nfile = "{keys_file}"\n\n[[targets]]\nname = "T"\n'
                      'table = "t"\nkey_version = "key_version"\ncolumns = ["c"]\n')
    code, doc, err = cli("keys", "list", "--config", str(config), "--json")
    assert code == 2
    assert doc == {"error": f"keys.file: {keys_file} has mode 0644: group or others may read the keys; "
                            f"run chmod 600 {keys_file}", "exit_code": 2}
    assert err.strip().count("\n") == 0 and "Traceback" not in err


def test_k8s_dir_keeps_the_modes_kubernetes_gives(tmp_path: Path) -> None:
    k1 = secrets.token_bytes(32)
    folder = tmp_path / "secret"
    write_secret_volume(folder, {"current": "1", "1": b64(k1)}, generation=1)
    for path in folder.rglob("*"):
        if not path.is_symlink():
            path.chmod(0o755 if path.is_dir() else 0o644)  # defaultMode 0644, as the kubelet mounts it
    folder.chmod(0o1777)
    assert K8sDirKeyProvider(folder).load_keyring().keys["1"].material == k1


# -- k8s-dir provider ---------------------------------------------------------------------------


def write_secret_volume(folder: Path, files: dict[str, str], generation: int) -> None:
    """Lay files out as the kubelet does: a timestamped folder, ``..data`` -> it, links to ``..data/x``."""
    folder.mkdir(exist_ok=True)
    stamp = folder / f"..2025_01_0{generation}_00_00_00.00000000{generation}"
    stamp.mkdir()
    for name, content in files.items():
        (stamp / name).write_text(content)
    tmp_link = folder / "..data_tmp"
    tmp_link.symlink_to(stamp.name)
    os.replace(tmp_link, folder / "..data")  # the atomic swap the kubelet does
    for name in files:
        link = folder / name
        if not link.is_symlink():
            link.symlink_to(f"..data/{name}")


def test_k8s_dir_reads_a_kubelet_style_secret_volume(tmp_path: Path) -> None:
    k1, k2 = secrets.token_bytes(32), secrets.token_bytes(32)
    folder = tmp_path / "secret"
    write_secret_volume(folder, {"current": "2\n", "1": b64(k1) + "\n", "2": b64(k2)}, generation=1)
    (folder / ".hidden-garbage").write_text("not base64 at all!")
    ring = K8sDirKeyProvider(folder).load_keyring()
    assert ring.current == "2"
    assert {k: v.material for k, v in ring.keys.items()} == {"1": k1, "2": k2}
    assert str(folder) in ring.source


def test_k8s_dir_rereads_the_folder_on_every_load(tmp_path: Path) -> None:
    k1, k2 = secrets.token_bytes(32), secrets.token_bytes(32)
    folder = tmp_path / "secret"
    provider = K8sDirKeyProvider(folder)
    write_secret_volume(folder, {"current": "1", "1": b64(k1)}, generation=1)
    assert provider.load_keyring().current == "1"
    write_secret_volume(folder, {"current": "2", "1": b64(k1), "2": b64(k2)}, generation=2)
    ring = provider.load_keyring()
    assert ring.current == "2"
    assert ring.key("2").material == k2


def test_k8s_dir_reads_a_legacy_key(tmp_path: Path) -> None:
    legacy = secrets.token_bytes(16)
    folder = tmp_path / "secret"
    write_secret_volume(folder, {"current": "k1", "k1": b64(secrets.token_bytes(16)), "legacy": b64(legacy)}, 1)
    ring = K8sDirKeyProvider(folder).load_keyring()
    assert ring.legacy is not None and ring.legacy.material == legacy
    assert list(ring.keys) == ["k1"]


K8S_BAD = {
    "no_current_file": {"1": GOOD},
    "current_names_missing_key": {"current": "2", "1": GOOD},
    "bad_base64": {"current": "1", "1": GOOD[:-3] + "!!"},
    "bad_length": {"current": "1", "1": b64(SHORT_KEY)},
}


@pytest.mark.parametrize("files", list(K8S_BAD.values()), ids=list(K8S_BAD))
def test_k8s_dir_errors_name_the_folder_or_file_never_the_value(tmp_path: Path, files: dict[str, str]) -> None:
    folder = tmp_path / "secret"
    write_secret_volume(folder, files, generation=1)
    with pytest.raises(ConfigError) as info:
        K8sDirKeyProvider(folder).load_keyring()
    assert str(folder) in str(info.value)
    assert_secret_free(info.value, GOOD_KEY, SHORT_KEY, GOOD, GOOD[:-3])


def test_k8s_dir_that_does_not_exist_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is not a folder"):
        K8sDirKeyProvider(tmp_path / "absent").load_keyring()
