"""The gate record: the value-free evidence kept with the change ticket before a key is destroyed.

Names, counts and the verdict only; never a key, a value or anything derived from one.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .._files import write_atomically
from ..config import pinrotate_home
from ..errors import ConfigError
from .verdict import GateReport, application_version

RECORD_KIND = "pinrotate gate record"
TICKET_PATTERN = re.compile(r"[^\x00-\x1f\x7f]{1,200}")


def check_ticket(ticket: str) -> str:
    """A change ticket reference: one line of printable text, at most 200 characters."""
    if not TICKET_PATTERN.fullmatch(ticket) or not ticket.strip():
        raise ConfigError("--ticket: must be one line of 1 to 200 printable characters")
    return ticket.strip()


def gate_record(report: GateReport, *, ticket: str | None, recorded_at: datetime) -> dict[str, Any]:
    """The value-free evidence Forge's runbook asks to keep with the change ticket before a key is
    deleted: when, where (database identity), by what (pinrotate's version), on which keyring
    (its source, never its material), over which tenants, the counts per target, and the verdict;
    with ``--erase-excluded``, that the operator accepted erasing the EXCLUDED values still on KEY,
    per target and scope rule."""
    as_dict = report.as_dict()
    return {
        "record": RECORD_KIND,
        "ticket": ticket,
        "recorded_at": recorded_at.isoformat(timespec="seconds"),
        "key": report.key,
        "verdict": "open" if report.open else "closed",
        "open": report.open,
        "blocking": {c: n for c, n in report.blocking.items() if n},
        "verdict_over": as_dict["verdict_over"],
        "erase_excluded": report.erase_excluded,
        "excluded_on_key": as_dict["excluded_on_key"],
        "current_key": report.current_key,
        "database": report.database,
        "pinrotate_version": application_version(),
        "keyring_source": report.keyring_source,
        "scope": report.scope,
        "tenants": as_dict["tenants"],
        "targets": {name: {**report.counts.get(name, {}), "gate": gate}
                    for name, gate in report.targets.items()},
        "discovery": report.discovery,
        **({"slice": report.slice} if report.slice is not None else {}),
        # What an open (or settling) gate waited for: transactions in flight, WAL flush, standbys.
        "settled": report.durability,
    }


def write_gate_record(report: GateReport, *, ticket: str | None, path: str | None) -> Path:
    """Write the change-ticket record atomically; the default path is under $PINROTATE_HOME/records."""
    now = datetime.now(UTC)
    record = gate_record(report, ticket=ticket, recorded_at=now)
    if path is None:
        key, slug = (re.sub(r"[^A-Za-z0-9_-]+", "_", text)[:64] for text in (report.key, ticket or "no-ticket"))
        target = pinrotate_home() / "records" / f"gate-{key}-{slug}-{now:%Y%m%dT%H%M%SZ}.json"
    else:
        target = Path(path).expanduser()
        if not target.parent.is_dir():
            raise ConfigError(f"--record: folder {target.parent} does not exist")
    try:
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_atomically(target, json.dumps(record, indent=2) + "\n")
    except OSError as e:
        raise ConfigError(f"--record: cannot write {target} ({e.strerror})") from None
    return target
