"""The vault-kv and vault-transit providers against a real OpenBao dev server (no mocks).

Every test works on its own mounts of the session server, or on a fresh server it may stop, seal
or break. Secrets (tokens, secret ids, JWTs, key material) are checked to appear in no exception
text and no captured log or output.
"""

from __future__ import annotations

import base64
import datetime
import json
import logging
import pickle
import secrets
import traceback
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from pinrotate_core.config import KeysSettings, VaultSettings, settings_from_mapping
from pinrotate_core.errors import CiphertextInvalid, ConfigError, ConflictError, KeyUnavailable
from pinrotate_core.providers import build_provider
from pinrotate_core.providers.vault import (
    TransitBatches,
    TransitValuesInvalid,
    VaultKvKeyProvider,
    VaultSession,
    VaultTransitKeyProvider,
    build_vault_provider,
)
from pinrotate_core.schemes.transit import is_transit, transit_version, transit_version_or_none

from .transit_helpers import transit_decrypt, transit_encrypt
from .vault_server import BaoAdmin, BaoDevServer, free_loopback_port

pytestmark = pytest.mark.vault
bao = BaoAdmin.of


# -- helpers ------------------------------------------------------------------------------------


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def b64key(n: int = 32) -> str:
    return base64.b64encode(secrets.token_bytes(n)).decode("ascii")


def kv_provider(server: BaoDevServer, mount: str, path: str, **vault: Any) -> VaultKvKeyProvider:
    settings = KeysSettings(provider="vault-kv",
                            vault=VaultSettings(addr=server.addr, token=server.token, mount=mount, path=path, **vault))
    provider = build_vault_provider(settings)
    assert isinstance(provider, VaultKvKeyProvider)
    return provider


def transit_provider(server: BaoDevServer, mount: str, key: str, **vault: Any) -> VaultTransitKeyProvider:
    settings = KeysSettings(provider="vault-transit",
                            vault=VaultSettings(addr=server.addr, token=server.token, transit_mount=mount, key=key,
                                                **vault))
    provider = build_vault_provider(settings)
    assert isinstance(provider, VaultTransitKeyProvider)
    return provider


def new_kv(server: BaoDevServer, data: dict[str, object] | None = None) -> tuple[str, str]:
    mount, path = unique("kv"), "pinrotate/keys"
    bao(server).enable_secrets(mount, "kv", {"version": "2"})
    if data is not None:
        bao(server).kv_put(mount, path, data)
    return mount, path


def new_transit(server: BaoDevServer) -> tuple[str, str]:
    mount, key = unique("transit"), "pii"
    bao(server).enable_secrets(mount, "transit")
    bao(server).api("POST", f"{mount}/keys/{key}", {"type": "aes256-gcm96"})
    return mount, key


def error_text(error: BaseException) -> str:
    """Everything an operator could see of an exception: message, repr and the whole chain."""
    return "\n".join([str(error), repr(error), *traceback.format_exception(error)])


def assert_secret_free(texts: Iterable[str], secret_values: Iterable[str]) -> None:
    joined = "\n".join(texts)
    for value in secret_values:
        assert value, "a secret to look for must not be empty"
        assert value not in joined, "a secret value appears in an error, log or output"


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG)  # also urllib3's request lines
    return caplog


# -- the format -----------------------------------------------------------------------------------


def test_transit_version_is_read_from_the_prefix() -> None:
    assert transit_version("vault:v1:y0qUEC9ltHmOlRdnhIor0yvio342dwqfszv9fXJJ") == 1
    assert transit_version(b"vault:v12:AAAA") == 12
    assert transit_version_or_none("vault:v3:QUJD") == 3
    assert is_transit("vault:v3:QUJD")


@pytest.mark.parametrize("value", [
    "", "vault:", "vault:v0:AAAA", "vault:v01:AAAA", "vault:v-1:AAAA", "vault:vx:AAAA", "vault:v1:",
    "vault:v1:not base64!", "vault:v1:AAA", "VAULT:v1:AAAA", "vault:v1:AAAA\n", " vault:v1:AAAA",
    "FPC1:AES-GCM:k1:AAAA", "AAAAAAAAAAAAAAAAAAAAAAAA",
])
def test_values_not_in_vault_transit_form_are_ciphertext_invalid(value: str) -> None:
    with pytest.raises(CiphertextInvalid) as excinfo:
        transit_version(value)
    assert str(excinfo.value) in (  # fixed texts: the value is never echoed
        "value is not a vault-transit ciphertext (vault:v<N>:<base64>)",
        "vault-transit ciphertext payload is not valid base64",
    )
    assert transit_version_or_none(value) is None


