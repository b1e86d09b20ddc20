"""RotationMetrics against a real Prometheus Pushgateway (Debian's ``prometheus-pushgateway``,
started here on a free loopback port, no persistence) and the node_exporter textfile format.

What is pushed is scraped back from the gateway's /metrics and parsed with prometheus_client's
own parser, so names, labels and values are checked as Prometheus would see them.
"""

from __future__ import annotations

import base64
import logging
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import prometheus_client
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pinrotate_core.config import MetricsSettings
from pinrotate_core.metrics import (
    DEFAULT_PREFIX,
    ERROR_REASONS,
    RUN_DURATION_BUCKETS_MS,
    THROTTLE_REASONS,
    RotationMetrics,
)

# xdist: every test of this module on one worker (one Pushgateway (with and without auth) for the module).
pytestmark = pytest.mark.xdist_group("test_metrics")

PUSHGATEWAY = "prometheus-pushgateway"
P = DEFAULT_PREFIX
# bcrypt (cost 4) of AUTH_PASSWORD, for the gateway's --web.config.file basic_auth_users.
AUTH_USER = "pinrotate"
AUTH_PASSWORD = "metrics-push-test"
AUTH_HASH = "$2b$04$abcdefghijklmnopqrstuu4QnpKQR1UppdpSV4ERZLRV1l9sAF5FS"
# Readiness is polled, never asserted on time; this bound only stops a broken binary hanging CI.
_START_LIMIT_S = 30.0

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Pushgateway:
    url: str
    process: subprocess.Popen[bytes]

    def scrape(self, auth: tuple[str, str] | None = None) -> str:
        request = urllib.request.Request(self.url + "/metrics")
        if auth is not None:
            token = base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
            request.add_header("Authorization", f"Basic {token}")
        with urllib.request.urlopen(request, timeout=10) as response:
            return str(response.read().decode("utf-8"))


def _start_pushgateway(workdir: Path, web_config: Path | None = None) -> Pushgateway:
    binary = shutil.which(PUSHGATEWAY)
    if binary is None:
        pytest.fail(f"{PUSHGATEWAY} is not installed: run `bash scripts/ensure-ops-tools.sh` (as root) first")
    for _attempt in range(3):  # another process may take the free port between probe and bind
        port = _free_loopback_port()
        args = [binary, f"--web.listen-address=127.0.0.1:{port}", "--persistence.file=", "--log.level=warn"]
        if web_config is not None:
            args.append(f"--web.config.file={web_config}")
        process = subprocess.Popen(args, cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   start_new_session=True)
        gateway = Pushgateway(f"http://127.0.0.1:{port}", process)
        if _wait_ready(gateway):
            return gateway
        _stop(gateway)
    pytest.fail(f"{PUSHGATEWAY} did not start on a loopback port")


def _wait_ready(gateway: Pushgateway) -> bool:
    deadline = time.monotonic() + _START_LIMIT_S
    while time.monotonic() < deadline:
        if gateway.process.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(gateway.url + "/-/ready", timeout=2):
                return True
        except urllib.error.HTTPError:
            return True  # it answers (401 behind basic auth): it is up
        except OSError:
            time.sleep(0.05)
    return False


def _stop(gateway: Pushgateway) -> None:
    if gateway.process.poll() is None:
        gateway.process.terminate()
        try:
            gateway.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            gateway.process.kill()
            gateway.process.wait()


@pytest.fixture(scope="module")
def pushgateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pushgateway]:
    gateway = _start_pushgateway(tmp_path_factory.mktemp("pushgateway"))
    yield gateway
    _stop(gateway)


@pytest.fixture(scope="module")
def pushgateway_with_auth(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pushgateway]:
    workdir = tmp_path_factory.mktemp("pushgateway-auth")
    web_config = workdir / "web.yml"
    web_config.write_text(f"basic_auth_users:\n  {AUTH_USER}: {AUTH_HASH}\n")
    gateway = _start_pushgateway(workdir, web_config)
    yield gateway
    _stop(gateway)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def pinrotate_log() -> Iterator[_Records]:
    # Attached to the "pinrotate" logger itself: configure_stderr_logging() turns propagation off.
    handler = _Records()
    logger = logging.getLogger("pinrotate")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old_level)


