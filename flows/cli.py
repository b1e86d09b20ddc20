"""``python -m flows.rotate``: the command line of contract §4.

``--help``, ``inventory``, ``gate`` and ``keys`` call the core directly and never import Prefect;
``run`` and ``demo`` go through the flow. Results go to stdout (one JSON document with ``--json``),
logs to stderr. Exit codes: 0 ok, 1 unexpected, 2 usage/configuration/refusal, 3 gate closed,
4 stopped fail-closed (an unreachable Prefect API too), 143 stopped by SIGTERM or cancellation, 130
the same stop asked for by Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

from flows import traces
from flows.prefect_api import PrefectApiUnreachable
from flows.reports import (
    database_named,
    decided_for,
    discovery_report,
    emit,
    fail,
    gate_summary,
    inventory_report,
    run_report,
)
from flows.terminal_run import Terminated, flow_outcome, stop_code, stopped_by
from pinrotate_core import rotation
from pinrotate_core.commands import commands_for
from pinrotate_core.config import Settings, load_settings
from pinrotate_core.errors import ConfigError, DatabaseError, KeyUnavailable, PinrotateError
from pinrotate_core.gate import check_ticket, write_gate_record
from pinrotate_core.log import configure_stderr_logging

COMMANDS = ("run", "inventory", "gate", "grants", "demo", "seed", "keys")


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="PATH", default=argparse.SUPPRESS,
                        help="configuration file (default: $PINROTATE_CONFIG, then ./pinrotate.toml)")
    parser.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="print one JSON document on stdout and nothing else there")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m flows.rotate",
        description="Rotate the keys of encrypted PII columns: re-encrypt, verify, and prove an old key can go.",
        epilog="Exit codes: 0 done, 1 unexpected error, 2 usage/configuration error or refusal to start, "
               "3 gate closed, 4 stopped fail-closed, 143 stopped by SIGTERM/cancellation, 130 stopped by "
               "Ctrl-C (a second Ctrl-C stops at once).")
    _common(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = sub.add_parser("run", help="one rotation run (the default command)")
    _common(run)
    run.add_argument("--dry-run", action="store_true", help="compute every count of a real run, write nothing")
    run.add_argument("--target", action="append", default=[], metavar="NAME", help="only this target (repeatable)")
    run.add_argument("--tenant", metavar="T", help="only this tenant (targets with a tenant column)")
    run.add_argument("--expected-key-version", metavar="V",
                     help="refuse to start unless V is the current key (required for non-dry fpc1 runs)")

    inv = sub.add_parser("inventory", help="read-only counts per target and key")
    _common(inv)
    inv.add_argument("--deep", action="store_true", help="also decrypt every value (finds FAILED)")
    inv.add_argument("--tenant", metavar="T")
    inv.add_argument("--discover", action="store_true",
                     help="also sweep the database for ciphertexts outside the configured targets")

    gate = sub.add_parser("gate", help="may KEY be destroyed now? exit 0 open, 3 closed")
    _common(gate)
    gate.add_argument("--retire", required=True, metavar="KEY", help="key version, key id, or 'legacy'")
    gate.add_argument("--tenant", metavar="T",
                      help="also show this tenant's slice; the verdict is always over every target and tenant")
    gate.add_argument("--erase-excluded", action="store_true",
                      help="open even though EXCLUDED rows (soft-deleted, require_not_null unset, outside every "
                           "tenant) still reference KEY: destroying KEY erases them")
    gate.add_argument("--shallow", action="store_true",
                      help="skip decrypting every value (faster; FAILED is then not checked)")
    gate.add_argument("--ticket", metavar="T",
                      help="change ticket: write a value-free JSON record of the verdict to keep with it")
    gate.add_argument("--record", metavar="PATH",
                      help="where to write the record (default: $PINROTATE_HOME/records/gate-KEY-T-TIME.json)")

    grants = sub.add_parser("grants", help="print the GRANT statements of the least-privilege role (runs nothing)")
    _common(grants)
    grants.add_argument("--role", required=True, metavar="ROLE", help="the database role to grant to")
    grants.add_argument("--read-only", action="store_true", help="an auditor: inventory and gate only")

    demo = sub.add_parser("demo", help="embedded PostgreSQL, fresh keys, sample data, then a rotation")
    _common(demo)
    demo.add_argument("--rows", type=int, default=10_000, metavar="N",
                      help="sample persons (default 10000), with N/2 documents, N/4 templates and N/4 requests")
    demo.add_argument("--keys", choices=("file", "vault"), default="file",
                      help="key provider for the demo (vault needs VAULT_ADDR/VAULT_TOKEN or a local bao)")
    demo.add_argument("--preset", choices=("pin-profile", "forge"), default="pin-profile",
                      help="forge: Forge's own tables and a sample Forge bootstrap file, rotated to k2")

    seed = sub.add_parser("seed", help="load the Pin profile sample into the configured database (never one that"
                                       " already holds its tables), to try a rotation on your own server")
    _common(seed)
    seed.add_argument("--rows", type=int, default=10_000, metavar="N",
                      help="sample persons (default 10000), with N/2 documents, N/4 templates and N/4 requests")
    seed.add_argument("--key", metavar="V", help="integer key version to encrypt under (default: the current key)")
    seed.add_argument("--preset", choices=("pin-profile", "forge"), default="pin-profile",
                      help="forge: Forge's own tables (examples/forge.sql) with legacy and FPC1 values, and a sample"
                           " Forge bootstrap file where none exists ([keys] file or FORGE_CRYPTO_BOOTSTRAP_FILE)")

    keys = sub.add_parser("keys", help="manage the keyring (file, vault-kv; rotate for vault-transit)")
    _common(keys)
    ksub = keys.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    add = ksub.add_parser("add", help="add a new key, read-only until promoted")
    _common(add)
    add.add_argument("--id", dest="key_id", metavar="ID", help="key id (fpc1); default: next version / generated")
    promote = ksub.add_parser("promote", help="make KEY the current key")
    _common(promote)
    promote.add_argument("key", metavar="KEY")
    lst = ksub.add_parser("list", help="key ids and which is current (never material)")
    _common(lst)
    rot = ksub.add_parser("rotate", help="vault-transit: create a new key version")
    _common(rot)
    return parser


class UsageError(Exception):
    """A command line argparse refuses; ``message`` is its one-line reason, ``usage`` the usage text."""

    def __init__(self, usage: str, message: str) -> None:
        super().__init__(message)
        self.usage = usage
        self.message = message


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is raised (so that ``--json`` can answer it on stdout), not printed."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(self.format_usage(), f"{self.prog}: {message}")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The parsed command line; raises ``UsageError`` (never exits) when argparse refuses it.

    ``--config`` and ``--json`` belong to the top parser and to every command (their default is
    SUPPRESS, so a command's parser never overwrites a value given before the command). With no
    command it is ``run``: a first pass finds no command, the second reads ``run`` and the rest.
    """
    parser = build_parser()
    first, _ = parser.parse_known_args(argv)
    ns = parser.parse_args(argv if first.command is not None else ["run", *argv])
    ns.config = getattr(ns, "config", None)
    ns.json = getattr(ns, "json", False)
    return ns


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        ns = parse_args(argv)
    except SystemExit as e:  # argparse: --help
        return int(e.code or 0)
    except UsageError as e:
        sys.stderr.write(e.usage)
        sys.stderr.write(f"pinrotate: error: {e.message}\n")
        if "--json" in argv:
            sys.stdout.write(json.dumps({"error": e.message, "exit_code": rotation.EXIT_CONFIG}) + "\n")
        return rotation.EXIT_CONFIG
    configure_stderr_logging()
    try:
        if ns.command == "run":
            return cmd_run(ns)
        if ns.command == "inventory":
            return cmd_inventory(ns)
        if ns.command == "gate":
            return cmd_gate(ns)
        if ns.command == "grants":
            return cmd_grants(ns)
        if ns.command == "keys":
            from flows import keys_cli

            return keys_cli.run(ns, emit)
        if ns.command == "seed":
            from flows.seed_cli import cmd_seed

            return cmd_seed(ns, _settings(ns))
        if ns.command == "demo":
            if ns.preset == "forge":
                if ns.config is not None:
                    raise ConfigError("demo --config: the demo runs on its own embedded server and keys and reads no"
                                      " configuration; to load Forge's sample into your database: seed --preset forge")
                if ns.rows < 1:
                    raise ConfigError("--rows: must be at least 1")
                from flows import demo_forge

                return demo_forge.run(ns)
            from flows import demo

            return demo.run(ns)
        return fail(ns, 2, f"unknown command {ns.command}")
    except ConfigError as e:
        return fail(ns, rotation.EXIT_CONFIG, str(e))
    except KeyUnavailable as e:
        return fail(ns, rotation.EXIT_FAIL_CLOSED, f"key unavailable: {e}")
    except DatabaseError as e:
        return fail(ns, rotation.EXIT_FAIL_CLOSED, str(e))
    except PrefectApiUnreachable as e:
        return fail(ns, rotation.EXIT_FAIL_CLOSED, str(e))
    except PinrotateError as e:
        return fail(ns, rotation.EXIT_UNEXPECTED, str(e))
    except KeyboardInterrupt:
        return fail(ns, rotation.EXIT_INTERRUPTED, "interrupted by Ctrl-C; everything committed stays")
    except Terminated as e:
        return fail(ns, stop_code(e.signum), f"{stopped_by(e.signum)}; everything committed stays")


