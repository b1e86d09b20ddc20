"""``demo --preset forge``: a Forge installation's rotation on a private sandbox, in one command.

Embedded PostgreSQL in a temporary folder, Forge's own tables (examples/forge.sql) with legacy and
FPC1 values as Forge writes them, a sample Forge bootstrap file (TEST keys: active ``k2``,
historical ``k1``, a legacy key) in the same folder, and examples/forge.toml pointed at both; then
the Prefect flow moves every value to ``k2`` and the gate for ``legacy`` is asked. Nothing outside
the temporary folder is touched.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import tomllib
from pathlib import Path

import psycopg
import tomli_w

from flows.demo import demo_flow, stoppable
from flows.reports import emit, run_report
from pinrotate_core import rotation
from pinrotate_core.config import settings_from_mapping
from pinrotate_core.db import embedded_server
from pinrotate_core.errors import ConfigError
from pinrotate_core.gate import evaluate_gate
from pinrotate_core.samples import forge_sample

FORGE_TOML = Path(__file__).resolve().parents[1] / "examples" / "forge.toml"


def _say(ns: argparse.Namespace, text: str) -> None:
    print(f"demo: {text}", file=sys.stderr, flush=True)


def run(ns: argparse.Namespace) -> int:
    if ns.keys != "file":
        raise ConfigError("demo --preset forge --keys: the Forge demo reads a sample Forge bootstrap file; drop --keys")
    return stoppable(ns, _demo)


def _demo(ns: argparse.Namespace) -> int:
    from flows.prefect_api import check_prefect_api, temporary_server

    sandbox = Path(tempfile.mkdtemp(prefix="pinrotate-demo-forge-"))
    os.chmod(sandbox, 0o700)
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, sandbox, ignore_errors=True)
        # The run's temporary Prefect server, as for `run` and the Pin profile demo (flows.demo).
        prefect_server = stack.enter_context(temporary_server())
        check_prefect_api()
        _say(ns, f"sandbox {sandbox}: starting embedded PostgreSQL")
        server = embedded_server(sandbox / "pgdata", cleanup_mode="delete")
        stack.callback(server.cleanup)
        url = server.get_uri()
        bootstrap = sandbox / "forge" / "crypto.properties"
        keys = forge_sample.write_sample_bootstrap(bootstrap)
        with psycopg.connect(url, autocommit=True) as conn:
            counts = forge_sample.seed_forge(conn, keys, ns.rows)
        _say(ns, f"seeded {sum(counts.values())} rows of Forge's tables (legacy values and FPC1 on k1 and k2);"
                 " running the flow pinrotate-rotate to move them to k2")
        raw = tomllib.loads(FORGE_TOML.read_text(encoding="utf-8"))
        raw["database"] = {"url": url}
        raw["keys"]["file"] = str(bootstrap)
        raw["job"] = {**raw.get("job", {}), "batch_size": 1000, "inter_batch_delay": 0}
        config_path = sandbox / "pinrotate.toml"
        config_path.write_text(tomli_w.dumps(raw), encoding="utf-8")
        settings = settings_from_mapping(raw, env={}, source=str(config_path))

        outcome = demo_flow(ns, prefect_server, server, sandbox, config_path=str(config_path), dry_run=False,
                            targets=None, tenant=None, expected_key_version=forge_sample.ACTIVE)
        if isinstance(outcome, int):
            return outcome
        assert outcome.report is not None
        after = rotation.inventory(settings, deep=True)
        gate = evaluate_gate(after, "legacy")
        doc = {**outcome.report, "demo": {"preset": "forge", "rows_seeded": sum(counts.values()), "tables": counts,
                                          "sandbox": str(sandbox), "inventory_after": after.as_dict(),
                                          "gate_legacy": gate.as_dict()}}
        human = run_report(doc) + "\n\n" + (
            f"gate --retire legacy: {'OPEN: the legacy key may be destroyed' if gate.open else 'closed'}")
        emit(ns, doc, human)
        return outcome.exit_code
    raise AssertionError("unreachable")  # pragma: no cover
