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
        lines.append(f"gate for key {key}: " + ("OPEN: nothing references it any more" if g["open"]
                                               else f"closed ({blocking})"))
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
        if t.get("stopped") in (STOP_KEY_UNAVAILABLE, STOP_DB_ERROR, STOP_THROTTLE_CRITICAL):
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
        lines.append(f"| {key} | {'OPEN' if g['open'] else 'closed'} | {blocking} |")
    if not d.get("gate"):
        lines.append("| (no older key in the keyring) | | |")
    return "\n".join(lines) + "\n"


def inventory_report(d: dict[str, Any], *, deep: bool) -> str:
    lines = [f"current key {d['current_key']}" + ("  (deep: every value decrypted)" if deep else ""), "",
             f"{'target':<22}{'total':>9}" + "".join(f"{c:>12}" for c in INVENTORY_CATEGORIES)]
    for name, t in d["targets"].items():
        lines.append(f"{name:<22}{t['total']:>9}" + "".join(f"{t[c]:>12}" for c in INVENTORY_CATEGORIES))
        by_key = ", ".join(f"{k}: {n}" for k, n in t["by_key"].items())
        lines.append(f"{'':<22}by key: {by_key or '-'}"
                     + (f"  BLOCKED: {t['blocked_reason']}" if t.get("blocked_reason") else ""))
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