def _settings(ns: argparse.Namespace) -> Settings:
    return load_settings(ns.config)


# -- run --------------------------------------------------------------------------------------------

def cmd_run(ns: argparse.Namespace) -> int:
    # Validate the configuration before Prefect starts: a bad file answers at once with exit 2.
    traces.check_environment()
    settings = _settings(ns)
    from flows.prefect_api import early_server

    # Without PREFECT_API_URL, the run's temporary Prefect server is spawned first, so that its
    # start-up (seconds) overlaps the checks below; it lives in a session of its own, so that a
    # Ctrl-C reaches the run, not its server, and is stopped after the run has reported. Prefect
    # itself is imported only once the checks pass: a refused run (a bad configuration, keyring or
    # target; exit 2) answers without it. The Prefect API is asked after the checks: refused
    # credentials are exit 2, an unreachable server exit 4, both before anything is written.
    with early_server(ns.json) as early:
        preflight(settings, ns)
        from flows.prefect_api import check_prefect_api, temporary_server

        with temporary_server(early) as server:
            if server is None:  # a server behind PREFECT_API_URL: its credentials, whether it answers
                check_prefect_api()
            from flows import flow  # noqa: F401 - imported while the server starts, not after

            if server is not None:
                server.start()  # waits until it answers
            return run_through_flow(ns, server, config_path=ns.config, dry_run=ns.dry_run,
                                    targets=ns.target or None, tenant=ns.tenant,
                                    expected_key_version=ns.expected_key_version)