def _samples(text: str, job: str | None = None) -> Samples:
    """Samples as {(name, labels): value}; with ``job``, only that Pushgateway group, with the
    gateway's own ``job``/``instance`` labels and its ``push_*`` bookkeeping left out."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if job is not None:
                if s.labels.get("job") != job or s.name.startswith("push_"):
                    continue
                labels = {k: v for k, v in s.labels.items() if k not in ("job", "instance")}
            else:
                labels = dict(s.labels)
            out[(s.name, frozenset(labels.items()))] = s.value
    return out


def _key(name: str, **labels: str) -> tuple[str, frozenset[tuple[str, str]]]:
    return (name, frozenset(labels.items()))


def _a_finished_run(prefix: str = P) -> RotationMetrics:
    metrics = RotationMetrics(prefix=prefix)
    metrics.set_current_key("2")
    metrics.set_progress("Person", 5)
    metrics.set_progress("PersonDocument", 0)
    metrics.add_processed("Person", 7)
    metrics.add_processed("Person", 7)
    metrics.add_processed("PersonDocument", 3)
    metrics.add_error("decrypt_failed", 2)
    metrics.observe_run_duration_ms(1234.5)
    metrics.mark_success(1_700_000_000.0)
    return metrics


def _expected_run_samples(prefix: str = P) -> Samples:
    expected: Samples = {
        _key(f"{prefix}_progress", target="Person"): 5.0,
        _key(f"{prefix}_progress", target="PersonDocument"): 0.0,
        _key(f"{prefix}_processed_total", target="Person"): 14.0,
        _key(f"{prefix}_processed_total", target="PersonDocument"): 3.0,
        _key(f"{prefix}_errors_total", reason="key_unavailable"): 0.0,
        _key(f"{prefix}_errors_total", reason="decrypt_failed"): 2.0,
        _key(f"{prefix}_errors_total", reason="conflict"): 0.0,
        _key(f"{prefix}_errors_total", reason="db_error"): 0.0,
        _key(f"{prefix}_run_duration_ms_count"): 1.0,
        _key(f"{prefix}_run_duration_ms_sum"): 1234.5,
        _key(f"{prefix}_last_success_timestamp_seconds"): 1_700_000_000.0,
        _key(f"{prefix}_current_key_version"): 2.0,
    }
    # Seconds the drains waited between batches, by reason: pre-initialised at 0 like the errors.
    for reason in THROTTLE_REASONS:
        expected[_key(f"{prefix}_throttled_seconds_total", reason=reason)] = 0.0
    for le in RUN_DURATION_BUCKETS_MS:
        expected[_key(f"{prefix}_run_duration_ms_bucket", le=_le(le))] = 1.0 if le >= 1234.5 else 0.0
    expected[_key(f"{prefix}_run_duration_ms_bucket", le="+Inf")] = 1.0
    return expected


def _le(bound: float) -> str:
    return prometheus_client.utils.floatToGoString(bound)


def _normalised_le(samples: Samples) -> Samples:
    """The gateway writes le="2500", the client le="2500.0": compare bucket bounds as numbers."""
    out: Samples = {}
    for (name, labels), value in samples.items():
        fixed = frozenset((k, _le(float(v)) if k == "le" and v != "+Inf" else v) for k, v in labels)
        out[(name, fixed)] = value
    return out


# --- Pushgateway ------------------------------------------------------------------------------


def test_push_exposes_contract_names_labels_and_values(pushgateway: Pushgateway) -> None:
    settings = MetricsSettings(pushgateway=pushgateway.url, job="names-labels-values")

    done = _a_finished_run().deliver(settings)

    assert done == [f"pushed to {pushgateway.url} (job names-labels-values)"]
    scraped = _normalised_le(_samples(pushgateway.scrape(), job="names-labels-values"))
    assert scraped == _normalised_le(_expected_run_samples())
    types = {f.name: f.type for f in text_string_to_metric_families(pushgateway.scrape())}
    assert types[f"{P}_progress"] == "gauge"
    assert types[f"{P}_processed"] == "counter"
    assert types[f"{P}_errors"] == "counter"
    assert types[f"{P}_run_duration_ms"] == "histogram"
    assert types[f"{P}_last_success_timestamp_seconds"] == "gauge"
    assert types[f"{P}_current_key_version"] == "gauge"


def test_next_run_replaces_targets_and_counts_of_the_previous_run(pushgateway: Pushgateway) -> None:
    settings = MetricsSettings(pushgateway=pushgateway.url, job="replace-group")
    _a_finished_run().deliver(settings)

    second = RotationMetrics()
    second.set_progress("Person", 0)
    second.add_processed("Person", 5)
    second.mark_success(1_700_000_300.0)
    second.deliver(settings)

    scraped = _samples(pushgateway.scrape(), job="replace-group")
    assert scraped[_key(f"{P}_progress", target="Person")] == 0.0
    assert _key(f"{P}_progress", target="PersonDocument") not in scraped
    assert scraped[_key(f"{P}_processed_total", target="Person")] == 5.0
    assert _key(f"{P}_processed_total", target="PersonDocument") not in scraped
    assert scraped[_key(f"{P}_errors_total", reason="decrypt_failed")] == 0.0
    assert scraped[_key(f"{P}_last_success_timestamp_seconds")] == 1_700_000_300.0
    assert _key(f"{P}_current_key_version") not in scraped  # not set in the second run


def test_failed_run_keeps_the_previous_success_time_in_the_pushgateway(pushgateway: Pushgateway) -> None:
    settings = MetricsSettings(pushgateway=pushgateway.url, job="failed-run")
    _a_finished_run().deliver(settings)

    failed = RotationMetrics()
    failed.set_progress("Person", 5)
    failed.add_error("key_unavailable")
    done = failed.deliver(settings)

    assert done == [f"pushed to {pushgateway.url} (job failed-run)"]
    scraped = _samples(pushgateway.scrape(), job="failed-run")
    assert scraped[_key(f"{P}_last_success_timestamp_seconds")] == 1_700_000_000.0
    assert scraped[_key(f"{P}_errors_total", reason="key_unavailable")] == 1.0


def test_failed_first_run_pushes_no_success_time(pushgateway: Pushgateway) -> None:
    failed = RotationMetrics()
    failed.add_error("key_unavailable")
    failed.deliver(MetricsSettings(pushgateway=pushgateway.url, job="never-succeeded"))

    scraped = _samples(pushgateway.scrape(), job="never-succeeded")
    assert scraped[_key(f"{P}_errors_total", reason="key_unavailable")] == 1.0
    assert _key(f"{P}_last_success_timestamp_seconds") not in scraped


def test_prefix_changes_every_pushed_metric_name(pushgateway: Pushgateway) -> None:
    settings = MetricsSettings(prefix="acme_rotation", pushgateway=pushgateway.url, job="other-prefix")

    _a_finished_run(prefix="acme_rotation").deliver(settings)

    scraped = _samples(pushgateway.scrape(), job="other-prefix")
    assert _normalised_le(scraped) == _normalised_le(_expected_run_samples("acme_rotation"))
    assert not any(name.startswith(P) for name, _ in scraped)


def test_labels_and_values_carry_only_target_names_and_reasons(pushgateway: Pushgateway) -> None:
    settings = MetricsSettings(pushgateway=pushgateway.url, job="label-hygiene")
    _a_finished_run().deliver(settings)

    scraped = _samples(pushgateway.scrape(), job="label-hygiene")
    for name, labels in scraped:
        label_names = {k for k, _ in labels}
        if name.endswith("_bucket"):
            assert label_names == {"le"}
        elif name.endswith(("_progress", "_processed_total")):
            assert label_names == {"target"}
            assert dict(labels)["target"] in {"Person", "PersonDocument"}
        elif name.endswith("_errors_total"):
            assert label_names == {"reason"}
            assert dict(labels)["reason"] in ERROR_REASONS
        elif name.endswith("_throttled_seconds_total"):
            assert label_names == {"reason"}
            assert dict(labels)["reason"] in THROTTLE_REASONS
        else:
            assert label_names == set(), name
    assert not any(name.endswith("_created") for name, _ in scraped)


def test_unreachable_pushgateway_returns_a_warning_and_raises_nothing(pinrotate_log: _Records) -> None:
    port = _free_loopback_port()  # nothing listens there once the probe socket is closed
    settings = MetricsSettings(pushgateway=f"http://ops:hunter2secret@127.0.0.1:{port}/?token=abc123",
                               job="unreachable")
    metrics = _a_finished_run()

    done = metrics.deliver(settings)

    assert len(done) == 1
    assert done[0].startswith(f"warning: push to http://127.0.0.1:{port}/ (job unreachable) failed:")
    warnings = [r for r in pinrotate_log.records if r.levelno == logging.WARNING]
    assert [r.pinrotate_event for r in warnings] == ["metrics_push_failed"]  # type: ignore[attr-defined]
    logged = " ".join(r.getMessage() for r in pinrotate_log.records)
    for secret in ("hunter2secret", "ops:", "abc123"):
        assert secret not in done[0]
        assert secret not in logged


def test_failed_run_against_a_gateway_that_is_down_is_one_warning(pinrotate_log: _Records) -> None:
    # Nothing is read from the gateway first: a failed run adds to the group (POST) instead.
    port = _free_loopback_port()
    failed = RotationMetrics()
    failed.add_error("key_unavailable")

    done = failed.deliver(MetricsSettings(pushgateway=f"127.0.0.1:{port}", job="down"))

    assert done[0].startswith(f"warning: push to http://127.0.0.1:{port} (job down) failed:")
    events = [r.pinrotate_event for r in pinrotate_log.records]  # type: ignore[attr-defined]
    assert events == ["metrics_push_failed"]


def test_credentials_in_the_pushgateway_url_are_sent_as_basic_auth(
    pushgateway_with_auth: Pushgateway, pinrotate_log: _Records
) -> None:
    host = pushgateway_with_auth.url.removeprefix("http://")
    settings = MetricsSettings(pushgateway=f"http://{AUTH_USER}:{AUTH_PASSWORD}@{host}", job="with-auth")
    first = _a_finished_run()
    failed = RotationMetrics()  # no success: reads the old success time back, with the same auth
    failed.add_error("conflict")

    assert first.deliver(settings) == [f"pushed to {pushgateway_with_auth.url} (job with-auth)"]
    assert failed.deliver(settings) == [f"pushed to {pushgateway_with_auth.url} (job with-auth)"]

    scraped = _samples(pushgateway_with_auth.scrape(auth=(AUTH_USER, AUTH_PASSWORD)), job="with-auth")
    assert scraped[_key(f"{P}_errors_total", reason="conflict")] == 1.0
    assert scraped[_key(f"{P}_last_success_timestamp_seconds")] == 1_700_000_000.0
    logged = " ".join(r.getMessage() for r in pinrotate_log.records)
    assert AUTH_PASSWORD not in logged


def test_wrong_pushgateway_credentials_are_a_warning(pushgateway_with_auth: Pushgateway) -> None:
    host = pushgateway_with_auth.url.removeprefix("http://")
    settings = MetricsSettings(pushgateway=f"http://{AUTH_USER}:wrong-password@{host}", job="bad-auth")
    metrics = _a_finished_run()

    done = metrics.deliver(settings)

    assert done == [f"warning: push to {pushgateway_with_auth.url} (job bad-auth) failed: HTTPError 401"]


# --- textfile ---------------------------------------------------------------------------------


def test_textfile_holds_the_same_names_labels_and_values(tmp_path: Path) -> None:
    path = tmp_path / "pinrotate.prom"

    done = _a_finished_run().deliver(MetricsSettings(textfile=str(path)))

    assert done == [f"wrote {path}"]
    assert _normalised_le(_samples(path.read_text())) == _normalised_le(_expected_run_samples())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pinrotate.prom"]  # no temp file left


def test_textfile_of_a_failed_run_keeps_the_previous_success_time(tmp_path: Path) -> None:
    path = tmp_path / "pinrotate.prom"
    _a_finished_run().deliver(MetricsSettings(textfile=str(path)))

    failed = RotationMetrics()
    failed.set_progress("Person", 5)
    failed.add_error("key_unavailable", 3)
    failed.deliver(MetricsSettings(textfile=str(path)))

    samples = _samples(path.read_text())
    assert samples[_key(f"{P}_last_success_timestamp_seconds")] == 1_700_000_000.0
    assert samples[_key(f"{P}_errors_total", reason="key_unavailable")] == 3.0
    assert _key(f"{P}_processed_total", target="Person") not in samples  # the rest is this run's


def test_textfile_prefix_changes_every_metric_name(tmp_path: Path) -> None:
    path = tmp_path / "acme.prom"

    _a_finished_run(prefix="acme_rotation").deliver(MetricsSettings(prefix="acme_rotation", textfile=str(path)))

    samples = _samples(path.read_text())
    assert _normalised_le(samples) == _normalised_le(_expected_run_samples("acme_rotation"))


def test_unwritable_textfile_returns_a_warning_and_raises_nothing(tmp_path: Path, pinrotate_log: _Records) -> None:
    path = tmp_path / "missing-folder" / "pinrotate.prom"

    done = _a_finished_run().deliver(MetricsSettings(textfile=str(path)))

    assert done == [f"warning: textfile {path} not written: FileNotFoundError errno 2"]
    assert [r.pinrotate_event for r in pinrotate_log.records] == ["metrics_textfile_failed"]  # type: ignore[attr-defined]


def test_both_destinations_are_delivered_and_reported(pushgateway: Pushgateway, tmp_path: Path) -> None:
    path = tmp_path / "pinrotate.prom"
    settings = MetricsSettings(pushgateway=pushgateway.url, textfile=str(path), job="both")

    done = _a_finished_run().deliver(settings)

    assert done == [f"pushed to {pushgateway.url} (job both)", f"wrote {path}"]


def test_nothing_configured_delivers_nothing() -> None:
    assert _a_finished_run().deliver(MetricsSettings()) == []


def test_settings_with_another_prefix_are_refused() -> None:
    with pytest.raises(ValueError, match="prefix"):
        _a_finished_run().deliver(MetricsSettings(prefix="acme_rotation"))


# --- the metrics themselves -------------------------------------------------------------------


def test_every_error_reason_starts_at_zero() -> None:
    samples = _samples(generate_latest(RotationMetrics().registry).decode())

    assert {dict(labels)["reason"]: v for (name, labels), v in samples.items() if name == f"{P}_errors_total"} == {
        reason: 0.0 for reason in ("key_unavailable", "decrypt_failed", "conflict", "db_error")
    }


def test_unknown_error_reason_is_rejected() -> None:
    metrics = RotationMetrics()
    with pytest.raises(ValueError, match="reason"):
        metrics.add_error("timeout")
    with pytest.raises(ValueError):
        metrics.add_error("conflict", -1)


@pytest.mark.parametrize("target", ["", "Person name", "x" * 65, 'Person"}', "Person\n"])
def test_anything_but_a_target_name_is_refused_as_a_label(target: str) -> None:
    metrics = RotationMetrics()
    with pytest.raises(ValueError, match="target"):
        metrics.set_progress(target, 1)
    with pytest.raises(ValueError, match="target"):
        metrics.add_processed(target, 1)


def test_negative_counts_and_durations_are_refused() -> None:
    metrics = RotationMetrics()
    with pytest.raises(ValueError):
        metrics.set_progress("Person", -1)
    with pytest.raises(ValueError):
        metrics.add_processed("Person", -1)
    with pytest.raises(ValueError):
        metrics.observe_run_duration_ms(-0.5)


def test_bad_prefix_is_refused() -> None:
    with pytest.raises(ValueError, match="prefix"):
        RotationMetrics(prefix="profile-crypto")


def test_current_key_is_exported_only_when_it_is_an_integer_version() -> None:
    metrics = RotationMetrics()
    metrics.set_current_key("7")
    assert _samples(generate_latest(metrics.registry).decode())[_key(f"{P}_current_key_version")] == 7.0

    metrics.set_current_key("k2025")  # an fpc1 key id: neither a number nor allowed in a label
    text = generate_latest(metrics.registry).decode()
    assert "current_key_version" not in text
    assert "k2025" not in text


def test_success_time_defaults_to_now_and_is_absent_before_success() -> None:
    metrics = RotationMetrics()
    assert "last_success_timestamp_seconds" not in generate_latest(metrics.registry).decode()

    before = time.time()
    metrics.mark_success()
    after = time.time()
    value = _samples(generate_latest(metrics.registry).decode())[_key(f"{P}_last_success_timestamp_seconds")]
    assert before <= value <= after


def test_run_duration_buckets_span_10_ms_to_10_minutes() -> None:
    metrics = RotationMetrics()
    metrics.observe_run_duration_ms(10.0)
    metrics.observe_run_duration_ms(600_000.0)
    metrics.observe_run_duration_ms(600_001.0)

    samples = _normalised_le(_samples(generate_latest(metrics.registry).decode()))
    assert RUN_DURATION_BUCKETS_MS[0] == 10.0 and RUN_DURATION_BUCKETS_MS[-1] == 600_000.0
    assert samples[_key(f"{P}_run_duration_ms_bucket", le=_le(10.0))] == 1.0
    assert samples[_key(f"{P}_run_duration_ms_bucket", le=_le(600_000.0))] == 2.0
    assert samples[_key(f"{P}_run_duration_ms_bucket", le="+Inf")] == 3.0


def test_each_run_has_its_own_registry_and_leaves_the_global_one_alone() -> None:
    first, second = RotationMetrics(), RotationMetrics()
    first.add_processed("Person", 3)

    assert _samples(generate_latest(first.registry).decode())[_key(f"{P}_processed_total", target="Person")] == 3.0
    assert not [name for name, _ in _samples(generate_latest(second.registry).decode()) if "processed" in name]
    assert P not in generate_latest(prometheus_client.REGISTRY).decode()


def test_counts_from_many_threads_add_up_exactly() -> None:
    metrics = RotationMetrics()

    def drain_worker() -> None:
        for _ in range(1000):
            metrics.add_processed("Person", 1)
            metrics.add_error("conflict")
            metrics.set_progress("Person", 1)

    workers = [threading.Thread(target=drain_worker) for _ in range(8)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()

    samples = _samples(generate_latest(metrics.registry).decode())
    assert samples[_key(f"{P}_processed_total", target="Person")] == 8000.0
    assert samples[_key(f"{P}_errors_total", reason="conflict")] == 8000.0
