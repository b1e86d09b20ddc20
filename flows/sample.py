"""``python -m flows.sample --config PATH [--rows N]``: the Pin profile preset with synthetic rows,
loaded into the database a configuration names, for trying a deployment end to end.

Creates schema ``profile`` and its four tables, then N persons (and their documents, templates and
requests) encrypted under the keyring's current key. Refuses a database that already holds the
tables: it never touches data it did not create. Synthetic values only; never logs one.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import psycopg

from flows import presets
from pinrotate_core import rotation
from pinrotate_core.config import load_settings
from pinrotate_core.db import database_url, redacted
from pinrotate_core.errors import ConfigError, DatabaseError, KeyUnavailable
from pinrotate_core.providers import build_provider


def load_sample(config: str | None, rows: int) -> dict[str, Any]:
    settings = load_settings(config)
    keyring = build_provider(settings).load_keyring()  # a new file keyring gets its first key here
    url = database_url(settings)
    try:
        with psycopg.connect(url, autocommit=True, application_name="pinrotate-sample") as conn:
            found = conn.execute("SELECT to_regclass(%s) IS NOT NULL",
                                 (f"{presets.SCHEMA}.{presets.PERSONS}",)).fetchone()
            if found and found[0]:
                raise ConfigError(f"{redacted(url)} already holds {presets.SCHEMA}.{presets.PERSONS}; "
                                  "the sample goes only into a database without the Pin profile tables")
            with conn.transaction():
                presets.apply_pin_profile_schema(conn)
                summary = presets.seed_pin_profile(conn, keyring, rows=rows, key_id=keyring.current)
    except psycopg.OperationalError as e:
        raise DatabaseError(f"cannot reach the database {redacted(url)}: {type(e).__name__}") from None
    return {"database": redacted(url), "key": keyring.current, "rows": summary.counts}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.sample", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", metavar="PATH", help="configuration file (default: as for flows.rotate)")
    parser.add_argument("--rows", type=int, default=10_000, metavar="N", help="persons to create (default 10000)")
    ns = parser.parse_args(argv)
    try:
        if ns.rows < 1:
            raise ConfigError("--rows: must be at least 1")
        doc = load_sample(ns.config, ns.rows)
    except ConfigError as e:
        print(f"pinrotate sample: {e}", file=sys.stderr)
        return rotation.EXIT_CONFIG
    except (KeyUnavailable, DatabaseError) as e:
        print(f"pinrotate sample: {e}", file=sys.stderr)
        return rotation.EXIT_FAIL_CLOSED
    counts = ", ".join(f"{n} {t}" for t, n in doc["rows"].items())
    print(f"loaded the Pin profile sample into {doc['database']} under key {doc['key']}: {counts}")
    return rotation.EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
