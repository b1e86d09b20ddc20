"""The reports people and programs read: human text and ``--json`` documents, for the CLI and the demo.

Every function here takes plain report documents (dicts) and returns or writes text; nothing here
runs a flow, touches a database or imports Prefect. Reports carry names, counts and row ids, never
a value or a key.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pinrotate_core.drain import STOP_DB_ERROR, STOP_KEY_UNAVAILABLE, STOP_THROTTLE_CRITICAL
from pinrotate_core.key_checks import STOP_KEY_MISMATCH

INVENTORY_CATEGORIES = ("ACTIVE", "HISTORICAL", "NEWER", "LEGACY", "UNKNOWN", "UNKNOWN_KEY", "EXCLUDED", "FAILED",
                        "CONFLICT", "BLOCKED")


def emit(ns: argparse.Namespace, document: dict[str, Any], human: str) -> None:
    """One JSON document (``--json``) or the human text on stdout; nothing else goes there."""
    if ns.json:
        sys.stdout.write(json.dumps(document, sort_keys=False, default=str) + "\n")
    else:
        sys.stdout.write(human.rstrip("\n") + "\n")
    sys.stdout.flush()


def fail(ns: argparse.Namespace | None, code: int, message: str) -> int:
    """One line on stderr (and ``{"error", "exit_code"}`` on stdout under ``--json``); returns ``code``."""
    sys.stderr.write(f"pinrotate: error: {message}\n")
    if ns is not None and getattr(ns, "json", False):
        sys.stdout.write(json.dumps({"error": message, "exit_code": code}) + "\n")
        sys.stdout.flush()
    return code


def run_report(d: dict[str, Any]) -> str:
    """The run report of ``run`` for people."""
    head = f"pinrotate run {d['run_id']}  current key {d['current_key']}" + (
        "  (DRY RUN: nothing written)" if d["dry_run"] else "")
    if d.get("skipped"):
        return f"{head}\n{d['skipped']}; nothing to do in this run."
    moved, left = _count_labels(d["dry_run"])
    lines = [head, "",
             f"{'target':<22}{moved:>17}{'failed':>8}{'conflicts':>10}{left:>17}{'batches':>8}{'seconds':>9}"]
    for name, t in d["targets"].items():
        lines.append(f"{name:<22}{t['reencrypted']:>17}{t['failed']:>8}{t['conflicts']:>10}"
                     f"{t['backlog_remaining']:>17}{t['batches']:>8}{t['duration_ms'] / 1000:>9.1f}"
                     + (f"  stopped: {t['stopped']}" if t.get("stopped") else ""))
    if d["dry_run"]:
        lines.append("(dry run: what a real run would re-encrypt and leave; nothing was written, the backlog is"
                     " all still there)")
    for name, t in d["targets"].items():
        if t.get("error"):
            lines.append(f"  {name}: {t['error']}")
        for note in t.get("notes", []):
            lines.append(f"  {name}: note: {note}")
        for f in t.get("failed_rows", [])[:10]:
            lines.append(f"  {name}: row {f['id']} left unchanged ({f['reason']}: {', '.join(f['columns'])})")
    verified = d["verified"]
    if verified:
        sampled = sum(v.get("sampled", 0) for v in verified.values())
        ok = sum(v.get("decrypted", 0) for v in verified.values())
        lines += ["", f"verified: {ok} of {sampled} re-encrypted rows re-read and decrypted under key {d['current_key']}"]
    for key, g in d["gate"].items():
        blocking = ", ".join(f"{c}={n}" for c, n in g["blocking"].items())
        lines.append(f"gate for key {key} (every configured target and tenant): "
                     + ("OPEN: nothing references it any more" if g["open"] else f"closed ({blocking})")
                     + (f"; outside the targets: {', '.join(g['outside_targets'])}" if g.get("outside_targets") else ""))
        if g.get("reason"):
            lines.append(f"  {g['reason']}")
        if g.get("slice"):
            lines.append(f"  {slice_line(g['slice'], key)}")
    if d.get("stopped") == "cancelled":
        lines.append("stopped between batches: everything committed stays; the next run resumes")
    return "\n".join(lines)


def _count_labels(dry_run: bool) -> tuple[str, str]:
    """Column titles: a dry run's "backlog left 0" must not read as "done"."""
    return ("would re-encrypt", "would be left") if dry_run else ("re-encrypted", "backlog left")


