"""Command-line parsing (contract §4): global options before or after the command, `run` by default,
and a usage error answered on stdout as JSON when --json is given."""

from __future__ import annotations

import json

import pytest

from flows.cli import UsageError, parse_args

from .pinprofile import cli


@pytest.mark.parametrize("argv", [
    ["--config", "x.toml", "inventory"],
    ["inventory", "--config", "x.toml"],
    ["--config=x.toml", "inventory"],
    ["--json", "--config", "x.toml", "inventory"],
])
def test_global_options_are_accepted_before_or_after_the_command(argv: list[str]) -> None:
    ns = parse_args(argv)
    assert ns.command == "inventory" and ns.config == "x.toml"
    assert ns.json is ("--json" in argv)


def test_options_before_a_nested_command_reach_it() -> None:
    ns = parse_args(["--json", "--config", "k.toml", "keys", "add", "--id", "k9"])
    assert (ns.command, ns.keys_command, ns.key_id, ns.config, ns.json) == ("keys", "add", "k9", "k.toml", True)
    ns = parse_args(["--config", "g.toml", "gate", "--retire", "1", "--ticket", "CHG-1"])
    assert (ns.command, ns.retire, ns.ticket, ns.config) == ("gate", "1", "CHG-1", "g.toml")


@pytest.mark.parametrize(("argv", "config", "dry_run"), [
    ([], None, False),
    (["--json"], None, False),
    (["--config", "x", "--dry-run"], "x", True),
    (["--dry-run", "--config=x"], "x", True),
    (["--config", "x"], "x", False),
])
def test_run_stays_the_default_command(argv: list[str], config: str | None, dry_run: bool) -> None:
    ns = parse_args(argv)
    assert (ns.command, ns.config, ns.dry_run, ns.json) == ("run", config, dry_run, "--json" in argv)


def test_a_usage_error_raises_instead_of_exiting() -> None:
    with pytest.raises(UsageError) as excinfo:
        parse_args(["--config", "x", "inventory", "extra"])
    assert "unrecognized arguments: extra" in excinfo.value.message


@pytest.mark.parametrize(("argv", "named"), [
    (["gate", "--json"], "the following arguments are required: --retire"),
    (["--json", "inventory", "--no-such-option"], "unrecognized arguments: --no-such-option"),
    (["--json", "no-such-command"], "invalid choice: 'no-such-command'"),
    (["--json", "demo", "--rows", "many"], "invalid int value: 'many'"),
])
def test_a_usage_error_with_json_prints_the_error_document_on_stdout(argv: list[str], named: str) -> None:
    code, out, err = cli(*argv, check_json=False)
    assert code == 2
    lines = out.splitlines()
    assert len(lines) == 1
    doc = json.loads(lines[0])
    assert set(doc) == {"error", "exit_code"} and doc["exit_code"] == 2 and named in doc["error"]
    assert "usage:" in err and named in err


def test_a_usage_error_without_json_prints_nothing_on_stdout() -> None:
    code, out, err = cli("gate", check_json=False)
    assert code == 2 and out == "" and "--retire" in err


def test_the_config_option_before_the_command_is_used() -> None:
    code, doc, err = cli("--config", "/nonexistent/pinrotate.toml", "--json", "inventory")
    assert code == 2 and doc == {"error": "configuration file not found: /nonexistent/pinrotate.toml",
                                 "exit_code": 2}
    assert "unrecognized arguments" not in err


@pytest.mark.parametrize("ticket", ["", "two\nlines", "x" * 201])
def test_a_ticket_that_is_not_one_short_line_is_refused(ticket: str) -> None:
    code, doc, _ = cli("gate", "--retire", "1", "--ticket", ticket, "--config", "/nonexistent.toml", "--json")
    assert code == 2 and doc["error"] == "--ticket: must be one line of 1 to 200 printable characters"