def test_null_and_binary_garbage_have_no_transit_version() -> None:
    assert transit_version_or_none(None) is None
    assert transit_version_or_none(b"\xff\xfe") is None


# -- configuration and construction ---------------------------------------------------------------


def test_missing_addr_is_a_config_error_naming_the_setting() -> None:
    with pytest.raises(ConfigError, match=r"^keys\.vault\.addr: "):
        VaultSession(VaultSettings(token="t"))


def test_token_auth_without_a_token_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"keys\.vault\.token"):
        VaultSession(VaultSettings(addr="http://127.0.0.1:8200"))


def test_approle_without_secret_id_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"keys\.vault\.secret_id"):
        VaultSession(VaultSettings(addr="http://127.0.0.1:8200", auth="approle", role_id="r"))


def test_tls_is_verified_by_default_and_ca_cert_is_the_bundle(tmp_path: Path) -> None:
    assert VaultSession(VaultSettings(addr="https://127.0.0.1:8200", token="t")).verify is True
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    assert VaultSession(VaultSettings(addr="https://127.0.0.1:8200", token="t", ca_cert=str(ca))).verify == str(ca)
    assert VaultSession(VaultSettings(addr="https://127.0.0.1:8200", token="t", verify=False)).verify is False
    with pytest.raises(ConfigError, match=r"keys\.vault\.ca_cert"):
        VaultSession(VaultSettings(addr="https://127.0.0.1:8200", token="t", ca_cert=str(tmp_path / "missing.pem")))


def test_reprs_and_pickling_never_expose_the_token() -> None:
    token = "hvs." + secrets.token_hex(16)
    settings = KeysSettings(provider="vault-kv", vault=VaultSettings(
        addr="http://user:pw@127.0.0.1:8200/ignored?x=1", token=token, path="app/keys"))
    provider = build_vault_provider(settings)
    assert_secret_free([repr(provider), str(provider), repr(provider.session), str(provider.session)],
                       [token, "user:pw"])
    assert_secret_free([repr(settings)], [token])
    assert "http://127.0.0.1:8200" in repr(provider.session)
    with pytest.raises(TypeError):
        pickle.dumps(provider)


# -- vault-kv -------------------------------------------------------------------------------------


def test_kv_keyring_is_read_once_per_instance_and_cached(openbao: BaoDevServer) -> None:
    k1, k2, k3 = b64key(), b64key(), b64key()
    mount, path = new_kv(openbao, {"current": "2", "1": k1, "2": k2})
    provider = kv_provider(openbao, mount, path)

    ring = provider.load_keyring()
    assert ring.current == "2"
    assert ring.source == f"vault-kv {mount}/{path}"
    assert ring.key("1").material == base64.b64decode(k1)
    assert ring.key("2").material == base64.b64decode(k2)
    assert not ring.server_side

    bao(openbao).kv_put(mount, path, {"current": "3", "1": k1, "2": k2, "3": k3})
    for _ in range(5):
        assert provider.load_keyring() is ring
    assert provider.reads == 1

    fresh = kv_provider(openbao, mount, path)
    assert fresh.load_keyring().current == "3"
    assert fresh.reads == 1


def test_kv_current_may_be_a_json_integer_and_legacy_is_read(openbao: BaoDevServer) -> None:
    legacy = b64key(16)
    mount, path = new_kv(openbao, {"current": 1, "1": b64key(), "legacy": legacy})
    ring = kv_provider(openbao, mount, path).load_keyring()
    assert ring.current == "1"
    assert ring.legacy is not None and ring.legacy.material == base64.b64decode(legacy)
    assert "legacy" not in ring.keys


