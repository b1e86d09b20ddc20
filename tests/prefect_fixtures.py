"""One Prefect test server for the whole session (SQLite in a temporary folder).

Flows in this process run against it through ``prefect_test_harness``; CLI subprocesses get its
URL in ``PREFECT_API_URL`` so that they don't each start a temporary server of their own.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[str]:
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        url = PREFECT_API_URL.value()
        assert url, "the Prefect test harness set no API URL"
        yield str(url)
