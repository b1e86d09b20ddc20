"""One request to the Prefect API before a run starts, so that refused credentials are one line.

A Prefect server started with ``PREFECT_SERVER_API_AUTH_STRING`` answers 401 to every client
without the same ``PREFECT_API_AUTH_STRING``; without this check the run would end in Prefect's
traceback (exit 1). Nothing here reads or prints the auth string itself.
"""

from __future__ import annotations

from pinrotate_core.errors import ConfigError

AUTH_HINT = ("set PREFECT_API_AUTH_STRING to the server's PREFECT_SERVER_API_AUTH_STRING "
             "(docs/reference.md, \"Who may start a rotation\")")


def check_prefect_api() -> None:
    """With ``PREFECT_API_URL`` set, ask the server its version (an authenticated endpoint).

    Credentials refused (401/403): ``ConfigError`` (exit 2), nothing run. A server that cannot be
    reached is left to the flow's own handling (after the configuration and targets are checked).
    """
    import httpx
    from prefect.client.orchestration import get_client
    from prefect.exceptions import PrefectHTTPStatusError
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        return  # Prefect starts a temporary local server of its own
    with get_client(sync_client=True) as client:
        try:
            client.api_version()
        except httpx.TransportError:
            return
        except PrefectHTTPStatusError as e:
            status = e.response.status_code
            if status in (401, 403):
                raise ConfigError(f"the Prefect API at {url} refused the credentials (HTTP {status}): "
                                  f"{AUTH_HINT}") from None
            raise