def test_kv_provider_is_built_from_config_and_vault_token_env_overrides(openbao: BaoDevServer) -> None:
    mount, path = new_kv(openbao, {"current": "1", "1": b64key()})
    settings = settings_from_mapping(
        {"keys": {"provider": "vault-kv", "vault": {"token": "not-the-token", "mount": mount, "path": path}},
         "targets": [{"name": "T", "table": "t", "key_version": "kv", "columns": ["c"]}]},
        env={"VAULT_ADDR": openbao.addr, "VAULT_TOKEN": openbao.token},
    )
    provider = build_provider(settings)
    assert provider.description == f"vault-kv {mount}/{path}"
    assert provider.load_keyring().current == "1"


def test_kv_keyring_is_read_inside_a_namespace(openbao: BaoDevServer) -> None:
    namespace = unique("team")
    bao(openbao).api("POST", f"sys/namespaces/{namespace}", {})
    mount, path = "kv", "pinrotate/keys"
    bao(openbao).enable_secrets(mount, "kv", {"version": "2"}, namespace=namespace)
    bao(openbao).kv_put(mount, path, {"current": "1", "1": b64key()}, namespace=namespace)

    assert kv_provider(openbao, mount, path, namespace=namespace).load_keyring().current == "1"
    with pytest.raises(KeyUnavailable) as excinfo:  # the same path outside the namespace
        kv_provider(openbao, mount, path).load_keyring()
    assert f"{mount}/{path}" in str(excinfo.value) and not excinfo.value.retryable