def fail_closed_summary(d: dict[str, Any]) -> str:
    """Which targets failed closed and why, by name and count only (never a row id or a value)."""
    parts = []
    for name, t in d["targets"].items():
        if t.get("stopped") in (STOP_KEY_MISMATCH, STOP_KEY_UNAVAILABLE, STOP_DB_ERROR, STOP_THROTTLE_CRITICAL):
            parts.append(f"{name} stopped ({t['stopped']})")
        if t["failed"]:
            parts.append(f"{name}: {t['failed']} rows left unchanged")
        if t["conflicts"]:
            parts.append(f"{name}: {t['conflicts']} conflicts")
    unverified = [n for n, v in d["verified"].items() if not v.get("ok", True)]
    if unverified:
        parts.append(f"verification failed for {', '.join(unverified)}")
    return "; ".join(parts) or f"exit code {d['exit_code']}"


def gate_markdown(d: dict[str, Any]) -> str:
    """The run report as a Markdown artifact: counts, names and the gate per older key. Never a value."""
    lines = [f"# pinrotate run `{d['run_id']}`", "",
             f"Current key: **{d['current_key']}**" + (" (dry run)" if d["dry_run"] else ""), "",
             "| target | {} | failed | conflicts | {} | batches | ms |".format(*_count_labels(d["dry_run"])),
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, t in d["targets"].items():
        lines.append(f"| {name} | {t['reencrypted']} | {t['failed']} | {t['conflicts']} | "
                     f"{t['backlog_remaining']} | {t['batches']} | {t['duration_ms']} |")
    notes = [f"- {name}: {note}" for name, t in d["targets"].items() for note in t.get("notes", [])]
    if notes:
        lines += ["", "Notes:", "", *notes]
    lines += ["", "## Retire gate", "", "| key | gate | blocking |", "|---|---|---|"]
    for key, g in d.get("gate", {}).items():
        blocking = ", ".join(f"{c} {n}" for c, n in g["blocking"].items()) or "nothing"
        if g.get("outside_targets"):
            blocking += f" ({', '.join(f'`{name}`' for name in g['outside_targets'])})"
        lines.append(f"| {key} | {'OPEN' if g['open'] else 'closed'} | {blocking} |")
    if not d.get("gate"):
        lines.append("| (no older key in the keyring) | | |")
    lines += ["", "The gate is decided over every configured target and tenant, whatever the run's filters."]
    lines += [f"- key {key}: {slice_line(g['slice'], key)}" for key, g in d.get("gate", {}).items() if g.get("slice")]
    return "\n".join(lines) + "\n"


def slice_line(part: dict[str, Any], key: str) -> str:
    """A filter's slice of the gate for KEY, one line, labelled as not deciding."""
    where = f"tenant {part['tenant']}" if part.get("tenant") is not None else "the targets asked for"
    counts = "; ".join(f"{name}: {t['on_key']} on key {key}" + (f", {t['excluded_on_key']} excluded"
                                                                 if t["excluded_on_key"] else "")
                       for name, t in part["targets"].items())
    return f"slice of {where} (shown only, does not decide): {counts or 'no target'}"


def settled_tail(durability: dict[str, Any]) -> str:
    """What an open gate waited for, as the tail of its durability line."""
    waited = durability.get("in_flight", {}).get("waited_for", 0)
    standbys = len(durability.get("standbys", {}).get("flushed", []))
    return (f"; waited for {waited} transaction(s) in flight" if waited else "") + \
        (f"; {standbys} standby(s) flushed past it" if standbys else "")


def gate_summary(d: dict[str, Any]) -> str:
    """``gate --retire KEY`` for people: the verdict over everything configured, what blocks it where,
    what destroying KEY erases, and the filter's slice (labelled as not deciding)."""
    key = d["key"]
    excluded = d.get("excluded_on_key", {})
    erased = sum(sum(rules.values()) for rules in excluded.values())
    by_rule = "; ".join(f"{name}: " + ", ".join(f"{r}={n}" for r, n in rules.items())
                        for name, rules in excluded.items())
    if d["open"]:
        if erased:
            only = f"gate for key {key}: OPEN (--erase-excluded). Only excluded rows still reference it"
            lines = [f"{only}; destroying it ERASES {erased} excluded values ({by_rule})."]
        else:
            opened = f"gate for key {key}: OPEN. Nothing in any configured target or tenant references it"
            lines = [f"{opened}; it may be destroyed."]
        if d.get("durability", {}).get("wal_flush_lsn"):
            lines.append(f"(what it read is on disk: WAL flushed to {d['durability']['wal_flush_lsn']}"
                         f"{settled_tail(d['durability'])})")
    else:
        blocking = ", ".join(f"{c}={n}" for c, n in d["blocking"].items() if n)
        lines = [f"gate for key {key}: CLOSED ({blocking}), over every configured target and tenant"]
        if d.get("durability", {}).get("reason"):
            lines.append(d["durability"]["reason"])
        for name, t in d["targets"].items():
            if t["blocking"]:
                lines.append(f"  {name}: " + ", ".join(f"{c}={n}" for c, n in t["blocking"].items())
                             + (f"  BLOCKED: {t['blocked_reason']}" if t.get("blocked_reason") else ""))
        if d["blocking"].get("EXCLUDED"):
            lines.append(f"EXCLUDED: rows no run takes (soft-deleted, require_not_null unset) "
                         f"still reference key {key} ({by_rule}); destroying it erases them. If that is intended: "
                         f"gate --retire {key} --erase-excluded")
        elif erased:
            lines.append(f"destroying it would also erase {erased} excluded values ({by_rule})")
    if d.get("slice"):
        lines.append(slice_line(d["slice"], key))
    return "\n".join(lines)


def database_named(identity: dict[str, Any]) -> dict[str, Any]:
    """The database a verdict speaks of, for the gate's JSON: host, port, database name and the
    server's own identifier (PostgreSQL's ``pg_control_system()``, MySQL's ``@@server_uuid``,
    MariaDB's ``@@server_uid``); where it cannot be read, it is left out and
    ``system_identifier_omitted`` says why."""
    out = {k: identity.get(k) for k in ("host", "port", "database", "server_version")}
    sysid = identity.get("system_identifier")
    if sysid:
        out["system_identifier"] = str(sysid)
    else:
        out["system_identifier_omitted"] = identity.get("system_identifier_omitted") or "not reported by this server"
    return out


def decided_for(database: dict[str, Any], keyring: dict[str, Any]) -> str:
    """One line: which database and which keyring a verdict was decided for."""
    where = f"{database.get('host')}" + (f":{database['port']}" if database.get("port") else "")
    sysid = (f"system identifier {database['system_identifier']}" if "system_identifier" in database
             else f"system identifier omitted: {database.get('system_identifier_omitted')}")
    return (f"decided for database {database.get('database')} on {where} ({sysid}), "
            f"keyring {keyring.get('source') or keyring.get('provider')}")


def inventory_report(d: dict[str, Any], *, deep: bool) -> str:
    lines = [f"current key {d['current_key']}" + ("  (deep: every value decrypted)" if deep else ""), "",
             f"{'target':<22}{'total':>9}" + "".join(f"{c:>12}" for c in INVENTORY_CATEGORIES)]
    for name, t in d["targets"].items():
        lines.append(f"{name:<22}{t['total']:>9}" + "".join(f"{t[c]:>12}" for c in INVENTORY_CATEGORIES))
        by_key = ", ".join(f"{k}: {n}" for k, n in t["by_key"].items())
        lines.append(f"{'':<22}by key: {by_key or '-'}"
                     + (f"  BLOCKED: {t['blocked_reason']}" if t.get("blocked_reason") else ""))
    if "discovery" in d:
        lines.append(discovery_report({**d["discovery"], "discovered": d["discovered"]}).lstrip("\n"))
    return "\n".join(lines)


def discovery_report(sweep: dict[str, Any]) -> str:
    """The sweep outside the targets for people: every find with its counts per key, what was not swept
    and what could not be read (names and counts only). Empty when there was no sweep."""
    if not sweep:
        return ""
    head = (f"outside the targets: {sweep['tables_swept']} tables, {sweep['columns_swept']} columns swept "
            f"in {sweep['seconds']:.1f} s")
    lines = ["", head]
    for f in sweep["discovered"]:
        counts = ", ".join(f"{k}: {n}" for k, n in f["by_key"].items())
        how = f" (of {f['tried']} values tried)" if f["method"] == "trial" else ""
        lines.append(f"  {f['column']:<40} {counts}{how}")
    if not sweep["discovered"]:
        lines.append("  no ciphertext found")
    lines += [f"  UNREADABLE: {why}" for why in sweep["unreadable"].values()]
    lines += [f"  UNSWEPT: {name}: {why}" for name, why in sweep.get("unswept", {}).items()]
    lines += [f"  not swept: {name} ({why})" for name, why in sweep["not_swept"].items()]
    return "\n".join(lines)


def demo_report(d: dict[str, Any]) -> str:
    """The demo's longer summary: the run report, then the deep inventory and the gate for key 1."""
    demo = d["demo"]
    after = demo["inventory_after"]["targets"]

    def total(category: str) -> int:
        return sum(t[category] for t in after.values())

    return run_report(d) + "\n\n" + (
        f"inventory after (deep): {total('ACTIVE')} rows on key 2, {total('HISTORICAL')} left on key 1, "
        f"{total('FAILED')} failed, {total('EXCLUDED')} drafts excluded\n"
        f"gate --retire 1: {'OPEN: key 1 may be destroyed' if demo['gate_key_1']['open'] else 'closed'}")
