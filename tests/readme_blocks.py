"""The README's shell blocks that tests run as written, each found by the marker before it.

``own_database_block``: "Trying it on your own database" (copy the example configuration, seed the
sample, add and promote a key, inventory, run, gate). tests/test_readme_walkthrough.py runs it as a
reader's first block, before the deployment walkthrough in the same shell, and checks what it left.
The deployment, Forge and Forge-on-MySQL walkthroughs are read by their own tests' modules.
"""

from __future__ import annotations

import re

from tests.pinprofile import REPO

OWN_DATABASE = "<!-- walkthrough: own-database -->"


def readme_block(marker: str) -> str:
    """The ```sh block that follows ``marker`` in README.md, as written."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    match = re.search(re.escape(marker) + r"\s*```sh\n(.*?)\n```", text, re.DOTALL)
    assert match, f"README.md has no ```sh block after {marker}"
    return match.group(1)


def own_database_block() -> str:
    return readme_block(OWN_DATABASE)
