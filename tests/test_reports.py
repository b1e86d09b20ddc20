"""Reports that say what happened (issue 23): shard results folded field by field, a retried shard's
first failure forgotten once a retry got through, a cancelled target's real counts, elapsed time,
a dry run that does not read as "done", and a backlog counted again where the shards could not.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any, cast
from uuid import UUID

import psycopg
import pytest

from flows import reports
from flows.flow import ShardDrains, _recount
from flows.runtime import RunProgress
from flows.tasks import FOLDED_FIELDS, RunSpec, merge_attempts, merge_shards
from pinrotate_core import rotation
from pinrotate_core.drain import STOP_CANCELLED, STOP_DB_ERROR, DrainResult
from pinrotate_core.schemes.base import FailedRow
from tests.pinprofile import seed_profile, write_config


def _result(**values: Any) -> DrainResult:
    return DrainResult("Person", "2", **values)


def test_every_field_of_a_drain_result_is_folded_by_name_never_by_its_type() -> None:
    assert FOLDED_FIELDS == {f.name for f in dataclasses.fields(DrainResult)}


def test_shards_add_their_counts_and_the_most_serious_stop_keeps_its_own_message() -> None:
    row = FailedRow("Person", "7", ("first_name_cipher",), "decrypt_failed")
    merged = merge_shards([
        _result(reencrypted=10, batches=2, backlog_before=12, backlog_remaining=1, failed=[row],
                counts={"unknown": 1}, stopped=STOP_CANCELLED, error="cancelled at a batch boundary"),
        _result(reencrypted=5, batches=1, backlog_before=9, backlog_remaining=4, failed=[row],
                counts={"unknown": 2}, stopped=STOP_DB_ERROR, error="target Person: connection lost", retryable=True),
    ])
    assert (merged.reencrypted, merged.batches, merged.backlog_before, merged.backlog_remaining) == (15, 3, 21, 5)
    assert merged.failed == [row] and merged.counts == {"unknown": 3}
    assert (merged.stopped, merged.error, merged.retryable) == (STOP_DB_ERROR, "target Person: connection lost", True)


def test_a_retried_shards_first_failure_does_not_survive_the_retry_that_finished_it() -> None:
    first = _result(reencrypted=40, batches=4, backlog_before=100, backlog_remaining=60, stopped=STOP_DB_ERROR,
                    error="target Person: terminating connection due to administrator command", retryable=True,
                    counts={"legacy_left": 3, "settled_elsewhere": 1})
    second = _result(reencrypted=60, batches=6, backlog_before=60, backlog_remaining=0,
                     counts={"legacy_left": 3, "settled_elsewhere": 2})
    merged = merge_attempts([first, second])
    assert (merged.stopped, merged.error, merged.retryable) == (None, None, False)
    assert not merged.fail_closed
    assert (merged.reencrypted, merged.batches, merged.backlog_before, merged.backlog_remaining) == (100, 10, 100, 0)
    # Values left in place are passed by both attempts; events add up.
    assert merged.counts == {"legacy_left": 3, "settled_elsewhere": 3}


def test_an_unrecorded_conflict_of_an_earlier_attempt_still_fails_closed() -> None:
    first = _result(conflicts=2, conflicts_by_tenant={"": 2}, stopped=STOP_DB_ERROR, retryable=True,
                    state_error="the CONFLICT counts could not be recorded: the database was unreachable")
    assert merge_attempts([first, _result()]).fail_closed
    clean = dataclasses.replace(first, conflicts=0, conflicts_by_tenant={})
    assert merge_attempts([clean, _result()]).state_error is None


def _drains(plan: list[dict[str, Any]], spec: RunSpec | None = None) -> ShardDrains:
    spec = spec or RunSpec(config_path=None, run_id=str(uuid.uuid4()), current_key="2")
    return ShardDrains(spec, plan, cast(RunProgress, None))  # progress is used only while collecting


def _plan(*rows: int, exact: bool = True) -> list[dict[str, Any]]:
    return [{"target": "Person", "shard": f"{i}/{len(rows)}", "id_range": None, "rows": n, "exact": exact}
            for i, n in enumerate(rows, start=1)]


def test_a_cancelled_target_reports_what_its_shards_moved_and_how_many_never_started() -> None:
    drains = _drains(_plan(100, 100, 100, 100))
    first, second, *_ = drains.shards
    first.result = _result(reencrypted=60, backlog_before=100, backlog_remaining=40, stopped=STOP_CANCELLED)
    second.result = _result(reencrypted=30, backlog_before=100, backlog_remaining=70, stopped=STOP_CANCELLED)
    first.started = second.started = first.counted = second.counted = True
    first.started_at, first.ended_at, second.started_at, second.ended_at = 1000.0, 1003.0, 1001.0, 1009.5
    first.result.duration_ms, second.result.duration_ms = 3000.0, 8500.0
    person = drains.by_target()["Person"]
    assert person.reencrypted == 90 and person.backlog_remaining == 40 + 70 + 100 + 100
    assert person.stopped == STOP_CANCELLED
    assert person.error == "cancelled before 2 of 4 shards started; their rows stay for the next run"
    assert person.duration_ms == pytest.approx(9500.0)  # first start to last end, not the longest shard (8.5 s)
    assert drains.uncounted_targets() == []  # the shards that never ran were planned from a count


def test_a_target_none_of_whose_shards_started_says_so() -> None:
    person = _drains(_plan(5, 5)).by_target()["Person"]
    assert person.error == "cancelled before it started" and person.reencrypted == 0


def test_the_dry_run_table_says_would_be_left_not_backlog_left() -> None:
    report = rotation.RunReport("r", "2", dry_run=True)
    report.targets = {"Person": _result(reencrypted=12, backlog_before=12, backlog_remaining=0, dry_run=True)}
    text = reports.run_report(report.as_dict())
    assert "would re-encrypt" in text and "would be left" in text and "backlog left" not in text
    assert "nothing was written" in text
    assert "would be left" in reports.gate_markdown(report.as_dict())
    report.dry_run = False
    assert "backlog left" in reports.run_report(report.as_dict())


def test_notes_reach_the_human_report_the_json_and_the_markdown() -> None:
    report = rotation.RunReport("r", "2", dry_run=False)
    note = "shard 1/2 ran again after the worker running it was lost"
    report.targets = {"Person": _result(reencrypted=3, notes=[note])}
    doc = report.as_dict()
    assert doc["targets"]["Person"]["notes"] == ["shard 1/2 ran again after the worker running it was lost"]
    assert "Person: note: shard 1/2 ran again" in reports.run_report(doc)
    assert "- Person: shard 1/2 ran again" in reports.gate_markdown(doc)


# -- against the real database: the backlog left is counted again where the shards could not ------------


def test_a_backlog_the_shards_could_not_count_is_counted_again_from_the_database(
        primary_database_url: str, tmp_path: Path, log_lines: list[str], prefect_api: str) -> None:
    profile = seed_profile(primary_database_url, tmp_path, rows=120)
    spec = RunSpec(config_path=str(profile.config_path), run_id=str(uuid.uuid4()), current_key="2")
    drains = _drains(_plan(60, 60), spec)
    for s in drains.shards:
        # As after an outage: every attempt stopped before it could count; the figure is the plan's.
        s.result = _result(backlog_before=60, backlog_remaining=60, stopped=STOP_DB_ERROR, error="outage")
        s.started = True
    report = rotation.RunReport(spec.run_id, "2", dry_run=False)
    report.targets = drains.by_target()
    assert report.targets["Person"].backlog_remaining == 120
    # Meanwhile 20 rows moved (a run before the outage did): the report must say 100, not 120.
    with psycopg.connect(primary_database_url, autocommit=True) as conn:
        conn.execute("UPDATE profile.persons SET key_version = 3 WHERE id IN "
                     "(SELECT id FROM profile.persons ORDER BY id LIMIT 20)")
    _recount(spec, report, drains.uncounted_targets())
    assert report.targets["Person"].backlog_remaining == profile.key_versions("persons")[1] == 100
    assert report.targets["Person"].notes == []


def test_a_backlog_that_cannot_be_counted_again_keeps_the_shards_figure_and_says_so(
        primary_database_url: str, tmp_path: Path, log_lines: list[str], prefect_api: str) -> None:
    profile = seed_profile(primary_database_url, tmp_path, rows=40)
    with socket.socket() as s:  # a port nobody listens on: the database is gone at the end of the run
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = write_config(tmp_path / "gone.toml", f"postgresql://postgres@127.0.0.1:{port}/x", profile.keys_file)
    spec = RunSpec(config_path=str(config), run_id=str(uuid.uuid4()), current_key="2")
    drains = _drains(_plan(40), spec)
    drains.shards[0].result = _result(backlog_before=40, backlog_remaining=40, stopped=STOP_DB_ERROR, error="outage")
    drains.shards[0].started = True
    report = rotation.RunReport(spec.run_id, "2", dry_run=False)
    report.targets = drains.by_target()
    _recount(spec, report, drains.uncounted_targets())
    person = report.targets["Person"]
    assert person.backlog_remaining == 40
    assert person.notes == [("backlog left is the shards' last figure: the database could not be counted at the "
                             "end of the run")]
    assert any("event=report_note" in line and "target=Person" in line for line in log_lines)


class _SlowEarlyWrites(RunProgress):
    """The watch thread's write of an older share reaches the API after a shard's end was counted:
    what a loaded machine did in CI, made certain by a pause before every write under 100 %."""

    def _update(self, **fields: Any) -> None:
        if fields.get("progress", 100.0) < 100.0:
            time.sleep(0.6)
        super()._update(**fields)


def test_the_progress_artifact_ends_at_the_latest_share_when_a_periodic_write_and_a_shard_end_cross(
        prefect_api: str) -> None:
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterId

    @flow(persist_result=False)
    def crossing() -> UUID:  # in a flow run, as the run's progress always is
        progress = _SlowEarlyWrites(str(uuid.uuid4()), "2", total=20)
        assert progress.artifact_id is not None
        progress.batch("Person", 10)
        watch = threading.Thread(target=progress.publish)  # reads 50 %, then takes its time to write it
        watch.start()
        time.sleep(0.1)
        progress.advance(20, target="Person")  # the only shard ended: 100 %
        watch.join()
        return progress.artifact_id

    artifact_id = crossing()
    with get_client(sync_client=True) as client:
        stored = client.read_artifacts(artifact_filter=ArtifactFilter(id=ArtifactFilterId(any_=[artifact_id])))
    assert [float(a.data) for a in stored] == [100.0]


def test_the_runs_own_polls_use_a_client_of_their_own_not_the_task_runs(prefect_api: str) -> None:
    """In a task run, ``get_client`` hands out the run's client: a watch polling with it used the
    run's retries, and once the task closed it the next poll raised "cannot be started again after
    closing" and ended the watch (seen on a Dask worker). The polls make their own."""
    from prefect import flow
    from prefect.context import SyncClientContext
    from prefect.settings import PREFECT_API_REQUEST_TIMEOUT, PREFECT_CLIENT_MAX_RETRIES

    from flows.api_watch import API_POLL_TIMEOUT_S, polling_client

    @flow(persist_result=False)
    def probe() -> tuple[bool, bool, float, int]:
        run_ctx = SyncClientContext.get()
        assert run_ctx is not None, "the flow engine sets the run's client"
        with polling_client() as client:
            own = client is not run_ctx.client
            timeout = client._client.timeout.read
            retries = PREFECT_CLIENT_MAX_RETRIES.value()
        after = SyncClientContext.get()
        return own, after is run_ctx and not run_ctx.client._closed, float(timeout or 0), retries

    own, run_client_kept, timeout, retries = probe()
    assert own and run_client_kept
    assert (timeout, retries) == (API_POLL_TIMEOUT_S, 0)
    assert PREFECT_API_REQUEST_TIMEOUT.value() != API_POLL_TIMEOUT_S  # the bound stayed inside the poll

    # The run's client closed (its task ended) while the context still names it: a poll still works.
    with SyncClientContext.get_or_create() as ctx:
        closed = ctx.client
    assert closed._closed
    token = SyncClientContext.__var__.set(ctx)
    try:
        with polling_client() as client:
            assert client is not closed and client.api_healthcheck() is None
    finally:
        SyncClientContext.__var__.reset(token)