def test_missing_key_version_names_the_path_and_field_never_a_value(openbao: BaoDevServer,
                                                                    logs: pytest.LogCaptureFixture,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    k1, k2 = b64key(), b64key()
    mount, path = new_kv(openbao, {"current": "3", "1": k1, "2": k2})
    with pytest.raises(KeyUnavailable) as excinfo:
        kv_provider(openbao, mount, path).load_keyring()
    message = str(excinfo.value)
    assert f"{mount}/{path}" in message and "field 3" in message
    assert excinfo.value.retryable is False
    out = capsys.readouterr()
    assert_secret_free([error_text(excinfo.value), logs.text, out.out, out.err], [k1, k2, openbao.token])


def test_absent_secret_is_key_unavailable_naming_the_path(openbao: BaoDevServer) -> None:
    mount, path = new_kv(openbao)
    with pytest.raises(KeyUnavailable, match=f"{mount}/{path}") as excinfo:
        kv_provider(openbao, mount, path).load_keyring()
    assert "404" in str(excinfo.value) and excinfo.value.retryable is False


def test_deleted_keyring_is_unavailable_and_never_replaced_by_keys_add(openbao: BaoDevServer) -> None:
    mount, path = new_kv(openbao, {"current": "1", "1": b64key()})
    bao(openbao).api("DELETE", f"{mount}/data/{path}")
    with pytest.raises(KeyUnavailable, match=r"latest version deleted"):
        kv_provider(openbao, mount, path).load_keyring()
    with pytest.raises(ConfigError, match=r"deleted or destroyed"):
        kv_provider(openbao, mount, path).add_key()


@pytest.mark.parametrize(("fields", "named"), [
    ({"current": "1", "1": "not base64 at all!"}, "field 1"),
    ({"current": "1", "1": base64.b64encode(b"short").decode()}, "field 1"),
    ({"current": ["1"], "1": "AAAA"}, "field current"),
    ({"current": True, "1": "AAAA"}, "field current"),
    ({"current": "", "1": "AAAA"}, "field current"),
    ({"1": "AAAA"}, "field current"),
    ({"current": "1", "1": 12345}, "field 1"),
    ({"current": "1", "bad name": "AAAA"}, "field 'bad name'"),
    ({"current": "1", "legacy": "%%%"}, "field legacy"),
])
def test_malformed_kv_content_is_a_config_error_naming_path_and_field(openbao: BaoDevServer, fields: dict[str, Any],
                                                                      named: str) -> None:
    good = b64key()
    mount, path = new_kv(openbao, {"1": good, **fields} if "1" not in fields else fields)
    with pytest.raises(ConfigError) as excinfo:
        kv_provider(openbao, mount, path).load_keyring()
    message = str(excinfo.value)
    assert f"vault-kv {mount}/{path}" in message and named in message
    values = [v for v in fields.values() if isinstance(v, str) and len(v) > 3]
    assert_secret_free([error_text(excinfo.value)], [*values, good])


def test_add_key_writes_a_new_field_without_moving_current_then_promote_moves_it(openbao: BaoDevServer) -> None:
    k1 = b64key()
    mount, path = new_kv(openbao, {"current": "1", "1": k1})
    keyring_admin = kv_provider(openbao, mount, path)

    assert keyring_admin.add_key() == "2"
    ring = kv_provider(openbao, mount, path).load_keyring()
    assert ring.current == "1" and sorted(ring.keys) == ["1", "2"]
    assert len(ring.key("2").material) == 32
    assert ring.key("1").material == base64.b64decode(k1)

    keyring_admin.promote("2")
    ring = kv_provider(openbao, mount, path).load_keyring()
    assert ring.current == "2" and sorted(ring.keys) == ["1", "2"]

    with pytest.raises(ConfigError, match=r"key 9 is not in"):
        keyring_admin.promote("9")
    with pytest.raises(ConfigError, match=r"already exists"):
        keyring_admin.add_key("2")
    with pytest.raises(ConfigError, match=r"reserved"):
        keyring_admin.add_key("current")


def test_add_key_on_an_absent_secret_creates_the_first_current_key(openbao: BaoDevServer) -> None:
    mount, path = new_kv(openbao)
    assert kv_provider(openbao, mount, path).add_key() == "1"
    ring = kv_provider(openbao, mount, path).load_keyring()
    assert ring.current == "1" and list(ring.keys) == ["1"]


def test_fpc1_style_adds_named_16_byte_keys(openbao: BaoDevServer) -> None:
    mount, path = new_kv(openbao, {"current": "k2024", "k2024": b64key(16)})
    settings = KeysSettings(provider="vault-kv",
                            vault=VaultSettings(addr=openbao.addr, token=openbao.token, mount=mount, path=path))
    keyring_admin = build_vault_provider(settings, style="named")
    assert isinstance(keyring_admin, VaultKvKeyProvider)
    new_id = keyring_admin.add_key()
    ring = kv_provider(openbao, mount, path).load_keyring()
    assert ring.current == "k2024" and len(ring.key(new_id).material) == 16
    assert keyring_admin.add_key("k2026") == "k2026"


def test_add_key_keeps_a_field_written_concurrently(openbao: BaoDevServer) -> None:
    """Check-and-set: a writer that lands between our read and our write is not overwritten."""
    k1, other = b64key(), b64key()
    mount, path = new_kv(openbao, {"current": "1", "1": k1})

    class RacedProvider(VaultKvKeyProvider):
        raced = False

        def _read_for_update(self) -> tuple[dict[str, Any], int]:
            fields, version = super()._read_for_update()
            if not self.raced:  # another operator adds key 7 right after our read
                self.raced = True
                bao(openbao).kv_put(mount, path, {"current": "1", "1": k1, "7": other})
            return fields, version

    keyring_admin = RacedProvider(VaultSettings(addr=openbao.addr, token=openbao.token, mount=mount, path=path))
    assert keyring_admin.add_key() == "8"  # re-read after the CAS mismatch: 7 is taken now
    ring = kv_provider(openbao, mount, path).load_keyring()
    assert sorted(ring.keys, key=int) == ["1", "7", "8"]
    assert ring.key("7").material == base64.b64decode(other)


def test_add_key_gives_up_with_a_conflict_when_the_secret_keeps_changing(openbao: BaoDevServer) -> None:
    mount, path = new_kv(openbao, {"current": "1", "1": b64key()})

    class AlwaysRaced(VaultKvKeyProvider):
        def _read_for_update(self) -> tuple[dict[str, Any], int]:
            fields, version = super()._read_for_update()
            bao(openbao).kv_put(mount, path, dict(fields))  # a new version every time
            return fields, version

    with pytest.raises(ConflictError, match=f"{mount}/{path}"):
        AlwaysRaced(VaultSettings(addr=openbao.addr, token=openbao.token, mount=mount, path=path)).add_key()


def test_promote_gives_up_with_a_conflict_after_five_lost_writes_and_changes_nothing(openbao: BaoDevServer) -> None:
    mount, path = new_kv(openbao, {"current": "1", "1": b64key(), "2": b64key()})
    reads = []

    class AlwaysRaced(VaultKvKeyProvider):
        def _read_for_update(self) -> tuple[dict[str, Any], int]:
            fields, version = super()._read_for_update()
            reads.append(version)
            bao(openbao).kv_put(mount, path, dict(fields))  # a new version every time
            return fields, version

    with pytest.raises(ConflictError, match="nothing changed, try again"):
        AlwaysRaced(VaultSettings(addr=openbao.addr, token=openbao.token, mount=mount, path=path)).promote("2")
    assert len(reads) == 5 and len(set(reads)) == 5  # each attempt re-read a newer version
    assert kv_provider(openbao, mount, path).load_keyring().current == "1"


# -- authentication -------------------------------------------------------------------------------


def _kv_read_policy(server: BaoDevServer, mount: str, path: str) -> str:
    name = unique("kv-read")
    bao(server).put_policy(name, f'path "{mount}/data/{path}" {{ capabilities = ["read"] }}')
    return name


def test_approle_login_reads_the_keyring(openbao: BaoDevServer, tmp_path: Path, logs: pytest.LogCaptureFixture,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    k1 = b64key()
    mount, path = new_kv(openbao, {"current": "1", "1": k1})
    policy = _kv_read_policy(openbao, mount, path)
    auth_mount = unique("approle")
    bao(openbao).enable_auth(auth_mount, "approle")
    bao(openbao).api("POST", f"auth/{auth_mount}/role/pinrotate", {"token_policies": [policy], "token_ttl": "10m"})
    role_id = bao(openbao).api("GET", f"auth/{auth_mount}/role/pinrotate/role-id")["data"]["role_id"]
    secret_id = bao(openbao).api("POST", f"auth/{auth_mount}/role/pinrotate/secret-id")["data"]["secret_id"]
    approle = {"auth": "approle", "role_id": role_id, "auth_mount": auth_mount}

    settings = KeysSettings(provider="vault-kv", vault=VaultSettings(
        addr=openbao.addr, mount=mount, path=path, secret_id=secret_id, **approle))
    provider = build_vault_provider(settings)
    assert provider.load_keyring().key("1").material == base64.b64decode(k1)
    assert provider.session.logins == 1

    # The login token is revoked (or expired) mid-run: the session logs in once more and goes on.
    bao(openbao).revoke_token(provider.session.client().token)
    again = VaultKvKeyProvider(settings.vault, session=provider.session)
    assert again.load_keyring().current == "1"
    assert provider.session.logins == 2

    secret_file = tmp_path / "secret-id"
    secret_file.write_text(secret_id + "\n")
    settings = KeysSettings(provider="vault-kv", vault=VaultSettings(
        addr=openbao.addr, mount=mount, path=path, secret_id_file=str(secret_file), **approle))
    assert build_vault_provider(settings).load_keyring().current == "1"

    wrong = secrets.token_hex(16)
    settings = KeysSettings(provider="vault-kv", vault=VaultSettings(
        addr=openbao.addr, mount=mount, path=path, secret_id=wrong, **approle))
    with pytest.raises(KeyUnavailable) as excinfo:
        build_vault_provider(settings).load_keyring()
    assert f"approle login at auth/{auth_mount}" in str(excinfo.value)
    assert excinfo.value.retryable is False
    out = capsys.readouterr()
    assert_secret_free([error_text(excinfo.value), logs.text, out.out, out.err],
                       [secret_id, wrong, role_id, k1, openbao.token])


def _self_signed_ca_pem() -> str:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pinrotate-test-k8s-ca")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM).decode("ascii")


def _service_account_jwt(namespace: str, name: str) -> str:
    """An unsigned-looking service-account JWT whose claims match the role, so the login reaches TokenReview."""
    def part(obj: dict[str, str]) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode("ascii")

    claims = {
        "iss": "kubernetes/serviceaccount",
        "kubernetes.io/serviceaccount/namespace": namespace,
        "kubernetes.io/serviceaccount/service-account.name": name,
        "kubernetes.io/serviceaccount/service-account.uid": str(uuid.uuid4()),
        "sub": f"system:serviceaccount:{namespace}:{name}",
    }
    return f"{part({'alg': 'RS256', 'typ': 'JWT'})}.{part(claims)}.{secrets.token_urlsafe(32)}"


def test_kubernetes_login_names_role_and_mount_never_the_jwt(openbao: BaoDevServer, tmp_path: Path,
                                                             logs: pytest.LogCaptureFixture,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    mount, path = new_kv(openbao, {"current": "1", "1": b64key()})
    auth_mount = unique("k8s")
    bao(openbao).enable_auth(auth_mount, "kubernetes")
    # A dummy API server on a closed loopback port: the login request path runs up to TokenReview.
    bao(openbao).api("POST", f"auth/{auth_mount}/config", {
        "kubernetes_host": f"https://127.0.0.1:{free_loopback_port()}",
        "kubernetes_ca_cert": _self_signed_ca_pem(), "disable_local_ca_jwt": True,
    })
    bao(openbao).api("POST", f"auth/{auth_mount}/role/pinrotate", {
        "bound_service_account_names": ["pinrotate"], "bound_service_account_namespaces": ["jobs"],
        "token_policies": [_kv_read_policy(openbao, mount, path)],
    })
    assert bao(openbao).api("GET", f"auth/{auth_mount}/role/pinrotate")["data"]["bound_service_account_names"] == ["pinrotate"]
    jwt = _service_account_jwt("jobs", "pinrotate")
    jwt_file = tmp_path / "token"
    jwt_file.write_text(jwt)

    settings = KeysSettings(provider="vault-kv", vault=VaultSettings(
        addr=openbao.addr, mount=mount, path=path, auth="kubernetes", role="pinrotate",
        jwt_file=str(jwt_file), auth_mount=auth_mount))
    with pytest.raises(KeyUnavailable) as excinfo:
        build_vault_provider(settings).load_keyring()
    message = str(excinfo.value)
    assert "role pinrotate" in message and f"auth/{auth_mount}" in message
    assert excinfo.value.retryable is False

    missing = KeysSettings(provider="vault-kv", vault=VaultSettings(
        addr=openbao.addr, mount=mount, path=path, auth="kubernetes", role="pinrotate",
        jwt_file=str(tmp_path / "absent"), auth_mount=auth_mount))
    with pytest.raises(ConfigError, match=r"keys\.vault\.jwt_file: cannot read .*absent"):
        build_vault_provider(missing).load_keyring()

    out = capsys.readouterr()
    assert_secret_free([error_text(excinfo.value), logs.text, out.out, out.err],
                       [jwt, jwt.split(".")[2], openbao.token])


# -- vault-transit --------------------------------------------------------------------------------


def test_transit_rewrap_moves_thousands_of_values_to_the_latest_version(openbao: BaoDevServer) -> None:
    mount, key = new_transit(openbao)
    provider = transit_provider(openbao, mount, key)
    plaintexts = [b""] + [secrets.token_bytes(1 + i % 48) for i in range(2999)]

    ciphertexts = transit_encrypt(provider, plaintexts[:1500])
    assert provider.rotate() == 2
    ciphertexts += transit_encrypt(provider, plaintexts[1500:])
    assert provider.rotate() == 3
    assert {transit_version(v) for v in ciphertexts} == {1, 2}

    ring = provider.load_keyring()
    assert ring.server_side and ring.current == "3" and ring.current_version == 3 and not ring.keys
    assert ring.source == f"vault-transit {mount}/{key}"

    rewrapped: list[str] = []
    for start in range(0, len(ciphertexts), 700):
        rewrapped += provider.rewrap(ciphertexts[start:start + 700])
    assert len(rewrapped) == len(ciphertexts)
    assert {transit_version(v) for v in rewrapped} == {3}
    assert transit_decrypt(provider, rewrapped) == plaintexts  # order preserved, plaintext unchanged
    assert provider.rewrap([]) == [] and transit_decrypt(provider, []) == []


def test_the_production_transit_provider_only_rewraps_it_cannot_encrypt_or_decrypt() -> None:
    # Plaintext through Transit is for tests and benchmarks only (tests/transit_helpers.py).
    assert not any(hasattr(VaultTransitKeyProvider, name) for name in ("encrypt", "decrypt"))
    assert not any(hasattr(TransitBatches, name) for name in ("encrypt", "decrypt"))


def test_transit_keyring_is_cached_per_instance(openbao: BaoDevServer) -> None:
    mount, key = new_transit(openbao)
    provider = transit_provider(openbao, mount, key)
    ring = provider.load_keyring()
    bao(openbao).api("POST", f"{mount}/keys/{key}/rotate")
    assert provider.load_keyring() is ring and ring.current == "1"
    assert provider.current_version() == 2
    assert transit_provider(openbao, mount, key).load_keyring().current == "2"


def test_min_decryption_version_is_read_and_older_values_are_key_unavailable(openbao: BaoDevServer) -> None:
    mount, key = new_transit(openbao)
    provider = transit_provider(openbao, mount, key)
    old = transit_encrypt(provider, [b"alpha", b"beta"])
    provider.rotate()
    provider.rotate()
    assert provider.min_decryption_version() == 1
    bao(openbao).api("POST", f"{mount}/keys/{key}/config", {"min_decryption_version": 2})
    assert provider.min_decryption_version() == 2
    with pytest.raises(KeyUnavailable, match=r"key versions 1, below the key's min_decryption_version") as excinfo:
        provider.rewrap(old)
    assert excinfo.value.retryable is False
    assert_secret_free([error_text(excinfo.value)], old)


def test_rewrap_reports_refused_values_by_position_never_by_value(openbao: BaoDevServer) -> None:
    mount, key = new_transit(openbao)
    provider = transit_provider(openbao, mount, key)
    good = transit_encrypt(provider, [b"one", b"two", b"three"])
    provider.rotate()

    not_transit = [good[0], "garbage-value", good[1]]
    with pytest.raises(TransitValuesInvalid) as excinfo:
        provider.rewrap(not_transit)
    assert excinfo.value.failed_positions == (1,)
    assert isinstance(excinfo.value, CiphertextInvalid)

    tampered = "vault:v1:" + base64.b64encode(secrets.token_bytes(40)).decode()
    with pytest.raises(TransitValuesInvalid) as excinfo2:
        provider.rewrap([good[0], good[1], tampered, good[2]])
    assert excinfo2.value.failed_positions == (2,)
    assert_secret_free([error_text(excinfo.value), error_text(excinfo2.value)], [*good, tampered, "garbage-value"])

    survivors = provider.rewrap([good[0], good[1], good[2]])
    assert transit_decrypt(provider, survivors) == [b"one", b"two", b"three"]


def test_a_batch_the_server_finds_too_complex_is_sent_again_in_halves(openbao_factory: Any) -> None:
    server: BaoDevServer = openbao_factory()  # default listener: at most 1000 JSON strings a request
    mount, key = new_transit(server)
    provider = transit_provider(server, mount, key)
    assert provider.max_items_per_request == 490
    plaintexts = [secrets.token_bytes(8) for _ in range(1200)]
    values = transit_encrypt(provider, plaintexts)  # 490 + 490 + 220: three requests
    provider.rotate()

    greedy = VaultTransitKeyProvider(VaultSettings(addr=server.addr, token=server.token, transit_mount=mount, key=key),
                                     max_items_per_request=5000)
    rewrapped = greedy.rewrap(values)
    assert greedy.max_items_per_request == 300  # 1200 and 600 refused, 300 accepted and kept
    assert {transit_version(v) for v in rewrapped} == {2}
    assert transit_decrypt(provider, rewrapped) == plaintexts


def test_missing_transit_key_names_mount_and_key(openbao: BaoDevServer) -> None:
    mount, _key = new_transit(openbao)
    with pytest.raises(KeyUnavailable, match=f"transit key absent does not exist at mount {mount}") as excinfo:
        transit_provider(openbao, mount, "absent").load_keyring()
    assert excinfo.value.retryable is False


# -- outages and revoked credentials --------------------------------------------------------------


def test_sealed_or_stopped_server_is_retryable_key_unavailable(openbao_factory: Any,
                                                               logs: pytest.LogCaptureFixture) -> None:
    server: BaoDevServer = openbao_factory()
    k1 = b64key()
    mount, path = new_kv(server, {"current": "1", "1": k1})
    tmount, tkey = new_transit(server)
    transit = transit_provider(server, tmount, tkey)
    values = transit_encrypt(transit, [b"x", b"y"])
    transit.rotate()
    cached = kv_provider(server, mount, path)
    ring = cached.load_keyring()

    bao(server).api("POST", "sys/seal")
    with pytest.raises(KeyUnavailable, match=r"sealed or unavailable \(HTTP 503\)") as sealed:
        kv_provider(server, mount, path).load_keyring()
    assert sealed.value.retryable is True

    server.stop()
    with pytest.raises(KeyUnavailable, match=r"cannot connect") as stopped:
        kv_provider(server, mount, path).load_keyring()
    assert stopped.value.retryable is True and server.addr in str(stopped.value)
    with pytest.raises(KeyUnavailable) as rewrap_stopped:
        transit.rewrap(values)
    assert rewrap_stopped.value.retryable is True
    assert cached.load_keyring() is ring  # the run's keyring was read once and stays usable

    assert_secret_free([error_text(e.value) for e in (sealed, stopped, rewrap_stopped)] + [logs.text],
                       [server.token, k1, *values])


def test_timeout_is_retryable_key_unavailable() -> None:
    import socket

    # A loopback listener that never answers: the connection is accepted by the kernel, the reply never comes.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        addr = f"http://127.0.0.1:{silent.getsockname()[1]}"
        provider = build_vault_provider(KeysSettings(provider="vault-kv", vault=VaultSettings(
            addr=addr, token="t", path="p", timeout=0.3)))
        with pytest.raises(KeyUnavailable, match=r"timed out after 0.3 s") as excinfo:
            provider.load_keyring()
    assert excinfo.value.retryable is True


def test_rate_limited_requests_are_retryable(openbao: BaoDevServer) -> None:
    mount, path = new_kv(openbao, {"current": "1", "1": b64key()})
    quota = unique("rl")
    bao(openbao).api("POST", f"sys/quotas/rate-limit/{quota}", {"rate": 1, "interval": "1h", "path": f"{mount}/"})
    try:
        kv_provider(openbao, mount, path).load_keyring()
        with pytest.raises(KeyUnavailable, match=r"rate limited \(HTTP 429\)") as excinfo:
            kv_provider(openbao, mount, path).load_keyring()
        assert excinfo.value.retryable is True
    finally:
        bao(openbao).api("DELETE", f"sys/quotas/rate-limit/{quota}")


def test_revoked_token_is_not_retryable(openbao: BaoDevServer, logs: pytest.LogCaptureFixture,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    k1 = b64key()
    mount, path = new_kv(openbao, {"current": "1", "1": k1})
    tmount, tkey = new_transit(openbao)
    policy = unique("app")
    bao(openbao).put_policy(policy, f'path "{mount}/data/{path}" {{ capabilities = ["read"] }}\n'
                               f'path "{tmount}/*" {{ capabilities = ["read", "update"] }}')
    token = bao(openbao).create_token([policy])
    settings = dict(addr=openbao.addr, token=token)
    kv = build_vault_provider(KeysSettings(provider="vault-kv", vault=VaultSettings(mount=mount, path=path, **settings)))
    transit = build_vault_provider(KeysSettings(provider="vault-transit",
                                                vault=VaultSettings(transit_mount=tmount, key=tkey, **settings)))
    assert isinstance(transit, VaultTransitKeyProvider)
    kv.load_keyring()
    values = transit_encrypt(transit, [b"secret plaintext"])

    bao(openbao).revoke_token(token)
    with pytest.raises(KeyUnavailable, match=r"permission denied .*\(HTTP 403\)") as kv_denied:
        build_vault_provider(KeysSettings(provider="vault-kv",
                                          vault=VaultSettings(mount=mount, path=path, **settings))).load_keyring()
    with pytest.raises(KeyUnavailable, match=r"HTTP 403") as rewrap_denied:
        transit.rewrap(values)
    assert kv_denied.value.retryable is False and rewrap_denied.value.retryable is False
    out = capsys.readouterr()
    assert_secret_free([error_text(kv_denied.value), error_text(rewrap_denied.value), logs.text, out.out, out.err],
                       [token, k1, *values, "secret plaintext"])


def test_tls_server_needs_its_ca_and_is_read_with_it(openbao_tls: BaoDevServer) -> None:
    server = openbao_tls
    mount, path = new_kv(server, {"current": "1", "1": b64key()})
    with pytest.raises(KeyUnavailable, match=r"TLS verification failed") as excinfo:
        kv_provider(server, mount, path).load_keyring()
    assert excinfo.value.retryable is False
    assert kv_provider(server, mount, path, ca_cert=server.ca_cert).load_keyring().current == "1"
