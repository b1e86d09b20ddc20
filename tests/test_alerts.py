"""deploy/alerts.yml: valid for Prometheus (``promtool check rules``), firing and not firing as its
unit tests say (``promtool test rules deploy/alerts_test.yml``), and built on metrics that
RotationMetrics really exports.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pinrotate_core.metrics import DEFAULT_PREFIX, RotationMetrics

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
ALERTS = DEPLOY / "alerts.yml"
ALERTS_TEST = DEPLOY / "alerts_test.yml"
RUNBOOK_ANCHORS = {
    "PinrotateKeyErrors": "docs/runbook.md#key-errors",
    "PinrotateBacklogNotConverging": "docs/runbook.md#backlog-not-converging",
    "PinrotateNoSuccessfulRun": "docs/runbook.md#no-successful-run",
}


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("promtool")
    if binary is None:
        pytest.fail("promtool is not installed: run `bash scripts/ensure-ops-tools.sh` (as root) first")
    return subprocess.run([binary, *args], cwd=DEPLOY.parent, capture_output=True, text=True, timeout=120)


def _rules() -> list[dict[str, Any]]:
    document = yaml.safe_load(ALERTS.read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


def test_promtool_accepts_the_alert_rules() -> None:
    result = _promtool("check", "rules", str(ALERTS.relative_to(DEPLOY.parent)))
    assert result.returncode == 0, f"promtool check rules failed:\n{result.stdout}\n{result.stderr}"
    assert "SUCCESS" in result.stdout


def test_alert_rules_fire_and_stay_quiet_as_their_unit_tests_expect() -> None:
    result = _promtool("test", "rules", str(ALERTS_TEST.relative_to(DEPLOY.parent)))
    assert result.returncode == 0, f"promtool test rules failed:\n{result.stdout}\n{result.stderr}"
    assert "SUCCESS" in result.stdout


def test_the_three_design_alerts_exist_with_severity_and_runbook() -> None:
    rules = _rules()

    assert {rule["alert"] for rule in rules} == set(RUNBOOK_ANCHORS)
    for rule in rules:
        assert rule["labels"]["severity"] in {"critical", "warning"}, rule["alert"]
        assert rule["annotations"]["runbook_url"] == RUNBOOK_ANCHORS[rule["alert"]]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_alert_rules_use_only_metrics_that_a_run_exports() -> None:
    metrics = RotationMetrics()
    metrics.set_progress("Person", 1)
    metrics.add_processed("Person", 1)
    metrics.observe_run_duration_ms(1.0)
    metrics.set_current_key("2")
    metrics.mark_success()
    exported = {
        sample.name
        for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
        for sample in family.samples
    }

    used = {
        name
        for rule in _rules()
        for name in re.findall(rf"\b{DEFAULT_PREFIX}_[a-z_]+", rule["expr"])
    }

    assert used, "the rules name no pinrotate metric"
    assert used <= exported, f"rules use metrics nobody exports: {sorted(used - exported)}"


def test_every_alert_has_a_unit_test_that_fires_it_and_one_that_does_not() -> None:
    document = yaml.safe_load(ALERTS_TEST.read_text())
    firing: set[str] = set()
    quiet: set[str] = set()
    for case in document["tests"]:
        for check in case["alert_rule_test"]:
            (firing if check["exp_alerts"] else quiet).add(check["alertname"])

    assert firing == set(RUNBOOK_ANCHORS)
    assert quiet == set(RUNBOOK_ANCHORS)