def preflight(settings: Settings, ns: argparse.Namespace) -> None:
    """Everything that can refuse the start, checked before Prefect starts: configuration, the key
    conditions of §4, every target against the live catalog. A refusal here has touched nothing.

    A retryable key outage is left to the flow, whose read_current_key task retries with backoff.
    """
    ctx = rotation.open_run(settings, target_names=ns.target, dry_run=ns.dry_run,
                            expected_key=ns.expected_key_version, tenant=ns.tenant)
    try:
        try:
            rotation.read_current_key(ctx, announce=False, record=False)
        except KeyUnavailable as e:
            if e.retryable:
                return
            raise
        rotation.resolve_all(ctx)
    finally:
        ctx.close()


def run_through_flow(ns: argparse.Namespace, server: Any = None, **params: Any) -> int:
    """Run the flow here and print its report. ``server``: the run's temporary Prefect server, if any."""
    outcome = flow_outcome(ns, server, **params)
    if isinstance(outcome, int):
        return outcome
    traces.flush()  # the run's spans reach the collector before the command returns
    if outcome.report is None:
        return fail(ns, outcome.exit_code, outcome.error or "the flow run ended without a report")
    emit(ns, outcome.report, run_report(outcome.report))
    return outcome.exit_code


# -- inventory and gate ---------------------------------------------------------------------------------

def cmd_inventory(ns: argparse.Namespace) -> int:
    settings = _settings(ns)
    commands = commands_for(settings)  # the database engine's inventory and sweep
    d = commands.inventory(settings, deep=ns.deep, tenant=ns.tenant).as_dict()
    if ns.discover:
        sweep = commands.discover(settings).as_dict()
        d["discovered"] = sweep.pop("discovered")
        d["discovery"] = sweep
    emit(ns, d, inventory_report(d, deep=ns.deep))
    return rotation.EXIT_OK


def cmd_gate(ns: argparse.Namespace) -> int:
    ticket = check_ticket(ns.ticket) if ns.ticket is not None else None
    settings = _settings(ns)
    with deep_pass_display(ns):
        report = commands_for(settings).retire_gate(settings, ns.retire, tenant=ns.tenant, deep=not ns.shallow,
                                                    erase_excluded=ns.erase_excluded)
    d = report.as_dict()
    # What the verdict was decided for: two configurations sharing one key file must not be confused.
    d["database"] = database_named(report.database)
    d["keyring"] = {"provider": settings.keys.provider, "source": report.keyring_source}
    human = gate_summary(d) + "\n" + decided_for(d["database"], d["keyring"]) + discovery_report(d.get("discovery", {}))
    if d.get("key_identity", {}).get("recorded") is False:
        human += f"\nnote: {d['key_identity']['note']} ({d['key_identity']['table']})"
    if ticket is not None or ns.record is not None:
        path = write_gate_record(report, ticket=ticket, path=ns.record)
        d["record"] = str(path)
        human += f"\nrecord for ticket {ticket or '-'} written to {path} (counts and names only, no value or key)"
    emit(ns, d, human)
    return rotation.EXIT_OK if report.open else rotation.EXIT_GATE_CLOSED


@contextlib.contextmanager
def deep_pass_display(ns: argparse.Namespace) -> Iterator[None]:
    """On an interactive terminal (stderr a TTY, no ``--json``), the gate's deep pass shows rows read
    of each target, the rate and the time left; elsewhere nothing is drawn (nor imported)."""
    if ns.shallow or ns.json or not sys.stderr.isatty():
        yield
        return
    from flows.terminal_progress import SHOW_PROGRESS, terminal_progress
    from pinrotate_core.inventory import DEEP_PASS_PROGRESS

    SHOW_PROGRESS.set(True)
    with terminal_progress(f"gate --retire {ns.retire}: deep pass, every value decrypted") as display:
        token = DEEP_PASS_PROGRESS.set(display)
        try:
            yield
        finally:
            DEEP_PASS_PROGRESS.reset(token)


def cmd_grants(ns: argparse.Namespace) -> int:
    settings = _settings(ns)
    statements = commands_for(settings).grant_statements(settings, ns.role, read_only=ns.read_only)
    emit(ns, {"role": ns.role, "read_only": ns.read_only, "statements": statements}, "\n".join(statements))
    return rotation.EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
