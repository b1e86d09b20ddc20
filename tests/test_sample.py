"""``python -m flows.sample``: the Pin profile sample in the database a configuration names, once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.pinprofile import REPO, PinProfile, write_config


def _sample(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flows.sample", "--config", str(config), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=180, check=False)


def test_the_sample_loads_rows_under_the_current_key_and_refuses_a_database_that_has_them(
        database_url: str, tmp_path: Path) -> None:
    keys_file = tmp_path / "keys" / "keys.toml"
    config = write_config(tmp_path / "pinrotate.toml", database_url, keys_file)
    done = _sample(config, "--rows", "40")
    assert done.returncode == 0, done.stderr
    assert "under key 1: 40 profile.persons, 20 profile.person_documents" in done.stdout
    profile = PinProfile(database_url, config, keys_file, summary=None)  # type: ignore[arg-type]
    assert profile.key_versions("persons") == {1: 40}
    # A second time: the database already holds the tables; one line, exit 2, nothing added.
    again = _sample(config, "--rows", "40")
    assert again.returncode == 2
    assert again.stderr.strip().splitlines() == [again.stderr.strip()]
    assert "already holds profile.persons" in again.stderr and "Traceback" not in again.stderr
    assert profile.key_versions("persons") == {1: 40}
