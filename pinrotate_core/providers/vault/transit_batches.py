"""Transit ``batch_input`` requests: split to the server's limit, halved when it refuses one as too
complex, per-item errors turned into positions. The values are ciphertexts; none reaches a message."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import hvac
import hvac.exceptions

from ...errors import CiphertextInvalid, KeyUnavailable, TransitValuesInvalid
from ...log import log_event
from ...schemes.transit import transit_version
from .session import Response, VaultSession

# OpenBao (>= 2.4.1) refuses request bodies with more than 1000 JSON strings by default
# (listener max_request_json_strings); a batch item costs two ("ciphertext": value), so 490 items
# plus the envelope stay below it. Servers with higher limits can be given a larger value.
DEFAULT_TRANSIT_ITEMS_PER_REQUEST = 490


class TransitBatches:
    """``batch_input`` requests against one Transit key (rewrap; the tests' encrypt and decrypt too).

    ``max_items_per_request`` is only ever lowered (see ``run``), and stays lowered for this instance.
    """

    def __init__(self, session: VaultSession, mount: str, key_name: str, description: str,
                 max_items_per_request: int) -> None:
        self.session = session
        self.mount = mount
        self.key_name = key_name
        self.description = description  # "vault-transit <mount>/<key>", the prefix of every message
        self.max_items_per_request = max_items_per_request

    def input_versions(self, values: Sequence[str], operation: str) -> list[int]:
        """Key versions of the inputs; values that are not ``vault:v<N>:`` never go to Vault."""
        versions: list[int] = []
        bad: list[int] = []
        for pos, value in enumerate(values):
            try:
                versions.append(transit_version(value))
            except CiphertextInvalid:
                versions.append(0)
                bad.append(pos)
        if bad:
            raise TransitValuesInvalid(
                f"{self.description}: {operation}: {len(bad)} of {len(values)} values are not vault-transit "
                f"ciphertexts (positions {_positions(bad)})", bad,
            )
        return versions

    def run(self, operation: str, items: list[dict[str, str]], versions: list[int] | None,
            send: Callable[[hvac.Client, list[dict[str, str]]], Any]) -> list[dict[str, Any]]:
        """``batch_input`` requests of at most ``max_items_per_request`` items; results in input order.

        A batch within the limit is ONE request. A server that refuses a request as too complex
        (OpenBao's ``max_request_json_strings``) gets the same items again in halves, and the
        smaller size is kept for the rest of the run.
        """
        results: list[dict[str, Any]] = []
        start = 0
        while start < len(items):
            size = min(self.max_items_per_request, len(items) - start)
            answer = self._request(operation, items[start:start + size], send)
            if answer is None:
                if size == 1:
                    raise KeyUnavailable(
                        f"{self.description}: {operation}: the server refuses even one value per request "
                        "as too complex (check its listener's max_request_json_* limits)", retryable=False,
                    )
                self.max_items_per_request = max(1, size // 2)
                log_event("transit_batch_limit_lowered", source=self.description,
                          max_items_per_request=self.max_items_per_request)
                continue
            results.extend(answer)
            start += size
        failed: list[int] = []
        too_old: list[int] = []
        for pos, result in enumerate(results):
            error = result.get("error")
            if error:
                (too_old if "too old" in str(error) or "disallowed by policy" in str(error) else failed).append(pos)
        if too_old and versions is not None:
            below = sorted({versions[p] for p in too_old})
            raise KeyUnavailable(
                f"{self.description}: {operation}: {len(too_old)} values are on key versions "
                f"{','.join(map(str, below))}, below the key's min_decryption_version", retryable=False,
            )
        failed = sorted(failed + too_old)
        if failed:
            raise TransitValuesInvalid(
                f"{self.description}: {operation}: Transit refused {len(failed)} of {len(items)} values "
                f"(positions {_positions(failed)})", failed,
            )
        return results

    def _request(self, operation: str, chunk: list[dict[str, str]],
                 send: Callable[[hvac.Client, list[dict[str, str]]], Any]) -> list[dict[str, Any]] | None:
        """One request; None when the server refused it as too complex (too many items)."""
        too_complex: Response = {}

        def recover(e: hvac.exceptions.VaultError) -> Response | None:
            if not isinstance(e, hvac.exceptions.InvalidRequest):
                return None
            errors = e.errors if isinstance(e.errors, list) else []
            if any("JSON input" in str(x) and ("complexity" in str(x) or "exceed" in str(x)) for x in errors):
                return too_complex
            # Vault answers a batch with item errors by HTTP 400 (OpenBao by 200): same results.
            body = e.json
            if isinstance(body, dict) and isinstance((body.get("data") or {}).get("batch_results"), list):
                return body
            return None

        response = self.session.call(
            f"{operation} {len(chunk)} values with transit key {self.key_name} at {self.mount}",
            lambda c: send(c, chunk),
            not_found=f"transit key {self.key_name} does not exist at mount {self.mount}",
            recover=recover,
        )
        if response is too_complex:
            return None
        # No per-item "reference": it would double the strings per request, and Transit answers
        # in input order; the count and shape are checked instead.
        results = (response.get("data") or {}).get("batch_results") if isinstance(response, dict) else None
        if not isinstance(results, list) or len(results) != len(chunk) or not all(isinstance(r, dict) for r in results):
            raise KeyUnavailable(f"{self.description}: {operation}: incomplete batch answer", retryable=False)
        return results


def transit_version_or_fail(value: str, where: str) -> int:
    """Version of a value Vault just returned; a malformed one means the answer cannot be trusted."""
    try:
        return transit_version(value)
    except CiphertextInvalid:
        raise KeyUnavailable(f"{where}: Vault returned a value that is not vault:v<N>:", retryable=False) from None


def _positions(positions: Sequence[int], limit: int = 20) -> str:
    shown = ",".join(str(p) for p in positions[:limit])
    return shown + (f",... ({len(positions) - limit} more)" if len(positions) > limit else "")

