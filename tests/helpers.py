"""Small test helpers: throwaway keyrings and checks that no secret leaked into a text.

Test code only; keys made here are random and never leave the test process.
"""

from __future__ import annotations

import base64
import secrets
from urllib.parse import urlsplit, urlunsplit

from pinrotate_core.keyring import Key, Keyring


def make_keyring(*key_ids: str, current: str | None = None, length: int = 32,
                 source: str = "test keyring") -> Keyring:
    """A keyring of fresh random keys; ``current`` defaults to the last id given."""
    ids = key_ids or ("1",)
    keys = {k: Key(k, secrets.token_bytes(length)) for k in ids}
    return Keyring(current=current or ids[-1], keys=keys, source=source)


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def secret_forms(secret: bytes | str) -> list[str]:
    """Every way a secret could show up in a message: as given, base64, hex, Python repr."""
    if isinstance(secret, str):
        return [secret]
    forms = [b64(secret), b64(secret).rstrip("="), secret.hex(), repr(secret)[2:-1]]
    forms.append(secret.decode("latin-1"))
    return forms


def exception_text(exc: BaseException) -> str:
    """str and repr of an exception and of everything chained to it (cause and context)."""
    parts: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        parts += [str(current), repr(current), *(repr(a) for a in current.args)]
        current = current.__cause__ or current.__context__
    return "\n".join(parts)


def assert_secret_free(text_or_exc: str | BaseException, *secrets_: bytes | str) -> None:
    text = exception_text(text_or_exc) if isinstance(text_or_exc, BaseException) else text_or_exc
    for secret in secrets_:
        for form in secret_forms(secret):
            # Very short forms (a 1-byte hex) would match by chance; real secrets are long.
            if len(form) >= 8:
                assert form not in text, "a secret value appears in the message"


def url_as(url: str, user: str) -> str:
    """``url`` with another user name (trust / peer-less test servers: no password)."""
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, f"{user}@{host}", parts.path, parts.query, parts.fragment))
